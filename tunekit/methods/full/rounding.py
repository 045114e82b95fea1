"""A full fine-tune's linears read their bf16 weight copies from tunekit.device.rounding, which
rounds them stochastically (its docstring says why): `round_stochastically` marks every nn.Linear
weight of the model and routes its forward through that copy while autocast is on."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tunekit.device.rounding import COPY, MARK, autocast_copy


def _linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if torch.is_autocast_enabled(x.device.type):
        # a bf16 copy made here: autocast then casts only x (and the bias) to match
        return F.linear(x, autocast_copy(self.weight, x.device.type), self.bias)
    return F.linear(x, self.weight, self.bias)


def round_stochastically(model: nn.Module) -> int:
    """Every nn.Linear of `model` takes its bf16 weight copy by stochastic rounding while it trains
    under bf16 autocast (eval, no_grad and fp32 are unchanged); the loss's head matmul
    (tunekit.losses) asks autocast_copy too. Returns how many linears it covers."""
    n = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            setattr(module.weight, MARK, True)
            module.forward = _linear_forward.__get__(module, nn.Linear)
            n += 1
    return n


def drop_copies(model: nn.Module) -> None:
    """Let go of the bf16 copies the weights keep between steps (once training is over)."""
    for p in model.parameters():
        if hasattr(p, COPY):
            delattr(p, COPY)
