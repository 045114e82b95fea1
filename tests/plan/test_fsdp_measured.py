"""The planner's per-rank FSDP figures against two real gloo ranks (trainer.strategy=fsdp, CPU).

scripts/bench_plan_fsdp.py forks two ranks from a parent that holds the imported runtime (as
scripts/bench_plan.py forks its one process, and tests/_helpers.launch_two_ranks forks the CLI's
ranks), each with the environment accelerate's launcher gives a gloo rank, and runs tunekit's own
trainer on the suite's random Llama (hidden 384, 4 blocks, vocabulary 4096: the smallest model
the measured tests have whose step grows far above allocator noise; here 80-150 MiB per rank, > 40
MiB with room, in well under a minute). Two configurations: lora without checkpointing (the loss's
phase peaks) and qlora with checkpointing (a block's backward peaks, the block gathered again to
be recomputed), with r=7 so that LoRA's A matrices do not split evenly over two ranks.

Checked per rank:

* the step's growth (VmHWM - VmRSS after setup and a warm-up step, glibc's mmap threshold fixed so
  freed tensors leave the process) within 15% of the plan's per-rank peak minus its per-rank state
  (over-planning: 15% plus the terms the plan sizes as upper bounds, below).
  15% is the bound tests/plan/test_plan_measured.py holds one process to, for the same reason: the
  saved tensors are counted exactly (test_plan.py), what is left is transient working sets the plan
  bounds from above, allocator rounding, and here the gathered weights, which the plan counts as
  two blocks plus the root unit at every phase while FSDP2 holds two blocks only in backward.
  Measured: -3.0% to +5.1% (benchmarks/plan/plan-cpu-fsdp.md); -3.0% to +6.6% over five
  runs while the rows were chosen.
* the state after sharding, term by term, against the plan's per-rank terms: byte for byte where
  every parameter's dim 0 splits evenly; otherwise within the padding bound: FSDP2 gives a rank
  ceil(d0 / 2) or floor(d0 / 2) rows, so each rank is off the plan's even split by half a row per
  parameter with an odd d0 (scripts/bench_plan_fsdp.py `shard_terms`), twice that for AdamW's two
  fp32 moments; plus one byte for the plan's floor division. The ranks together hold exactly what
  the plan splits.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from _helpers import REPO

STATE_TERMS = ("base weights", "trainable parameters", "optimizer state")


@pytest.mark.slow
def test_planned_fsdp_rank_memory_matches_two_gloo_ranks(tmp_path, default_model_dir):
    out = tmp_path / "plan-cpu-fsdp"
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_plan_fsdp.py"), "--steps", "1",
                           "--work", str(tmp_path / "work"), "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.with_suffix(".json").read_text())["results"]
    overrides = " ".join(r["overrides"] for r in rows)
    for needed in ("recipe=lora", "recipe=qlora", "trainer.strategy=fsdp", "gradient_checkpointing=true"):
        assert needed in overrides, needed
    uneven = 0
    for row in rows:
        ranks = row["ranks"]
        assert sorted(r["rank"] for r in ranks) == [0, 1], row["name"]
        for r in ranks:
            where = (row["name"], r["rank"])
            assert r["measured_mib"] > 40, where  # growth far above allocator noise
            assert r["planned_terms"]["gathered blocks (FSDP)"] > 0, where  # part of the step's figure
            # Under-planning costs a user a crash: never more than 15%. Over-planning: 15%, plus the
            # terms the plan sizes as upper bounds, which a step may not fill at all: a block's
            # backward working set (the largest a block's backward can hold at once) and the gathered
            # blocks (two blocks and the root at every phase; FSDP2 holds two only in backward). On
            # these rows those are 4.5-23 MiB of a 75-145 MiB step, while the step's own scratch moved
            # by ~5 MiB between otherwise identical runs on a shared CPU (76-81 MiB for the qlora row).
            terms = r["planned_terms"]
            upper = terms.get("working set (block backward)", 0) + terms["gathered blocks (FSDP)"]
            over = 15 + 100 * upper / 2**20 / r["measured_mib"]
            assert -15 <= r["error_pct"] <= over, (*where, r["measured_mib"], r["predicted_mib"], over)
            for term in STATE_TERMS:
                bound = r["padding_bound"].get(term, 0)
                uneven += bound > 0
                assert abs(r["state"][term] - r["planned_terms"][term]) <= bound + 1, (*where, term, r["state"][term],
                                                                                     r["planned_terms"][term], bound)
        for term in STATE_TERMS:  # the ranks' shards add up to the whole the plan splits
            planned = ranks[0]["planned_terms"][term]
            assert abs(sum(r["state"][term] for r in ranks) - 2 * planned) <= 2, (row["name"], term)
    assert uneven, "no configuration exercised an uneven split (method.r=7)"
