"""Losses: functions of (batch, model outputs[, teacher outputs]) -> (loss sum, trained token count).

SFT cross-entropy and distillation, both chunked over tokens so the (tokens, vocab) logits never
exist at once. Import torch only: the training objective (tunekit.train.objective) calls them.
"""

from tunekit.losses.sft import select_trained, sft_loss, sft_loss_from_hidden

__all__ = ["select_trained", "sft_loss", "sft_loss_from_hidden"]
