"""scripts/bench_kernels.py must at least parse its arguments and fail cleanly without CUDA."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_kernels.py"


def _run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


def test_help():
    proc = _run("--help")
    assert proc.returncode == 0, proc.stderr
    assert "--out" in proc.stdout and "--tokens" in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_without_cuda_exits_with_one_line_message():
    proc = _run("--repeats", "1")
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [
        "bench_kernels: no CUDA device (torch.cuda.is_available() is False); nothing to measure."
    ]
