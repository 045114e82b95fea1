"""How faithful an export is: the artifact reloaded from disk vs the trained model, on held-out data.

For every non-padding position of the run's held-out batches (prompt and response alike: a
deployed model sees both) we compare next-token distributions p (trained) and q (exported):

    max_abs_logit_diff   max |z_p - z_q| over positions and vocabulary
    kl_mean              mean over positions of KL(p || q) = sum_v p_v (log p_v - log q_v), nats/token
    top1_agreement       fraction of positions where argmax z_p == argmax z_q
    ppl_trained/exported perplexity on the response tokens only (the tokens the run trained on)

KL(trained || exported) is the expected extra nats per token a sampler pays for using the export
instead of the trained model; it is the number the refusal threshold applies to.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from tunekit.data import IGNORE

# Default refusal thresholds on kl_mean (nats/token), by the dtype the export is stored in.
# The floor is set by the reference itself: the trained model computes in bf16 (4-bit layers
# dequantize into bf16 matmuls), the export in its own dtype. Measured on SmolLM2-135M, QLoRA,
# 2 steps: an fp32 merge (adapter intact, ppl 91.72 vs 91.75) still shows KL 1.0e-3 from that
# compute difference alone, while a bf16 merge whose small LoRA delta (|BA| ~ 7e-5) rounds away
# under bf16's resolution of the base weights (ulp ~2e-4 at |w| ~ 0.05) shows KL 5.4e-3 (ppl
# back at the untrained 96.2). 3e-3 sits between: above compute noise, below "adapter lost".
# Mis-permuted q/k or a wrong token map cost far more (tenths of a nat and up).
KL_THRESHOLDS = {"bf16": 3e-3, "fp16": 3e-3, "fp32": 3e-3}
# An adapter is reloaded on the same base with the same weights: it must be exact.
KL_THRESHOLD_ADAPTER = 1e-5
# Re-quantizing the merged weights to NF4 rounds every weight to one of 16 levels per block of
# 64 (~7% relative step): that is a deliberate, lossy deploy choice, so its bound is looser. It
# still catches a broken quantization (wrong layout, a skipped layer), which costs > 0.5 nats.
KL_THRESHOLD_REQUANT_NF4 = 5e-2


def logits_of(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """(batch, seq, vocab) fp32 logits aligned with batch["input_ids"].

    peft's prompt-learning models return logits for the virtual tokens too (prepended): keep the
    last `seq` positions, which are the real ones.
    """
    seq = batch["input_ids"].shape[1]
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
    return out.logits[:, -seq:].float()


@torch.no_grad()
def compare(trained: nn.Module | Callable, exported: nn.Module | Callable,
            batches: list[dict[str, torch.Tensor]]) -> dict:
    """Fidelity numbers of `exported` against `trained` (both callables batch -> logits, or models)."""
    f_ref = trained if not isinstance(trained, nn.Module) else (lambda b: logits_of(trained, b))
    f_exp = exported if not isinstance(exported, nn.Module) else (lambda b: logits_of(exported, b))
    max_abs, kl_sum, agree, n_pos = 0.0, 0.0, 0, 0
    nll_ref = nll_exp = 0.0
    n_resp = 0
    for batch in batches:
        z_p, z_q = f_ref(batch), f_exp(batch)  # (batch, seq, vocab)
        if z_p.shape != z_q.shape:
            raise ValueError(f"logit shapes differ: trained {tuple(z_p.shape)}, exported {tuple(z_q.shape)}")
        mask = batch["attention_mask"].bool()  # (batch, seq)
        p, q = z_p[mask], z_q[mask]  # (positions, vocab)
        logp, logq = F.log_softmax(p, -1), F.log_softmax(q, -1)
        max_abs = max(max_abs, (p - q).abs().max().item())
        kl_sum += (logp.exp() * (logp - logq)).sum(-1).clamp_min(0).sum().item()  # clamp: fp noise below 0
        agree += (p.argmax(-1) == q.argmax(-1)).sum().item()
        n_pos += p.shape[0]
        # response tokens: position t predicts labels[t + 1]
        labels = batch["labels"][:, 1:]
        resp = labels != IGNORE
        target = labels[resp]
        nll_ref += F.cross_entropy(z_p[:, :-1][resp], target, reduction="sum").item()
        nll_exp += F.cross_entropy(z_q[:, :-1][resp], target, reduction="sum").item()
        n_resp += int(resp.sum())
    return {
        "batches": len(batches), "positions": n_pos, "response_tokens": n_resp,
        "max_abs_logit_diff": max_abs,
        "kl_mean": kl_sum / max(n_pos, 1),
        "top1_agreement": agree / max(n_pos, 1),
        "ppl_trained": math.exp(min(nll_ref / max(n_resp, 1), 50)),
        "ppl_exported": math.exp(min(nll_exp / max(n_resp, 1), 50)),
    }


def summary(label: str, report: dict) -> str:
    """The few lines printed after an export."""
    f = report["fidelity"]
    verdict = "OK" if report["accepted"] else ("ABOVE THRESHOLD, written anyway (--force)" if report["forced"]
                                                else "REFUSED (above threshold)")
    return "\n".join([
        f"fidelity of {label} vs the trained model: {f['batches']} held-out batches, {f['positions']} tokens "
        f"({f['response_tokens']} response)",
        f"  KL(trained||exported) {f['kl_mean']:.3e} nats/token (threshold {report['kl_threshold']:.0e})   "
        f"max |logit diff| {f['max_abs_logit_diff']:.4f}   top-1 agreement {100 * f['top1_agreement']:.2f}%",
        f"  response perplexity: trained {f['ppl_trained']:.4f}, exported {f['ppl_exported']:.4f}",
        f"  -> {verdict}",
    ])
