"""How torch's OpenMP threads wait: the `tunekit` command caps libgomp's spin before torch loads."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tunekit.device import threads

from _helpers import REPO


def test_the_cap_is_added_only_where_nobody_chose_and_torch_is_not_loaded():
    assert threads.openmp_env({}, torch_loaded=False) == {"GOMP_SPINCOUNT": threads.SPINCOUNT}
    assert threads.openmp_env({"PATH": "/bin", "OMP_NUM_THREADS": "2"}, torch_loaded=False) == {
        "GOMP_SPINCOUNT": threads.SPINCOUNT}  # the thread count is another question: left alone
    # the user's own choice stays, whichever of the two they made
    assert threads.openmp_env({"GOMP_SPINCOUNT": "300000"}, torch_loaded=False) == {}
    assert threads.openmp_env({"OMP_WAIT_POLICY": "ACTIVE"}, torch_loaded=False) == {}
    # libgomp has read its environment already: setting it now would only mislead the log
    assert threads.openmp_env({}, torch_loaded=True) == {}


def test_the_log_line_and_summary_say_what_the_threads_do():
    assert threads.describe({"GOMP_SPINCOUNT": "10000"}, 2, 2) == (
        "threads: 2 intra-op on 2 cores; idle threads spin 10000 rounds before sleeping (GOMP_SPINCOUNT)")
    assert threads.describe({}, 1, 2).endswith("libgomp's default 300000 rounds")
    assert "OMP_WAIT_POLICY=PASSIVE" in threads.describe({"OMP_WAIT_POLICY": "PASSIVE"}, 2, 2)
    assert threads.summary({"GOMP_SPINCOUNT": "10000", "HOME": "/x"}, 2, 4) == {
        "intra_op": 2, "cores": 4, "gomp_spincount": "10000"}
    assert threads.summary({}, 1, 1) == {"intra_op": 1, "cores": 1}


@pytest.mark.parametrize("device_type", ["cpu", "cuda", "xpu", "mps"])
def test_only_a_run_that_computes_on_the_cpu_reports_its_threads(device_type):
    """recipe.py asks this with the run's device type (torch.device("cuda:1").type is "cuda"): the
    line and summary entry on a CPU run, nothing on an accelerator, where the threads only feed it."""
    report = threads.on_device(device_type, {"GOMP_SPINCOUNT": "10000"}, 16, 16)
    if device_type == "cpu":
        assert report == {"line": threads.describe({"GOMP_SPINCOUNT": "10000"}, 16, 16),
                          "summary": {"intra_op": 16, "cores": 16, "gomp_spincount": "10000"}}
    else:
        assert report is None


def _bundled_libgomp() -> bool:
    import torch

    return any(Path(torch.__file__).parent.joinpath("lib").glob("libgomp*"))


@pytest.mark.skipif(not _bundled_libgomp(), reason="this torch build does not run on GNU OpenMP (libgomp)")
@pytest.mark.parametrize("user_choice", [None, "123456"])
def test_libgomp_reads_the_value_the_command_set(user_choice):
    """In a fresh process, as the console script starts: `tunekit.commands.main.main` (here with --version,
    which returns before any command imports anything), then torch. OMP_DISPLAY_ENV=VERBOSE makes libgomp
    print the settings it read at that import: tunekit's cap, or the user's own value untouched."""
    env = {k: v for k, v in os.environ.items() if k not in threads.USER_CHOICES}
    env["OMP_DISPLAY_ENV"] = "VERBOSE"  # VERBOSE: the GOMP_ variables too
    if user_choice:
        env["GOMP_SPINCOUNT"] = user_choice
    code = ("from tunekit.commands.main import main\n"
            "try:\n    main(['--version'])\nexcept SystemExit:\n    pass\n"
            "import torch\ntorch.ones(64).sum()\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"GOMP_SPINCOUNT = '{user_choice or threads.SPINCOUNT}'" in proc.stderr, proc.stderr[-2000:]
