"""How faithful an export is: the artifact, reloaded from disk, vs the trained model on held-out data.

The user's question is "how much of what the fine-tune gained does the export keep?". On the
response tokens of the run's held-out batches (the tokens the run trained on) we measure the mean
loss (nats/token) of three models and report

    gain_kept = (loss_base - loss_exported) / (loss_base - loss_trained)

where base is the model the run trained over (for a 4-bit run: the NF4 base, prepared as in
training). An export that merged the fine-tune into other weights (`--merge-into original`, the
high-precision base) is measured from the base it merged into, so that a better base cannot pass
for a kept fine-tune. Beside it, on every non-padding position (prompt and response alike: a
deployed model sees both), the distributions p (trained) and q (exported) are compared:

    kl_mean              mean over positions of KL(p || q) = sum_v p_v (log p_v - log q_v), nats/token
    max_abs_logit_diff   max |z_p - z_q| over positions and vocabulary
    top1_agreement       fraction of positions where argmax z_p == argmax z_q

The trained model's logits and all three losses come from one load of the base (tunekit's own
loader, so no bitsandbytes CPU repack: TRAPS.md): the base is measured before the method is
applied, then the adapter is loaded into it. Its logits are kept (only the non-padding positions,
fp32) so that every export candidate is compared against one reference pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from tunekit.data import IGNORE

Logits = Callable[[dict], torch.Tensor]  # batch -> (batch, seq, vocab) fp32


def logits_of(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """(batch, seq, vocab) fp32 logits aligned with batch["input_ids"].

    peft's prompt-learning models return logits for the virtual tokens too (prepended): keep the
    last `seq` positions, which are the real ones.
    """
    seq = batch["input_ids"].shape[1]
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
    return out.logits[:, -seq:].float()


def as_logits(model_or_fn) -> Logits:
    return model_or_fn if not isinstance(model_or_fn, nn.Module) else (lambda b: logits_of(model_or_fn, b))


def response_nll(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> tuple[float, int]:
    """(sum of NLL over response tokens, their count); position t predicts labels[t + 1]."""
    labels = batch["labels"][:, 1:]
    resp = labels != IGNORE
    nll = F.cross_entropy(logits[:, :-1][resp].float(), labels[resp], reduction="sum")
    return nll.item(), int(resp.sum())


@torch.no_grad()
def mean_loss(model: nn.Module, batches: list[dict]) -> float:
    """Mean response NLL (nats/token) of a causal LM over the batches.

    Only the loss is needed here, so the output head (vocab x dim: a fifth of SmolLM2's forward)
    runs on the response positions alone, as in training's own loss.
    """
    from tunekit.model import decoder_and_head

    decoder, head = decoder_and_head(model)
    total = count = 0
    for batch in batches:
        hidden = decoder(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                         use_cache=False).last_hidden_state  # (batch, seq, dim)
        labels = batch["labels"][:, 1:]
        resp = labels != IGNORE
        logits = head(hidden[:, :-1][resp]).float()  # (response tokens, vocab)
        total += F.cross_entropy(logits, labels[resp], reduction="sum").item()
        count += int(resp.sum())
    return total / max(count, 1)


@dataclass
class Reference:
    """The trained model's side of every comparison, measured once.

    logits[i]: (positions_i, vocab) fp32 trained logits at the non-padding positions of batch i.
    """

    batches: list[dict]
    loss_base: float
    loss_trained: float
    logits: list[torch.Tensor] = field(repr=False)

    @property
    def gain(self) -> float:
        """What the fine-tune gained on held-out response tokens, nats/token (> 0 = better)."""
        return self.loss_base - self.loss_trained


@torch.no_grad()
def measure_reference(base: nn.Module, make_trained: Callable[[nn.Module], nn.Module],
                      batches: list[dict]) -> tuple[Reference, nn.Module]:
    """Base loss from `base`, then `make_trained(base)` (method.apply + load: same storage) gives
    the trained model, whose logits and loss are recorded. Returns the reference and the trained model."""
    loss_base = mean_loss(base, batches)
    trained = make_trained(base)
    logits, total, count = [], 0.0, 0
    for batch in batches:
        z = logits_of(trained, batch)  # (batch, seq, vocab)
        s, n = response_nll(z, batch)
        total, count = total + s, count + n
        logits.append(z[batch["attention_mask"].bool()].contiguous())  # (positions, vocab)
        del z
    return Reference(batches, loss_base, total / max(count, 1), logits), trained


def gain_kept(ref: Reference, loss_exported: float, loss_merge_base: Optional[float] = None) -> float:
    """Fraction of the fine-tune's held-out gain that the export keeps (1.0 = all of it).

    loss_merge_base: loss of the base the export merged into, when that is not the base the run
    trained over (merge into the original high-precision weights)."""
    start = ref.loss_base if loss_merge_base is None else loss_merge_base
    return (start - loss_exported) / ref.gain


@torch.no_grad()
def compare(ref: Reference, exported, loss_merge_base: Optional[float] = None) -> dict:
    """Fidelity numbers of `exported` (model, or callable batch -> logits) against the reference."""
    f_exp = as_logits(exported)
    max_abs, kl_sum, agree, n_pos, n_seq = 0.0, 0.0, 0, 0, 0
    nll, n_resp = 0.0, 0
    for batch, p in zip(ref.batches, ref.logits):
        z_q = f_exp(batch)  # (batch, seq, vocab)
        mask = batch["attention_mask"].bool()  # (batch, seq)
        if z_q.shape[:2] != mask.shape or z_q.shape[-1] != p.shape[-1]:
            raise ValueError(f"logit shapes differ: trained {(*mask.shape, p.shape[-1])}, exported {tuple(z_q.shape)}")
        q = z_q[mask]  # (positions, vocab)
        # In slices of rows: the whole (positions, vocab) temporaries would be 350 MB each on the
        # default run, and allocating and streaming them cost more than the arithmetic.
        for i in range(0, p.shape[0], 32):
            pi, qi = p[i : i + 32], q[i : i + 32]
            logp, logq = F.log_softmax(pi, -1), F.log_softmax(qi, -1)
            max_abs = max(max_abs, (pi - qi).abs().max().item())
            kl_sum += (logp.exp() * (logp - logq)).sum(-1).clamp_min(0).sum().item()  # clamp: fp noise below 0
            agree += (pi.argmax(-1) == qi.argmax(-1)).sum().item()
        n_pos += p.shape[0]
        n_seq += mask.shape[0]
        s, n = response_nll(z_q, batch)
        nll, n_resp = nll + s, n_resp + n
        del z_q, q
    loss_exp = nll / max(n_resp, 1)
    out = {
        "batches": len(ref.batches), "sequences": n_seq, "positions": n_pos, "response_tokens": n_resp,
        "loss_base": ref.loss_base, "loss_trained": ref.loss_trained, "loss_exported": loss_exp,
        "ppl_base": _ppl(ref.loss_base), "ppl_trained": _ppl(ref.loss_trained), "ppl_exported": _ppl(loss_exp),
        "gain": ref.gain, "gain_kept": gain_kept(ref, loss_exp, loss_merge_base) if ref.gain != 0 else None,
        "kl_mean": kl_sum / max(n_pos, 1), "max_abs_logit_diff": max_abs, "top1_agreement": agree / max(n_pos, 1),
    }
    if loss_merge_base is not None:
        out.update(loss_merge_base=loss_merge_base, ppl_merge_base=_ppl(loss_merge_base))
    return out


def _ppl(loss: float) -> float:
    return math.exp(min(loss, 50.0))
