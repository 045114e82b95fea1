"""Optimizers (torch AdamW or bitsandbytes 8-bit / paged) and the warmup + cosine schedule."""

from __future__ import annotations

import logging
import math
import warnings

import torch

from tunekit import TunekitError
from tunekit.device import facts as dev

log = logging.getLogger(__name__)


def build_optimizer(name: str, params: list, lr: float, weight_decay: float, device: torch.device):
    """name: adamw | adamw_8bit | paged_adamw_8bit | paged_adamw_32bit. params: tensors, or parameter
    groups (dicts with "params" and their own "lr": Method.param_groups); `lr` is the default rate.

    Paged optimizers (QLoRA) keep their state in CUDA unified memory so it can spill to the
    host under memory pressure. There is no paging on a CPU: bitsandbytes falls back to the
    unpaged variant there, which we say once here instead of its per-tensor warning.
    """
    if name == "adamw":
        # fused on a GPU (tunekit.device.facts.fused_adamw)
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=dev.fused_adamw(device))
    import bitsandbytes as bnb

    classes = {
        "adamw_8bit": bnb.optim.AdamW8bit,
        "paged_adamw_8bit": bnb.optim.PagedAdamW8bit,
        "paged_adamw_32bit": bnb.optim.PagedAdamW32bit,
    }
    if name not in classes:
        raise TunekitError(f"trainer.optimizer: unknown optimizer {name!r}; choose one of {['adamw', *classes]}")
    if name.startswith("paged") and device.type != "cuda":
        log.info("trainer.optimizer=%s: no paging on %s, bitsandbytes runs it unpaged", name, device.type)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return classes[name](params, lr=lr, weight_decay=weight_decay)


def warmup_cosine(optimizer, warmup_steps: int, max_steps: int, min_ratio: float = 0.0):
    """Linear warmup from 0 to lr over warmup_steps, then cosine decay to min_ratio * lr."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# bitsandbytes pages these per-parameter buffers (its init_state makes them with get_state_buffer);
# the rest of a parameter's state (step, quantization maps, absmax) is small and never paged.
PAGED_STATE_KEYS = ("state1", "state2")


def load_state(optimizer, state_dict: dict, allocate=None) -> None:
    """optimizer.load_state_dict, keeping a paged optimizer paged.

    bitsandbytes' load_state_dict casts the saved state onto the parameter's device as ordinary
    tensors, so a resumed paged optimizer would hold its whole state in GPU memory and never spill
    it to the host again: exactly the memory a paged optimizer was chosen to free. After the load,
    every buffer bitsandbytes would have paged is re-created through the optimizer's own allocator
    (`get_state_buffer`: a paged buffer on CUDA for tensors of 1e5+ elements, a plain one
    elsewhere) and filled with the loaded values. `allocate(param, dtype)` replaces that allocator
    in tests, which have no CUDA.
    """
    optimizer.load_state_dict(state_dict)
    if not getattr(optimizer, "is_paged", False):
        return
    allocate = allocate or optimizer.get_state_buffer
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            for key in PAGED_STATE_KEYS:
                t = state.get(key)
                if not isinstance(t, torch.Tensor) or getattr(t, "is_paged", False) or t.shape != p.shape:
                    continue
                buf = allocate(p, dtype=t.dtype)
                buf.copy_(t)
                state[key] = buf
