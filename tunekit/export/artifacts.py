"""Each export format as a pair: write(...) builds the artifact, reload(...) reads it back the way
its consumer will (peft / tunekit for adapters, transformers for HF folders, llama.cpp for GGUF
files), so the fidelity check measures what a user actually gets.

Writers take the merged fp32 model built once per export and never modify it: trying bf16, then
fp16, then fp32 costs one write and one reload each, not one rebuild each. A LoRA merge is not
built in memory at all: tunekit.export.stream writes each candidate straight from the base's files.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import logging
import shutil
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn

from tunekit import TunekitError
from tunekit.runs.load import apply_and_load, load_base
from tunekit.runs.open import Source

log = logging.getLogger("tunekit")
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def free(*models) -> None:
    """Collect what the export dropped (peft models hold reference cycles) and hand the memory back.

    glibc keeps freed blocks below its mmap threshold (up to 32 MB: every layer of a 4-bit 1B model)
    in its heap for reuse; the models loaded next are mapped from their files and never reuse it, so
    the freed trained model would stay in the process's resident set (measured on a 1B model: 1.45 GB
    of anonymous memory resident after the trained model was gone, 0.34 GB after malloc_trim, 0.31
    before it loaded)."""
    del models
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to trim
        pass


# ---------------------------------------------------------------- adapter
def write_adapter(run: Source, trained: nn.Module, tokenizer, out_dir: Path) -> None:
    """method.save() of the rebuilt trained model + the run's tokenizer (saving does not touch the model)."""
    run.method_impl.save(trained, out_dir)
    tokenizer.save_pretrained(out_dir)


def reload_adapter(run: Source, folder: Path) -> nn.Module:
    """A peft-format folder (adapter_config.json has peft_type) through peft.PeftModel on a freshly
    loaded base; a tunekit-only format (bottleneck adapters, BitFit) through tunekit's method.load."""
    config = json.loads((folder / "adapter_config.json").read_text())
    if "peft_type" not in config:
        return apply_and_load(run, load_base(run), folder)
    from peft import PeftModel

    return PeftModel.from_pretrained(load_base(run), folder).eval()


# ---------------------------------------------------------------- merged
def _cast_state(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The model's state dict in `dtype`, tied tensors still sharing storage (so that saving
    drops the tied copy exactly as save_pretrained does for the model itself)."""
    cast: dict[int, torch.Tensor] = {}
    out = {}
    for name, t in model.state_dict().items():
        key = t.data_ptr()
        if key not in cast:
            cast[key] = t.detach().to(dtype)
        out[name] = cast[key]
    return out


def write_merged(merged: nn.Module, tokenizer, out_dir: Path, dtype: str) -> None:
    """A standalone HF folder from the merged fp32 model: model.safetensors (in `dtype`),
    config.json, generation_config.json, tokenizer. `merged` is not modified."""
    torch_dtype = TORCH_DTYPES[dtype]
    cfg = merged.config
    # Nothing of the training setup may leak into config.json: a stale quantization_config would
    # make transformers try to load plain weights as 4-bit.
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(cfg, attr):
            delattr(cfg, attr)
    cfg.use_cache = True
    merged.save_pretrained(out_dir, state_dict=_cast_state(merged, torch_dtype), safe_serialization=True)
    # save_pretrained records the in-memory model's dtype (fp32); the file holds `dtype`, and
    # consumers loading with dtype="auto" must get that.
    cfg.dtype = torch_dtype
    cfg.save_pretrained(out_dir)
    cfg.dtype = torch.float32
    if not (out_dir / "generation_config.json").is_file():
        from transformers import GenerationConfig

        GenerationConfig.from_model_config(cfg).save_pretrained(out_dir)
    stop_at_turn_end(out_dir, tokenizer)
    tokenizer.save_pretrained(out_dir)


def stop_at_turn_end(out_dir: Path, tokenizer) -> None:
    """generation_config.json's eos_token_id gains the tokenizer's EOS and the token its chat template
    ends a reply with, where it lacks them (a base's config names the base's EOS; a run with
    data.chat_template ends replies with a token it added): transformers' generate stops there."""
    from transformers import GenerationConfig

    from tunekit.data.tokenize import turn_end_id

    gen = GenerationConfig.from_pretrained(out_dir)
    have = gen.eos_token_id if isinstance(gen.eos_token_id, list) else [gen.eos_token_id]
    stops = [i for i in dict.fromkeys([*have, tokenizer.eos_token_id, turn_end_id(tokenizer)]) if i is not None]
    if stops != [i for i in have if i is not None]:
        gen.eos_token_id = stops if len(stops) > 1 else stops[0]
        gen.save_pretrained(out_dir)


