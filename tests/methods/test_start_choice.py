"""method.init=auto (the qlora recipe's default): LoftQ where its estimated cost is small against the
run's, the plain start otherwise, decided before anything loads (tunekit.methods.lora.start_choice)."""

from __future__ import annotations


import pytest

from tunekit.commands.compose import compose_configs
from tunekit.device.facts import DeviceFacts
from tunekit.methods import get_method
from tunekit.methods.lora.start_choice import MAX_SHARE, choose_init, loftq_seconds, svd_units, training_seconds
from tunekit.plan import GiB
from tunekit.plan.choose import plan_for
from tunekit.plan.shape import PROJECTIONS, preset_shape

CPU = DeviceFacts("cpu", cpu_bf16=True)
H100 = DeviceFacts("cuda", 0, (9, 0), "H100", 80 * GiB)


def _resolve(facts, *overrides, kept=None):
    (cfg,) = compose_configs(["recipe=qlora", *overrides])
    plan = plan_for(cfg, facts, 1, 2, True)
    note = get_method("lora").resolve_start(cfg, facts, plan, int(cfg.trainer.max_steps), kept)
    return cfg.method.init, note


def test_svd_units_count_each_target_once_per_alternation():
    shape = preset_shape("llama-3-8b")
    one = svd_units(shape, PROJECTIONS, 1)
    # q, o: 4096 x 4096; k, v: 1024 x 4096; gate, up, down: 14336 x 4096 (min side 4096)
    per_block = 10 * (2 * 4096**3 + 2 * 1024**2 * 4096 + 3 * 14336 * 4096**2)
    assert one == 32 * per_block and svd_units(shape, PROJECTIONS, 3) == 3 * one
    assert svd_units(shape, ("q_proj",), 1) == 32 * 10 * 4096**3


def test_the_rule_weighs_the_start_against_the_run():
    shape = preset_shape("llama-3-8b")
    step = 1e15  # FLOPs of one optimizer step
    # the share is LoftQ's time over training's: exactly MAX_SHARE at this many steps
    edge = loftq_seconds(shape, PROJECTIONS, 1, "cuda") / (MAX_SHARE * training_seconds(step, 1, "cuda"))
    long_run = choose_init(shape, PROJECTIONS, 1, "cuda", step, int(edge * 2), "nf4", False)
    short_run = choose_init(shape, PROJECTIONS, 1, "cuda", step, int(edge / 2), "nf4", False)
    assert long_run[0] == "loftq" and short_run[0] == "default"
    assert "method.init=loftq forces it" in short_run[1] and "~" in long_run[1]
    # two more alternations cost twice as much again
    assert choose_init(shape, PROJECTIONS, 3, "cuda", step, int(edge * 2), "nf4", False)[0] == "default"


@pytest.mark.parametrize("quantize,reference,why", [
    ("none", False, "this base is not 4-bit"),
    ("nf4", True, "reference is the base with the adapter off"),
])
def test_where_loftq_cannot_apply_auto_is_the_plain_start(quantize, reference, why):
    init, reason = choose_init(preset_shape("llama-3-8b"), PROJECTIONS, 1, "cuda", 1e15, 10**6, quantize, reference)
    assert init == "default" and why in reason


def test_the_default_model_takes_loftq_and_a_large_one_on_a_short_run_does_not():
    init, note = _resolve(CPU)  # the embedded 135M model, the recipe's 60 steps
    assert init == "loftq" and note.startswith("method.init=auto -> loftq: LoftQ's SVDs ~")
    init, note = _resolve(H100, "model.preset=llama-3-8b", "trainer.max_steps=20", "data.max_seq_len=512")
    assert init == "default" and "over 10%" in note


def test_explicit_starts_and_a_resumed_runs_choice_are_kept():
    assert _resolve(CPU, "method.init=default") == ("default", None)
    assert _resolve(CPU, "method.init=loftq") == ("loftq", None)
    init, note = _resolve(H100, "model.preset=llama-3-8b", "trainer.max_steps=20", kept="loftq")
    assert init == "loftq" and "first start chose" in note


def test_dora_and_preference_runs_resolve_to_the_plain_start(tmp_path):
    assert _resolve(CPU, "method.use_dora=true")[0] == "default"
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(f'{{"prompt": "p{i}", "chosen": "a", "rejected": "b"}}\n' for i in range(40)))
    assert _resolve(CPU, "objective=preference", f"data.path={pairs}")[0] == "default"
    init, _ = _resolve(CPU, "objective=preference", f"data.path={pairs}", "preference.loss=simpo")
    assert init == "loftq"  # no reference to keep: LoftQ's start is allowed



def test_fsdp_over_several_ranks_keeps_the_plain_start():
    """Under FSDP the base streams from rank 0 only for a start that needs no weights."""
    (cfg,) = compose_configs(["recipe=qlora", "trainer.strategy=fsdp"])
    plan = plan_for(cfg, CPU, 2, 2, True)
    note = get_method("lora").resolve_start(cfg, CPU, plan, 60)
    assert cfg.method.init == "default" and "under FSDP the base streams from one process" in note
    (one,) = compose_configs(["recipe=qlora", "trainer.strategy=fsdp"])
    get_method("lora").resolve_start(one, CPU, plan_for(one, CPU, 1, 2, True), 60)
    assert one.method.init == "loftq"  # one process trains plainly: nothing streams
