"""Run `tunekit` command lines as child processes, as `tunekit doctor` does for each of its checks.

A child process keeps each check apart: a crash, a CUDA fault or a SIGKILL takes down that check,
not the report. How the child starts is the choice here (`start_method`):

- "fresh": `python -m tunekit.commands.main ...`, a new interpreter. Every child pays the import of torch,
  transformers, peft, bitsandbytes and hydra (measured ~10 s per child on a 2-core CPU VM).
- "forkserver": Python's forkserver start method. One server process is started fresh, imports
  that stack once and nothing else (no tensor is ever computed there, so no OpenMP pool or CUDA
  context exists to be copied), and each child is a fork of it that runs `tunekit.commands.main.main`.
  The child has its own stdout/stderr files, environment and exit status, as a fresh process has.

On a machine with a GPU the children start fresh: importing that stack may initialise the CUDA
driver (bitsandbytes probes for it), and CUDA does not survive a fork. Where no GPU is visible,
nothing in the server can hold CUDA state, and forking is safe.
"""

from __future__ import annotations

import atexit
import importlib
import multiprocessing
import os
import subprocess
import sys
import traceback
from pathlib import Path

# Imported once by the fork server (what `tunekit train` and `tunekit export` import on their way;
# matplotlib.pyplot: the loss curve every run draws, ~0.6 s of imports and fonts).
PRELOAD = ["torch", "transformers", "peft", "accelerate", "bitsandbytes", "hydra", "tunekit.commands.main", "tunekit.commands.train", "tunekit.train.loop",
           "tunekit.config", "tunekit.data", "tunekit.methods", "tunekit.model", "tunekit.commands.export", "tunekit.speed.lora_path",
           "matplotlib.pyplot"]


def start_method(cuda_devices: int) -> str:
    """"fresh" where a GPU is visible (CUDA state does not survive a fork), else "forkserver"."""
    return "fresh" if cuda_devices > 0 else "forkserver"


def exit_status(e: SystemExit) -> int:
    """The status the interpreter gives a SystemExit: None -> 0, an int as is, anything else
    (a message) is printed to stderr -> 1."""
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)
    return 1


def _own_resource_tracker() -> None:
    """Let this child start its own multiprocessing resource tracker, as a fresh process does.

    A forkserver child inherits its parent's tracker, so a semaphore of a child killed with SIGKILL
    (tqdm makes one for its progress bars) is reported as leaked on the *parent's* stderr when the
    parent exits. With a tracker of its own, that warning and the cleanup land in the child's log.
    (CPython keeps the tracker's pipe in a private attribute; where it differs, nothing changes.)"""
    from multiprocessing import resource_tracker

    tracker = getattr(resource_tracker, "_resource_tracker", None)
    if tracker is not None and getattr(tracker, "_fd", None) is not None and hasattr(tracker, "_pid"):
        os.close(tracker._fd)
        tracker._fd, tracker._pid = None, None


def _forked_main(module: str, args: list[str], env: dict, cwd: str, out: str, err: str) -> None:
    """The body of a forked child: `<module>.main(args)` as `python -m <module> args` would run it."""
    code = 1
    try:
        for fd, path in ((1, out), (2, err)):
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(target, fd)
            os.close(target)
        sys.stdout = open(1, "w", closefd=False, buffering=1)
        sys.stderr = open(2, "w", closefd=False, buffering=1)
        os.chdir(cwd)  # the caller's, as a fresh process would have (the server's may differ)
        os.environ.clear()
        os.environ.update(env)
        sys.argv = [module, *args]
        _own_resource_tracker()
        try:
            importlib.import_module(module).main(args)
            code = 0
        except SystemExit as e:
            code = exit_status(e)
        except BaseException:  # noqa: BLE001 - print it and exit 1, as `python -m` would
            traceback.print_exc()
            code = 1
    finally:
        try:
            atexit._run_exitfuncs()  # what the interpreter runs at exit (wandb, logging handlers)
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


class Child:
    """One running command: poll() -> exit status or None, kill() (SIGKILL), wait() -> exit status."""

    def __init__(self, proc):
        self._proc = proc

    def poll(self) -> int | None:
        if isinstance(self._proc, subprocess.Popen):
            return self._proc.poll()
        return self._proc.exitcode

    def kill(self) -> None:
        self._proc.kill()

    def wait(self, timeout: float | None = None) -> int | None:
        """Exit status; on timeout the child is killed (SIGKILL) and -9 returned."""
        if isinstance(self._proc, subprocess.Popen):
            try:
                return self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                return self._proc.wait()
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            self._proc.kill()
            self._proc.join()
        return self._proc.exitcode


# A process has one fork server: (environment, preload) of the first Launcher that started it.
_server: tuple[dict, list[str]] | None = None


class Launcher:
    """Starts `python -m <module> args` (a module with `main(argv)`; `tunekit.commands.main` unless told) with
    `env` as the child's whole environment, by `method` (see above); `preload` is what the fork
    server imports once."""

    def __init__(self, env: dict, method: str, module: str = "tunekit.commands.main", preload: list[str] | None = None):
        global _server
        if method not in ("fresh", "forkserver"):
            raise ValueError(f"start method {method!r}: choose fresh or forkserver")
        self.env, self.method, self.module = dict(env), method, module
        self._ctx = None
        if method == "forkserver":
            preload = list(PRELOAD if preload is None else preload)
            if _server is not None and _server != (self.env, preload):
                raise RuntimeError("this process's fork server already runs with another environment or preload")
            self._ctx = multiprocessing.get_context("forkserver")
            if _server is None:
                self._ctx.set_forkserver_preload(preload)
                self._start_server()
                _server = (self.env, preload)

    def _start_server(self) -> None:
        """Start the fork server now, with `env` as its environment: what is read at import (thread
        counts, TRITON_INTERPRET) is read there, once, for every child. Started here, its imports
        overlap whatever the caller does before its first child."""
        from multiprocessing import forkserver

        saved = dict(os.environ)
        os.environ.clear()
        os.environ.update(self.env)
        try:
            forkserver.ensure_running()
        finally:
            os.environ.clear()
            os.environ.update(saved)

    def command(self, args: list[str]) -> list[str]:
        """The equivalent shell command (for logs)."""
        return [sys.executable, "-m", self.module, *args]

    def start(self, args: list[str], out: Path, err: Path) -> Child:
        """Start the command, its stdout appended to `out` and stderr to `err` (may be the same file)."""
        with open(out, "ab") as o, open(err, "ab") as e:  # both files exist once start() returns
            if self._ctx is None:
                return Child(subprocess.Popen(self.command(args), env=self.env, stdout=o, stderr=e,
                                              stdin=subprocess.DEVNULL))
        # not a daemon: a daemonic process may not start processes of its own (DataLoader workers)
        proc = self._ctx.Process(target=_forked_main, name=" ".join([self.module, *args[:1]]),
                                 args=(self.module, list(args), self.env, os.getcwd(), str(out), str(err)))
        proc.start()
        return Child(proc)

    def run(self, args: list[str], out: Path, err: Path, timeout: float | None = None) -> int:
        """Run to completion; the exit status (-9 where the timeout killed it)."""
        return self.start(args, out, err).wait(timeout)
