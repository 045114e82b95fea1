"""fp16 with dynamic loss scaling: the policy that picks it (V100, T4), the scaler's arithmetic, and a
real fp16 qlora run on the CPU with an injected gradient overflow: skipped, counted, not applied,
and the scale state resumed from a checkpoint."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from _helpers import read_jsonl
from tunekit.config import DataConfig, ModelConfig, TrainConfig, TrainerConfig
from tunekit.methods import MethodConfig
from tunekit.device import facts as dev
from tunekit.device import precision
from tunekit.train.loop import TrainRecipe
from tunekit.train.loss_scale import MAX_SKIPS_IN_A_ROW, LossScaler


@pytest.mark.parametrize("capability, compute, scaling", [
    ((7, 0), torch.float16, True),  # V100
    ((7, 5), torch.float16, True),  # T4, RTX 20xx
    ((6, 1), torch.float32, False),  # Pascal: no tensor cores
    ((8, 6), torch.bfloat16, False),
    ((9, 0), torch.bfloat16, False),
])
def test_the_policy_computes_fp16_with_loss_scaling_on_volta_and_turing(capability, compute, scaling):
    facts = dev.DeviceFacts("cuda", 0, capability, "GPU", 16 * 2**30)
    p = precision.decide("auto", facts)
    assert p.compute == compute and p.loss_scaling is scaling
    assert dev.compute_dtype("auto", facts) == compute  # the planner and the loaders ask this
    assert p.as_dict()["loss_scaling"] is scaling
    if scaling:
        assert "dynamic loss scaling" in p.describe() and "fp16 but no bf16" in p.reason
        ok, why = dev.fused_kernel_support(facts, torch.float16, triton_installed=True)
        assert ok, why  # the fused kernel compiles fp16 there (its configs: tests/kernels/test_tiles.py)


def test_the_cpu_policy_is_unchanged_and_fp16_is_obeyed_where_asked():
    cpu = dev.DeviceFacts("cpu", cpu_bf16=True)
    assert precision.decide("auto", cpu).compute == torch.bfloat16
    assert precision.decide("auto", dev.DeviceFacts("cpu")).compute == torch.float32
    p = precision.decide("fp16", cpu)
    assert p.compute == torch.float16 and p.loss_scaling and "may emulate" in p.reason


def test_the_scaler_backs_off_grows_and_gives_up():
    s = LossScaler(enabled=True, growth_interval=3)
    assert s.scaled(torch.tensor(2.0)).item() == 2.0 * 2**16
    s.update(overflowed=True)
    assert (s.scale, s.skipped, s.clean_steps) == (2**15, 1, 0)
    for _ in range(3):
        s.update(overflowed=False)
    assert (s.scale, s.skipped, s.skipped_in_a_row, s.clean_steps) == (2**16, 1, 0, 0)
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 3.0 * 2**16)
    s.unscale_([p])
    assert torch.equal(p.grad, torch.full((3,), 3.0))  # a power of two: exact
    restored = LossScaler(enabled=True)
    restored.load_state_dict(json.loads(json.dumps(s.state_dict())))
    assert restored.state_dict() == s.state_dict()
    for _ in range(MAX_SKIPS_IN_A_ROW):
        assert not s.gave_up
        s.update(overflowed=True)
    assert s.gave_up
    off = LossScaler(enabled=False)
    off.update(overflowed=True)
    assert off.scaled(torch.tensor(2.0)).item() == 2.0 and off.skipped == 0


def _cfg(model, data, out, resume=False) -> TrainConfig:
    return TrainConfig(
        output_dir=str(out), seed=0,
        model=ModelConfig(path=str(model), quantize="nf4", dtype="fp16"),
        data=DataConfig(path=str(data), max_seq_len=64, val_fraction=0.2, max_val_examples=2),
        method=MethodConfig(r=4, alpha=8, dropout=0.0),
        trainer=TrainerConfig(max_steps=4, micro_batch_size=2, grad_accum=2, lr=1e-3, warmup_steps=0, eval_every=4,
                              save_every=2, eval_samples=0, optimizer="adamw", resume=resume),
    )


def _run(cfg, out, overflow_at: int | None = None) -> tuple[dict, list[dict]]:
    """Train; at step index `overflow_at` one trained gradient is made inf after the backward (what
    an fp16 overflow in the base's backward leaves). Returns the summary and each step's weights."""
    r = TrainRecipe(cfg, out)
    weights = []
    try:
        r.setup()
        inner = r._train_step

        def train_step(step):
            out = inner(step)
            if step == overflow_at:
                r.params[0].grad.view(-1)[0] = float("inf")
            weights.append([p.detach().clone() for p in r.params])  # before this step's update
            return out

        r._train_step = train_step
        return r.train(), weights
    finally:
        r.cleanup()


def test_an_overflowed_fp16_step_is_skipped_counted_and_resumed(tiny_model_dir, tiny_data, tmp_path):
    out = tmp_path / "run"
    summary, weights = _run(_cfg(tiny_model_dir, tiny_data, out), out, overflow_at=1)
    assert summary["precision"]["compute"] == "fp16" and summary["precision"]["observed"]["head"] == "fp16"
    rows = [row for row in read_jsonl(out / "metrics.jsonl") if "loss" in row]
    assert [row.get("skipped", False) for row in rows] == [False, True, False, False]
    assert [row["loss_scale"] for row in rows] == [2**16, 2**15, 2**15, 2**15]
    assert summary["loss_scaling"]["skipped_steps"] == 1 and summary["loss_scaling"]["scale"] == 2**15
    # the skipped step left the weights as they were; the others moved them
    before_2, before_3 = weights[1], weights[2]
    assert all(torch.equal(a, b) for a, b in zip(before_2, before_3))
    assert not all(torch.equal(a, b) for a, b in zip(weights[0], weights[1]))
    assert all(torch.isfinite(p).all() for p in weights[-1])

    # resumed from the step-2 checkpoint (after the skip): the same adapter, the scale state carried on
    resumed = tmp_path / "resumed"
    shutil.copytree(out, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step-000004")
    shutil.rmtree(resumed / "adapter")
    (resumed / "summary.json").unlink()
    again, _ = _run(_cfg(tiny_model_dir, tiny_data, resumed, resume=True), resumed)
    a = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(resumed / "adapter" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert again["loss_scaling"] == summary["loss_scaling"]
    assert [row["loss_scale"] for row in read_jsonl(resumed / "metrics.jsonl") if "loss" in row][2:] == [2**15, 2**15]
