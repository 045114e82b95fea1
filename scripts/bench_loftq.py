#!/usr/bin/env python
"""QLoRA from a LoftQ start (method.init=loftq) against plain QLoRA, over several seeds, on the task of
scripts/bench_task.py (tweet sentiment, 3 classes).

Every arm is `tunekit train recipe=qlora` with the same steps, batch, sequence cap, lr (qlora's
default) and seed; a LoftQ arm adds method.init=loftq method.loftq_iters=K. For each run:

* the start: held-out loss before the first step (metrics.jsonl, step 0), and the start's cost
  (the LoftQ line of the training log);
* the trained model: `tunekit eval` accuracy by likelihood and held-out loss (no generation);
* the gap to what ships: `tunekit export --format merged --merge-into original` (the fine-tune on
  the original bf16 weights), its fidelity report's KL(trained || exported), held-out gain kept and
  task accuracy on the held-out rows (rows lost / won against the trained model).

Writes benchmarks/task/loftq-<date>.json/.md (or --out). Runs live under --work; a rerun skips
finished steps.

    python scripts/bench_loftq.py                                   # 3 seeds x (plain, iters=1): ~40 min on 2 cores
    python scripts/bench_loftq.py --iters 1,2@0                     # and 2 iterations at seed 0 only
    python scripts/bench_loftq.py --seeds 0 --steps 2 --train-per-class 8 --val-per-class 4 \\
        --model /path/to/tiny-model --work /tmp/bl                  # plumbing check
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import shutil
import statistics
import sys
from pathlib import Path

from benchlib import device_name, fail, pct, run_logged, train_seconds, tunekit_exe, write_result

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--iters", default="1", help="LoftQ arms: method.loftq_iters values (plain QLoRA always runs); "
                   "K@S1/S2 runs that arm at seeds S1, S2 only, e.g. 1,2@0")
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=160)
    p.add_argument("--warmup-steps", type=int, default=5)
    p.add_argument("--model", help="model folder (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--train-per-class", type=int, default=200)
    p.add_argument("--val-per-class", type=int, default=50)
    p.add_argument("--eval-batch-size", type=int, default=32)
    p.add_argument("--no-export", action="store_true", help="skip the merged export of each run")
    p.add_argument("--work", type=Path, default=REPO / "runs" / "bench-loftq")
    p.add_argument("--out", type=Path,
                   default=REPO / "benchmarks" / "task" / f"loftq-{datetime.date.today().isoformat()}")
    args = p.parse_args(argv)
    args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    arms = {}
    for spec in (i.strip() for i in args.iters.split(",") if i.strip()):
        iters, _, seeds = spec.partition("@")
        arms[int(iters)] = [int(x) for x in seeds.split("/")] if seeds else args.seeds
    args.iters = list(arms)
    args.arm_seeds = arms
    return args


def arm_name(iters: int) -> str:
    return "qlora" if iters == 0 else f"qlora + LoftQ (iters={iters})"


def train(args, iters: int, seed: int, data: dict) -> Path:
    out = args.work / f"seed-{seed}" / (f"loftq{iters}" if iters else "plain")
    if (out / "summary.json").is_file():
        return out
    shutil.rmtree(out, ignore_errors=True)  # an unfinished run of this script's own work folder
    cmd = [tunekit_exe(), "train", "recipe=qlora", f"data.path={data['train_path']}", f"data.val_path={data['val_path']}",
           f"trainer.max_steps={args.steps}", f"trainer.micro_batch_size={args.micro_batch_size}", "trainer.grad_accum=1",
           f"data.max_seq_len={args.seq_len}", f"trainer.warmup_steps={min(args.warmup_steps, args.steps - 1)}",
           f"trainer.eval_every={args.steps}", f"trainer.save_every={args.steps}", f"seed={seed}", f"output_dir={out}"]
    cmd += ["method.init=loftq", f"method.loftq_iters={iters}"] if iters else ["method.init=default"]
    cmd += [f"model.path={args.model}"] if args.model else []
    print(f"{arm_name(iters)} seed {seed}: {' '.join(cmd[1:])}", flush=True)
    log = args.work / "logs" / f"train-{out.parent.name}-{out.name}.log"
    rc, wall = run_logged(cmd, log)
    if rc != 0:
        fail(f"tunekit train ({arm_name(iters)}, seed {seed})", log)
    print(f"  trained in {wall:.0f} s", flush=True)
    return out


def start_of(run: Path, log: Path) -> dict:
    """Held-out loss at step 0, and the LoftQ line of the log (its summary and seconds)."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    first = next((r["val_loss"] for r in rows if r.get("step") == 0 and "val_loss" in r), None)
    line = next((m.group(0) for m in re.finditer(r"LoftQ \(iters=.*", log.read_text())), None) if log.is_file() else None
    return {"val_loss_step0": first, "loftq": line}


