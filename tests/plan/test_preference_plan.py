"""The planner's preference terms: a pair is two rows through one forward, and a loss with a
reference runs one more no-grad forward of the same rows each step (tunekit.train.preference).
Measured against real DPO steps by scripts/bench_plan.py (its "dpo" configurations)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tunekit.commands.compose import compose_configs
from tunekit.device.facts import DeviceFacts
from tunekit.plan import GiB
from tunekit.plan.choose import choose
from tunekit.plan.compute import step_flops
from tunekit.plan.inputs import planner_inputs
from tunekit.plan.memory import activation_bytes, reference_forward_bytes, sft_loss_bytes, step_memory

H100_24 = DeviceFacts("cuda", 0, (9, 0), "H100", 24 * GiB)
LLAMA8 = ("recipe=dpo", "model.preset=llama-3-8b", "data.max_seq_len=1024")


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    path.write_text("".join(f'{{"prompt": "Say {i}.", "chosen": "{i}.", "rejected": "No."}}\n' for i in range(40)))
    return path


def _setup(pairs, *overrides):
    (cfg,) = compose_configs([*LLAMA8, f"data.path={pairs}", *overrides])
    return cfg, *planner_inputs(cfg, H100_24)


@pytest.mark.parametrize("overrides,rows,reference,kl", [
    ((), 2, True, 0),  # dpo, the recipe's loss
    (("preference.loss=ipo",), 2, True, 0),
    (("preference.loss=simpo",), 2, False, 0),  # reference-free
    (("preference.loss=orpo",), 2, False, 0),
    (("preference.loss=kto",), 1, True, 2),  # unpaired rows, and the KL rows through policy and reference
    (("preference.loss=kto", "preference.kto_kl=zero"), 1, True, 0),
    (("preference.loss=kto", "preference.precompute_ref=true"), 1, False, 2),  # the KL rows change each epoch
    (("preference.precompute_ref=true",), 2, False, 0),  # the reference computed once, before training
])
def test_the_setup_follows_the_preference_node(pairs, overrides, rows, reference, kl):
    _, _, setup = _setup(pairs, *overrides)
    assert (setup.rows_per_example, setup.reference_forward, setup.kl_forwards) == (rows, reference, kl)


def test_ktos_kl_rows_cost_two_frozen_forwards_where_the_reference_runs(pairs):
    _, shape, kto = _setup(pairs, "preference.loss=kto", "model.gradient_checkpointing=false")
    zero = replace(kto, kl_forwards=0)
    flops, flops0 = step_flops(shape, kto), step_flops(shape, zero)
    # each KL forward is the reference's work over the same number of rows (their lengths are capped
    # by the same data.max_seq_len the plan's worst rows fill)
    assert flops["KTO KL"] == 2 * flops["reference"] and flops["total"] - flops0["total"] == flops["KTO KL"]
    # the same working set as the reference's, at the same point of the step: with the reference computed
    # once (precompute_ref), the KL forwards alone still peak where the reference did
    mem = step_memory(shape, kto)
    assert mem.phase == "reference forward" and step_memory(shape, zero).total == mem.total
    once = replace(kto, reference_forward=False)
    assert step_memory(shape, once).phase == "KL forwards" and step_memory(shape, once).total == mem.total
    assert step_memory(shape, replace(once, kl_forwards=0)).total < mem.total


def test_n_pairs_plan_the_activations_of_2n_rows_and_the_reference_on_top(pairs):
    _, shape, dpo = _setup(pairs, "trainer.micro_batch_size=2", "model.gradient_checkpointing=false")
    sft = replace(dpo, rows_per_example=1, reference_forward=False, micro_batch_size=4)
    assert activation_bytes(shape, dpo) == activation_bytes(shape, sft)
    # the loss keeps the same rows' gradient; its backward adds one fp32 copy of it
    n_d = 4 * (1024 - 1) * shape.hidden_size
    assert sft_loss_bytes(shape, dpo)["backward"] == sft_loss_bytes(shape, sft)["backward"] + 4 * n_d
    mem = step_memory(shape, dpo)
    assert mem.total >= step_memory(shape, sft).total
    # the reference's forward runs beside the saved activations: at least its own last hidden states
    assert reference_forward_bytes(shape, dpo) > 4 * 1024 * shape.hidden_size * 2
    no_ref = replace(dpo, reference_forward=False)
    assert step_memory(shape, no_ref).total <= mem.total
    # and it costs one more frozen forward: more than a third of the SFT step's FLOPs (4N of 6N+)
    extra = step_flops(shape, dpo)["total"] - step_flops(shape, no_ref)["total"]
    assert extra == step_flops(shape, dpo)["reference"] > step_flops(shape, sft)["total"] / 4


def test_auto_picks_fewer_pairs_than_it_would_sft_rows(pairs):
    cfg, _, _ = _setup(pairs, "trainer.micro_batch_size=auto", "model.gradient_checkpointing=true")
    (sft_cfg,) = compose_configs(["recipe=qlora", "model.preset=llama-3-8b", "data.max_seq_len=1024",
                                  "trainer.micro_batch_size=auto", "model.gradient_checkpointing=true"])
    budget = int(10 * GiB)
    pairs, _, plan = choose(cfg, H100_24, budget)
    rows, _, _ = choose(sft_cfg, H100_24, budget)
    assert plan.setup.rows_per_example == 2 and pairs < rows
