"""Checkpoints: the adapter plus the full training state, written atomically, read without pickle.

output_dir/checkpoints/step-000020/
    adapter/                 Method.save() output (read back and verified as it is written)
    optimizer.safetensors    every tensor of the optimizer's state
    trainer_state.json       step, tokens seen, first evaluation, the run's fingerprint, the
                             optimizer's structure (tensors referenced by key), the scheduler, the
                             random state of every rank, and the SHA-256 of every file above.
                             Written last: its presence marks a complete checkpoint.

Checkpoints get shared, so loading one must never run code: everything is safetensors (raw
tensors) or JSON (plain values). Each checkpoint is built in the run's scratch home (tunekit.owned)
and renamed into place, and a pruned one leaves through it, so a crash leaves the old set of
checkpoints or the new one, each whole; a file damaged later
(truncated copy, disk error) fails its checksum, and resume falls back to the newest intact one.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Callable, Optional

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from tunekit import TunekitError
from tunekit.train.optim import load_state
# The atomic writes live in tunekit.owned (what tunekit may delete); imported from here by older callers.
from tunekit.owned import atomic_dir, atomic_write_text, cleanup_leftovers, discard, sha256_file  # noqa: F401

log = logging.getLogger(__name__)

STATE_JSON = "trainer_state.json"
OPTIMIZER_FILE = "optimizer.safetensors"
FORMAT_VERSION = 2  # 1: training_state.pt (pickle), no longer read


def step_of(ckpt: Path) -> int:
    try:
        return int(Path(ckpt).name.split("-")[1])
    except (IndexError, ValueError):
        return -1


def checkpoint_dirs(output_dir: Path) -> list[Path]:
    """Complete checkpoints (their marker file exists), oldest first."""
    root = Path(output_dir) / "checkpoints"
    if not root.is_dir():
        return []
    done = [d for d in root.glob("step-*") if (d / STATE_JSON).is_file() and step_of(d) >= 0]
    return sorted(done, key=step_of)


def latest_checkpoint(output_dir: Path) -> Optional[Path]:
    dirs = checkpoint_dirs(output_dir)
    return dirs[-1] if dirs else None


# ------------------------------------------------------------------ state trees without pickle
def encode_tree(obj, tensors: dict[str, torch.Tensor], path: str = "state"):
    """A nested state (dicts, lists, tuples, numbers, strings, tensors) as JSON-able values.

    Tensors go into `tensors` under a fresh key and are replaced by {"__tensor__": key}. Dicts
    with non-string keys (an optimizer's per-parameter state) and tuples keep their type through
    small tags. Anything else is refused: it would need pickle.
    """
    if isinstance(obj, torch.Tensor):
        key = f"t{len(tensors)}"
        tensors[key] = obj.detach().to("cpu").contiguous().clone()
        return {"__tensor__": key}
    if isinstance(obj, bool) or obj is None or isinstance(obj, (int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else {"__float__": repr(obj)}
    if isinstance(obj, torch.dtype):
        return {"__dtype__": str(obj).removeprefix("torch.")}
    if isinstance(obj, tuple):
        return {"__tuple__": [encode_tree(v, tensors, f"{path}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [encode_tree(v, tensors, f"{path}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: encode_tree(v, tensors, f"{path}.{k}") for k, v in obj.items()}
        return {"__items__": [[encode_tree(k, tensors, path), encode_tree(v, tensors, f"{path}[{k!r}]")]
                              for k, v in obj.items()]}
    raise TypeError(f"cannot checkpoint {type(obj).__name__} at {path} without pickle")


def decode_tree(obj, tensors: dict[str, torch.Tensor]):
    """Inverse of encode_tree. Only builds plain values and tensors: nothing is executed."""
    if isinstance(obj, list):
        return [decode_tree(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "__tensor__" in obj:
        return tensors[obj["__tensor__"]]
    if "__float__" in obj:
        return float(obj["__float__"])
    if "__dtype__" in obj:
        dtype = getattr(torch, str(obj["__dtype__"]), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown dtype {obj['__dtype__']!r}")
        return dtype
    if "__tuple__" in obj:
        return tuple(decode_tree(v, tensors) for v in obj["__tuple__"])
    if "__items__" in obj:
        return {decode_tree(k, tensors): decode_tree(v, tensors) for k, v in obj["__items__"]}
    return {k: decode_tree(v, tensors) for k, v in obj.items()}


def _file_digests(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): sha256_file(p) for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != STATE_JSON}


# ------------------------------------------------------------------ save / verify / load
def save_checkpoint(output_dir: Path, step: int, save_adapter: Callable[[Path], None], optimizer, scheduler,
                    trainer_state: dict, rng_states: list[dict], keep: int) -> Path:
    """Write checkpoints/step-NNNNNN atomically and prune all but the newest `keep`.

    trainer_state: JSON-able run facts (tokens seen, first evaluation, fingerprint); rng_states:
    one `tunekit.device.facts.rng_state` per rank, in rank order.
    """
    target = Path(output_dir) / "checkpoints" / f"step-{step:06d}"
    if target.exists() and not (target / STATE_JSON).is_file():
        # Replacing it would delete a folder tunekit cannot show it wrote (a checkpoint always has its
        # trainer_state.json: it is written last, inside the scratch folder).
        raise TunekitError(f"{target} exists and is not a tunekit checkpoint (no {STATE_JSON}); tunekit will not "
                           f"replace it: move it out of {target.parent}")

    def write(tmp: Path) -> None:
        save_adapter(tmp / "adapter")
        tensors: dict[str, torch.Tensor] = {}
        optimizer_tree = encode_tree(optimizer.state_dict(), tensors, "optimizer")
        save_file(tensors, str(tmp / OPTIMIZER_FILE))
        state = {"format": FORMAT_VERSION, "step": step, **trainer_state, "optimizer": optimizer_tree,
                 "scheduler": encode_tree(scheduler.state_dict(), {}, "scheduler"), "rng": rng_states,
                 "files": _file_digests(tmp)}
        (tmp / STATE_JSON).write_text(json.dumps(state, indent=1))

    try:
        atomic_dir(target, write)
    except (OSError, SafetensorError) as e:
        # The scratch folder is gone with its half-written files and every older checkpoint is as it
        # was (nothing is pruned before the new one is in place): say so, in one line.
        last = latest_checkpoint(output_dir)
        kept = f"the last good checkpoint, {last}, is intact" if last else "no earlier checkpoint was saved"
        raise TunekitError(f"{_save_error(e, target)}; {kept}") from None
    for old in checkpoint_dirs(output_dir)[:-keep]:
        discard(old)  # whole or gone: half of one, without its trainer_state.json, would pass for the user's
    return target


def _save_error(e: BaseException, target: Path) -> str:
    """What stopped a save: a full disk named as such (safetensors reports it as its own error type,
    with the OS's words inside), anything else with its reason."""
    import errno

    text = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
    if getattr(e, "errno", None) == errno.ENOSPC or "No space left" in text or "os error 28" in text:
        return f"no space left on {target.parent}: saving {target.name} failed"
    if getattr(e, "errno", None) == errno.EDQUOT:
        return f"disk quota exceeded on {target.parent}: saving {target.name} failed"
    return f"{target}: saving the checkpoint failed ({getattr(e, 'strerror', None) or text})"


def read_state(ckpt: Path) -> dict:
    """trainer_state.json of a checkpoint; TunekitError if unreadable or of an older format."""
    path = Path(ckpt) / STATE_JSON
    try:
        state = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TunekitError(f"{path}: unreadable ({type(e).__name__}: {str(e).splitlines()[0][:100]})") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT_VERSION:
        raise TunekitError(f"{path}: not a checkpoint of this tunekit version (format {state.get('format') if isinstance(state, dict) else '?'}, "
                           f"expected {FORMAT_VERSION}); older checkpoints held pickled state and are not loaded")
    # What resume reads from it beyond the checksummed files: a hand-edited or foreign state file
    # would otherwise fail mid-setup with a TypeError or KeyError. The caller (damage) then treats the
    # checkpoint as damaged: resume falls back to an older intact one, or names this file.
    step = state.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise TunekitError(f"{path}: 'step' must be a whole number >= 0, got {step!r}")
    rng = state.get("rng")
    if not isinstance(rng, list) or not rng or not all(isinstance(r, dict) for r in rng):
        raise TunekitError(f"{path}: 'rng' (the random state of every rank) is missing or not a list of objects")
    return state


def damage(ckpt: Path) -> Optional[str]:
    """Why a checkpoint cannot be resumed from (missing, truncated or altered files), or None."""
    try:
        state = read_state(ckpt)
    except TunekitError as e:
        return str(e)
    files = state.get("files")
    if not isinstance(files, dict) or OPTIMIZER_FILE not in files:
        return f"{Path(ckpt) / STATE_JSON}: no file list"
    for rel, digest in files.items():
        path = Path(ckpt) / rel
        if not path.is_file():
            return f"{path} is missing"
        if sha256_file(path) != digest:
            return f"{path} is truncated or altered (checksum mismatch)"
    return None


def find_resumable(output_dir: Path) -> tuple[Optional[Path], list[str]]:
    """The newest intact checkpoint, and a note for each newer one that is damaged."""
    skipped = []
    for ckpt in reversed(checkpoint_dirs(output_dir)):
        why = damage(ckpt)
        if why is None:
            return ckpt, skipped
        skipped.append(f"{ckpt.name}: {why}")
    return None, skipped


def load_checkpoint(ckpt: Path, optimizer, scheduler) -> dict:
    """Restore optimizer and scheduler from an intact checkpoint; returns its trainer_state.json."""
    state = read_state(ckpt)
    try:
        tensors = load_file(str(Path(ckpt) / OPTIMIZER_FILE))
        load_state(optimizer, decode_tree(state["optimizer"], tensors))
        scheduler.load_state_dict(decode_tree(state["scheduler"], {}))
    except (KeyError, ValueError, TypeError, RuntimeError, SafetensorError) as e:
        raise TunekitError(f"{ckpt}: optimizer or scheduler state does not fit this run "
                           f"({type(e).__name__}: {str(e).splitlines()[0][:120]})") from None
    return state
