"""What the trainer minimises: supervised fine-tuning, or distillation from a frozen teacher.

An objective turns the student's last hidden states into (loss sum, trained tokens) for a
micro-batch, and into named sums for evaluation. The recipe only calls `loss` and `eval_sums`,
so it has one code path for every objective.
"""

from __future__ import annotations

import logging

import torch
import torch.nn as nn
import torch.nn.functional as F

from tunekit import TunekitError
from tunekit.losses.distill import chunked_distill_loss, divergence
from tunekit.losses.sft import IGNORE, select_trained, sft_loss_from_hidden

log = logging.getLogger(__name__)


def model_inputs(batch: dict) -> dict:
    """Padded batches carry attention_mask, packed ones position_ids (see data.batching)."""
    return {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch}


class SFTObjective:
    """Token-summed cross-entropy on response tokens."""

    eval_names = ("loss",)  # the keys of eval_sums, the same on every rank

    @staticmethod
    def count(batch: dict) -> int:
        """Trained tokens of a collated micro-batch: what the step's summed loss is divided by."""
        return int((batch["labels"][:, 1:] != IGNORE).sum())

    def loss(self, hidden: torch.Tensor, head: nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        return sft_loss_from_hidden(hidden, head, batch["labels"])

    @torch.no_grad()
    def eval_sums(self, hidden, head, batch) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        total, n = self.loss(hidden, head, batch)
        return {"loss": total}, n


class DistillObjective:
    """alpha * CE(labels) + (1 - alpha) * T^2 * D(teacher || student), chunked over tokens.

    The teacher is frozen and run under no_grad on the same batch; its logits, like the
    student's, are only ever formed `chunk_size` trained tokens at a time.
    """

    eval_names = ("ce", "kl", "loss")
    count = staticmethod(SFTObjective.count)

    def __init__(self, teacher: nn.Module, cfg):
        from tunekit.model import decoder_and_head

        self.teacher = teacher.eval().requires_grad_(False)
        self.teacher_decoder, self.teacher_head = decoder_and_head(teacher)
        self.alpha, self.temperature = cfg.alpha, cfg.temperature
        self.kind = getattr(cfg.divergence, "value", cfg.divergence)
        self.beta, self.chunk_size = cfg.beta, cfg.chunk_size

    @torch.no_grad()
    def _teacher_hidden(self, batch: dict) -> torch.Tensor:
        return self.teacher_decoder(**model_inputs(batch), use_cache=False).last_hidden_state

    def loss(self, hidden: torch.Tensor, head: nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        t_hidden = self._teacher_hidden(batch)
        return chunked_distill_loss(
            hidden.to(head.weight.dtype), head.weight, t_hidden.to(self.teacher_head.weight.dtype),
            self.teacher_head.weight, batch["labels"], self.alpha, self.temperature, self.kind, self.beta,
            self.chunk_size, student_bias=head.bias, teacher_bias=self.teacher_head.bias,
        )

    @torch.no_grad()
    def eval_sums(self, hidden, head, batch) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """The training loss plus its parts at T = 1: CE to the labels, KL(teacher || student)."""
        total, n = self.loss(hidden, head, batch)
        rows, targets = select_trained(hidden, batch["labels"])
        t_rows, _ = select_trained(self._teacher_hidden(batch), batch["labels"])
        ce = kl = torch.zeros((), device=hidden.device)
        for i in range(0, rows.shape[0], self.chunk_size):
            s_logits = head(rows[i : i + self.chunk_size].to(head.weight.dtype)).float()
            t_logits = self.teacher_head(t_rows[i : i + self.chunk_size].to(self.teacher_head.weight.dtype)).float()
            ce = ce + F.cross_entropy(s_logits, targets[i : i + self.chunk_size], reduction="sum")
            kl = kl + divergence(s_logits, t_logits, "forward_kl").sum()
        return {"loss": total, "ce": ce, "kl": kl}, n


def check_same_vocabulary(student_tok, teacher_tok, student_cfg, teacher_cfg, teacher_name: str) -> None:
    """Distillation compares distributions token by token: the vocabularies must be identical."""
    if student_tok.get_vocab() != teacher_tok.get_vocab():
        raise TunekitError(
            f"distill.teacher: the tokenizer of {teacher_name} ({len(teacher_tok)} tokens) does not match the "
            f"student's ({len(student_tok)} tokens); distillation needs the same vocabulary"
        )
    if student_cfg.vocab_size != teacher_cfg.vocab_size:
        raise TunekitError(
            f"distill.teacher: {teacher_name} has vocab_size {teacher_cfg.vocab_size}, the student "
            f"{student_cfg.vocab_size}; their output heads must have the same size"
        )
