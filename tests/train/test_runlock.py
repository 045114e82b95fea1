"""One run per output_dir at a time (tunekit.train.runlock): the lock, its holder's record, stale locks,
and a second run refused through the real CLI."""

from __future__ import annotations

import functools
import json
import os
import re
import socket

import pytest

from _helpers import die_holding_lock, fork_server, read_jsonl, run_cli, snapshot, tiny_args
from tunekit import TunekitError
from tunekit.train.runlock import LOCK_NAME, RunLock


def test_a_second_lock_is_refused_naming_the_holder(tmp_path):
    out = tmp_path / "a" / "run"
    lock = RunLock.acquire(out)
    holder = json.loads((out / LOCK_NAME).read_text())
    assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname() and holder["started"]
    before = snapshot(tmp_path)
    # flock is per open file: a second open in this same process conflicts as another process would
    with pytest.raises(TunekitError) as e:
        RunLock.acquire(out)
    msg = str(e.value)
    assert msg.startswith(f"output_dir: {out} is in use by another tunekit run (pid {os.getpid()} on ")
    assert f"started {holder['started']}" in msg and "\n" not in msg
    assert snapshot(tmp_path) == before  # the refused one changed nothing
    lock.release()
    lock.release()  # twice is harmless
    assert not tmp_path.joinpath("a").exists()  # the folders the lock made, empty again, are gone
    RunLock.acquire(out).release()


def test_release_keeps_a_folder_that_holds_a_run(tmp_path):
    out = tmp_path / "run"
    lock = RunLock.acquire(out)
    (out / "config.yaml").write_text("x")
    lock.release()
    assert [p.name for p in out.iterdir()] == ["config.yaml"]


def test_a_stale_lock_is_taken_over(tmp_path):
    """A lock file whose process died (SIGKILL, a crash): the kernel dropped the lock with it."""
    pid = die_holding_lock(tmp_path)
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == pid
    lock = RunLock.acquire(tmp_path)
    assert lock.stale["pid"] == pid and f"pid {pid} on " in lock.describe_stale()
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_a_locked_output_dir_is_refused_through_the_cli(tiny_model_dir, tiny_data, tmp_path):
    """The lock held by this process: the run says who holds it, in one line, and touches nothing."""
    out = tmp_path / "run"
    lock = RunLock.acquire(out)
    started = json.loads((out / LOCK_NAME).read_text())["started"]
    before = snapshot(out)
    try:
        r = run_cli(["train", *tiny_args(tiny_model_dir, tiny_data, out, "recipe=lora")], tmp_path)
    finally:
        after = snapshot(out)
        lock.release()
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines() == [
        f"tunekit: error: output_dir: {out} is in use by another tunekit run (pid {os.getpid()} on "
        f"{socket.gethostname()}, started {started}); one run writes to a folder at a time: wait for it to end, "
        "or choose another output_dir"]
    assert after == before


def test_two_runs_started_together_on_one_output_dir(tiny_model_dir, tiny_data, tmp_path):
    """Two real processes at once: one trains, the other is refused naming it; one run's rows only."""
    out = tmp_path / "run"
    # one step: the fork server stops the other child 20 s after one fails (as torchrun's agent would)
    args = ["train", *tiny_args(tiny_model_dir, tiny_data, out, "recipe=lora", "trainer.max_steps=1")]
    env = dict(os.environ)
    server = fork_server()
    if server is not None and server.serves(env):
        # two children forked at the same moment, sharing stdout and stderr (as ranks would, but
        # without a launcher's RANK/WORLD_SIZE: two independent runs); the code is the failed one's
        r = server.run(args, tmp_path, env, 300, ranks=[env, env])
        code, err = r.returncode, r.stderr
    else:
        import subprocess
        import sys

        exe = os.path.join(os.path.dirname(sys.executable), "tunekit")
        procs = [subprocess.Popen([exe, *args], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  stdin=subprocess.DEVNULL, text=True) for _ in range(2)]
        outs = [p.communicate(timeout=300) for p in procs]
        code = max(p.returncode for p in procs)
        err = "".join(e for _, e in outs)
    # the two share stderr: the refused run's error may follow the other's progress bar on its line,
    # after a \r or mid-line (a bar drawn without one), so the error is found wherever it starts
    errors = re.findall(r"tunekit: error:[^\r\n]*", err)
    assert code == 2 and len(errors) == 1, err[-3000:]
    assert f"output_dir: {out} is in use by another tunekit run (pid " in errors[0] and "started " in errors[0]
    assert err.count("done in ") == 1 and "Traceback" not in err
    assert [row["step"] for row in read_jsonl(out / "metrics.jsonl") if "loss" in row] == [1]
    assert not (out / LOCK_NAME).exists()


def test_a_home_made_just_before_the_kill_is_the_next_runs_to_remove_and_nothing_else(tmp_path):
    """A run killed right after it made its scratch home, before the home's marker: only its lock
    record names the folder, which is enough. A fresh run counts it as tunekit's (not as a file of the
    user's), takes the lock over and removes it; a folder named the same way that no record names (a
    user's look-alike, unmarked) is the user's: named as such, and left as it was."""
    from itertools import count

    from _helpers import die_mid_save, lost_or_changed, open_scratch_in, plant_lookalikes
    from tunekit.owned import HOME_PREFIX, is_scratch
    from tunekit.train.resume import check_not_foreign

    out = tmp_path / "run"
    lookalike = out / f"{HOME_PREFIX}0123456789abcdef"
    mine = plant_lookalikes(lookalike)

    def unmarked_homes():
        return [p for p in out.iterdir() if p.name.startswith(HOME_PREFIX) and p != lookalike and not is_scratch(p)]

    for n in count(1):  # kill one call later each time, until the home exists without its marker
        assert die_mid_save(out, at=n, save=functools.partial(open_scratch_in, out)) is not None
        if unmarked_homes():
            break
        lock = RunLock.acquire(out)  # as the next run would: this try's leftovers removed, start clean
        lock.open_scratch()
        lock.release()
    [home] = unmarked_homes()
    with pytest.raises(TunekitError, match=rf"holds no tunekit run \({re.escape(lookalike.name)}\)"):
        check_not_foreign(out, allow_nonempty=False)  # the look-alike only: the home is tunekit's
    lock = RunLock.acquire(out)
    assert lock.scratch == [home.name]
    assert lock.open_scratch() == [f"removed {home}"]
    lock.release()
    assert sorted(p.name for p in out.iterdir()) == [lookalike.name] and lost_or_changed(lookalike, mine) == []
