"""recipe=distill through the real CLI: DistilBERT-style student, teacher checks, KL going down."""

from __future__ import annotations

import json
import shutil

import pytest
from transformers import AutoConfig, AutoTokenizer

from _helpers import read_jsonl, run_cli, tiny_args
from tunekit.model.student import kept_layers


def test_kept_layers():
    assert kept_layers(30, 2) == list(range(0, 30, 2)) and len(kept_layers(30, 2)) == 15
    assert kept_layers(5, 3) == [0, 3]


def test_distill_lowers_kl_to_teacher(tiny_model_dir, tiny_data, tmp_path):
    out = tmp_path / "distill"
    args = tiny_args(tiny_model_dir, tiny_data, out, f"distill.teacher={tiny_model_dir}", "distill.alpha=0.0",
                     "trainer.lr=1e-2", "trainer.max_steps=4", "distill.chunk_size=7")
    r = run_cli(["train", "recipe=distill", *args], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    # the student is the teacher with every 2nd layer kept, saved as a plain HF model
    student = AutoConfig.from_pretrained(out / "student_base")
    assert student.num_hidden_layers == 1 and AutoConfig.from_pretrained(tiny_model_dir).num_hidden_layers == 2
    assert json.loads((out / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] == str(
        out / "student_base")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["first_val_kl"] > 0 and summary["last_val_kl"] < summary["first_val_kl"]
    assert {"first_val_ce", "last_val_ce"} <= set(summary)
    assert summary["precision"]["observed"]["trained"] == ["fp32"]
    evals = [row for row in read_jsonl(out / "metrics.jsonl") if "val_kl" in row]
    assert [row["step"] for row in evals] == [0, 2, 4]
    assert "val kl" in r.stderr and "teacher" in r.stderr
    # eval and export open the run over the student it trained (out/student_base), not over model.path
    # (the default model, whose adapter tensors this run does not hold)
    r = run_cli(["eval", str(out), "--base"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    scored = json.loads((out / "eval.json").read_text())
    assert scored["source"].startswith(f"{out}: run (distill: lora) over {out / 'student_base'} ")
    # the same held-out rows and model as the trainer's last evaluation; the two differ in batching and
    # padding only: fp32 sums in another order, and the bf16 logits of rows padded differently rounding
    # to neighbouring values (|dz| <= 2^-8 |z|, |z| < 1 for this std-0.02 model): far under 1e-2 a token
    assert abs(scored["trained"]["loss"] - summary["last_val_ce"]) < 1e-2
    assert abs(scored["base"]["loss"] - summary["first_val_ce"]) < 1e-2  # step 0: the student, LoRA B = 0
    r = run_cli(["export", str(out), "--format", "merged", "--out", str(tmp_path / "merged"), "--eval-batches", "1",
                 "--task-rows", "0"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert AutoConfig.from_pretrained(tmp_path / "merged").num_hidden_layers == 1


def test_teacher_with_another_vocabulary_is_one_clear_error(tiny_model_dir, tiny_data, tmp_path):
    other = tmp_path / "other-teacher"
    shutil.copytree(tiny_model_dir, other)
    tok = AutoTokenizer.from_pretrained(other)
    tok.add_tokens(["<tunekit-extra-token>"])
    tok.save_pretrained(other)
    out = tmp_path / "run"
    r = run_cli(["train", "recipe=distill", *tiny_args(tiny_model_dir, tiny_data, out, f"distill.teacher={other}",
                                                      "distill.student_keep_every=0")], tmp_path)
    assert r.returncode == 2
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("tunekit: error: distill.teacher: the tokenizer of") and str(other) in last
    assert "Traceback" not in r.stderr and not (out / "adapter").exists()


@pytest.mark.parametrize("override, culprit", [("distill.alpha=1.5", "distill.alpha: must be in [0, 1]"),
                                               ("distill.divergence=l2", "distill.divergence: Invalid value 'l2'"),
                                               ("distill.teacher=/no/teacher", "distill.teacher: no model folder at /no/teacher")])
def test_bad_distill_config(override, culprit, capsys):
    from tunekit.commands.main import main

    with pytest.raises(SystemExit) as e:
        main(["train", "recipe=distill", override])
    assert e.value.code == 2 and culprit in capsys.readouterr().err
