"""LoRA's `method.*` keys: what each one sets, with its default (read by tunekit.methods.lora.method)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional


@dataclass
class LoRAConfig:
    """The method.* keys of LoRA."""

    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.05
    # LoRA and BitFit: which projections; "all-linear" = q,k,v,o,gate,up,down of every block.
    target_modules: List[str] = field(default_factory=lambda: ["all-linear"])
    # DoRA: a trained magnitude (out,) per target over the normalised W + s B A (QDoRA over 4-bit).
    use_dora: bool = False
    # rsLoRA: scale the update by alpha / sqrt(r) instead of alpha / r (stable at large r).
    use_rslora: bool = False
    # How B A starts: default (B = 0) | pissa | olora (W's principal part; bf16 base only) |
    # loftq (a low-rank fit of what 4-bit rounding lost; 4-bit base only) | auto (loftq where its
    # cost is small against the run, else default: tunekit.methods.lora.start_choice; qlora's default).
    init: str = "default"
    # LoftQ's alternations (quantize, fit, requantize...); 1 keeps the loader's 4-bit base as it is.
    loftq_iters: int = 1
    # LoRA+: B's learning rate = this x trainer.lr (the paper suggests ~16); null: one rate.
    loraplus_lr_ratio: Optional[float] = None
