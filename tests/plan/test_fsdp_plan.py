"""The plan of a trainer.strategy=fsdp run is the plan of what FSDP2 runs (CPU only: device facts).

FSDP2 keeps peft's LoRA layers over a 4-bit base (tunekit.train.strategy.FSDP2.choose_lora_backend:
an fp32 copy of every LoRA input, no fused kernel, no dense cache) and never offloads activations
(tunekit.device.facts.offload_activations, sharded). The planner's setup, the `auto` settings and
`tunekit plan`'s FSDP column and verdict must count that path, not the one a single GPU takes.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from tunekit.commands.compose import compose_configs
from tunekit.commands.main import main
from tunekit.device.facts import DeviceFacts
from tunekit.plan import AUTO_HEADROOM, GiB, predict
from tunekit.plan.choose import choose
from tunekit.plan.inputs import planner_inputs

H100_40 = DeviceFacts("cuda", 0, (9, 0), "H100", 40 * GiB)  # a 40 GiB sm_90 card: bf16 compute
LLAMA8 = ("recipe=qlora", "model.preset=llama-3-8b", "data.max_seq_len=2048")


def _cfg(*overrides):
    (cfg,) = compose_configs([*LLAMA8, *overrides])
    return cfg


@pytest.mark.parametrize("ranks", [2, 4])
def test_the_fsdp_setup_has_the_flags_of_the_path_fsdp_runs(ranks):
    fsdp = planner_inputs(_cfg("trainer.strategy=fsdp", "model.gradient_checkpointing=true",
                               "model.offload_activations=true"), H100_40, ranks=ranks)[1]
    assert (fsdp.lora_compute, fsdp.fused_kernel, fsdp.dense_cache_bytes, fsdp.offload_activations) == (False, False, 0, False)
    # DDP, and fsdp in one process (a plain single process), take the compute-dtype path and offload
    for cfg, n in ((_cfg("model.gradient_checkpointing=true", "model.offload_activations=true"), ranks),
                   (_cfg("trainer.strategy=fsdp", "model.gradient_checkpointing=true",
                         "model.offload_activations=true"), 1)):
        one = planner_inputs(cfg, H100_40, ranks=n)[1]
        assert (one.lora_compute, one.fused_kernel, one.offload_activations) == (True, True, True)


def test_auto_checkpointing_follows_the_fsdp_figure():
    """A budget where the step without checkpointing fits on the compute-dtype path but not on
    peft's (fp32 copies of the LoRA inputs): under fsdp `auto` must turn checkpointing on."""
    cfg = _cfg("trainer.strategy=fsdp", "trainer.micro_batch_size=4", "model.gradient_checkpointing=auto")
    shape, setup = planner_inputs(cfg, H100_40, ranks=2)
    setup = replace(setup, gradient_checkpointing=False)
    peft = predict(shape, setup, H100_40, 2, setup).as_run(True)
    compute = replace(setup, lora_compute=True, fused_kernel=True)
    other = predict(shape, compute, H100_40, 2, compute).as_run(True)
    assert other.needed_beyond_runtime() < peft.needed_beyond_runtime()
    # between the two: the compute-dtype figure fits with auto's headroom, peft's does not
    available = int((other.needed_beyond_runtime() + peft.needed_beyond_runtime()) / 2 / (1 - AUTO_HEADROOM))
    assert other.fits(available, AUTO_HEADROOM) and not peft.fits(available, AUTO_HEADROOM)
    b, checkpointing, plan = choose(cfg, H100_40, available, ranks=2)
    assert (b, checkpointing) == (4, True)
    assert plan.memory is plan.fsdp and not plan.setup.lora_compute and not plan.setup.offload_activations
    # with more room the same choice drops checkpointing, from the peft figure
    assert choose(cfg, H100_40, int(peft.needed_beyond_runtime() / (1 - AUTO_HEADROOM)) + 1, ranks=2)[1] is False


