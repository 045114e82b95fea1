"""Will an export fit on its device? The planner's check, made before any model loads.

An export runs in phases, and what one phase holds is freed before the next loads, so the check
is on the largest phase (tunekit.plan.inference.check_fits adds the CUDA allocator's margin):

streamed merge (tunekit.export.stream: LoRA, `--format merged`)
    reference  the trained model (the base as trained: 4-bit NF4 projections, every other weight
               in fp32, or a 16-bit base as stored, computing in fp32; the fp32 adapter), one check
               batch's forward (a block's working set and its
               fp32 logits), the reference figures (tunekit.export.fidelity.Reference: top-k logits
               and ids, per position)
    merge      one tensor's merge (its stored copy, fp32 weight, NF4 codes, dequantized fp32 weight,
               output), the reference figures
    compare    the candidate as it ships (bf16 / fp16 / fp32), one check batch's forward, the
               reference figures
gguf-adapter (tunekit.export.gguf_adapter: both files written from files, checked by llama.cpp)
    reference  as a streamed merge's
    write      the adapter (read from its file, fp32, and its converted copy for the GGUF writer);
               then one base tensor at a time (read, rounded through NF4, cast to f16), the figures
    check      in llama.cpp, on the CPU: the f16 base GGUF (read whole: llama-cpp-python maps no file
               it applies a LoRA to), the adapter GGUF, llama.cpp's context for the longest held-out
               row (f16 KV cache, one block's fp32 working set, the logits of every position three
               times: the graph's, the context's output buffer, llama-cpp-python's scores array); in
               torch, one batch's fp32 logits and a softmax-sized temporary, the figures
in memory (every other format or method)
    the trained model (4-bit runs merged into the dequantized weights: it becomes the merge) or the
    original weights in fp32, the merged fp32 model, the reloaded candidate, the forward, the figures.

On a GPU the phases that run there (reference; the base's tensors, rounded where the trained model
was) are checked against its free memory, those on the CPU (the adapter's read, llama.cpp's check)
against the host's.
"""

from __future__ import annotations

import math
from typing import Optional

from tunekit import TunekitError
from tunekit.export.fidelity import TOP_K
from tunekit.plan.inference import Workload, activation_terms, check_fits
from tunekit.plan.memory import base_weight_bytes
from tunekit.plan.shape import PROJECTIONS, ModelShape

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
HINT = "--eval-batches 1 holds one batch's forward less"


def reference_bytes(shape: ModelShape, positions: int) -> int:
    """The reference figures of `positions` held-out positions: top-k ids (int64) and logits (fp32), the lse."""
    return positions * (min(TOP_K, shape.vocab_size) * (8 + 4) + 4)


def merge_tensor_bytes(shape: ModelShape, stored: int, out: int) -> int:
    """Peak bytes of one tensor's streamed merge (tunekit.export.stream.merged_weight): for a projection of
    n weights, its stored copy (`stored` bytes each), the fp32 weight and the NF4 codes (0.5), then the
    dequantized fp32 weight beside them (8.5 + stored per weight); a tensor that is only cast (the
    embeddings, an untied head): its stored copy and its output."""
    largest = max(i * o for p in PROJECTIONS for i, o in [shape.projection(p)])
    return max(int((8.5 + stored) * largest), (stored + out) * shape.embedding_params)


def streamed_phases(shape: ModelShape, quantize: str, adapter_bytes: int, dtype: str, work: Workload,
                    positions: int, held: int = 4, stored: int = 4) -> dict[str, dict[str, int]]:
    """{phase: {term: bytes}} of a streamed merged export whose candidate is stored in `dtype`. held:
    bytes per weight the reference pass holds what is not 4-bit in (4: fp32; 2: a 16-bit base as
    stored, computing in fp32); stored: bytes per weight in the base's files."""
    ref = {"reference figures (top-k)": reference_bytes(shape, positions)}
    forward = activation_terms(shape, 4, work)  # the trained model computes in fp32; a candidate's logits are fp32
    return {
        "reference": {"trained model (fp32 compute)": base_weight_bytes(shape, quantize, held) + adapter_bytes,
                      **forward, **ref},
        "merge": {"one tensor's merge (fp32)": merge_tensor_bytes(shape, stored, DTYPE_BYTES[dtype]), **ref},
        "compare": {f"candidate ({dtype})": shape.total_params * DTYPE_BYTES[dtype], **forward, **ref},
    }


