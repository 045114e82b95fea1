"""tunekit.commands.forkserver: a command run as a fork of a fork server must end as the same command run in a
fresh interpreter (exit status, output, environment, working directory), and die when killed.

The doctor (tests/kernel_ops/test_doctor.py) runs its checks through the fork server on the CPU;
on a GPU they start fresh. Both ways run here, on `_child_probe`, a stand-in for tunekit.commands.main that
imports nothing heavy, so the fresh interpreters cost ~0.1 s each.
"""

from __future__ import annotations

import json
import os
import time

import pytest

from _helpers import REPO
from tunekit.commands.forkserver import Launcher, start_method

# What both ways give their children: the probe's folder on the path, and one variable to find.
ENV = {**os.environ, "PYTHONPATH": str(REPO / "tests"), "PROBE_MINE": "yes"}


def launcher(method: str) -> Launcher:
    return Launcher(ENV, method, module="_child_probe", preload=["_child_probe"])


def run(method: str, args: list[str], tmp_path) -> tuple[int, dict | None, str]:
    out, err = tmp_path / f"{method}.out", tmp_path / f"{method}.err"
    code = launcher(method).run(args, out, err, timeout=60)
    stdout = out.read_text()
    return code, json.loads(stdout) if stdout else None, err.read_text()


def test_a_gpu_makes_the_children_start_fresh():
    assert start_method(0) == "forkserver"
    assert start_method(1) == start_method(2) == "fresh"  # CUDA state does not survive a fork


@pytest.mark.parametrize("args, code, last_err_line", [
    (["exit", "0"], 0, "probe: to stderr"),
    (["exit", "3"], 3, "probe: to stderr"),
    (["exit", "a message"], 1, "a message"),  # SystemExit("...") prints it and exits 1
    (["raise"], 1, "RuntimeError: probe: boom"),  # a traceback and 1, as `python -m` gives
])
def test_a_forked_child_ends_as_a_fresh_one(args, code, last_err_line, tmp_path, monkeypatch):
    monkeypatch.setenv("PROBE_NOT_GIVEN", "the caller's own")  # in os.environ, not in ENV: neither child has it
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")  # the caller's working directory now, not the server's at its start
    results = {m: run(m, args, tmp_path) for m in ("fresh", "forkserver")}
    for method, (got_code, said, err) in results.items():
        assert got_code == code, (method, err)
        assert said == {"argv": args, "sys_argv_rest": args, "cwd": str(tmp_path / "here"),
                        "env": {"PROBE_MINE": "yes"}}, method
        assert err.strip().splitlines()[-1] == last_err_line, (method, err)


@pytest.mark.parametrize("method", ["fresh", "forkserver"])
def test_kill_and_timeout(method, tmp_path):
    log = tmp_path / "both.log"  # stdout and stderr into one file, as the doctor's killed run does
    child = launcher(method).start(["sleep", "60"], log, log)
    deadline = time.time() + 30
    while "to stderr" not in log.read_text() and time.time() < deadline:
        time.sleep(0.02)
    assert child.poll() is None  # still running
    child.kill()
    assert child.wait() == -9
    assert '"argv": ["sleep", "60"]' in log.read_text() and "probe: to stderr" in log.read_text()

    start = time.time()
    assert launcher(method).run(["sleep", "60"], tmp_path / "o", tmp_path / "e", timeout=1) == -9
    assert time.time() - start < 30


def test_one_fork_server_per_process():
    launcher("forkserver")  # the server this module's tests use (started by whichever test came first)
    with pytest.raises(RuntimeError, match="another environment or preload"):
        Launcher({**ENV, "PROBE_MINE": "other"}, "forkserver", module="_child_probe", preload=["_child_probe"])
    with pytest.raises(ValueError, match="choose fresh or forkserver"):
        Launcher(ENV, "spawn")
