"""The preference losses (tunekit.losses.preference) against TRL's own loss code on the same
per-sequence log-probabilities.

TRL computes DPO and KTO inline in its trainers' `_compute_loss`: DPO's is called on a stand-in trainer
whose model returns the per-token log-probs given, the reference log-probs going in as TRL's precomputed
ones (tests/_helpers.trl_dpo_loss); KTO's needs a real model for its two forwards and is copied term by
term. ORPO's `odds_ratio_loss` and CPO's `cpo_loss` (SimPO, cDPO) are called directly.

Tolerance: both sides compute in fp32 from the same fp32 inputs, a handful of elementwise ops (one
subtraction of sums of up to 8 per-token values of magnitude <= 10, a logsigmoid or square), so they
agree to a few fp32 ulps of the largest intermediate (~80, ulp 7.6e-6): atol 1e-4 leaves room for the
different order of operations (TRL sums per-token values, the test's sums are formed the same way) and
stays far below any formula difference (a missing factor or sign changes values by >= 1e-2 here).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from _helpers import trl_dpo_loss
from tunekit.losses import preference as P

ATOL = 1e-4
PAIRS, WIDTH = 4, 9  # 4 pairs, sequences of 9 tokens (8 predicted positions)


def _per_token():
    """(per-token logps (2P, W-1) in TRL's [chosen; rejected] order, completion mask (2P, W), the same for
    the reference): prompts of 2-4 tokens, completions of 2-6, log-probs in [-3, 0)."""
    g = torch.Generator().manual_seed(0)
    mask = torch.zeros(2 * PAIRS, WIDTH, dtype=torch.long)
    for i in range(2 * PAIRS):
        start = int(torch.randint(2, 5, (1,), generator=g))
        length = int(torch.randint(2, WIDTH - start + 1, (1,), generator=g))
        mask[i, start : start + length] = 1
    logps = -3 * torch.rand(2 * PAIRS, WIDTH - 1, generator=g) * mask[:, 1:]
    ref = -3 * torch.rand(2 * PAIRS, WIDTH - 1, generator=g) * mask[:, 1:]
    return logps, ref, mask


class _Acc:
    device = torch.device("cpu")

    def gather(self, x):
        return x

    gather_for_metrics = gather


@pytest.mark.parametrize("loss,beta", [("dpo", 0.1), ("dpo", 0.5), ("ipo", 0.1), ("ipo", 0.3)])
def test_dpo_and_ipo_equal_trl(loss, beta):
    logps, ref, mask = _per_token()
    trl_loss, metrics = trl_dpo_loss(logps, ref.sum(1), mask, beta, "sigmoid" if loss == "dpo" else "ipo")
    s, rs, n = logps.sum(1), ref.sum(1), mask.sum(1)
    c, r, rc, rr = s[:PAIRS], s[PAIRS:], rs[:PAIRS], rs[PAIRS:]
    ours = (P.dpo_loss(c, r, rc, rr, beta) if loss == "dpo" else
            P.ipo_loss(c, r, rc, rr, n[:PAIRS], n[PAIRS:], beta))
    assert float(ours.per_pair.mean()) == pytest.approx(float(trl_loss), abs=ATOL)
    assert float(ours.chosen_rewards.mean()) == pytest.approx(metrics["rewards/chosen"][0], abs=ATOL)
    assert float(ours.rejected_rewards.mean()) == pytest.approx(metrics["rewards/rejected"][0], abs=ATOL)
    margin = ours.chosen_rewards - ours.rejected_rewards
    assert float(margin.mean()) == pytest.approx(metrics["rewards/margins"][0], abs=ATOL)
    assert float((margin > 0).float().mean()) == pytest.approx(metrics["rewards/accuracies"][0], abs=ATOL)


def _sums():
    logps, ref, mask = _per_token()
    s, rs, n = logps.sum(1), ref.sum(1), mask[:, 1:].sum(1)
    return s[:PAIRS], s[PAIRS:], rs[:PAIRS], rs[PAIRS:], n[:PAIRS], n[PAIRS:]


@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_conservative_dpo_equals_trl_cpo_sigmoid(smoothing):
    """TRL's DPOTrainer has no label-smoothed sigmoid; its CPO trainer's `sigmoid` on the log-ratios is cDPO."""
    from trl.experimental.cpo import CPOTrainer

    c, r, rc, rr, _, _ = _sums()
    t = SimpleNamespace(beta=0.1, label_smoothing=smoothing, loss_type="sigmoid", alpha=0.0, accelerator=_Acc())
    trl_losses = CPOTrainer.cpo_loss(t, c - rc, r - rr)[0]
    ours = P.dpo_loss(c, r, rc, rr, 0.1, smoothing)
    torch.testing.assert_close(ours.per_pair, trl_losses, atol=ATOL, rtol=0)


@pytest.mark.parametrize("beta,gamma", [(0.1, 0.5), (2.0, 1.0)])
def test_simpo_equals_trl_cpo_simpo(beta, gamma):
    """TRL's SimPO takes length-averaged log-probs (average_log_prob for loss_type simpo)."""
    from trl.experimental.cpo import CPOTrainer

    c, r, _, _, nc, nr = _sums()
    t = SimpleNamespace(beta=beta, label_smoothing=0.0, loss_type="simpo", simpo_gamma=gamma, alpha=0.0,
                        accelerator=_Acc())
    trl_losses, trl_chosen, trl_rejected = CPOTrainer.cpo_loss(t, c / nc, r / nr)
    ours = P.simpo_loss(c, r, nc, nr, beta, gamma)
    torch.testing.assert_close(ours.per_pair, trl_losses, atol=ATOL, rtol=0)
    torch.testing.assert_close(ours.chosen_rewards, trl_chosen, atol=ATOL, rtol=0)
    torch.testing.assert_close(ours.rejected_rewards, trl_rejected, atol=ATOL, rtol=0)


