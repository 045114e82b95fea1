"""Held-out preference rows scored as a preference run trained on them (`tunekit eval`, export's task check).

A pair is scored by the implied rewards of the run's own loss, computed by the training code itself:
the summed log-probability of each completion's trained tokens comes from tunekit.losses.logps (the head
a chunk of rows at a time, never the whole logits), the rewards from tunekit.losses.preference:

  dpo, ipo, kto   beta x (log p(completion) - log p_ref(completion)): the reference is the run's base,
                  the trained model with its trained part switched off (as in training)
  orpo, simpo     beta x the per-token mean log-probability (no reference), as TRL logs them

  preference accuracy   share of pairs whose chosen reward exceeds the rejected one (a tie is not
                        correct, as in the trainer's rewards/accuracies), with its binomial standard error
  prefers chosen        share of pairs whose chosen completion has the higher mean log-probability per
                        token under the model itself, whatever the loss (not a trainer figure): what
                        the model ranks first, comparable between the base and the trained model
  margin                mean of chosen reward - rejected reward, with its standard error
  loss                  the run's loss per pair: on the run's own split, the trainer's val_loss

These are the trainer's held-out figures (val_loss, val_rewards/*) over the same rows. The base (the
untuned model) scored the same way: for a loss with a reference the base IS the reference, so every
margin is 0, its accuracy 0% and its loss the loss at zero margin (ln 2 for DPO): "prefers chosen" is
then the informative before and after. KTO's unpaired rows
have no pairs to order: their figures are the mean reward of the desirable and of the undesirable rows.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn

from tunekit.config import plain
from tunekit.losses.preference import has_reference, kto_loss, pair_losses


@dataclass
class Logps:
    """Per row, per side (chosen, rejected; KTO: its one completion): the summed log-probability of the
    completion's trained tokens, fp32 (rows, sides), and their count (rows, sides)."""

    sums: torch.Tensor
    tokens: torch.Tensor


@dataclass
class Figures:
    """One model's figures on the rows (`metrics`) and, per row, whether it is ordered right (pairs:
    margin > 0; None for KTO) and its margin (pairs) or reward (KTO)."""

    metrics: dict
    correct: Optional[list[bool]]
    values: list[float]


def mean_se(values: torch.Tensor) -> tuple[float, float]:
    """Mean and its standard error (sample standard deviation / sqrt(n); 0 for fewer than 2 values)."""
    n = values.numel()
    if n == 0:
        return float("nan"), float("nan")
    mean = float(values.double().mean())
    return mean, float(values.double().std() / math.sqrt(n)) if n > 1 else 0.0


def rate_se(hits: int, n: int) -> tuple[float, float]:
    """A share and its binomial standard error sqrt(p (1 - p) / n)."""
    p = hits / max(n, 1)
    return p, math.sqrt(p * (1 - p) / max(n, 1))


class PairScorer:
    """The figures of a run's preference loss (cfg: the run's `preference` node) from log-probabilities."""

    def __init__(self, cfg):
        self.kind = plain(cfg.loss)
        self.beta, self.gamma, self.label_smoothing = cfg.beta, cfg.gamma, cfg.label_smoothing
        self.weights = (cfg.desirable_weight, cfg.undesirable_weight)

    @property
    def needs_reference(self) -> bool:
        return has_reference(self.kind)

    @property
    def paired(self) -> bool:
        return self.kind != "kto"

    def figures(self, policy: Logps, reference: Optional[Logps], desirable: Optional[torch.Tensor] = None) -> Figures:
        """The figures of the model that gave `policy`; `reference`: the reference's (losses with one).
        desirable: KTO's (rows,) bool labels."""
        if not self.paired:
            return self._kto(policy, reference, desirable)
        c, r = policy.sums[:, 0], policy.sums[:, 1]
        rc, rr = (None, None) if reference is None else (reference.sums[:, 0], reference.sums[:, 1])
        out = pair_losses(self.kind, c, r, rc, rr, policy.tokens[:, 0], policy.tokens[:, 1], self.beta,
                          self.label_smoothing, self.gamma)
        margin = out.chosen_rewards - out.rejected_rewards
        correct = (margin > 0).tolist()
        n = len(correct)
        acc, acc_se = rate_se(sum(correct), n)
        m, m_se = mean_se(margin)
        # what the model itself ranks first, whatever the loss: the higher mean log-probability per token
        # (for a loss with a reference, the base's preference_accuracy is 0 by definition; this is not)
        per_token = policy.sums / policy.tokens.clamp(min=1)
        own, own_se = rate_se(int((per_token[:, 0] > per_token[:, 1]).sum()), n)
        metrics = {"pairs": n, "loss": float(out.per_pair.double().mean()), "preference_accuracy": acc,
                   "preference_accuracy_se": acc_se, "likelihood_accuracy": own, "likelihood_accuracy_se": own_se,
                   "margin": m, "margin_se": m_se,
                   "rewards_chosen": float(out.chosen_rewards.double().mean()),
                   "rewards_rejected": float(out.rejected_rewards.double().mean())}
        return Figures(metrics, correct, margin.tolist())

    def _kto(self, policy: Logps, reference: Logps, desirable: torch.Tensor) -> Figures:
        good = desirable.bool()
        out = kto_loss(policy.sums[:, 0], reference.sums[:, 0], good, self.beta, None, *self.weights)
        reward = self.beta * (policy.sums[:, 0] - reference.sums[:, 0])
        d, d_se = mean_se(out.chosen_rewards)
        u, u_se = mean_se(out.rejected_rewards)
        metrics = {"rows": int(good.numel()), "desirable": int(good.sum()), "undesirable": int((~good).sum()),
                   "loss": float(out.per_pair.double().mean()), "reward_desirable": d, "reward_desirable_se": d_se,
                   "reward_undesirable": u, "reward_undesirable_se": u_se, "reward_gap": d - u}
        return Figures(metrics, None, reward.tolist())


