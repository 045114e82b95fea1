"""tunekit.commands.forkserver: a command run as a fork of a fork server must end as the same command run in a
fresh interpreter (exit status, output, environment, working directory), and die when killed.

The doctor (tests/kernels/test_doctor.py) and every CLI test of the suite (tests/_cli_forker.py)
run their commands through this server on the CPU; on a GPU the doctor's start fresh. Both ways run
here, on `_child_probe`, a stand-in for tunekit.commands.main that imports nothing heavy, so a fresh
interpreter or a server costs only Python's own start.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from _helpers import REPO
from tunekit.commands.forkserver import Launcher, Server, start_method

# What both ways give their children: the probe's folder on the path, one variable to find, and one
# the interpreter reads at its start (a fork must act on it itself).
ENV = {**os.environ, "PYTHONPATH": str(REPO / "tests"), "PROBE_MINE": "yes", "PYTHONFAULTHANDLER": "1"}


@pytest.fixture(scope="module")
def launchers():
    made = {m: Launcher(ENV, m, module="_child_probe", preload=["_child_probe"]) for m in ("fresh", "forkserver")}
    # the server forked from this process (the doctor's, where it was forked itself), not started fresh;
    # this process with a multiprocessing resource tracker running, as a pytest worker may have
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    made["forkserver from here"] = Launcher(ENV, "forkserver", module="_child_probe", preload=["_child_probe"],
                                            from_here=True)
    yield made
    for launcher in made.values():
        launcher.close()


def run(launcher: Launcher, args: list[str], tmp_path) -> tuple[int, dict | None, str]:
    name = launcher.method + ("-here" if launcher.server is not None and launcher.server.forked_here else "")
    out, err = tmp_path / f"{name}.out", tmp_path / f"{name}.err"
    code = launcher.run(args, out, err, timeout=60)
    stdout = out.read_text()
    return code, json.loads(stdout.splitlines()[0]) if stdout else None, err.read_text()


def test_a_gpu_makes_the_children_start_fresh():
    assert start_method(0) == "forkserver"
    assert start_method(1) == start_method(2) == "fresh"  # CUDA state does not survive a fork


@pytest.mark.parametrize("args, code, last_err_line", [
    (["exit", "0"], 0, "probe: to stderr"),
    (["exit", "3"], 3, "probe: to stderr"),
    (["exit", "a message"], 1, "a message"),  # SystemExit("...") prints it and exits 1
    (["return", "4"], 4, "probe: to stderr"),  # main's int, as `sys.exit(main(argv))` gives
    (["raise"], 1, "RuntimeError: probe: boom"),  # a traceback and 1, as `python -m` gives
])
def test_a_forked_child_ends_as_a_fresh_one(launchers, args, code, last_err_line, tmp_path, monkeypatch):
    monkeypatch.setenv("PROBE_NOT_GIVEN", "the caller's own")  # in os.environ, not in ENV: neither child has it
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")  # the caller's working directory now, not the server's at its start
    results = {m: run(launcher, args, tmp_path) for m, launcher in launchers.items()}
    for method, (got_code, said, err) in results.items():
        assert got_code == code, (method, err)
        assert said == {"argv": args, "sys_argv_rest": args, "cwd": str(tmp_path / "here"),
                        "env": {"PROBE_MINE": "yes"}, "faulthandler": True, "uid": os.getuid()}, method
        assert err.strip().splitlines()[-1] == last_err_line, (method, err)


@pytest.mark.parametrize("method", ["fresh", "forkserver", "forkserver from here"])
def test_kill_and_timeout(launchers, method, tmp_path):
    launcher = launchers[method]
    log = tmp_path / "both.log"  # stdout and stderr into one file, as the doctor's killed run does
    child = launcher.start(["sleep", "60"], log, log)
    deadline = time.time() + 30
    while "to stderr" not in log.read_text() and time.time() < deadline:
        time.sleep(0.02)
    assert child.poll() is None  # still running
    child.kill()
    assert child.wait() == -9
    assert '"argv": ["sleep", "60"]' in log.read_text() and "probe: to stderr" in log.read_text()

    start = time.time()
    assert launcher.run(["sleep", "60"], tmp_path / "o", tmp_path / "e", timeout=1) == -9
    assert time.time() - start < 30


def test_a_forked_child_reads_its_stdin_and_takes_a_signal(launchers, tmp_path):
    server = launchers["forkserver"].server
    (tmp_path / "in.txt").write_text("line one\nline two\n")
    out = tmp_path / "read.out"
    assert server.start("_child_probe", ["read"], out, out, stdin=tmp_path / "in.txt").wait(60) == 0
    assert json.loads(out.read_text().splitlines()[-1]) == {"stdin": "line one\nline two\n"}
    out = tmp_path / "none.out"  # no stdin given: an empty one, never the server's request channel
    assert server.start("_child_probe", ["read"], out, out).wait(60) == 0
    assert json.loads(out.read_text().splitlines()[-1]) == {"stdin": ""}

    child = server.start("_child_probe", ["sleep", "60"], tmp_path / "s.out", tmp_path / "s.err")
    deadline = time.time() + 30
    while "to stderr" not in (tmp_path / "s.err").read_text() and time.time() < deadline:
        time.sleep(0.02)
    child.send_signal(signal.SIGTERM)
    assert child.wait(30) == -signal.SIGTERM
    child.send_signal(signal.SIGTERM)  # an ended child: nothing to signal, no error


@pytest.mark.skipif(os.getuid() != 0, reason="only root may run a child as another user")
def test_a_forked_child_reports_its_peak_resident_memory(launchers, tmp_path):
    """The server's wait4 gives the child's own peak RSS (what a fresh child's rusage gives its parent):
    at least the 200 MiB it wrote, and not the server's (a child that grows nothing stays far below)."""
    server = launchers["forkserver"].server
    big = server.start("_child_probe", ["grow", "200"], tmp_path / "g", tmp_path / "g")
    small = server.start("_child_probe", ["exit", "0"], tmp_path / "s", tmp_path / "s")
    assert big.maxrss_kib is None  # not known while it runs
    assert big.wait(60) == 0 and small.wait(60) == 0
    assert big.maxrss_kib >= 200 * 1024 and small.maxrss_kib < big.maxrss_kib - 150 * 1024


def test_a_forked_child_runs_as_the_user_asked(launchers, tmp_path):
    import pwd

    nobody = pwd.getpwnam("nobody").pw_uid
    out = tmp_path / "user.out"
    assert launchers["forkserver"].server.start("_child_probe", ["exit", "0"], out, out, user="nobody").wait(60) == 0
    assert json.loads(out.read_text().splitlines()[0])["uid"] == nobody != 0


def test_a_failed_request_or_child_leaves_the_server_serving(launchers, tmp_path):
    server = launchers["forkserver"].server
    out = tmp_path / "missing.out"
    assert server.start("_no_such_probe", ["exit", "0"], out, out).wait(60) == 1
    assert "ModuleNotFoundError: No module named '_no_such_probe'" in out.read_text()
    with pytest.raises(RuntimeError, match="fork server: ModuleNotFoundError"):
        server.call("_no_such_probe:main")
    assert server.alive() and run(launchers["forkserver"], ["exit", "3"], tmp_path)[0] == 3


def test_each_launcher_has_a_server_of_its_own(launchers, tmp_path):
    """Two servers in one process, each with its own environment (read at its imports, given to its
    children); an ended server refuses to start a child with one clear error."""
    other = Launcher({**ENV, "PROBE_MINE": "other"}, "forkserver", module="_child_probe", preload=["_child_probe"])
    try:
        (tmp_path / "a").mkdir()
        (tmp_path / "b").mkdir()
        assert run(other, ["exit", "0"], tmp_path / "a")[1]["env"] == {"PROBE_MINE": "other"}
        assert run(launchers["forkserver"], ["exit", "0"], tmp_path / "b")[1]["env"] == {"PROBE_MINE": "yes"}
    finally:
        other.close()
    assert not other.server.alive()
    with pytest.raises(RuntimeError, match="the fork server has ended"):
        other.start(["exit", "0"], tmp_path / "o", tmp_path / "e")
    with pytest.raises(ValueError, match="choose fresh or forkserver"):
        Launcher(ENV, "spawn")


def test_a_preload_that_fails_is_left_to_the_child(tmp_path):
    """A module the server cannot import is skipped there (a speed-up only); the child that needs it
    fails on its own, saying why, and the others run."""
    server = Server(ENV, preload=["_no_such_probe", "_child_probe"])
    try:
        out = tmp_path / "o"
        assert server.start("_no_such_probe", ["exit", "0"], out, out).wait(60) == 1
        assert "ModuleNotFoundError: No module named '_no_such_probe'" in out.read_text()
        assert server.start("_child_probe", ["exit", "3"], tmp_path / "p", tmp_path / "p").wait(60) == 3
    finally:
        server.close()


def test_a_server_forked_from_its_caller_runs_none_of_the_callers_exit_work(tmp_path):
    """The caller's exit functions and finalizers (a temporary folder's removal, its own servers'
    closing) stay the caller's: each child runs the exit functions it finds, and one that ran the
    caller's removed the suite's own folders."""
    import atexit
    import weakref

    ran = tmp_path / "ran"

    def mark(what: str) -> None:
        with open(ran, "a") as f:
            f.write(what + "\n")

    class Owner:
        pass

    owner = Owner()
    finalizer = weakref.finalize(owner, mark, "finalizer")
    atexit.register(mark, "atexit")
    try:
        launcher = Launcher(ENV, "forkserver", module="_child_probe", preload=["_child_probe"], from_here=True)
        try:
            code, said, _ = run(launcher, ["exit", "0"], tmp_path)
        finally:
            launcher.close()
        assert code == 0 and said is not None
        assert not ran.exists(), ran.read_text()
    finally:
        atexit.unregister(mark)
        finalizer.detach()
