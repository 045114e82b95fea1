"""`tunekit train recipe=dpo` end to end on the tiny model (one run, 2 steps), checked against log-probs
computed apart from tunekit: plain transformers (model(input_ids).logits, log_softmax, gather, masked sum)
on the same pairs, rendered with the tokenizer's chat template, and TRL's own DPO loss on them. Then
`tunekit eval` and `tunekit export` of the same run, against its last evaluation.

The run is in fp32 (model.quantize=none model.dtype=fp32 over recipe=dpo's QLoRA) so that both sides
compute in one dtype and the comparison's tolerance comes from summation order alone: per-sequence
log-probs are sums of <= 20 per-token values of magnitude ~11 (ln 49152, the tiny model's near-uniform
predictions), each from a log-sum-exp over 49k fp32 logits and two decoder layers whose fp32 matmuls
sum 64-128 products in another order in a padded batch than in a single row: a relative error of a few
1e-6 per value, ~1e-4 absolute per summed sequence at worst. Rewards are beta = 0.1 times differences
of two such sums (<= 2e-5) and the DPO loss moves by at most beta/4 times its argument's error: atol 2e-4
holds with a margin of 10x, and is far below what a wrong reference would change (the rewards after two
steps at lr 1e-3 are ~1e-2, which the test asserts; a reference with the adapter left on makes them 0).
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from _helpers import read_jsonl, run_cli, trl_dpo_loss

ATOL = 2e-4
BETA = 0.1
HELD = [{"prompt": f"What is {a} times 2?", "chosen": f"{a} times 2 is {2 * a}.", "rejected": f"It is {2 * a + 3}, I think."}
        for a in (3, 5, 8, 11)]


@pytest.fixture(scope="module")
def dpo_run(tiny_model_dir, tmp_path_factory):
    from pathlib import Path

    tmp = tmp_path_factory.mktemp("dpo")
    held = tmp / "held.jsonl"
    held.write_text("".join(json.dumps(r) + "\n" for r in HELD))
    pairs = Path(__file__).parents[1] / "data" / "pairs.jsonl"
    out = tmp / "run"
    args = ["train", "recipe=dpo", f"model.path={tiny_model_dir}", f"data.path={pairs}", f"data.val_path={held}",
            f"output_dir={out}", "model.quantize=none", "model.dtype=fp32", "trainer.max_steps=2",
            "trainer.micro_batch_size=4", "trainer.grad_accum=1", "trainer.eval_every=2", "trainer.save_every=2",
            "trainer.warmup_steps=0", "trainer.lr=1e-3", "trainer.eval_samples=0", "data.max_seq_len=64"]
    done = run_cli(args, tmp)
    assert done.returncode == 0, done.stderr[-3000:]
    return out, read_jsonl(out / "metrics.jsonl")


def _logps(model, tok, rows) -> torch.Tensor:
    """(2P,) summed log-probs of each completion's tokens (through its <|im_end|>), chosen then rejected."""
    out = []
    for side in ("chosen", "rejected"):
        for r in rows:
            user = [{"role": "user", "content": r["prompt"]}]
            prompt = tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
            full = tok.apply_chat_template(user + [{"role": "assistant", "content": r[side]}], tokenize=False)
            completion = full[len(prompt):]
            completion = completion[: completion.index("<|im_end|>") + len("<|im_end|>")]
            p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
            c_ids = tok(completion, add_special_tokens=False)["input_ids"]
            ids = torch.tensor([p_ids + c_ids])
            with torch.no_grad():
                logp = torch.log_softmax(model(input_ids=ids).logits.float()[0, :-1], -1)
            picked = logp.gather(1, ids[0, 1:, None]).squeeze(1)
            out.append(picked[len(p_ids) - 1:].sum())  # the positions that predict the completion
    return torch.stack(out)


def _as_trl(sums: torch.Tensor, ref: torch.Tensor):
    """TRL's loss and metrics from per-sequence sums (each sum as one per-token value)."""
    mask = torch.ones(sums.shape[0], 2, dtype=torch.long)
    return trl_dpo_loss(sums[:, None], ref, mask, BETA)


