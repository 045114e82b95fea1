"""The cross-entropy over a head held in vocabulary slices (tunekit.losses.sliced_head: FSDP's frozen
head, never gathered whole) against autograd's reference over the whole head, and against the
whole-head chunked loss it replaces (tunekit.losses.sft.linear_cross_entropy)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tunekit.losses.sft import linear_cross_entropy
from tunekit.losses.sliced_head import fsdp_row_counts, online_cross_entropy, sliced_cross_entropy


def _case(n=37, d=16, V=301, dtype=torch.float64, scale=3.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(n, d, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    weight = (scale * torch.randn(V, d, generator=g, dtype=torch.float64)).to(dtype)
    targets = torch.randint(0, V, (n,), generator=g)
    return rows, weight, targets


def _slices(weight: torch.Tensor, ranks: int, order: list[int]):
    counts = fsdp_row_counts(weight.shape[0], ranks)
    starts = [sum(counts[:r]) for r in range(ranks)]
    return lambda: ((starts[r], weight[starts[r] : starts[r] + counts[r]]) for r in order)


def test_row_counts_are_fsdps_cut():
    """FSDP2 cuts dim 0 as torch.chunk does; ranks past the last chunk hold no row."""
    for vocab, ranks in [(10, 4), (5, 4), (49152, 2), (128256, 8), (3, 8)]:
        chunks = [len(c) for c in torch.arange(vocab).chunk(ranks)]
        assert fsdp_row_counts(vocab, ranks) == chunks + [0] * (ranks - len(chunks))


@pytest.mark.parametrize("ranks, order", [(1, [0]), (4, [2, 0, 3, 1]), (8, [7, 6, 5, 4, 3, 2, 1, 0])])
def test_fp64_equals_the_whole_head_in_any_slice_order(ranks, order):
    """In fp64 the online sums and the whole head's differ only by summation order: ~V * 2^-53
    relative, far below 1e-10 on a loss of O(10) and gradients of O(1). With 8 ranks over 17
    rows (3 a rank), the last two hold none (an empty slice is skipped)."""
    rows, weight, targets = _case(n=11, d=6, V=17)
    assert fsdp_row_counts(17, 8)[-2:] == [0, 0]
    loss = sliced_cross_entropy(rows, targets, _slices(weight, ranks, order), torch.float64)
    (grad,) = torch.autograd.grad(loss * 0.5, rows)  # a scaled loss, as the trainer's 1/tokens
    ref = F.cross_entropy(F.linear(rows, weight), targets, reduction="sum")
    (ref_grad,) = torch.autograd.grad(ref * 0.5, rows)
    assert abs(loss.item() - ref.item()) <= 1e-10 * abs(ref.item())
    assert (grad - ref_grad).abs().max() <= 1e-10
    assert torch.autograd.gradcheck(lambda r: sliced_cross_entropy(r, targets, _slices(weight, ranks, order),
                                                                   torch.float64), (rows.detach().requires_grad_(),))


def test_a_target_far_below_the_maximum_keeps_its_logit():
    """A target whose logit lies 200 below the row's maximum (exp underflows in fp32): its loss is
    the gap, not inf. In fp32 the logits are exact small integers here, so the loss is exact up to
    the log-sum-exp's rounding (~2^-24 relative)."""
    rows = torch.tensor([[1.0]], requires_grad=True)
    weight = torch.tensor([[0.0], [200.0], [-5.0]])  # logits 0, 200, -5
    targets = torch.tensor([2])
    loss = sliced_cross_entropy(rows, targets, _slices(weight, 3, [1, 0, 2]), torch.float32)
    assert abs(loss.item() - 205.0) <= 205.0 * 2.0**-20
    (grad,) = torch.autograd.grad(loss, rows)
    assert abs(grad.item() - 205.0) <= 205.0 * 2.0**-20  # softmax @ W - W_target = 200 - (-5)


def test_bf16_within_rounding_of_the_whole_head_chunked_loss():
    """bf16 head and rows, as FSDP's frozen bf16 head computes. Both compute the same bf16 logits
    (one dot product over d per logit; a slice's matmul may block the sum differently: at most a
    bf16 rounding, 2^-8 |z|, apart) and sum them in fp32: the loss differs by at most
    n * 2 * 2^-8 * max|z| (test_sft_loss's bound). The rows' gradient: both multiply a bf16 cast of
    a number in [0, 1] (the softmax there, exp(z - m) here, rescaled in fp32 after) by the same
    bf16 rows, one more fp32 rescale and a bf16 cast here: within 2^-6 of the largest element
    (four roundings of 2^-9 relative, and the casts)."""
    rows, weight, targets = _case(n=50, d=32, V=500, dtype=torch.bfloat16, scale=1.0)
    loss = sliced_cross_entropy(rows, targets, _slices(weight, 2, [0, 1]), torch.bfloat16)
    (grad,) = torch.autograd.grad(loss, rows)
    ref = linear_cross_entropy(rows, weight, None, targets)
    (ref_grad,) = torch.autograd.grad(ref, rows)
    bound = 50 * 2 * 2.0**-8 * F.linear(rows, weight).detach().abs().max().float()
    assert abs(loss.item() - ref.item()) <= bound.item()
    assert grad.dtype == torch.bfloat16
    assert (grad.float() - ref_grad.float()).abs().max() <= 2.0**-6 * ref_grad.float().abs().max()


def test_no_grad_gives_the_loss_alone():
    rows, weight, targets = _case(dtype=torch.float32)
    total, grad = online_cross_entropy(rows.detach(), targets, _slices(weight, 2, [1, 0]), need_grad=False)
    ref = F.cross_entropy(F.linear(rows.detach(), weight), targets, reduction="sum")
    assert grad is None and abs(total.item() - ref.item()) <= 1e-5 * abs(ref.item())  # fp32 sums of 301 terms
