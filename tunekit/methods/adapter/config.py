"""Bottleneck adapters' `method.*` keys, each with its default and what it sets."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List


@dataclass
class AdapterConfig:
    """The method.* keys of bottleneck adapters: width of dim -> bottleneck -> dim, its nonlinearity
    (gelu | silu | relu), and the sublayers whose output is adapted."""

    bottleneck: int = 64
    activation: str = "gelu"
    sublayers: List[str] = field(default_factory=lambda: ["self_attn", "mlp"])
