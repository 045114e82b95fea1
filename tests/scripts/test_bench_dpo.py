"""scripts/bench_dpo.py's plumbing on the tiny model: both systems (tunekit's recipe=dpo and TRL's
DPOTrainer) run in this process, one step each, one repetition; what each model received must be the
same micro-batches, and step 1 must give ln 2 on both."""

from __future__ import annotations

import copy
import json
import math

from test_bench_task import _script

# Step 1 with the adapter at B = 0: policy and reference run the same ops on the same inputs (the
# fused kernel off: on a GPU it would compute the policy's projections alone), so every pair's
# d = (c - c_ref) - (r - r_ref) is exactly 0 and its loss -log sigmoid(0) is ln 2 rounded once to
# fp32 (ulp 6e-8 near 0.69); the step's loss is a mean of 4 such values (one more rounding per add):
# within 4 ulp, 2.4e-7. 1e-6 keeps that margin, while a reference that is not the policy (another
# batch, the adapter left on after an update) moves a summed log-probability of a few tokens by
# >= 1e-2 and the loss by beta * |d| / 2 >= 5e-4 at beta 0.1.
LN2_BOUND = 1e-6


def test_both_systems_see_the_same_tokens_and_start_at_ln2(tiny_model_dir, tmp_path):
    bench = _script("bench_dpo")
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": f"What is {i} plus {i}?", "chosen": f"It is {2 * i}.",
                                         "rejected": f"Maybe {2 * i + 1}{', or so' * (i % 3)}."}) + "\n"
                             for i in range(10)))
    out = tmp_path / "out"
    rc = bench.main(["--steps", "1", "--warmup", "0", "--reps", "1", "--pairs", "2", "--grad-accum", "2",
                     "--model", str(tiny_model_dir), "--data", str(pairs), "--out", str(out), "--in-process",
                     "--set", "kernels.fused_lora=off"])  # on a GPU too: the same ops in policy and reference
    result = json.loads(out.with_suffix(".json").read_text())
    block = result["results"]
    assert rc == 0 and block["checks"] == {"tokens": "ok", "first_loss_ln2": "ok"}, block["checks"]
    tk, trl = block["systems"]["tunekit"], block["systems"]["trl"]
    assert tk["tokens_per_run"] == trl["tokens_per_run"] > 0
    seen = {s: [[m["tokens"] for m in step] for step in r[0]["seen"]] for s, r in result["runs"].items()}
    assert seen["tunekit"] == seen["trl"] and len(seen["trl"][0]) == 2  # one step of 2 micro-batches
    for s in (tk, trl):
        assert abs(s["first_loss"] - math.log(2)) <= LN2_BOUND, s["first_loss"]
    assert set(block["ratios"]) >= {"tokens_per_s", "s_per_step", "memory", "first_loss_rel_diff"}
    assert out.with_suffix(".md").read_text().count("| tunekit |") == 1

    # one token less in what TRL received: no ratio, and the step is named
    runs = copy.deepcopy(result["runs"])
    runs["trl"][0]["seen"][0][1]["tokens"] -= 1
    refused = bench.compare(runs, 0)["ratios"]
    assert "tokens_per_s" not in refused and "step 1" in refused["refused"]
