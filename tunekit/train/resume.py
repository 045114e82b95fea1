"""What makes a run folder resumable: its fingerprint, and the rules for reusing a folder.

A checkpoint records the fingerprint of the run that wrote it: every config value that shapes the
trained weights or the order of the data (method, rank, targets, optimizer, lr, seed, batch
layout, dtype...), the SHA-256 of the data files, and the number of ranks. Resuming with any of
them changed would silently train a different run on top of the first, so it is refused with
the keys that differ. The number of ranks alone may change where every rank saved the whole
optimizer state (data parallel, one process): the run goes on with a larger or smaller global batch
and says so. FSDP's checkpoint holds one part of the optimizer state per rank: it resumes only on
as many ranks as wrote it (`world_size_change`). What only changes when or how long the run trains, or what it reports, may
change: `MAY_CHANGE` below.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

from tunekit import TunekitError
from tunekit.train.checkpoint import STATE_JSON, find_resumable, read_state
from tunekit.config import STUDENT_DIR, plain
from tunekit.owned import is_scratch
from tunekit.train.runlock import LOCK_NAME, recorded_scratch

# Keys (or key prefixes, ending in ".") a resumed run may change.
MAY_CHANGE = (
    "output_dir", "recipe",                       # where the run lives; the recipe's name is a label
    "trainer.max_steps", "trainer.epochs",        # train longer or shorter (the cosine schedule follows)
    "trainer.eval_every", "trainer.save_every", "trainer.keep_checkpoints", "trainer.resume",
    "trainer.memory_check",                       # a safety check, not part of the run
    "trainer.allow_nonempty_output_dir",          # where the run may live, not what it trains
    "data.max_val_examples",                      # only what is evaluated
    "data.cache", "data.cache_dir", "data.num_proc",  # where and how rows are tokenized: the same examples
    "trainer.eval_samples", "trainer.eval_task", "trainer.eval_task_rows", "trainer.eval_max_new_tokens",
    "trainer.keep_best", "trainer.best_metric",   # what is reported, and which adapter/ is exported
    "tracker.",                                   # where metrics go
    "kernels.",                                   # the fused kernel computes the same function
    "model.gradient_checkpointing",               # recomputation, not a different result
)
# What a folder holds once a run has started writing into it.
DATA_FINGERPRINT = "data.sha256.json"  # written beside config.yaml at the start of a run (tunekit.train.build)
RUN_FILES = ("config.yaml", "metrics.jsonl", "summary.json", "checkpoints", "adapter")


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = [plain(x) for x in v] if isinstance(v, (list, tuple)) else plain(v)
    return out


def fingerprint(cfg, world_size: int, hashes: Optional[dict] = None) -> dict[str, Any]:
    """{dotted config key: value} of everything that must not change on resume, plus data hashes
    (those of `hashes`, an earlier fingerprint of the same data files, where given: hashing a large
    file twice costs seconds)."""
    from tunekit.data.formats import DEFAULT_DATA_DIR

    flat = _flatten(asdict(cfg))
    kept = {k: v for k, v in flat.items()
            if not any(k == m or (m.endswith(".") and k.startswith(m)) for m in MAY_CHANGE)}
    data = cfg.data
    # a file's sha256; also save_to_disk folders, hub ids, and a list of sources with their settings
    from tunekit.data.mixture import fingerprint as data_fingerprint, is_mixture

    train = data.path if is_mixture(data.path) else Path(data.path) if data.path else DEFAULT_DATA_DIR / "train.jsonl"
    val = Path(data.val_path) if data.val_path else (DEFAULT_DATA_DIR / "val.jsonl" if not data.path else None)
    if hashes is not None:
        kept.update({k: v for k, v in hashes.items() if k.endswith(":sha256")})
    else:
        kept["data.path:sha256"] = data_fingerprint(train)
        kept["data.val_path:sha256"] = data_fingerprint(val, "data.val_path") if val is not None else None
        template = _template_file(data.chat_template)
        if template is not None:  # a .jinja file: its text shapes every row (a name of a built-in: the key)
            kept["data.chat_template:sha256"] = hashlib.sha256(template.read_bytes()).hexdigest()
    if cfg.model.adapter is not None and "model.adapter:sha256" not in kept:  # the frozen start's content
        from tunekit.model.start_adapter import open_start

        kept["model.adapter:sha256"] = open_start(cfg.model.adapter).sha256
    kept["world_size"] = world_size
    if kept.get("objective") != "preference":
        # the preference node shapes nothing else: checkpoints written before it existed still resume
        kept = {k: v for k, v in kept.items() if not k.startswith("preference.")}
    if kept.get("trainer.strategy") == "ddp":
        # the default, as before the key existed: checkpoints written then still resume
        del kept["trainer.strategy"]
    return kept


def _template_file(value) -> Optional[Path]:
    """data.chat_template's file, where it names one that exists."""
    from tunekit.data.templates import TEMPLATES

    if not isinstance(value, str) or value in TEMPLATES or not Path(value).expanduser().is_file():
        return None
    return Path(value).expanduser()


