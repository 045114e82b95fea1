"""Run many `tunekit` command lines fast: import tunekit once, then fork one child per command.

    python tests/_cli_forker.py < request.json > results.json      # a batch (the bad-input catalogue)
    python tests/_cli_forker.py --serve                             # one case per stdin line (run_cli)

request: {"cases": [{"id", "argv", "cwd", "env": {...}, "user": null | "nobody", "input": null | text}, ...],
          "warmup": [overrides of one good train command] | null, "jobs": 2, "timeout": 120}
results: [{"id", "code", "stdout", "stderr", "seconds"}, ...] in the cases' order
(a case's optional "signal_when": [path, signum] sends it that signal once the path exists, as a
scheduler stopping a job would.)
(`jobs` children run at once, each single-threaded.) --serve reads one case per line (plus "timeout",
and "env" as the child's whole environment) and answers one result per line, until stdin closes;
a line {"batch": request} runs a whole request there (its results: one line).
A --serve case with "ranks": [env, env, ...] is one distributed run: a child per rank, each with
its own whole environment (what a launcher gives a rank: RANK, WORLD_SIZE, MASTER_PORT, ...),
writing to the same stdout and stderr, as `accelerate launch` ranks do (tests/_helpers.py).

Each child is the real CLI path: `tunekit.commands.main.main(argv)` in a fresh process image with its own
stdout/stderr (file descriptors 1 and 2), cwd and environment; its exit status is what the shell
would see (SystemExit codes as Python's interpreter maps them; an uncaught exception prints its
traceback and exits 1, as `python -m` would). What the fork saves is the import of torch,
transformers, peft and hydra (~5-10 s per process start on 2 cores).

Threads: run with OMP_NUM_THREADS=1 and no torch compute before forking; a child of a process
whose OpenMP pool is running can hang in its first parallel region.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import time
import traceback

from tunekit.commands.forkserver import exit_status


def preload(warmup: list[str] | None) -> None:
    """Import everything a command imports; validate one good command line to fill the caches
    (the tiny model's skeleton, the good data file) that the children then inherit."""
    import tunekit.commands.compose
    import tunekit.commands.main  # noqa: F401
    import tunekit.commands.train  # noqa: F401
    import tunekit.config  # noqa: F401
    import tunekit.data  # noqa: F401
    import tunekit.commands.export  # noqa: F401
    import tunekit.infer.decode  # noqa: F401
    import tunekit.methods  # noqa: F401
    import tunekit.model.folder  # noqa: F401
    import tunekit.train.loop  # noqa: F401

    # the loss curve every run draws (tunekit.train.tracking): ~0.6 s of imports and font set-up per child
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot  # noqa: F401

    # The first tokenizer a process loads sets up transformers' tokenizer classes: ~0.3 s of a child's
    # ~0.6 s load of SmolLM2's tokenizer (the tiny model's too). Once here, for every child.
    from tunekit.model import load_tokenizer
    from tunekit.model.default import converted_default_dir

    if (folder := converted_default_dir()) is not None:
        load_tokenizer(str(folder))
    # transformers builds its table of checkpoint renamings (~900 regexes) at a process's first
    # from_pretrained and keeps it: 0.15 s of each child that loads a model. Built once here instead
    # (a 1-step tiny-model train, 12 children: median 1.84 and 2.10 s without, 1.78 and 1.91 s with).
    # (a speed-up only: a transformers without that module or function just skips it)
    import importlib

    try:
        importlib.import_module("transformers.conversion_mapping").get_checkpoint_conversion_mapping("llama")
    except (ImportError, AttributeError):
        pass
    if warmup:
        tunekit.commands.compose.check_overrides(warmup)
    logging.root.handlers.clear()
    _no_torch_library_teardown_at_exit()


def _no_torch_library_teardown_at_exit() -> None:
    """torch keeps a weakref.finalize per operator library (~250 once bitsandbytes and triton are
    imported) that deregisters the library's operators at interpreter exit: ~55 ms of every child's
    ~80 ms of exit functions, measured here, spent tidying a process that ends right after. Those
    finalizers (torch.library._del_library) no longer run at exit; every other exit function does
    (wandb, logging, tempfile's finalizers), as in the console script."""
    import weakref

    import torch.library

    del_library = getattr(torch.library, "_del_library", None)  # private: a later torch may drop it
    if del_library is None:
        return
    for finalizer in list(weakref.finalize._registry):  # noqa: SLF001 - no public way to list finalizers
        info = finalizer.peek()
        if info is not None and info[1] is del_library:
            finalizer.atexit = False


def _child(case: dict, out_fd: int, err_fd: int) -> None:
    code = 1
    try:
        # never the parent's stdin (--serve's requests come there): the case's "input", or nothing
        if case.get("input") is not None:
            stdin = tempfile.TemporaryFile()
            stdin.write(case["input"].encode())
            stdin.seek(0)
            os.dup2(stdin.fileno(), 0)
        else:
            os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        sys.stdin = open(0, "r", closefd=False)
        sys.stdout = open(1, "w", closefd=False, buffering=1)
        sys.stderr = open(2, "w", closefd=False, buffering=1)
        os.chdir(case["cwd"])
        if case.get("env_exact"):
            os.environ.clear()
        os.environ.update(case.get("env") or {})
        if os.environ.get("PYTHONFAULTHANDLER"):  # read at interpreter start, which a fork skips
            import faulthandler

            faulthandler.enable()
        if case.get("user") and os.getuid() == 0:
            import pwd

            user = pwd.getpwnam(case["user"])
            os.setgroups([])
            os.setgid(user.pw_gid)
            os.setuid(user.pw_uid)
        from tunekit.commands.main import main

        sys.argv = ["tunekit", *case["argv"]]
        try:
            main(case["argv"])
            code = 0
        except SystemExit as e:  # as the interpreter maps it
            code = exit_status(e)
        except BaseException:
            traceback.print_exc()
            code = 1
    finally:
        try:
            import atexit

            atexit._run_exitfuncs()  # what the interpreter runs at exit (wandb, logging), then no more
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


class Running:
    """One forked child, or one per rank of a distributed case: pids, captured output, start time."""

    # A rank that failed leaves the others waiting in a collective: as torchrun's agent does, stop
    # them, after a grace period in which they may still report their own error.
    GRACE_S = 20.0

    def __init__(self, case: dict):
        self.case = case
        self.out, self.err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
        self.start = time.perf_counter()
        self.codes: dict[int, int] = {}
        self.failed: tuple[float, int] | None = None  # (when, exit status) of the first rank that failed
        self.signal_when = case.get("signal_when")  # [path, signum]: sent once, when the path appears
        self.pids = []
        for env in case.get("ranks") or [case.get("env")]:
            pid = os.fork()
            if pid == 0:
                _child({**case, "env": env}, self.out.fileno(), self.err.fileno())
            self.pids.append(pid)

    def _kill_running(self) -> None:
        for pid in self.pids:
            if pid not in self.codes:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                self.codes[pid] = -9

    def poll(self, timeout: float) -> dict | None:
        if self.signal_when and os.path.exists(self.signal_when[0]):
            for pid in self.pids:
                if pid not in self.codes:
                    os.kill(pid, self.signal_when[1])
            self.signal_when = None
        for pid in self.pids:
            if pid not in self.codes:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    self.codes[pid] = os.waitstatus_to_exitcode(status)
                    if self.codes[pid] != 0 and self.failed is None:
                        self.failed = (time.perf_counter(), self.codes[pid])
        now = time.perf_counter()
        if now - self.start > timeout:
            self._kill_running()
            code = "timeout"
        elif len(self.codes) == len(self.pids) or (self.failed is not None and now - self.failed[0] > self.GRACE_S):
            self._kill_running()
            code = self.failed[1] if self.failed else 0  # a distributed run: its first failed rank's status
        else:
            return None
        seconds = now - self.start
        self.out.seek(0)
        self.err.seek(0)
        result = {"id": self.case["id"], "code": code, "stdout": self.out.read().decode("utf-8", "replace"),
                  "stderr": self.err.read().decode("utf-8", "replace"), "seconds": round(seconds, 3)}
        self.out.close()
        self.err.close()
        return result


def run_all(cases: list[dict], jobs: int, timeout: float) -> list[dict]:
    """Every case, `jobs` children at a time (each single-threaded); results in the cases' order."""
    pending, running, results = list(cases), [], {}
    while pending or running:
        while pending and len(running) < jobs:
            running.append(Running(pending.pop(0)))
        for child in list(running):
            result = child.poll(timeout)
            if result is not None:
                results[result["id"]] = result
                running.remove(child)
        time.sleep(0.005)
    return [results[case["id"]] for case in cases]


def run_batch(request: dict) -> list[dict]:
    """A whole request (the catalogue): warm the caches on its good command line, then every case."""
    preload(request.get("warmup"))
    start = time.perf_counter()
    results = run_all(request["cases"], max(1, int(request.get("jobs", 1))), request.get("timeout", 120))
    for r in results[:1]:  # the batch's wall time rides on its first result (the batch's caller shows it)
        r["batch_seconds"] = round(time.perf_counter() - start, 1)
    return results


def serve() -> None:
    """One case per request line, run in a forked child; its result as one line. Ends at EOF.
    A line {"batch": request} runs a whole request as a batch does; its results come as one line."""
    preload(None)
    channel = sys.stdout
    for line in sys.stdin:
        case = json.loads(line)
        if "batch" in case:
            channel.write(json.dumps(run_batch(case["batch"])) + "\n")
            channel.flush()
            continue
        child = Running(case)
        while (result := child.poll(case.get("timeout", 600))) is None:
            time.sleep(0.005)
        channel.write(json.dumps(result) + "\n")
        channel.flush()


def main() -> None:
    if sys.argv[1:] == ["--serve"]:
        serve()
        return
    json.dump(run_batch(json.load(sys.stdin)), sys.stdout)


if __name__ == "__main__":
    main()
