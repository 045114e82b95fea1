"""Checkpoints: the adapter in PEFT format plus the full training state, written atomically.

output_dir/checkpoints/step-000020/
    adapter/             method.save() output (adapter_model.safetensors, adapter_config.json)
    training_state.pt    optimizer, scheduler, RNG states
    trainer_state.json   step, tokens seen; written last: its presence marks a complete checkpoint
Every checkpoint is built in a hidden temp folder and renamed into place, so a crash leaves either
the old set of checkpoints or the new one, never a folder that looks complete but is not.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

STATE_JSON = "trainer_state.json"


def checkpoint_dirs(output_dir: Path) -> list[Path]:
    root = Path(output_dir) / "checkpoints"
    if not root.is_dir():
        return []
    done = [d for d in root.glob("step-*") if (d / STATE_JSON).is_file()]
    return sorted(done, key=lambda d: int(d.name.split("-")[1]))


def latest_checkpoint(output_dir: Path) -> Optional[Path]:
    dirs = checkpoint_dirs(output_dir)
    return dirs[-1] if dirs else None


def atomic_dir(target: Path, write: Callable[[Path], None]) -> None:
    """Call write(tmp_dir), then move tmp_dir to target (replacing an older target)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        write(tmp)
        if target.exists():
            old = target.with_name(f".{target.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            target.rename(old)
            tmp.rename(target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def atomic_write_text(path: Path, text: str) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(output_dir: Path, step: int, save_adapter: Callable[[Path], None], optimizer, scheduler,
                    trainer_state: dict, keep: int) -> Path:
    target = Path(output_dir) / "checkpoints" / f"step-{step:06d}"

    def write(tmp: Path) -> None:
        save_adapter(tmp / "adapter")
        torch.save(
            {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "rng": rng_state()},
            tmp / "training_state.pt",
        )
        (tmp / STATE_JSON).write_text(json.dumps({"step": step, **trainer_state}, indent=2))

    atomic_dir(target, write)
    for old in checkpoint_dirs(output_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return target


def load_training_state(ckpt: Path, optimizer, scheduler) -> dict:
    # weights_only=False: the file holds RNG states (numpy arrays, tuples) that we wrote ourselves
    blob = torch.load(Path(ckpt) / "training_state.pt", map_location="cpu", weights_only=False)
    optimizer.load_state_dict(blob["optimizer"])
    scheduler.load_state_dict(blob["scheduler"])
    set_rng_state(blob["rng"])
    return json.loads((Path(ckpt) / STATE_JSON).read_text())
