"""`tunekit plan`, the `auto` settings it feeds, and the refusal of runs that cannot fit."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from _helpers import tiny_args
from tunekit import TunekitError
from tunekit.commands.compose import compose_configs
from tunekit.commands.main import main
from tunekit.device.facts import DeviceFacts
from tunekit.plan import GiB
from tunekit.plan.choose import candidates, choose
from tunekit.plan.memory import quant_state_bytes
from tunekit.plan.shape import PROJECTIONS, preset_shape

CPU = DeviceFacts("cpu", cpu_bf16=True)
A100_80 = DeviceFacts("cuda", 0, (8, 0), "A100", 80 * GiB)


def run_main(args, capsys) -> tuple[int, str, str]:
    try:
        main(args)
        code = 0
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err.strip()


def test_plan_says_why_a_full_fine_tune_peaks_without_gradients(capsys):
    """Without accumulation the loss's forward runs before any gradient exists: the breakdown's
    zero is said, not left for the reader to doubt."""
    args = ["plan", "recipe=full", "trainer.micro_batch_size=2", "data.max_seq_len=512"]
    device = ["--device", "cuda", "--memory", "24"]
    code, out, err = run_main(args + ["trainer.grad_accum=1"] + device, capsys)
    assert code == 0, err
    assert "gradients                                      0.00 GiB" in out
    assert "(the peak falls in: loss forward; no gradient exists yet there with grad_accum 1)" in out
    code, out, err = run_main(args + ["trainer.grad_accum=2"] + device, capsys)
    assert code == 0, err
    assert "gradients                                      0.50 GiB" in out and "no gradient exists" not in out


def test_plan_prints_the_breakdown_for_the_default_model(capsys):
    code, out, err = run_main(["plan", "recipe=qlora", "--memory", "16"], capsys)
    assert code == 0, err
    for row in ("base weights", "trainable parameters", "gradients", "optimizer state", "activations",
                "loss and head", "peak of one step", "runtime", "device total"):
        assert row in out, row
    assert "fits: needs" in out and "gradient checkpointing on instead" in out and "TFLOP" in out
    # the recipe says auto: the plan shows what train would pick on a 16 GiB CPU
    assert "model.gradient_checkpointing=auto -> off" in out
    code, out, err = run_main(["plan", "recipe=qlora", "trainer.micro_batch_size=auto", "--memory", "16"], capsys)
    assert code == 0 and "trainer.micro_batch_size=auto -> " in out, err


def test_plan_json_has_per_rank_ddp_and_fsdp_figures(capsys):
    code, out, err = run_main(["plan", "recipe=qlora", "model.preset=llama-3-70b", "trainer.micro_batch_size=1",
                               "data.max_seq_len=512", "--device", "cuda", "--memory", "24", "--gpus", "4", "--json"],
                              capsys)
    assert code == 0, err
    plan = json.loads(out)
    ddp, fsdp = plan["per_rank"]["ddp"], plan["per_rank"]["fsdp"]
    assert plan["ranks"] == 4 and plan["model"]["num_layers"] == 80
    # the 4-bit codes and the bf16 rest split four ways; the quantization state whole on every rank
    state = quant_state_bytes(preset_shape("llama-3-70b"), "nf4")
    assert (fsdp["terms"]["base weights"] - state) * 4 == pytest.approx(ddp["terms"]["base weights"] - state, abs=4)
    assert fsdp["device_total_bytes"] < 24 * GiB < ddp["device_total_bytes"]
    assert plan["fits"] is False  # as run (DDP: every rank holds the whole base)
    assert plan["flops"]["total"] > 0 and plan["toggle_gradient_checkpointing"]["gradient_checkpointing"] is False


def test_a_70b_base_does_not_fit_one_24gb_card(capsys):
    code, out, _ = run_main(["plan", "recipe=qlora", "model.preset=llama-3-70b", "trainer.micro_batch_size=1",
                             "data.max_seq_len=512", "--device", "cuda", "--memory", "24", "--gpus", "4"], capsys)
    assert code == 0
    assert "does NOT fit" in out and "FSDP over 4 ranks would need" in out


def test_ia3_is_planned_through_its_own_terms(capsys):
    """The planner asks the method: (IA)^3's vectors on the default model are 30 blocks x (k 192 +
    v 192 + down_proj's input 1536) = 57,600 (the count the trainer logs), fp32, with their
    gradients and AdamW's two moments."""
    code, out, err = run_main(["plan", "recipe=ia3", "--memory", "16", "--json"], capsys)
    assert code == 0, err
    plan = json.loads(out)
    assert plan["setup"]["method"] == "ia3"
    assert plan["setup"]["options"] == {"targets": ["k_proj", "v_proj", "down_proj"], "feedforward": ["down_proj"]}
    assert plan["flops"]["trainable_params"] == 57_600
    terms = plan["per_rank"]["single"]["terms"]
    assert terms["trainable parameters"] == terms["gradients"] == 4 * 57_600
    assert terms["optimizer state"] == 8 * 57_600
    code, out, err = run_main(["plan", "recipe=ia3", "model.quantize=nf4", "--memory", "16"], capsys)
    assert code == 0 and "(IA)^3 vectors on 3 projections (1 input-scaled) over a NF4" in out, err


