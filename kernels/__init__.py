"""tunekit_kernels: fused Triton kernels for QLoRA training (installed from repo dir kernels/).

Importing this package needs only torch; the Triton-backed ops are imported lazily on
first use, so ``is_available`` and the pure-torch references work without triton.

Public API:
    is_available(device)            -> bool
    NF4Weight, from_quant_state     -> plain-tensor NF4 weight (quant.py)
    nf4_dequantize(quant, dtype)    -> dense (out, in) weight (Triton, nf4.py)
    fused_lora_linear(x, quant, A, B, scaling, bias=None, dropout_p=0.0)  (Triton, lora.py)
    reference.dequant_nf4_reference, reference.lora_linear_reference (pure torch)
    tiles.configs_for, tiles.shared_memory -> which matmul configs fit which GPU's shared memory,
                                          and a cross-compile to check it (tiles.py, needs triton)
"""

from __future__ import annotations

from typing import Any

from ._runtime import is_available
from .quant import NF4Weight, from_quant_state
from .reference import dequant_nf4_reference, lora_linear_reference

_LAZY = {
    "nf4_dequantize": ".nf4",
    "fused_lora_linear": ".lora",
    "FusedLoRANF4Function": ".lora",
}

__all__ = [
    "is_available",
    "NF4Weight",
    "from_quant_state",
    "dequant_nf4_reference",
    "lora_linear_reference",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    # PEP 562: import the Triton modules only when a kernel is actually requested.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
