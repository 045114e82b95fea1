"""When one rank stops, every other rank says which and why in one line, and stops too.

A rank that raises (its data, a forward, a save) or dies (killed, a segfault) would otherwise leave
the others waiting in their next collective until the timeout, and then print a backend traceback
that names no rank. Three routes, all through the process group's own store (the TCPStore every
rank already reaches; torchrun's agent hosts it where the launcher has one, else rank 0):

- **A rank that raises** writes its one-line error under its rank (`announce`) before it exits. A
  survivor then finds it: its collective fails at once under gloo (the peer's connection closes),
  and `Peers.stopped_by_peer` turns that error into "rank 1 failed: <its error>". Rank 0 hosts the
  store where no agent does: failing, it waits (a few seconds at most) until every other rank has
  read its line.
- **A rank that dies** writes nothing. Every rank posts its host and pid at the start, so a
  survivor on the same host names the dead one ("rank 1 stopped (exit/connection lost)"). Across
  hosts the backend's connection error or the collective timeout (trainer.dist_timeout_s) is what
  is known, and the line says that much.
- **A backend that waits instead of failing** (NCCL's kernels wait on a dead peer until the
  timeout): a watcher thread polls the store twice a second. Once it knows of a failed or dead
  rank, the main thread has GRACE_S to report it; if it is still stuck then, the watcher writes the
  same line and ends the process (os._exit). Checkpoints already saved are whole (a save writes
  into a scratch folder and renames it), so nothing saved is lost; an unfinished save's scratch
  folder is removed by the next run.

The watcher stops (`close`, every rank, followed by a barrier) before a finished run lets any rank
exit, so a rank that ends first is never taken for one that died.

TUNEKIT_TEST_FAIL_AT="RANK:STEP[:HOW]" (tests only, docs/testing.md) makes rank RANK fail when it
reaches optimizer step STEP (from 1): HOW=raise (a TunekitError, the default), exit (os._exit(3)) or
kill (SIGKILL to itself).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import Optional

from tunekit import TunekitError

log = logging.getLogger("tunekit")

PREFIX = "tunekit/peers/"
GRACE_S = 10.0  # how long the main thread may take to report a known failure before the watcher does
POLL_S = 0.5
ANNOUNCE_WAIT_S = 5.0  # how long a failing store host waits for the others to read its line
TEST_FAIL_ENV = "TUNEKIT_TEST_FAIL_AT"


def one_line(e: BaseException) -> str:
    """An exception as one line: a TunekitError's message, else `Type: first line`."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    if isinstance(e, TunekitError):
        return text
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def is_collective_error(e: BaseException) -> bool:
    """Whether `e` is a collective's failure (a peer's connection lost, a timeout), not this rank's own."""
    import torch.distributed as dist

    if isinstance(e, getattr(dist, "DistError", ())):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and any(w in text for w in (
        "gloo", "Connection closed by peer", "Connection reset by peer", "NCCL", "Timed out", "timed out"))


