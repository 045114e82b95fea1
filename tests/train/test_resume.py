"""Interrupted and resumed runs through the real CLI: what may change, what is refused, what survives."""

from __future__ import annotations

import functools
import itertools
import re
import json
import shutil
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from _helpers import (crashed_copy, resume_is_bit_identical, die_holding_lock, save_like_a_run, die_mid_save, lost_or_changed, plant_lookalikes, read_jsonl, run_cli, snapshot,
                      tiny_args)
from tunekit.owned import HOME_PREFIX, PREFIX, atomic_dir, atomic_write_text, discard, is_scratch
from tunekit.train.checkpoint import damage
from tunekit.train.runlock import LOCK_NAME, RunLock

# LoRA dropout on, so the resumed run must also restore the random stream exactly.
COMMON = ("recipe=lora", "method.dropout=0.1", "trainer.max_steps=4")


def adapter(run: Path) -> dict:
    return load_file(str(run / "adapter" / "adapter_model.safetensors"))


@pytest.fixture(scope="module")
def full_run(tiny_model_dir, tiny_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("resume") / "full"
    r = run_cli(["train", *tiny_args(tiny_model_dir, tiny_data, out, *COMMON)], out.parent)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def test_resume_restores_rng_and_reports_first_eval(full_run, tiny_model_dir, tiny_data, tmp_path):
    run = crashed_copy(full_run, tmp_path / "run")
    die_mid_save(run / "checkpoints" / "step-000004")  # what a kill during a save leaves
    r = run_cli(["train", *tiny_args(tiny_model_dir, tiny_data, run, *COMMON, "trainer.resume=true")], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "leftover of an interrupted save: removed" in r.stderr
    assert not list((run / "checkpoints").glob(".*"))
    a, b = adapter(full_run), adapter(run)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # dropout masks included
    full, resumed = (json.loads((d / "summary.json").read_text()) for d in (full_run, run))
    assert resumed["first_val_loss"] == full["first_val_loss"] and resumed["resumed_from_step"] == 2
    assert "n/a (resumed)" not in r.stderr


def test_resume_falls_back_from_a_damaged_checkpoint(full_run, tiny_model_dir, tiny_data, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(full_run, run)
    shutil.rmtree(run / "adapter")
    bad = run / "checkpoints" / "step-000004" / "adapter" / "adapter_model.safetensors"
    bad.write_bytes(bad.read_bytes()[:100])  # a truncated copy
    r = run_cli(["train", *tiny_args(tiny_model_dir, tiny_data, run, *COMMON, "trainer.resume=true")], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "skipping damaged checkpoint step-000004" in r.stderr and "resumed from" in r.stderr
    a, b = adapter(full_run), adapter(run)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("change, named", [
    ("method.r=8", "method.r (16 -> 8)"),
    ("trainer.lr=5e-4", "trainer.lr"),
    ("seed=3", "seed (0 -> 3)"),
    ("trainer.micro_batch_size=2", "trainer.micro_batch_size"),
    ("data", "data.path (file content changed)"),
])
def test_resume_refuses_a_changed_run(full_run, tiny_model_dir, tiny_data, tmp_path, change, named):
    run = crashed_copy(full_run, tmp_path / "run")
    config_before = (run / "config.yaml").read_text()
    data = tiny_data
    if change == "data":
        data = tmp_path / "other.jsonl"
        data.write_text(tiny_data.read_text().replace("easy", "simple"))
        change = f"data.path={data}"
    r = run_cli(["train", *tiny_args(tiny_model_dir, data, run, *COMMON, "trainer.resume=true", change)], tmp_path)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "tunekit: error: trainer.resume: this config differs" in r.stderr and named in r.stderr
    assert "Traceback" not in r.stderr and "base:" not in r.stderr  # refused before the model loads
    assert (run / "config.yaml").read_text() == config_before  # the original config is kept


def test_resume_accepts_more_steps_and_other_cadence(full_run, tiny_model_dir, tiny_data, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(full_run, run)
    r = run_cli(["train", *tiny_args(tiny_model_dir, tiny_data, run, *COMMON, "trainer.resume=true",
                                     "trainer.max_steps=5", "trainer.eval_every=5", "trainer.save_every=5")], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stderr and "step 4" in r.stderr
    assert [row["step"] for row in read_jsonl(run / "metrics.jsonl") if "loss" in row] == [1, 2, 3, 4, 5]


def test_a_started_run_without_checkpoint_is_not_overwritten(full_run, tiny_model_dir, tiny_data, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    for name in ("config.yaml", "metrics.jsonl"):  # a run killed before its first save
        shutil.copy(full_run / name, run / name)
    before = (run / "metrics.jsonl").read_bytes()
    r = run_cli(["train", *tiny_args(tiny_model_dir, tiny_data, run, *COMMON)], tmp_path)
    assert r.returncode == 2 and "already holds a run (config.yaml, metrics.jsonl)" in r.stderr
    assert (run / "metrics.jsonl").read_bytes() == before


def test_non_finite_training_stops_and_keeps_the_last_good_checkpoint(tiny_model_dir, tiny_data, tmp_path):
    run = tmp_path / "run"
    # lr 1e30: the first update moves LoRA weights by ~1e30, the next forward overflows to inf/nan
    r = run_cli(["train", *tiny_args(tiny_model_dir, tiny_data, run, "recipe=lora", "trainer.max_steps=6",
                                     "trainer.save_every=1", "trainer.warmup_steps=0", "trainer.lr=1e30")], tmp_path)
    assert r.returncode == 2, r.stderr[-2000:]
    line = [ln for ln in r.stderr.splitlines() if ln.startswith("tunekit: error:")]
    assert len(line) == 1 and "nan" in line[0], r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "the last good checkpoint is" in line[0]
    assert not (run / "adapter").exists() and not (run / "summary.json").exists()
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert ckpts and all(not n.startswith(".") for n in ckpts)
    for ckpt in ckpts:  # every checkpoint kept holds finite weights
        t = load_file(str(run / "checkpoints" / ckpt / "adapter" / "adapter_model.safetensors"))
        assert all(v.isfinite().all() for v in t.values()), ckpt


def test_sigterm_behaves_like_ctrl_c(tiny_model_dir, tiny_data, tmp_path):
    """What schedulers send: stop cleanly, leave no temp folder, say how to resume; then resume."""
    run = tmp_path / "run"
    args = tiny_args(tiny_model_dir, tiny_data, run, *COMMON, "trainer.max_steps=40", "trainer.save_every=1",
                     "trainer.eval_every=40")
    # SIGTERM once the first checkpoint is there (in a fork of the suite's fork server, as every CLI
    # test; TUNEKIT_TEST_FRESH_CLI=1 signals the console script instead)
    first = run / "checkpoints" / "step-000001"
    r = run_cli(["train", *args], tmp_path, timeout=300, signal_when=(first, signal.SIGTERM))
    err = r.stderr
    assert r.returncode == 143, err[-2000:]
    assert "tunekit: error: interrupted by SIGTERM; the last checkpoint is step-" in err and "trainer.resume=true" in err
    assert "Traceback" not in err
    assert not [p for p in run.rglob(".*") if ".tmp" in p.name or p.name.endswith(".old")]
    assert not (run / LOCK_NAME).exists()  # released on the way out: the resume below needs no takeover
    # resumed for one more step past its last checkpoint (the other 30-odd of the 40 would only add time)
    last = max(int(p.name.removeprefix("step-")) for p in (run / "checkpoints").glob("step-*"))
    r = run_cli(["train", *args, "trainer.resume=true", f"trainer.max_steps={last + 1}"], tmp_path)
    assert r.returncode == 0 and "resumed from" in r.stderr and f"step {last}" in r.stderr, r.stderr[-2000:]
    assert [row["step"] for row in read_jsonl(run / "metrics.jsonl") if "loss" in row][-1] == last + 1


def test_user_files_survive_a_run_a_crash_a_resume_and_an_export(tiny_model_dir, tiny_data, tmp_path):
    """A folder of the user's as output_dir: refused, then allowed; files that look like leftovers
    (hidden *.tmp*, *.old, a hand-made checkpoints/step-5) beside real leftovers of a killed run
    and a stale lock; an export beside more of them. tunekit removes its own, and nothing else."""
    run = tmp_path / "mine"
    mine = plant_lookalikes(run)
    args = tiny_args(tiny_model_dir, tiny_data, run, *COMMON, "trainer.max_steps=2")
    before = snapshot(run)
    r = run_cli(["train", *args], tmp_path)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"tunekit: error: output_dir: {run} is not empty and holds no tunekit run (.draft.tmp, .photos.old, "
        ".tunekit.tmp-notes and 2 more); give a new or empty folder, or pass trainer.allow_nonempty_output_dir=true "
        "to write the run beside these files (tunekit leaves them alone)"], r.stderr[-2000:]
    assert snapshot(run) == before

    r = run_cli(["train", *args, "trainer.allow_nonempty_output_dir=true"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert lost_or_changed(run, mine) == [] and not (run / LOCK_NAME).exists()

    # the user's look-alikes in checkpoints/; a run killed between the renames that replace adapter/,
    # and while it wrote step 4; its lock left behind
    ck = run / "checkpoints"
    in_ck = plant_lookalikes(ck, tag="ck")
    (ck / "step-5").mkdir()
    (ck / "step-5" / "notes.txt").write_text("a folder of mine, named like a checkpoint")
    in_ck["step-5/notes.txt"] = (ck / "step-5" / "notes.txt").read_bytes()
    adapter_before = snapshot(run / "adapter")
    die_mid_save(run / "adapter", at="rename")
    die_mid_save(ck / "step-000004", at="write")
    stale = die_holding_lock(run)
    assert not (run / "adapter").exists()
    r = run_cli(["train", *tiny_args(tiny_model_dir, tiny_data, run, *COMMON, "trainer.resume=true")], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"took over the lock of a run that ended without releasing it (pid {stale} on " in r.stderr
    assert f"leftover of an interrupted save: restored {run / 'adapter'} from {PREFIX}adapter-" in r.stderr
    assert r.stderr.count("leftover of an interrupted save: removed") == 2 and "resumed from" in r.stderr
    assert snapshot(run / "adapter") != adapter_before  # the restored one, then replaced by the final adapter
    assert lost_or_changed(run, mine) == [] and lost_or_changed(ck, in_ck) == []
    assert sorted(p.name for p in ck.iterdir() if p.name.startswith("step-")) == ["step-000002", "step-000004", "step-5"]
    assert not [p for p in run.rglob(f"{PREFIX}*") if p.name != ".tunekit.tmp-notes"] and not (run / LOCK_NAME).exists()

    # an export, then a second one over it, beside the user's files
    exports = tmp_path / "exports"
    beside = plant_lookalikes(exports, tag="exports")
    (exports / ".mine-adapter.old").mkdir()  # named as older versions named a replaced export
    (exports / ".mine-adapter.old" / "keep.txt").write_text("mine")
    beside[".mine-adapter.old/keep.txt"] = b"mine"
    out = exports / "mine-adapter"
    for _ in range(2):
        r = run_cli(["export", str(run), "--format", "adapter", "--out", str(out), "--eval-batches", "1"], tmp_path)
        assert r.returncode == 0, r.stderr[-3000:]
        assert (out / "fidelity.json").is_file() and lost_or_changed(exports, beside) == []
    assert sorted(p.name for p in exports.iterdir()) == sorted(
        {n.split("/")[0] for n in beside} | {"mine-adapter"})
    assert lost_or_changed(run, mine) == []


def _tunekit_left(run: Path) -> list[str]:
    """tunekit's names under a run folder other than its outputs (the user's .tunekit.tmp-notes aside)."""
    return sorted(str(p.relative_to(run)) for p in run.rglob(".tunekit*") if ".tunekit.tmp-notes" not in p.parts)


def test_a_kill_at_any_point_of_a_save_leaves_nothing_after_the_resume(full_run, tiny_model_dir, tiny_data, tmp_path):
    """A run killed (SIGKILL) after each call of its saves that creates, writes, renames or removes, one
    kill a try: as it starts (the lock, its scratch home), replaces a checkpoint, writes a new one,
    prunes it, rewrites config.yaml and ends. After each, the next run's start leaves nothing of
    tunekit's but its outputs, the checkpoint whole and every look-alike of the user's as it was
    (.tunekit.tmp-notes included: tunekit's prefix, not tunekit's). Then a real resume after a kill
    mid-save trains on and leaves nothing either."""
    run = crashed_copy(full_run, tmp_path / "run")
    ck = run / "checkpoints"
    mine, in_ck = plant_lookalikes(run), plant_lookalikes(ck, tag="ck")
    pristine = shutil.copytree(ck / "step-000002", tmp_path / "step-2")
    config = (run / "config.yaml").read_text()
    a_run_saving = functools.partial(save_like_a_run, run, pristine, config)

    seen = {"unmarked home": 0, "moved aside": 0}
    for n in itertools.count(1):
        if die_mid_save(run, at=n, save=a_run_saving) is None:
            break
        seen["unmarked home"] += any(p.name.startswith(HOME_PREFIX) and not is_scratch(p) for p in run.iterdir())
        seen["moved aside"] += not (ck / "step-000002").exists()
        lock = RunLock.acquire(run)  # the next run starts
        lock.open_scratch()
        lock.release()
        assert _tunekit_left(run) == [], n
        assert lost_or_changed(run, mine) == [] and lost_or_changed(ck, in_ck) == [], n
        assert damage(ck / "step-000002") is None and (run / "config.yaml").read_text() == config, n
        if (ck / "step-000003").exists():  # the kill came after it was in place: whole, the run's
            assert damage(ck / "step-000003") is None, n
            shutil.rmtree(ck / "step-000003")
    # every point of the sequence was a kill, those where the old design left an unmarked folder too
    assert n > 40 and seen["unmarked home"] > 0 and seen["moved aside"] > 0, (n, seen)

    # a kill with step-000002 moved aside, then the real resume: puts it back, trains on, leaves nothing
    mid = next(k for k in itertools.count(1) if die_mid_save(run, at=k, save=a_run_saving) is None
               or not (ck / "step-000002").exists())
    assert not (ck / "step-000002").exists(), mid
    r = run_cli(["train", *tiny_args(tiny_model_dir, tiny_data, run, *COMMON, "trainer.resume=true")], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"leftover of an interrupted save: restored {ck / 'step-000002'} from {HOME_PREFIX}" in r.stderr
    assert "resumed from" in r.stderr and (run / "summary.json").is_file()
    assert _tunekit_left(run) == [] and lost_or_changed(run, mine) == [] and lost_or_changed(ck, in_ck) == []


def test_another_number_of_ranks_resumes_data_parallel_and_is_refused_under_fsdp(tmp_path):
    """world_size_change: the same number passes silently; data parallel (or one process) on another
    number resumes with a line; FSDP on either side is refused, naming both numbers."""
    from tunekit import TunekitError
    from tunekit.train.resume import world_size_change

    ddp = lambda n: {"world_size": n}  # noqa: E731  (trainer.strategy=ddp is left out of the fingerprint)
    fsdp = lambda n: {"world_size": n, "trainer.strategy": "fsdp"}  # noqa: E731
    assert world_size_change(ddp(2), ddp(2), tmp_path) is None and world_size_change(fsdp(4), fsdp(4), tmp_path) is None
    assert world_size_change(ddp(2), ddp(4), tmp_path).startswith(
        "trainer.resume: the checkpoint was written by 2 ranks, this run has 4: the global batch changes")
    for saved, now, said in ((fsdp(2), fsdp(4), "2 FSDP ranks; this run has 4 FSDP ranks"),
                             (fsdp(2), fsdp(1), "2 FSDP ranks; this run has 1 process (its optimizer state whole"),
                             (fsdp(1), fsdp(2), "1 process (its optimizer state whole, not sharded); this run has 2 FSDP")):
        with pytest.raises(TunekitError, match=re.escape(f"in {tmp_path} was written by {said}")) as e:
            world_size_change(saved, now, tmp_path)
        assert f"resume with --num_processes {saved['world_size']}, or start a new output_dir" in str(e.value)


def test_resume_refuses_a_start_adapter_whose_content_changed(tmp_path):
    """model.adapter: the start's sha256 is part of the run's fingerprint, so a resume reloads the very
    adapter the run started over (its path is a config key like any other)."""
    from safetensors.torch import save_file

    from tunekit import TunekitError
    from tunekit.config import TrainConfig
    from tunekit.train.resume import check_same_run, fingerprint

    start = tmp_path / "start"
    start.mkdir()
    (start / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2}))
    save_file({"base_model.model.x.lora_A.weight": torch.zeros(2, 4)}, str(start / "adapter_model.safetensors"))
    cfg = TrainConfig()
    cfg.model.adapter = str(start)
    saved = fingerprint(cfg, 1, hashes={})
    assert check_same_run(saved, fingerprint(cfg, 1, hashes={}), tmp_path) is None
    save_file({"base_model.model.x.lora_A.weight": torch.ones(2, 4)}, str(start / "adapter_model.safetensors"))
    with pytest.raises(TunekitError, match=r"trainer.resume: this config differs from the run saved in .* in "
                                           r"model.adapter \(file content changed\)"):
        check_same_run(saved, fingerprint(cfg, 1, hashes={}), tmp_path)


def test_a_full_fine_tune_resumes_to_the_same_weights(tiny_model_dir, tiny_data, tmp_path):
    """recipe=full under bf16 draws a stochastic bf16 copy of its weights each step from the torch
    RNG (tunekit.device.rounding): a run resumed from its step-2 checkpoint draws the same copies
    as the run that went on, and ends with the same weights, bit for bit."""
    args = ("recipe=full", "model.dtype=bf16", "trainer.max_steps=4", "trainer.lr=1e-4")
    resume_is_bit_identical(tiny_model_dir, tiny_data, tmp_path, args, "model.safetensors")
