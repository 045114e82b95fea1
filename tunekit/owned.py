"""What tunekit writes beside its outputs while it works, and therefore all it may delete.

Every output that must appear whole (a checkpoint, the adapter, config.yaml, summary.json, an
export) is built in a scratch folder beside its target and renamed into place, so a crash leaves
the old output or the new one, never half of one. Output folders are shared with their owner (a
user may keep notes, photos or their own `.draft.tmp` in them), so a scratch folder is tunekit's
by proof, not by look: its name starts with `.tunekit.tmp-`, and the first thing written into it
is a marker file, tunekit-scratch.json, naming the target and the writing process (pid, host,
time). A target being replaced is first moved *into* that scratch folder (`old`), so a crash
between the two renames leaves nothing outside it.

`cleanup_leftovers` removes only marked scratch folders whose process is gone, after renaming a
stranded `old` back to its target; a look-alike without the marker (`.draft.tmp`, `.photos.old/`,
`x.tmp-123`, an unmarked `.tunekit.tmp-*`) is never touched. The only window that leaks is a kill
between creating a scratch folder and writing its marker: an empty hidden folder stays behind,
which is better than guessing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

log = logging.getLogger(__name__)

PREFIX = ".tunekit.tmp-"
MARKER = "tunekit-scratch.json"
MAGIC = "tunekit scratch folder v1"
NEW, OLD = "new", "old"  # inside a scratch folder: what is being built, and the target it replaces
# Sub-folders of a run where tunekit writes atomically (output_dir itself, and these).
RUN_SUBFOLDERS = ("checkpoints", "best")
_MARKER_MAX_BYTES = 4096


def pid_running(pid: int) -> bool:
    """Whether a process with this pid exists on this machine (a zombie counts as existing)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


class Scratch:
    """A marked scratch folder beside `target` (same folder, so renames out of it are atomic).

    Use as a context manager: `new` is where the output is built, `old` where a replaced target
    goes. On the way out (normally or by an exception, SIGINT/SIGTERM included) a target moved
    to `old` whose replacement never took its place is put back, then the folder is removed.
    """

    def __init__(self, target: Path):
        self.target = Path(target)
        parent = self.target.parent
        parent.mkdir(parents=True, exist_ok=True)
        # the target's name only helps a reader of `ls -a`; the marker holds it whole (names are
        # cut so that the folder's name stays under the 255 bytes a file name may have)
        self.root = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{self.target.name[:64]}-", dir=parent))
        try:
            (self.root / MARKER).write_text(json.dumps({
                "tunekit": MAGIC, "target": self.target.name, "pid": os.getpid(), "host": socket.gethostname(),
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}))
        except BaseException:
            shutil.rmtree(self.root, ignore_errors=True)  # just made by us, and still unmarked
            raise
        self.new, self.old = self.root / NEW, self.root / OLD

    def __enter__(self) -> "Scratch":
        return self

    def __exit__(self, *exc) -> None:
        if os.path.lexists(self.old) and not os.path.lexists(self.target):
            try:
                os.rename(self.old, self.target)
            except OSError as e:  # keep the folder, marker and all: the next run's cleanup restores it
                log.warning("could not put %s back from %s (%s)", self.target, self.root, e.strerror or e)
                return
        remove_scratch(self.root)


def read_marker(folder: Path) -> Optional[dict]:
    """The marker of a tunekit scratch folder, or None where `folder` is not provably one."""
    folder = Path(folder)
    if not folder.name.startswith(PREFIX) or folder.is_symlink() or not folder.is_dir():
        return None
    marker = folder / MARKER
    try:
        if marker.is_symlink() or not marker.is_file() or marker.stat().st_size > _MARKER_MAX_BYTES:
            return None
        info = json.loads(marker.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    if not isinstance(info, dict) or info.get("tunekit") != MAGIC:
        return None
    target = info.get("target")
    # a plain name in the same folder: a marker must never point a restore anywhere else
    if not isinstance(target, str) or target in ("", ".", "..") or "/" in target or "\0" in target:
        return None
    return info


def is_scratch(path: Path) -> bool:
    return read_marker(path) is not None


def _still_writing(info: dict) -> bool:
    """A scratch folder of a live process on this machine, other than this one, is in use."""
    pid = info.get("pid")
    if info.get("host") != socket.gethostname() or not isinstance(pid, int) or isinstance(pid, bool):
        return False  # another machine's (a shared disk): the run's lock says nobody writes here now
    return pid != os.getpid() and pid > 0 and pid_running(pid)


def remove_scratch(folder: Path) -> bool:
    """Remove a scratch folder: its contents first, the marker last, so that a crash halfway leaves
    a folder that is still provably ours. True if it is gone."""
    folder = Path(folder)
    if not folder.is_dir():
        return not os.path.lexists(folder)
    for p in list(folder.iterdir()):
        if p.name == MARKER:
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            try:
                p.unlink()
            except OSError:  # gone already, or not ours to remove: the folder then stays, marked
                pass
    if any(p.name != MARKER for p in folder.iterdir()):
        return False
    (folder / MARKER).unlink(missing_ok=True)
    try:
        folder.rmdir()
    except OSError:
        return False
    return True


# ------------------------------------------------------------------ atomic writes
def atomic_dir(target: Path, write: Callable[[Path], None]) -> None:
    """Call write(folder) on a fresh folder, then move it to `target`, replacing an older target.

    The older target is moved into the scratch folder first and removed with it; a crash between
    the two renames leaves it there, and `cleanup_leftovers` (or the exit of this call) puts it back.
    """
    target = Path(target)
    with Scratch(target) as s:
        s.new.mkdir()
        write(s.new)
        if os.path.lexists(target):
            os.rename(target, s.old)
        os.rename(s.new, target)


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Call write(file) on a fresh path (same suffix as `path`: writers that pick a format by it,
    as matplotlib does), then move that file over `path` in one rename."""
    path = Path(path)
    with Scratch(path) as s:
        tmp = s.root / f"{NEW}{path.suffix}"
        write(tmp)
        os.replace(tmp, path)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda tmp: tmp.write_text(text))


def cleanup_leftovers(output_dir: Path) -> list[str]:
    """Remove what interrupted saves left in a run folder (itself, checkpoints/, best/); returns
    what was done, one line per action.

    Only marked scratch folders of processes that are gone: an `old` inside one whose target is
    missing (the crash came between atomic_dir's two renames) is renamed back first. Anything
    else, whatever its name, is left alone.
    """
    done = []
    root = Path(output_dir)
    for folder in (root, *(root / sub for sub in RUN_SUBFOLDERS)):
        if not folder.is_dir():
            continue
        for p in sorted(folder.iterdir()):
            info = read_marker(p)
            if info is None:
                continue
            if _still_writing(info):
                done.append(f"kept {p}: pid {info['pid']} is still writing it")
                continue
            target = folder / info["target"]
            old = p / OLD
            if os.path.lexists(old) and not os.path.lexists(target):
                os.rename(old, target)
                done.append(f"restored {target} from {p.name}")
            if remove_scratch(p):
                done.append(f"removed {p}")
    return done


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file, read in 1 MiB blocks (what checkpoints and data fingerprints record)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
