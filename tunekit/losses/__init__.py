"""Losses: functions of (batch, model outputs[, teacher outputs]) -> (loss sum, trained token count)."""

from tunekit.losses.sft import select_trained, sft_loss, sft_loss_from_hidden

__all__ = ["select_trained", "sft_loss", "sft_loss_from_hidden"]
