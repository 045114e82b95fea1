"""`tunekit eval` on a GGUF file: llama.cpp scores the rows with the torch scorer's figures
(tunekit.infer.gguf), checked row by row against tunekit.infer.score on the trained model
that the GGUF was exported from (f32, so both sides compute the same function in f32)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from _helpers import need_llama_cpp, scaled_tiny_model
from test_taskeval import colour_rows, task_data, train_run  # noqa: F401 (task_data: a fixture)

# ---------------------------------------------------------------- tolerance
# Derived from an f32 rounding-error analysis of the scaled tiny model (2 layers, hidden d = 64,
# MLP 128, 4 heads of 16, prompts < 64 tokens), not from a measurement. Both sides compute the same
# function in f32: f32 GGUF weights (merged: W + BA rounded once more, relative u), llama.cpp's KV
# cache in f32, the fp32 torch model (LoRA unmerged); they differ only in the order and blocking of
# their roundings (u = 2**-24) and in ggml's own exp, SiLU and rope angle formulas, each within a few u.
#  - One stage (a dot product or a sum of n <= 128 terms: hidden 64, MLP 128, <= 63 attended
#    positions) rounded in another order differs by ~ lam * sqrt(n) * u relative (rounding errors as
#    independent; lam = 3 covers the difference of two such roundings): 3 * 11.3 * 6.0e-8 = 2.0e-6.
STAGE = 3 * math.sqrt(128) * 2.0**-24
#  - From the embeddings to the last hidden state h: 2 layers x 13 stages (norm, q/k/v, rope,
#    scores, softmax, AV, o, residual, norm, gate/up, SiLU x up, down, residual) + the final norm =
#    27 stages, their errors adding in quadrature. The two score stages count |s| times: softmax
#    turns an absolute score error |s| * eps into a relative weight error, and |s| <= 16 here (q, k
#    entries ~ N(0, 2^2): std-0.25 weights times an RMS-normed input of norm 8; a score sums 16 of
#    their products and is divided by 4: std 4, 4 sigma = 16).
EPS_H = STAGE * math.sqrt(27 + 2 * 16**2)  # relative error of h: 4.7e-5
#  - log p(t) = z_t - logsumexp(z) with z = E h (tied embeddings; the log-softmax itself is the same
#    torch op on both sides): its change is (E_t - sum_v p_v E_v) . dh, at most
#    2 max|E_v| |h| EPS_H, and for an error dh of random direction 1/sqrt(d) of that.
#    |h| = sqrt(d) * max |final norm weight| (an RMS-normed vector), max |E_v| is read from the model.
#  - A row's figure sums T tokens (its reference answer and the trained tokens inside its prompt),
#    with errors of one sign at worst: tolerance T * per_token (about T * 1e-3 here; an f16 KV cache
#    alone would move these rows by up to 1e-1).


def per_token_tolerance(model) -> float:
    """Bound on the difference of one token's log p between the two sides, from the analysis above."""
    emb = model.get_input_embeddings().weight.detach().float()
    d = emb.shape[1]
    norm = max(float(m.weight.detach().abs().max()) for name, m in model.named_modules() if name.endswith("model.norm"))
    h = math.sqrt(d) * norm  # |h|: RMS-normed, times the final norm's weight
    return 2 * float(emb.norm(dim=1).max()) * h * EPS_H / math.sqrt(d)


# ---------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def lora_run(tiny_model_dir, task_data, tmp_path_factory) -> Path:
    """A short fp32 LoRA run over the scaled tiny model (diverse greedy answers; see _helpers)."""
    need_llama_cpp()  # before training a run that only llama.cpp's tests use
    root = tmp_path_factory.mktemp("gguf-eval")
    scaled = scaled_tiny_model(tiny_model_dir, root / "scaled", seed=1)
    return train_run("lora", scaled, task_data, root / "run", "trainer.eval_samples=0")


@pytest.fixture(scope="module")
def gguf_file(lora_run, tmp_path_factory) -> Path:
    """The run merged (fp32: W + BA, one more rounding per weight) and written by tunekit's GGUF
    writer in f32, as `tunekit export --format gguf --dtype f32` writes it (without the export's
    own checks, which test_export.py covers)."""
    from tunekit.export.gguf import write_gguf
    from tunekit.runs.load import load_tokenizer_for, load_trained
    from tunekit.runs.open import open_source
    from tunekit.methods import get_method

    src = open_source(lora_run)
    out = tmp_path_factory.mktemp("gguf-file") / "run.gguf"
    write_gguf(get_method("lora").merge(load_trained(src)), load_tokenizer_for(src), out, "fp32")
    return out