def evaluate(args, run: Path, with_base: bool) -> dict:
    out = run / "eval.json"
    if not out.is_file() or (with_base and "base" not in json.loads(out.read_text())):
        cmd = [tunekit_exe(), "eval", str(run), "--out", str(out), "--batch-size", str(args.eval_batch_size), "--json",
               "--no-generate"] + (["--base"] if with_base else [])
        log = args.work / "logs" / f"eval-{run.parent.name}-{run.name}.log"
        rc, _ = run_logged(cmd, log)
        if rc != 0:
            fail(f"tunekit eval {run}", log)
    return json.loads(out.read_text())


def export_original(args, run: Path, data: dict) -> dict:
    """The merge into the original weights, and its fidelity report's figures."""
    path = run.parent / f"{run.name}-merged-original"
    report = path / "fidelity.json"
    if not report.is_file():
        log = args.work / "logs" / f"export-{run.parent.name}-{run.name}.log"
        rc, _ = run_logged([tunekit_exe(), "export", str(run), "--format", "merged", "--merge-into", "original",
                            "--out", str(path), "--data", data["val_path"], "--task-rows", "1000", "--force"], log)
        if rc != 0 or not report.is_file():
            fail(f"tunekit export {run}", log)
    rep = json.loads(report.read_text())
    f = rep["fidelity"]
    task = f.get("task") or {}
    return {"kl_mean": f["kl_mean"], "gain_kept": f.get("gain_kept"), "task_trained": task.get("trained"),
            "task_exported": task.get("exported"), "rows_lost": _count(task.get("lost_rows")),
            "rows_won": _count(task.get("won_rows")),
            "dtype": rep.get("dtype")}


def _count(rows):
    return len(rows) if isinstance(rows, list) else rows


def summarize(runs: list[dict]) -> list[dict]:
    def stat(values):
        values = [v for v in values if v is not None]
        if not values:
            return None
        return {"mean": statistics.fmean(values), "sd": statistics.stdev(values) if len(values) > 1 else 0.0,
                "values": values}

    out = []
    for arm in dict.fromkeys(r["arm"] for r in runs):
        rs = [r for r in runs if r["arm"] == arm]
        out.append({"arm": arm, "seeds": [r["seed"] for r in rs]}
                   | {k: stat([r.get(k) for r in rs]) for k in
                      ("start_loss", "accuracy", "loss", "export_kl", "export_accuracy",
                       "export_gain_kept", "train_s", "peak_mib")})
    return out


