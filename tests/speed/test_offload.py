"""Activation offloading (tunekit.speed.offload) on the CPU: the same bookkeeping a GPU runs with
its side stream, here with plain copies. Gradients must be bit-identical with and without it, each
checkpointed block's input must leave and come back once, and backward must find every one but
the first already prefetched (the GPU overlaps those copies with compute)."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from tunekit.speed.offload import Offloader


class Blocks(nn.Module):
    def __init__(self, n: int = 4, d: int = 64):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)) for _ in range(n))

    def forward(self, x):
        for b in self.blocks:
            x = x + checkpoint(b, x, use_reentrant=False)
        return x


def _grads(model, x, offloader=None):
    model.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_()
    with offloader.hooks() if offloader else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        y = model(xi)
    (y.float() ** 2).sum().backward()
    return [xi.grad.clone()] + [p.grad.clone() for p in model.parameters()]


def test_offloaded_gradients_are_bit_identical_and_prefetched():
    torch.manual_seed(0)
    model, x = Blocks(), torch.randn(32, 64)
    plain = _grads(model, x)
    off = Offloader(torch.device("cpu"), min_bytes=1)  # every saved tensor, however small
    got = _grads(model, x, off)
    assert all(torch.equal(a, b) for a, b in zip(plain, got))
    # with non-reentrant checkpointing the saved tensors are each block's input
    assert off.stats["offloaded"] == 4 and off.stats["kept"] == 0
    assert off.stats["fetched_on_demand"] == 1 and off.stats["prefetched"] == 3  # the last block's only
    assert not off.host and not off.back  # nothing left behind after backward


def test_small_tensors_and_parameters_stay_put():
    torch.manual_seed(0)
    model, x = Blocks(n=2), torch.randn(8, 64)
    off = Offloader(torch.device("cpu"))  # 1 MiB threshold: an (8, 64) fp32 input is 2 KiB
    got = _grads(model, x, off)
    assert all(torch.equal(a, b) for a, b in zip(_grads(model, x), got))
    assert off.stats["offloaded"] == 0 and off.stats["kept"] == 2