def reload_merged(folder: Path, device: torch.device) -> nn.Module:
    """As a consumer loads it, on `device`: plain transformers, stored dtype; bitsandbytes when
    config asks for it."""
    from transformers import AutoModelForCausalLM

    from tunekit.device.facts import device_map

    cfg = json.loads((folder / "config.json").read_text())
    if "quantization_config" not in cfg:
        # placed on the device as it loads: through the host first, a 16 GB model would need 16 GB
        # of host memory beside the GPU's copy
        placed = {"device_map": device_map(device)} if torch.device(device).type == "cuda" else {}
        return AutoModelForCausalLM.from_pretrained(folder, dtype="auto", **placed).to(device).eval()
    from tunekit.model.loader import keep_bnb_layout

    model = AutoModelForCausalLM.from_pretrained(folder, dtype="auto", device_map=device_map(device))
    # Same 4-bit math as training measured it: no bitsandbytes CPU repack on eval forwards
    # (tunekit.model.loader.keep_bnb_layout says why).
    keep_bnb_layout(model)
    return model.eval()


def write_requantized_nf4(run: Source, write_plain: Callable[[Path], None], tokenizer, out_dir: Path, dtype: str,
                          compute_dtype: torch.dtype) -> None:
    """Merged weights re-quantized to NF4 + double quant (bitsandbytes), as a HF folder with its
    quantization_config. Built the way a consumer would quantize the merged folder: write_plain(folder)
    writes the merged model in `dtype` to a scratch folder (from the merged model in memory, or
    streamed), which is loaded back through transformers' bitsandbytes integration (lm_head kept
    in high precision, as in training; it quantizes tensor by tensor as it loads), then saved, with
    the compute dtype the run trained in."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from tunekit.model.loader import NF4_SKIP_MODULES
    from tunekit.device.facts import device_map

    scratch = out_dir / ".merged-scratch"
    scratch.mkdir()
    write_plain(scratch)
    qcfg = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=compute_dtype, llm_int8_skip_modules=list(NF4_SKIP_MODULES))
    model = AutoModelForCausalLM.from_pretrained(scratch, quantization_config=qcfg, dtype=TORCH_DTYPES[dtype],
                                                 device_map=device_map(run.device))
    shutil.rmtree(scratch)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    free(model)


# ---------------------------------------------------------------- gguf
def write_gguf_file(run: Source, write: Callable[[Path, str, str], None], path: Path, dtype: str) -> None:
    """bf16/fp16/fp32: written by `write(path, dtype, name)` (from a loaded merged model, or merged
    tensor by tensor as it is written: tunekit.export.job); a llama.cpp quantized type: f16 written
    beside `path`, llama.cpp's quantizer turns it into `path`, the f16 file is removed."""
    from tunekit.infer import llamacpp

    name = f"{Path(run.base_path).name}-{run.method}"
    if dtype not in llamacpp.QUANT_TYPES:
        write(path, dtype, name)
        return
    f16 = path.with_name(f".{path.name}.f16")
    try:
        write(f16, "fp16", name)
        llamacpp.quantize(f16, path, dtype, torch.get_num_threads())
    finally:
        f16.unlink(missing_ok=True)


@contextlib.contextmanager
def gguf_parsed_once():
    """Within it, transformers' GGUF loader parses each file once. It builds a gguf.GGUFReader for
    the config, again for the weights and again for the tokenizer, and each parse of a 49k-token
    vocabulary takes ~4 s on a 2-core CPU (the fallback check's largest cost): hand all three the
    same reader. The reader is only read from; it is dropped when the block ends."""
    import gguf

    real, parsed = gguf.GGUFReader, {}

    def reader(path, mode="r"):
        key = (str(Path(path).resolve()), mode)
        if key not in parsed:
            parsed[key] = real(path, mode)
        return parsed[key]

    gguf.GGUFReader = reader  # transformers imports it from gguf inside each call
    try:
        yield
    finally:
        gguf.GGUFReader = real
        parsed.clear()


def reload_gguf_transformers(path: Path, device: torch.device) -> nn.Module:
    """transformers' GGUF loader (an independent reader: dequantizes, undoes the q/k interleave),
    on `device`; the fallback check where llama.cpp is not available."""
    import io

    from transformers import AutoModelForCausalLM

    # transformers draws a tqdm bar per GGUF load that its progress-bar switch does not reach;
    # our log lines go through logging's handler (bound to the real stderr), not sys.stderr.
    with contextlib.redirect_stderr(io.StringIO()):
        return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).to(device).eval()


def reload_tokenizer(folder: Path, gguf_file: str | None = None):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file) if gguf_file else AutoTokenizer.from_pretrained(folder)


def tokenizer_agreement(reference, exported, batches: list[dict]) -> float:
    """Fraction of held-out texts that the exported tokenizer encodes to the same ids as the run's.

    Logit comparisons feed token ids, so they cannot see a broken vocabulary or merge list; this can.
    `exported` is any callable text -> {"input_ids": [...]} (a HF tokenizer, or llama.cpp's).
    """
    same = total = 0
    for batch in batches:
        for ids, mask in zip(batch["input_ids"], batch["attention_mask"]):
            text = reference.decode(ids[mask.bool()].tolist(), skip_special_tokens=False)
            a = reference(text, add_special_tokens=False)["input_ids"]
            b = exported(text, add_special_tokens=False)["input_ids"]
            same += list(a) == list(b)
            total += 1
    if total == 0:
        raise TunekitError("export: the held-out split is empty; nothing to check the export against")
    return same / total
