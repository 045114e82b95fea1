"""One run per output_dir at a time: an OS lock on output_dir/.tunekit.lock.

Two runs writing one folder interleave metrics.jsonl, mix checkpoints and crash later, and the
output_dir checks cannot see each other: both pass before either has written a file. So a run
takes this lock before it looks at or writes anything in output_dir, and the checks run under it.

The lock is flock(2) on the open lock file, which holds the holder's pid, host and start time
for the message a second run prints. The kernel drops a flock when its process ends, however it
ends (an exception, SIGINT/SIGTERM, SIGKILL, a crash), so a lock file left by a dead run is just
a file: the next run locks it and takes it over. A run that ends normally removes the file too.
Under `accelerate launch` only rank 0 takes it (tunekit.train.loop): one run, however many ranks.

The record also lists the run's scratch home (tunekit.owned.ScratchHome), written before the home
is made: what proves it the run's. A run that takes a lock over inherits the record's homes, removes
them (`open_scratch`), and only then opens its own; a lock file whose record still lists a home
stays behind when its run ends, for the next run to finish the job. The record is always rewritten
whole, in one write: a kill at any moment leaves the old record or the new one.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Optional

from tunekit import TunekitError
from tunekit.owned import ScratchHome, cleanup_leftovers, is_home_name

LOCK_NAME = ".tunekit.lock"


def _describe(holder: Optional[dict]) -> str:
    if not holder:
        return "holder unknown: its lock file names nobody yet"
    return f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}, started {holder.get('started', '?')}"


RECORD_MAX = 1 << 16  # bytes of a lock file read as its record


def _write_record(f, record: dict) -> None:
    """The holder's record over the file's old one in a single write, never truncated first: a kill
    at any moment leaves one whole record. What a longer old record leaves beyond is blanked with
    spaces, which JSON reads past."""
    data = (json.dumps(record) + "\n").encode()
    os.pwrite(f.fileno(), data + b" " * max(0, os.fstat(f.fileno()).st_size - len(data)), 0)


def _homes_of(record: Optional[dict]) -> list[str]:
    names = record.get("scratch") if isinstance(record, dict) else None
    return [n for n in names if is_home_name(n)] if isinstance(names, list) else []


def recorded_scratch(output_dir: Path) -> list[str]:
    """The scratch homes the lock file of output_dir lists (read without taking the lock)."""
    try:
        with open(Path(output_dir) / LOCK_NAME) as f:
            return _homes_of(json.loads(f.read(RECORD_MAX) or "null"))
    except (OSError, UnicodeDecodeError, ValueError):
        return []


def _read_holder(f) -> Optional[dict]:
    """The holder's record; it writes it right after taking the lock, so wait a moment for it."""
    for _ in range(20):
        f.seek(0)
        text = f.read(RECORD_MAX)
        try:
            holder = json.loads(text)
            if isinstance(holder, dict):
                return holder
        except ValueError:
            pass
        time.sleep(0.025)
    return None


