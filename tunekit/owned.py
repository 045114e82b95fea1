"""What tunekit writes beside its outputs while it works, and therefore all it may delete.

Every output that must appear whole (a checkpoint, the adapter, config.yaml, summary.json, an
export) is built in a scratch folder and renamed into place, so a crash leaves the old output or
the new one, never half of one. A target being replaced is first moved *into* that scratch folder
(`old`), so a crash between the two renames leaves nothing outside it. Output folders are shared
with their owner (a user may keep notes, photos or their own `.draft.tmp` in them), so a scratch
folder is tunekit's by proof, not by look (its `.tunekit.tmp-` name proves nothing: a user may have
one too). Two proofs, by where the save happens:

- In a run's folder, a run (which holds the folder's lock, tunekit.train.runlock) opens one scratch
  home when it starts, `.tunekit.tmp-run-<random>`, and builds every save there. It writes the
  home's name into its lock file *before* creating it: from the moment the home exists, the record
  says it is the run's, and everything inside it is the run's by where it is. A run that dies (a
  SIGKILL mid-save) leaves the record; the next run on the folder takes the lock over, puts back a
  target a save had moved aside, and removes the homes the record names (`cleanup_leftovers`). A
  home also holds a marker, so that one is found when its lock file is gone.
- Anywhere else (an export's --out), a scratch folder beside the target whose first file is a
  marker, tunekit-scratch.json, naming the target and the writing process (pid, host, time). The
  window there is a kill between creating the folder and writing its marker: an empty hidden
  folder stays behind, which is better than guessing.

`cleanup_leftovers` touches nothing else: a look-alike (`.draft.tmp`, `.photos.old/`,
`x.tmp-123`, an unmarked `.tunekit.tmp-*` that no lock record names) is never touched.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import secrets
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
HOME_PREFIX = f"{PREFIX}run-"
_HOME_NAME = re.compile(re.escape(HOME_PREFIX) + r"[0-9a-f]{16}")
# This process's open homes, by the real path of their run folder (ScratchHome.open registers one).
_homes: dict[str, "ScratchHome"] = {}


def is_home_name(name) -> bool:
    """A name as ScratchHome.open makes them (what a lock record may name: nothing else is removed)."""
    return isinstance(name, str) and _HOME_NAME.fullmatch(name) is not None


def _marker_text(**fields) -> str:
    return json.dumps({"tunekit": MAGIC, "pid": os.getpid(), "host": socket.gethostname(),
                       "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **fields})


def pid_running(pid: int) -> bool:
    """Whether a process with this pid exists on this machine (a zombie counts as existing)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


class ScratchHome:
    """The folder where one run builds every save into its run folder (see the module docstring).

    open() records the home's name through `journal` (the run's lock: record_scratch/drop_scratch)
    before it creates it, and registers it: from then on every Scratch whose target lies in the run
    folder, on its file system, is made inside it. close() puts back what a save left moved aside,
    removes the home and forgets it."""

    def __init__(self, folder: Path, path: Path):
        self.folder, self.path = folder, path
        self.name = path.name

    @classmethod
    def open(cls, folder: Path, journal) -> "ScratchHome":
        folder = Path(folder).absolute()
        while True:
            name = HOME_PREFIX + secrets.token_hex(8)
            if os.path.lexists(folder / name):  # 64 random bits taken: never, but never record a name in use
                continue
            journal.record_scratch(name)
            try:
                os.mkdir(folder / name)
            except FileExistsError:  # made by someone else since the check above: not ours, forget it
                journal.drop_scratch(name)
                continue
            break
        path = folder / name
        (path / MARKER).write_text(_marker_text(home=True))  # found by a scan, when the lock file is gone
        home = cls(folder, path)
        _homes[os.path.realpath(folder)] = home
        return home

    def holds(self, target: Path) -> bool:
        """Whether a save to `target` is built here: it lies in the run folder (itself, checkpoints/,
        best/, ...) on the home's file system, so that the renames out of the home stay atomic."""
        parent, root = os.path.realpath(Path(target).parent), os.path.realpath(self.folder)
        if parent != root and not parent.startswith(root + os.sep):
            return False
        try:
            return os.stat(parent).st_dev == os.stat(self.path).st_dev
        except OSError:
            return False

    def close(self) -> bool:
        """Put back what a save left moved aside, remove the home; True if it is gone."""
        _homes.pop(os.path.realpath(self.folder), None)
        _settle_home(self.folder, self.path)
        return not os.path.lexists(self.path)


def _home_for(target: Path) -> Optional[ScratchHome]:
    return next((home for home in _homes.values() if home.holds(target)), None)


