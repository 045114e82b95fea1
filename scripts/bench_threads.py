#!/usr/bin/env python
"""How torch's OpenMP threads wait, on a quiet and on a busy CPU: libgomp's default against tunekit's.

Each run is the real command, `python -m tunekit.commands.main train recipe=qlora ...` on the embedded
default model (or --model), with GOMP_SPINCOUNT set explicitly: 300000 (libgomp's own default, what
a process gets without tunekit) or tunekit's value (tunekit/device/threads.py). Three scenarios:

  alone  one run on an otherwise idle machine: what the setting costs where nothing competes
  pair   two runs started together (two jobs, or `tunekit eval` beside training)
  busy   one run beside a single-threaded CPU burner (a compiler, a browser tab, a notebook)

Per run it reads metrics.jsonl: the first step's time (it overlaps the other process's start in
`pair`) and tokens/s over steps 2..N, plus the process's wall time. Runs alternate between the two
settings, in the opposite order on every other repetition, because these VMs drift by 10-20%.

    python scripts/bench_threads.py                       # default model, 6 steps, 2 repetitions
    python scripts/bench_threads.py --model /tmp/tiny --steps 30 --scenarios pair

Writes benchmarks/training/threads-cpu.json and .md (or --out). CPU only: on a GPU the threads wait on the
device instead.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tunekit.device.threads import SPINCOUNT, cores  # noqa: E402  (no torch: the parent stays light)

from benchlib import versions  # noqa: E402

SETTINGS = {"libgomp default": "300000", "tunekit": SPINCOUNT}
SCENARIOS = ("alone", "pair", "busy")
BURNER = "while True: pass"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model folder (default: the embedded default model)")
    p.add_argument("--steps", type=int, default=6, help="optimizer steps per run (>= 2)")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--set", action="append", default=[], help="extra train override (repeatable)")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "training" / "threads-cpu"))
    args = p.parse_args(argv)
    args.scenarios = [s for s in args.scenarios.split(",") if s]
    bad = [s for s in args.scenarios if s not in SCENARIOS]
    if bad or args.steps < 2:
        p.error(f"--scenarios: choose from {', '.join(SCENARIOS)}" if bad else "--steps must be >= 2")
    return args


def start_run(args, spin: str, out: Path) -> tuple[subprocess.Popen, float]:
    cmd = [sys.executable, "-m", "tunekit.commands.main", "train", "recipe=qlora", f"output_dir={out}",
           f"trainer.max_steps={args.steps}", "trainer.eval_every=100000", "trainer.eval_samples=0",
           "data.max_val_examples=8", "trainer.save_every=100000", *args.set]
    if args.model:
        cmd.append(f"model.path={args.model}")
    env = {**os.environ, "GOMP_SPINCOUNT": spin, "WANDB_MODE": "disabled"}
    env.pop("OMP_WAIT_POLICY", None)
    log = open(str(out) + ".log", "w")
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT), time.perf_counter()


def finish_run(proc: subprocess.Popen, started: float, out: Path) -> dict:
    rc = proc.wait()
    wall = time.perf_counter() - started
    if rc != 0:
        tail = Path(str(out) + ".log").read_text()[-2000:]
        raise SystemExit(f"bench_threads: a run failed (exit {rc}); its log ends:\n{tail}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "step_time_s" in r]
    later = steps[1:]
    tokens = sum(r["input_tokens"] for r in later)
    seconds = sum(r["step_time_s"] for r in later)
    return {"first_step_s": round(steps[0]["step_time_s"], 3), "later_steps_s": round(seconds, 3),
            "tokens_per_s": round(tokens / seconds, 1), "wall_s": round(wall, 2),
            "losses": [round(r["loss"], 6) for r in steps]}


def cpu_times() -> list[int]:
    """The machine's cumulative CPU time by kind (/proc/stat: user nice system idle iowait irq softirq steal)."""
    return [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]


def shares(before: list[int], after: list[int]) -> dict:
    """Idle and stolen (taken by the hypervisor for other VMs) shares of the machine's CPU time."""
    d = [b - a for a, b in zip(before, after)]
    total = sum(d) or 1
    return {"idle_pct": round(100 * (d[3] + d[4]) / total, 1), "steal_pct": round(100 * d[7] / total, 1)}