def _alive(pid: int) -> bool:
    """Whether a local process runs (a zombie, dead but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True


class Peers:
    """This rank's view of the others (module docstring). `start()` gives None in a single process."""

    def __init__(self, store, rank: int, world_size: int, timeout_s: int):
        self.store, self.rank, self.world_size, self.timeout_s = store, rank, world_size, timeout_s
        self.host = socket.gethostname()
        self.known: Optional[str] = None  # the line naming the first rank seen to fail or die
        self.reported = threading.Event()  # the main thread is reporting (the watcher must not)
        self.done = threading.Event()
        self.lock = threading.Lock()
        self.pids: dict[int, tuple[str, int]] = {}
        store.set(f"{PREFIX}pid/{rank}", f"{self.host} {os.getpid()}")
        self.store_addr = self._store_address()
        self.thread = threading.Thread(target=self._watch, name="tunekit-peers", daemon=True)
        self.thread.start()

    @classmethod
    def start(cls, timeout_s: int) -> Optional["Peers"]:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return None
        return cls(dist.distributed_c10d._get_default_store(), dist.get_rank(), dist.get_world_size(), timeout_s)

    # ---------------------------------------------------------------- this rank fails
    def announce(self, line: str) -> None:
        """Tell the others this rank failed with `line`; as the store's host, wait until they read it."""
        self.done.set()
        self.reported.set()  # this rank reports its own error
        if self.known is not None:
            return  # stopping because of another rank: that one is what the others must hear of
        try:
            self.store.set(f"{PREFIX}failed/{self.rank}", line)
            self.store.add(f"{PREFIX}failures", 1)
            if not self._hosts_store():
                return
            deadline = time.monotonic() + ANNOUNCE_WAIT_S
            while time.monotonic() < deadline:
                if self.store.add(f"{PREFIX}failures", 0) + self.store.add(f"{PREFIX}seen", 0) >= self.world_size:
                    return
                time.sleep(0.05)
        except Exception:  # the store is gone too: nothing more to tell
            pass

    # ---------------------------------------------------------------- another rank failed
    def stopped_by_peer(self, e: Optional[BaseException], wait_s: float = 3.0) -> Optional[str]:
        """The one line to end this rank with when `e` (None: a signal) came from another rank's
        failure; None when this rank's own error should be reported. Claims the report: the watcher
        stays quiet from here on."""
        collective = e is not None and is_collective_error(e)
        deadline = time.monotonic() + (wait_s if collective else 0.0)
        while True:
            line = self.known or self._look()
            if line is not None or time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        if line is None and collective:
            what = one_line(e)
            timed_out = "timed out" in what.lower()
            line = (f"a rank stopped answering: a collective {'timed out after trainer.dist_timeout_s=' + str(self.timeout_s) + ' s' if timed_out else 'lost its connection'} "
                    f"({what[:200]})")
        if line is not None:
            self.reported.set()
            self.done.set()
        return line

    def _look(self) -> Optional[str]:
        """A failed rank's line from the store, or a dead local rank, or the store's host gone."""
        with self.lock:
            if self.known is not None:
                return self.known
            if self.store_addr is not None and not self._reachable():
                line = ("rank 0 stopped (exit/connection lost: the run's store on "
                        f"{self.store_addr[0]}:{self.store_addr[1]} is gone)")
            else:
                line = self._posted() or self._dead()
            if line is not None:
                self.known = line
            return line

    def _posted(self) -> Optional[str]:
        try:
            if self.store.add(f"{PREFIX}failures", 0) == 0:
                return None
            for r in range(self.world_size):
                key = f"{PREFIX}failed/{r}"
                if r != self.rank and self.store.check([key]):
                    line = self.store.get(key).decode("utf-8", "replace")
                    self.store.add(f"{PREFIX}seen", 1)
                    return f"rank {r} failed: {line}"
        except Exception:
            return None
        return None

    def _dead(self) -> Optional[str]:
        for r in range(self.world_size):
            if r == self.rank:
                continue
            if r not in self.pids:
                try:
                    if not self.store.check([f"{PREFIX}pid/{r}"]):
                        continue
                    host, pid = self.store.get(f"{PREFIX}pid/{r}").decode().split()
                    self.pids[r] = (host, int(pid))
                except Exception:
                    continue
            host, pid = self.pids[r]
            if host == self.host and not _alive(pid):
                return f"rank {r} stopped (exit/connection lost: its process {pid} is gone)"
        return None

    # ---------------------------------------------------------------- the store's host
    def _store_address(self) -> Optional[tuple[str, int]]:
        """Where rank 0 hosts the store (None where torchrun's agent does: it outlives the ranks)."""
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
            return None
        addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        return (addr, int(port)) if addr and port and port.isdigit() else None

    def _hosts_store(self) -> bool:
        return self.store_addr is not None and self.rank == 0

    def _reachable(self) -> bool:
        """Whether the store still listens (asked with a bare connection, not a store call: a store
        call to a dead host prints torch's C++ stack on stderr)."""
        if self._hosts_store():
            return True
        try:
            socket.create_connection(self.store_addr, timeout=2).close()
            return True
        except OSError:
            return False

    # ---------------------------------------------------------------- the watcher
    def _watch(self) -> None:
        while not self.done.wait(POLL_S):
            line = self._look()
            if line is None:
                continue
            if self.reported.wait(GRACE_S) or self.done.is_set():
                return  # the main thread reports it, or this rank is failing on its own
            # the main thread is stuck (a backend waiting on the dead peer): report and end here
            print(f"tunekit: error: {line}", file=sys.stderr, flush=True)
            os._exit(1)

    def close(self) -> None:
        """Stop watching (a finished run, before the final barrier)."""
        self.done.set()
        self.thread.join(timeout=2 * POLL_S + 1)


def group_timeout_s() -> Optional[float]:
    """The timeout the default process group's collectives actually wait (None where unreadable)."""
    import torch
    import torch.distributed as dist

    try:
        group = dist.distributed_c10d._get_default_group()
        device = torch.device("cuda") if dist.get_backend(group) == "nccl" else torch.device("cpu")
        return group._get_backend(device).options._timeout.total_seconds()
    except Exception:
        return None


def fail_for_test(rank: int, step: int) -> None:
    """TUNEKIT_TEST_FAIL_AT (module docstring): fail here if this rank and step are the chosen ones."""
    spec = os.environ.get(TEST_FAIL_ENV)
    if not spec:
        return
    parts = spec.split(":")
    if int(parts[0]) != rank or int(parts[1]) != step:
        return
    how = parts[2] if len(parts) > 2 else "raise"
    if how == "exit":
        os._exit(3)
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise TunekitError(f"{TEST_FAIL_ENV}: rank {rank} fails at step {step} as asked")