def test_dpo_recipe_logs_rewards_and_saves_the_adapter(dpo_run):
    out, rows = dpo_run
    train = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "val_loss" in r]
    assert [r["step"] for r in train] == [1, 2] and [r["step"] for r in evals] == [0, 2]
    for r in train:
        assert {"rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "pairs"} <= set(r)
        assert r["pairs"] == 4
    for r in evals:
        assert {"val_rewards/chosen", "val_rewards/rejected", "val_rewards/accuracies", "val_rewards/margins"} <= set(r)
    assert (out / "adapter" / "adapter_config.json").is_file()
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["data"]["preference_rows"] == "pairs"


def test_losses_and_rewards_equal_trl_on_independent_logps(dpo_run, tiny_model_dir):
    """Step 1 and the step-0 evaluation: the adapter is the identity (B = 0), so the policy is the base and
    TRL's loss is ln 2 on any pairs. The last evaluation: the saved adapter over the base gives the policy,
    the base alone the reference; the run's held-out loss and rewards must be TRL's on those."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, rows = dpo_run
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    base = _logps(model, tok, HELD)
    first, _ = _as_trl(base, base)
    train = [r for r in rows if "loss" in r]
    evals = {r["step"]: r for r in rows if "val_loss" in r}
    assert train[0]["loss"] == pytest.approx(first, abs=ATOL) and first == pytest.approx(math.log(2), abs=1e-6)
    assert evals[0]["val_loss"] == pytest.approx(first, abs=ATOL)

    policy = _logps(PeftModel.from_pretrained(model, out / "adapter").eval(), tok, HELD)
    loss, metrics = _as_trl(policy, base)
    last = evals[2]
    assert abs(metrics["rewards/margins"][0]) > 10 * ATOL  # the adapter moved: a wrong reference would show
    assert last["val_loss"] == pytest.approx(loss, abs=ATOL)
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
        assert last[f"val_{name}"] == pytest.approx(metrics[name][0], abs=ATOL), name


def test_eval_and_export_score_the_held_out_pairs_as_the_trainer_did(dpo_run, tmp_path):
    """`tunekit eval` on the run's own split gives the last evaluation's figures (the saved adapter is the
    step-2 model; the tolerance is the module's: both sides fp32, the same 4 pairs in one batch, only the
    summation order may differ); the base is the reference, so its margins are 0 and its loss ln 2.
    Export's task check judges the same preference accuracy."""
    out, rows = dpo_run
    last = [r for r in rows if r.get("step") == 2 and "val_loss" in r][0]
    done = run_cli(["eval", str(out), "--base", "--json"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    trained, base = report["trained"], report["base"]
    assert report["objective"] == "preference" and trained["pairs"] == 4 == len(report["answers"])
    assert min(abs(a["value"]) for a in report["answers"]) > 10 * ATOL  # no margin near the accuracy's cut
    assert trained["loss"] == pytest.approx(last["val_loss"], abs=ATOL)
    for name, theirs in (("margin", "margins"), ("rewards_chosen", "chosen"), ("rewards_rejected", "rejected"),
                         ("preference_accuracy", "accuracies")):
        assert trained[name] == pytest.approx(last[f"val_rewards/{theirs}"], abs=ATOL), name
    assert trained["preference_accuracy"] == sum(a["correct"] for a in report["answers"]) / 4
    assert base["margin"] == 0 and base["preference_accuracy"] == 0 and base["loss"] == pytest.approx(math.log(2))
    exported = run_cli(["export", str(out), "--format", "adapter", "--out", str(tmp_path / "exp")], tmp_path)
    assert exported.returncode == 0, exported.stderr[-3000:]
    task = json.loads((tmp_path / "exp" / "fidelity.json").read_text())["fidelity"]["task"]
    assert task["metric"] == "preference_accuracy" and task["rows"] == 4
    assert (task["base"], task["trained"], task["exported"]) == (0.0, trained["preference_accuracy"],
                                                                 trained["preference_accuracy"])


# ---------------------------------------------------------------- a new adapter over a frozen start
# The run above is the start (model.adapter=RUN): DPO again, 2 steps, its reference precomputed.
# Step 1's reference and policy are the same function: the new adapter's B is 0 in the policy and scaled
# by 0 in the reference, both through the same layers (tunekit.methods.lora.stacked), so their log-probs
# agree to the summation-order bound of the module docstring at worst (~1e-4 per summed sequence, were
# the grad and no-grad forwards to sum in another order), and the DPO loss to beta/4 times twice that:
# 1e-5. A reference without the start (the base alone) would move it by beta/4 times the start's reward
# margins over beta (> 10 * ATOL / beta, asserted by the test above): > 5e-4.
STEP1_ATOL = 1e-5


@pytest.fixture(scope="module")
def stacked_run(dpo_run, tmp_path_factory):
    from pathlib import Path

    start, _ = dpo_run
    tmp = tmp_path_factory.mktemp("stacked")
    pairs = Path(__file__).parents[1] / "data" / "pairs.jsonl"
    out = tmp / "run"
    config = (start / "config.yaml").read_text()
    model_path = next(line.split(": ", 1)[1] for line in config.splitlines() if line.startswith("  path: "))
    args = ["train", "recipe=dpo", f"model.path={model_path}", f"data.path={pairs}", f"model.adapter={start}",
            f"output_dir={out}", "model.quantize=none", "model.dtype=fp32", "trainer.max_steps=2",
            "trainer.micro_batch_size=4", "trainer.grad_accum=1", "trainer.eval_every=2", "trainer.save_every=2",
            "trainer.warmup_steps=0", "trainer.lr=1e-3", "trainer.eval_samples=0", "data.max_seq_len=64",
            "preference.precompute_ref=true", "data.max_val_examples=4"]
    done = run_cli(args, tmp)
    assert done.returncode == 0, done.stderr[-3000:]
    return out, read_jsonl(out / "metrics.jsonl")


def test_dpo_over_a_frozen_start_adapter(stacked_run, dpo_run):
    """The reference is base + start (step 1's loss is ln 2, the step-0 rewards 0), only the new adapter
    trains (the same count as the start's run), and the run records which start it trained over."""
    from safetensors.torch import load_file

    from tunekit.owned import sha256_file

    out, rows = stacked_run
    start, _ = dpo_run
    train = [r for r in rows if "loss" in r]
    first_eval = next(r for r in rows if r.get("step") == 0 and "val_loss" in r)
    assert train[0]["loss"] == pytest.approx(math.log(2), abs=STEP1_ATOL)
    assert first_eval["val_rewards/margins"] == pytest.approx(0, abs=STEP1_ATOL / BETA)
    assert train[1]["rewards/margins"] != 0  # the new adapter did train
    summary = json.loads((out / "summary.json").read_text())
    sha = sha256_file(start / "adapter" / "adapter_model.safetensors")
    assert summary["start_adapter"]["sha256"] == sha and summary["start_adapter"]["path"] == str(start)
    assert summary["trainable_params"] == json.loads((start / "summary.json").read_text())["trainable_params"]
    assert json.loads((out / "adapter" / "start_adapter.json").read_text())["sha256"] == sha
    saved = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    assert saved and not any(".start." in k for k in saved)


# The merge export's route for such a run (tunekit.export.job: the in-memory merge of apply_and_load over
# the fp32 original base) against the stacked model, both fp32 over the same bf16-exact base weights.
# merged: W' = W + s_A B_A A_A + s_B B_B A_B, each entry rounded at most r + 2 = 18 times at 2^-24
# relative; stacked: W x + s_A B_A (A_A x) + s_B B_B (B_A x), summed in another order. Per projection
# output the two differ by at most K 2^-24 sum_k |W'_jk x_k| <= 128 * 6e-8 * (128 * 0.02 * 3) ~ 6e-5
# (K <= 128 inputs, |W| ~ 0.02 the init scale, |x| <= ~3 after RMSNorm), through two residual blocks
# and the 64-wide tied head: atol 1e-4 on the logits. Leaving out the start would move them by more
# than 100x that (asserted).
MERGE_ATOL = 1e-4


def test_merged_export_route_equals_base_plus_start_plus_new(stacked_run):
    from tunekit.export.stream import plan_stream
    from tunekit.methods import get_method
    from tunekit.runs.load import apply_and_load, load_base, load_original_base
    from tunekit.runs.open import open_source

    out, _ = stacked_run
    src = open_source(out)
    assert src.start is not None and src.dtype == torch.float32
    assert plan_stream(src, "original")[0] is None  # not streamed: both adapters merge on the loaded model
    lora = get_method("lora")
    ids = torch.randint(10, 1000, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        stacked = apply_and_load(src, load_base(src))(input_ids=ids).logits
        merged = lora.merge(apply_and_load(src, load_original_base(src))).eval()(input_ids=ids).logits
        alone = lora.apply(load_base(src), src.run.cfg.method)  # the new adapter without its start
        lora.load(alone, out / "adapter")
        without_start = alone.eval()(input_ids=ids).logits
    torch.testing.assert_close(merged, stacked, atol=MERGE_ATOL, rtol=0)
    assert (without_start - stacked).abs().max() > 100 * MERGE_ATOL


def test_kto_reference_point_is_the_batchs_mismatched_log_ratio(tiny_model_dir, tmp_path):
    """KTO with its KL estimate (preference.kto_kl=batch) end to end. Every row shares one prompt, and a
    micro-batch holds all four rows: the mismatched rows (each prompt with another row's completion) are
    then the matched rows in another order, so the estimate must equal the mean log-ratio of the rows
    the step trained on, max(0, (3 rewards/chosen + rewards/rejected) / (4 beta)), whatever order the
    batch took. That holds only if the KL rows go through the trained model (not the reference) and the
    reference (not the trained model). Tolerance: the same fp32 sums as the module docstring's (~1e-4
    absolute per sequence, a policy and a reference sum per log-ratio, rows in other batch positions),
    averaged over 4 rows, so 5e-4."""
    rows = [{"prompt": "Name a colour.", "completion": c, "label": c != "Banana."}
            for c in ("Red.", "Blue.", "Banana.", "Green.")]
    data = tmp_path / "kto.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    r = run_cli(["train", "recipe=dpo", "preference.loss=kto", f"model.path={tiny_model_dir}", f"data.path={data}",
                 f"data.val_path={data}", f"output_dir={out}", "model.quantize=none", "model.dtype=fp32",
                 "method.dropout=0", "trainer.max_steps=2", "trainer.micro_batch_size=4", "trainer.grad_accum=1",
                 "trainer.eval_every=2", "trainer.save_every=2", "trainer.warmup_steps=0", "trainer.lr=1e-2",
                 "trainer.eval_samples=0", "data.max_seq_len=64"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    steps = [m for m in read_jsonl(out / "metrics.jsonl") if "loss" in m and "step" in m and "lr" in m]
    assert len(steps) == 2 and steps[0]["loss"] == pytest.approx(0.5, abs=1e-6)  # step 1: policy = reference
    for m in steps:
        mean_ratio = (3 * m["rewards/chosen"] + m["rewards/rejected"]) / (4 * BETA)
        assert m["kl"] == pytest.approx(max(0.0, mean_ratio), abs=5e-4), m
    assert max(m["kl"] for m in steps) > 5e-3  # the estimate moved: not a reference scored twice


def test_a_kto_run_resumes_to_the_same_adapter_and_logs_its_figures_to_wandb(tiny_model_dir, tmp_path):
    """Resume and W&B hold for a preference objective as for SFT: a KTO run (the objective with the most
    per-step state: its rewards per kind of row and the KL rows built from each micro-batch) stopped
    after its step-2 checkpoint and resumed ends on the uninterrupted run's adapter bit for bit, its
    steps 3-4 logged with the same figures; and the figures metrics.jsonl holds reach W&B (offline).
    With preference.precompute_ref the reference log-probs are kept with the run and the resume reads
    them back (stored in fp32 as computed: the same values, so the same adapter)."""
    import os
    import shutil

    from safetensors.torch import load_file

    rows = [{"prompt": f"Is {i} even?", "completion": "Yes." if i % 2 == 0 else "No.", "label": True}
            for i in range(12)] + [{"prompt": f"Is {i} even?", "completion": "No." if i % 2 == 0 else "Yes.",
                                    "label": False} for i in range(12)]
    data = tmp_path / "kto.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env["HOME"] = str(tmp_path)  # no API key: tunekit picks W&B's offline mode
    whole = tmp_path / "whole"

    def train(out, *extra):
        r = run_cli(["train", "recipe=dpo", "preference.loss=kto", f"model.path={tiny_model_dir}", f"data.path={data}",
                     f"output_dir={out}", "model.quantize=none", "model.dtype=fp32", "trainer.max_steps=4",
                     "trainer.micro_batch_size=2", "trainer.grad_accum=2", "trainer.eval_every=4", "trainer.save_every=2",
                     "trainer.lr=1e-2", "trainer.eval_samples=0", "data.max_seq_len=32", "data.val_fraction=0.2",
                     "preference.precompute_ref=true", *extra], tmp_path, env=env, whole_env=True)
        assert r.returncode == 0, r.stderr[-3000:]
        return r

    train(whole, "tracker=wandb")
    (logged,) = (whole / "wandb").glob("offline-run-*/run-*.wandb")
    assert all(name.encode() in logged.read_bytes() for name in ("rewards/chosen", "rewards/rejected", "rewards/margins"))

    resumed = tmp_path / "resumed"
    shutil.copytree(whole, resumed, ignore=shutil.ignore_patterns("wandb"))
    shutil.rmtree(resumed / "checkpoints" / "step-000004")
    shutil.rmtree(resumed / "adapter")
    cache = load_file(whole / "reference_logps.safetensors")
    assert cache["train"].shape == (20, 1) and cache["val"].shape == (4, 1)  # 24 unpaired rows, 0.2 held out
    stderr = train(resumed, "trainer.resume=true").stderr
    assert "resumed from" in stderr and f"read from {resumed / 'reference_logps.safetensors'}" in stderr
    a = load_file(whole / "adapter" / "adapter_model.safetensors")
    b = load_file(resumed / "adapter" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    def steps(run):
        return {m["step"]: m for m in read_jsonl(run / "metrics.jsonl") if "lr" in m}

    s_whole, s_resumed = steps(whole), steps(resumed)
    for step in (3, 4):
        for key in ("loss", "kl", "rewards/chosen", "rewards/rejected", "rows"):
            assert s_resumed[step][key] == s_whole[step][key], (step, key)
