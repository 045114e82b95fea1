"""The chunked cross-entropy (tunekit.losses.sft.linear_cross_entropy) against autograd's reference:
F.cross_entropy over the whole (rows, vocab) logits of F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from tunekit.losses.sft import chunk_rows, linear_cross_entropy, sft_loss_from_hidden


def _case(n=7, d=5, V=11, dtype=torch.float64, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(n, d, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    weight = torch.randn(V, d, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    b = torch.randn(V, generator=g, dtype=torch.float64).to(dtype).requires_grad_() if bias else None
    targets = torch.randint(0, V, (n,), generator=g)
    return rows, weight, b, targets


@pytest.mark.parametrize("chunk", [1, 3, 7, 64])  # one row a chunk, a partial last chunk, exact, one chunk
def test_gradients_are_exact_in_fp64(chunk):
    rows, weight, bias, targets = _case()
    fn = lambda r, w, b: linear_cross_entropy(r, w, b, targets, chunk=chunk)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (rows, weight, bias))


@pytest.mark.parametrize("chunk", [2, 5, 100])
def test_fp32_equals_the_unchunked_loss(chunk):
    # Both sum n log-sum-exps of V fp32 terms in different orders: each term is off by ~2^-24
    # relative, the sum by ~sqrt(n * V) * 2^-24 * |loss| ~ 1e-5 * |loss| here at most; 1e-5 relative
    # on the loss and 1e-5 absolute on gradients of O(1) leave room and catch any missing term.
    rows, weight, bias, targets = _case(n=37, d=16, V=300, dtype=torch.float32)
    loss = linear_cross_entropy(rows, weight, bias, targets, chunk=chunk)
    grads = torch.autograd.grad(loss * 0.5, (rows, weight, bias))  # a scaled loss, as the trainer's 1/n
    ref = F.cross_entropy(F.linear(rows, weight, bias), targets, reduction="sum")
    ref_grads = torch.autograd.grad(ref * 0.5, (rows, weight, bias))
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=0)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_bf16_head_matches_the_reference_within_bf16_rounding():
    # The reference rounds the bf16 matmul's logits once and upcasts them, as the chunks do; a chunk
    # of fewer rows may round a logit to the neighbouring bf16 value: |dz| <= 2^-8 |z| per logit, so
    # |d CE| <= 2 * 2^-8 * max|z| per row (softmax - onehot sums to 2 in absolute value) and the sum
    # of n rows within n times that. The rows' gradient is one bf16 matmul of the same operands:
    # within 2^-7 of its largest element (two roundings of 2^-9 relative, and the bf16 softmax cast).
    rows, weight, bias, targets = _case(n=50, d=32, V=500, dtype=torch.bfloat16, bias=False)
    loss = linear_cross_entropy(rows, weight, None, targets, chunk=8)
    (grad,) = torch.autograd.grad(loss, (rows,))
    logits = F.linear(rows, weight)
    ref = F.cross_entropy(logits.float(), targets, reduction="sum")
    (ref_grad,) = torch.autograd.grad(ref, (rows,))
    bound = 50 * 2 * 2.0 ** -8 * logits.detach().abs().max().float()
    assert abs(loss.item() - ref.item()) <= bound.item()
    assert grad.dtype == torch.bfloat16
    assert (grad.float() - ref_grad.float()).abs().max() <= 2.0 ** -7 * ref_grad.float().abs().max()


def test_no_grad_computes_the_loss_only():
    rows, weight, bias, targets = _case(dtype=torch.float32)
    with torch.no_grad():
        loss = linear_cross_entropy(rows, weight, bias, targets, chunk=3)
    ref = F.cross_entropy(F.linear(rows, weight, bias), targets, reduction="sum")
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=0)


class _Sizes(TorchDispatchMode):
    """The largest tensor any op allocates, in elements (views of existing tensors left out)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view:
            return out
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_no_tensor_of_all_logits_exists_forward_or_backward():
    n, d, V, chunk = 64, 16, 1000, 8
    rows, weight, _, targets = _case(n=n, d=d, V=V, dtype=torch.float32, bias=False)
    weight.requires_grad_(False)  # a frozen head, as under every PEFT method
    sizes = _Sizes()
    with sizes:
        loss = linear_cross_entropy(rows, weight, None, targets, chunk=chunk)
        loss.backward()
    assert sizes.largest == chunk * V  # one chunk's logits; all of them would be 8x that
    with _Sizes() as ref:
        F.cross_entropy(F.linear(rows, weight), targets, reduction="sum").backward()
    assert ref.largest == n * V


def test_a_trained_fp32_head_under_autocast_gets_an_fp32_gradient():
    """recipe=full: fp32 master weights, the head's matmuls in bf16 under autocast."""
    rows, weight, _, targets = _case(n=9, d=8, V=40, dtype=torch.float32, bias=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(rows, weight, None, targets, chunk=4)
    loss.backward()
    assert loss.dtype == torch.float32 and weight.grad.dtype == torch.float32 and rows.grad.dtype == torch.float32
    ref = F.cross_entropy(F.linear(rows.bfloat16(), weight.bfloat16()).float(), targets, reduction="sum")
    # the same bf16 products as the reference: within 9 rows x 2 x 2^-8 x max|z| (see the bf16 test)
    assert abs(loss.item() - ref.item()) <= 9 * 2 * 2.0 ** -8 * F.linear(rows, weight).abs().max().item()


def test_chunk_rows_bound_the_working_set():
    assert chunk_rows(128_256) * 128_256 <= 1 << 24 < (chunk_rows(128_256) + 1) * 128_256
    assert chunk_rows(49_152) == 341
    assert chunk_rows(10**9) == 16  # a floor: a matmul of fewer rows reads the whole head for little work


def test_from_hidden_states_trains_only_labelled_positions():
    torch.manual_seed(0)
    hidden = torch.randn(2, 5, 8, requires_grad=True)
    head = torch.nn.Linear(8, 13, bias=False)
    labels = torch.tensor([[-100, 3, 4, -100, 1], [-100, -100, 2, 9, -100]])
    total, n = sft_loss_from_hidden(hidden, head, labels)
    ref = F.cross_entropy(head(hidden[:, :-1]).reshape(-1, 13), labels[:, 1:].reshape(-1), reduction="sum")
    assert n.item() == 5
    torch.testing.assert_close(total, ref, rtol=1e-5, atol=0)
    total.backward()
    assert hidden.grad[:, -1].abs().sum() == 0 and hidden.grad[0, 0].abs().sum() > 0
