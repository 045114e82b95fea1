"""Full fine-tuning's `method.*` keys, each with its default and what it sets."""

from __future__ import annotations

from dataclasses import dataclass

WEIGHT_ROUNDINGS = ("stochastic", "nearest")


@dataclass
class FullConfig:
    """The method.* keys of a full fine-tune.

    weight_rounding: how the fp32 weights' bf16 copies for the matmuls are made under the precision
    policy's bf16 autocast. `stochastic` (default): rounded up or down at random, unbiased, so the
    steps the fp32 weights take below bf16's resolution still reach the loss (tunekit.device.rounding
    says why). `nearest`: autocast's own cast, as the standard stack trains. No effect
    in fp32, or in fp16 (T4, V100), whose copies keep autocast's rounding.
    """

    weight_rounding: str = "stochastic"