@pytest.mark.parametrize("args, culprit", [
    (["trainer.max_stpes=3"], "trainer.max_stpes: unknown config key"),
    (["model.preset=llama-9"], "model.preset: unknown preset 'llama-9'"),
    # a size without a model folder: the planner's own refusal; a model folder: training's, which plans share
    (["model.preset=llama-3-8b", "method.target_modules=[lm_head]"],
     "method.target_modules: the planner models the projections"),
    (["method.target_modules=[lm_head]"], "method.target_modules: 'lm_head' is the output head of LlamaForCausalLM"),
])
def test_plan_errors_are_one_line(args, culprit, capsys):
    code, _, err = run_main(["plan", "recipe=qlora", *args], capsys)
    assert code == 2 and err.startswith("tunekit: error: ") and culprit in err
    assert len(err.splitlines()) == 1


@pytest.mark.parametrize("value, expected", [("8", 8), ("'8'", 8), ("auto", "auto"), ("AUTO", "auto")])
def test_micro_batch_size_takes_ints_and_auto(value, expected):
    (cfg,) = compose_configs(["recipe=qlora", f"trainer.micro_batch_size={value}"])
    assert cfg.trainer.micro_batch_size == expected


@pytest.mark.parametrize("value, expected", [("true", True), ("false", False), ("yes", True), ("off", False),
                                             ("auto", "auto")])
def test_gradient_checkpointing_takes_bools_and_auto(value, expected):
    (cfg,) = compose_configs(["recipe=qlora", f"model.gradient_checkpointing={value}"])
    assert cfg.model.gradient_checkpointing is expected if isinstance(expected, bool) else cfg.model.gradient_checkpointing == expected


@pytest.mark.parametrize("args, culprit", [
    (["trainer.micro_batch_size=abc"], "trainer.micro_batch_size: must be a positive integer or auto, got 'abc'"),
    (["trainer.micro_batch_size=0"], "trainer.micro_batch_size: must be a positive integer or auto, got 0"),
    (["trainer.micro_batch_size=true"], "trainer.micro_batch_size: must be a positive integer or auto, got True"),
    (["trainer.micro_batch_size=2.5"], "trainer.micro_batch_size: must be a positive integer or auto, got 2.5"),
    (["model.gradient_checkpointing=maybe"], "model.gradient_checkpointing: must be true, false or auto, got 'maybe'"),
    (["model.preset=llama-3-8b"], "model.preset: 'llama-3-8b' is a size for `tunekit plan` only"),
])
def test_bad_auto_values_and_presets_stop_train_in_one_line(args, culprit, capsys):
    code, _, err = run_main(["train", *args], capsys)
    assert code == 2 and err.startswith("tunekit: error: ") and culprit in err
    assert len(err.splitlines()) == 1


def _cfg(*overrides):
    (cfg,) = compose_configs(["recipe=qlora", *overrides])
    return cfg


@pytest.mark.parametrize("facts", [CPU, A100_80], ids=["cpu", "gpu"])
def test_auto_checkpointing_is_off_when_the_step_fits_without_it(facts):
    cfg = _cfg("model.gradient_checkpointing=auto")  # default model, 8 x 512
    off = choose(_cfg("model.gradient_checkpointing=false"), facts, 10**15)[2].needed_beyond_runtime()
    on = choose(_cfg("model.gradient_checkpointing=true"), facts, 10**15)[2].needed_beyond_runtime()
    assert on < off
    assert choose(cfg, facts, int(off / 0.89))[:2] == (8, False)  # fits: a third less compute
    assert choose(cfg, facts, int(off / 0.91))[:2] == (8, True)  # only within auto's 10% headroom


