"""tunekit.device.precision: the mixed-precision policy, decided from device facts this machine may lack, and
what each op of a real training step receives under it (a dtype spy, not a config key)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tunekit.device import facts as dev
from tunekit.speed.offload import offload_context
from tunekit.device import precision
from tunekit.config import DataConfig, ModelConfig, TrainConfig, TrainerConfig
from tunekit.methods import MethodConfig
from tunekit.train.loop import TrainRecipe

CPU = dev.DeviceFacts("cpu", cpu_bf16=False)
CPU_BF16 = dev.DeviceFacts("cpu", cpu_bf16=True)
T4 = dev.DeviceFacts("cuda", 0, (7, 5), "Tesla T4", 16 * 2**30)
A10 = dev.DeviceFacts("cuda", 1, (8, 6), "NVIDIA A10", 24 * 2**30)
H100 = dev.DeviceFacts("cuda", 0, (9, 0), "H100", 80 * 2**30)


@pytest.mark.parametrize("facts, name, compute, tf32", [
    (H100, "auto", torch.bfloat16, True),
    (A10, "auto", torch.bfloat16, True),   # sm_86, on cuda:1
    (T4, "auto", torch.float16, False),    # fp16 tensor cores only: fp16 with loss scaling; no TF32 before sm_80
    (T4, "bf16", torch.bfloat16, False),   # asked for: obeyed (emulated)
    (H100, "fp32", torch.float32, False),  # strict fp32: no TF32 either
    (CPU_BF16, "auto", torch.bfloat16, False),
    (CPU, "auto", torch.float32, False),
    (CPU, "bf16", torch.bfloat16, False),
])
def test_the_policy_from_device_facts(facts, name, compute, tf32):
    p = precision.decide(name, facts)
    assert p.compute == compute and p.tf32 == tf32
    assert p.as_dict()["trained"] == "fp32" and p.as_dict()["loss"] == "fp32"
    assert p.as_dict()["compute"] == {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[compute]
    assert p.describe().startswith("precision: ")


def test_the_t4_rule_says_why():
    assert "fp16 but no bf16 tensor cores" in precision.decide("auto", T4).reason
    assert "emulates" in precision.decide("bf16", CPU).reason


@pytest.mark.parametrize("facts, expected", [
    (H100, {"float32_matmul_precision": "high"}),
    (T4, {"float32_matmul_precision": "highest"}),
    (CPU_BF16, {}),
])
def test_tf32_switches(facts, expected):
    assert precision.matmul_settings(precision.decide("auto", facts), facts) == expected


def test_apply_sets_tf32_for_cuda_facts_and_nothing_on_a_cpu():
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        precision.apply(precision.decide("auto", CPU_BF16), CPU_BF16)
        assert torch.get_float32_matmul_precision() == "highest"
        precision.apply(precision.decide("auto", H100), H100)
        assert torch.get_float32_matmul_precision() == "high"
        precision.apply(precision.decide("fp32", H100), H100)
        assert torch.get_float32_matmul_precision() == "highest"
    finally:
        torch.set_float32_matmul_precision(before)


def test_autocast_only_for_methods_that_ask_and_only_in_half_precision():
    bf16 = precision.decide("bf16", CPU)
    with bf16.autocast(torch.device("cpu"), wanted=True):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    with bf16.autocast(torch.device("cpu"), wanted=False):
        assert not torch.is_autocast_enabled("cpu")
    with precision.decide("fp32", CPU).autocast(torch.device("cpu"), wanted=True):
        assert not torch.is_autocast_enabled("cpu")


# ------------------------------------------------------------------ what the ops receive
def _spied_step(tiny_model_dir, tiny_data, tmp_path, monkeypatch, dtype: str, quantize: str, method: str) -> dict:
    seen = {"sdpa": set(), "head_in": set(), "loss_logits": set()}
    real_sdpa = F.scaled_dot_product_attention

    def sdpa(q, k, v, *a, **kw):  # the dtypes the kernel computes in (autocast casts inside the op)
        seen["sdpa"].add((precision.received(q), precision.received(k), precision.received(v)))
        return real_sdpa(q, k, v, *a, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
    import tunekit.losses.sft as sft

    real_linear = sft.F.linear

    class _F:  # the loss module's view of F: records the head matmul's operands and the logits' upcast
        def __getattr__(self, name):
            return getattr(F, name)

        @staticmethod
        def linear(x, w, b=None):
            seen["head_in"].add((x.dtype, w.dtype))
            return real_linear(x, w, b)

    monkeypatch.setattr(sft, "F", _F())
    real_lse = torch.logsumexp
    monkeypatch.setattr(torch, "logsumexp", lambda z, *a, **kw: seen["loss_logits"].add(z.dtype) or real_lse(z, *a, **kw))
    cfg = TrainConfig(
        output_dir=str(tmp_path), seed=0,
        model=ModelConfig(path=str(tiny_model_dir), quantize=quantize, dtype=dtype),
        data=DataConfig(path=str(tiny_data), max_seq_len=48, val_fraction=0.2),
        method=MethodConfig(name=method, r=4, alpha=8, dropout=0.0),
        trainer=TrainerConfig(max_steps=1, micro_batch_size=2, grad_accum=1, eval_samples=0,
                              optimizer="adamw", lr=1e-3 if method != "full" else 1e-5),
    )
    r = TrainRecipe(cfg, tmp_path)
    r.setup()
    r.train_step(0)
    base = r.model.get_base_model() if hasattr(r.model, "get_base_model") else r.model
    seen["embeddings"] = base.get_input_embeddings().weight.dtype
    seen["norms"] = {m.weight.dtype for n, m in base.named_modules() if n.endswith("norm")}
    seen["trained"] = {p.dtype for p in r.params}
    seen["summary_precision"] = r.precision.as_dict()
    r.tracker.close()
    return seen


@pytest.mark.parametrize("quantize, method", [("nf4", "lora"), ("none", "lora"), ("nf4", "bitfit"), ("none", "adapter")])
def test_bf16_policy_runs_attention_and_head_in_bf16(tiny_model_dir, tiny_data, tmp_path, monkeypatch, quantize, method):
    seen = _spied_step(tiny_model_dir, tiny_data, tmp_path, monkeypatch, "bf16", quantize, method)
    bf = torch.bfloat16
    assert seen["sdpa"] == {(bf, bf, bf)}  # flash / memory-efficient kernels take these on a GPU
    assert seen["embeddings"] == bf and seen["norms"] == {bf}  # frozen: no fp32 copies, even over 4 bits
    assert seen["head_in"] == {(bf, bf)}
    assert seen["loss_logits"] == {torch.float32}  # the loss itself in fp32
    assert seen["trained"] == {torch.float32}  # master copies
    assert seen["summary_precision"]["compute"] == "bf16"


def test_full_fine_tune_trains_fp32_weights_through_bf16_matmuls(tiny_model_dir, tiny_data, tmp_path, monkeypatch):
    seen = _spied_step(tiny_model_dir, tiny_data, tmp_path, monkeypatch, "bf16", "none", "full")
    bf = torch.bfloat16
    assert seen["sdpa"] == {(bf, bf, bf)}  # autocast: the projections' outputs are bf16
    assert seen["trained"] == {torch.float32} and seen["embeddings"] == torch.float32
    assert seen["head_in"] == {(bf, bf)} and seen["loss_logits"] == {torch.float32}


@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
def test_full_fine_tune_trains_on_stochastic_bf16_copies_and_evaluates_in_fp32(tiny_model_dir, tiny_data, tmp_path,
                                                                               monkeypatch, rounding):
    """What the decoder's projections receive in a real training step of `full` under bf16: bf16
    copies of their fp32 weights, rounded stochastically (some weights round away from nearest),
    or by autocast's own cast with method.weight_rounding=nearest; what the held-out evaluation's
    attention receives: fp32, as `tunekit eval` computes a full fine-tune. The copies kept are the
    bytes the plan counts."""
    from tunekit.device.rounding import COPY
    from tunekit.plan.memory import TrainSetup, plan_terms
    from tunekit.plan.shape import model_shape

    received = []  # the weight each projection's matmul in the step receives
    real_linear = F.linear

    def linear(x, w, b=None):
        received.append(w.dtype)
        return real_linear(x, w, b)

    monkeypatch.setattr(F, "linear", linear)
    sdpa_dtypes, real_sdpa = set(), F.scaled_dot_product_attention
    cfg = TrainConfig(
        output_dir=str(tmp_path), seed=0,
        model=ModelConfig(path=str(tiny_model_dir), quantize="none", dtype="bf16"),
        data=DataConfig(path=str(tiny_data), max_seq_len=48, val_fraction=0.2),
        method=MethodConfig(name="full", weight_rounding=rounding),
        trainer=TrainerConfig(max_steps=1, micro_batch_size=2, grad_accum=1, eval_samples=0, optimizer="adamw", lr=1e-5),
    )
    r = TrainRecipe(cfg, tmp_path)
    r.setup()
    r.train_step(0)
    weights = {id(p): p for m in r.model.modules() if isinstance(m, torch.nn.Linear) for p in [m.weight]}
    copies = [getattr(p, COPY, None) for p in weights.values()]
    if rounding == "stochastic":
        assert received and set(received) == {torch.bfloat16}
        # the copies the step computed with (made before the optimizer moved the weights by ~1e-5,
        # far below a gap): not all the nearest ones
        assert sum(int((c[1] != p.detach().bfloat16()).sum()) for c, p in zip(copies, weights.values())) > 100
        shape = model_shape(str(tiny_model_dir), None)
        planned = plan_terms(shape, TrainSetup(method="full", compute_bytes=2)).weight_copy_bytes
        assert sum(c[1].untyped_storage().nbytes() for c in copies) == planned
    else:
        # the projections: the fp32 weight, cast inside the op by autocast to nearest; the loss's head
        # matmul: the nearest bf16 copy, cast before it (tunekit.losses.sft)
        assert received.count(torch.float32) == len(received) - 1 and received[-1] == torch.bfloat16
        assert all(c is None for c in copies)

    def sdpa(q, k, v, *a, **kw):
        sdpa_dtypes.add(precision.received(q))  # the dtype the kernel computes in (autocast casts inside)
        return real_sdpa(q, k, v, *a, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
    r.evaluate(1)
    assert sdpa_dtypes == {torch.float32}
    r.method.merge(r.model)  # what export does with the trained model: the copies are let go
    assert all(getattr(p, COPY, None) is None for p in weights.values())
    r.tracker.close()


def test_fp32_policy_is_strict_fp32(tiny_model_dir, tiny_data, tmp_path, monkeypatch):
    seen = _spied_step(tiny_model_dir, tiny_data, tmp_path, monkeypatch, "fp32", "nf4", "lora")
    f32 = torch.float32
    assert seen["sdpa"] == {(f32, f32, f32)} and seen["head_in"] == {(f32, f32)}
    assert seen["embeddings"] == f32 and seen["norms"] == {f32}


def _gpu_summary(q="bf16", head="bf16", trained=("fp32",), kernel="EFFICIENT_ATTENTION") -> dict:
    return {"precision": {"compute": "bf16", "tf32": True, "observed": {
        "embeddings": "bf16", "head": head, "trained": list(trained),
        "attention": {"q": q, "k": q, "v": q, "mask": True, "device": "cuda", "kernel": kernel}}},
        "memory": {"peak_mib": 6900.0, "measured_as": "torch max allocated", "planned_step_peak_mib": 7000.0,
                   "planned_device_total_mib": 8200.0}}


def test_the_doctor_reports_what_a_gpu_run_had_against_the_plan():
    from tunekit.commands.doctor import precision_figures

    ok, figures = precision_figures(_gpu_summary())
    assert ok and figures["attention"] == "bf16 q/k/v, masked, EFFICIENT_ATTENTION"
    assert figures["peak_mib"] == 6900.0 and figures["planned_mib"] == 7000.0  # torch's peak vs the step peak
    ok, figures = precision_figures(_gpu_summary(q="fp32", kernel="MATH"))  # what rules flash out
    assert not ok and "attention q fp32" in figures["error"]
    ok, figures = precision_figures(_gpu_summary(trained=("bf16",)))
    assert not ok and "trained bf16" in figures["error"]


# ------------------------------------------------------------------ activation offloading
@pytest.mark.parametrize("setting, facts, ckpt, sharded, expected", [
    ("auto", H100, True, False, True), (True, A10, True, False, True),
    ("auto", H100, False, False, False),   # nothing checkpointed: nothing this small to offload
    (False, H100, True, False, False),
    ("auto", CPU_BF16, True, False, False), (True, CPU, True, False, False),  # host memory already
    ("auto", H100, True, True, False),     # FSDP keeps its own
])
def test_offload_decision(setting, facts, ckpt, sharded, expected):
    assert dev.offload_activations(setting, facts, ckpt, sharded) is expected


def test_offloaded_checkpoint_inputs_give_the_same_gradients(tiny_model_dir):
    """The mechanism a GPU run uses (on a CPU the copies are not pinned): same loss, same gradients."""
    from tunekit.methods import MethodConfig as MC
    from tunekit.methods import get_method
    from tunekit.model import decoder_and_head, load_base_model, prepare_for_training
    from tunekit.train.objective import SFTObjective

    ids = torch.randint(3, 1000, (2, 16), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    grads = []
    for offload in (False, True):
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(1)
        model = load_base_model(str(tiny_model_dir), "none", torch.float32, torch.device("cpu"))
        prepare_for_training(model, "none", gradient_checkpointing=True)
        model = get_method("lora").apply(model, MC(r=4, alpha=8, dropout=0.0)).train()
        for n, p in model.named_parameters():
            if "lora_B" in n:
                torch.nn.init.normal_(p, std=0.02, generator=g)
        decoder, head = decoder_and_head(model)
        with offload_context(torch.device("cpu")) if offload else torch.autograd.graph.saved_tensors_hooks(
                lambda t: t, lambda t: t):
            hidden = decoder(input_ids=ids, attention_mask=batch["attention_mask"], use_cache=False).last_hidden_state
        loss, _ = SFTObjective().loss(hidden, head, batch)
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.requires_grad])
    for a, b in zip(*grads):
        assert torch.equal(a, b)  # the same tensors, moved and back: bit for bit


def test_the_plan_moves_offloaded_inputs_to_the_host():
    from dataclasses import replace

    from tunekit.plan.memory import TrainSetup, activation_bytes, step_memory
    from tunekit.plan.shape import preset_shape

    shape = preset_shape("llama-3-8b")
    st = TrainSetup(quantize="nf4", lora_r=8, gradient_checkpointing=True, micro_batch_size=2, seq_len=2048,
                    lora_compute=True)
    on, off = step_memory(shape, replace(st, offload_activations=True)), step_memory(shape, st)
    blocks = activation_bytes(shape, st)["blocks"]
    assert blocks == 32 * 2 * 2048 * 4096 * 2  # 32 bf16 block inputs of (2, 2048, 4096)
    assert on.host == {"offloaded activations": blocks} and not off.host
    assert off.total - on.total == blocks


def test_the_plan_counts_no_dequantized_weight_for_the_fused_kernel():
    from dataclasses import replace

    from tunekit.plan.memory import TrainSetup, activation_bytes
    from tunekit.plan.shape import preset_shape

    shape = preset_shape("llama-3-8b")
    st = TrainSetup(quantize="nf4", lora_r=8, gradient_checkpointing=True, micro_batch_size=2, seq_len=2048,
                    lora_compute=True)
    torch_path, kernel = activation_bytes(shape, st), activation_bytes(shape, replace(st, fused_kernel=True))
    # the largest projection (gate/up/down: 14336 x 4096) dequantized to bf16 for the torch path's dx,
    # and the torch path's three (tokens, 14336) bf16 buffers of a recomputed block's backward
    assert torch_path["layer_backward"] - kernel["layer_backward"] == 14336 * 4096 * 2 + 3 * 4096 * 14336 * 2


def test_planner_inputs_follow_the_lora_backend_rules():
    from tunekit.commands.compose import compose_configs
    from tunekit.plan.inputs import planner_inputs

    (cfg,) = compose_configs(["recipe=qlora", "model.preset=llama-3-8b"])
    _, gpu = planner_inputs(cfg, H100)
    _, cpu = planner_inputs(cfg, CPU_BF16)
    assert gpu.lora_compute and gpu.fused_kernel and cpu.lora_compute and not cpu.fused_kernel
    (off,) = compose_configs(["recipe=qlora", "model.preset=llama-3-8b", "kernels.fused_lora=off"])
    assert not planner_inputs(off, H100)[1].lora_compute  # peft's own fp32 branch


def test_cudnn_attention_switch_holds_for_the_run_and_is_restored(tiny_model_dir, tiny_data, tmp_path):
    """kernels.cudnn_attention=false keeps torch's cuDNN attention out for the whole run (a
    checkpointed block's recomputation in backward included: the switch is process-wide, not a
    context around the forward) and puts torch's setting back at the end."""
    from tunekit.config import DataConfig, KernelsConfig, ModelConfig, TrainConfig, TrainerConfig
    from tunekit.methods import MethodConfig
    from tunekit.train.loop import TrainRecipe

    seen = []
    cfg = TrainConfig(
        output_dir=str(tmp_path / "run"), seed=0,
        model=ModelConfig(path=str(tiny_model_dir), quantize="none", gradient_checkpointing=True),
        data=DataConfig(path=str(tiny_data), max_seq_len=64, val_fraction=0.2, max_val_examples=2),
        method=MethodConfig(r=4, alpha=8, dropout=0.0),
        trainer=TrainerConfig(max_steps=1, micro_batch_size=2, grad_accum=1, eval_every=100, save_every=100,
                              eval_samples=0),
        kernels=KernelsConfig(cudnn_attention=False),
    )
    assert torch.backends.cuda.cudnn_sdp_enabled()
    r = TrainRecipe(cfg, tmp_path / "run")
    try:
        r.setup()
        attn = r.model.get_base_model().model.layers[0].self_attn
        attn.register_forward_hook(lambda *a: seen.append(torch.backends.cuda.cudnn_sdp_enabled()))
        r.train_step(0)
    finally:
        r.cleanup()
    assert seen and not any(seen)  # the forward and the recomputation in backward (checkpointing on)
    assert len(seen) == 2 and torch.backends.cuda.cudnn_sdp_enabled()