@pytest.fixture(scope="module")
def trained(lora_run):
    from tunekit.runs.load import load_tokenizer_for, load_trained
    from tunekit.runs.open import open_source

    src = open_source(lora_run)
    return load_trained(src), load_tokenizer_for(src)


def task(tok):
    from tunekit.data import tokenize_rows
    from tunekit.infer.rows import closed_set, task_rows

    rows, _ = task_rows(tokenize_rows(colour_rows(), "chat", "x", tok, 64), tok)
    return rows, closed_set(rows)


class EosAs:
    """The run's tokenizer with another end token: a stop the scaled model does reach."""

    def __init__(self, tok, eos: int):
        self.tok, self.eos_token_id, self.pad_token_id = tok, eos, tok.pad_token_id

    def decode(self, *args, **kwargs):
        return self.tok.decode(*args, **kwargs)


# ---------------------------------------------------------------- scoring
def test_gguf_scores_agree_with_the_torch_scorer_row_by_row(trained, gguf_file):
    from tunekit.infer.gguf import load_gguf, score_rows_gguf
    from tunekit.infer.rows import TaskRow
    from tunekit.infer.score import score_rows

    model, tok = trained
    rows, classes = task(tok)
    assert classes is not None and len(rows) == 36 and any(any(x != -100 for x in r.prompt_labels) for r in rows)
    tol = per_token_tolerance(model)
    assert 1e-4 < tol < 3e-3  # the analysis' figure for this model (see above)
    want = score_rows(model, tok, rows, classes, batch_size=8)
    lm = load_gguf(gguf_file)
    try:
        got = score_rows_gguf(lm, tok, rows, classes, batch_size=8)
        # one row per batch, and all rows in one: each row is computed as alone (no leak between the
        # sequences of a batch, nor between a row's continuations)
        alone = score_rows_gguf(lm, tok, rows, classes, batch_size=1, generate=False)
        together = lm.score_task(rows, classes, tok, batch_size=64, generate=False)  # the export's entry
        # each class answer's log-likelihood, row by row: that class as the reference to score
        per_class = [(score_rows(model, tok, rows_k, None, batch_size=8, generate=False),
                      score_rows_gguf(lm, tok, rows_k, None, batch_size=8, generate=False))
                     for rows_k in ([TaskRow(r.prompt, r.prompt_labels, a, "x") for r in rows] for a in classes.answers)]
    finally:
        lm.close()

    assert len({r.answer for r in want.rows}) > 10  # the scaled model answers differently per row
    assert [r.answer for r in got.rows] == [r.answer for r in want.rows]
    assert [r.exact for r in got.rows] == [r.exact for r in want.rows]
    assert [r.truth for r in got.rows] == [r.truth for r in want.rows]
    for res in (got, alone, together):
        assert [r.tokens for r in res.rows] == [r.tokens for r in want.rows]
        for a, b in zip(res.rows, want.rows):
            assert abs(a.loss_sum - b.loss_sum) <= b.tokens * tol, (a.loss_sum, b.loss_sum)
    for torch_k, gguf_k in per_class:
        for a, b in zip(gguf_k.rows, torch_k.rows):
            assert abs(a.loss_sum - b.loss_sum) <= b.tokens * tol
    # the predicted class is the same wherever the analysis allows no flip: torch's best class ahead
    # of the next by more than both sides' tolerance (every row here)
    loglik = torch.tensor([[-r.loss_sum for r in t.rows] for t, _ in per_class]).T  # (rows, classes)
    bound = torch.tensor([[r.tokens * tol for r in t.rows] for t, _ in per_class]).T
    top2 = loglik.topk(2, dim=1)
    assert bool((top2.values[:, 0] - top2.values[:, 1] > 2 * bound.max(dim=1).values).all())
    assert [r.predicted for r in got.rows] == [r.predicted for r in want.rows] == loglik.argmax(1).tolist()
    assert [r.predicted for r in alone.rows] == [r.predicted for r in together.rows] == [r.predicted for r in want.rows]
    for key in ("rows", "exact_match", "accuracy", "per_class", "majority"):
        assert got.metrics[key] == want.metrics[key]
    assert got.metrics["loss"] == pytest.approx(want.metrics["loss"], abs=tol)  # a mean over tokens: tol per token


