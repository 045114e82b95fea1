#!/usr/bin/env python
"""Where a training step's time goes: torch.profiler over a few steps of `tunekit train`'s own
step (TrainRecipe.train_step), for several settings in one process.

    python scripts/gpu_profile.py --model DIR --out DIR [--steps 6] [--profile 2] \
        --variant "name: key=value key=value" --variant ...

Each variant composes the given overrides over the recipe and runs `--steps` steps; the last
`--profile` of them run under the profiler. Writes, per variant, the step times and the top
operators by host (self CPU) time and by device time to DIR/profile.md and profile.json. Made for
the GPU check's machine (no network: a model folder from `gpu_check.py --stages models`), and runs
on a CPU too (device columns then stay empty).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def profile_variant(name: str, overrides: list[str], steps: int, profiled: int, out: Path) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from tunekit.commands.compose import compose_configs
    from tunekit.train.loop import TrainRecipe

    run_dir = out / f"run-{name.replace(' ', '-')}"
    (cfg,) = compose_configs([*overrides, f"output_dir={run_dir}", "trainer.eval_every=1000000",
                              "trainer.save_every=1000000", "trainer.eval_samples=0", f"trainer.max_steps={steps}"])
    r = TrainRecipe(cfg, run_dir)
    t0 = time.perf_counter()
    r.setup()
    res = {"variant": name, "overrides": overrides, "setup_s": round(time.perf_counter() - t0, 2), "steps": []}
    cuda = torch.cuda.is_available()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    try:
        for step in range(steps - profiled):
            res["steps"].append(round(r.train_step(step)["step_time_s"], 3))
        with profile(activities=acts) as prof:
            for step in range(steps - profiled, steps):
                res["steps"].append(round(r.train_step(step)["step_time_s"], 3))
            if cuda:
                torch.cuda.synchronize()
    finally:
        r.cleanup()
    ka = prof.key_averages()
    dev_attr = "self_device_time_total" if hasattr(ka[0], "self_device_time_total") else "self_cuda_time_total"

    def top(attr: str, n: int = 25) -> list[dict]:
        rows = sorted(ka, key=lambda e: getattr(e, attr, 0) or 0, reverse=True)[:n]
        return [{"op": e.key[:90], "calls": e.count, "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 2),
                 "cpu_total_ms": round(e.cpu_time_total / 1e3, 2),
                 "self_device_ms": round((getattr(e, dev_attr, 0) or 0) / 1e3, 2)} for e in rows]

    res["by_host"] = top("self_cpu_time_total")
    res["by_device"] = top(dev_attr) if cuda else []
    res["profiled_steps_s"] = res["steps"][-profiled:]
    res["device_total_ms"] = round(sum((getattr(e, dev_attr, 0) or 0) for e in ka) / 1e3, 1)
    res["host_total_ms"] = round(sum(e.self_cpu_time_total for e in ka) / 1e3, 1)
    return res


def markdown(results: list[dict]) -> str:
    lines = ["# Step profiles", ""]
    for r in results:
        lines += [f"## {r['variant']}", "", f"overrides: `{' '.join(r['overrides'])}`", "",
                  f"setup {r.get('setup_s')} s; step times (s): {r.get('steps')}; profiled steps' host self time "
                  f"{r.get('host_total_ms')} ms, device self time {r.get('device_total_ms')} ms", ""]
        if "error" in r:
            lines += ["```", r["error"], "```", ""]
            continue
        for title, key in (("by host self time", "by_host"), ("by device self time", "by_device")):
            if r.get(key):
                lines += [f"### {title}", "", "| op | calls | self CPU ms | CPU total ms | self device ms |",
                          "|---|---:|---:|---:|---:|"]
                lines += [f"| `{e['op']}` | {e['calls']} | {e['self_cpu_ms']} | {e['cpu_total_ms']} | {e['self_device_ms']} |"
                          for e in r[key]]
                lines.append("")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--profile", type=int, default=2)
    p.add_argument("--variant", action="append", required=True, help='"name: key=value key=value"')
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for v in args.variant:
        name, _, rest = v.partition(":")
        overrides = [f"model.path={args.model}", *rest.split()]
        t0 = time.perf_counter()
        try:
            res = profile_variant(name.strip(), overrides, args.steps, args.profile, args.out)
        except Exception as e:  # one variant's failure costs that variant, not the others
            import traceback
            res = {"variant": name.strip(), "overrides": overrides, "error": traceback.format_exc()[-3000:]}
        res["wall_s"] = round(time.perf_counter() - t0, 1)
        results.append(res)
        print(f"gpu_profile: {res['variant']}: steps {res.get('steps')} ({res['wall_s']} s)", flush=True)
        (args.out / "profile.json").write_text(json.dumps(results, indent=2) + "\n")
        (args.out / "profile.md").write_text(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