def test_every_rank_computes_in_rank_0s_dtype(caplog):
    """Ranks on different GPU models: rank 0's decision is broadcast and every rank follows it; a
    rank that cannot run it at all stops with one line."""
    from tunekit import TunekitError

    h100 = dev.DeviceFacts("cuda", capability=(9, 0), name="H100")
    t4 = dev.DeviceFacts("cuda", capability=(7, 5), name="T4")
    p100 = dev.DeviceFacts("cuda", capability=(6, 0), name="P100")
    rank0 = precision.decide("auto", h100)
    assert rank0.compute == torch.bfloat16
    from_rank0 = lambda obj: {"compute": "bf16", "reason": rank0.reason}  # noqa: E731 (rank 0's broadcast)
    mine = precision.decide("auto", t4)
    assert mine.compute == torch.float16  # what the T4 would have chosen alone
    with caplog.at_level("WARNING"):
        agreed = precision.agree(mine, t4, from_rank0)
    assert agreed.compute == torch.bfloat16 and not agreed.tf32 and "emulates it" in caplog.text
    assert precision.agree(rank0, h100, from_rank0) is rank0  # rank 0 itself: unchanged
    with pytest.raises(TunekitError, match="^precision: rank 0 computes in bf16"):
        precision.agree(precision.decide("auto", p100), p100, from_rank0)
    # the other way round: rank 0 on a T4 decided fp16, an H100 rank follows (its TF32 stays its own)
    fp16 = precision.agree(rank0, h100, lambda obj: {"compute": "fp16", "reason": mine.reason})
    assert fp16.compute == torch.float16 and fp16.loss_scaling and fp16.tf32
