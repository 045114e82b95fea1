"""Export one finished run in every deployable form and tabulate the fidelity reports and wall times.

    python scripts/bench_export.py RUN_DIR [--out-dir DIR] [--md benchmarks/export/export-cpu.md] [--only NAME ...]

Each export runs through the real CLI (`tunekit export ... --force`, so a refused export still
leaves its report to read; the gate's verdict is the report's "accepted"), one after another,
and its wall time is taken around the whole process (imports included), as a user sees it.
Run it on a quiet machine: the figures are meaningless while other jobs share the CPU. With
--before-src PATH (a checkout of an older tunekit), the same command runs that code for the
"before" column (its own report format is kept raw in the JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

EXPORTS = {  # name -> CLI arguments after RUN_DIR
    "merged auto (default: into original)": ["--format", "merged"],
    "merged auto, into dequantized NF4": ["--format", "merged", "--merge-into", "dequantized"],
    "merged fp32, into dequantized NF4": ["--format", "merged", "--dtype", "fp32", "--merge-into", "dequantized"],
    "merged nf4 re-quantized, from dequantized NF4": ["--format", "merged", "--requantize", "nf4", "--merge-into", "dequantized"],
    "gguf auto (default: into original)": ["--format", "gguf"],
    "gguf auto, into dequantized NF4": ["--format", "gguf", "--merge-into", "dequantized"],
    "gguf Q8_0 (into original)": ["--format", "gguf", "--dtype", "Q8_0"],
    "gguf Q8_0, into dequantized NF4": ["--format", "gguf", "--dtype", "Q8_0", "--merge-into", "dequantized"],
    "gguf Q4_K_M (into original)": ["--format", "gguf", "--dtype", "Q4_K_M"],
    "gguf Q4_K_M, into dequantized NF4": ["--format", "gguf", "--dtype", "Q4_K_M", "--merge-into", "dequantized"],
}


def versions() -> str:
    import importlib.metadata as md

    names = ("torch", "transformers", "peft", "bitsandbytes", "gguf", "llama_cpp_python")
    found = []
    for n in names:
        try:
            found.append(f"{n} {md.version(n)}")
        except md.PackageNotFoundError:
            found.append(f"{n} (not installed)")
    return ", ".join(found)


def cpu() -> str:
    try:
        model = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        model = platform.processor()
    return f"{model}, {os.cpu_count()} cores"


def run_one(run_dir: Path, name: str, args: list[str], out_dir: Path, env: dict) -> dict:
    is_gguf = "gguf" in args
    slug = "".join(c if c.isalnum() or c in "-_" else "-" for c in name)
    out = out_dir / (slug + (".gguf" if is_gguf else ""))
    report_file = Path(f"{out}.fidelity.json") if is_gguf else out / "fidelity.json"
    for p in (out, report_file):
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()
    cmd = [sys.executable, "-c", "import sys; from tunekit.commands.main import main; sys.argv[0] = 'tunekit'; main()",
           "export", str(run_dir), *args, "--out", str(out), "--force"]
    started = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.time() - started
    report = json.loads(report_file.read_text()) if report_file.is_file() else None
    size = (out.stat().st_size if out.is_file() else sum(f.stat().st_size for f in out.rglob("*") if f.is_file())) \
        if out.exists() else None
    return {"name": name, "args": args, "wall_s": round(wall, 1), "rc": proc.returncode, "bytes": size,
            "stdout": proc.stdout[-3000:], "stderr": proc.stderr[-1500:], "report": report}


def row(r: dict) -> str:
    rep = r["report"]
    if rep is None or "gain_kept" not in rep.get("fidelity", {}):
        return f"| {r['name']} | (rc {r['rc']}, no new-style report) | | | | | | | {r['wall_s']} |"
    f = rep["fidelity"]
    verdict = "OK" if rep["accepted"] else "refused"
    size = f"{r['bytes'] / 2**20:.0f} MiB" if r["bytes"] else ""
    return (f"| {r['name']} | {rep['dtype']} | {f['ppl_exported']:.3f} | {100 * f['gain_kept']:.1f}% | "
            f"{f['kl_mean']:.2e} | {f['max_abs_logit_diff']:.2f} | {100 * f['top1_agreement']:.2f}% | {verdict} | "
            f"{r['wall_s']} | {size} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--out-dir", type=Path, default=Path("/tmp/tunekit-bench-export"))
    ap.add_argument("--md", type=Path, help="write the markdown table (and the raw JSON beside it)")
    ap.add_argument("--only", nargs="*", help="names (substrings) of the exports to run")
    ap.add_argument("--before-src", type=Path, help="an older tunekit checkout to time instead (PYTHONPATH)")
    a = ap.parse_args()
    env = dict(os.environ)
    if a.before_src:
        env["PYTHONPATH"] = str(a.before_src) + os.pathsep + env.get("PYTHONPATH", "")
    a.out_dir.mkdir(parents=True, exist_ok=True)
    chosen = {n: v for n, v in EXPORTS.items() if not a.only or any(o in n for o in a.only)}
    results = []
    for name, args in chosen.items():
        r = run_one(a.run_dir.absolute(), name, args, a.out_dir, env)
        print(f"{name}: {r['wall_s']} s, rc {r['rc']}", flush=True)
        results.append(r)
    first = next((r["report"] for r in results if r["report"] and "loss_base" in r["report"].get("fidelity", {})), None)
    lines = [f"machine: {cpu()}; {versions()}", ""]
    if first:
        f = first["fidelity"]
        lines.append(f"held-out: {f['batches']} batches, {f['positions']} tokens ({f['response_tokens']} response); "
                     f"base ppl {f['ppl_base']:.3f} (loss {f['loss_base']:.4f}), trained ppl {f['ppl_trained']:.3f} "
                     f"(loss {f['loss_trained']:.4f}), gain {f['gain']:.4f} nats/token")
        lines.append("")
    lines += ["| export | dtype | ppl | gain kept | KL(trained‖exp) | max \\|Δlogit\\| | top-1 | gate | wall s | size |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [row(r) for r in results]
    text = "\n".join(lines) + "\n"
    print(text)
    if a.md:
        a.md.parent.mkdir(parents=True, exist_ok=True)
        a.md.write_text(text)
        a.md.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
