#!/usr/bin/env python
"""How many LoftQ alternations to run: per-layer errors on the embedded default model, T = 1..N.

For every LoRA target of recipes/recipe/qlora.yaml (its target_modules and r, scaling alpha / r) in
the embedded default model (SmolLM2-135M, or --model), each original weight W is read alone from the
model folder and LoftQ (tunekit.methods.lora.loftq) runs N alternations with the settings the loader
quantizes with (QuantSettings.from_loader, model.dtype=auto on this machine). Per layer and T:
err_plain = ||W - dequant(quant W)||_F and err_T = ||W - dequant(Q_T) - s B_T A_T||_F, and the time
to reach T. Iteration T's start does not depend on how many follow, so one pass gives every T.

Then (unless --no-apply) the real path once: the base loaded in 4-bit by the loader, LoRA applied as
the qlora recipe does, apply_loftq with --apply-iters; resident memory sampled during it against the
loaded model's, to show that it adds about one layer in full precision, not a full-precision model.

    python scripts/loftq_iters.py                  # writes benchmarks/quantization/loftq-iters-<date>.json and .md
    python scripts/loftq_iters.py --limit 14 --iters 3 --out /tmp/loftq-quick
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model folder (default: the embedded default model)")
    p.add_argument("--iters", type=int, default=5, help="largest T")
    p.add_argument("--limit", type=int, default=0, help="first N target layers only (0: all)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: steadier on a shared CPU)")
    p.add_argument("--apply-iters", type=int, default=1, help="T for the apply_loftq memory run")
    p.add_argument("--no-apply", action="store_true", help="skip the apply_loftq memory run")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "quantization" / f"loftq-iters-{time.strftime('%Y-%m-%d')}"))
    return p.parse_args(argv)


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), platform.processor())


def recipe() -> dict:
    from omegaconf import OmegaConf

    m = OmegaConf.load(REPO / "recipes" / "recipe" / "qlora.yaml").method
    return {"r": int(m.r), "alpha": float(m.alpha), "target_modules": list(m.target_modules)}


def target_names(model_dir: Path, targets: list[str]) -> list[str]:
    """Module names LoRA wraps: peft's all-linear (every Linear but the output head) or name suffixes."""
    import torch.nn as nn

    from tunekit.model.folder import model_skeleton

    skeleton = model_skeleton(str(model_dir))
    head = skeleton.get_output_embeddings()
    linear = [n for n, m in skeleton.named_modules() if isinstance(m, nn.Linear) and m is not head]
    if targets == ["all-linear"]:
        return linear
    return [n for n in linear if any(n == t or n.endswith("." + t) for t in targets)]


def measure_layers(model_dir: Path, names: list[str], r: int, scaling: float, iters: int, settings) -> list[dict]:
    from tunekit.methods.lora.loftq import loftq_iterates, read_original_weight, tensor_key

    rows = []
    for i, name in enumerate(names):
        t0 = time.perf_counter()
        w = read_original_weight(model_dir, tensor_key(name))
        read_s = time.perf_counter() - t0
        errs, secs = [], []
        start = time.perf_counter()
        for res in loftq_iterates(w, r, scaling, settings):
            errs.append(res.err_loftq)
            secs.append(time.perf_counter() - start)
            err_plain = res.err_plain
            if res.iters == iters:
                break
        shape = list(w.shape)
        del w, res
        rows.append({"name": name, "shape": shape, "err_plain": err_plain, "err": errs, "seconds": secs, "read_s": read_s})
        print(f"[{i + 1}/{len(names)}] {name}: plain {err_plain:.4f} -> " + " ".join(f"{e:.4f}" for e in errs), flush=True)
    return rows


