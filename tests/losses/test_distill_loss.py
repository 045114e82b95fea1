"""Distillation losses: divergences vs hand-written formulas, gradchecks, masking, chunking."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from tunekit.losses.distill import (
    DIVERGENCES,
    chunked_distill_loss,
    distill_loss,
    divergence,
    forward_kl,
    generalized_jsd,
    reverse_kl,
)
from tunekit.losses.sft import IGNORE, sft_loss

# fp64 checks test the formula itself (only rounding differences between two exact expressions);
# fp32 checks compare two fp32 computations that sum/accumulate in a different order (chunks,
# separate log_softmax passes), so they agree to a few ulps of the summed magnitude, not exactly.
TOL = {
    torch.float64: dict(rtol=1e-10, atol=1e-12),
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    # bf16 gradients: the two paths round the same fp32 values to bf16 (8-bit mantissa) at
    # different points (whole-batch vs per-chunk matmuls), so they differ by a few bf16 ulps.
    torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
}

V = 11  # deliberately odd, tiny vocabulary


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # Tensors here are tiny: intra-op threads only add overhead, and on a busy 2-core box their
    # spin-waiting made the gradchecks ~50x slower. Restored afterwards for the rest of the suite.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _logits(*shape, dtype=torch.float64, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype) * scale


def _labels(batch, seq, vocab=V, seed=0, p_ignore=0.3):
    g = torch.Generator().manual_seed(seed + 1000)
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    labels[torch.rand(batch, seq, generator=g) < p_ignore] = IGNORE
    labels[0, 1] = 3  # at least one trained token whatever the seed
    return labels


# Direct formulas, written out with exp/log of explicit softmaxes (no log_softmax).
def _softmax_direct(z, t):
    e = torch.exp(z / t - (z / t).max(-1, keepdim=True).values)
    return e / e.sum(-1, keepdim=True)


def _kl_direct(p, q):
    return (p * (torch.log(p) - torch.log(q))).sum(-1)


def _div_direct(kind, s, t, temperature, beta):
    ps, pt = _softmax_direct(s, temperature), _softmax_direct(t, temperature)
    if kind == "forward_kl":
        return _kl_direct(pt, ps)
    if kind == "reverse_kl":
        return _kl_direct(ps, pt)
    m = beta * pt + (1 - beta) * ps
    return beta * _kl_direct(pt, m) + (1 - beta) * _kl_direct(ps, m)


def _distill_direct(s, t, labels, alpha, temperature, kind, beta):
    """Per-token loss summed over trained tokens, looping over positions explicitly."""
    total, n = torch.zeros((), dtype=s.dtype), 0
    for b in range(s.shape[0]):
        for pos in range(s.shape[1] - 1):
            y = labels[b, pos + 1].item()
            if y == IGNORE:
                continue
            ce = -torch.log(_softmax_direct(s[b, pos], 1.0)[y])
            d = _div_direct(kind, s[b, pos], t[b, pos], temperature, beta)
            total = total + alpha * ce + (1 - alpha) * temperature**2 * d
            n += 1
    return total, n


@pytest.mark.parametrize("temperature", [1.0, 2.5])
@pytest.mark.parametrize("kind", DIVERGENCES)
def test_divergence_matches_direct_formula(kind, temperature):
    s, t = _logits(6, V, seed=1), _logits(6, V, seed=2)
    for beta in ([0.5, 0.1, 0.9] if kind == "jsd" else [0.5]):
        got = divergence(s, t, kind, beta=beta, temperature=temperature)
        want = _div_direct(kind, s, t, temperature, beta)
        assert got.shape == (6,)
        torch.testing.assert_close(got, want, **TOL[torch.float64])
        assert (got >= 0).all()


def test_named_functions_and_fp32_upcast():
    s, t = _logits(4, V, seed=3), _logits(4, V, seed=4)
    torch.testing.assert_close(forward_kl(s, t, 2.0), divergence(s, t, "forward_kl", temperature=2.0))
    torch.testing.assert_close(reverse_kl(s, t), divergence(s, t, "reverse_kl"))
    torch.testing.assert_close(generalized_jsd(s, t, 0.3), divergence(s, t, "jsd", beta=0.3))
    # bf16 logits are upcast: the result is fp32 and equals the fp32 computation on the same values.
    sb, tb = s.to(torch.bfloat16), t.to(torch.bfloat16)
    out = forward_kl(sb, tb)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, forward_kl(sb.float(), tb.float()), rtol=0, atol=0)


def test_jsd_symmetric_at_half_and_bounded_by_log2():
    s, t = _logits(5, V, seed=5, scale=10.0), _logits(5, V, seed=6, scale=10.0)
    a, b = generalized_jsd(s, t, 0.5), generalized_jsd(t, s, 0.5)
    torch.testing.assert_close(a, b, **TOL[torch.float64])
    assert (a <= math.log(2) + 1e-12).all()


@pytest.mark.parametrize("beta", [0.0, 1.0, -0.1, 1.5])
def test_jsd_beta_outside_open_interval_raises(beta):
    s = _logits(2, V)
    with pytest.raises(ValueError, match="beta"):
        generalized_jsd(s, s, beta)
    with pytest.raises(ValueError, match="beta"):
        distill_loss(s[None], s[None], torch.zeros(1, 2, dtype=torch.long), 0.5, 1.0, "jsd", beta)


@pytest.mark.parametrize("kind", DIVERGENCES)
def test_divergence_gradcheck(kind):
    s = _logits(3, 5, seed=7).requires_grad_()
    t = _logits(3, 5, seed=8).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: divergence(a, b, kind, beta=0.3, temperature=1.7), (s, t))


@pytest.mark.parametrize("kind", DIVERGENCES)
def test_distill_loss_matches_direct_and_gradcheck(kind):
    s, t = _logits(2, 6, V, seed=9), _logits(2, 6, V, seed=10)
    labels = _labels(2, 6)
    loss, n = distill_loss(s, t, labels, alpha=0.3, temperature=2.0, divergence=kind, beta=0.4)
    want, want_n = _distill_direct(s, t, labels, 0.3, 2.0, kind, 0.4)
    assert n.item() == want_n and n.dtype == torch.int64
    torch.testing.assert_close(loss, want, **TOL[torch.float64])
    s_small = _logits(2, 4, 5, seed=11).requires_grad_()
    t_small = _logits(2, 4, 5, seed=12)
    lab = torch.tensor([[0, 1, IGNORE, 4], [0, IGNORE, 2, 3]])
    assert torch.autograd.gradcheck(
        lambda a: distill_loss(a, t_small, lab, 0.3, 2.0, kind, 0.4)[0], (s_small,))


def test_no_gradient_into_teacher_logits():
    s = _logits(1, 4, V, seed=13).requires_grad_()
    t = _logits(1, 4, V, seed=14).requires_grad_()
    distill_loss(s, t, _labels(1, 4), 0.5, 2.0)[0].backward()
    assert t.grad is None and s.grad is not None


@pytest.mark.parametrize("kind", DIVERGENCES)
def test_temperature(kind):
    s, t = _logits(2, 5, V, seed=15), _logits(2, 5, V, seed=16)
    labels = _labels(2, 5)
    mask = labels[:, 1:] != IGNORE
    rows_s, rows_t = s[:, :-1][mask], t[:, :-1][mask]
    for temperature in (0.5, 1.0, 3.0):
        # alpha = 0: the loss is exactly T^2 * sum of the divergence between the softened distributions.
        loss, _ = distill_loss(s, t, labels, 0.0, temperature, kind)
        soft = divergence(rows_s / temperature, rows_t / temperature, kind)  # softening == dividing logits
        torch.testing.assert_close(loss, temperature**2 * soft.sum(), **TOL[torch.float64])
    # T = 1 reduces to the plain (unsoftened, unscaled) divergence.
    torch.testing.assert_close(distill_loss(s, t, labels, 0.0, 1.0, kind)[0],
                               divergence(rows_s, rows_t, kind).sum(), **TOL[torch.float64])
    # Higher temperature flattens the distributions: the divergence itself shrinks.
    assert divergence(rows_s, rows_t, kind, temperature=4.0).sum() < divergence(rows_s, rows_t, kind).sum()
    # Identical logits: zero divergence at any temperature, so alpha = 0 gives zero loss.
    for temperature in (1.0, 2.0):
        torch.testing.assert_close(distill_loss(s, s.clone(), labels, 0.0, temperature, kind)[0],
                                   torch.zeros((), dtype=s.dtype), **TOL[torch.float64])


@pytest.mark.parametrize("kind", DIVERGENCES)
def test_masked_positions_do_not_matter(kind):
    s = _logits(2, 7, V, seed=17).requires_grad_()
    t = _logits(2, 7, V, seed=18)
    labels = _labels(2, 7)
    loss, n = distill_loss(s, t, labels, 0.4, 2.0, kind)
    loss.backward()
    untrained = torch.ones(2, 7, dtype=torch.bool)
    untrained[:, :-1] = labels[:, 1:] == IGNORE  # the last position predicts nothing
    assert untrained.any() and (~untrained).any()
    # No gradient on positions that predict an untrained token (or nothing).
    assert (s.grad[untrained] == 0).all()
    assert (s.grad[~untrained].abs().sum(-1) > 0).all()
    # Arbitrary changes there leave the loss unchanged.
    s2, t2 = s.detach().clone(), t.clone()
    s2[untrained] = 1e3 * torch.randn_like(s2[untrained])
    t2[untrained] = -1e3
    loss2, n2 = distill_loss(s2, t2, labels, 0.4, 2.0, kind)
    assert torch.equal(loss.detach(), loss2) and n == n2 == (~untrained).sum()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_alpha_one_equals_sft_loss(dtype):
    s, t = _logits(3, 6, V, dtype=dtype, seed=19), _logits(3, 6, V, dtype=dtype, seed=20)
    labels = _labels(3, 6)
    for kind in DIVERGENCES:
        loss, n = distill_loss(s, t, labels, alpha=1.0, temperature=3.0, divergence=kind)
        ref, ref_n = sft_loss(s, labels)  # sft_loss computes in fp32 even for fp64 input
        assert n == ref_n
        torch.testing.assert_close(loss.float(), ref, **TOL[torch.float32])


def test_vocab_mismatch_raises():
    s, t = _logits(1, 4, V), _logits(1, 4, V + 2)
    with pytest.raises(ValueError, match=rf"teacher vocab size {V + 2} != student vocab size {V}"):
        distill_loss(s, t, _labels(1, 4), 0.5, 2.0)
    h = _logits(1, 4, 6)
    with pytest.raises(ValueError, match=rf"teacher vocab size {V + 2} != student vocab size {V}"):
        chunked_distill_loss(h, _logits(V, 6), h, _logits(V + 2, 6), _labels(1, 4), 0.5, 2.0)


def test_bad_arguments_raise():
    s = _logits(1, 4, V)
    labels = _labels(1, 4)
    with pytest.raises(ValueError, match="alpha"):
        distill_loss(s, s, labels, 1.5, 1.0)
    with pytest.raises(ValueError, match="temperature"):
        distill_loss(s, s, labels, 0.5, 0.0)
    with pytest.raises(ValueError, match="unknown divergence"):
        distill_loss(s, s, labels, 0.5, 1.0, "tvd")
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_distill_loss(s, _logits(V, V), s, _logits(V, V), labels, 0.5, 1.0, chunk_size=0)
    with pytest.raises(TypeError, match="nn.Linear"):
        chunked_distill_loss(s, nn.Sequential(nn.Linear(V, V)), s, _logits(V, V), labels, 0.5, 1.0)


# --- chunked path ----------------------------------------------------------------------------


def _chunk_setup(dtype, batch=3, seq=14, hs=6, ht=5, vocab=V, seed=21, head_bias=True):
    """Shapes chosen so 3 * 13 shifted positions minus ignored ones leave an awkward token count."""
    g = torch.Generator().manual_seed(seed)
    h_s = torch.randn(batch, seq, hs, generator=g, dtype=dtype).requires_grad_()
    w_s = torch.randn(vocab, hs, generator=g, dtype=dtype).requires_grad_()
    b_s = torch.randn(vocab, generator=g, dtype=dtype).requires_grad_() if head_bias else None
    h_t = torch.randn(batch, seq, ht, generator=g, dtype=dtype)
    w_t = torch.randn(vocab, ht, generator=g, dtype=dtype)
    b_t = torch.randn(vocab, generator=g, dtype=dtype)
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    labels[:, :2] = IGNORE  # a "prompt"
    labels[1, 5:9] = IGNORE
    return h_s, w_s, b_s, h_t, w_t, b_t, labels


def _unchunked(h_s, w_s, b_s, h_t, w_t, b_t, labels, *args):
    s = torch.nn.functional.linear(h_s, w_s, b_s)
    t = torch.nn.functional.linear(h_t, w_t, b_t)
    return distill_loss(s, t, labels, *args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", DIVERGENCES)
def test_chunked_equals_unchunked(kind, dtype):
    h_s, w_s, b_s, h_t, w_t, b_t, labels = _chunk_setup(dtype)
    args = (0.3, 2.0, kind, 0.7)
    ref, ref_n = _unchunked(h_s, w_s, b_s, h_t, w_t, b_t, labels, *args)
    assert ref_n.item() == 3 * 12 - 4  # 32 tokens: not a multiple of 7
    ref_grads = torch.autograd.grad(ref, (h_s, w_s, b_s))
    for chunk in (7, 1, 32, 4096):  # 7 rows: last chunk partial; 4096: larger than the token count
        loss, n = chunked_distill_loss(h_s, w_s, h_t, w_t, labels, *args, chunk_size=chunk,
                                       student_bias=b_s, teacher_bias=b_t)
        assert n == ref_n and loss.dtype == dtype
        torch.testing.assert_close(loss, ref, **TOL[dtype])
        for got, want in zip(torch.autograd.grad(loss, (h_s, w_s, b_s)), ref_grads):
            torch.testing.assert_close(got, want, **TOL[dtype])


def test_chunked_37_tokens_in_chunks_of_7_with_linear_heads():
    torch.manual_seed(22)
    batch, seq = 1, 38  # all trained: 37 shifted positions
    student_head, teacher_head = nn.Linear(6, V, bias=False), nn.Linear(5, V)
    h_s = torch.randn(batch, seq, 6, requires_grad=True)
    h_t = torch.randn(batch, seq, 5)
    labels = torch.randint(0, V, (batch, seq))
    ref, ref_n = distill_loss(student_head(h_s), teacher_head(h_t), labels, 0.5, 1.5, "reverse_kl")
    ref_grads = torch.autograd.grad(ref, (h_s, student_head.weight))
    loss, n = chunked_distill_loss(h_s, student_head, h_t, teacher_head, labels, 0.5, 1.5,
                                   "reverse_kl", chunk_size=7)
    assert n.item() == ref_n.item() == 37
    torch.testing.assert_close(loss, ref, **TOL[torch.float32])
    loss.backward()
    torch.testing.assert_close(h_s.grad, ref_grads[0], **TOL[torch.float32])
    torch.testing.assert_close(student_head.weight.grad, ref_grads[1], **TOL[torch.float32])
    assert teacher_head.weight.grad is None  # the teacher is a fixed target


@pytest.mark.parametrize("kind", DIVERGENCES)
def test_chunked_gradcheck(kind):
    h_s, w_s, b_s, h_t, w_t, b_t, labels = _chunk_setup(torch.float64, batch=2, seq=5, hs=3, ht=4, vocab=5)
    assert torch.autograd.gradcheck(
        lambda h, w, b: chunked_distill_loss(h, w, h_t, w_t, labels, 0.4, 1.8, kind, 0.3, chunk_size=2,
                                             student_bias=b, teacher_bias=b_t)[0],
        (h_s, w_s, b_s))


def test_chunked_frozen_head_gets_no_grad():
    h_s, w_s, _, h_t, w_t, _, labels = _chunk_setup(torch.float32, head_bias=False)
    w_s.requires_grad_(False)
    loss, _ = chunked_distill_loss(h_s, w_s, h_t, w_t, labels, 0.5, 2.0, chunk_size=5)
    loss.backward()
    assert w_s.grad is None and h_s.grad is not None and h_s.grad.abs().sum() > 0


@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_chunked_alpha_edges(alpha):
    h_s, w_s, b_s, h_t, w_t, b_t, labels = _chunk_setup(torch.float64)
    ref, _ = _unchunked(h_s, w_s, b_s, h_t, w_t, b_t, labels, alpha, 2.0, "jsd", 0.5)
    loss, _ = chunked_distill_loss(h_s, w_s, h_t, w_t, labels, alpha, 2.0, "jsd", 0.5, chunk_size=4,
                                   student_bias=b_s, teacher_bias=b_t)
    torch.testing.assert_close(loss, ref, **TOL[torch.float64])


def test_chunked_zero_trained_tokens():
    h_s, w_s, b_s, h_t, w_t, b_t, labels = _chunk_setup(torch.float32)
    labels[:] = IGNORE
    loss, n = chunked_distill_loss(h_s, w_s, h_t, w_t, labels, 0.5, 2.0, chunk_size=7,
                                   student_bias=b_s, teacher_bias=b_t)
    assert loss.item() == 0.0 and n.item() == 0 and loss.dtype == torch.float32
    loss.backward()
    assert (h_s.grad == 0).all() and (w_s.grad == 0).all() and (b_s.grad == 0).all()


def test_chunked_bf16_inputs():
    """bf16 hidden states and head: logits are formed in bf16 (as the model would), the loss in fp32."""
    h_s, w_s, b_s, h_t, w_t, b_t, labels = _chunk_setup(torch.float32, head_bias=False)
    h_s, w_s = h_s.detach().bfloat16().requires_grad_(), w_s.detach().bfloat16().requires_grad_()
    h_t, w_t = h_t.bfloat16(), w_t.bfloat16()
    ref, _ = _unchunked(h_s, w_s, None, h_t, w_t, None, labels, 0.5, 2.0, "jsd", 0.5)
    ref_grads = torch.autograd.grad(ref, (h_s, w_s))
    loss, _ = chunked_distill_loss(h_s, w_s, h_t, w_t, labels, 0.5, 2.0, "jsd", 0.5, chunk_size=7)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref, **TOL[torch.float32])
    for got, want in zip(torch.autograd.grad(loss, (h_s, w_s)), ref_grads):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got, want, **TOL[torch.bfloat16])
