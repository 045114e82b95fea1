"""Losses: functions of (batch, model outputs) -> (loss sum, trained token count)."""

from tunekit.losses.sft import sft_loss

__all__ = ["sft_loss"]
