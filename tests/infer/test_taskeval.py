"""Task evaluation (`tunekit eval`), training-time samples / task metric, keep_best.

The figures are checked against independent oracles on a tiny fp32 model whose weights are scaled
up so that every context gives a different greedy answer (see tests/infer/test_generate.py):
  - response loss == the trainer's own held-out loss on the same rows (right-padded full forward),
  - class scores == log p(answer | prompt) from a plain forward of prompt + answer, row by row,
  - exact match == a no-cache greedy loop over the full sequence, row by row, normalised.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml
import torch

from _helpers import read_jsonl, run_cli, scaled_tiny_model

CPU = torch.device("cpu")
COLOURS = ["red", "green", "blue"]


def colour_rows(n: int = 45) -> list[dict]:
    """A 3-class chat task; every 4th row is two-turn (an earlier trained reply inside the prompt)."""
    rows = []
    for i in range(n):
        c = COLOURS[i % 3]
        msgs = [{"role": "user", "content": f"Item {i} is {c}. Which colour is item {i}?"},
                {"role": "assistant", "content": c.capitalize() + "." if i % 5 == 0 else c}]
        if i % 4 == 0:
            msgs = [{"role": "user", "content": f"Hello number {i}"}, {"role": "assistant", "content": "Hello!"}] + msgs
        rows.append({"messages": msgs})
    return rows


@pytest.fixture(scope="module")
def task_data(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("task") / "colours.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in colour_rows()))
    return out


@pytest.fixture(scope="module")
def scaled_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model with std-0.25 projections and unit embeddings, fp32: diverse greedy answers."""
    return scaled_tiny_model(tiny_model_dir, tmp_path_factory.mktemp("scaled-tiny-eval"), seed=1)


def train_run(recipe: str, model_dir: Path, data: Path, out: Path, *extra: str) -> Path:
    """A short fp32 run in this process (the CLI path is covered elsewhere; this keeps the file fast)."""
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    from tunekit.commands.compose import register_schema
    from tunekit.train.checks import validate
    from tunekit.train.loop import TrainRecipe

    register_schema()
    over = [f"recipe={recipe}", f"model.path={model_dir}", f"data.path={data}", f"output_dir={out}",
            "model.dtype=fp32", "trainer.max_steps=2", "trainer.micro_batch_size=4", "trainer.grad_accum=2",
            "trainer.eval_every=2", "trainer.save_every=2", "trainer.warmup_steps=1", "trainer.lr=1e-3",
            "data.val_fraction=0.2", "data.max_seq_len=128", *extra]
    with initialize_config_module(config_module="tunekit_recipes", version_base="1.3"):
        cfg = OmegaConf.to_object(compose(config_name="train", overrides=over))
    validate(cfg)
    r = TrainRecipe(cfg, out)
    r.setup()
    r.train()
    r.cleanup()
    return out


RECIPES = ["lora", "qlora", "adapter", "bitfit", "prompt_tuning", "ia3", "full"]


@pytest.fixture(scope="module")
def runs(scaled_model_dir, task_data, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("eval-runs")
    out = {}
    for recipe in RECIPES:
        out[recipe] = train_run(recipe, scaled_model_dir, task_data, root / recipe, "trainer.eval_samples=2")
    return out


def oracle_greedy(model, ids: list[int], n: int, stop: list[int]) -> list[int]:
    """Greedy decoding by re-running the whole sequence each step (no cache, no padding)."""
    new = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(input_ids=torch.tensor([ids + new])).logits[0, -1]
            new.append(int(logits.argmax()))
            if new[-1] in stop:
                break
    return new


def oracle_logp(model, prompt: list[int], answer: list[int]) -> float:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + answer])).logits[0].float()
    logp = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
    return float(logp.gather(1, torch.tensor(answer)[:, None]).sum())


# ------------------------------------------------------------------ scoring vs oracles
@pytest.fixture(scope="module")
def lora_model(runs):
    from tunekit.runs.load import load_tokenizer_for, load_trained
    from tunekit.runs.open import open_source

    src = open_source(runs["lora"])
    return load_trained(src), load_tokenizer_for(src)


