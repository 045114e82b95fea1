"""trainer.strategy=fsdp (tunekit.train.fsdp): two real gloo ranks on the CPU against one process, resume,
per-rank memory; and the checks that stop a corrupted sharded 4-bit base, without launching."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file

from _helpers import launch_two_ranks, read_jsonl, run_cli, tiny_args
from tunekit import TunekitError
from tunekit.train.fsdp import (Sharded, check_config, decoder_layers, outer_units, packed_checksum,
                                projection_units)


@pytest.fixture(scope="session")
def untied_model_dir(tmp_path_factory, tiny_model_dir) -> Path:
    """The tiny model with an output head of its own (FSDP shards it as a unit beside the layers)."""
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny-untied")
    cfg = AutoConfig.from_pretrained(tiny_model_dir)
    cfg.tie_word_embeddings = False
    torch.manual_seed(1)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(out)
    return out


# Two ranks x grad_accum G x one example == one process x grad_accum 2G x one example, fp32 LoRA.
# Every example runs alone in both runs, so at a step that starts from the same weights its forward
# and backward are the same computation and its gradient is bitwise the same. With G = 1 the two
# per-example gradients are summed once (a + b == b + a exactly) and, clipping off, Adam steps the
# same numbers elementwise: the runs are equal bit for bit, whatever the compute dtype. With G = 2
# (and clipping on) the four gradients are summed in another order (FSDP: a reduce-scatter per
# micro-batch, accumulated; one process: a running sum in length order) and the clip norm is summed
# over shards: |dg| <= 3 * 2^-24 * sum_k |g_k| per element, and the next steps' forwards start from
# weights that differ by such roundings. That needs fp32 compute: in bf16 a weight a few ulps off
# flips the rounding of some activations (1 bf16 ulp = 4e-3 relative), and the flips compound from
# step to step far past ATOL. In fp32 Adam's update m/(sqrt(v) + eps) moves by about
# |dg| / (|g| + eps) per step: nothing measurable unless an element's gradient cancels
# (sum_k |g_k| >> |g|), and eps = 1e-8 bounds even that: over 4 steps at lr 1e-3 a cancellation
# ratio up to 1e4 gives 4 * 1e-3 * 1.8e-7 * 1e4 = 7e-6 < ATOL. A real fault (a reduction missed or
# doubled, a shard not updated) moves updates by O(lr) = 1e-3. A gradient scaled by a wrong divide
# factor would hardly move Adam's update, so the logged gradient norms are compared too (RTOL_NORM:
# the same ~33k squares summed in another order; a factor 2 is 1e0) and the losses (the same
# micro-batch sums, re-added).
ATOL, RTOL, RTOL_NORM, RTOL_LOSS = 1e-5, 1e-4, 1e-4, 1e-5
ONE_EXAMPLE = ["method.dropout=0", "trainer.micro_batch_size=1", "trainer.max_steps=4"]


def _adapter(run: Path, sub: str = "adapter") -> dict[str, torch.Tensor]:
    return load_file(str(run / sub / "adapter_model.safetensors"))


def _steps(run: Path) -> list[dict]:
    return [row for row in read_jsonl(run / "metrics.jsonl") if "loss" in row]


def _same_run(two: Path, one: Path) -> None:
    last = "checkpoints/step-000004/adapter"
    a, b = _adapter(two, last), _adapter(one, last)
    assert a.keys() == b.keys() and len(a) == 28
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=RTOL, atol=ATOL, msg=key)
    assert any(not torch.equal(v, _adapter(one, "checkpoints/step-000002/adapter")[k]) for k, v in b.items())
    rows_two, rows_one = _steps(two), _steps(one)
    assert [r["step"] for r in rows_two] == [r["step"] for r in rows_one] == [1, 2, 3, 4]  # rank 0 alone logs
    for r2, r1 in zip(rows_two, rows_one):
        assert r2["trained_tokens"] == r1["trained_tokens"]
        assert r2["loss"] == pytest.approx(r1["loss"], rel=RTOL_LOSS)
        assert r2["grad_norm"] == pytest.approx(r1["grad_norm"], rel=RTOL_NORM)


def _holds_half(run: Path) -> dict:
    """Every tensor is cut in two along its first dimension; what is not cut (4-bit quantization
    state, rotary buffers) is small beside the tiny model's 49k x 64 embedding."""
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["ranks_in_sync"]
    fsdp = summary["fsdp"]
    assert len(fsdp["rank_bytes"]) == 2 and all(0.45 < b / fsdp["model_bytes"] < 0.55 for b in fsdp["rank_bytes"])
    return fsdp