def test_auto_micro_batch_is_the_largest_power_of_two_that_fits():
    cfg = _cfg("trainer.micro_batch_size=auto", "model.preset=llama-3-8b", "data.max_seq_len=2048",
               "model.gradient_checkpointing=true")
    sizes = [choose(cfg, A100_80, gib * GiB)[0] for gib in (24, 48, 80, 160)]
    assert sizes == sorted(sizes) and sizes[0] >= 1 and sizes[-1] > sizes[0]
    for gib, size in zip((24, 48, 80, 160), sizes):
        _, _, plan = choose(cfg, A100_80, gib * GiB)
        assert plan.fits(gib * GiB, 0.10)  # with the headroom auto keeps
        if size < 64:
            bigger = choose(_cfg("model.preset=llama-3-8b", "data.max_seq_len=2048",
                                 f"trainer.micro_batch_size={2 * size}"), A100_80, 10**15)[2]
            assert not bigger.fits(gib * GiB, 0.10)


def test_a_run_that_cannot_fit_is_refused_with_the_breakdown():
    cfg = _cfg("model.preset=llama-3-8b", "data.max_seq_len=4096", "trainer.micro_batch_size=16")
    with pytest.raises(TunekitError) as e:
        choose(cfg, A100_80, 24 * GiB)
    msg = str(e.value)
    assert msg.startswith("memory: the planned peak") and "24.00 GiB free" in msg
    assert "activations" in msg and "base weights" in msg and "trainer.memory_check=false" in msg
    assert "\n" not in msg
    cfg.trainer.memory_check = False  # a warning instead; the given values are kept
    assert choose(cfg, A100_80, 24 * GiB)[:2] == (16, True)


def _recipe(tiny_model_dir, tiny_data, out, *overrides):
    from tunekit.train.loop import TrainRecipe

    (cfg,) = compose_configs(["recipe=lora", *tiny_args(tiny_model_dir, tiny_data, out), *overrides])
    return TrainRecipe(cfg, out)


def test_train_resolves_auto_before_loading_and_logs_one_line(tiny_model_dir, tiny_data, tmp_path, caplog):
    out = tmp_path / "run"
    r = _recipe(tiny_model_dir, tiny_data, out, "trainer.micro_batch_size=auto", "model.gradient_checkpointing=auto")
    with caplog.at_level("INFO", logger="tunekit"):
        r.setup()
    r.tracker.close()
    (line,) = [rec.getMessage() for rec in caplog.records if rec.getMessage().startswith("memory:")]
    # the tiny model fits anything: the largest micro-batch, no checkpointing
    assert "trainer.micro_batch_size=auto -> 64" in line and "model.gradient_checkpointing=auto -> off" in line
    assert "planned peak" in line and "free on cpu" in line
    assert r.schedule.micro_batch_size == 64 and not r.model.get_base_model().is_gradient_checkpointing
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["trainer"]["micro_batch_size"] == 64 and saved["model"]["gradient_checkpointing"] is False


def test_train_refuses_what_cannot_fit_before_loading(tiny_model_dir, tiny_data, tmp_path, monkeypatch):
    import tunekit.train.build

    def never(*a, **k):
        raise AssertionError("the model was loaded before the memory check")

    monkeypatch.setattr(tunekit.train.build, "load_base_model", never)  # the tokenizer and data may load: cheap
    out = tmp_path / "run"
    r = _recipe(tiny_model_dir, tiny_data, out, "data.max_seq_len=512", "trainer.micro_batch_size=1048576")
    with pytest.raises(TunekitError) as e:
        r.setup()
    assert str(e.value).startswith("memory: the planned peak") and "activations" in str(e.value)
    assert not (out / "config.yaml").exists()


def test_ranks_choose_from_the_least_free_memory_and_a_resumed_run_keeps_its_choice(tmp_path):
    import torch

    from tunekit.plan.choose import resolve_memory_settings

    plenty = _cfg("trainer.micro_batch_size=auto")
    resolve_memory_settings(plenty, torch.device("cpu"))
    tight = _cfg("trainer.micro_batch_size=auto")  # another rank has only 3 GiB free: all must fit there
    resolve_memory_settings(tight, torch.device("cpu"), least=lambda n: min(n, 3 * GiB))
    assert tight.trainer.micro_batch_size < plenty.trainer.micro_batch_size
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({"trainer": {"micro_batch_size": 2},
                                                     "model": {"gradient_checkpointing": True}}))
    resumed = _cfg("trainer.micro_batch_size=auto", "model.gradient_checkpointing=auto", "trainer.resume=true")
    resolve_memory_settings(resumed, torch.device("cpu"), output_dir=run)
    assert (resumed.trainer.micro_batch_size, resumed.model.gradient_checkpointing) == (2, True)


