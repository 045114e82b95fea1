"""Score one model on task rows, in batches, with one prompt pass per row.

Per batch of rows (sorted by prompt length, so little padding), `tunekit.infer.decode.prefill` runs
the prompts once; from that pass:

  response loss   -log p(reference answer | prompt), summed over its tokens (end-of-turn included),
                  plus the trained tokens of earlier replies inside the prompt: the same sum as the
                  trainer's held-out loss on the same rows (tested to fp32 precision)
  accuracy        over a closed answer set: the class whose answer is most likely (summed log
                  probability of its tokens, end-of-turn included, as lm-evaluation-harness's `acc`)
  exact match     the greedy answer (up to max_new_tokens), normalised, equals the normalised reference

The continuations (reference + K class answers) reuse the prompt's KV cache; greedy decoding goes
last because it extends that cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from tunekit.infer.rows import ClassSet, TaskRow, normalize

IGNORE = -100


@dataclass
class RowResult:
    answer: str  # the greedy answer's text ("" when generation was off)
    exact: bool
    predicted: Optional[int]  # class index by log-likelihood (closed sets only)
    truth: Optional[int]  # the reference's class index
    loss_sum: float  # -log p of the row's trained tokens
    tokens: int


@dataclass
class TaskResult:
    rows: list[RowResult]
    classes: Optional[ClassSet]
    generated: bool
    metrics: dict = field(default_factory=dict)

    def summarize(self) -> dict:
        n = len(self.rows)
        tokens = sum(r.tokens for r in self.rows)
        loss = sum(r.loss_sum for r in self.rows) / max(tokens, 1)
        m = {"rows": n, "loss": loss, "ppl": math.exp(min(loss, 50))}
        if self.generated:
            m["exact_match"] = sum(r.exact for r in self.rows) / max(n, 1)
        if self.classes is not None:
            m["accuracy"] = sum(r.predicted == r.truth for r in self.rows) / max(n, 1)
            per = {}
            for k, label in enumerate(self.classes.labels):
                mine = [r for r in self.rows if r.truth == k]
                per[label] = {"rows": len(mine), "predicted": sum(r.predicted == k for r in self.rows),
                              "correct": sum(r.predicted == k for r in mine)}
                if self.generated:
                    per[label]["exact"] = sum(r.exact for r in mine)
            m["per_class"] = per
            m["majority"] = max(v["rows"] for v in per.values()) / max(n, 1)
        self.metrics = m
        return m


def _prompt_loss(prefix, head: nn.Module, batch: list[TaskRow]) -> list[tuple[float, int]]:
    """(-log p, tokens) of the trained tokens inside each prompt (earlier replies of multi-turn rows).

    prefix.hidden: (batch, width, dim); the hidden state at token j's slot predicts token j + 1."""
    prefix_hidden = prefix.hidden
    out = []
    for i, r in enumerate(batch):
        n = len(r.prompt)
        slots = prefix.token_slots(i, n)
        targets = [(slots[j], r.prompt_labels[j + 1]) for j in range(n - 1) if r.prompt_labels[j + 1] != IGNORE]
        if not targets:
            out.append((0.0, 0))
            continue
        pos = torch.tensor([p for p, _ in targets], device=prefix_hidden.device)
        tgt = torch.tensor([t for _, t in targets], device=prefix_hidden.device)
        logits = head(prefix_hidden[i, pos].to(head.weight.dtype)).float()
        out.append((float(F.cross_entropy(logits, tgt, reduction="sum")), len(targets)))
    return out


@torch.no_grad()
def score_rows(model: nn.Module, tokenizer, rows: list[TaskRow], classes: Optional[ClassSet] = None,
               batch_size: int = 16, max_new_tokens: Optional[int] = None, generate: bool = True) -> TaskResult:
    """Score `model` (any trained model: see tunekit.infer.decode.generation_view) on `rows`.

    max_new_tokens: greedy budget; default the longest reference plus 4 tokens (an answer longer
    than that cannot match after normalisation in any realistic case)."""
    from tunekit.infer.decode import generation_view, greedy, pad_token_id, prefill, score_continuations, stop_token_ids
    from tunekit.model import decoder_and_head

    lm, soft = generation_view(model)
    was_training = lm.training
    lm.eval()
    pad, stop = pad_token_id(tokenizer), stop_token_ids(lm, tokenizer)
    budget = max_new_tokens or (max((len(r.answer) for r in rows), default=1) + 4)
    _, head = decoder_and_head(lm)
    order = sorted(range(len(rows)), key=lambda i: len(rows[i].prompt))
    results: dict[int, RowResult] = {}
    try:
        for start in range(0, len(order), batch_size):
            idx = order[start:start + batch_size]
            batch = [rows[i] for i in idx]
            prefix = prefill(lm, [r.prompt for r in batch], [soft] * len(batch), keep_hidden=True)
            conts = [[r.answer] + (classes.answers if classes is not None else []) for r in batch]
            scores = score_continuations(lm, prefix, conts, pad)  # (batch, 1 + K)
            inner = _prompt_loss(prefix, head, batch)
            prefix.hidden = None  # free it before decoding
            answers = greedy(lm, prefix, budget, stop, pad) if generate else [[] for _ in batch]
            for j, (i, r) in enumerate(zip(idx, batch)):
                text = tokenizer.decode(answers[j], skip_special_tokens=True).strip() if generate else ""
                truth = classes.index(r.reference) if classes is not None else None
                predicted = int(scores[j, 1:].argmax()) if classes is not None else None
                results[i] = RowResult(text, generate and normalize(text) == normalize(r.reference), predicted, truth,
                                       -float(scores[j, 0]) + inner[j][0], len(r.answer) + inner[j][1])
    finally:
        lm.train(was_training)
    result = TaskResult([results[i] for i in range(len(rows))], classes, generate)
    result.summarize()
    return result