def summarize(rows: list[dict], iters: int) -> list[dict]:
    out = []
    for t in range(iters):
        red = [1 - row["err"][t] / row["err_plain"] for row in rows]
        best = sum(1 for row in rows if min(range(iters), key=lambda k: row["err"][k]) == t)
        energy = 1 - (sum(row["err"][t] ** 2 for row in rows) / sum(row["err_plain"] ** 2 for row in rows)) ** 0.5
        out.append({"iters": t + 1, "mean_reduction": statistics.mean(red), "median_reduction": statistics.median(red),
                    "min_reduction": min(red), "max_reduction": max(red), "energy_reduction": energy,
                    "helps_fraction": sum(x > 0 for x in red) / len(red), "best_of_all": best,
                    "mean_seconds_per_layer": statistics.mean(row["seconds"][t] for row in rows)})
    return out


def by_kind(rows: list[dict], iters: int) -> dict:
    kinds: dict[str, list[dict]] = {}
    for row in rows:
        kinds.setdefault(row["name"].rsplit(".", 1)[-1], []).append(row)
    return {k: [statistics.mean(1 - row["err"][t] / row["err_plain"] for row in rs) for t in range(iters)]
            for k, rs in kinds.items()}


def apply_run(model_dir: Path, rec: dict, dtype, iters: int) -> dict:
    """The real path: 4-bit load, LoRA as the recipe, apply_loftq; RSS sampled every 5 ms."""
    from types import SimpleNamespace

    import torch

    from tunekit.methods import get_method
    from tunekit.methods.lora.loftq import apply_loftq, lora_scaling, lora_targets
    from tunekit.model import load_base_model

    base = load_base_model(str(model_dir), "nf4", dtype, torch.device("cpu"))
    cfg = SimpleNamespace(r=rec["r"], alpha=rec["alpha"], dropout=0.0, target_modules=rec["target_modules"])
    model = get_method("lora").apply(base, cfg)
    before = rss_mib()
    samples, stop = [before], threading.Event()

    def sample():
        while not stop.wait(0.005):
            samples.append(rss_mib())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    report = apply_loftq(model, model_dir, r=rec["r"], scaling=lora_scaling(model), iters=iters)
    seconds = time.perf_counter() - t0
    stop.set()
    sampler.join()
    biggest = max(t.base.weight.quant_state.shape.numel() for t in lora_targets(model).values())
    return {"iters": iters, "layers": len(report.layers), "kept": report.kept, "seconds": seconds,
            "rss_after_load_mib": before, "rss_peak_during_apply_mib": max(samples), "rss_samples": len(samples),
            "largest_weight_fp32_mib": biggest * 4 / 2**20, "summary": report.summary()}