def scenario(args, name: str, spin: str, work: Path, tag: str) -> list[dict]:
    burner = subprocess.Popen([sys.executable, "-c", BURNER]) if name == "busy" else None
    before = cpu_times()
    try:
        outs = [work / f"{tag}-{i}" for i in range(2 if name == "pair" else 1)]
        running = [(start_run(args, spin, out), out) for out in outs]
        runs = [finish_run(proc, started, out) for (proc, started), out in running]
    finally:
        if burner is not None:
            burner.kill()
            burner.wait()
    machine_share = shares(before, cpu_times())
    return [{**r, **machine_share} for r in runs]


def machine() -> dict:
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    field = lambda key: next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith(key)), "?")  # noqa: E731
    return {"cpu": field("model name"), "cpu_family": field("cpu family"), "cpu_model": field("model\t"),
            "avx512_bf16": "avx512_bf16" in info, "cores": cores()}


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = [f"# OpenMP wait: libgomp's default against tunekit's (GOMP_SPINCOUNT={SPINCOUNT})", "",
             f"Machine: {m['cpu']} (family {m['cpu_family']}, model {m['cpu_model']}), {m['cores']} cores, "
             f"AVX512-BF16 {'yes' if m['avx512_bf16'] else 'no'}. Versions: "
             + ", ".join(f"{k} {v}" for k, v in result["versions"].items()) + ".", "",
             f"Settings: {json.dumps(result['settings'])}", "",
             "tokens/s over steps 2..N of each run (input tokens), first step's time, process wall time; "
             "one cell per run, repetitions in order.", "",
             "Steal: the share of the machine's CPU time the hypervisor gave other VMs during the scenario "
             "(/proc/stat); it competes for the cores as another process would.", "",
             "| scenario | GOMP_SPINCOUNT | tokens/s | first step (s) | wall (s) | steal % |", "|---|---|---|---|---|---|"]
    for name in result["settings"]["scenarios"]:
        for label, spin in SETTINGS.items():
            runs = [r for rep in result["runs"] for r in rep[name][label]]
            lines.append(f"| {name} | {spin} ({label}) | " + ", ".join(f"{r['tokens_per_s']:.1f}" for r in runs)
                         + " | " + ", ".join(f"{r['first_step_s']:.1f}" for r in runs)
                         + " | " + ", ".join(f"{r['wall_s']:.1f}" for r in runs)
                         + " | " + ", ".join(f"{r['steal_pct']:.0f}" for r in runs) + " |")
    losses = {tuple(r["losses"]) for rep in result["runs"] for by in rep.values() for rs in by.values() for r in rs}
    lines += ["", f"Losses of every step the same in every run (the wait changes no arithmetic): "
              f"{'yes' if len(losses) == 1 else 'NO: ' + str(sorted(losses))}", ""]
    lines += ["Ratios (tunekit / libgomp default, medians over runs):", ""]
    for name, r in result["ratios"].items():
        lines.append(f"- {name}: tokens/s x{r['tokens_per_s']:.2f}, first step x{r['first_step_s']:.2f}, "
                     f"wall x{r['wall_s']:.2f}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    result = {"machine": machine(), "versions": versions(),
              "settings": {"steps": args.steps, "reps": args.reps, "scenarios": args.scenarios, "set": args.set,
                           "model": args.model or "embedded default", "spincounts": SETTINGS},
              "runs": []}
    with tempfile.TemporaryDirectory(prefix="bench-threads-") as tmp:
        for rep in range(args.reps):
            block = {}
            for name in args.scenarios:
                order = list(SETTINGS.items()) if rep % 2 == 0 else list(SETTINGS.items())[::-1]
                block[name] = {}
                for label, spin in order:
                    block[name][label] = scenario(args, name, spin, Path(tmp), f"{rep}-{name}-{spin}")
                    print(f"rep {rep} {name:5s} GOMP_SPINCOUNT={spin:>6s}: "
                          + ", ".join(f"{r['tokens_per_s']:.1f} tokens/s (first step {r['first_step_s']:.1f} s, "
                                      f"wall {r['wall_s']:.1f} s, steal {r['steal_pct']:.0f}%)"
                                      for r in block[name][label]), flush=True)
            result["runs"].append(block)
    result["ratios"] = {}
    for name in args.scenarios:
        med = {label: {k: statistics.median(r[k] for rep in result["runs"] for r in rep[name][label])
                       for k in ("tokens_per_s", "first_step_s", "wall_s")} for label in SETTINGS}
        result["ratios"][name] = {k: med["tunekit"][k] / med["libgomp default"][k] for k in med["tunekit"]}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))
    print(f"wrote {out.with_suffix('.md')} and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
