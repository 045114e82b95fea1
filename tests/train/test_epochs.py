"""trainer.epochs: the run's length in passes over the training rows (tunekit.train.checks for the
rule with trainer.max_steps, tunekit.train.build._resolve_steps for the count, tunekit.data.batching
for the arithmetic, whose own tests are in tests/data/test_data.py)."""

from __future__ import annotations

import json
import math

import pytest

from _helpers import read_jsonl, run_cli, tiny_args
from tunekit import TunekitError
from tunekit.config import DEFAULT_MAX_STEPS, TrainConfig, TrainerConfig


def test_max_steps_auto_is_the_old_default_without_epochs_and_waits_for_the_rows_with_them():
    from tunekit.train.checks import check_run_length

    alone = TrainerConfig()
    check_run_length(alone)
    assert alone.max_steps == DEFAULT_MAX_STEPS == 60
    for steps in ("auto", None):
        t = TrainerConfig(max_steps=steps, epochs=0.5)
        check_run_length(t)
        assert t.max_steps == "auto" and t.epochs == 0.5  # resolved in the run, from its rows
    with pytest.raises(TunekitError, match=r"^trainer.epochs=2 and trainer.max_steps=40 both set"):
        check_run_length(TrainerConfig(max_steps=40, epochs=2))  # e.g. recipe=distill's 40 steps


def test_epochs_and_their_step_count_resume_like_max_steps(tmp_path):
    """A run sized by epochs resumes as one given the same count in max_steps (both keys may change
    on resume); a checkpoint at or past the epochs' count is refused, naming trainer.epochs."""
    from tunekit.train.resume import check_steps_left, fingerprint

    by_steps, by_epochs = TrainConfig(), TrainConfig()
    by_steps.trainer.max_steps = 113
    by_epochs.trainer.epochs = 3
    assert fingerprint(by_steps, 1, hashes={}) == fingerprint(by_epochs, 1, hashes={})
    check_steps_left(112, 113, 3, tmp_path)  # a step left: fine
    with pytest.raises(TunekitError, match=r"^trainer.epochs: checkpoint .* is at step 113, already at the 113 "
                                           r"steps trainer.epochs=3 resolves to: nothing to resume"):
        check_steps_left(113, 113, 3, tmp_path)


def test_the_progress_bar_shows_the_epoch(tmp_path):
    from tunekit.train.tracking import Tracker

    for run in "ab":
        (tmp_path / run).mkdir()
    sized = Tracker(tmp_path / "a", 113, 0, "none", "p", None, {}, epochs=3)
    sized.step({"step": 1, "loss": 2.0, "tokens_per_s": 1.0, "epoch": 1.4})
    assert sized.bar.desc.startswith("epoch 1.4/3")
    sized.close()
    steps = Tracker(tmp_path / "b", 10, 4, "none", "p", None, {}, first_epoch=0.75)
    assert steps.bar.desc.startswith("epoch 0.8") and "/" not in steps.bar.desc  # a resume starts at its epoch
    steps.close()


def test_a_run_of_one_epoch_logs_its_count_and_the_epoch(tiny_model_dir, tiny_data, tmp_path):
    """One epoch of the tiny data: 48 rows less the held-out fifth, 16 a step (micro 8 x accum 2)."""
    out = tmp_path / "run"
    args = [a for a in tiny_args(tiny_model_dir, tiny_data, out, "trainer.micro_batch_size=8",
                                 "trainer.eval_every=100", "trainer.save_every=100", "trainer.eval_samples=0")
            if not a.startswith(("trainer.max_steps=", "trainer.micro_batch_size=4"))]
    r = run_cli(["train", *args, "trainer.epochs=1"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    rows = summary["data"]["train"]["rows"]
    steps = math.ceil(rows / 16)
    assert summary["steps"] == steps and summary["epochs"] == 1
    assert (f"trainer.epochs=1: {rows} training rows / global batch 16 (micro_batch_size 8 x grad_accum 2 x 1 rank)"
            f" = {rows / 16:.4g} steps an epoch -> {steps} steps") in r.stderr
    epochs = [row["epoch"] for row in read_jsonl(out / "metrics.jsonl") if "loss" in row]
    assert epochs == [16 * k / rows for k in range(1, steps + 1)]  # the last one just past 1: a whole step
    assert epochs[-2] < 1 <= epochs[-1]