# gguf-adapter phases held in host memory whatever the export's device (llama.cpp runs on the CPU)
HOST_PHASES = ("write: the adapter", "check: llama.cpp")


def base_gguf_bytes(shape: ModelShape) -> int:
    """The f16 base GGUF of tunekit.export.gguf_adapter: matrices in 2 bytes, 1-D tensors (norms,
    biases) in 4; a tied head is stored once."""
    matrices = shape.num_layers * sum(i * o for p in PROJECTIONS for i, o in [shape.projection(p)])
    matrices += shape.embedding_params + shape.head_params
    return 2 * matrices + 4 * (shape.total_params - matrices)


def llama_cpp_terms(shape: ModelShape, n_ctx: int) -> dict[str, int]:
    """llama.cpp's context for one row of up to n_ctx tokens with every position's logits (the check's
    tunekit.infer.llamacpp.LlamaCppModel): its f16 KV cache, one block's fp32 working set, the logits
    as the graph's output, the context's output buffer and llama-cpp-python's scores array."""
    d, m = shape.hidden_size, shape.intermediate_size
    return {"llama.cpp KV cache (f16)": 2 * shape.num_layers * n_ctx * shape.kv_dim * 2,
            "llama.cpp working set (one block)": n_ctx * (3 * d + shape.q_dim + 2 * shape.kv_dim + 3 * m) * 4,
            "llama.cpp logits (x3)": 3 * n_ctx * shape.vocab_size * 4}


def gguf_adapter_phases(shape: ModelShape, quantize: str, adapter_bytes: int, lora_params: int, adapter_width: int,
                        work: Workload, positions: int, n_ctx: int, held: int = 4,
                        stored: int = 4) -> dict[str, dict[str, int]]:
    """{phase: {term: bytes}} of a gguf-adapter export (HOST_PHASES are on the CPU). adapter_bytes: the
    trained model's adapter, as streamed_phases counts it; lora_params: the LoRA matrices' elements,
    read again in fp32 to be written, adapter_width bytes each in the adapter GGUF (4: f32, 2: f16);
    n_ctx: the longest held-out row; held, stored: as in streamed_phases."""
    ref = {"reference figures (top-k)": reference_bytes(shape, positions)}
    reference = streamed_phases(shape, quantize, adapter_bytes, "fp16", work, positions, held, stored)["reference"]
    logits = {k: v for k, v in activation_terms(shape, 4, work).items() if k == "logits"}
    return {
        "reference": reference,
        "write: the adapter": {"adapter (fp32, and its copy in the GGUF's dtype)": lora_params * (4 + adapter_width),
                               **ref},
        "write: the base": {"one base tensor (read, rounded through NF4, cast to f16)":
                            merge_tensor_bytes(shape, stored, 2), **ref},
        "check: llama.cpp": {"base GGUF (f16)": base_gguf_bytes(shape), "adapter GGUF": lora_params * adapter_width,
                             **llama_cpp_terms(shape, n_ctx), **logits, **ref},
    }


def in_memory_terms(shape: ModelShape, quantize: str, adapter_bytes: int, fmt: str, target: Optional[str],
                    reload_bytes: int, work: Workload, positions: int) -> dict[str, int]:
    """{term: bytes} at the peak of an export that merges on the loaded model (or ships the adapter)."""
    trained = base_weight_bytes(shape, quantize, 4) + adapter_bytes
    if fmt == "adapter":
        weights = {"trained model": trained, "reloaded adapter export": trained}
    else:
        merged = {"merged model (fp32)": shape.total_params * 4, "reloaded export": shape.total_params * reload_bytes}
        weights = merged if target == "original" or quantize != "nf4" else {"trained model": trained, **merged}
    return {**weights, **activation_terms(shape, 4, work), "reference figures (top-k)": reference_bytes(shape, positions)}


def peak(phases: dict[str, dict[str, int]]) -> tuple[str, dict[str, int]]:
    """The phase holding the most, and its terms."""
    name = max(phases, key=lambda p: sum(phases[p].values()))
    return name, phases[name]


