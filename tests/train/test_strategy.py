"""The loop trains through either strategy object (tunekit.train.strategy) with the same results.

Two ranks are tests/train/test_fsdp.py's (slow: real processes). Here FSDP2 runs in this process over a
one-rank gloo group, against SingleOrDDP on one process: the same TrainRecipe, so every call the
loop makes of a strategy (wrap, run, reduce_grads, clip, all_finite, full_trained, the optimizer
state saved and loaded, in_sync, summary) goes through FSDP2's path, the sharding machinery
included (DTensor shards, the root unit, 4-bit codes stored as bf16 and their first-forward check).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

import tunekit.train.loop as loop
from _helpers import read_jsonl
from tunekit.config import DataConfig, KernelsConfig, ModelConfig, TrainConfig, TrainerConfig
from tunekit.methods import MethodConfig
from tunekit.train.strategy import FSDP2, SingleOrDDP


def _cfg(tiny_model_dir, tiny_data, out, resume: bool = False) -> TrainConfig:
    # fp32 compute, dropout off and clipping off (max_grad_norm inf): see the error analysis below;
    # the peft LoRA path in both (the one FSDP takes), a 4-bit base (its codes stored differently)
    return TrainConfig(
        output_dir=str(out), seed=0,
        model=ModelConfig(path=str(tiny_model_dir), quantize="nf4", dtype="fp32"),
        data=DataConfig(path=str(tiny_data), max_seq_len=64, val_fraction=0.2, max_val_examples=4),
        method=MethodConfig(r=4, alpha=8, dropout=0.0),
        trainer=TrainerConfig(max_steps=2, micro_batch_size=2, grad_accum=2, lr=1e-3, warmup_steps=0,
                              max_grad_norm=float("inf"), eval_every=2, save_every=1, eval_samples=1,
                              eval_max_new_tokens=4, resume=resume),
        kernels=KernelsConfig(fused_lora="off"),
    )


def _train(cfg, out) -> dict:
    r = loop.TrainRecipe(cfg, out)
    try:
        r.setup()
        return r.train()
    finally:
        r.cleanup()


def _fsdp_one_rank(cfg, out, tmp_path, monkeypatch) -> dict:
    """The same run with the strategy FSDP2 over a gloo group of one rank (this process)."""
    chosen = []

    def choose(setting, acc, device):
        chosen.append(FSDP2(acc, device))
        return chosen[-1]

    monkeypatch.setattr(loop, "choose_strategy", choose)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        summary = _train(cfg, out)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert len(chosen) == 1
    return summary


def _adapter(run, sub="adapter") -> dict:
    return load_file(str(run / sub / "adapter_model.safetensors"))


def test_one_process_and_fsdp2_on_one_rank_train_the_same(tiny_model_dir, tiny_data, tmp_path, monkeypatch):
    """With one rank every FSDP collective is a copy (an all-gather of the one shard, a sum over one
    rank divided by 1), the micro-batches' gradients accumulate in the same order, clipping is off
    and the packed 4-bit codes are the same bytes whatever dtype stores them: the two runs do the
    same floating-point operations in the same order, so losses and adapters are equal bit for bit.
    Only the logged gradient norm is combined differently (torch's vector norm of the per-tensor
    norms, FSDP's square root of the all-reduced sum of their squares): 28 fp32 squares summed,
    a relative error of at most ~29 * 2^-24 = 1.7e-6 each, so rel 1e-5."""
    one, sharded = tmp_path / "one", tmp_path / "fsdp"
    s1 = _train(_cfg(tiny_model_dir, tiny_data, one), one)
    s2 = _fsdp_one_rank(_cfg(tiny_model_dir, tiny_data, sharded), sharded, tmp_path, monkeypatch)

    assert "fsdp" not in s1 and s2["fsdp"]["rank_bytes"] and s1["ranks_in_sync"] and s2["ranks_in_sync"]
    assert s1["kernels"]["path"] == s2["kernels"]["path"] == "peft"
    rows1, rows2 = read_jsonl(one / "metrics.jsonl"), read_jsonl(sharded / "metrics.jsonl")
    assert [sorted(r) for r in rows1] == [sorted(r) for r in rows2]
    assert [r["step"] for r in rows1 if "loss" in r] == [1, 2] and sum("val_loss" in r for r in rows1) == 2
    timed = {"grad_norm", "tokens_per_s", "step_time_s", "memory_mb"}
    for a, b in zip(rows1, rows2):
        assert {k: v for k, v in a.items() if k not in timed} == {k: v for k, v in b.items() if k not in timed}
        assert a.get("grad_norm", 0) == pytest.approx(b.get("grad_norm", 0), rel=1e-5)
    a, b = _adapter(one), _adapter(sharded)
    assert a.keys() == b.keys() and len(a) == 28 and all(torch.equal(a[k], b[k]) for k in a)
    first = _adapter(one, "checkpoints/step-000001/adapter")
    assert any(not torch.equal(first[k], a[k]) for k in a)  # the second step moved the weights

    # the optimizer state as FSDP saves it (one entry per rank), and a resume from it
    state = json.loads((sharded / "checkpoints" / "step-000001" / "trainer_state.json").read_text())
    assert state["optimizer"]["world_size"] == 1 and len(state["optimizer"]["ranks"]) == 1
    resumed = tmp_path / "resumed"
    shutil.copytree(sharded, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step-000002")
    shutil.rmtree(resumed / "adapter")
    s3 = _fsdp_one_rank(_cfg(tiny_model_dir, tiny_data, resumed, resume=True), resumed, tmp_path, monkeypatch)
    assert s3["resumed_from_step"] == 1
    c = _adapter(resumed)
    assert all(torch.equal(b[k], c[k]) for k in b)


def test_the_strategy_is_chosen_from_the_setting_and_the_process_count():
    class Acc:
        def __init__(self, n):
            self.num_processes, self.process_index = n, 0

    cpu = torch.device("cpu")
    assert type(loop.choose_strategy("ddp", Acc(1), cpu)) is SingleOrDDP
    assert type(loop.choose_strategy("ddp", Acc(2), cpu)) is SingleOrDDP
    alone = loop.choose_strategy("fsdp", Acc(1), cpu)  # nothing to shard
    assert type(alone) is SingleOrDDP and "nothing to shard" in alone.describe()
    assert type(loop.choose_strategy("fsdp", Acc(2), cpu)) is FSDP2