def test_gguf_greedy_stops_and_budget_as_the_torch_scorer(trained, gguf_file):
    """Stop tokens and the greedy budget: the scaled model never emits its EOS, so an end token it
    does emit (the 3rd token of row 0's answer) stands in for it on both sides."""
    from test_taskeval import oracle_greedy
    from tunekit.infer.decode import stop_token_ids
    from tunekit.infer.gguf import score_rows_gguf
    from tunekit.infer.score import score_rows

    model, tok = trained
    rows, _ = task(tok)
    rows = rows[:12]
    ids = oracle_greedy(model, rows[0].prompt, 6, stop_token_ids(model, tok))
    assert len(ids) == 6  # no EOS of its own within 6 tokens
    eos = EosAs(tok, ids[2])
    cut = ids[:ids.index(ids[2]) + 1]
    for budget in (None, 2, 9):
        want = score_rows(model, eos, rows, None, batch_size=5, max_new_tokens=budget)
        got = score_rows_gguf(gguf_file, eos, rows, None, batch_size=5, max_new_tokens=budget)  # a path: loaded here
        assert [r.answer for r in got.rows] == [r.answer for r in want.rows]
        assert got.rows[0].answer == tok.decode(cut[:budget or len(cut)], skip_special_tokens=True).strip()


# ---------------------------------------------------------------- the command
def test_eval_cli_scores_a_gguf_file_as_its_run(lora_run, gguf_file, task_data, trained, tmp_path, capsys):
    """`tunekit eval X.gguf`: the table and X.gguf.eval.json, the same shape and figures as the run's
    own evaluation on the same rows (the GGUF's own tokenizer makes the same rows)."""
    from tunekit.commands.eval import main

    main([str(gguf_file), "--data", str(task_data), "--max-rows", "15", "--batch-size", "4", "--device", "cpu"])
    printed = capsys.readouterr().out
    out = Path(f"{gguf_file}.eval.json")
    for line in ("response loss", "exact match", "accuracy (likelihood)", "per class", "answers (trained):",
                 f"wrote {out}"):
        assert line in printed
    report = json.loads(out.read_text())
    assert "GGUF file (its own tokenizer), scored by llama.cpp on the CPU" in report["source"]
    main([str(lora_run), "--data", str(task_data), "--max-rows", "15", "--out", str(tmp_path / "run.json")])
    capsys.readouterr()
    run_report = json.loads((tmp_path / "run.json").read_text())
    assert set(report) == set(run_report) and set(report["trained"]) == set(run_report["trained"])
    assert report["rows"] == run_report["rows"] == 15
    assert [a["answer"] for a in report["answers"]] == [a["answer"] for a in run_report["answers"]]
    assert [a["predicted"] for a in report["answers"]] == [a["predicted"] for a in run_report["answers"]]
    assert report["trained"]["accuracy"] == run_report["trained"]["accuracy"]
    # a mean over tokens: within the per-token tolerance
    assert report["trained"]["loss"] == pytest.approx(run_report["trained"]["loss"], abs=per_token_tolerance(trained[0]))


def test_bad_gguf_sources_are_one_clear_error(gguf_file, tmp_path, monkeypatch):
    import tunekit.infer.llamacpp as lc
    from tunekit import TunekitError
    from tunekit.commands.generate import main as generate_main
    from tunekit.commands.eval import main

    data = gguf_file.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) // 3])
    (tmp_path / "text.gguf").write_text("not a model\n")
    cases = [
        ([str(tmp_path / "cut.gguf")], f"{tmp_path / 'cut.gguf'}: llama.cpp cannot load this GGUF file (truncated or damaged"),
        ([str(tmp_path / "text.gguf")], f"RUN: {tmp_path / 'text.gguf'} is not a GGUF file"),
        ([str(tmp_path / "none.gguf")], f"RUN: no such file: {tmp_path / 'none.gguf'}"),
        ([str(gguf_file), "--base"], f"--base: the base of the GGUF file {gguf_file} is unknown; name it with --base-model DIR"),
        ([str(gguf_file), "--quantize", "nf4"], "--quantize: "),
    ]
    for args, message in cases:
        with pytest.raises(TunekitError) as err:
            main(args)
        assert message in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(TunekitError, match="a GGUF file runs in llama.cpp, which only `tunekit eval` drives"):
        generate_main(["--adapter", str(gguf_file), "--prompt", "Hi"])
    monkeypatch.setattr(lc, "unavailable", lambda: "llama-cpp-python is not usable here (ImportError: test)")
    with pytest.raises(TunekitError, match=r"is scored by llama.cpp, and llama-cpp-python is not usable here .*setup.sh"):
        main([str(gguf_file)])
    assert not list(tmp_path.glob("*.eval.json"))
