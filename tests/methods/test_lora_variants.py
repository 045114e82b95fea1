"""LoRA's variants (method.use_dora, use_rslora, init, loraplus_lr_ratio) on the tiny model.

Each variant row over each base it is offered on: trains, saves a folder that peft's own
PeftModel.from_pretrained loads over the ORIGINAL base with tunekit's logits, reloads into tunekit
exactly, and merges. Then: the compute-path choice keeps peft's layers for DoRA and refuses the
fused kernel, the planner counts DoRA's magnitudes, LoRA+'s groups are peft's, and bad values
are one line each.
"""

from __future__ import annotations

import json

import pytest
import torch

from test_methods import DTYPE, TOL, eval_logits, make_base, make_batch, train_steps
from tunekit import TunekitError
from tunekit.methods import MethodConfig
from tunekit.methods import get_method

LORA = {"r": 4, "alpha": 8, "dropout": 0.0}
ROWS = [
    ("dora", {"use_dora": True}, ("none", "nf4")),
    ("rslora", {"use_rslora": True}, ("none", "nf4")),
    ("dora+rslora", {"use_dora": True, "use_rslora": True}, ("nf4",)),
    ("pissa", {"init": "pissa"}, ("none",)),
    ("olora+rslora", {"init": "olora", "use_rslora": True}, ("none",)),
]
PARAMS = [pytest.param(o, q, id=f"{n}-{q}") for n, o, bases in ROWS for q in bases]


def peft_logits(folder, model_dir, quantize, batch) -> torch.Tensor:
    """The saved folder through peft alone, over a fresh (original) base."""
    from peft import PeftModel

    model = PeftModel.from_pretrained(make_base(model_dir, quantize), str(folder)).eval()
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return logits.float()[batch["attention_mask"].bool()]


