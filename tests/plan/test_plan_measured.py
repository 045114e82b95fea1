"""The planner against the measured peak of real training steps on the CPU, 9 configurations.

scripts/bench_plan.py runs tunekit's own trainer (TrainRecipe.setup + train_step) once per
configuration, each in a fresh process forked from one that already holds the imported runtime,
on a random Llama of a middle size (hidden 384, 4 blocks, vocabulary 4096: a step grows by
~50-200 MiB, far above the allocator's noise of a few MiB) with the planner's worst micro-batch
(full-length, fully trained, padded rows). Measured: the largest resident growth over a step,
VmHWM - VmRSS after setup and a warm-up step, with glibc's mmap threshold fixed so that freed
tensors leave the process (the peak of live memory; glibc's default keeps them resident, which
the plan covers with a stated margin, see benchmarks/plan/plan-cpu.md). Predicted: the plan's peak
minus the state that lives across steps (weights, trainable parameters, optimizer state), which
test_plan.py checks byte for byte.

One measured step after the warm-up: a second repeats the first on the same batch, and their live
peaks differed by at most 1.6 MiB (1.7%) in benchmarks/plan/plan-cpu-suite.json, 13.5 MiB (0.8%) on the
default model (plan-cpu.json) and 1.9 MiB (3.4%) in a suite run on the 2-core AVX2 VM, against a 15%
bound. A step that kept memory (a leak) shows in the first one already: the baseline is read after
the warm-up step. Alone on that VM the test took 70.2 s with 2 measured steps, 59.7 s with 1.

15% is the issue's bound; the model counts the saved tensors exactly (test_plan.py), so what
is left is transient working sets (the loss's gradients, a block's backward buffers) that the
plan bounds from above, and the allocator's rounding. Measured errors: +3% to +16% here (the
largest where cross-entropy's backward was the peak, before the loss was chunked).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from _helpers import REPO


@pytest.mark.slow
def test_planned_step_memory_is_within_15_percent_of_measured(tmp_path, default_model_dir):
    out = tmp_path / "plan-cpu-suite"
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_plan.py"), "--configs", "suite",
                           "--allocator", "live", "--steps", "1", "--work", str(tmp_path / "work"), "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.with_suffix(".json").read_text())["results"]
    assert len(rows) >= 8
    overrides = " ".join(r["overrides"] for r in rows)
    for needed in ("recipe=qlora", "recipe=lora", "recipe=adapter", "recipe=prompt_tuning", "recipe=distill", "recipe=dpo",
                   "max_seq_len=128", "max_seq_len=1024", "micro_batch_size=1 ", "micro_batch_size=16",
                   "gradient_checkpointing=false", "gradient_checkpointing=true"):
        assert needed in overrides + " ", needed
    for r in rows:
        assert r["measured_live_mib"] > 40, r  # growth far above allocator noise
        # Under-planning is the error that costs a user a crash: never more than 15%; over, 15% too.
        assert -15 <= r["error_live_pct"] <= 15, (r["name"], r["measured_live_mib"], r["predicted_mib"])
