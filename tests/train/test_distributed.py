"""Two real gloo ranks on the CPU, as `accelerate launch` starts them (`--cpu` alone runs one).

The first test goes through the real launcher; the others fork the two ranks with the environment
that launcher gives them (tests/_helpers.py: launch_two_ranks)."""

from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors.torch import load_file

from _helpers import launch_two_ranks, read_jsonl, run_cli, snapshot, tiny_args
from tunekit.train.runlock import LOCK_NAME, RunLock


def test_two_ranks_match_one_process(tiny_model_dir, tiny_data, tmp_path):
    """2 ranks x 2 micro-batches x 2 examples == 1 process x 4 micro-batches x 2 examples:
    same examples, same token normalisation, so the same adapter (dropout off)."""
    # fp32 compute: what is compared is the normalisation and the reduction, so only summation
    # order may differ (bf16 would add rounding that depends on how examples group into micro-batches)
    common = ["recipe=qlora", "method.dropout=0", "trainer.micro_batch_size=2", "model.dtype=fp32"]
    two = tmp_path / "two"
    r = launch_two_ranks(tiny_args(tiny_model_dir, tiny_data, two, *common), tmp_path, 29517, real=True)
    assert r.returncode == 0, r.stderr[-3000:]
    one = tmp_path / "one"
    r1 = run_cli(["train", *tiny_args(tiny_model_dir, tiny_data, one, *common, "trainer.grad_accum=4")], tmp_path)
    assert r1.returncode == 0, r1.stderr[-3000:]

    summary = json.loads((two / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["ranks_in_sync"]
    assert not (two / LOCK_NAME).exists()  # rank 0's lock, released; rank 1 never contended for it
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


def test_two_ranks_resume_each_with_its_own_random_state(tiny_model_dir, tiny_data, tmp_path):
    """Dropout draws differ per rank; a resume must give each rank back its own RNG stream (once
    every rank loaded rank 0's). One held-out row for two ranks: rank 1 evaluates nothing and
    must still take part in the same reductions (it used to reduce fewer values: a hang on NCCL)."""
    common = ["recipe=lora", "method.dropout=0.2", "trainer.micro_batch_size=2", "trainer.max_steps=4",
              "data.max_val_examples=1"]
    full = tmp_path / "full"
    r = launch_two_ranks(tiny_args(tiny_model_dir, tiny_data, full, *common), tmp_path, 29518)
    assert r.returncode == 0, r.stderr[-3000:]
    evals = [row for row in read_jsonl(full / "metrics.jsonl") if "val_loss" in row]
    assert [row["step"] for row in evals] == [0, 2, 4]

    crashed = tmp_path / "crashed"
    shutil.copytree(full, crashed)
    shutil.rmtree(crashed / "checkpoints" / "step-000004")
    shutil.rmtree(crashed / "adapter")
    r = launch_two_ranks(tiny_args(tiny_model_dir, tiny_data, crashed, *common, "trainer.resume=true"), tmp_path, 29519)
    assert r.returncode == 0, r.stderr[-3000:]
    a = load_file(str(full / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(crashed / "adapter" / "adapter_model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    state = json.loads((crashed / "checkpoints" / "step-000004" / "trainer_state.json").read_text())
    assert len(state["rng"]) == 2 and state["rng"][0]["torch"] != state["rng"][1]["torch"]

    # the same checkpoint resumed by one process: every rank saved the whole optimizer state, so it
    # resumes, with one line saying the global batch changed; the data goes on where it stopped
    alone = tmp_path / "alone"
    shutil.copytree(full, alone)
    shutil.rmtree(alone / "checkpoints" / "step-000004")
    shutil.rmtree(alone / "adapter")
    r = run_cli(["train", *tiny_args(tiny_model_dir, tiny_data, alone, *common, "trainer.resume=true")], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr.count("trainer.resume: the checkpoint was written by 2 ranks, this run has 1: the global batch "
                          "changes from 2 to 1 x") == 1, r.stderr[-3000:]
    assert "resumed from" in r.stderr
    state = json.loads((alone / "checkpoints" / "step-000004" / "trainer_state.json").read_text())
    # 2 steps x 2 ranks x 2 micro-batches x 2 rows, then 2 steps x 1 rank x 2 x 2
    assert state["fingerprint"]["world_size"] == 1 and state["data_position"] == 2 * 8 + 2 * 4
    assert json.loads((alone / "summary.json").read_text())["world_size"] == 1


def test_two_ranks_on_a_locked_output_dir_stop_together(tiny_model_dir, tiny_data, tmp_path):
    """Rank 0 finds output_dir locked by another run; rank 1, which takes no lock of its own, stops with it
    (rank 0's verdict is broadcast) instead of waiting for rank 0 in the next collective."""
    out = tmp_path / "run"
    lock = RunLock.acquire(out)  # this test process is the other run
    before = snapshot(out)
    try:
        r = launch_two_ranks(tiny_args(tiny_model_dir, tiny_data, out, "recipe=lora"), tmp_path, 29524, timeout=120)
    finally:
        after = snapshot(out)
        lock.release()
    assert r.returncode == 2, r.stderr[-3000:]
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("tunekit: error:")]
    assert len(errors) == 2 and len(set(errors)) == 1, r.stderr[-3000:]  # one line per rank, the same
    assert f"output_dir: {out} is in use by another tunekit run (pid {os.getpid()} on " in errors[0]
    assert after == before
