"""Two real gloo ranks on the CPU through `accelerate launch` (TRAPS.md: `--cpu` alone runs one)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from _helpers import read_jsonl, run_cli, tiny_args


def test_two_ranks_match_one_process(tiny_model_dir, tiny_data, tmp_path):
    """2 ranks x 2 micro-batches x 2 examples == 1 process x 4 micro-batches x 2 examples:
    same examples, same token normalisation, so the same adapter (dropout off)."""
    common = ["recipe=qlora", "method.dropout=0", "trainer.micro_batch_size=2"]
    two = tmp_path / "two"
    # the venv's own launcher: CI runs tests without activating the venv, so PATH may lack it
    launch = [str(Path(sys.executable).with_name("accelerate")), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
              "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "29517",
              "-m", "tunekit.cli", "train", *tiny_args(tiny_model_dir, tiny_data, two, *common)]
    r = subprocess.run(launch, cwd=tmp_path, env={**os.environ, "ACCELERATE_USE_CPU": "true"},
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    one = tmp_path / "one"
    r1 = run_cli(["train", *tiny_args(tiny_model_dir, tiny_data, one, *common, "trainer.grad_accum=4")], tmp_path)
    assert r1.returncode == 0, r1.stderr[-3000:]

    summary = json.loads((two / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["ranks_in_sync"]
    # only rank 0 writes: one row per step, one info line per message
    assert [row["step"] for row in read_jsonl(two / "metrics.jsonl") if "loss" in row] == [1, 2, 3]
    assert r.stderr.count("no paging on cpu") == 1

    a = load_file(str(two / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(one / "adapter" / "adapter_model.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        # fp32 adapter weights; the only difference is the order gradients are summed in
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-6, msg=key)
    trained = load_file(str(two / "checkpoints" / "step-000002" / "adapter" / "adapter_model.safetensors"))
    assert any(not torch.equal(trained[k], a[k]) for k in a)  # weights moved between steps
