"""The compact fidelity reference of an export (tunekit.export.fidelity.kl_topk): the KL estimate
from the trained model's top-k tokens, against the exact KL."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tunekit.export.fidelity import kl_topk, summarize


# ---------------------------------------------------------------- the compact reference
def _exact_kl(zp: torch.Tensor, zq: torch.Tensor) -> torch.Tensor:
    lp, lq = F.log_softmax(zp, -1), F.log_softmax(zq, -1)
    return (lp.exp() * (lp - lq)).sum(-1)


@pytest.mark.parametrize("spread", [0.02, 3.0])  # a near-uniform distribution (a random model) and a peaked one
def test_topk_kl_estimate_against_the_exact_kl(spread):
    """Noise spread evenly over the vocabulary, as rounding weights spreads it (kl_topk's assumption):
    KL ~ Var_p(d) / 2, and the estimate replaces the tail's variance by the top-k tokens'. Its error
    then is the difference of two weighted sample variances of iid noise: their expectations differ
    by the weights' concentration (E[weighted variance] = (1 - sum w^2) sigma^2, sum w^2 < 0.05 for
    64 tokens of either distribution here) and each mean over 256 positions has a relative standard
    error of about sqrt(2 / (64 * 256)) ~ 1.1%. 10% covers both with room; the lower bound (top-k +
    one tail bucket) holds exactly."""
    torch.manual_seed(0)
    zp = spread * torch.randn(256, 8192)
    ids, vals, lse = summarize(zp)
    for sigma in (0.01, 0.1):
        zq = zp + sigma * torch.randn_like(zp)
        est, tail = kl_topk(ids, vals, lse, zq)
        exact = _exact_kl(zp, zq)
        assert abs(est.mean() / exact.mean() - 1) < 0.10, (spread, sigma, est.mean(), exact.mean())
        assert (tail > 0).all() and (tail < 1).all()
    assert torch.equal(kl_topk(ids, vals, lse, zp.clone())[0], torch.zeros(256))  # identical logits: exactly 0


def test_topk_kl_reads_high_when_only_the_top_tokens_move():
    """An export that loses what the fine-tune raised moves the top tokens: the estimate reads at least
    the exact KL there (the side on which a gate may refuse), and it never reads below the lower bound."""
    torch.manual_seed(0)
    zp = 3.0 * torch.randn(128, 8192)
    ids, vals, lse = summarize(zp)
    zq = zp.clone()
    zq.scatter_add_(1, ids[:, :8], torch.full((128, 8), -0.5))
    est, _ = kl_topk(ids, vals, lse, zq)
    assert est.mean() >= _exact_kl(zp, zq).mean()
