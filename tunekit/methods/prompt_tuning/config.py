"""Prompt tuning's `method.*` keys, each with its default and what it sets."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class PromptTuningConfig:
    """The method.* keys of prompt tuning: soft prompt length, and the text whose token embeddings
    initialise it (repeated/truncated to num_virtual_tokens); null = random vocabulary rows."""

    num_virtual_tokens: int = 20
    prompt_init_text: Optional[str] = None