def _shards(fp: dict) -> bool:
    """Whether the run of fingerprint `fp` shards its optimizer state over its ranks (FSDP on several)."""
    return fp.get("trainer.strategy") == "fsdp" and (fp.get("world_size") or 1) > 1


def world_size_change(saved: dict, current: dict, ckpt: Path) -> Optional[str]:
    """A different number of ranks on resume: None where it is the same; the refusal (a TunekitError)
    where either run shards the optimizer state (FSDP keeps one part per rank: it resumes on as many
    ranks as wrote it); else (data parallel: every rank saved the whole state) the line to log, since
    the global batch changes size from here on."""
    was, now = saved.get("world_size"), current.get("world_size")
    if was is None or was == now:
        return None
    if _shards(saved) or _shards(current):
        def ranks(fp: dict, n) -> str:
            return f"{n} FSDP rank{'s' if n != 1 else ''}" if _shards(fp) else (
                f"{n} process{'es' if n != 1 else ''} (its optimizer state whole, not sharded)")

        raise TunekitError(f"trainer.resume: the checkpoint in {ckpt} was written by {ranks(saved, was)}; this run "
                           f"has {ranks(current, now)}: FSDP saves one part of the optimizer state per rank, so the "
                           f"run resumes only on {was}; resume with --num_processes {was}, or start a new output_dir")
    return (f"trainer.resume: the checkpoint was written by {was} rank{'s' if was != 1 else ''}, this run has {now}: "
            f"the global batch changes from {was} to {now} x trainer.micro_batch_size x trainer.grad_accum examples "
            "per step; the data continues with the example after the last one trained, and ranks without a random "
            "state of their own in the checkpoint start a fresh one, so the run is no longer the one an "
            "uninterrupted run would have trained")


def run_changes(saved: dict, current: dict, ckpt: Path) -> Optional[str]:
    """What differs between a checkpoint's fingerprint and this config's, as the end of a sentence
    ("this config differs from the run saved in CKPT in seed (0 -> 1); ..."), or None. The number of
    ranks is world_size_change's."""
    changed = [k for k in sorted(set(saved) | set(current))
               if saved.get(k) != current.get(k) and k != "world_size"]
    # a list of sources' digest covers its settings too: a changed setting is named once, as the setting
    changed = [k for k in changed if not (k.endswith(":sha256") and k.removesuffix(":sha256") in changed
                                          and isinstance(current.get(k.removesuffix(":sha256")), list))]
    if not changed:
        return None

    def show(key: str) -> str:
        if key.endswith(":sha256"):
            return f"{key.removesuffix(':sha256')} (file content changed)"
        return f"{key} ({saved.get(key)!r} -> {current.get(key)!r})"

    listed = ", ".join(show(k) for k in changed[:4]) + (f" and {len(changed) - 4} more" if len(changed) > 4 else "")
    return (f"this config differs from the run saved in {ckpt} in {listed}; these shape the trained weights or the "
            "data order, so resuming would mix two runs. Restore them, or train into a new output_dir")


def check_same_run(saved: dict, current: dict, ckpt: Path) -> Optional[str]:
    """Refuse to resume `ckpt` when anything in the fingerprint differs; name what differs. Returns
    world_size_change's line where a data-parallel run resumes on another number of ranks."""
    changes = run_changes(saved, current, ckpt)
    if changes:
        raise TunekitError(f"trainer.resume: {changes}")
    return world_size_change(saved, current, ckpt)


def check_output_dir(output_dir: Path, resume: bool, allow_nonempty: bool = False) -> None:
    """Never start a run over another one, nor into a folder of someone else's files.

    A folder with any run file needs trainer.resume=true. A folder without one must be empty (what
    tunekit itself leaves there, its lock and marked scratch folders, does not count) unless
    trainer.allow_nonempty_output_dir=true: tunekit would then write beside those files, and they
    stay as they are (it deletes only what it can show it wrote, tunekit.owned).
    """
    out = Path(output_dir)
    found = [name for name in RUN_FILES if (out / name).exists()]
    if found and not resume:
        raise TunekitError(f"output_dir: {out} already holds a run ({', '.join(found)}); pass "
                           "trainer.resume=true to continue it, or choose another output_dir")
    if found:
        _check_checkpoint_names(out)
    else:
        check_not_foreign(out, allow_nonempty)


def check_not_foreign(out: Path, allow_nonempty: bool) -> None:
    """A folder without a run file is empty but for what tunekit left there, unless allowed."""
    if allow_nonempty or not out.is_dir() or any((out / name).exists() for name in RUN_FILES):
        return
    others = sorted(p.name for p in out.iterdir() if not _tunekit_entry(p))
    if others:
        shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        raise TunekitError(f"output_dir: {out} is not empty and holds no tunekit run ({shown}); give a new or empty "
                           "folder, or pass trainer.allow_nonempty_output_dir=true to write the run beside these "
                           "files (tunekit leaves them alone)")