def test_scores_match_row_by_row_oracles(lora_model, task_data):
    from tunekit.data import tokenize_rows
    from tunekit.infer.decode import stop_token_ids
    from tunekit.infer.rows import TaskRow, closed_set, normalize, task_rows
    from tunekit.infer.score import score_rows

    model, tok = lora_model
    rows, _ = task_rows(tokenize_rows(colour_rows(), "chat", "x", tok, 64), tok)
    rows = rows[:10]
    classes = closed_set(rows)
    stop = stop_token_ids(model, tok)
    answers = [oracle_greedy(model, r.prompt, 6, stop) for r in rows]
    texts = [tok.decode(a, skip_special_tokens=True).strip() for a in answers]
    assert len(set(texts)) > 3  # the scaled model answers differently per row
    # Make the references of even rows the model's own answer (re-cased, punctuated): exact match must
    # be 1 there and 0 elsewhere; classes stay those of the original references.
    probe = [TaskRow(r.prompt, r.prompt_labels, r.answer, f" {t.upper()}!" if i % 2 == 0 else r.reference)
             for i, (r, t) in enumerate(zip(rows, texts))]
    result = score_rows(model, tok, probe, None, batch_size=3, max_new_tokens=6)
    assert [r.answer for r in result.rows] == texts
    assert [r.exact for r in result.rows] == [i % 2 == 0 or normalize(t) == normalize(r.reference)
                                              for i, (r, t) in enumerate(zip(rows, texts))]

    result = score_rows(model, tok, rows, classes, batch_size=4)
    for r, res in zip(rows, result.rows):
        scores = [oracle_logp(model, r.prompt, a) for a in classes.answers]
        # fp32, sums of <= 3 log-probs: batched/cached vs plain differ by ~1e-6 per logit
        assert res.predicted == max(range(3), key=scores.__getitem__)
        assert res.truth == classes.index(r.reference)
    m = result.metrics
    assert m["accuracy"] == sum(r.predicted == r.truth for r in result.rows) / len(rows)
    assert sum(v["rows"] for v in m["per_class"].values()) == len(rows)
    assert sum(v["predicted"] for v in m["per_class"].values()) == len(rows)


def test_eval_cli_loss_equals_training_val_loss(runs, capsys):
    """The response loss of `tunekit eval` is the trainer's held-out loss on the same rows (two-turn
    rows included): base == step 0, trained == the last evaluation."""
    from tunekit.commands.eval import main

    run = runs["lora"]
    main([str(run), "--base", "--batch-size", "3"])
    printed = capsys.readouterr().out
    report = json.loads((run / "eval.json").read_text())
    summary = json.loads((run / "summary.json").read_text())
    # fp32: per-token losses agree to ~1e-6 between the padded and the cached computations
    assert report["trained"]["loss"] == pytest.approx(summary["last_val_loss"], abs=1e-4)
    assert report["base"]["loss"] == pytest.approx(summary["first_val_loss"], abs=1e-4)
    assert report["trained"]["ppl"] == pytest.approx(math.exp(report["trained"]["loss"]))
    assert report["difference"]["loss"] == pytest.approx(report["trained"]["loss"] - report["base"]["loss"])
    assert report["classes"] == ["blue", "green", "red"] and report["rows"] == 9
    assert len(report["answers"]) == 9 and {"prompt", "reference", "answer", "exact", "predicted",
                                            "base_answer", "base_predicted"} <= set(report["answers"][0])
    for line in ("response loss", "exact match", "accuracy (likelihood)", "per class", "wrote"):
        assert line in printed


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_evaluates_and_generates(recipe, runs, capsys):
    """eval and generate work on the output of every recipe, and generate's answer is the model's
    own greedy answer (a no-cache loop over the trained model as export rebuilds it)."""
    from tunekit.infer.decode import encode_prompts, stop_token_ids
    from tunekit.commands.generate import main as generate_main
    from tunekit.runs.load import load_tokenizer_for, load_trained
    from tunekit.runs.open import open_source
    from tunekit.commands.eval import main as eval_main

    run = runs[recipe]
    eval_main([str(run), "--base", "--json", "--out", str(run / "e.json")])
    report = json.loads(capsys.readouterr().out)
    summary = json.loads((run / "summary.json").read_text())
    assert report["trained"]["loss"] == pytest.approx(summary["last_val_loss"], abs=1e-4)
    started = yaml.safe_load((run / "config.yaml").read_text())["method"].get("init")
    assert (started == "loftq") == (recipe == "qlora")  # the qlora recipe's auto start, on this small run
    if recipe != "prompt_tuning" and started != "loftq":  # the identity at step 0; a soft prompt and LoftQ are not
        assert report["base"]["loss"] == pytest.approx(summary["first_val_loss"], abs=1e-4)

    prompt = "Item 7 is green. Which colour is item 7?"
    generate_main(["--adapter", str(run / "adapter"), "--prompt", prompt, "--max-new-tokens", "5", "--json"])
    got = json.loads(capsys.readouterr().out.strip())["completion"]
    src = open_source(run)
    model, tok = load_trained(src), load_tokenizer_for(src)
    ids = encode_prompts(tok, [prompt])[0]
    assert got == tok.decode(oracle_greedy(model, ids, 5, stop_token_ids(model, tok)), skip_special_tokens=True)


