"""A full fine-tune's bf16 weight copies: stochastic rounding (tunekit.device.rounding, applied to the
model by tunekit.methods.full.rounding).

What must hold: each copy is one of the weight's two bf16 neighbours, chosen without bias; the
gradient reaches the fp32 weight as through autocast's own cast; a step's forwards share one copy;
evaluation is unchanged; and, the reason for all of it, a fit whose steps are smaller than bf16's
resolution converges where rounding to nearest lets the fp32 weight drift past its target.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tunekit.device.rounding import autocast_copy, stochastic_bf16
from tunekit.methods.full.rounding import round_stochastically


def _neighbours(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 values just below and above (or equal to) each fp32 value, by truncating its bit
    pattern (toward zero) and stepping one bf16 gap away from zero."""
    bits = w.view(torch.int32)
    toward_zero = (bits & -(1 << 16)).view(torch.float32)
    away = (((bits & -(1 << 16)) + (1 << 16)).view(torch.float32))
    exact = toward_zero == w
    away = torch.where(exact, w, away)
    return torch.minimum(toward_zero, away), torch.maximum(toward_zero, away)


def test_each_copy_is_a_neighbour_and_the_rounding_is_unbiased():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4096, generator=g) * 0.05
    w[:4] = torch.tensor([1.0, -1.0, 0.0, 2.0 ** -20])  # representable: come back unchanged
    lo, hi = _neighbours(w)
    K = 256
    draws = torch.stack([stochastic_bf16(w, generator=g).float() for _ in range(K)])
    assert ((draws == lo) | (draws == hi)).all()
    assert torch.equal(draws[:, :4], w[:4].expand(K, 4))
    # Each draw's error over its gap is (B - p) with B ~ Bernoulli(p), p the weight's position in
    # its gap: mean 0, variance p(1 - p) <= 1/4. The mean over all N*K draws then has standard
    # deviation at most 1 / (2 sqrt(N K)) = 1.5e-4; 6 of those bound it (a fixed seed besides).
    gap = (hi - lo).clamp_min(torch.finfo(torch.float32).tiny)
    z = ((draws - w) / gap)[:, 4:]
    assert abs(z.mean().item()) < 6 / (2 * math.sqrt(z.numel()))
    # Rounding to nearest, by contrast, is biased for every weight a quarter of a gap above its
    # lower neighbour: always down. Stochastically, up a quarter of the time: 4096 draws of
    # Bernoulli(1/4) have standard deviation sqrt(3/16 / 4096) = 0.0068; 6 of those: 0.041.
    quarter = (lo + (hi - lo) / 4)[4:64]
    ups = torch.stack([stochastic_bf16(quarter, generator=g).float() for _ in range(4096)]) > quarter
    assert abs(ups.float().mean().item() - 0.25) < 0.041
    assert (quarter.bfloat16().float() < quarter).all()


def test_non_finite_weights_stay_non_finite():
    w = torch.tensor([float("inf"), -float("inf"), float("nan")])
    assert not torch.isfinite(stochastic_bf16(w).float()).any()


def test_the_gradient_reaches_the_fp32_weight_as_through_a_cast():
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(8, 16, generator=g) * 0.05).requires_grad_()
    setattr(w, "_tunekit_stochastic_copy", True)
    x = torch.randn(4, 16, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        copy = autocast_copy(w, "cpu")
        y = F.linear(x, copy)
    (y.float() ** 2).sum().backward()
    assert copy.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
    leaf = copy.detach().clone().requires_grad_()  # the same bf16 copy as a leaf: its gradient, cast up
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (F.linear(x, leaf).float() ** 2).sum().backward()
    assert torch.equal(w.grad, leaf.grad.float())


def test_a_steps_forwards_share_one_copy_and_a_changed_weight_gets_a_new_one():
    w = (torch.randn(64, 64) * 0.05).requires_grad_()
    setattr(w, "_tunekit_stochastic_copy", True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        first, second = autocast_copy(w, "cpu"), autocast_copy(w, "cpu")
        assert torch.equal(first, second)  # gradient accumulation: every micro-batch sees one weight
        with torch.no_grad():
            w.add_(1e-6)  # an optimizer step (in place, as torch.optim does)
        third = autocast_copy(w, "cpu")
        assert not torch.equal(first, third)
        with torch.no_grad():  # evaluation: autocast's own rounding to nearest
            assert torch.equal(autocast_copy(w, "cpu"), w.bfloat16())


def test_only_training_forwards_under_bf16_autocast_round_stochastically():
    torch.manual_seed(2)
    lin = nn.Linear(256, 256, bias=False)
    assert round_stochastically(nn.Sequential(lin, nn.ReLU())) == 1
    x = torch.randn(3, 256)
    nearest = F.linear(x.bfloat16(), lin.weight.bfloat16())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not torch.equal(lin(x), nearest)  # 65536 weights: all rounding to nearest by chance is ~impossible
        with torch.no_grad():
            assert torch.equal(lin(x), nearest)
    assert torch.equal(lin(x), F.linear(x, lin.weight))  # fp32: untouched


@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
def test_steps_below_bf16s_resolution_reach_the_loss_only_when_rounded_stochastically(rounding):
    """A linear fit from weights at 1.0 to a target 1.002: a quarter of bf16's gap above 1.0
    (2^-7 = 0.0078), so the nearest copy of the target is 1.0. Rounded to nearest, the loss does not
    see the fp32 weight move until it crosses the midpoint 1 + 2^-8 = 1.0039: its gradient keeps
    pointing the same way, and Adam (steps of about lr = 1e-4, 300 of them) carries every weight on
    to that midpoint and holds it there, 0.0019 past the target. Rounded stochastically, the copy is
    1.0078 with probability (w - 1) / 2^-7, the expected forward is the fp32 one, and the weights
    settle around the target: each within about 1e-3 (the rounding noise in its gradient), their
    mean over 32 within 1e-3 / sqrt(32) ~ 2e-4 (bound: 3 times that). The midpoint, less a few of
    Adam's steps of oscillation (3e-4), bounds the other arm from below."""
    torch.manual_seed(3)
    lin = nn.Linear(32, 1, bias=False)
    with torch.no_grad():
        lin.weight.fill_(1.0)
    if rounding == "stochastic":
        round_stochastically(lin)
    x = torch.randn(512, 32)
    y = x.sum(1, keepdim=True) * 1.002
    opt = torch.optim.Adam(lin.parameters(), lr=1e-4)
    for _ in range(300):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = ((lin(x).float() - y) ** 2).mean()
        loss.backward()
        opt.step()
    err = (lin.weight.detach().mean() - 1.002).abs().item()
    if rounding == "stochastic":
        assert err < 6e-4
    else:
        assert err > 2.0 ** -8 - 0.002 - 3e-4


def test_fp16_autocast_keeps_rounding_to_nearest():
    """The T4/V100 policy (fp16 autocast): a marked weight's copy is autocast's nearest fp16 one,
    drawn afresh each time, with no copy kept on the weight."""
    w = (torch.randn(64, 64) * 0.05).requires_grad_()
    setattr(w, "_tunekit_stochastic_copy", True)
    with torch.autocast("cpu", dtype=torch.float16):
        copy = autocast_copy(w, "cpu")
    assert copy.dtype == torch.float16 and torch.equal(copy, w.detach().half())
    assert not hasattr(w, "_tunekit_bf16_copy")
