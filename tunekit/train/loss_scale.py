"""Dynamic loss scaling for fp16 training (Micikevicius et al., "Mixed Precision Training", ICLR 2018).

On GPUs with fp16 tensor cores but no bf16 ones (V100, T4, RTX 20xx) the precision policy computes
in fp16 (tunekit.device.precision). fp16 keeps 5 exponent bits: a gradient flowing back through the
frozen base below 2^-24 flushes to zero, one above 65504 overflows to inf. The loss is multiplied
by a scale S (a power of two) before backward, which moves those gradients up, clear of the
underflow; the trained fp32 gradients are divided by S before clipping and the update, exactly
(both are powers of two). When a gradient overflowed anyway (the gradient norm is inf or NaN),
the step is skipped: no update, no scheduler step, counted in metrics.jsonl and summary.json; S
halves. After `growth_interval` clean steps in a row S doubles. The defaults are torch.amp.GradScaler's.

A run whose gradients overflow `MAX_SKIPS_IN_A_ROW` steps in a row (S fell by 2^20 without one
clean step) is not learning: it stops with one line, as a non-finite fp32 run does.

The state (S, the clean steps since the last change, the steps skipped) is three numbers, saved in
each checkpoint's trainer_state.json, so a resumed run scales exactly as the uninterrupted one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_SKIPS_IN_A_ROW = 20


@dataclass
class LossScaler:
    enabled: bool
    scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    clean_steps: int = 0  # clean steps since the scale last changed
    skipped: int = 0  # steps skipped over the whole run
    skipped_in_a_row: int = 0

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss backward is called on: times S when scaling, else the loss itself."""
        return loss * self.scale if self.enabled else loss

    @torch.no_grad()
    def unscale_(self, params: list[torch.Tensor]) -> None:
        """Divide the trained gradients by S in place (one multi-tensor kernel; exact: S is a power of two)."""
        grads = [p.grad for p in params if p.grad is not None]
        if self.enabled and grads:
            torch._foreach_mul_(grads, 1.0 / self.scale)

    def update(self, overflowed: bool) -> None:
        """After a step: back off on an overflow, grow after growth_interval clean steps."""
        if not self.enabled:
            return
        if overflowed:
            self.scale *= self.backoff_factor
            self.clean_steps = 0
            self.skipped += 1
            self.skipped_in_a_row += 1
            return
        self.skipped_in_a_row = 0
        self.clean_steps += 1
        if self.clean_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.clean_steps = 0

    @property
    def gave_up(self) -> bool:
        return self.skipped_in_a_row >= MAX_SKIPS_IN_A_ROW

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "skipped": self.skipped,
                "skipped_in_a_row": self.skipped_in_a_row}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.skipped = int(state["skipped"])
        self.skipped_in_a_row = int(state.get("skipped_in_a_row", 0))
