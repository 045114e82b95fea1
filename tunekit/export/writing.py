"""Where an export may be written, and writing a single file (GGUF) atomically with its report.

Folders (adapter, merged) go through tunekit.train.checkpoint.atomic_dir; a GGUF (a model, or a LoRA
adapter for llama.cpp) is one file plus PATH.fidelity.json beside it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from tunekit import TunekitError
from tunekit.owned import Scratch

FILE_FORMATS = ("gguf", "gguf-adapter")  # one file at PATH; the other formats write a folder


def report_path(fmt: str, out: Path) -> Path:
    return out.with_name(out.name + ".fidelity.json") if fmt in FILE_FORMATS else out / "fidelity.json"


def check_out(fmt: str, out: Path, run_dir: Path) -> None:
    """Refuse any PATH whose replacement could destroy something that is not a previous export."""
    # Compared resolved: a symlink on the way (a link to the run, or to one of its folders) would
    # otherwise pass the check and the export would be written inside the run folder.
    real, real_run = out.resolve(), run_dir.resolve()
    if real == real_run or real_run in real.parents or out == run_dir or run_dir in out.parents:
        where = "" if real == out else f" (through a link: it is {real})"
        raise TunekitError(f"--out: {out} is inside the run folder {run_dir}{where}; export somewhere else")
    # The folder it goes in must be creatable and writable: refused now, not after the export's
    # minutes of loading and measuring, with an OSError from deep in the writer.
    parent = next((p for p in real.parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise TunekitError(f"--out: {out} lies under {parent}, which is a file")
    if parent is not None and not os.access(parent, os.W_OK | os.X_OK):
        raise TunekitError(f"--out: cannot write in {parent} (permission denied or a read-only location)")
    if not out.exists():
        return
    is_dir_format = fmt not in FILE_FORMATS
    if is_dir_format != out.is_dir():
        raise TunekitError(f"--out: {out} exists and is a {'folder' if out.is_dir() else 'file'}; "
                           f"--format {fmt} writes a {'folder' if is_dir_format else 'file'}")
    if not report_path(fmt, out).is_file():
        raise TunekitError(f"--out: {out} exists and is not a tunekit export (no {report_path(fmt, out).name}); "
                           "choose another path or remove it")


def atomic_file(out: Path, build: Callable[[Path], dict], report_name: str) -> dict:
    """build(tmp_dir) writes tmp_dir/out.name and tmp_dir/report_name; both are then moved beside
    PATH, the report first and the GGUF last, so a GGUF at PATH always has its report."""
    # built in a marked scratch folder beside PATH (tunekit.owned), removed with everything in it
    with Scratch(out) as scratch:
        scratch.new.mkdir()
        report = build(scratch.new)
        os.replace(scratch.new / report_name, report_path("gguf", out))
        os.replace(scratch.new / out.name, out)
        return report
