"""The tests' way to run the real CLI in a child: tunekit.commands.forkserver's Server, and what a test needs around it.

`CliServer(env)` starts a fork server with `env` (tunekit imported once); each command is a fork
of it that runs `tunekit.commands.main.main(argv)` with its own cwd, environment, stdin, stdout and
stderr, and exits as the console script does (test_bad_input.py::test_forker_matches_the_console_script
compares the two). Around that:

- run(): one command as subprocess.run gives it (a CompletedProcess; TimeoutExpired past the
  timeout); with `ranks`, one distributed run: a child per rank, each with its own whole
  environment (what a launcher gives a rank: RANK, WORLD_SIZE, MASTER_PORT, ...), all writing to
  one stdout and stderr as `accelerate launch` ranks do; with `signal_when=(path, signum)`, that
  signal once the path exists (a scheduler stopping a job);
- batch(): many cases, `jobs` children at a time (the bad-input catalogue), after validating one
  good command line in the server so that its children inherit the caches (the tiny model's
  skeleton, the good data file).

Threads: the suite runs with OMP_NUM_THREADS=1 and the server computes nothing before forking; a
child of a process whose OpenMP pool is running can hang in its first parallel region.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from itertools import count
from pathlib import Path

from tunekit.commands.forkserver import CLI, Server

# Environment variables read when torch, libgomp, triton, transformers or the kernels are imported: a
# command whose environment differs from the server's in one of them needs a server of its own.
IMPORT_TIME_ENV = ("TRITON_", "OMP_", "GOMP_", "MKL_", "CUDA_", "PYTHON", "HF_", "TRANSFORMERS_", "TORCH", "LD_")
# Among those, variables read only when used, which a library sets in the test process on its first
# use: inductor writes its default cache folder into os.environ (torch.compile, or importing trl), and
# a server replaced for it costs the stack's import again. Each command gets the caller's value.
READ_WHEN_USED = ("TORCHINDUCTOR_CACHE_DIR",)


class Running:
    """One command in forked children (one, or one per rank): their output files and start time."""

    # A rank that failed leaves the others waiting in a collective: as torchrun's agent does, stop
    # them after a grace period in which they may still report their own error.
    GRACE_S = 20.0

    def __init__(self, server: Server, case: dict, folder: Path):
        self.case, self.start = case, time.perf_counter()
        self.out, self.err = folder / f"{case['n']}.out", folder / f"{case['n']}.err"
        stdin = None
        if case.get("input") is not None:
            stdin = folder / f"{case['n']}.in"
            # bytes as given (input that is not UTF-8), text as UTF-8
            stdin.write_bytes(case["input"]) if isinstance(case["input"], bytes) else stdin.write_text(case["input"])
        self.files = [p for p in (self.out, self.err, stdin) if p is not None]
        self.failed: tuple[float, int] | None = None  # (when, exit status) of the first rank that failed
        self.signal_when = case.get("signal_when")  # (path, signum): sent once, when the path appears
        self.children = [server.start(case.get("module") or CLI, case["argv"], self.out, self.err, env=env, cwd=case["cwd"],
                                      stdin=stdin, user=case.get("user"))
                         for env in case.get("ranks") or [case["env"]]]

    def poll(self, timeout: float) -> dict | None:
        if self.signal_when and os.path.exists(self.signal_when[0]):
            for child in self.children:
                child.send_signal(self.signal_when[1])
            self.signal_when = None
        codes = [child.poll() for child in self.children]
        if self.failed is None and any(c not in (None, 0) for c in codes):
            self.failed = (time.perf_counter(), next(c for c in codes if c not in (None, 0)))
        now = time.perf_counter()
        if now - self.start > timeout:
            code = "timeout"
        elif None not in codes or (self.failed is not None and now - self.failed[0] > self.GRACE_S):
            code = self.failed[1] if self.failed else 0  # a distributed run: its first failed rank's status
        else:
            return None
        for child in self.children:
            child.wait(0)  # kills what still runs
        # each rank's own exit status; None: still running when stopped (the grace or the timeout ran out)
        result = {"id": self.case["id"], "code": code, "rank_codes": codes, "stdout": self.out.read_text("utf-8", "replace"),
                  "stderr": self.err.read_text("utf-8", "replace"), "seconds": round(now - self.start, 3)}
        for path in self.files:
            path.unlink()
        return result


class CliServer:
    """A fork server for `tunekit` commands, with `env` as its environment (see the module docstring)."""

    def __init__(self, env: dict):
        self.env = dict(env)
        self.server = Server(self.env)
        self.folder = Path(tempfile.mkdtemp(prefix="tunekit-cli-"))
        self._n = count()
        self.tokenizers: set[Path] = set()  # model folders whose tokenizer the server preloaded
        self.paths: set[Path] = set()  # folders put on the server's sys.path (tests/_helpers.fork_ranks)

    def serves(self, env: dict) -> bool:
        """Whether a command with environment `env` may be a fork of this server: the server runs and
        agrees with `env` on every variable read at import."""
        keys = {k for k in {*env, *self.env} if k.startswith(IMPORT_TIME_ENV) and k not in READ_WHEN_USED}
        return self.server.alive() and all(env.get(k) == self.env.get(k) for k in keys)

    def close(self) -> None:
        self.server.close()
        shutil.rmtree(self.folder, ignore_errors=True)

    def _case(self, case: dict) -> dict:
        return {**case, "n": next(self._n), "cwd": str(case["cwd"]), "argv": list(case["argv"])}

    def run(self, args: list[str], cwd: Path, env: dict, timeout: float, input: str | bytes | None = None,
            ranks: list[dict] | None = None, cmd: list[str] | None = None,
            signal_when: tuple[Path, int] | None = None, module: str = CLI) -> subprocess.CompletedProcess:
        """One command (`env`: its whole environment); with `ranks` (each rank's whole environment),
        one child per rank; `module`: what each child runs (`python -m MODULE ARGS`), tunekit's CLI
        unless told."""
        case = self._case({"id": 0, "argv": args, "cwd": cwd, "env": env, "input": input, "ranks": ranks, "module": module,
                           "signal_when": (str(signal_when[0]), int(signal_when[1])) if signal_when else None})
        running, pause = Running(self.server, case, self.folder), 0.002
        while (result := running.poll(timeout)) is None:
            time.sleep(pause)
            pause = min(1.5 * pause, 0.05)  # a quick command's end seen at once, a long one's polled cheaply
        cmd = cmd or [str(Path(sys.executable).with_name("tunekit")), *args]
        if result["code"] == "timeout":
            raise subprocess.TimeoutExpired(cmd, timeout, result["stdout"], result["stderr"])
        done = subprocess.CompletedProcess(cmd, result["code"], result["stdout"], result["stderr"])
        done.rank_codes = result["rank_codes"]  # with `ranks`: each rank's exit status, in rank order
        return done

    def batch(self, cases: list[dict], jobs: int, timeout: float, warmup: list[str] | None = None) -> list[dict]:
        """Every case ({"id", "argv", "cwd", "env": added to the server's, "user", "input", "apart": cases
        with one such key never run at once}), `jobs` at a time; results {"id", "code" (an exit status or "timeout"), "stdout", "stderr",
        "seconds"} in the cases' order, the batch's wall time on the first as "batch_seconds"."""
        if warmup:
            self.server.call("tunekit.commands.compose:check_overrides", list(warmup))
        start = time.perf_counter()
        pending = [self._case({**c, "env": {**self.env, **(c.get("env") or {})}}) for c in cases]
        running, results = [], {}
        while pending or running:
            # a case whose "apart" key a running case holds waits: two runs on one output_dir would
            # meet at its run lock, and the second would be refused for that, not for its own input
            busy = {r.case.get("apart") for r in running} - {None}
            free = [c for c in pending if c.get("apart") not in busy]
            while free and len(running) < max(1, jobs):
                case = free.pop(0)
                pending.remove(case)
                running.append(Running(self.server, case, self.folder))
                free = [c for c in free if case.get("apart") is None or c.get("apart") != case["apart"]]
            for child in list(running):
                if (result := child.poll(timeout)) is not None:
                    results[result["id"]] = result
                    running.remove(child)
            time.sleep(0.01)
        rows = [results[c["id"]] for c in cases]
        if rows:
            rows[0]["batch_seconds"] = round(time.perf_counter() - start, 1)
        return rows
