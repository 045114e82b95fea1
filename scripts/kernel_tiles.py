#!/usr/bin/env python
"""Shared memory each config of the fused NF4 LoRA matmul needs, per NVIDIA target, vs the limit.

Cross-compiles the kernel (Triton's wheel ships ptxas: no GPU needed) for sm_75, sm_80, sm_86,
sm_89 and sm_90 in every dtype the kernels run in there, and prints one table per dtype:
config x compute capability, the bytes one block needs (the compiler's ``metadata.shared``)
against the per-block limit, and whether the autotuner is offered the config on that target
(kernels/tiles.py prunes the others). Every config of the dtype is compiled, pruned ones too.

``--before REV`` adds the same table for the kernels at git revision REV (its own configs), e.g.
the commit before the kernel stopped gathering per element in its K loop.

    python scripts/kernel_tiles.py --before 2cba8b8 --out benchmarks/kernels/kernel-fit.md

Needs TRITON_INTERPRET unset. A full run compiles ~150 kernels: minutes on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import importlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchlib import import_kernels  # tunekit_kernels, installed or from this checkout

REPO = Path(__file__).resolve().parents[1]
BEFORE_PKG = "tunekit_kernels_before"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", metavar="REV", help="also tabulate the kernels of this git revision")
    p.add_argument("--launches", default="forward", help="comma-separated: forward, dx (default forward)")
    p.add_argument("--workers", type=int, default=2, help="compiling processes (default 2)")
    p.add_argument("--out", type=Path, help="also write the tables to this markdown file")
    return p.parse_args(argv)


def import_before(rev: str):
    """kernels/ at git revision ``rev`` as the package BEFORE_PKG (written to a temporary folder)."""
    names = subprocess.run(["git", "ls-tree", "--name-only", rev, "kernels/"], cwd=REPO, check=True,
                           capture_output=True, text=True).stdout.split()
    root = Path(tempfile.mkdtemp(prefix="kernel-tiles-"))
    atexit.register(shutil.rmtree, root, True)
    pkg = root / BEFORE_PKG
    pkg.mkdir()
    for name in names:
        if name.endswith(".py"):
            text = subprocess.run(["git", "show", f"{rev}:{name}"], cwd=REPO, check=True,
                                  capture_output=True, text=True).stdout
            (pkg / Path(name).name).write_text(text)
    sys.path.insert(0, str(root))
    return importlib.import_module(f"{BEFORE_PKG}.lora")


def _old_launch(old_kernel, tiles, new_kernel, dtype, launch):
    """The launch of the revision's kernel with the arguments today's makes, matched by name."""
    new_fn, old_fn = tiles.jit_function(new_kernel), tiles.jit_function(old_kernel)
    args, constexprs = tiles.matmul_launches(dtype, **tiles.CHECK_SHAPE)[launch]
    runtime = [p.name for p in new_fn.params if not p.is_constexpr]
    named = {**dict(zip(runtime, args)), **constexprs}
    old_params = {p.name: p for p in old_fn.params}
    old_args = tuple(named[n] for n in old_fn.arg_names if not old_params[n].is_constexpr)
    old_const = {n: named[n] for n in old_fn.arg_names if old_params[n].is_constexpr and n in named}
    return old_args, old_const


def compile_job(job):
    which, launch, cap, dname, key = job
    tiles = importlib.import_module("tunekit_kernels.tiles")
    lora = importlib.import_module("tunekit_kernels.lora")
    dtype = tiles._dtype(dname)
    start = time.perf_counter()
    try:
        if which == "after":
            config = next(c for c in tiles.matmul_configs(dtype) if tiles.config_key(c) == key)
            args, constexprs = tiles.matmul_launches(dtype, **tiles.CHECK_SHAPE)[launch]
            shared = tiles.shared_memory(lora._nf4_lora_matmul_kernel, args, constexprs, cap, config, **lora.OPTIONS)
        else:
            old = importlib.import_module(f"{BEFORE_PKG}.lora")
            config = next(c for c in old._configs() if tiles.config_key(c) == key)
            args, constexprs = _old_launch(old._nf4_lora_matmul_kernel, tiles, lora._nf4_lora_matmul_kernel,
                                           dtype, launch)
            shared = tiles.shared_memory(old._nf4_lora_matmul_kernel, args, constexprs, cap, config,
                                       enable_fp_fusion=False)
        error = None
    except Exception as e:  # noqa: BLE001 - a config that does not compile is a table entry too
        shared, error = None, f"{type(e).__name__}: {str(e).strip().splitlines()[0][:120] if str(e).strip() else ''}"
    return dict(which=which, launch=launch, capability=cap, dtype=dname, key=key, shared=shared, error=error,
                seconds=round(time.perf_counter() - start, 2))


def jobs_for(tiles, which, configs_of, launches):
    jobs = []
    for launch in launches:
        for cap in tiles.TARGETS:
            for dtype in tiles.dtypes_for(cap):
                jobs += [(which, launch, cap, tiles.dtype_name(dtype), tiles.config_key(c)) for c in configs_of(dtype)]
    return jobs


def table(tiles, rows, which, launch, dname, configs, after: bool) -> list[str]:
    caps = [c for c in tiles.TARGETS if any(tiles.dtype_name(d) == dname for d in tiles.dtypes_for(c))]
    head = "| config | " + " | ".join(f"sm_{a}{b} (limit {tiles.SMEM_LIMIT[(a, b)]:,})" for a, b in caps) + " |"
    lines = [head, "|---|" + "---|" * len(caps)]
    by = {(r["capability"], r["key"]): r for r in rows
          if r["which"] == which and r["launch"] == launch and r["dtype"] == dname}
    for config in configs:
        key = tiles.config_key(config)
        cells = []
        for cap in caps:
            r = by.get((cap, key))
            if r is None:
                cells.append("-")
                continue
            limit = tiles.SMEM_LIMIT[cap]
            if r["shared"] is None:
                cells.append(f"does not compile ({r['error']})")
                continue
            fits = r["shared"] <= limit
            cell = f"{r['shared']:,} {'fits' if fits else '**over**'}"
            if after:
                offered = key in {tiles.config_key(c) for c in tiles.configs_for(cap, tiles._dtype(dname))}
                est = tiles.matmul_shared_estimate(config, tiles._dtype(dname), cap)
                cell += f"; {'offered' if offered else 'pruned'} (estimate {est:,})"
            cells.append(cell)
        lines.append(f"| {tiles.config_name(config)} | " + " | ".join(cells) + " |")
    return lines


def main(argv=None):
    args = parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        sys.exit("kernel_tiles: unset TRITON_INTERPRET (the kernels must be compiled, not interpreted)")
    import torch
    import triton

    import_kernels()
    from tunekit_kernels import tiles

    launches = [s.strip() for s in args.launches.split(",") if s.strip()]
    jobs = jobs_for(tiles, "after", tiles.matmul_configs, launches)
    old = None
    if args.before:
        old = import_before(args.before)
        jobs += jobs_for(tiles, "before", lambda dtype: old._configs(), ["forward"])
    start = time.perf_counter()
    if args.workers > 1:
        import multiprocessing

        with multiprocessing.get_context("fork").Pool(args.workers) as pool:
            rows = pool.map(compile_job, jobs, chunksize=1)
    else:
        rows = [compile_job(j) for j in jobs]
    wall = time.perf_counter() - start
    shape = tiles.CHECK_SHAPE
    cpu = f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs"
    out = [
        "# Fused NF4 LoRA matmul: shared memory per block vs the device limit",
        "",
        f"Cross-compiled with Triton {triton.__version__} (its bundled ptxas) on a CPU-only machine ({cpu}, "
        f"no GPU), torch {torch.__version__}, {datetime.date.today().isoformat()}: "
        f"`python scripts/kernel_tiles.py{' --before ' + args.before if args.before else ''}"
        f"{' --launches ' + args.launches if args.launches != 'forward' else ''}` "
        f"({len(jobs)} compiles, {wall:.0f} s with {args.workers} processes).",
        "",
        "Each cell: the bytes of shared memory one block needs (`metadata.shared`, what a launch asks "
        "the device for) and whether that fits the target's per-block opt-in limit. Launch: the "
        f"training forward (x @ W^T, LoRA term and bias in the epilogue, fp32 output for a half-precision x) "
        f"with 4096 tokens, W {shape['n_out']}x{shape['n_in']} in NF4 blocks of {shape['blocksize']} (rows not "
        "starting on a block: the most scale blocks per tile), rank 16; `dx` is the backward's W launch "
        "with the dropout mask. bf16 and fp16 run from sm_80; sm_75 trains in fp32.",
    ]
    if old is not None:
        out += ["", f"## Before ({args.before}): {len(old._configs())} configs for every dtype, code book and "
                "scales gathered per weight element inside the K loop", ""]
        for dname in ("fp32", "bf16", "fp16"):
            out += [f"### {dname}, forward", ""]
            out += table(tiles, rows, "before", "forward", dname, old._configs(), after=False) + [""]
    out += ["", "## After: per-dtype tiles, code book in registers, scales once per tile row, pruned per device",
            "", "\"offered\": the autotuner sees the config on that target (its estimate, an upper bound, fits); "
            "\"pruned\": it does not.", ""]
    for launch in launches:
        for dname in ("fp32", "bf16", "fp16"):
            out += [f"### {dname}, {launch}", ""]
            out += table(tiles, rows, "after", launch, dname, tiles.matmul_configs(tiles._dtype(dname)), after=True) + [""]
    text = "\n".join(out).rstrip() + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
        print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
