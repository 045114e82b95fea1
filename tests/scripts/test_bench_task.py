"""scripts/bench_task.py: the table's mean and standard error over seeds on known numbers, the
generative task's split, and the whole script on the tiny model (both tasks, both
precisions, one seed, 2 steps), its tunekit commands forked from the suite's server."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from _helpers import REPO, run_cli

SCRIPTS = REPO / "scripts"


def _script(name: str):
    """A script of scripts/ as a module (scripts/ on sys.path, as when it runs as a script)."""
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _run(method: str, precision: str, seed: int, acc, em: float, loss: float) -> dict:
    return {"method": method, "precision": precision, "lr": 1e-3, "seed": seed, "default": True,
            "trained": {"accuracy": acc, "exact_match": em, "loss": loss},
            "base": {"accuracy": acc and 0.3, "exact_match": 0.1, "loss": 2.0}, "train_s": 10.0 * (seed + 1),
            "eval_s": 1.0}


def test_mean_and_standard_error_over_seeds_on_known_numbers():
    bench = _script("bench_task")
    # 0.6, 0.7, 0.8: mean 0.7, sample variance ((0.1)^2 + 0 + (0.1)^2) / (3 - 1) = 0.01, sd 0.1,
    # SE 0.1 / sqrt(3). Three float additions and a square root: relative error a few 1e-16, so
    # 1e-12 cannot hide a wrong formula (population sd would give 0.0471, sd alone 0.1).
    m, se = bench.mean_se([0.6, 0.7, 0.8])
    assert m == pytest.approx(0.7, abs=1e-12) and se == pytest.approx(0.1 / math.sqrt(3), abs=1e-12)
    assert bench.mean_se([0.25]) == (0.25, None)  # one seed: no spread to measure

    runs = [_run(meth, prec, seed, None, em, 1.0 + em) for meth in ("lora", "qlora") for prec in ("policy", "fp32")
            for seed, em in ((0, 0.5), (1, 0.7))]
    table = bench.arms(runs)
    assert [(a["method"], a["precision"], a["seeds"]) for a in table] == [
        ("lora", "policy", [0, 1]), ("lora", "fp32", [0, 1]), ("qlora", "policy", [0, 1]), ("qlora", "fp32", [0, 1])]
    row = table[0]
    # two values 0.5, 0.7: sd = 0.2 / sqrt(2), SE = sd / sqrt(2) = 0.1
    assert row["exact_match"]["mean"] == pytest.approx(0.6, abs=1e-12)
    assert row["exact_match"]["se"] == pytest.approx(0.1, abs=1e-12)
    assert row["exact_match"]["values"] == [0.5, 0.7]
    assert row["accuracy"] is None  # the generative task has no likelihood accuracy
    assert row["train_s"] == pytest.approx(15.0)
    assert bench.pm(row["exact_match"]) == "60.0 ± 10.0"
    assert bench.pm(bench.stat([0.5])) == "50.0 ± n/a"


def test_the_generative_split_is_fixed_and_disjoint(tmp_path):
    city = _script("build_city_data")
    a = city.build(tmp_path / "a", train_rows=60, val_rows=20)
    b = city.build(tmp_path / "b", train_rows=60, val_rows=20)
    rows = {name: (tmp_path / "a" / f"{name}.jsonl").read_text() for name in ("train", "val")}
    assert rows == {name: (tmp_path / "b" / f"{name}.jsonl").read_text() for name in ("train", "val")}
    cities = {name: {json.loads(line)["messages"][0]["content"] for line in text.splitlines()}
              for name, text in rows.items()}
    assert len(cities["train"]) == 60 and len(cities["val"]) == 20 and not cities["train"] & cities["val"]
    assert a["val_answers"] == b["val_answers"] and a["usable_rows"] >= 750  # room for the default 600 + 150


def _forked(cmd: list[str], log: Path) -> tuple[int, float]:
    """benchlib.run_logged for a `tunekit ...` command: forked from the suite's server (seconds of
    imports saved per command), its output in the log as the script writes it."""
    t0 = time.perf_counter()
    proc = run_cli(cmd[1:], cwd=REPO, env={"TOKENIZERS_PARALLELISM": "false"})
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(proc.stdout + proc.stderr)
    return proc.returncode, time.perf_counter() - t0


def test_both_tasks_both_precisions_on_the_tiny_model(tiny_model_dir, tmp_path, monkeypatch):
    bench = _script("bench_task")
    benchlib = sys.modules["benchlib"]
    real = benchlib.run_logged
    route = lambda cmd, log: _forked(cmd, log) if cmd[0] == benchlib.tunekit_exe() else real(cmd, log)  # noqa: E731
    monkeypatch.setattr(bench, "run_logged", route)
    monkeypatch.setattr(benchlib, "run_logged", route)
    out = tmp_path / "out"
    # one seed: the mean and standard error over seeds are checked on known numbers above; this run
    # checks both tasks in both precisions end to end (4 runs, not 8)
    assert bench.main(["--recipes", "lora", "--seeds", "0", "--steps", "2", "--micro-batch-size", "4",
                       "--warmup-steps", "1", "--train-per-class", "4", "--val-per-class", "2", "--gen-train-rows", "8",
                       "--gen-val-rows", "4", "--baseline", "none", "--model", str(tiny_model_dir),
                       "--work", str(tmp_path / "work"), "--out", str(out), "--suffix=-t"]) == 0
    for name, task, head in (("tweet-sentiment", "classify", "accuracy"), ("city-country", "generate", "exact_match")):
        result = json.loads((out / f"task-{name}-t.json").read_text())
        assert result["task_key"] == task and result["headline"] == head
        assert len(result["runs"]) == 2  # 1 recipe x 2 precisions x 1 seed
        table = result["table"]
        assert [(a["method"], a["precision"], a["seeds"]) for a in table] == [("lora", "policy", [0]),
                                                                            ("lora", "fp32", [0])]
        for a in table:
            assert len(a[head]["values"]) == 1 and a[head]["se"] is None  # one seed: no spread to measure
            assert (a["accuracy"] is None) == (task == "generate")
        md = (out / f"task-{name}-t.md").read_text()
        assert md.count("| lora |") == 2 and " ± n/a" in md and "mean ± SE" in md
    # each precision trained as it says: fp32 forced, the policy left to the recipe (auto)
    for precision, dtype in (("policy", "auto"), ("fp32", "fp32")):
        for seed in (0,):
            run = next((tmp_path / "work" / "generate" / precision / f"seed-{seed}" / "lora").glob("lr*"))
            cfg = OmegaConf.load(run / "config.yaml")
            assert cfg.model.dtype == dtype and cfg.seed == seed