def export_memory_check(src, facts, fmt: str, target: Optional[str], candidates: tuple, batches: list[dict],
                        streamed: bool, reference_dtype=None) -> str:
    """The check for an opened run (tunekit.runs.open.Source) and its held-out batches: a line for
    the log, or one TunekitError naming the largest terms. The candidates tried in order are
    checked at the first one's width when streamed (export checks a wider one again before
    trying it), at the widest in memory."""
    from tunekit.infer import llamacpp
    from tunekit.plan.shape import model_shape
    from tunekit.device.facts import available_memory_bytes

    try:
        shape = model_shape(src.base_path, None)
    except TunekitError as e:
        return f"memory: not checked ({e})"
    tokens = max(int(b["input_ids"].numel()) for b in batches)
    positions = sum(int(b["attention_mask"].sum()) for b in batches)
    work = Workload(kv_tokens=0, forward_tokens=tokens, logit_rows=tokens)
    adapter = 2 * sum(f.stat().st_size for f in src.adapter_dir.glob("*.safetensors"))  # bf16 files read as fp32
    available = available_memory_bytes(src.device)
    if fmt == "gguf-adapter":
        import torch

        from tunekit.export.stream import stored_dtype
        from tunekit.methods.saving import read_shapes

        held = torch.empty((), dtype=reference_dtype or torch.float32).element_size()
        stored = torch.empty((), dtype=stored_dtype(src)).element_size()
        n_ctx = max(int(b["attention_mask"].sum(1).max()) for b in batches)  # the longest row llama.cpp reads
        lora = sum(math.prod(s) for k, s in read_shapes(src.adapter_dir).items() if ".lora_" in k)
        phases = gguf_adapter_phases(shape, src.quantize, adapter, lora, DTYPE_BYTES[candidates[0]], work,
                                     positions, n_ctx, held, stored)
        return _check_gguf_adapter(phases, facts, available)
    if streamed:
        import torch

        from tunekit.export.stream import stored_dtype

        held = torch.empty((), dtype=reference_dtype or torch.float32).element_size()
        stored = torch.empty((), dtype=stored_dtype(src)).element_size()
        # a GGUF candidate is checked as read back at its widest (transformers' GGUF reader, the fallback
        # where llama.cpp is missing, dequantizes to fp32); llama.cpp holds the file's own types
        first = "fp32" if fmt == "gguf" else candidates[0]
        phase, terms = peak(streamed_phases(shape, src.quantize, adapter, first, work, positions, held, stored))
        where = f"streamed merge, {candidates[0]}: the peak is its {phase} phase"
        try:
            return f"{check_fits(terms, facts, available, 'tunekit export', HINT)} ({where})"
        except TunekitError as e:
            raise TunekitError(f"{e} ({where})") from None
    widest = max(4 if c in (None, "fp32") or c in llamacpp.QUANT_TYPES else 2 for c in candidates)
    reload = 4 if fmt.startswith("gguf") else widest  # transformers' GGUF reader dequantizes to fp32
    return check_fits(in_memory_terms(shape, src.quantize, adapter, fmt, target, reload, work, positions),
                      facts, available, "tunekit export", HINT)


def _check_gguf_adapter(phases: dict[str, dict[str, int]], facts, available) -> str:
    """The largest phase against the export's device, or on a GPU the largest of its phases there
    and the largest of those on the CPU each against its own memory; a log line, or one error."""
    from tunekit.device.facts import DeviceFacts, available_memory_bytes

    checks = [(phases, facts, available)]
    if facts.type == "cuda":
        on_gpu = {k: v for k, v in phases.items() if k not in HOST_PHASES}
        on_host = {k: v for k, v in phases.items() if k in HOST_PHASES}
        checks = [(on_gpu, facts, available), (on_host, DeviceFacts("cpu"), available_memory_bytes("cpu"))]
    lines = []
    for group, where, free in checks:
        phase, terms = peak(group)
        try:
            lines.append(f"{check_fits(terms, where, free, 'tunekit export', HINT)} (gguf-adapter: its {phase} phase)")
        except TunekitError as e:
            raise TunekitError(f"{e} (gguf-adapter: its {phase} phase)") from None
    return "; ".join(lines)
