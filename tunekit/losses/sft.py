"""Supervised fine-tuning loss: next-token cross-entropy on response tokens, as a sum.

Returning (sum, count) instead of a mean lets the trainer normalise by the number of trained
tokens in the whole accumulated (and all-reduced) batch. A mean of per-micro-batch means would
weight a token in a short micro-batch more than one in a long micro-batch.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tunekit.head_matmul import head_logits

IGNORE = -100


def select_trained(states: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of `states` (batch, seq, dim) that predict a trained token, and those tokens.

    Position t predicts token t+1. Returns (rows (n, dim), targets (n,)).
    """
    shift_labels = labels[:, 1:]
    mask = shift_labels != IGNORE
    return states[:, :-1][mask], shift_labels[mask]


def sft_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: (batch, seq, vocab); labels: (batch, seq) with IGNORE on untrained positions.

    Cross-entropy is computed in fp32 whatever the logits' dtype: bf16 log-softmax over a 49k
    vocabulary loses ~2 decimal digits.
    Returns (summed loss: scalar fp32, number of trained tokens: scalar int64).
    """
    rows, targets = select_trained(logits, labels)
    return F.cross_entropy(rows.float(), targets, reduction="sum"), torch.tensor(targets.numel())


def sft_loss_from_hidden(hidden: torch.Tensor, head: nn.Module, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Same loss from the decoder's last hidden states (batch, seq, dim) and the output head.

    The head runs only on the positions that predict a trained token: on chat data those are
    about a third of all positions, and the (tokens, vocab) head matmul and its fp32 logits are
    the largest single cost of a small model (49k x 576 for SmolLM2-135M).
    """
    rows, targets = select_trained(hidden, labels)
    logits = head_logits(rows, head)  # head(rows), its matmuls in checked bf16 math where chosen
    return F.cross_entropy(logits.float(), targets, reduction="sum"), torch.tensor(targets.numel())
