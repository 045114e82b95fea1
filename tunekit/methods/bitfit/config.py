"""BitFit's `method.*` keys, each with its default and what it sets."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List


@dataclass
class BitFitConfig:
    """The method.* keys of BitFit: the projections that get a bias ([all-linear]: all seven)."""

    target_modules: List[str] = field(default_factory=lambda: ["all-linear"])