def markdown(result: dict) -> str:
    s = result["settings"]

    def ms(x, fmt=pct):
        if x is None:
            return "-"
        return f"{fmt(x['mean'])} ± {fmt(x['sd'])}" if len(x["values"]) > 1 else fmt(x["mean"])

    def num(v):
        return f"{v:.3f}"

    def sci(v):
        return f"{v:.2e}"

    lines = [f"# QLoRA from a LoftQ start, {result['data']['task']}", "",
             f"Model: {s['model']}. Every run: recipe=qlora, {s['steps']} steps, micro-batch {s['micro_batch_size']}, "
             f"sequences <= {s['seq_len']} tokens, qlora's default lr; seeds {s['seeds']}. Device: {result['device']}. "
             f"Command: `{result['command']}`. 4-bit base, untrained: accuracy {pct(result['base'].get('accuracy'))}, "
             f"held-out loss {result['base']['loss']:.3f}.", "",
             "Mean ± standard deviation over the seeds. *start loss*: held-out loss before the first step. *export*: "
             "`tunekit export --format merged --merge-into original` (the fine-tune on the original weights), its "
             "fidelity report against the trained 4-bit model (its task check computes in fp32, so its accuracies "
             "differ by a few rows from `tunekit eval`'s). *peak RSS*: the training process's peak resident "
             "memory (summary.json).", "",
             "| arm | start loss | accuracy | held-out loss | export KL(trained‖export) | export accuracy "
             "| export gain kept | train s | peak RSS MiB |",
             "|---|---|---|---|---|---|---|---|---|"]
    for a in result["arms"]:
        lines.append(f"| {a['arm']} | {ms(a['start_loss'], num)} | {ms(a['accuracy'])} | "
                     f"{ms(a['loss'], num)} | {ms(a['export_kl'], sci)} | {ms(a['export_accuracy'])} | "
                     f"{ms(a['export_gain_kept'], pct)} | {ms(a['train_s'], lambda v: f'{v:.0f}')} | "
                     f"{ms(a['peak_mib'], lambda v: f'{v:.0f}')} |")
    lines += ["", "Per run:", "", "| arm | seed | start loss | accuracy | held-out loss | export KL | export accuracy "
              "(lost / won) | LoftQ |", "|---|---|---|---|---|---|---|---|"]
    for r in result["runs"]:
        lost = f" ({r['rows_lost']} / {r['rows_won']})" if r.get("rows_lost") is not None else ""
        kl = "-" if r.get("export_kl") is None else f"{r['export_kl']:.2e}"
        start = "-" if r["start_loss"] is None else f"{r['start_loss']:.3f}"
        lines.append(f"| {r['arm']} | {r['seed']} | {start} | {pct(r['accuracy'])} | {r['loss']:.3f} | {kl} | "
                     f"{pct(r.get('export_accuracy'))}{lost} | {r.get('loftq') or '-'} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    from build_task_data import build

    data = build(args.work / "data", args.train_per_class, args.val_per_class)
    runs, base = [], None
    for seed in args.seeds:
        for iters in [0, *[i for i in args.iters if seed in args.arm_seeds[i]]]:
            run = train(args, iters, seed, data)
            ev = evaluate(args, run, with_base=base is None)
            base = base or ev["base"]
            t = ev["trained"]
            start = start_of(run, args.work / "logs" / f"train-{run.parent.name}-{run.name}.log")
            row = {"arm": arm_name(iters), "iters": iters, "seed": seed, "dir": str(run),
                   "start_loss": start["val_loss_step0"], "loftq": start["loftq"], "accuracy": t.get("accuracy"),
                   "exact_match": t.get("exact_match"), "loss": t["loss"], "train_s": train_seconds(run),
                   "peak_mib": json.loads((run / "summary.json").read_text()).get("memory", {}).get("peak_mib")}
            if not args.no_export:
                e = export_original(args, run, data)
                row |= {"export_kl": e["kl_mean"], "export_accuracy": e["task_exported"],
                        "export_gain_kept": e["gain_kept"], "rows_lost": e["rows_lost"], "rows_won": e["rows_won"],
                        "export_dtype": e["dtype"]}
            print(f"  {row['arm']} seed {seed}: accuracy {pct(row['accuracy'])}, loss {row['loss']:.3f}"
                  + (f", export KL {row['export_kl']:.2e}" if "export_kl" in row else ""), flush=True)
            runs.append(row)
    result = {"data": {k: data[k] for k in ("task", "labels", "source", "train_rows", "val_rows")},
              "settings": {"steps": args.steps, "micro_batch_size": args.micro_batch_size, "seq_len": args.seq_len,
                           "warmup_steps": args.warmup_steps, "seeds": args.seeds, "iters": args.arm_seeds,
                           "model": args.model or "SmolLM2-135M-Instruct (embedded default)"},
              "device": device_name(), "date": datetime.date.today().isoformat(),
              "command": "python scripts/bench_loftq.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "base": {"accuracy": base.get("accuracy"), "loss": base["loss"]},
              "arms": summarize(runs), "runs": runs}
    write_result(args.out, result, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