class RunLock:
    """The lock on one output_dir, held until release() or the end of the process."""

    def __init__(self, path: Path, file, created: list[Path], stale: Optional[dict], record: dict):
        self.path, self._file, self._created = path, file, created
        self.stale = stale  # the record of a run that ended without releasing the lock, if any
        self.record = record  # what the lock file says now (holder, scratch homes)
        self.home: Optional[ScratchHome] = None  # this run's, from open_scratch() on

    @classmethod
    def acquire(cls, output_dir: Path, command: str = "tunekit train") -> "RunLock":
        """Lock output_dir (created if missing), or TunekitError naming the run that holds it."""
        out = Path(output_dir)
        created = []  # the folders this call makes, deepest last: release removes them if still empty
        p = out
        while not p.exists() and p != p.parent:
            created.insert(0, p)
            p = p.parent
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise TunekitError(f"output_dir: cannot create {out} ({e.strerror or e})") from None
        path = out / LOCK_NAME
        for _ in range(10):
            try:
                f = open(os.open(path, os.O_RDWR | os.O_CREAT, 0o644), "r+")
            except OSError as e:
                _remove_empty(created)
                raise TunekitError(f"output_dir: cannot open the lock file {path} ({e.strerror or e})") from None
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                holder = _read_holder(f) if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN) else None
                f.close()
                _remove_empty(created)
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise TunekitError(f"output_dir: cannot lock {path} ({e.strerror or e})") from None
                raise TunekitError(f"output_dir: {out} is in use by another tunekit run ({_describe(holder)}); one "
                                   "run writes to a folder at a time: wait for it to end, or choose another output_dir"
                                   ) from None
            # The run we raced with may have ended and removed the file between our open and our lock:
            # then we hold a lock on a file nobody else will open. Lock the file at the path instead.
            try:
                mine = os.fstat(f.fileno())
                there = os.stat(path)
                same = (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino)
            except FileNotFoundError:
                same = False
            if not same:
                f.close()
                continue
            stale = _read_holder_now(f)
            # a dead run's scratch homes are this run's to remove now (open_scratch): kept in the
            # record until they are gone, so that a kill before then still leaves them named
            record = {"pid": os.getpid(), "host": socket.gethostname(),
                      "started": time.strftime("%Y-%m-%d %H:%M:%S %z"), "command": command,
                      "scratch": _homes_of(stale)}
            _write_record(f, record)
            return cls(path, f, created, stale, record)
        raise TunekitError(f"output_dir: could not lock {path}: other runs keep taking and releasing it")

    def describe_stale(self) -> Optional[str]:
        return _describe(self.stale) if self.stale else None

    # ------------------------------------------------------------ scratch homes (tunekit.owned)
    @property
    def scratch(self) -> list[str]:
        """The scratch homes the record names: this run's, and those inherited not yet removed."""
        return list(self.record["scratch"])

    def record_scratch(self, name: str) -> None:
        self.record["scratch"] = [*self.record["scratch"], name]
        _write_record(self._file, self.record)

    def drop_scratch(self, name: str) -> None:
        self.record["scratch"] = [n for n in self.record["scratch"] if n != name]
        _write_record(self._file, self.record)

    def open_scratch(self) -> list[str]:
        """What a run does first in its folder, under this lock: undo what earlier runs' interrupted
        saves left (the homes the record inherited, marked scratch folders) and open its own home,
        where every save of the run is then built. Returns what was undone, a line each."""
        folder = self.path.parent
        done = cleanup_leftovers(folder, self.scratch)
        for name in self.scratch:
            if not os.path.lexists(folder / name):
                self.drop_scratch(name)
        self.home = ScratchHome.open(folder, self)
        return done

    def release(self) -> None:
        """Close the run's scratch home; remove the lock file (kept where its record still names a
        home that could not be removed) and drop the lock; then the folders acquire() made, if still
        empty. Safe to call more than once."""
        if self.home is not None and self._file is not None:
            home, self.home = self.home, None
            if home.close():
                self.drop_scratch(home.name)
        f, self._file = self._file, None
        if f is None:
            return
        try:
            # Removed while still locked, and only if it is still our file: a run that opened it in the
            # meantime then finds it gone once it gets the lock, and locks a fresh one (see acquire).
            mine, there = os.fstat(f.fileno()), os.stat(self.path)
            if (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino) and not self.record["scratch"]:
                os.unlink(self.path)
        except OSError:
            pass
        f.close()
        _remove_empty(self._created)

    @property
    def held(self) -> bool:
        return self._file is not None


def _read_holder_now(f) -> Optional[dict]:
    f.seek(0)
    try:
        holder = json.loads(f.read(RECORD_MAX) or "null")
    except ValueError:
        return None
    return holder if isinstance(holder, dict) else None


def _remove_empty(created: list[Path]) -> None:
    """rmdir (which removes only empty folders) the folders a refused or finished run made."""
    for d in reversed(created):
        try:
            d.rmdir()
        except OSError:
            return