@pytest.mark.parametrize("recipe", [r for r in RECIPES if r != "full"])
def test_a_standalone_adapter_folder_opens_as_the_run_it_came_from(recipe, runs, scaled_model_dir, tmp_path):
    """An adapter folder copied out of its run is recognised by the method that wrote it (each method
    names its adapter kinds) and rebuilds the same trained model: equal logits, bit for bit, since
    both load the same stored tensors into the same structure over the same base."""
    import shutil

    from tunekit.runs.load import load_trained
    from tunekit.runs.open import open_source

    copy = tmp_path / "copy"
    shutil.copytree(runs[recipe] / "adapter", copy)
    inside = open_source(runs[recipe])
    alone = open_source(copy, model=str(scaled_model_dir), quantize=inside.quantize,
                        dtype={torch.bfloat16: "bf16", torch.float32: "fp32"}[inside.dtype])
    assert alone.kind == "adapter" and alone.method == inside.method
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    with torch.no_grad():
        want = load_trained(inside)(input_ids=ids).logits
        got = load_trained(alone)(input_ids=ids).logits
    assert torch.equal(got, want)


def test_merged_folder_evaluates_with_its_base(runs, scaled_model_dir, tmp_path, capsys):
    from tunekit import TunekitError
    from tunekit.runs.load import load_tokenizer_for, load_trained
    from tunekit.runs.open import open_source
    from tunekit.methods import get_method
    from tunekit.commands.eval import main

    r = open_source(runs["lora"])
    merged = get_method("lora").merge(load_trained(r))
    merged.save_pretrained(tmp_path / "merged")
    load_tokenizer_for(r).save_pretrained(tmp_path / "merged")
    with pytest.raises(TunekitError, match="--base: the base of the model folder .* --base-model DIR"):
        main([str(tmp_path / "merged"), "--base"])
    main([str(tmp_path / "merged"), "--base", "--base-model", str(scaled_model_dir), "--dtype", "fp32",
          "--data", str(_val_file(runs["lora"], tmp_path)), "--json"])
    merged_report = json.loads(capsys.readouterr().out)
    main([str(runs["lora"]), "--json", "--out", str(tmp_path / "run.json")])
    run_report = json.loads(capsys.readouterr().out)
    # the same 9 rows: a merged LoRA (fp32) scores as the adapter does, to fp32 rounding
    assert merged_report["trained"]["loss"] == pytest.approx(run_report["trained"]["loss"], abs=1e-4)
    assert [a["answer"] for a in merged_report["answers"]] == [a["answer"] for a in run_report["answers"]]


def test_a_full_fine_tune_opens_as_its_run_and_exports_merged(runs, tmp_path):
    """A full fine-tune's adapter/ is a whole model folder: it opens as its run (same base, same
    held-out split) for export as for eval; merged (fp32) it is the trained model, and --format
    adapter, which has no adapter to ship, is one line before anything loads."""
    from tunekit import TunekitError
    from tunekit.commands.export import export
    from tunekit.runs.open import open_source

    src = open_source(runs["full"])
    assert src.kind == "run" and src.method == "full" and src.adapter_dir == runs["full"] / "adapter"
    with pytest.raises(TunekitError, match=r"--format adapter: .* trained every weight .* use --format merged"):
        export(runs["full"], "adapter", tmp_path / "a")
    assert not (tmp_path / "a").exists()
    report = export(runs["full"], "merged", tmp_path / "m", dtype="fp32", eval_batches=1, task_rows=0)
    # The fp32 export holds the trained fp32 weights bit for bit; trained and reloaded models can
    # differ only in summation order: fp32 rounding, relative ~1e-6 over 64-wide dot products, of
    # logits up to ~100 here (std-0.25 projections) gives differences <= 1e-4, and the KL is second
    # order in them (~1e-8), far below 1e-6.
    assert report["accepted"] and report["fidelity"]["kl_mean"] < 1e-6, report["fidelity"]