def _plan_json(capsys, *overrides, gpus=2, memory="40"):
    main(["plan", *LLAMA8, *overrides, "--device", "cuda", "--memory", memory, "--gpus", str(gpus), "--json"])
    return json.loads(capsys.readouterr().out)


def test_plan_cli_fsdp_column_and_verdict_are_fsdp_s(capsys):
    fixed = ("trainer.micro_batch_size=2", "model.gradient_checkpointing=true", "model.offload_activations=true")
    plan = _plan_json(capsys, "trainer.strategy=fsdp", *fixed)
    ddp, fsdp = plan["per_rank"]["ddp"], plan["per_rank"]["fsdp"]
    assert plan["strategy"] == "fsdp"
    assert plan["setup"]["lora_compute"] is False and plan["setup"]["offload_activations"] is False
    # the DDP column offloads the checkpointed inputs (host memory), the FSDP column keeps them
    assert fsdp["terms"]["activations"] > ddp["terms"]["activations"]
    assert plan["needed_bytes"] == fsdp["device_total_bytes"]  # the verdict reads the FSDP figure
    assert plan["fits"] == (fsdp["device_total_bytes"] <= 40 * GiB)
    as_ddp = _plan_json(capsys, *fixed)
    assert as_ddp["strategy"] == "ddp" and as_ddp["needed_bytes"] == as_ddp["per_rank"]["ddp"]["device_total_bytes"]
    assert as_ddp["per_rank"]["fsdp"] == fsdp  # the FSDP column does not depend on which strategy is asked for


def test_plan_cli_text_verdict_under_fsdp(capsys):
    """A 70B base does not fit 24 GiB under DDP but does sharded over 4 ranks: asked for fsdp, the
    verdict says it fits, with the FSDP figure."""
    args = ["plan", "recipe=qlora", "model.preset=llama-3-70b", "trainer.micro_batch_size=1", "data.max_seq_len=512",
            "model.gradient_checkpointing=true"]
    flags = ["--device", "cuda", "--memory", "24", "--gpus", "4"]
    main(args + ["trainer.strategy=fsdp"] + flags)
    out = capsys.readouterr().out
    assert "fits: needs" in out and "does NOT fit" not in out and "FSDP over 4 ranks would need" not in out
    main(args + flags)
    assert "does NOT fit" in capsys.readouterr().out


def test_plan_cli_fsdp_column_marks_the_terms_split_over_the_ranks(capsys):
    """The FSDP column says which of its rows are a rank's share (divided by N) and which every rank
    holds whole; the verdict names the column it reads."""
    args = ["plan", *LLAMA8, "trainer.strategy=fsdp", "trainer.micro_batch_size=2", "model.gradient_checkpointing=true",
            "--device", "cuda", "--memory", "40", "--gpus", "4"]
    main(args)
    out = capsys.readouterr().out
    rows = {line.split("  ")[1].strip(): line for line in out.splitlines() if line.startswith("  ") and "GiB" in line
            and not line.lstrip().startswith(("fits", "gradient checkpointing on", "device:"))}
    split = ("base weights", "trainable parameters", "gradients", "optimizer state")
    for name in split:
        assert rows[name].rstrip().endswith("GiB (1/4)"), rows[name]  # the FSDP column, last
        assert rows[name].count("(1/4)") == 1, rows[name]  # never in the DDP column
    for name in ("activations", "gathered blocks (FSDP)", "peak of one step"):
        assert "(1/4)" not in rows[name], rows[name]
    assert "quantization state inside base weights" in out  # NF4: not all of base weights is split
    assert "fits: needs" in out and "(from the FSDP x4 column)" in out
    plan = _plan_json(capsys, *args[1 + len(LLAMA8):-6], gpus=4)
    assert plan["per_rank"]["fsdp"]["sharded_terms"] == list(split)
    assert plan["per_rank"]["ddp"]["sharded_terms"] == []