def test_orpo_equals_trl_odds_ratio_plus_nll():
    """TRL's ORPO: mean NLL of the chosen tokens minus the mean of beta * log sigmoid(log odds). With
    chosen completions of equal length (here: all of 4 tokens), the NLL term is each pair's own mean."""
    from trl.experimental.orpo import ORPOTrainer

    g = torch.Generator().manual_seed(1)
    tokens = torch.full((PAIRS,), 4)
    c_tok = -2 * torch.rand(PAIRS, 4, generator=g)
    c, r, nr = c_tok.sum(1), -2 * torch.rand(PAIRS, generator=g) * 5, torch.full((PAIRS,), 5)
    t = SimpleNamespace(beta=0.1, accelerator=_Acc())
    ratio_losses, trl_chosen, trl_rejected, _, _ = ORPOTrainer.odds_ratio_loss(t, c / tokens, r / nr)
    trl_loss = -c_tok.mean() - ratio_losses.mean()  # TRL: policy_nll_loss - losses.mean()
    ours = P.orpo_loss(c, r, tokens, nr, 0.1)
    assert float(ours.per_pair.mean()) == pytest.approx(float(trl_loss), abs=ATOL)
    torch.testing.assert_close(ours.chosen_rewards, trl_chosen, atol=ATOL, rtol=0)
    torch.testing.assert_close(ours.rejected_rewards, trl_rejected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("with_kl", [False, True])
def test_kto_equals_trl_formula(with_kl):
    """TRL's KTO loss (kto_trainer._compute_loss, Eqn 7; `apo_zero_unpaired` is the zero-KL form): copied
    here term by term, as TRL computes it inline between two forwards of a real model."""
    g = torch.Generator().manual_seed(2)
    logps, ref = -20 * torch.rand(6, generator=g), -20 * torch.rand(6, generator=g)
    desirable = torch.tensor([True, False, True, True, False, False])
    beta, kl = 0.1, (torch.tensor(0.7) if with_kl else None)
    k = kl if with_kl else torch.zeros(())
    ratio = logps - ref
    chosen = 1 - torch.sigmoid(beta * (ratio[desirable] - k))
    if with_kl:
        rejected = 1 - torch.sigmoid(beta * (k - ratio[~desirable]))
    else:  # apo_zero_unpaired's own form of the undesirable term
        rejected = torch.sigmoid(beta * ratio[~desirable])
    trl_mean = torch.cat([1.0 * chosen, 1.0 * rejected]).mean()
    ours = P.kto_loss(logps, ref, desirable, beta, kl)
    assert float(ours.per_pair.mean()) == pytest.approx(float(trl_mean), abs=ATOL)
    torch.testing.assert_close(ours.chosen_rewards, beta * ratio[desirable], atol=ATOL, rtol=0)


def test_sequence_logps_and_their_gradients_equal_plain_log_softmax(monkeypatch):
    """Chunked per-sequence log-probs (5 rows a chunk here, so chunks straddle sequences) against
    log_softmax of all logits, in float64 where the chunked path also stays in float64 up to its fp32
    log-sum-exp: the values agree to fp32 rounding of logits of magnitude ~5 (ulp 4.8e-7) summed over
    <= 5 tokens, so atol 1e-5; gradients (to hidden states, head weight and bias) likewise."""
    from tunekit.losses import logps as L

    monkeypatch.setattr(L, "chunk_rows", lambda vocab: 5)
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 50).double()
    hidden = torch.randn(3, 6, 8, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 50, (3, 6))
    labels[0, :3] = labels[2, :5] = P_IGNORE = -100
    sums, counts = L.sequence_logps(hidden, head, labels)
    shift = labels[:, 1:]
    per_token = torch.log_softmax(head(hidden)[:, :-1], -1).gather(2, shift.clamp(min=0)[..., None]).squeeze(-1)
    want = (per_token * (shift != P_IGNORE)).sum(1)
    assert counts.tolist() == [3, 5, 1]
    torch.testing.assert_close(sums.double(), want, atol=1e-5, rtol=0)
    w = torch.tensor([0.3, -1.2, 2.0], dtype=torch.float64)
    got = torch.autograd.grad((sums.double() * w).sum(), [hidden, head.weight, head.bias])
    ref = torch.autograd.grad((want * w).sum(), [hidden, head.weight, head.bias])
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
