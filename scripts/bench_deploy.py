#!/usr/bin/env python
"""The deployment chain: one trained run's task accuracy as trained, and as each artifact a user ships.

One QLoRA run of the default model (SmolLM2-135M-Instruct) on the tweet-sentiment task that
scripts/build_task_data.py builds (3 classes, one-word answers; 600 train / 150 held-out rows),
then every export of it, each scored twice on the same 150 held-out rows:

  - by the export's own check (`tunekit export ... --data val.jsonl`: the task section of its
    fidelity report, scored by transformers or, for GGUF, by llama.cpp itself), with the gate's verdict;
  - by `tunekit eval ARTIFACT --data val.jsonl` on the written artifact, as a user would score it.

Exports: merged (the default: into the dequantized NF4 weights, narrowest dtype that passes),
merged into the original weights, re-quantized to NF4, GGUF f16 / Q8_0 / Q4_K_M, and the LoRA as a
llama.cpp adapter GGUF where tunekit has that format. `--force` is passed so that a refused export
is still written and scored; the table says which the gate refused.

    python scripts/bench_deploy.py                      # ~25 min on a 2-core CPU
    python scripts/bench_deploy.py --steps 2 --train-per-class 8 --val-per-class 4 --work /tmp/bd   # plumbing

Writes benchmarks/export/deploy-tweet-sentiment-<date>.md and .json (or --out).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

from benchlib import versions as installed

REPO = Path(__file__).resolve().parents[1]

# (name, export arguments, artifact file or folder name)
EXPORTS = [
    ("merged (default: into dequantized NF4)", ["--format", "merged"], "merged"),
    ("merged --merge-into original", ["--format", "merged", "--merge-into", "original"], "merged-original"),
    ("merged --requantize nf4", ["--format", "merged", "--requantize", "nf4"], "merged-nf4"),
    ("gguf f16", ["--format", "gguf"], "model-f16.gguf"),
    ("gguf Q8_0", ["--format", "gguf", "--dtype", "Q8_0"], "model-q8_0.gguf"),
    ("gguf Q4_K_M", ["--format", "gguf", "--dtype", "Q4_K_M"], "model-q4_k_m.gguf"),
    ("gguf f16 --merge-into original", ["--format", "gguf", "--merge-into", "original"], "model-original-f16.gguf"),
    ("gguf-adapter (llama.cpp --lora)", ["--format", "gguf-adapter"], "adapter.gguf"),
]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--train-per-class", type=int, default=200)
    p.add_argument("--val-per-class", type=int, default=50)
    p.add_argument("--work", type=Path, default=REPO / "runs" / "bench-deploy")
    p.add_argument("--out", type=Path, help="output path without suffix (default benchmarks/export/deploy-tweet-sentiment-DATE)")
    p.add_argument("--only", help="comma-separated export names (artifact names) to run")
    return p.parse_args(argv)


def tunekit(*args: str, log: Path) -> tuple[int, float]:
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.run([str(Path(sys.executable).with_name("tunekit")), *args], cwd=REPO, stdout=f,
                            stderr=subprocess.STDOUT).returncode
    return rc, time.perf_counter() - t0


def formats() -> str:
    """The export formats this tunekit has (gguf-adapter is newer than the rest)."""
    out = subprocess.run([str(Path(sys.executable).with_name("tunekit")), "export", "--help"], capture_output=True,
                         text=True).stdout
    return out


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def versions() -> dict:
    return installed(("torch", "transformers", "peft", "bitsandbytes", "llama_cpp_python"))


def pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def markdown(result: dict) -> str:
    r = result
    lines = [
        f"# Deployment chain: tweet-sentiment, {r['date']}",
        "",
        f"Machine: {r['machine']['cpu']} ({r['machine']['cores']} cores), no GPU; "
        + ", ".join(f"{k} {v}" for k, v in r["versions"].items()) + ".",
        f"Run: `tunekit train recipe=qlora` on {r['data']['train_rows']} rows, {r['steps']} steps, batch 8, "
        f"sequences <= 160 tokens, warmup 5 (the same settings as scripts/bench_task.py); held-out: "
        f"{r['data']['val_rows']} rows, 3 classes. Command: `{r['command']}`.",
        "",
        f"`tunekit eval RUN --data val.jsonl --base`: base (4-bit) {pct(r['eval']['base'])}, trained "
        f"{pct(r['eval']['trained'])} accuracy (by likelihood).",
        "",
        "| artifact | dtype | export's task check | task gain kept | rows lost / won | held-out loss gain kept "
        "| KL(trained‖exported) | gate | `tunekit eval` of the artifact |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for e in r["exports"]:
        if e.get("error"):
            lines.append(f"| {e['name']} | | {e['error']} | | | | | | |")
            continue
        t = e.get("task") or {}
        lines.append(
            f"| {e['name']} | {e.get('dtype') or '-'} | {pct(t.get('exported'))} | {pct(t.get('gain_kept'))} | "
            f"{t.get('lost_rows', '-')} / {t.get('won_rows', '-')} | {pct(e.get('gain_kept'))} | "
            f"{e['kl_mean']:.2e} | {'OK' if e['accepted'] else 'refused: ' + (e.get('why') or '')} | "
            f"{pct(e.get('eval_accuracy'))} |")
    trained_fp32 = next((e["task"]["trained"] for e in r["exports"] if e.get("task")), None)
    lines += ["", "Task check: accuracy by likelihood on the held-out rows, scored by transformers (merged, NF4) "
              "or llama.cpp (GGUF) against the trained model computed in fp32 "
              f"({pct(trained_fp32)}; `tunekit eval` above computes in the device's dtype, bf16 on a CPU with "
              "native bf16, so a few rows differ). `tunekit eval` of the artifact: the written file or folder "
              "scored as a user would (GGUF in llama.cpp; a gguf-adapter needs its base GGUF, so it has none). "
              "Export times are in the .json; they are not comparable here when other jobs shared the machine. "
              "Raw reports: the .json beside this file."]
    if r.get("note"):
        lines += ["", r["note"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    from build_task_data import build

    date = datetime.date.today().isoformat()
    out = args.out or REPO / "benchmarks" / "export" / f"deploy-tweet-sentiment-{date}"
    work = args.work.absolute()
    data = build(work / "data", args.train_per_class, args.val_per_class)
    val = data["val_path"]
    run = work / "run"
    if not (run / "adapter" / "adapter_model.safetensors").is_file():
        rc, _ = tunekit("train", "recipe=qlora", f"data.path={data['train_path']}", f"data.val_path={val}",
                        f"trainer.max_steps={args.steps}", "trainer.micro_batch_size=8", "trainer.grad_accum=1",
                        "data.max_seq_len=160", "trainer.warmup_steps=5", f"output_dir={run}", log=work / "train.log")
        if rc:
            raise SystemExit(f"training failed: see {work / 'train.log'}")
    rc, _ = tunekit("eval", str(run), "--data", val, "--base", "--no-generate", "--json", "--out",
                    str(work / "eval.json"), log=work / "eval.log")
    if rc:
        raise SystemExit(f"eval failed: see {work / 'eval.log'}")
    ev = json.loads((work / "eval.json").read_text())
    have = formats()
    only = set(args.only.split(",")) if args.only else None
    exports = []
    for name, flags, artifact in EXPORTS:
        if only is not None and artifact not in only:
            continue
        fmt = flags[1]
        if fmt not in have:
            exports.append({"name": name, "error": f"this tunekit has no --format {fmt}"})
            continue
        path = work / "exports" / artifact
        log = work / "logs" / f"export-{artifact}.log"
        rc, secs = tunekit("export", str(run), *flags, "--out", str(path), "--data", val, "--task-rows", "1000",
                           "--force", log=log)
        report_file = path / "fidelity.json" if path.is_dir() else Path(f"{path}.fidelity.json")
        if rc or not report_file.is_file():
            exports.append({"name": name, "error": f"export failed (rc {rc}; {log})"})
            continue
        rep = json.loads(report_file.read_text())
        f = rep["fidelity"]
        entry = {"name": name, "artifact": str(path), "dtype": rep.get("dtype"), "accepted": rep["accepted"],
                 "why": rep["gate"].get("why"), "rule": rep["gate"].get("rule"), "task": f.get("task"),
                 "task_skipped": f.get("task_skipped"), "gain_kept": f.get("gain_kept"), "kl_mean": f["kl_mean"],
                 "export_s": secs, "merge_into": rep.get("merge_into"), "checked_by": rep.get("checked_by")}
        if fmt != "gguf-adapter":  # an adapter GGUF needs its base GGUF beside it to be scored
            eval_out = work / "logs" / f"eval-{artifact}.json"
            rc, _ = tunekit("eval", str(path), "--data", val, "--no-generate", "--json", "--out", str(eval_out),
                            "--device", "cpu", log=work / "logs" / f"eval-{artifact}.log")
            if rc == 0:
                entry["eval_accuracy"] = json.loads(eval_out.read_text())["trained"].get("accuracy")
            else:
                entry["eval_error"] = (work / "logs" / f"eval-{artifact}.log").read_text()[-300:]
        exports.append(entry)
        print(f"{name}: task {pct((entry['task'] or {}).get('exported'))}, eval {pct(entry.get('eval_accuracy'))}, "
              f"{'OK' if entry['accepted'] else 'refused'}", flush=True)
    import os

    result = {
        "date": date, "machine": {"cpu": cpu_name(), "cores": os.cpu_count()}, "versions": versions(),
        "command": "python scripts/bench_deploy.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "steps": args.steps, "data": {k: data[k] for k in ("train_rows", "val_rows", "source")},
        "eval": {"base": ev["base"].get("accuracy"), "trained": ev["trained"].get("accuracy"),
                 "base_loss": ev["base"]["loss"], "trained_loss": ev["trained"]["loss"]},
        "exports": exports,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps(result, indent=2) + "\n")
    Path(f"{out}.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