class Scratch:
    """A scratch folder for `target`: in the run's home where the target lies in an open one's run
    folder (ScratchHome), else a marked one beside it (same folder: renames out of it are atomic).

    Use as a context manager: `new` is where the output is built, `old` where a replaced target
    goes. On the way out (normally or by an exception, SIGINT/SIGTERM included) a target moved
    to `old` whose replacement never took its place is put back, then the folder is removed.
    """

    def __init__(self, target: Path):
        self.target = Path(target)
        parent = self.target.parent
        parent.mkdir(parents=True, exist_ok=True)
        self.home = _home_for(self.target)
        # the target's name only helps a reader of `ls -a`; the marker holds it whole (names are
        # cut so that the folder's name stays under the 255 bytes a file name may have)
        if self.home is not None:  # the run's by where it is: the marker only says what an `old` is
            self.root = Path(tempfile.mkdtemp(prefix=f"{self.target.name[:64]}-", dir=self.home.path))
            target = os.path.relpath(os.path.join(os.path.realpath(parent), self.target.name),
                                     os.path.realpath(self.home.folder))
        else:
            self.root = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{self.target.name[:64]}-", dir=parent))
            target = self.target.name
        try:
            (self.root / MARKER).write_text(_marker_text(target=target))
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
        if self.home is not None:
            shutil.rmtree(self.root, ignore_errors=True)  # inside the home: a kill halfway leaves it there
        else:
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
    if info.get("home") is True:  # a run's scratch home (ScratchHome): no target of its own
        return info if is_home_name(folder.name) else None
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


def discard(path: Path) -> None:
    """Remove an output of tunekit's (an older checkpoint it prunes) so that a kill at any moment
    leaves it whole or gone, never a half whose files a later run would take for the user's: one
    rename moves it into a scratch folder (not as `old`: nothing puts it back), removed with it."""
    path = Path(path)
    if not os.path.lexists(path):
        return
    with Scratch(path) as s:
        os.rename(path, s.root / "discarded")


def cleanup_leftovers(output_dir: Path, recorded=()) -> list[str]:
    """Remove what interrupted saves left in a run folder; returns what was done, a line per action.

    `recorded`: the scratch homes the folder's lock record names (tunekit.train.runlock; the caller
    holds the lock, so their run is over), removed whatever they hold. Then homes found by their
    marker, and marked scratch folders beside targets (the folder itself, checkpoints/, best/), of
    processes that are gone. A target a save had moved aside (`old`) and not replaced is renamed back
    first. Anything else, whatever its name, is left alone.
    """
    done = []
    root = Path(output_dir)
    if not root.is_dir():
        return done
    homes = [root / name for name in recorded if is_home_name(name)]
    for folder in (root, *(root / sub for sub in RUN_SUBFOLDERS)):
        if not folder.is_dir():
            continue
        for p in sorted(folder.iterdir()):
            info = read_marker(p)
            if info is None or p in homes:
                continue
            if _still_writing(info):
                done.append(f"kept {p}: pid {info['pid']} is still writing it")
            elif info.get("home") is True:
                homes.append(p)
            else:
                done += _settle(folder, p, folder / info["target"])
    for home in homes:
        if os.path.isdir(home) and not os.path.islink(home):
            done += _settle_home(root, home)
    return done


def _settle(folder: Path, scratch: Path, target: Path, remove: Optional[Callable[[Path], bool]] = remove_scratch
            ) -> list[str]:
    """Rename a stranded `old` in `scratch` back to `target` when that is missing, then remove the
    scratch folder (unless `remove` is None: a home goes whole)."""
    done = []
    old = scratch / OLD
    if os.path.lexists(old) and not os.path.lexists(target):
        try:
            os.rename(old, target)
        except OSError as e:  # keep it whole for the next try: it holds the only copy
            return [f"kept {scratch}: could not put back {target} ({e.strerror or e})"]
        done.append(f"restored {target} from {scratch.relative_to(folder)}")
    if remove is not None and remove(scratch):
        done.append(f"removed {scratch}")
    return done


def _home_target(folder: Path, scratch: Path) -> Optional[Path]:
    """The target a scratch folder in a home was made for (a path inside the run folder), or None."""
    marker = scratch / MARKER
    try:
        info = json.loads(marker.read_text()) if not marker.is_symlink() else None
    except (OSError, UnicodeDecodeError, ValueError):
        return None  # a kill before its marker was whole: nothing was moved in yet
    rel = info.get("target") if isinstance(info, dict) else None
    if not isinstance(rel, str) or os.path.isabs(rel) or any(part in ("", ".", "..") for part in rel.split(os.sep)):
        return None
    return folder / rel


def _settle_home(folder: Path, home: Path) -> list[str]:
    """Every stranded `old` in a run's home put back, then the home removed whole (all of it is the
    run's); kept where a target could not be put back."""
    done = []
    for scratch in sorted(home.iterdir()):
        if scratch.is_dir() and not scratch.is_symlink():
            target = _home_target(folder, scratch)
            if target is not None:
                done += _settle(folder, scratch, target, remove=None)
    if any(line.startswith("kept") for line in done):
        return done
    shutil.rmtree(home, ignore_errors=True)
    if not os.path.lexists(home):
        done.append(f"removed {home}")
    return done


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file, read in 1 MiB blocks (what checkpoints and data fingerprints record)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
