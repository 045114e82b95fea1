#!/usr/bin/env python
"""LoRA's variants against plain LoRA on the task of scripts/bench_task.py (tweet sentiment, 3 classes).

Each variant is the lora or qlora recipe with its method.* keys (docs/training.md, "LoRA variants"),
trained with the same steps, batch, sequence cap, seed and learning rate (the recipe's default, or
--lr) as its plain arm, then scored by the same `tunekit eval` on the same held-out rows. The
table gives held-out loss, task accuracy, exact match and training speed (input tokens per second of
optimizer steps, from metrics.jsonl), each next to the plain arm over the same base.

Writes benchmarks/task/variants-<date>.json/.md (or --out). Runs live under --work; a rerun skips
finished ones.

    python scripts/bench_variants.py                       # the full table: hours on a 2-core CPU
    python scripts/bench_variants.py --variants lora,dora --steps 1 --train-per-class 8 --val-per-class 4 \\
        --model /path/to/tiny-model --work /tmp/bv         # plumbing check
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import sys
from pathlib import Path

from benchlib import device_name, evaluate, fail, pct, run_logged, train_seconds, tunekit_exe, write_result

REPO = Path(__file__).resolve().parents[1]

# name -> (recipe, overrides). The plain arm of each base comes first: the others are read against it.
VARIANTS = {
    "lora": ("lora", []),
    "dora": ("lora", ["method.use_dora=true"]),
    "rslora": ("lora", ["method.use_rslora=true"]),
    "pissa": ("lora", ["method.init=pissa"]),
    "olora": ("lora", ["method.init=olora"]),
    "loraplus": ("lora", ["method.loraplus_lr_ratio=16"]),
    "qlora": ("qlora", []),
    "qdora": ("qlora", ["method.use_dora=true"]),
    "qlora-rslora": ("qlora", ["method.use_rslora=true"]),
    "qlora-loraplus": ("qlora", ["method.loraplus_lr_ratio=16"]),
}
PLAIN = {"lora": "lora", "qlora": "qlora"}  # recipe -> its plain arm


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=160)
    p.add_argument("--warmup-steps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, help="one lr for every arm (default: each recipe's own)")
    p.add_argument("--model", help="model folder (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--train-per-class", type=int, default=200)
    p.add_argument("--val-per-class", type=int, default=50)
    p.add_argument("--eval-batch-size", type=int, default=32)
    p.add_argument("--work", type=Path, default=REPO / "runs" / "bench-variants")
    p.add_argument("--out", type=Path,
                   default=REPO / "benchmarks" / "task" / f"variants-{datetime.date.today().isoformat()}")
    args = p.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in args.variants if v not in VARIANTS]
    if bad:
        p.error(f"--variants: unknown {bad}; choose from {list(VARIANTS)}")
    for v in args.variants:  # every variant is read against its plain arm: train that too
        plain = PLAIN[VARIANTS[v][0]]
        if plain not in args.variants:
            args.variants.insert(0, plain)
    return args


def train(args, name: str, data: dict) -> dict:
    recipe, overrides = VARIANTS[name]
    out = args.work / name
    job = {"method": name, "lr": args.lr or 0.0, "seed": args.seed, "dir": out, "recipe": recipe}
    if (out / "summary.json").is_file():
        return job
    shutil.rmtree(out, ignore_errors=True)
    cmd = [tunekit_exe(), "train", f"recipe={recipe}", *overrides, f"data.path={data['train_path']}",
           f"data.val_path={data['val_path']}", f"trainer.max_steps={args.steps}",
           f"trainer.micro_batch_size={args.micro_batch_size}", "trainer.grad_accum=1",
           f"data.max_seq_len={args.seq_len}",
           f"trainer.warmup_steps={min(args.warmup_steps, args.steps - 1)}", f"trainer.eval_every={args.steps}",
           f"trainer.save_every={args.steps}", f"seed={args.seed}", f"output_dir={out}"]
    cmd += ([f"trainer.lr={args.lr:g}"] if args.lr else []) + ([f"model.path={args.model}"] if args.model else [])
    print(f"{name}: {' '.join(cmd[1:])}", flush=True)
    log = args.work / "logs" / f"train-{name}.log"
    rc, wall = run_logged(cmd, log)
    if rc != 0:
        fail(f"tunekit train ({name})", log)
    print(f"{name}: trained in {wall:.0f} s", flush=True)
    return job


def tokens_per_s(run: Path) -> float | None:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rates = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r]
    return sum(rates) / len(rates) if rates else None


def markdown(result: dict) -> str:
    s = result["settings"]
    lines = [f"# LoRA variants on {result['data']['task']}", "",
             f"Model: {s['model']}. Every run: {s['steps']} steps, micro-batch {s['micro_batch_size']}, sequences <= "
             f"{s['seq_len']} tokens, seed {s['seed']}, lr {s['lr'] or 'the recipe default'}. "
             f"Device: {result['device']}. "
             f"Command: `{result['command']}`. Differences are against the plain arm over the same base; one "
             "seed, so a difference of a few accuracy points is within the rows' own noise.", "",
             "| variant | recipe | accuracy | exact match | held-out loss | d loss vs plain | tokens/s "
             "| speed vs plain |",
             "|---|---|---|---|---|---|---|---|"]
    by_name = {r["method"]: r for r in result["runs"]}
    for r in result["runs"]:
        plain = by_name.get(PLAIN[r["recipe"]])
        d_loss = "-" if plain is None else f"{r['loss'] - plain['loss']:+.3f}"
        speed = "-" if plain is None or not r["tokens_per_s"] or not plain["tokens_per_s"] else \
            f"{r['tokens_per_s'] / plain['tokens_per_s']:.2f}x"
        tps = "-" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:.0f}"
        lines.append(f"| {r['method']} | {r['recipe']} | {pct(r['accuracy'])} | {pct(r['exact_match'])} | "
                     f"{r['loss']:.3f} | {d_loss} | {tps} | {speed} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    from build_task_data import build

    data = build(args.work / "data", args.train_per_class, args.val_per_class)
    jobs = [train(args, name, data) for name in args.variants]
    runs = []
    for job in jobs:
        evaluate(args, job, with_base=False)
        t = job["eval"]["trained"]
        runs.append({"method": job["method"], "recipe": job["recipe"], "dir": str(job["dir"]),
                     "accuracy": t.get("accuracy"), "exact_match": t.get("exact_match"), "loss": t["loss"],
                     "tokens_per_s": tokens_per_s(job["dir"]), "train_s": train_seconds(job["dir"])})
    result = {"data": {k: data[k] for k in ("task", "labels", "source", "train_rows", "val_rows")},
              "settings": {k: getattr(args, k) for k in ("steps", "micro_batch_size", "seq_len", "warmup_steps",
                                                         "seed", "lr")}
              | {"model": args.model or "SmolLM2-135M-Instruct (embedded default)"},
              "device": device_name(),
              "command": "python scripts/bench_variants.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "runs": runs}
    write_result(args.out, result, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