@pytest.mark.parametrize("overrides, quantize", PARAMS)
def test_variant(overrides, quantize, tiny_model_dir, tmp_path):
    torch.manual_seed(0)
    cfg, method, batch = MethodConfig(name="lora", **LORA, **overrides), get_method("lora"), make_batch()
    base = make_base(tiny_model_dir, quantize)
    before = eval_logits(base, batch)
    w = base.model.layers[0].self_attn.q_proj.weight.detach().clone()
    model = method.apply(base, cfg)
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    r, alpha = LORA["r"], LORA["alpha"]
    assert layer.scaling["default"] == pytest.approx(alpha / r ** 0.5 if overrides.get("use_rslora") else alpha / r)
    assert bool(layer.use_dora["default"]) == bool(overrides.get("use_dora"))
    rewrites = overrides.get("init", "default") != "default"
    # At init the model is the base's function: exactly where B = 0 (DoRA's m = ||W|| rescales by 1
    # up to the norm's rounding, so bf16 TOL); PiSSA/OLoRA hold W as bf16(W - s B0 A0) + s B0 A0,
    # one bf16 rounding of each weight (2^-9 relative) summed over the 64-wide rows, within TOL.
    exact = not rewrites and not overrides.get("use_dora")
    torch.testing.assert_close(eval_logits(model, batch), before, **(dict(atol=0, rtol=0) if exact else TOL[DTYPE]))
    if rewrites:  # the base really holds the residual W - s B0 A0, not W
        assert not torch.equal(layer.get_base_layer().weight.detach(), w)
    train_steps(model, batch)
    trained = eval_logits(model, batch)
    assert (trained - before).abs().max() > 0.1

    method.save(model, tmp_path / "a")
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert config["use_dora"] == bool(overrides.get("use_dora"))
    assert config["use_rslora"] == bool(overrides.get("use_rslora"))
    assert config["r"] == (2 * r if rewrites else r) and config["init_lora_weights"] is True
    # peft over the original base: the same layers exactly, or for PiSSA/OLoRA W + s [B, -B0][A; A0]
    # against bf16(W_res) + s B A, which differ by the one rounding above: TOL (two bf16 steps).
    theirs = peft_logits(tmp_path / "a", tiny_model_dir, quantize, batch)
    torch.testing.assert_close(theirs, trained, **(TOL[DTYPE] if rewrites else dict(atol=0, rtol=0)))

    fresh = method.apply(make_base(tiny_model_dir, quantize), cfg)  # resuming: the same start, the trained halves
    method.load(fresh, tmp_path / "a")
    torch.testing.assert_close(eval_logits(fresh, batch), trained, atol=0, rtol=0)
    method.save(fresh, tmp_path / "again")  # ... and it saves the same folder
    from safetensors.torch import load_file

    one, two = (load_file(tmp_path / d / "adapter_model.safetensors") for d in ("a", "again"))
    assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)

    # merged against unmerged: (W + delta) x, or DoRA's m * (W + delta) / ||W + delta|| x, in one matmul
    # (bf16 weights rounded once, 2^-9 relative; fp32 over NF4) instead of the sum of separately
    # rounded outputs: the same two bf16 steps as test_methods.TOL's merged LoRA.
    merged = method.merge(model)
    mask = batch["attention_mask"].bool()
    with torch.no_grad():
        out = merged(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()[mask]
    torch.testing.assert_close(out, trained, **TOL[DTYPE])


def test_dora_keeps_peft_layers_and_refuses_the_fused_kernel(tiny_model_dir):
    from tunekit.device.facts import DeviceFacts
    from tunekit.methods.lora.backend import PeftLoRALinear4bit, choose_lora_backend, lora_4bit_layers

    model = get_method("lora").apply(make_base(tiny_model_dir, "nf4"), MethodConfig(name="lora", **LORA, use_dora=True))
    facts = DeviceFacts("cpu", cpu_bf16=True)
    with pytest.raises(TunekitError, match=r"^kernels.fused_lora=on: the fused LoRA kernel does not implement DoRA"):
        choose_lora_backend(model, "on", facts, DTYPE)
    decision = choose_lora_backend(model, "auto", facts, DTYPE)  # a plain LoRA would take the torch path here
    assert decision.path == "peft" and "DoRA" in decision.reason
    assert all(type(m) is PeftLoRALinear4bit for _, m in lora_4bit_layers(model))


def test_plan_counts_dora_and_refuses_fused(tiny_model_dir):
    from types import SimpleNamespace

    from tunekit.methods.lora import LoRAPlan
    from tunekit.plan.memory import TrainSetup, trainable_tensors
    from tunekit.plan.shape import model_shape
    from tunekit.device.facts import DeviceFacts

    shape = model_shape(str(tiny_model_dir), None)
    for quantize in ("none", "nf4"):
        model = get_method("lora").apply(make_base(tiny_model_dir, quantize), MethodConfig(name="lora", use_dora=True))
        st = TrainSetup(quantize=quantize, method="lora", options=LoRAPlan(dora=True))
        assert sorted(p.numel() for p in model.parameters() if p.requires_grad) == sorted(trainable_tensors(shape, st))
    lora = get_method("lora")
    cfg = SimpleNamespace(kernels=SimpleNamespace(fused_lora="on"), method=MethodConfig(name="lora", use_dora=True))
    st = TrainSetup(quantize="nf4", method="lora", options=LoRAPlan(dora=True))
    with pytest.raises(TunekitError, match="does not implement DoRA"):
        lora.plan_setup(st, shape, cfg, DeviceFacts("cuda"), DTYPE)
    cfg.kernels.fused_lora = "auto"
    planned = lora.plan_setup(st, shape, cfg, DeviceFacts("cpu", cpu_bf16=True), DTYPE)
    assert not planned.lora_compute and not planned.fused_kernel
    plain = lora.plan_terms(shape, TrainSetup(quantize="nf4", method="lora", options=LoRAPlan()))
    dora = lora.plan_terms(shape, st)
    assert dora.forward_flops_per_token > plain.forward_flops_per_token


def test_loraplus_groups_are_peft_s(tiny_model_dir):
    """B (and DoRA's magnitude) at ratio x lr, A at lr: peft's create_loraplus_optimizer's grouping."""
    from peft.optimizers import create_loraplus_optimizer

    from tunekit.train.optim import build_optimizer, load_state, warmup_cosine

    cfg = MethodConfig(name="lora", **LORA, use_dora=True, loraplus_lr_ratio=16.0)
    method = get_method("lora")
    model = method.apply(make_base(tiny_model_dir, "none"), cfg)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = method.param_groups(model, params, cfg, 1e-3)
    theirs = create_loraplus_optimizer(model, torch.optim.AdamW, lr=1e-3, loraplus_lr_ratio=16.0)
    by_lr = lambda gs: {g["lr"]: {id(p) for p in g["params"]} for g in gs if g["params"]}  # noqa: E731
    assert by_lr(groups) == by_lr(theirs.param_groups)
    assert sorted(by_lr(groups)) == [1e-3, 16e-3]
    assert method.param_groups(model, params, MethodConfig(name="lora"), 1e-3) == [{"params": params, "lr": 1e-3}]
    # the schedule scales both rates alike, and the optimizer state (groups included) round-trips
    opt = build_optimizer("adamw", groups, 1e-3, 0.0, torch.device("cpu"))
    sched = warmup_cosine(opt, 0, 10)
    train_steps(model, make_batch(), steps=1)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    sched.step()
    lrs = [g["lr"] for g in opt.param_groups]
    assert lrs[1] == pytest.approx(16 * lrs[0])
    again = build_optimizer("adamw", method.param_groups(model, params, cfg, 1e-3), 1e-3, 0.0, torch.device("cpu"))
    load_state(again, opt.state_dict())
    assert [g["lr"] for g in again.param_groups] == lrs
    assert all(torch.equal(again.state[p]["exp_avg"], opt.state[p]["exp_avg"]) for p in params)


def test_pissa_olora_refused_over_4bit(tiny_model_dir):
    """(The other bad values are rows of test_methods.test_config_errors_name_the_key.)"""
    for init in ("pissa", "olora"):
        with pytest.raises(TunekitError, match=rf"^method.init={init}: rewrites the base weight .* \(model\.quantize=none\)"):
            get_method("lora").apply(make_base(tiny_model_dir, "nf4"), MethodConfig(name="lora", init=init))


def test_variants_train_from_the_cli(tiny_model_dir, tiny_data, tmp_path):
    """The keys as a user sets them on the recipes: DoRA + rsLoRA + LoRA+ over NF4 (QDoRA) and bf16;
    DoRA with the fused kernel forced, and PiSSA over NF4, are refused in one line."""
    from _helpers import run_cli, tiny_args

    out = tmp_path / "sweep"
    r = run_cli(["train", "-m", "recipe=qlora,lora", *tiny_args(
        tiny_model_dir, tiny_data, out, "trainer.max_steps=2", "trainer.eval_every=2", "method.r=4",
        "method.use_dora=true", "method.use_rslora=true", "method.loraplus_lr_ratio=16")], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    for job in range(2):
        summary = json.loads((out / str(job) / "summary.json").read_text())
        assert summary["steps"] == 2 and abs(summary["last_val_loss"]) < 100
        saved = json.loads((out / str(job) / "adapter" / "adapter_config.json").read_text())
        assert saved["use_rslora"] is True and saved["use_dora"] is True
    r = run_cli(["train", "recipe=qlora", "method.use_dora=true", "kernels.fused_lora=on",
                 *tiny_args(tiny_model_dir, tiny_data, tmp_path / "no")], tmp_path)
    assert r.returncode != 0 and "does not implement DoRA" in r.stderr, r.stderr[-2000:]
    r = run_cli(["train", "recipe=qlora", "method.init=pissa", *tiny_args(tiny_model_dir, tiny_data, tmp_path / "no")],
                tmp_path)
    assert r.returncode != 0 and "model.quantize=none" in r.stderr, r.stderr[-2000:]


def test_pissa_loraplus_resume_is_bit_identical(tiny_model_dir, tiny_data, tmp_path):
    """A run killed after its step-2 checkpoint and resumed ends with the uninterrupted run's adapter,
    bit for bit: LoRA+'s two optimizer groups restored, PiSSA's start recomputed alike, and saving
    (peft's conversion) leaves the training's dropout stream and train mode as they were."""
    from _helpers import resume_is_bit_identical

    common = ("recipe=lora", "method.r=4", "method.dropout=0.1", "method.init=pissa", "method.loraplus_lr_ratio=16",
              "trainer.max_steps=4")
    _, run = resume_is_bit_identical(tiny_model_dir, tiny_data, tmp_path, common, "adapter_model.safetensors")
    assert json.loads((run / "adapter" / "adapter_config.json").read_text())["r"] == 8  # rank 2r over the original base


@pytest.mark.parametrize("quantize, dropout", [("none", 0.0), ("nf4", 0.0), ("none", 0.1)])
def test_dora_saves_what_the_plan_counts(quantize, dropout, tiny_model_dir):
    """What one DoRA layer keeps for backward beyond plain LoRA's (autograd's saved tensors, each
    storage once, in training mode), against lora_variants.dora_saves at its site. Tensors that the
    forward builds and frees (B A through an identity input, its graph unreachable once detached)
    are not kept: only those still referenced by the output's graph count."""
    from tunekit.methods.lora import LoRAPlan
    from tunekit.methods.lora.variants import dora_saves
    from tunekit.plan.shape import model_shape
    from tunekit.plan.terms import Site

    tokens = 48

    def kept(dora: bool) -> int:
        torch.manual_seed(0)
        model = get_method("lora").apply(make_base(tiny_model_dir, quantize), MethodConfig(
            name="lora", dropout=dropout, use_dora=dora, target_modules=["up_proj"]))
        layer = model.base_model.model.model.layers[0].mlp.up_proj.train()
        x = torch.randn(tokens, 64, dtype=DTYPE, requires_grad=True)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            y = layer(x)
        live, seen = 0, set()

        def walk(fn):  # the tensors the output's graph still holds (saved_tensors of each node)
            nonlocal live
            if fn is None or id(fn) in seen:
                return
            seen.add(id(fn))
            for name in dir(fn):
                if name.startswith("_saved_"):
                    t = getattr(fn, name)
                    if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen \
                            and t.untyped_storage().data_ptr() != x.untyped_storage().data_ptr():
                        seen.add(t.untyped_storage().data_ptr())
                        live += t.untyped_storage().nbytes()
            for nxt, _ in fn.next_functions:
                walk(nxt)

        walk(y.grad_fn)
        return live

    shape = model_shape(str(tiny_model_dir), None)
    site = Site("gate_up", tokens, 2)
    o = LoRAPlan(targets=("up_proj",), dropout=dropout, dora=True)
    extra = kept(True) - kept(False)
    small = 3 * 4 * 128  # three (out,) fp32 vectors (magnitude, m / norm, its - 1), per layer: not per position
    assert 0 <= extra - dora_saves(o, site, shape) <= small, (extra, dora_saves(o, site, shape))