def test_the_plan_counts_the_dense_copy_the_trainer_keeps():
    """tunekit.methods.lora.backend keeps a CPU run's 4-bit base dequantized in its compute dtype where that copy is
    at most an eighth of memory (bf16 on a CPU with native bf16, fp32 elsewhere): the planner counts
    the same bytes under "base weights", and nothing where the trainer keeps none."""
    from tunekit.plan.inputs import planner_inputs

    cfg = _cfg()
    shape, _ = planner_inputs(cfg, CPU)
    weights = shape.num_layers * sum(i * o for p in PROJECTIONS for i, o in [shape.projection(p)])
    for cpu_bf16, size in ((True, 2), (False, 4)):
        roomy = DeviceFacts("cpu", cpu_bf16=cpu_bf16, total_memory=8 * size * weights)
        assert planner_inputs(cfg, roomy)[1].dense_cache_bytes == size * weights
        small = DeviceFacts("cpu", cpu_bf16=cpu_bf16, total_memory=8 * size * weights - 1)
        assert planner_inputs(cfg, small)[1].dense_cache_bytes == 0
    assert planner_inputs(_cfg("kernels.fused_lora=off"), roomy)[1].dense_cache_bytes == 0  # peft keeps none
    assert planner_inputs(cfg, A100_80)[1].dense_cache_bytes == 0  # the GPU dequantizes in the kernel


def test_auto_offloads_activations_only_when_nothing_fits_without():
    """Offloading copies each checkpointed block's input to the host and back every micro-batch:
    `auto` takes it only where the step does not fit without it (and never on a CPU)."""
    cfg = _cfg("model.preset=llama-3-8b", "data.max_seq_len=2048", "trainer.micro_batch_size=2",
               "model.gradient_checkpointing=true")
    assert [o for _, _, o in candidates(cfg, A100_80)] == [False, True]
    without = choose(_cfg("model.preset=llama-3-8b", "data.max_seq_len=2048", "trainer.micro_batch_size=2",
                          "model.gradient_checkpointing=true", "model.offload_activations=false"), A100_80, 10**15)[2]
    with_ = choose(_cfg("model.preset=llama-3-8b", "data.max_seq_len=2048", "trainer.micro_batch_size=2",
                        "model.gradient_checkpointing=true", "model.offload_activations=true"), A100_80, 10**15)[2]
    need_without, need_with = without.needed_beyond_runtime(), with_.needed_beyond_runtime()
    assert need_with < need_without
    assert not choose(cfg, A100_80, 24 * GiB)[2].setup.offload_activations  # a 24 GiB card: room enough
    room = int(need_with / 0.89)  # fits with offloading, inside auto's 10% headroom; not without it
    assert not without.fits(room, 0.10)
    squeezed = choose(cfg, A100_80, room)[2]
    assert squeezed.setup.offload_activations and squeezed.fits(room, 0.10)
    assert [o for _, _, o in candidates(cfg, CPU)] == [False]  # nothing to offload to on a CPU


def test_dora_plans_the_identity_peft_builds_each_forward():
    """peft's DoRA layer builds torch.eye(in_features) and the (out, in) weight for its norm on every
    forward and recompute: on Llama-3-8B's down_proj (in 14336) the identity alone is 784 MiB in
    fp32. The plan's block working set carries it (plain LoRA's does not)."""
    base = ["model.preset=llama-3-8b", "data.max_seq_len=2048", "trainer.micro_batch_size=2",
            "model.gradient_checkpointing=true", "model.offload_activations=false"]
    lora = choose(_cfg(*base), A100_80, 10**15)[2]
    dora = choose(_cfg(*base, "method.use_dora=true"), A100_80, 10**15)[2]
    grown = dora.memory.terms["working set (block backward)"] - lora.memory.terms["working set (block backward)"]
    assert grown >= 4 * (14336**2 + 3 * 4096 * 14336)  # 1.42 GiB: the identity and three (4096, 14336) fp32 tensors
    assert dora.peak - lora.peak >= grown


@pytest.mark.skipif(torch.cuda.is_available(), reason="what a machine without a GPU answers")
def test_planning_for_a_gpu_on_a_machine_without_one_needs_no_memory_figure(capsys):
    """`--device cuda` without `--memory` where no GPU is visible: the free memory is unknown (said so),
    not a traceback from torch.cuda."""
    from tunekit.device import facts as dev

    assert dev.available_memory_bytes(torch.device("cuda")) is None
    code, out, err = run_main(["plan", "recipe=qlora", "model.preset=llama-3-8b", "--device", "cuda"], capsys)
    assert code == 0, err
    assert "an unknown amount (give --memory)" in out
