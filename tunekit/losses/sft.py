"""Supervised fine-tuning loss: next-token cross-entropy on response tokens, as a sum.

Returning (sum, count) instead of a mean lets the trainer normalise by the number of trained
tokens in the whole accumulated (and all-reduced) batch. A mean of per-micro-batch means would
weight a token in a short micro-batch more than one in a long micro-batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE = -100


def sft_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: (batch, seq, vocab); labels: (batch, seq) with IGNORE on untrained positions.

    Position t predicts token t+1. Cross-entropy is computed in fp32 whatever the logits' dtype:
    bf16 log-softmax over a 49k vocabulary loses ~2 decimal digits.
    Returns (summed loss: scalar fp32, number of trained tokens: scalar int64).
    """
    shift_logits = logits[:, :-1, :]
    shift_labels = labels[:, 1:]
    mask = shift_labels != IGNORE
    # Select trained positions first: only they need the (tokens, vocab) fp32 copy.
    picked = shift_logits[mask].float()
    loss_sum = F.cross_entropy(picked, shift_labels[mask], reduction="sum")
    return loss_sum, mask.sum()
