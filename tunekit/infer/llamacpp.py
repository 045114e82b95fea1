"""llama.cpp itself, through llama-cpp-python, as the GGUF check and the GGUF quantizer.

A GGUF file is only as good as llama.cpp's reading of it (tensor names, rope layout, tokenizer
pre-split, tied output): so the exported file is loaded by llama.cpp, its logits on the held-out
sequences are compared with the trained model's, and its tokenizer encodes the held-out texts.
The quantized types users deploy (Q8_0, Q4_K_M, ...) come from llama.cpp's own quantizer
(llama_model_quantize), applied to the f16 GGUF tunekit writes.

llama-cpp-python is built from source once by scripts/setup.sh (scripts/llama_cpp_wheel.sh). Where
it is missing, `unavailable()` says why in one line and export falls back to transformers' reader.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from tunekit import TunekitError

# tunekit's name -> (llama_ftype, llama.cpp's name). Q8_0: 8-bit blocks of 32 (8.5 bits/weight);
# K-quants: super-blocks of 256 with 6-bit sub-block scales; _M mixes keep attn_v / ffn_down and
# the output in a wider type. These are the types llama.cpp's README recommends for deployment.
QUANT_TYPES = {"q8_0": (7, "Q8_0"), "q6_k": (18, "Q6_K"), "q5_k_m": (17, "Q5_K_M"), "q4_k_m": (15, "Q4_K_M")}


def unavailable() -> Optional[str]:
    """None when llama.cpp can be used here, else the one-line reason."""
    try:
        import llama_cpp  # noqa: F401
    except Exception as e:  # ImportError, or OSError when the shared library does not load
        return f"llama-cpp-python is not usable here ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
    return None


def version_of() -> str:
    import llama_cpp

    return llama_cpp.__version__


def version() -> str:
    return f"llama.cpp via llama-cpp-python {version_of()}"


@contextlib.contextmanager
def _quiet_stderr():
    """llama.cpp prints its load and quantize logs straight to fd 2 from C; keep the CLI's output
    to tunekit's own lines. A failure is reported by return code / exception, not by these logs."""
    fd = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(fd, 2)
        os.close(fd)


def quantize(src: Path, dst: Path, qtype: str, threads: int) -> None:
    """llama.cpp's quantizer: src (an f16/f32 GGUF) -> dst in `qtype` (a QUANT_TYPES key)."""
    import llama_cpp

    ftype, name = QUANT_TYPES[qtype]
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = threads
    with _quiet_stderr():
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise TunekitError(f"--dtype {name}: llama.cpp's quantizer failed (return code {rc}) on {src.name}")


def weight_repacking(cpuinfo: str) -> tuple[bool, str]:
    """Whether llama.cpp may repack the GGUF's weights into its CPU "extra buffer types" at load.

    Repacking only changes the layout the CPU kernels read (interleaved blocks for AVX2/AVX512, AMX
    tiles). On a CPU with AMX, ggml puts Q8_0 and K-quant weights into its AMX buffer, and its AMX
    matmul (ggml_backend_amx_mul_mat) segfaults on the first decode of Q8_0 and K-quant files with
    llama-cpp-python 0.3.36 (github.com/ggml-org/llama.cpp/issues/20824; docs/pitfalls.md). A
    segfault ends `tunekit export` with no message, so where the
    CPU has AMX the weights stay in the GGUF's own layout, the file is computed by ggml's plain
    kernels, and the check is as complete (llama.cpp's `--no-repack` does the same)."""
    if "amx_int8" in cpuinfo.split():
        return False, "weight repacking off: ggml's AMX matmul crashed on this kind of CPU"
    return True, "weight repacking on (llama.cpp's default)"


