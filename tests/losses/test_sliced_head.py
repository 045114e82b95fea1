"""The cross-entropy over a head held in vocabulary slices (tunekit.losses.sliced_head: FSDP's frozen
head, never gathered whole) against autograd's reference over the whole head, and against the
whole-head chunked loss it replaces (tunekit.losses.sft.linear_cross_entropy)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tunekit.losses.sft import linear_cross_entropy
from tunekit.losses.sliced_head import fsdp_row_counts, online_cross_entropy, sliced_cross_entropy, sliced_token_logps


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


@pytest.mark.parametrize("ranks, order", [(1, [0]), (3, [1, 2, 0])])
def test_per_token_log_probabilities_equal_the_whole_heads_with_each_rows_own_gradient(ranks, order):
    """The preference losses' per-token log-probabilities (tunekit.losses.logps under FSDP): each
    row's gradient is scaled by its own incoming gradient, as log_softmax's. In fp64 the sums differ
    from the whole head's only by summation order (~V * 2^-53 relative); the log-probabilities come
    back in fp32, as tunekit.losses.logps returns them, so the incoming gradient is an fp32 number
    and the backward scales in fp32: the fp32 cast of each row's gradient, of its incoming gradient
    and of their product, three roundings of 2^-24 relative per element (bound: 4 x 2^-24)."""
    rows, weight, targets = _case(n=13, d=5, V=29)
    upstream = torch.randn(13, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    logps = sliced_token_logps(rows, targets, _slices(weight, ranks, order), torch.float64)
    ref = torch.log_softmax(F.linear(rows, weight), -1).gather(1, targets[:, None]).squeeze(1)
    assert logps.dtype == torch.float32  # what tunekit.losses.logps returns
    assert (logps.double() - ref).abs().max() <= 1e-5 * ref.abs().max()  # the fp32 cast of the result: 2^-24 relative
    (grad,) = torch.autograd.grad((logps.double() * upstream).sum(), rows)
    (ref_grad,) = torch.autograd.grad((ref * upstream).sum(), rows)
    assert ((grad - ref_grad).abs() <= 4 * 2.0**-24 * ref_grad.abs() + 1e-12).all()


def test_preference_logps_take_an_fsdp_heads_slices_never_the_whole(tmp_path, monkeypatch):
    """tunekit.losses.logps under FSDP2 (one gloo rank, this process): a frozen head without bias goes
    through its slices, never unshard(); the values are the whole head's (one rank: one slice, the
    same fp32 dot products and the same sums, up to the online rescale's roundings, 2^-24 relative)."""
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.fsdp import fully_shard

    import tunekit.losses.sliced_head as sliced
    from tunekit.losses.logps import token_logps

    rows, weight, targets = _case(n=9, d=8, V=40, dtype=torch.float32)
    head = nn.Linear(8, 40, bias=False)
    head.weight.data.copy_(weight)
    head.weight.requires_grad_(False)
    ref = torch.log_softmax(F.linear(rows, weight), -1).gather(1, targets[:, None]).squeeze(1)
    calls = []
    real = sliced.online_row_cross_entropy
    monkeypatch.setattr(sliced, "online_row_cross_entropy", lambda *a: calls.append(1) or real(*a))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        fully_shard(head)
        head.unshard = lambda *a, **k: pytest.fail("the head was gathered whole")
        logps = token_logps(rows, head, targets)
    finally:
        dist.destroy_process_group()
    assert calls == [1]
    assert (logps - ref).abs().max() <= 8 * 2.0**-24 * ref.abs().max()
