"""(IA)^3's `method.*` keys, each with its default and what it sets."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List


@dataclass
class IA3Config:
    """The method.* keys of (IA)^3."""

    # the projections that get a vector ([all-linear]: all seven): Liu et al. scale keys, values
    # and the MLP's inner activation
    target_modules: List[str] = field(default_factory=lambda: ["k_proj", "v_proj", "down_proj"])
    # the targets whose input, not output, is scaled (down_proj's input is the MLP's activation)
    feedforward_modules: List[str] = field(default_factory=lambda: ["down_proj"])
