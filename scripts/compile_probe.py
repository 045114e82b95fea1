#!/usr/bin/env python
"""Probe: does torch.compile (inductor, CPU) over the decoder blocks speed up a qlora step?

Builds the same setup as `scripts/bench_train.py --config cpu` (default model, qlora, seq 256,
micro-batch 8 x 2, padded) with tunekit's TrainRecipe, `compile` with kernels.compile=true
(tunekit/speed/torch_compile.py: the check, then every decoder layer's training forward compiled; an
earlier version of this probe compiled the layers itself, with `nn.Module.compile(dynamic=True)`), then
times optimizer steps 2-4 after two warm-up steps (the first pays the compilation). Prints each
step's loss so eager and compiled can be compared.

    python scripts/compile_probe.py eager
    python scripts/compile_probe.py compile
    python scripts/compile_probe.py eager --residual bf16    # norms, embedding, head in bf16 (see below)
    python scripts/compile_probe.py check --recipe lora --dtype bf16   # the check alone, every tensor

`check` runs setup only (kernels.compile=true: the check on the last layer, then compiling) and
prints, for every compared tensor, the compiled-vs-eager difference and, in half precision, both
sides' distance from the layer run in fp32 (tunekit/speed/torch_compile.py's `judge` sees the same figures).

Compiled losses must follow eager's to rounding. They once parted after step 0: torch 2.13's inductor
drops `alpha` from `add_(a @ b, alpha=s)`, which the LoRA math then used, so the compiled layers
computed every LoRA term at scaling 1 instead of alpha/r (benchmarks/history/training-speed.md has
the correction and the figures with the fix).

`--residual bf16` casts any frozen fp32 parameter (norms, embedding, output head) to bf16 after
setup. Under the bf16 precision policy (docs/precision.md) they are bf16 already and it changes
nothing; with model.dtype=fp32 it shows what a bf16 residual stream alone is worth.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from benchlib import build_cfg


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    mode = argv[0] if argv else "eager"
    residual = argv[argv.index("--residual") + 1] if "--residual" in argv else "fp32"
    if mode == "check":
        recipe = argv[argv.index("--recipe") + 1] if "--recipe" in argv else "qlora"
        dtype = argv[argv.index("--dtype") + 1] if "--dtype" in argv else "auto"
        recipes = sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "recipes" / "recipe").glob("*.yaml"))
        if recipe not in recipes or dtype not in ("auto", "bf16", "fp32"):
            raise SystemExit(f"compile_probe.py check: --recipe is one of {', '.join(recipes)}; "
                             f"--dtype one of auto, bf16, fp32 (got {recipe}, {dtype})")
        return check(recipe, dtype)
    if mode not in ("eager", "compile") or residual not in ("fp32", "bf16"):
        raise SystemExit("usage: compile_probe.py eager|compile [--residual fp32|bf16] | "
                         "check [--recipe R] [--dtype auto|bf16|fp32]")
    import torch

    r = _setup("qlora", 8, ["kernels.compile=true"] if mode == "compile" else [])
    model = r.model.base_model.model if hasattr(r.model, "base_model") else r.model
    if residual == "bf16":
        for p in model.parameters():
            if p.dtype == torch.float32 and not p.requires_grad:
                p.data = p.data.to(torch.bfloat16)
    if mode == "compile":
        print(f"compile: {r.compiled.reason}", flush=True)
    for step in range(2):
        t0 = time.perf_counter()
        m = r.train_step(step)
        print(f"step {step}: {time.perf_counter() - t0:.1f} s, loss {m['loss']:.6f}", flush=True)
    tokens, t0 = 0, time.perf_counter()
    for step in range(2, 5):
        m = r.train_step(step)
        tokens += m["input_tokens"]
        print(f"step {step}: loss {m['loss']:.6f}", flush=True)
    print(f"{mode}, residual {residual}: {tokens / (time.perf_counter() - t0):.1f} tokens/s over steps 2-4", flush=True)
    return 0


def _setup(recipe: str, steps: int, overrides: list[str]):
    """TrainRecipe set up as `bench_train.py --config cpu` builds it (default model, seq 256, 8 x 2, padded)."""
    from tunekit.train.loop import TrainRecipe

    spec = {"recipe": recipe, "steps": steps, "micro_batch_size": 8, "grad_accum": 2, "seq_len": 256,
            "packing": "false", "model": None, "data": None, "set": overrides}
    out = tempfile.mkdtemp(prefix="tunekit-compile-probe-")
    r = TrainRecipe(build_cfg(spec, out), Path(out))
    r.setup()
    return r


def check(recipe: str, dtype: str) -> int:
    from tunekit.speed import torch_compile as compiled

    seen = []  # judge's arguments, once per check batch
    judge = compiled.judge

    def spy(diffs, near, tol):
        seen.append((diffs, near))
        return judge(diffs, near, tol)

    compiled.judge = spy
    r = _setup(recipe, 2, ["kernels.compile=true", f"model.dtype={dtype}"])
    print(f"recipe {recipe}, compute {r.dtype}: {r.compiled.reason}")
    for label, (diffs, near) in zip(r.compiled.check["batches"], seen):
        print(f"\n{label}:\n\n| tensor | compiled vs eager | compiled vs fp32 | eager vs fp32 |\n|---|---:|---:|---:|")
        for name, d in diffs.items():
            far = " | ".join(f"{v:.2e}" for v in near[name]) if name in near else "- | -"
            print(f"| {name.replace('.default.weight', '')} | {d:.2e} | {far} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