def _tunekit_entry(p: Path) -> bool:
    """What tunekit may have left in a folder before its config.yaml: its lock, a marked scratch
    folder or a scratch home its lock file names, the student a distillation builds first."""
    return p.name in (LOCK_NAME, STUDENT_DIR) or is_scratch(p) or p.name in recorded_scratch(p.parent)


def _check_checkpoint_names(out: Path) -> None:
    """A folder named as tunekit names a checkpoint, without the trainer_state.json every checkpoint
    has, was not written by tunekit (or was emptied by hand): saving that step would replace it."""
    root = out / "checkpoints"
    if os.path.lexists(root) and not root.is_dir():
        # a file (or a dangling link) there: no checkpoint would be found, the run would restart from
        # step 0 over the run's own files, and its first save would fail
        raise TunekitError(f"output_dir: {root} is not a folder; tunekit keeps checkpoints in it: move it out "
                           f"of {out} to resume")
    if not root.is_dir():
        return
    for p in sorted(root.iterdir()):
        if re.fullmatch(r"step-\d{6}", p.name) and not (p / STATE_JSON).is_file():
            raise TunekitError(f"output_dir: {p} is not a tunekit checkpoint (no {STATE_JSON}) but has a "
                               f"checkpoint's name, which a save would replace; move it out of {root}")


def check_resumable(output_dir: Path, max_steps, current: Optional[dict] = None) -> None:
    """trainer.resume=true: refuse, before anything loads or is written, a run with nothing to resume.

    A damaged checkpoint (files that fail their checksum, a trainer_state.json without a whole-number
    step or the ranks' random state) is skipped for an older intact one, as a truncated copy always
    was; with none intact the first damaged one is named. A finished run (adapter/ and summary.json)
    resumes only to train longer: otherwise no step would run, and summary.json, config.yaml and
    metrics.jsonl would be rewritten over the run's own. So would they from a checkpoint already at or
    past trainer.max_steps. `current`, this config's fingerprint: a change to what the run trains is
    refused too, in the same message as the steps (a user who raised max_steps should not find the
    changed seed only then). metrics.jsonl is rewritten on resume: it must read back whole first.
    max_steps "auto" (trainer.epochs sizes the run, from its rows): the steps are checked once the
    count is known (check_steps_left, from tunekit.train.build).
    """
    from tunekit.train.tracking import check_metrics

    out = Path(output_dir)
    finished = all((out / n).exists() for n in ("adapter", "summary.json"))
    ckpt, skipped = find_resumable(out)
    if ckpt is None and skipped:
        raise TunekitError(f"trainer.resume: no intact checkpoint in {out / 'checkpoints'} ({skipped[0]}); "
                           "remove the damaged ones to start over")
    if ckpt is None:
        if finished:
            raise TunekitError(f"trainer.resume: the run in {out} is finished (adapter/ and summary.json are "
                               "written) and has no checkpoint to continue from; to train longer, train into a new "
                               "output_dir with a larger trainer.max_steps")
        return
    state = read_state(ckpt)
    conflicts = []
    if isinstance(max_steps, int) and state["step"] >= max_steps:
        run = f"the run in {out} is finished; its" if finished else "the"
        conflicts.append(f"trainer.max_steps: {run} checkpoint {ckpt} is at step {state['step']}, "
                         f"{'already at' if state['step'] == max_steps else 'past'} trainer.max_steps={max_steps}: "
                         f"nothing to resume. To train longer, raise trainer.max_steps above {state['step']}")
    changes = None
    if current is not None:
        # `auto` settings take their value from the memory plan, later: compared then (_find_checkpoint)
        later = {k for k, v in current.items() if v == "auto"}
        changes = run_changes({k: v for k, v in state.get("fingerprint", {}).items() if k not in later},
                              {k: v for k, v in current.items() if k not in later}, ckpt)
    if changes:
        conflicts.append(f"trainer.resume: {changes}")
    if current is not None:
        try:
            world_size_change(state.get("fingerprint", {}), current, ckpt)
        except TunekitError as e:
            conflicts.append(str(e))
    if len(conflicts) == 1:
        raise TunekitError(conflicts[0])
    if conflicts:  # every one in one line: fixing the first must not only reveal the next
        raise TunekitError(f"trainer.resume: the run in {out} cannot be resumed as configured, for "
                           f"{len(conflicts)} reasons: " + "; ".join(f"({i}) {c}" for i, c in enumerate(conflicts, 1)))
    check_metrics(out / "metrics.jsonl")


def check_steps_left(step: int, max_steps: int, epochs, ckpt: Path) -> None:
    """A run sized by trainer.epochs, resumed from a checkpoint at `step`: refused where its
    `max_steps` (the count the epochs resolve to) leaves no step to run."""
    if epochs is not None and step >= max_steps:
        raise TunekitError(f"trainer.epochs: checkpoint {ckpt} is at step {step}, "
                           f"{'already at' if step == max_steps else 'past'} the {max_steps} steps trainer.epochs="
                           f"{epochs:g} resolves to: nothing to resume. To train longer, raise trainer.epochs")
