"""tunekit/head_matmul.py: the fp32 output head's matmuls in oneDNN's bf16 math mode on a CPU with
native bf16, decided from plain facts and checked against fp64 before use."""

from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.nn as nn

from tunekit import device as dev
from tunekit import head_matmul as hm
from tunekit.losses.sft import sft_loss_from_hidden

CPU_BF16 = dev.DeviceFacts("cpu", cpu_bf16=True)
CPU_PLAIN = dev.DeviceFacts("cpu", cpu_bf16=False)
H100 = dev.DeviceFacts("cuda", 0, (9, 0), "NVIDIA H100 80GB HBM3", 80 * 2**30)
T4 = dev.DeviceFacts("cuda", 1, (7, 5), "Tesla T4", 16 * 2**30)


@pytest.mark.parametrize("mode, facts, dtype, has_mode, want", [
    ("auto", CPU_BF16, torch.float32, True, True),
    ("fp32", CPU_BF16, torch.float32, True, False),  # the user's off switch
    ("auto", CPU_PLAIN, torch.float32, True, False),  # bf16 emulated: nothing to gain
    ("auto", CPU_BF16, torch.bfloat16, True, False),  # a bf16 head already runs on bf16 units
    ("auto", CPU_BF16, torch.float32, False, False),  # an older torch without the switch
    ("auto", H100, torch.float32, True, False),
    ("auto", T4, torch.float32, True, False),
])
def test_wanted_is_a_function_of_plain_facts(mode, facts, dtype, has_mode, want):
    ok, reason = hm.wanted(mode, facts, dtype, has_mode)
    assert ok is want and reason


def test_error_measure_tells_plain_bf16_from_fp32():
    """The check is only as good as its measure: a plain bf16 rounding of the operands must land
    near its predicted 2^-9.6 per product, far above TOLERANCE, and exact fp32 far below it."""
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(16, 512, generator=gen)
    b = torch.randn(512, 300, generator=gen) * 0.05
    fp32 = hm.per_product_error(a, b, a @ b)
    plain = hm.per_product_error(a, b, a.bfloat16().float() @ b.bfloat16().float())
    assert fp32 < 2.0 ** -18 < hm.TOLERANCE
    assert 2.0 ** -11 < plain < 2.0 ** -8.5  # 2^-9.6 predicted: uniform rounding of both operands
    assert plain > 16 * hm.TOLERANCE


def test_check_measures_one_of_the_two_schemes_and_restores_strict_fp32():
    """On any CPU the mode is one of two things, and the check must tell which: oneDNN either
    carries each fp32 value as several bf16 pieces or ignores the mode (within TOLERANCE: the AMD
    EPYC with AVX512-BF16 measured ~2^-21), or it rounds each operand once to bf16 (the plain
    rounding's ~2^-9.6, far above TOLERANCE: oneDNN on the Intel VM with AMX, 2^-8.7)."""
    w = torch.randn(1000, 96) * 0.05
    before = torch.backends.mkldnn.matmul.fp32_precision
    eps = hm.check(w)
    assert set(eps) == {"forward", "backward"}
    several_pieces = all(0 <= e <= hm.TOLERANCE for e in eps.values())
    plain_rounding = all(hm.PLAIN_ROUNDING[0] < e < hm.PLAIN_ROUNDING[1] for e in eps.values())
    assert several_pieces or plain_rounding, eps
    assert torch.backends.mkldnn.matmul.fp32_precision == before


def test_bf16_math_restores_the_setting_after_an_error():
    before = torch.backends.mkldnn.matmul.fp32_precision
    with pytest.raises(RuntimeError):
        with hm.bf16_math():
            assert torch.backends.mkldnn.matmul.fp32_precision == "bf16"
            raise RuntimeError("boom")
    assert torch.backends.mkldnn.matmul.fp32_precision == before


def _head(vocab=500, hidden=48, bias=False) -> nn.Linear:
    torch.manual_seed(0)
    head = nn.Linear(hidden, vocab, bias=bias)
    head.weight.requires_grad_(False)  # frozen, as under LoRA / QLoRA
    return head