@torch.no_grad()
def completion_logps(model: nn.Module, examples: list[dict], pad_id: int, batch_size: int,
                     switched_off: Optional[Callable] = None) -> tuple[Logps, Optional[Logps]]:
    """The log-probabilities of every example's completions under `model` and, with `switched_off` (the
    method's context that turns the trained part off), under its base: one forward each per batch of
    `batch_size` examples (pairs: 2 x batch_size rows, as the trainer batches them)."""
    from tunekit.data.preference import collate_preference
    from tunekit.losses.logps import sequence_logps
    from tunekit.model import decoder_and_head

    was_training = model.training
    model.eval()
    decoder, head = decoder_and_head(model)
    device = head.weight.device
    sides = 2 if "rejected_input_ids" in examples[0] else 1
    parts: list[tuple[list, list]] = [([], []), ([], [])]
    try:
        for i in range(0, len(examples), batch_size):
            rows = [{k: v for k, v in e.items() if k != "ref_logps"} for e in examples[i:i + batch_size]]
            batch = collate_preference(rows, pad_id)
            inputs = {"input_ids": batch["input_ids"].to(device), "attention_mask": batch["attention_mask"].to(device)}
            labels = batch["labels"].to(device)
            for part, context in zip(parts, (lambda m: nullcontext(), switched_off)):
                if context is None:
                    continue
                with context(model):
                    hidden = decoder(**inputs, use_cache=False).last_hidden_state
                sums, tokens = sequence_logps(hidden, head, labels)
                part[0].append(sums.float().cpu().view(sides, len(rows)).T)
                part[1].append(tokens.cpu().view(sides, len(rows)).T)
    finally:
        model.train(was_training)
    policy = Logps(torch.cat(parts[0][0]), torch.cat(parts[0][1]))
    reference = Logps(torch.cat(parts[1][0]), torch.cat(parts[1][1])) if switched_off is not None else None
    return policy, reference


def desirable_of(examples: list[dict]) -> Optional[torch.Tensor]:
    """KTO's labels, (rows,) bool; None for pairs."""
    return torch.tensor([bool(e["desirable"]) for e in examples]) if "desirable" in examples[0] else None


# ----------------------------------------------------------------------------- the report
PAIR_ROWS = (("loss", "preference loss", "{:.4f}"), ("preference_accuracy", "preference accuracy", "pct"),
             ("likelihood_accuracy", "prefers chosen (per token)", "pct"), ("margin", "reward margin", "{:+.4f}"), ("rewards_chosen", "reward chosen", "{:+.4f}"),
             ("rewards_rejected", "reward rejected", "{:+.4f}"))
KTO_ROWS = (("loss", "preference loss", "{:.4f}"), ("reward_desirable", "reward desirable", "{:+.4f}"),
            ("reward_undesirable", "reward undesirable", "{:+.4f}"), ("reward_gap", "desirable - undesirable", "{:+.4f}"))


def _cell(fmt: str, value: float) -> str:
    return f"{100 * value:.1f}%" if fmt == "pct" else fmt.format(value)


def preference_table(trained: dict, base: Optional[dict], header: str) -> str:
    """The printed report: base and trained side by side, the change, a standard error where there is one."""
    rows = PAIR_ROWS if "pairs" in trained else KTO_ROWS
    cols = ["base", "trained", "change"] if base else ["trained"]
    lines = [header, f"{'':26}" + "".join(f"{c:>10}" for c in cols)]
    for key, name, fmt in rows:
        line = f"{name:26}" + (f"{_cell(fmt, base[key]):>10}" if base else "") + f"{_cell(fmt, trained[key]):>10}"
        if base:
            change = trained[key] - base[key]
            line += f"{100 * change:>+10.1f}" if fmt == "pct" else f"{change:>+10.4f}"
        se = trained.get(f"{key}_se")
        if se is not None:
            line += f"   (+- {_cell(fmt, se).lstrip('+')} trained)"
        lines.append(line)
    return "\n".join(lines)