@contextlib.contextmanager
def _model_params(**fields):
    """llama-cpp-python's Llama takes its model parameters from llama_model_default_params() and
    exposes no argument for some fields (use_extra_bufts in 0.3.36): for this one load, the
    defaults it reads carry `fields`. A binding without a field is refused in one line."""
    import llama_cpp.llama_cpp as C

    known = {name for name, _ in C.llama_model_params._fields_}
    missing = sorted(set(fields) - known)
    if missing:
        raise TunekitError(f"llama-cpp-python {version_of()}: its model parameters have no {', '.join(missing)} "
                           f"(scripts/llama_cpp_wheel.sh pins the version tunekit is tested with)")
    real = C.llama_model_default_params

    def defaults():
        params = real()
        for name, value in fields.items():
            setattr(params, name, value)
        return params

    C.llama_model_default_params = defaults
    try:
        yield
    finally:
        C.llama_model_default_params = real


class LlamaCppModel:
    """A GGUF file loaded by llama.cpp; `logits(batch)` evaluates each row's non-padding tokens.

    Each row is decoded alone (KV cache cleared) in one llama_decode of up to n_ctx tokens, with
    logits for every position: (batch, seq, vocab) fp32, zeros at padding (masked by the caller).
    """

    def __init__(self, path: Path, n_ctx: int, threads: int, repack: bool, lora: Optional[Path] = None):
        """lora: a LoRA adapter GGUF that llama.cpp applies over `path` at load (scale 1), as `--lora` does."""
        from llama_cpp import Llama

        self.n_ctx = max(n_ctx, 8)
        extra = {"lora_path": str(lora)} if lora is not None else {}
        try:
            with _quiet_stderr(), _model_params(use_extra_bufts=repack):
                self.llm = Llama(model_path=str(path), n_ctx=self.n_ctx, n_batch=self.n_ctx, n_ubatch=self.n_ctx,
                                 logits_all=True, n_threads=threads, n_threads_batch=threads, verbose=False, **extra)
        except (RuntimeError, ValueError) as e:
            if lora is None:
                raise
            # llama.cpp's own reason went to the silenced stderr; the binding raises a generic line
            raise TunekitError(f"llama.cpp did not apply the LoRA adapter {lora.name} over {path.name} "
                               f"({str(e).splitlines()[0][:160]})") from None
        if bool(self.llm.model_params.use_extra_bufts) != repack:  # the load read other defaults
            self.llm.close()
            raise TunekitError(f"llama-cpp-python {version_of()} did not take use_extra_bufts={repack} when loading "
                               f"{path.name}; scripts/llama_cpp_wheel.sh pins the version tunekit is tested with")

    @torch.no_grad()
    def logits(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        ids, mask = batch["input_ids"].cpu(), batch["attention_mask"].bool().cpu()  # llama.cpp runs on the CPU
        out = torch.zeros(*ids.shape, self.llm.n_vocab(), dtype=torch.float32)
        for row in range(ids.shape[0]):
            tokens = ids[row][mask[row]].tolist()
            if len(tokens) > self.n_ctx:
                raise TunekitError(f"export: a held-out sequence has {len(tokens)} tokens, more than llama.cpp's "
                                   f"context {self.n_ctx}")
            self.llm.reset()
            self.llm.eval(tokens)
            scores = np.asarray(self.llm.scores[: len(tokens)], dtype=np.float32)  # (n, vocab)
            out[row, mask[row]] = torch.from_numpy(scores.copy())
        return out

    def score_task(self, rows, classes, tokenizer=None, batch_size: int = 16, max_new_tokens=None,
                   generate: bool = True):
        """`tunekit eval`'s figures for this file on task rows (tunekit.infer.gguf.score_rows_gguf):
        a TaskResult. tokenizer: the one that made the rows (None: llama.cpp's own vocabulary
        decodes the greedy answers)."""
        from tunekit.infer.gguf import score_rows_gguf

        return score_rows_gguf(self, tokenizer, rows, classes, batch_size, max_new_tokens, generate)

    def tokenize(self, text: str) -> list[int]:
        """llama.cpp's own tokenizer (the GGUF's vocabulary, merges and pre-split), special tokens parsed."""
        return self.llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)

    def close(self) -> None:
        self.llm.close()


class LlamaCppTokenizer:
    """The tokenizer protocol `artifacts.tokenizer_agreement` needs, over llama.cpp's tokenizer."""

    def __init__(self, model: LlamaCppModel):
        self.model = model

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": self.model.tokenize(text)}