def test_choose_marks_the_head_only_when_the_check_passes(monkeypatch, caplog):
    head = _head()
    d = hm.choose(head, "auto", CPU_BF16)
    passes = hm.torch_has_mode() and max(hm.check(head.weight).values()) <= hm.TOLERANCE  # this CPU's oneDNN
    assert (d.math == "bf16") == passes, d
    assert (getattr(head, hm.ATTR, None) == "bf16") == (d.math == "bf16")
    hm.clear(head)

    monkeypatch.setattr(hm, "torch_has_mode", lambda: True)
    # a plain rounding to bf16 (oneDNN on the AMX VM): refused, said in the decision, no warning
    monkeypatch.setattr(hm, "check", lambda w: {"forward": 2.0 ** -8.7, "backward": 2.0 ** -8.7})
    with caplog.at_level(logging.WARNING, logger="tunekit.head_matmul"):
        d = hm.choose(head, "auto", CPU_BF16)
    assert d.math == "fp32" and "rounds fp32 operands to bf16" in d.reason and not hasattr(head, hm.ATTR)
    assert not caplog.text
    # an error of neither scheme: refused with a warning
    monkeypatch.setattr(hm, "check", lambda w: {"forward": 2.0 ** -12, "backward": 2.0 ** -21})
    with caplog.at_level(logging.WARNING, logger="tunekit.head_matmul"):
        d = hm.choose(head, "auto", CPU_BF16)
    assert d.math == "fp32" and "failed its check" in d.reason and not hasattr(head, hm.ATTR)
    assert "keeping strict fp32" in caplog.text
    monkeypatch.setattr(hm, "check", lambda w: {"forward": float("nan"), "backward": 0.0})
    assert hm.choose(head, "auto", CPU_BF16).math == "fp32"  # a NaN never passes
    assert hm.choose(head, "auto", CPU_PLAIN).math == "fp32" and not hasattr(head, hm.ATTR)


@pytest.mark.parametrize("bias, weight_trains", [(False, False), (True, True)])
def test_marked_head_matches_strict_fp32_in_loss_and_gradients(bias, weight_trains):
    """The loss path tunekit trains with (sft_loss_from_hidden), marked head vs the plain module:
    loss and gradients agree to the per-product bound. A logit's error is at most eps times
    sqrt(sum (x_i w_i)^2); the loss, a softmax-weighted mean of logit errors, and the gradients,
    products with the same K, carry the same relative bound (x4 for the sums over rows). eps is
    TOLERANCE, or the mode's own error where this CPU's oneDNN rounds plainly to bf16 (choose()
    never marks a head there; the marking is forced here to test the path)."""
    head = _head(bias=bias)
    eps = max([hm.TOLERANCE, *hm.check(head.weight).values()])
    head.weight.requires_grad_(weight_trains)
    hidden = torch.randn(2, 12, 48)
    labels = torch.randint(0, 500, (2, 12))
    labels[:, :3] = -100

    def run(marked: bool):
        hm.clear(head)
        if marked:
            setattr(head, hm.ATTR, "bf16")
        for p in head.parameters():
            p.grad = None
        h = hidden.clone().requires_grad_(True)
        loss, n = sft_loss_from_hidden(h, head, labels)
        loss.backward()
        return loss.detach(), n, h.grad, [None if p.grad is None else p.grad.clone() for p in head.parameters()]

    ref_loss, ref_n, ref_dh, ref_dp = run(False)
    loss, n, dh, dp = run(True)
    hm.clear(head)
    assert n == ref_n
    tol = 4 * eps
    assert math.isclose(loss.item(), ref_loss.item(), rel_tol=tol)
    assert (dh - ref_dh).norm() <= tol * ref_dh.norm()
    for got, ref in zip(dp, ref_dp):
        assert (got is None) == (ref is None)
        if ref is not None:
            assert (got - ref).norm() <= tol * ref.norm()
    assert (ref_dp[0] is not None) == weight_trains
