"""The method applied to the base, and its start computed once: on rank 0, then sent to every rank.

A computed start (LoRA's method.init=loftq|pissa|olora: an SVD or several per target) costs minutes
on a large base. With several ranks (DDP or FSDP, before any sharding) rank 0 computes it on its own
and every other rank applies the method without it (`Method.computes_start`), then receives rank
0's tensors in place (`Strategy.broadcast_tensors`): every rank starts from bit-identical weights
whatever its device would have computed, and the others wait instead of repeating the work. A
resumed run recomputes nothing: every rank restores the checkpoint's start itself (`Method.start`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn as nn


def apply_method(method, model: nn.Module, cfg, model_dir: str, resume_dir: Optional[Path], strategy,
                 log: Callable[[str], None], start_dir: Optional[Path] = None) -> nn.Module:
    """`method` applied to `model` (cfg: the method node) and started, the same on every rank.
    start_dir: model.adapter's folder, loaded frozen under the new adapter (every rank reads it; a
    new LoRA starts at B = 0, nothing computed)."""
    if start_dir is not None:
        return method.apply_over_start(model, cfg, start_dir)
    shared = strategy.world_size > 1 and resume_dir is None and method.computes_start(cfg)
    # FSDP keeps the base in host memory until it shards; the start's SVDs run on this rank's device
    compute = strategy.device if torch.device(strategy.load_device) != torch.device(strategy.device) else None
    if not shared:
        model = method.apply(model, cfg)
        method.start(model, cfg, model_dir, resume_dir, log, compute_device=compute)  # LoftQ
        return model
    mine = strategy.rank == 0
    model = method.apply(model, cfg, compute_start=mine)
    if mine:
        method.start(model, cfg, model_dir, None, log, compute_device=compute)
    tensors = method.start_tensors(model)
    strategy.broadcast_tensors(tensors)
    extras = strategy.broadcast(method.start_extras(model) if mine else None)
    if not mine:
        method.received_start(model, cfg, extras)
    log(f"method {cfg.name}: start computed on rank 0, {len(tensors)} tensors sent to {strategy.world_size - 1} "
        f"other rank{'s' if strategy.world_size > 2 else ''}")
    return model