def write_md(path: Path, data: dict) -> None:
    s, env = data["summary"], data["environment"]
    lines = [
        f"# LoftQ iterations on the default model ({data['date']})", "",
        f"`scripts/loftq_iters.py`: every LoRA target of recipes/recipe/qlora.yaml ({data['recipe']['target_modules']}, "
        f"r={data['recipe']['r']}, scaling {data['scaling']:g}) in {data['model']} ({data['layers']} layers), quantized "
        f"as the loader does ({data['settings']}). Per layer: err_plain = ||W - dequant(quant W)||_F, "
        "err_T = ||W - dequant(Q_T) - s B_T A_T||_F; reduction = 1 - err_T / err_plain.", "",
        f"Machine: {env['cpu']}, {env['cores']} cores, torch threads {env['torch_threads']}. Other processes were running "
        f"on the 2 cores during the run (load average {env['loadavg_start'][0]:.2f} at start, "
        f"{env['loadavg_end'][0]:.2f} at end): the times are indicative.", "",
        "| T | mean reduction | median | min | max | energy-weighted | layers helped | best T for | s / layer (cumulative) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in s:
        lines.append(f"| {row['iters']} | {100 * row['mean_reduction']:.2f}% | {100 * row['median_reduction']:.2f}% | "
                     f"{100 * row['min_reduction']:.2f}% | {100 * row['max_reduction']:.2f}% | "
                     f"{100 * row['energy_reduction']:.2f}% | {100 * row['helps_fraction']:.0f}% | "
                     f"{row['best_of_all']} | {row['mean_seconds_per_layer']:.3f} |")
    lines += ["", "Mean reduction per projection:", "",
              "| projection | " + " | ".join(f"T={t + 1}" for t in range(len(s))) + " |",
              "|---" * (len(s) + 1) + "|"]
    for kind, reds in data["by_projection"].items():
        lines.append(f"| {kind} | " + " | ".join(f"{100 * x:.2f}%" for x in reds) + " |")
    lines += ["", f"Peak RSS of the measuring pass (no model loaded, one weight at a time): {data['peak_rss_mib']:.0f} MiB, "
              f"of which {data['rss_after_imports_mib']:.0f} MiB after importing torch, transformers, peft and bitsandbytes "
              "(this pass leaves freed heap pages to the allocator; apply_loftq hands them back after each layer)."]
    lines += ["", "These are errors of the weights (how far base + adapter start from W), not of the model's outputs "
              "or of a fine-tune's result. T = 1 keeps the loader's own base (quant W) and changes only the LoRA start; "
              "T >= 2 requantizes the base, which every later load of the run (evaluation, export, resume) must "
              "rebuild from the original weights and the saved base factors (tunekit.methods.lora.loftq_io)."]
    if data.get("apply"):
        a = data["apply"]
        lines += ["", f"apply_loftq on the loaded 4-bit LoRA model (T={a['iters']}): {a['summary']}; {a['seconds']:.1f} s. "
                  f"RSS {a['rss_after_load_mib']:.0f} MiB after the load, peak {a['rss_peak_during_apply_mib']:.0f} MiB "
                  f"during it (+{a['rss_peak_during_apply_mib'] - a['rss_after_load_mib']:.0f} MiB; the largest LoRA target "
                  f"weight in fp32 is {a['largest_weight_fp32_mib']:.1f} MiB, the model's safetensors files "
                  f"{data['model_files_mib']:.0f} MiB)."]
    path.write_text("\n".join(lines) + "\n")


def main(argv=None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import bitsandbytes
    import peft
    import safetensors
    import torch
    import transformers

    from tunekit.methods.lora.loftq import QuantSettings, settings_record
    from tunekit.model import compute_dtype, default_model_dir

    torch.set_num_threads(args.threads)
    model_dir = Path(args.model) if args.model else default_model_dir()
    rec = recipe()
    scaling = rec["alpha"] / rec["r"]
    dtype = compute_dtype("auto", torch.device("cpu"))
    settings = QuantSettings.from_loader(dtype)
    names = target_names(model_dir, rec["target_modules"])
    names = names[: args.limit] if args.limit else names
    rss_after_imports = rss_mib()
    env = {"cpu": cpu_model(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
           "loadavg_start": os.getloadavg(), "python": platform.python_version(),
           "versions": {m.__name__: m.__version__ for m in (torch, bitsandbytes, peft, transformers, safetensors)}}
    t0 = time.perf_counter()
    rows = measure_layers(model_dir, names, rec["r"], scaling, args.iters, settings)
    data = {"date": time.strftime("%Y-%m-%d"), "model": str(model_dir.name), "recipe": rec, "scaling": scaling,
            "settings": settings_record(settings), "layers": len(rows), "wall_s": time.perf_counter() - t0,
            "peak_rss_mib": peak_rss_mib(), "rss_after_imports_mib": rss_after_imports, "summary": summarize(rows, args.iters),
            "by_projection": by_kind(rows, args.iters), "rows": rows, "environment": env,
            "model_files_mib": sum(f.stat().st_size for f in model_dir.glob("*.safetensors")) / 2**20}
    if not args.no_apply:
        data["apply"] = apply_run(model_dir, rec, dtype, args.apply_iters)
    env["loadavg_end"] = os.getloadavg()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(data, indent=1, default=str) + "\n")
    write_md(out.with_suffix(".md"), data)
    print(out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
