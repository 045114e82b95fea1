"""Smoke test of scripts/bench_train.py on the tiny random Llama: both systems, 2 steps, 1 rep."""

from __future__ import annotations

import json
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


def test_both_systems_run_and_agree(tiny_model_dir, tiny_data, tmp_path):
    # packing on: TRL's padding-free collator against tunekit's packed rows, the subtler of the two
    # matches (the script runs "off" the same way; --packing both is the CPU config's default).
    out = tmp_path / "bench"
    proc = _run("--model", str(tiny_model_dir), "--data", str(tiny_data), "--steps", "2", "--reps", "1",
                "--warmup", "1", "--micro-batch-size", "4", "--grad-accum", "2", "--seq-len", "64",
                "--packing", "on", "--peak-reps", "2", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.with_suffix(".json").read_text())
    assert out.with_suffix(".md").read_text().startswith("# Training benchmark")
    assert set(result["versions"]) >= {"torch", "transformers", "peft", "bitsandbytes", "trl", "tunekit"}
    assert result["device"] and result["settings"]["steps"] == 2
    # the CPU's own matmul peak, measured before and after the runs (bf16 only where it is native):
    # MFU's denominator is the figure of the dtype the base computed in
    from tunekit.speed.device import cpu_has_bf16

    peaks = result["matmul_peak_gflops"]
    dtypes = {"bfloat16", "float32"} if cpu_has_bf16() else {"float32"}
    assert all(set(peaks[when]) == dtypes for when in ("before", "after")), peaks
    assert all(p["gflops"] > 0 for when in ("before", "after") for p in peaks[when].values())
    block = result["results"]["on"]
    computed = block["runs"]["tunekit"][0]["compute_dtype"]
    assert computed == ("bfloat16" if cpu_has_bf16() else "float32")  # the tiny model's model.dtype=auto
    assert block["mfu_peak"]["tflops"] == pytest.approx(peaks["before"][computed]["gflops"] / 1e3)
    for system in ("tunekit", "trl"):
        s = block["systems"][system]
        for key in ("tokens_per_s", "trained_tokens_per_s", "median_step_s", "peak_rss_mib", "first_losses", "mfu"):
            assert key in s, (system, key)
        (run,) = block["runs"][system]
        assert len(run["step_times_s"]) == 2 and len(run["losses"]) == 2
    tk, trl = block["runs"]["tunekit"][0], block["runs"]["trl"][0]
    # the same examples in the same micro-batches: identical input and trained token counts per step
    assert tk["tokens"] == trl["tokens"]
    assert trl["loss_normalised_per_step"]  # TRL divides by the trained tokens of the whole step, as tunekit
    # Step 0: same bf16 checkpoint quantized by the same deterministic NF4 code, same tokens, LoRA B = 0
    # (the adapters add nothing yet), and the same precision on both sides: TRL's default setup under
    # bf16 autocast keeps the base's bf16 embeddings, norms and head, so its residual stream is bf16 as
    # tunekit's is, the projections compute in bf16 and the loss in fp32 (on a CPU without native bf16
    # both compute in fp32). What may differ: the order of the fp32 sums in the cross-entropy
    # (~2^-24 relative), and the head's bf16 logits where the two split its matmul over different rows
    # (tunekit: the trained rows in chunks; TRL: every position), which can round a logit z to the
    # neighbouring bf16 value, |dz| <= 2^-8 |z|, independently from logit to logit. Each token's loss
    # moves by sum_v (p_v - y_v) dz_v, whose rms is at most sqrt(2) * 2^-8 * max|z|; the mean over
    # n tokens by that / sqrt(n). The tiny model is initialised with std 0.02 (its initializer_range)
    # over 64 hidden units after an RMSNorm, so its logits are ~N(0, 0.16^2), max|z| < 1 over 49k; with
    # n >= 30 trained tokens a step: rms <= 1e-3 absolute, 1e-4 of its loss (~10.8). 1e-3 relative is
    # 10 such standard deviations, and a real mismatch (a shifted mask, a lost EOS label, a mean of
    # micro-batch means, the residual stream in fp32) moves the loss by more than that.
    assert tk["losses"][0] == pytest.approx(trl["losses"][0], rel=1e-3)
    # Step 1 follows one optimizer step (TRL's LoRA weights are bf16, tunekit's fp32 masters) from
    # gradients equal up to that rounding: a step of lr 2e-4 moves the loss by ~1e-3, and the bf16
    # rounding of TRL's weights perturbs that move by 2^-8 of itself: within the same 1e-3.
    assert tk["losses"][1] == pytest.approx(trl["losses"][1], rel=1e-3)
    assert "tunekit/trl" in block["ratios"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_gpu_config_without_cuda_fails_in_one_line():
    proc = _run("--config", "gpu-1b", timeout=120)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "CUDA" in lines[0] and "gpu-1b" in lines[0], proc.stderr


def test_a_forced_dtype_is_named_before_the_runs():
    """`--set model.dtype=...` decides which matmul peak MFU divides by: it is measured with the others,
    before the runs (auto, or no such override: the CPU's own rule, nothing forced)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_train_script", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)  # stdlib imports only at the top: no torch here
    assert bench.forced_dtype([]) is None and bench.forced_dtype(["trainer.lr=1e-4"]) is None
    assert bench.forced_dtype(["model.dtype=auto"]) is None
    assert bench.forced_dtype(["model.dtype=bf16"]) == "bfloat16"
    assert bench.forced_dtype(["model.dtype=bf16", "trainer.lr=1e-4", "model.dtype=fp32"]) == "float32"
