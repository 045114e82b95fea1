"""Will an opened source (tunekit.runs.open.Source) and a command's work fit on its device?

The planner's check (tunekit.plan.inference), made before anything loads: `check_memory` returns
a line for the log, or raises one TunekitError naming the largest terms and what to change.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from tunekit import TunekitError
from tunekit.runs.open import Source
from tunekit.device import facts as dev


def trained_part_bytes(src: Source) -> int:
    """Memory of what is loaded on top of the base: the adapter's tensors, at most fp32 (its files
    hold them in their stored dtype). A full fine-tune and a model folder replace the base's own
    weights instead: nothing on top."""
    if src.kind in ("model", "gguf") or src.method_impl.trains_base or src.adapter_dir is None:
        return 0
    stored = sum(f.stat().st_size for f in Path(src.adapter_dir).glob("*.safetensors"))
    return 2 * stored  # bf16 files loaded as fp32 masters at worst


def check_memory(src: Source, work, what: str, hint: str = "") -> str:
    """The planner's check that `src` and `work` (tunekit.plan.inference.Workload) fit on the
    source's device, before anything loads: a line for the log, or a TunekitError naming the
    largest terms and what to change. A model the planner cannot read (not a Llama-style
    config.json) is not checked.

    A GGUF file is not checked: llama.cpp maps it (its pages are the file's, shared and evictable)
    and its scoring cache is sized to one batch. With --base, what loads on the device is the
    untuned Hugging Face base (--base-model): that is checked."""
    from tunekit.plan.inference import check_fits, inference_memory
    from tunekit.plan.shape import model_shape

    if src.kind == "gguf":
        if src.base_override is None:
            return (f"memory: not checked for a GGUF file ({src.path.stat().st_size / 2**20:.0f} MiB, mapped by "
                    "llama.cpp on the CPU)")
        from tunekit.model import resolve_model_path

        src = replace(src, kind="model", base_path=resolve_model_path(src.base_override, key="--base-model"))
    try:
        shape = model_shape(src.base_path, None, key=str(src.base_path))
    except TunekitError as e:
        return f"memory: not checked ({e})"
    quantize = src.quantize
    if src.kind == "model" and quantize == "none":
        config = Path(src.base_path) / "config.json"
        from tunekit.model.folder import read_json

        if config.is_file() and "quantization_config" in read_json(config, src.base_key):
            quantize = "nf4"  # a re-quantized export loads as 4-bit whatever --quantize says
    e = torch.empty((), dtype=src.dtype).element_size()
    terms = inference_memory(shape, quantize, e, work, trained_part_bytes(src))
    return check_fits(terms, src.facts, dev.available_memory_bytes(src.device), what, hint)