def test_qlora_two_fsdp_ranks_match_one_process_and_resume(tiny_model_dir, tiny_data, tmp_path):
    """QLoRA (4-bit codes stored as bf16 and sharded; paged AdamW 32-bit on the shards; gradient
    checkpointing; accumulation and clipping) on two ranks == one process (G = 2 above, fp32
    compute); a resume from the step-2 checkpoint ends where the uninterrupted run ended. One
    held-out row: rank 1 evaluates nothing and runs filler forwards for rank 0's gathers. The LoRA
    starts from LoftQ: rank 0 computes it alone and sends it, so both ranks train from the start one
    process computes."""
    common = ["recipe=qlora", "model.dtype=fp32", *ONE_EXAMPLE, "data.max_val_examples=1", "trainer.strategy=fsdp",
              "method.init=loftq"]
    two = tmp_path / "two"
    r = launch_two_ranks(tiny_args(tiny_model_dir, tiny_data, two, *common), tmp_path, 29521)
    assert r.returncode == 0, r.stderr[-3000:]
    # one process with trainer.strategy=fsdp trains plainly (and is the reference)
    one = tmp_path / "one"
    r1 = run_cli(["train", *tiny_args(tiny_model_dir, tiny_data, one, *common, "trainer.grad_accum=4")], tmp_path)
    assert r1.returncode == 0, r1.stderr[-3000:]
    assert "nothing to shard" in r1.stderr and "fsdp:" not in r1.stderr

    _same_run(two, one)
    a, b = _adapter(two), _adapter(two, "checkpoints/step-000004/adapter")
    assert all(torch.equal(a[k], b[k]) for k in a)
    _holds_half(two)
    assert r.stderr.count("fsdp: 2 decoder layers + the rest sharded over 2 ranks") == 1  # one log line, rank 0
    assert r.stderr.count("adapter saved to") == 1
    assert r.stderr.count("start computed on rank 0") == 1
    assert "4-bit codes stored as bf16; checked at the first forward" in r.stderr
    state = json.loads((two / "checkpoints" / "step-000004" / "trainer_state.json").read_text())
    assert state["optimizer"]["world_size"] == 2 and len(state["optimizer"]["ranks"]) == 2  # each rank's own shards

    resumed = tmp_path / "resumed"
    shutil.copytree(two, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step-000004")
    shutil.rmtree(resumed / "adapter")
    r = launch_two_ranks(tiny_args(tiny_model_dir, tiny_data, resumed, *common, "trainer.resume=true"), tmp_path, 29522)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stderr
    a, b = _adapter(two), _adapter(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)  # the same computations in the same order: bitwise

    # on one process: each rank saved its own shards' optimizer state, so it is refused, in one line,
    # before the model loads (no "base:" line), naming both numbers of ranks
    fewer = tmp_path / "fewer"
    shutil.copytree(two, fewer)
    shutil.rmtree(fewer / "checkpoints" / "step-000004")
    shutil.rmtree(fewer / "adapter")
    r = run_cli(["train", *tiny_args(tiny_model_dir, tiny_data, fewer, *common, "trainer.resume=true")], tmp_path)
    assert r.returncode == 2, r.stderr[-3000:]
    assert (f"tunekit: error: trainer.resume: the checkpoint in {fewer / 'checkpoints' / 'step-000002'} was written "
            "by 2 FSDP ranks; this run has 1 process (its optimizer state whole, not sharded)") in r.stderr
    assert "resume with --num_processes 2, or start a new output_dir" in r.stderr
    assert "base:" not in r.stderr and "Traceback" not in r.stderr


def test_lora_over_an_untied_model_two_fsdp_ranks_match_one_process(untied_model_dir, tiny_data, tmp_path):
    """LoRA over a base whose embeddings and head are units of their own, G = 1 and clipping off
    above. The frozen embeddings and head are never gathered: the lookup and the loss take their
    vocabulary slices from the ranks one at a time (the loss summed online,
    tunekit.losses.sliced_head), where one process sums the whole head's logits at once. Only that loss's sums differ in order: a few roundings of 2^-24
    relative per gradient element in fp32, the G = 2 case's bound above (in bf16 such a difference
    flips activations' roundings from step to step, as said there). keep_best gathers the adapter
    at every evaluation (all ranks) and rank 0 writes best/."""
    common = ["recipe=lora", "model.dtype=fp32", *ONE_EXAMPLE, "trainer.max_grad_norm=inf"]
    two = tmp_path / "two"
    r = launch_two_ranks(tiny_args(untied_model_dir, tiny_data, two, *common, "trainer.grad_accum=1",
                                   "trainer.strategy=fsdp", "trainer.keep_best=true"), tmp_path, 29523)
    assert r.returncode == 0, r.stderr[-3000:]
    one = tmp_path / "one"
    r1 = run_cli(["train", *tiny_args(untied_model_dir, tiny_data, one, *common, "trainer.grad_accum=2")], tmp_path)
    assert r1.returncode == 0, r1.stderr[-3000:]

    assert "2 decoder layers + embeddings + head + the rest" in r.stderr
    fsdp = _holds_half(two)
    assert fsdp["model_bytes"] > 2 * 49152 * 64 * 4  # embeddings and head, fp32
    assert fsdp["head_in_loss"] == fsdp["embeddings_in_forward"] == "slices"
    best = json.loads((two / "best" / "best.json").read_text())
    assert best["step"] in (0, 2, 4) and _adapter(two).keys() == _adapter(two, "best/adapter").keys()
    _same_run(two, one)  # the last checkpoints (adapter/ is the best evaluation's)


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_dpo_over_an_untied_model_two_ranks_match_one_process(untied_model_dir, tmp_path, strategy):
    """DPO on two ranks: each rank's micro-batch of pairs is its chosen and rejected rows in one
    forward, the reference the same model with the adapter switched off. Under FSDP the per-token
    log-probabilities come from the frozen head's vocabulary slices, never gathered
    (tunekit.losses.sliced_head), each token's gradient scaled by its own sequence's; under DDP every
    rank holds the whole model and the gradients are averaged. Two ranks of one pair each == one
    process of two pairs (G = 1 above, fp32: only the sums' order differs, the untied SFT test's
    bound). The first step's loss is ln 2 on both: the reference is the policy before any step."""
    pairs = Path(__file__).parents[1] / "data" / "pairs.jsonl"
    common = [f"model.path={untied_model_dir}", f"data.path={pairs}", "recipe=dpo", "model.quantize=none",
              "model.dtype=fp32", "method.dropout=0", "trainer.micro_batch_size=1", "trainer.max_steps=2",
              "trainer.eval_every=1000", "trainer.save_every=2", "trainer.warmup_steps=0", "trainer.lr=1e-3",
              "trainer.eval_samples=0", "trainer.max_grad_norm=inf", "data.max_seq_len=64", "data.val_fraction=0.2"]
    two = tmp_path / "two"
    r = launch_two_ranks([*common, f"output_dir={two}", "trainer.grad_accum=1", f"trainer.strategy={strategy}"],
                         tmp_path, 29524 if strategy == "fsdp" else 29525)
    assert r.returncode == 0, r.stderr[-3000:]
    one = tmp_path / "one"
    r1 = run_cli(["train", *common, f"output_dir={one}", "trainer.grad_accum=2"], tmp_path)
    assert r1.returncode == 0, r1.stderr[-3000:]
    summary = json.loads((two / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["ranks_in_sync"]
    if strategy == "fsdp":
        assert _holds_half(two)["head_in_loss"] == "slices"
    else:
        assert "fsdp" not in summary
    rows_two, rows_one = _steps(two), _steps(one)
    assert [r["step"] for r in rows_two] == [r["step"] for r in rows_one] == [1, 2]
    assert rows_two[0]["loss"] == pytest.approx(math.log(2), rel=RTOL_LOSS)
    for r2, r1 in zip(rows_two, rows_one):
        assert r2["pairs"] == r1["pairs"] == 2
        for key in ("loss", "rewards/margins", "grad_norm"):
            assert r2[key] == pytest.approx(r1[key], rel=RTOL_NORM, abs=1e-7), key
    a, b = _adapter(two), _adapter(one)
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=RTOL, atol=ATOL, msg=key)


# ---------------------------------------------------------------- without launching
def test_checksum_catches_nan_canonicalisation_of_packed_codes():
    """github.com/bitsandbytes-foundation/bitsandbytes/issues/1945: FSDP2 on CUDA rewrote every bf16 NaN pattern of packed NF4 codes to
    0x7FFF. The first-forward check compares checksums of the gathered weight with the original."""
    import bitsandbytes.functional as bnbf

    torch.manual_seed(0)
    packed, _ = bnbf.quantize_4bit(torch.randn(256, 256), blocksize=64, compress_statistics=True, quant_type="nf4",
                                   quant_storage=torch.bfloat16)
    words = packed.view(torch.int16)
    nan = torch.isnan(packed) & (words != 0x7FFF)
    assert packed.dtype == torch.bfloat16 and int(nan.sum()) > 0  # such patterns do occur
    canonical = words.clone()
    canonical[nan] = 0x7FFF
    assert packed_checksum(packed) == packed_checksum(packed.clone())
    assert packed_checksum(canonical.view(torch.bfloat16)) != packed_checksum(packed)


def test_first_forward_check_stops_on_a_changed_weight_and_then_steps_aside():
    sh = Sharded(torch.device("cpu"), 2, 0)
    layer, x = nn.Linear(8, 8), torch.randn(2, 8)
    sh._checks["layers.0.q_proj"] = layer.register_forward_pre_hook(
        sh._checksum_hook("layers.0.q_proj", packed_checksum(layer.weight)))
    layer(x)
    assert not sh._checks and not layer._forward_pre_hooks  # checked once, then removed
    sh._checks["layers.0.q_proj"] = layer.register_forward_pre_hook(sh._checksum_hook("layers.0.q_proj", (0, 0)))
    with pytest.raises(TunekitError, match=r"fsdp: the 4-bit weight of layers.0.q_proj differs .*issues/1945"):
        layer(x)


def test_first_step_symptoms_stop_with_one_line():
    sh = Sharded(torch.device("cpu"), 2, 0)
    sh.quantized = True
    sh.check_first_step(0, 10.8, 1.2)  # a real first step passes
    for loss, norm, what in [(0.0, 0.0, "exactly 0"), (10.8, float("nan"), "gradient norm nan"),
                             (float("inf"), 1.0, "loss is inf")]:
        with pytest.raises(TunekitError, match=f"trainer.strategy=fsdp: step 1: .*{what}.*issues/1945") as e:
            sh.check_first_step(0, loss, norm)
        assert "\n" not in str(e.value) and "trainer.strategy=ddp" in str(e.value)


def test_config_refusals_and_the_fingerprint():
    from tunekit.config import TrainConfig
    from tunekit.train.checks import check_values
    from tunekit.train.resume import fingerprint

    with pytest.raises(TunekitError, match="kernels.fused_lora: on is not supported with trainer.strategy=fsdp"):
        check_config("on", "sft")
    with pytest.raises(TunekitError, match="trainer.strategy: fsdp does not run objective=distill"):
        check_config("auto", "distill")
    check_config("auto", "sft")
    cfg = TrainConfig()
    cfg.trainer.strategy = "zero3"
    with pytest.raises(TunekitError, match="trainer.strategy"):
        check_values(cfg)
    cfg.trainer.strategy = "ddp"
    assert "trainer.strategy" not in fingerprint(cfg, 2)  # as before the key existed: old checkpoints resume
    cfg.trainer.strategy = "fsdp"
    assert fingerprint(cfg, 2)["trainer.strategy"] == "fsdp"  # a DDP checkpoint does not resume under FSDP


def test_units_follow_the_model(tiny_model_dir, untied_model_dir):
    from transformers import AutoModelForCausalLM

    tied = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    untied = AutoModelForCausalLM.from_pretrained(untied_model_dir)
    assert [type(m).__name__ for m in decoder_layers(tied)] == ["LlamaDecoderLayer"] * 2
    assert outer_units(tied) == []  # a tied head stays with the embeddings in the root unit
    assert outer_units(untied) == [untied.model.embed_tokens, untied.lm_head]
    # a CPU rank's projection units: the seven frozen projections of each layer, in model order; under
    # LoRA each is peft's layer (base weight, A and B together), never its base_layer alone, and
    # the norms stay in their layer's unit
    names = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert projection_units(decoder_layers(tied)) == []  # trained weights (full fine-tuning): layer units
    tied.requires_grad_(False)
    plain = projection_units(decoder_layers(tied))
    assert plain == [getattr(getattr(layer, "mlp" if n.endswith(("gate_proj", "up_proj", "down_proj")) else "self_attn"), n)
                     for layer in decoder_layers(tied) for n in names]
    from peft import LoraConfig, get_peft_model

    lora = get_peft_model(tied, LoraConfig(r=4, target_modules=["q_proj", "down_proj"]))
    units = projection_units(decoder_layers(lora))
    assert len(units) == 14 and [type(u).__name__ for u in units[:7]] == ["Linear"] * 7
    wrapped = [u for u in units if hasattr(u, "base_layer")]
    assert len(wrapped) == 4 and all(not u.weight.requires_grad for u in units)
    assert not any(u.base_layer in units for u in wrapped)


def test_the_start_up_memory_check_plans_with_the_fsdp_figures(tiny_model_dir):
    from tunekit.config import TrainConfig
    from tunekit.device.facts import DeviceFacts
    from tunekit.plan.choose import plan_for

    cfg = TrainConfig()
    cfg.model.path = str(tiny_model_dir)
    facts = DeviceFacts("cuda", 0, (9, 0), "GPU", 80 * 2**30)
    ddp = plan_for(cfg, facts, 2, 8, False)
    cfg.trainer.strategy = "fsdp"
    fsdp = plan_for(cfg, facts, 2, 8, False)
    assert "gathered blocks (FSDP)" not in ddp.memory.terms
    assert fsdp.memory.terms == ddp.fsdp.terms and "gathered blocks (FSDP)" in fsdp.memory.terms
    assert fsdp.memory.terms["base weights"] * 2 == pytest.approx(ddp.memory.terms["base weights"], abs=2)