def _val_file(run: Path, tmp_path: Path) -> Path:
    """The run's held-out rows as a file (the split tunekit computed), for --data."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(run / "config.yaml")
    rows = read_jsonl(Path(cfg.data.path))
    import random

    order = list(range(len(rows)))
    random.Random(cfg.seed).shuffle(order)
    n_val = max(1, int(len(rows) * cfg.data.val_fraction))
    out = tmp_path / "val.jsonl"
    out.write_text("".join(json.dumps(rows[i]) + "\n" for i in sorted(order[:n_val])))
    return out


# ------------------------------------------------------------------ generate: mixing, chat
@pytest.fixture(scope="module")
def lora_b(scaled_model_dir, task_data, tmp_path_factory) -> Path:
    """A second LoRA run over the same base (another seed and rate)."""
    return train_run("lora", scaled_model_dir, task_data, tmp_path_factory.mktemp("lora-b") / "run", "seed=3",
                     "trainer.lr=3e-2", "trainer.eval_samples=0")


def test_mixed_lora_batch_equals_each_row_alone(runs, lora_b, capsys):
    """Rows of one batch use LoRA adapter A, adapter B, or none, over one base (peft adapter_names):
    each row's answer is the one that model gives alone."""
    from tunekit.infer.decode import encode_prompts, stop_token_ids
    from tunekit.commands.generate import main
    from tunekit.runs.load import load_base, load_tokenizer_for, load_trained
    from tunekit.runs.open import open_source

    a, b = runs["lora"], lora_b
    prompts = ["Item 4 is green. Which colour is item 4?"] * 2 + ["Hi"]
    main(["--adapter", str(a), "--prompt", prompts[0], "--adapter", str(b / "adapter"), "--prompt", prompts[1],
          "--adapter", "none", "--prompt", prompts[2], "--max-new-tokens", "6", "--json"])
    got = [json.loads(line)["completion"] for line in capsys.readouterr().out.splitlines()]
    src_a, src_b = open_source(a), open_source(b)
    tok = load_tokenizer_for(src_a)
    models = [load_trained(src_a), load_trained(src_b), load_base(src_a)]
    want = []
    for model, prompt in zip(models, prompts):
        ids = encode_prompts(tok, [prompt])[0]
        want.append(tok.decode(oracle_greedy(model, ids, 6, stop_token_ids(model, tok)), skip_special_tokens=True))
    assert got == want
    assert want[0] != want[1]  # A and B answer the same prompt differently: each row ran its own adapter


@pytest.mark.parametrize("mix, message", [
    (("adapter", "lora"), "--adapter: one batch cannot mix .*bottleneck|--adapter: one batch cannot mix .*adapter"),
    (("qlora", "lora"), "--adapter: rows use adapters trained over different bases"),
    (("bitfit", None), "--adapter: one batch cannot mix .*bitfit"),
])
def test_unmixable_batches_are_refused_in_one_line(mix, message, runs):
    from tunekit import TunekitError
    from tunekit.commands.generate import main

    args = []
    for recipe in mix:
        args += ["--adapter", str(runs[recipe]) if recipe else "none", "--prompt", "Hi"]
    with pytest.raises(TunekitError, match=message) as err:
        main(args)
    assert "\n" not in str(err.value)


def test_chat_through_the_cli_streams_with_history(runs, tmp_path):
    """`tunekit chat RUN` with piped input: each reply is the model's greedy answer to the whole
    conversation so far (prompt tuning: the soft prompt first); /reset starts over."""
    from tunekit.infer.decode import encode_messages, stop_token_ids
    from tunekit.runs.load import load_tokenizer_for, load_trained
    from tunekit.runs.open import open_source

    run = runs["prompt_tuning"]
    r = run_cli(["chat", str(run), "--max-new-tokens", "5"], tmp_path, input="Hi\nWhat colour?\n/reset\nHi\n")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "chatting with" in r.stderr and "history cleared" in r.stderr
    src = open_source(run)
    model, tok = load_trained(src), load_tokenizer_for(src)
    stop = stop_token_ids(model.base, tok)

    def reply(messages):
        ids = oracle_greedy(model, encode_messages(tok, messages), 5, stop)
        return tok.decode(ids, skip_special_tokens=True).lstrip()

    first = reply([{"role": "user", "content": "Hi"}])
    second = reply([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": first.strip()},
                    {"role": "user", "content": "What colour?"}])
    assert r.stdout == first + "\n" + second + "\n" + first + "\n"


