"""scripts/bench_train.py without CUDA. Its run on the tiny random Llama (both systems, 2 steps, 1 rep)
is the GPU check's bench stage, checked in tests/kernels/test_doctor.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from _helpers import REPO

SCRIPT = REPO / "scripts" / "bench_train.py"


def _run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_gpu_config_without_cuda_fails_in_one_line():
    proc = _run("--config", "gpu-1b", timeout=120)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "CUDA" in lines[0] and "gpu-1b" in lines[0], proc.stderr


def test_a_forced_dtype_is_named_before_the_runs(monkeypatch):
    """`--set model.dtype=...` decides which matmul peak MFU divides by: it is measured with the others,
    before the runs (auto, or no such override: the CPU's own rule, nothing forced)."""
    import importlib.util

    monkeypatch.syspath_prepend(str(SCRIPT.parent))  # its sibling benchlib, as running the script gives
    spec = importlib.util.spec_from_file_location("bench_train_script", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)  # stdlib imports only at the top: no torch here
    assert bench.forced_dtype([]) is None and bench.forced_dtype(["trainer.lr=1e-4"]) is None
    assert bench.forced_dtype(["model.dtype=auto"]) is None
    assert bench.forced_dtype(["model.dtype=bf16"]) == "bfloat16"
    assert bench.forced_dtype(["model.dtype=bf16", "trainer.lr=1e-4", "model.dtype=fp32"]) == "float32"


def test_fork_runs_is_refused_where_cuda_is_visible(monkeypatch, capsys):
    """--fork-runs forks runs from a parent that imported the stack: CUDA state does not survive a
    fork, so with a GPU visible (faked here) it stops in one line before measuring anything."""
    import importlib.util

    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("bench_train_script", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert bench.main(["--config", "cpu", "--fork-runs"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--fork-runs" in err[0] and "CUDA" in err[0]
