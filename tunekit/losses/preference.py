"""Preference losses: from per-sequence log-probabilities to one loss per pair (or per row), plus the
implicit rewards the trainer logs.

Every function here is pure: it takes the summed log-probability of each completion's trained tokens
under the trained model (`chosen`, `rejected`: (pairs,) fp32) and, for the losses that need one, under
the reference model (`ref_chosen`, `ref_rejected`), and returns `Losses(per_pair, chosen_rewards,
rejected_rewards)`. The trainer averages `per_pair` over the pairs of the global batch. Formulas and
defaults follow TRL 1.16 (tests/losses/test_preference_losses.py checks each against TRL's own code):

- DPO (Rafailov et al. 2023, "Direct Preference Optimization", arXiv:2305.18290): TRL's `sigmoid`,
  -log sigmoid(beta * ((c - c_ref) - (r - r_ref))), beta 0.1. `label_smoothing` eps > 0 gives
  conservative DPO (cDPO, Mitchell 2023): -(1 - eps) log sigmoid(beta d) - eps log sigmoid(-beta d),
  the form TRL's CPO trainer uses for `sigmoid` (TRL's DPOTrainer reads label_smoothing only for its
  `robust` and `exo_pair` losses, not offered here).
- IPO (Azar et al. 2023, "A General Theoretical Paradigm...", arXiv:2310.12036): TRL's `ipo`,
  (d / n - 1 / (2 beta))^2 where each log-ratio is divided by its completion's trained tokens first
  (TRL normalises per token, as the IPO authors' results do). beta is the paper's tau.
- ORPO (Hong et al. 2024, "ORPO: Monolithic Preference Optimization without Reference Model",
  arXiv:2403.07691): reference-free. On length-averaged log-probs (TRL's ORPO uses
  average_log_prob=True): log odds = (c - r) - (log(1 - e^c) - log(1 - e^r)); the loss is the chosen
  completions' NLL (per token, TRL's `policy_nll_loss`) minus beta * log sigmoid(log odds); beta 0.1
  is the paper's lambda.
- SimPO (Meng et al. 2024, "SimPO: Simple Preference Optimization with a Reference-Free Reward",
  arXiv:2405.14734): reference-free, TRL's CPO trainer with loss_type=simpo and cpo_alpha=0 (pure
  SimPO, no NLL term): -log sigmoid(beta * (c / n_c - r / n_r) - gamma), beta 0.1 and gamma 0.5 as in
  TRL (the paper tunes beta 2-2.5 and gamma/beta 0.3-0.5 per model).
- KTO (Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic Optimization",
  arXiv:2402.01306): unpaired rows, each desirable or undesirable. Desirable: 1 - sigmoid(beta (l - kl)),
  undesirable: 1 - sigmoid(beta (kl - l)), l the row's log-ratio to the reference, weighted by
  desirable_weight / undesirable_weight (1.0 each). `kl` is the reference point: TRL's estimate of
  KL(policy || ref) from mismatched prompt/completion pairs, the mean of their log-ratios, clamped at 0
  and detached (`kto_kl_estimate`; the trainer computes it per micro-batch, preference.kto_kl=batch),
  or 0 (preference.kto_kl=zero: the same loss as TRL's `apo_zero_unpaired`).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

LOSSES = ("dpo", "ipo", "orpo", "simpo", "kto")
REFERENCE_FREE = ("orpo", "simpo")


def has_reference(loss: str) -> bool:
    """Whether a preference loss scores against a reference model (dpo, ipo, kto); orpo and simpo need none."""
    return loss not in REFERENCE_FREE


class Losses(NamedTuple):
    """per_pair: (pairs,) the loss of each pair (KTO: of each row); chosen / rejected rewards: (pairs,)
    the implicit rewards TRL logs as rewards/chosen and rewards/rejected (detached). For KTO,
    chosen holds the desirable rows' rewards and rejected the undesirable rows'."""

    per_pair: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor


def dpo_loss(chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor, ref_rejected: torch.Tensor,
             beta: float = 0.1, label_smoothing: float = 0.0) -> Losses:
    """DPO (TRL `sigmoid`), conservative with label_smoothing > 0."""
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    d = beta * (chosen_ratio - rejected_ratio)
    losses = -F.logsigmoid(d) * (1 - label_smoothing) - F.logsigmoid(-d) * label_smoothing
    return Losses(losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach())


def ipo_loss(chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor, ref_rejected: torch.Tensor,
             chosen_tokens: torch.Tensor, rejected_tokens: torch.Tensor, beta: float = 0.1) -> Losses:
    """IPO (TRL `ipo`): each log-ratio averaged over its completion's trained tokens."""
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    d = chosen_ratio / chosen_tokens.clamp(min=1) - rejected_ratio / rejected_tokens.clamp(min=1)
    losses = (d - 1 / (2 * beta)) ** 2
    return Losses(losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach())


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, stable at both ends (Maechler 2012, TRL's log1mexp)."""
    return torch.where(x > -0.6931471805599453, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def orpo_loss(chosen: torch.Tensor, rejected: torch.Tensor, chosen_tokens: torch.Tensor,
              rejected_tokens: torch.Tensor, beta: float = 0.1) -> Losses:
    """ORPO: the chosen completion's per-token NLL minus beta * log sigmoid(log odds ratio), per pair.

    `chosen`, `rejected` are summed log-probs; ORPO works on their per-token averages. TRL's NLL term is
    one mean over all chosen tokens of the batch; here it is each pair's own per-token mean, which is the
    same where the chosen completions have equal lengths (the trainer averages per_pair over pairs).
    Rewards as TRL logs them: beta x the averaged log-probs."""
    c, r = chosen / chosen_tokens.clamp(min=1), rejected / rejected_tokens.clamp(min=1)
    log_odds = (c - r) - (_log1mexp(c) - _log1mexp(r))
    losses = -c - beta * F.logsigmoid(log_odds)
    return Losses(losses, beta * c.detach(), beta * r.detach())


def simpo_loss(chosen: torch.Tensor, rejected: torch.Tensor, chosen_tokens: torch.Tensor,
               rejected_tokens: torch.Tensor, beta: float = 0.1, gamma: float = 0.5,
               label_smoothing: float = 0.0) -> Losses:
    """SimPO (TRL CPO `simpo`, cpo_alpha 0): length-normalised log-probs, target margin gamma."""
    c, r = chosen / chosen_tokens.clamp(min=1), rejected / rejected_tokens.clamp(min=1)
    d = beta * ((c - r) - gamma / beta)
    losses = -F.logsigmoid(d) * (1 - label_smoothing) - F.logsigmoid(-d) * label_smoothing
    return Losses(losses, beta * c.detach(), beta * r.detach())


def kto_loss(logps: torch.Tensor, ref_logps: torch.Tensor, desirable: torch.Tensor, beta: float = 0.1,
             kl: Optional[torch.Tensor] = None, desirable_weight: float = 1.0,
             undesirable_weight: float = 1.0) -> Losses:
    """KTO per row (`desirable`: (rows,) bool). kl None: the zero-KL variant (module docstring).

    Returns per-row losses (weighted) and the rewards beta * (logps - ref_logps) of the desirable rows
    (chosen) and of the undesirable rows (rejected)."""
    ratio = logps - ref_logps
    kl = torch.zeros((), dtype=ratio.dtype, device=ratio.device) if kl is None else kl.clamp(min=0)
    good = desirable_weight * (1 - torch.sigmoid(beta * (ratio - kl)))
    bad = undesirable_weight * (1 - torch.sigmoid(beta * (kl - ratio)))
    losses = torch.where(desirable, good, bad)
    rewards = beta * ratio.detach()
    return Losses(losses, rewards[desirable], rewards[~desirable])


def kto_kl_estimate(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """KTO's reference point from the mismatched rows' summed log-probs under the policy and the reference
    (each (rows,)): the mean log-ratio, clamped at 0, with no gradient (TRL's `kl`)."""
    return (logps.detach().float() - ref_logps.detach().float()).mean().clamp(min=0)


def pair_losses(kind: str, chosen, rejected, ref_chosen, ref_rejected, chosen_tokens, rejected_tokens,
                beta: float, label_smoothing: float, gamma: float) -> Losses:
    """The paired loss `kind` (dpo | ipo | orpo | simpo); ref_* are None for orpo and simpo."""
    if kind == "dpo":
        return dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta, label_smoothing)
    if kind == "ipo":
        return ipo_loss(chosen, rejected, ref_chosen, ref_rejected, chosen_tokens, rejected_tokens, beta)
    if kind == "orpo":
        return orpo_loss(chosen, rejected, chosen_tokens, rejected_tokens, beta)
    if kind == "simpo":
        return simpo_loss(chosen, rejected, chosen_tokens, rejected_tokens, beta, gamma, label_smoothing)
    raise ValueError(f"unknown paired preference loss {kind!r}")