# ------------------------------------------------------------------ during training
def test_training_shows_samples_and_the_task_metric(tiny_model_dir, task_data, tmp_path, capsys):
    """Sample answers and the task metric at every evaluation: printed, in metrics.jsonl and in a
    second panel of the loss plot."""
    from PIL import Image

    out = train_run("lora", tiny_model_dir, task_data, tmp_path / "run", "trainer.eval_every=1",
                    "trainer.eval_task=true", "trainer.eval_samples=2", "tracker=wandb")  # offline (conftest)
    printed = capsys.readouterr().out  # the progress bar's writes (evaluations, samples) go to stdout
    assert "accuracy" in printed and "exact" in printed and "on 9 rows" in printed
    assert "'Item 1 is green. Which colour is item 1?' -> " in printed and "(ref 'green')" in printed
    rows = read_jsonl(out / "metrics.jsonl")
    evals = [x for x in rows if "val_loss" in x]
    assert [x["step"] for x in evals] == [0, 1, 2]
    assert all({"val_accuracy", "val_exact_match", "val_task_rows"} <= set(x) for x in evals)
    samples = [x for x in rows if "samples" in x]
    assert [x["step"] for x in samples] == [0, 1, 2] and all(len(x["samples"]) == 2 for x in samples)
    assert [s["reference"] for s in samples[0]["samples"]] == ["Red.", "green"]
    assert samples[0]["samples"][0]["prompt"] == "Item 0 is red. Which colour is item 0?"  # the last user turn
    assert Image.open(out / "loss_curve.png").size == (1200, 400)
    tables = sorted((out / "wandb").glob("offline-run-*/files/media/table/samples_*.table.json"))
    assert len(tables) == 3  # one W&B table per evaluation
    table = json.loads(tables[0].read_text())
    assert table["columns"] == ["step", "prompt", "answer", "reference", "exact"] and len(table["data"]) == 2


def test_keep_best_exports_the_best_evaluation(tiny_model_dir, tmp_path):
    """Trained to answer "red", evaluated on rows answering "green green green green": the held-out
    loss rises from step 0, so keep_best must export the untrained LoRA (B = 0) as adapter/ while
    the last checkpoint keeps the trained one."""
    from safetensors.torch import load_file

    def rows(answer, ids):
        return "".join(json.dumps({"messages": [{"role": "user", "content": f"Which colour is item {i}?"},
                                                {"role": "assistant", "content": answer}]}) + "\n" for i in ids)

    (tmp_path / "red.jsonl").write_text(rows("red", range(32)))
    (tmp_path / "green.jsonl").write_text(rows("green green green green", range(32, 40)))
    out = train_run("lora", tiny_model_dir, tmp_path / "red.jsonl", tmp_path / "run", f"data.val_path={tmp_path / 'green.jsonl'}",
                    "trainer.eval_every=1", "trainer.save_every=1", "trainer.lr=1e-2", "trainer.warmup_steps=0",
                    "trainer.keep_best=true", "trainer.eval_samples=0")
    losses = [x["val_loss"] for x in read_jsonl(out / "metrics.jsonl") if "val_loss" in x]
    assert losses[0] < min(losses[1:])
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["best_step"], summary["best_metric"]) == (0, "val_loss")
    final = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    last = load_file(str(out / "checkpoints" / "step-000002" / "adapter" / "adapter_model.safetensors"))
    b_keys = [k for k in final if "lora_B" in k]
    assert b_keys and all(final[k].abs().max() == 0 for k in b_keys)
    assert any(last[k].abs().max() > 0 for k in b_keys)
    assert (out / "adapter" / "tokenizer.json").is_file()


@pytest.mark.parametrize("recipe", ["lora", "adapter", "bitfit", "prompt_tuning"])
def test_adapter_folder_outside_its_run(recipe, runs, scaled_model_dir, tmp_path, capsys):
    """An adapter folder copied out of its run loads over --model from its own config (peft's
    loader for LoRA, the method's for the others): the same logits as the run's model, not the base's."""
    import shutil

    from tunekit.infer.decode import encode_prompts
    from tunekit.commands.generate import main
    from tunekit.runs.load import load_base, load_tokenizer_for, load_trained
    from tunekit.runs.open import open_source

    folder = shutil.copytree(runs[recipe] / "adapter", tmp_path / "moved")
    moved, in_run = open_source(folder, model=str(scaled_model_dir), dtype="fp32"), open_source(runs[recipe])
    assert moved.kind == "adapter" and moved.method == recipe and in_run.kind == "run"
    tok = load_tokenizer_for(moved)
    ids = torch.tensor([encode_prompts(tok, ["Item 2 is blue. Which colour is item 2?"])[0]])

    def logits(model):
        with torch.no_grad():
            return model(input_ids=ids).logits.float()

    got, want, base = logits(load_trained(moved)), logits(load_trained(in_run)), logits(load_base(in_run))
    assert torch.allclose(got, want, atol=1e-5)  # fp32, identical weights and computation order
    assert (got - base).abs().max() > 1e-4  # the trained part is there
    main(["--adapter", str(folder), "--model", str(scaled_model_dir), "--dtype", "fp32", "--prompt", "Hi",
          "--max-new-tokens", "3", "--json"])
    assert "completion" in json.loads(capsys.readouterr().out)


def test_shared_prefix_pass_equals_the_plain_batch(lora_model):
    """Rows that share a templated start run it once (batch 1, cache repeated): same logits, same
    hidden states at every token, same greedy answers as the plain left-padded batch (fp32)."""
    from tunekit.infer.decode import encode_prompts, greedy, pad_token_id, prefill, shared_prefix_len, stop_token_ids

    model, tok = lora_model
    rows = encode_prompts(tok, ["Item 3 is red. Which colour?", "Hi", "Item 12 is blue. Which colour is item 12?"])
    shared = shared_prefix_len(rows, [None] * 3)
    assert shared >= 16  # SmolLM's template puts a default system prompt first
    a = prefill(model, rows, keep_hidden=True, share_prefix=True)
    b = prefill(model, rows, keep_hidden=True, share_prefix=False)
    assert a.shared == shared and b.shared == 0
    # fp32: the two passes add the same terms in another blocking (attention over a cache vs in one
    # pass): relative error ~1e-6 on logits up to ~1e2 in this scaled model
    assert torch.allclose(a.last_logits, b.last_logits, atol=1e-4, rtol=1e-5)
    for i, r in enumerate(rows):
        ha, hb = a.hidden[i, a.token_slots(i, len(r))], b.hidden[i, b.token_slots(i, len(r))]
        assert torch.allclose(ha, hb, atol=1e-4, rtol=1e-5)
    stop, pad = stop_token_ids(model, tok), pad_token_id(tok)
    assert greedy(model, a, 6, stop, pad) == greedy(model, b, 6, stop, pad)


@pytest.mark.parametrize("args, message", [
    (["{tmp}/missing"], "RUN: no such folder: {tmp}/missing"),
    (["{tmp}/empty"], "RUN: {tmp}/empty is neither a tunekit run (config.yaml), an adapter folder"),
    (["{run}", "--data", "{tmp}/nope.jsonl"], "--data: file not found: {tmp}/nope.jsonl"),
    (["{run}", "--batch-size", "0"], "--batch-size: must be > 0, got 0"),
    (["{run}", "--data", "{tmp}/text.jsonl"], "no held-out row has a prompt and a reply to score"),
])
def test_eval_bad_input_is_one_clear_error(args, message, runs, tmp_path):
    from tunekit import TunekitError
    from tunekit.commands.eval import main

    (tmp_path / "empty").mkdir()
    (tmp_path / "text.jsonl").write_text(json.dumps({"text": "plain text only"}) + "\n")
    fill = {"tmp": tmp_path, "run": runs["lora"]}
    with pytest.raises(TunekitError) as err:
        main([a.format(**fill) for a in args])
    assert message.format(**fill) in str(err.value) and "\n" not in str(err.value)


# ---------------------------------------------------------------- where the commands run
GIB = 2**30
FAKE_GPUS = {"sm_80": ((8, 0), "NVIDIA A100-SXM4-80GB", torch.bfloat16),
             "sm_75": ((7, 5), "Tesla T4", torch.float16)}  # no bf16 below sm_80: fp16 tensor cores


@pytest.fixture
def fake_gpu(monkeypatch):
    """One GPU with the given facts and free memory, as far as tunekit's device decisions can tell
    (this machine has none). Models still load on the CPU: a spy on the loader records the device
    and dtype tunekit asked for, then loads there instead."""
    import tunekit.device.facts as dev
    import tunekit.model as model_pkg
    from tunekit.device.facts import DeviceFacts

    loads = []

    def install(capability, name, free):
        facts = DeviceFacts("cuda", 0, capability, name, 24 * GIB)
        real_probe, real_free, real_load = dev.probe, dev.available_memory_bytes, model_pkg.load_base_model
        monkeypatch.setattr(dev, "cuda_device_count", lambda: 1)
        monkeypatch.setattr(dev, "probe", lambda d: facts if torch.device(d).type == "cuda" else real_probe(d))
        monkeypatch.setattr(dev, "available_memory_bytes",
                            lambda d: free if torch.device(d).type == "cuda" else real_free(d))

        def load_spy(path, quantize, dtype, device, *a, **k):
            loads.append((str(device), dtype))
            return real_load(path, quantize, dtype, CPU, *a, **k)

        monkeypatch.setattr(model_pkg, "load_base_model", load_spy)
        return loads

    return install


def auto_dtype_run(run: Path, tmp_path: Path) -> Path:
    """A copy of a finished run as if it had trained with model.dtype=auto (the default)."""
    import shutil

    copy = tmp_path / run.name
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("checkpoints"))
    text = (copy / "config.yaml").read_text()
    assert "dtype: fp32" in text
    (copy / "config.yaml").write_text(text.replace("dtype: fp32", "dtype: auto", 1))
    return copy


@pytest.mark.parametrize("gpu", list(FAKE_GPUS))
def test_eval_generate_and_chat_run_on_the_gpu_in_its_dtype(gpu, runs, fake_gpu, tmp_path, capsys):
    import io

    from tunekit.commands.chat import main as chat_main
    from tunekit.commands.generate import main as generate_main
    from tunekit.commands.eval import main as eval_main

    capability, name, dtype = FAKE_GPUS[gpu]
    loads = fake_gpu(capability, name, free=40 * GIB)
    run = auto_dtype_run(runs["lora"], tmp_path)
    eval_main([str(run), "--base", "--max-rows", "2", "--no-generate", "--out", str(tmp_path / "e.json")])
    report = json.loads((tmp_path / "e.json").read_text())
    assert f"on cuda:0 ({name}, sm_{capability[0]}{capability[1]}" in report["source"]
    assert loads == [("cuda:0", dtype)] * 2  # the trained model, then the base for --base
    generate_main(["--adapter", str(run), "--prompt", "Hi", "--max-new-tokens", "2"])
    chat_main([str(run), "--max-new-tokens", "2"], stdin=io.StringIO("Hi\n"), stdout=io.StringIO())
    assert loads == [("cuda:0", dtype)] * 4
    loads.clear()
    eval_main([str(run), "--device", "cpu", "--max-rows", "2", "--no-generate", "--out", str(tmp_path / "e.json")])
    from tunekit.device import facts as dev

    assert loads == [("cpu", dev.compute_dtype("auto", dev.probe(CPU)))]


def test_commands_refuse_a_gpu_too_small_before_loading(runs, fake_gpu, tmp_path):
    from tunekit import TunekitError
    from tunekit.commands.export import export
    from tunekit.commands.generate import main as generate_main
    from tunekit.commands.eval import main as eval_main

    loads = fake_gpu((8, 0), "NVIDIA A10G", free=2 * 2**20)  # 2 MiB free: less than the tiny model's weights
    run = runs["lora"]
    with pytest.raises(TunekitError, match=r"tunekit eval needs about .* on cuda:0 \(NVIDIA A10G.*--device cpu"):
        eval_main([str(run), "--max-rows", "2"])
    with pytest.raises(TunekitError, match=r"tunekit generate needs about .*--device cpu"):
        generate_main(["--adapter", str(run), "--prompt", "Hi"])
    with pytest.raises(TunekitError, match=r"tunekit export needs about .* on cuda:0 .*--device cpu"):
        export(run, "merged", tmp_path / "m")
    assert loads == [] and not (tmp_path / "m").exists()


def test_a_device_this_machine_lacks_is_one_error(runs):
    from tunekit import TunekitError
    from tunekit.commands.eval import main as eval_main

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(TunekitError, match="--device cuda: this process sees no CUDA GPU"):
        eval_main([str(runs["lora"]), "--device", "cuda"])
    with pytest.raises(TunekitError, match="--device: unknown device 'tpu'"):
        eval_main([str(runs["lora"]), "--device", "tpu"])
