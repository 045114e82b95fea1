#!/usr/bin/env python
"""The memory planner against the measured peak of a real training step on the CPU.

For each configuration, a child process (forked from a parent that has already imported torch,
transformers, peft, bitsandbytes and loaded the tokenizer, so that runtime is the baseline) runs
tunekit's own trainer:

    baseline RSS -> TrainRecipe.setup() -> one tiny warm-up step (allocates the optimizer state,
    first-call kernel buffers) -> reset the peak (VmHWM, as scripts/bench_train.py) -> one
    optimizer step on the planner's worst micro-batch -> peak RSS

measured = peak RSS - baseline RSS: everything the run added (weights, trainable parameters,
gradients, optimizer state, activations, loss), the same quantity the planner's "peak of one
step" predicts (`Plan.peak`, the runtime baseline excluded). The worst micro-batch is what the
plan assumes: micro_batch_size text rows, one of max_seq_len tokens and the rest one token
shorter (so the batch is padded and attention gets a mask, as on real data), every token trained.

    python scripts/bench_plan.py                       # the default model, writes benchmarks/plan/plan-cpu.md/.json
    python scripts/bench_plan.py --configs suite --model DIR --out /tmp/x   # the test suite's configurations

trainer.strategy=fsdp on two gloo ranks: scripts/bench_plan_fsdp.py.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from benchlib import (LIVE_MMAP_THRESHOLD, quiet_libraries, M_MMAP_THRESHOLD, SUITE_MODEL_NAME, FixedSchedule, build_suite_model,
                      machine, rss_kib, warm_parent, worst_batch)

REPO = Path(__file__).resolve().parents[1]

# (name, overrides). Each one differs in what dominates: weights, activations, loss, teacher.
DEFAULT_CONFIGS = [
    ("qlora ckpt, 4x512", "recipe=qlora model.gradient_checkpointing=true trainer.micro_batch_size=4 data.max_seq_len=512"),
    ("qlora no ckpt, 4x512", "recipe=qlora model.gradient_checkpointing=false trainer.micro_batch_size=4 data.max_seq_len=512"),
    ("lora, 1x1024", "recipe=lora trainer.micro_batch_size=1 data.max_seq_len=1024"),
    ("lora ckpt, 16x128", "recipe=lora model.gradient_checkpointing=true trainer.micro_batch_size=16 data.max_seq_len=128"),
    ("lora packed, 8x128", "recipe=lora data.packing=true trainer.micro_batch_size=8 data.max_seq_len=128"),
    ("adapter, 4x256", "recipe=adapter trainer.micro_batch_size=4 data.max_seq_len=256"),
    ("prompt_tuning, 4x256", "recipe=prompt_tuning trainer.micro_batch_size=4 data.max_seq_len=256"),
    ("distill qlora ckpt, 4x256", "recipe=distill model.gradient_checkpointing=true trainer.micro_batch_size=4 data.max_seq_len=256"),
    ("dpo qlora no ckpt, 2 pairs x256", "recipe=dpo model.gradient_checkpointing=false trainer.micro_batch_size=2 "
                                        "data.max_seq_len=256"),
    ("dpo qlora ckpt, 4 pairs x256", "recipe=dpo model.gradient_checkpointing=true trainer.micro_batch_size=4 "
                                     "data.max_seq_len=256"),
    ("qlora adamw_8bit dropout, 2x512", "recipe=qlora model.gradient_checkpointing=false method.dropout=0.1 "
     "trainer.optimizer=adamw_8bit trainer.micro_batch_size=2 data.max_seq_len=512"),
    # fp32 weights, stochastic bf16 copies under autocast (where the CPU computes in bf16)
    ("full no ckpt, 2x256", "recipe=full model.gradient_checkpointing=false trainer.micro_batch_size=2 "
                            "data.max_seq_len=256"),
    ("full ckpt, 4x256", "recipe=full model.gradient_checkpointing=true trainer.micro_batch_size=4 "
                         "data.max_seq_len=256"),
]
# The suite's configurations run on a smaller random Llama (tests/plan/test_plan_measured.py).
SUITE_CONFIGS = [
    ("qlora ckpt, 8x256", "recipe=qlora model.gradient_checkpointing=true trainer.micro_batch_size=8 data.max_seq_len=256"),
    ("qlora no ckpt, 2x512", "recipe=qlora model.gradient_checkpointing=false trainer.micro_batch_size=2 data.max_seq_len=512"),
    ("lora, 1x1024", "recipe=lora trainer.micro_batch_size=1 data.max_seq_len=1024"),
    ("lora ckpt, 16x128", "recipe=lora model.gradient_checkpointing=true trainer.micro_batch_size=16 data.max_seq_len=128"),
    ("lora packed, 8x128", "recipe=lora data.packing=true trainer.micro_batch_size=8 data.max_seq_len=128"),
    ("adapter, 4x256", "recipe=adapter trainer.micro_batch_size=4 data.max_seq_len=256"),
    ("prompt_tuning, 4x256", "recipe=prompt_tuning trainer.micro_batch_size=4 data.max_seq_len=256"),
    ("distill qlora ckpt, 4x256", "recipe=distill model.gradient_checkpointing=true trainer.micro_batch_size=4 data.max_seq_len=256"),
    ("dpo qlora no ckpt, 2 pairs x256", "recipe=dpo model.gradient_checkpointing=false trainer.micro_batch_size=2 "
                                        "data.max_seq_len=256"),
]
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", choices=["default", "suite"], default="default")
    p.add_argument("--only", help="comma-separated config names (substring match)")
    p.add_argument("--model", help="model folder (default: the embedded default model; suite: built under --work)")
    p.add_argument("--work", type=Path, help="folder for the suite model, data and runs (default: a temp folder)")
    p.add_argument("--allocator", choices=["live", "glibc", "both"], default="both",
                   help="measure with glibc's mmap threshold fixed (live memory), as it comes, or both")
    p.add_argument("--steps", type=int, default=3, help="measured optimizer steps per configuration (max peak)")
    p.add_argument("--out", type=Path, help="output path without suffix (default benchmarks/plan/plan-cpu[-suite])")
    return p.parse_args(argv)


def measure(overrides: list[str], work: Path, steps: int) -> dict:
    """One configuration, in this (fresh, forked) process."""
    import torch

    from tunekit.commands.compose import compose_configs
    from tunekit.device.facts import probe
    from tunekit.plan import dynamic_bytes, predict
    from tunekit.plan.inputs import planner_inputs
    from tunekit.commands.plan import resolve_auto
    from tunekit.train.loop import TrainRecipe

    out = Path(tempfile.mkdtemp(dir=work))
    (cfg,) = compose_configs(overrides + [f"output_dir={out}/run", "trainer.eval_every=1000000",
                                          "trainer.save_every=1000000", "trainer.max_steps=10", "trainer.grad_accum=1"])
    facts = probe(torch.device("cpu"))
    resolve_auto(cfg, facts, None, 1)  # what train would pick here; the recipe below then runs that
    shape, setup = planner_inputs(cfg, facts)
    plan = predict(shape, setup, facts)
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # what the parent freed is not this run's to reuse
    base = rss_kib()
    r = TrainRecipe(cfg, out / "run")
    r.setup()
    after_setup = rss_kib()
    t = cfg.trainer
    rows = worst_batch(cfg.data.max_seq_len, t.micro_batch_size * setup.rows_per_example, shape.vocab_size,
                       r.tokenizer.eos_token_id)
    if cfg.objective == "preference" and setup.rows_per_example == 2:  # N pairs: the 2N rows, paired up
        n = t.micro_batch_size
        rows = [{**a, "rejected_input_ids": b["input_ids"], "rejected_labels": b["labels"]}
                for a, b in zip(rows[:n], rows[n:])]
    # Warm-up on the measured shapes: optimizer state, first-call buffers, and the per-shape
    # matmul kernels oneDNN JIT-compiles and caches for bf16 (~13 MiB on the suite's qlora over
    # the bf16 LoRA path, the same for 1, 4 or 8 rows: code and scratch, not tensors).
    r.train_data, r.schedule = rows, FixedSchedule(len(rows), t.grad_accum)
    r.train_step(0)
    before = rss_kib()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    peaks, seconds = [], []
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        row = r.train_step(step)
        seconds.append(time.perf_counter() - t0)
        peaks.append((rss_kib("VmHWM") - before) / 1024)
    return {"measured_mib": max(peaks), "peaks_mib": peaks, "setup_mib": (after_setup - base) / 1024,
            "after_warmup_mib": (before - base) / 1024, "predicted_mib": dynamic_bytes(plan.memory) / 2**20,
            "cpu_margin_mib": plan.overhead()["allocator margin (glibc)"] / 2**20,
            "predicted_peak_mib": plan.peak / 2**20, "phase": plan.memory.phase, "step_s": seconds,
            "terms_mib": {k: v / 2**20 for k, v in plan.memory.terms.items()},
            "loss": row["loss"], "input_tokens": row["input_tokens"],
            "trained_tokens": row.get("trained_tokens")}


def pairs_file(work: Path) -> Path:
    path = work / "pairs.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Count to {i}.", "chosen": " ".join(map(str, range(i))),
                                        "rejected": "No."}) + "\n" for i in range(2, 42)))
    return path


def run_forked(overrides: list[str], work: Path, steps: int, mmap_threshold: int = 0) -> dict:
    """measure() in a forked child: it inherits the imported runtime, and its peak is its own.

    mmap_threshold > 0 fixes glibc's mmap threshold in the child (mallopt M_MMAP_THRESHOLD):
    larger blocks are then returned to the system when freed, so the peak RSS is the peak of
    live memory; 0 keeps glibc's default (a threshold that rises with every large free, after
    which freed tensors stay resident in the heap).
    """
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(read)
        try:
            if mmap_threshold:
                ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, mmap_threshold)
            result = {"ok": True, **measure(overrides, work, steps)}
        except BaseException as e:  # report, never fall back into the parent's code
            import traceback

            result = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
        with os.fdopen(write, "w") as f:
            f.write(json.dumps(result))
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        data = f.read()
    os.waitpid(pid, 0)
    return json.loads(data) if data else {"ok": False, "error": "child died without a result"}


def main(argv=None):
    args = parse_args(argv)
    quiet_libraries()
    import torch

    from tunekit.model import default_model_dir

    work = args.work or Path(tempfile.mkdtemp(prefix="bench-plan-"))
    work.mkdir(parents=True, exist_ok=True)
    configs = DEFAULT_CONFIGS if args.configs == "default" else SUITE_CONFIGS
    if args.only:
        wanted = args.only.split(",")
        configs = [c for c in configs if any(w in c[0] for w in wanted)]
    model = args.model or (str(default_model_dir()) if args.configs == "default"
                           else str(build_suite_model(work / "suite-llama", str(default_model_dir()))))
    warm_parent(model)
    modes = {"live": LIVE_MMAP_THRESHOLD, "glibc": 0}
    wanted = list(modes) if args.allocator == "both" else [args.allocator]
    rows = []
    for name, over in configs:
        extra = [f"model.path={model}"]
        if "recipe=distill" in over:
            extra.append(f"distill.teacher={model}")
        if "recipe=dpo" in over:  # the run needs a file of pairs; the measured batch is the worst one
            extra.append(f"data.path={pairs_file(work)}")
        row = {"name": name, "overrides": over}
        for mode in wanted:
            res = run_forked(over.split() + extra, work, args.steps, modes[mode])
            if not res["ok"]:
                sys.exit(f"{name} ({mode}): {res['error']}\n{res.get('trace', '')}")
            row.update({k: v for k, v in res.items() if k not in ("ok", "measured_mib", "peaks_mib")})
            row[f"measured_{mode}_mib"], row[f"peaks_{mode}_mib"] = res["measured_mib"], res["peaks_mib"]
            row[f"error_{mode}_pct"] = 100 * (res["predicted_mib"] / res["measured_mib"] - 1)
            if mode == "glibc":  # the device total's stated glibc margin, against glibc as it comes
                row["error_glibc_margin_pct"] = 100 * ((res["predicted_mib"] + res["cpu_margin_mib"])
                                                      / res["measured_mib"] - 1)
            print(f"{name:34s} {mode:5s} measured {res['measured_mib']:8.1f} MiB  predicted {res['predicted_mib']:8.1f} "
                  f"MiB  {row[f'error_{mode}_pct']:+6.1f}%  ({res['phase']}; peaks "
                  f"{[round(x) for x in res['peaks_mib']]})", file=sys.stderr, flush=True)
        rows.append(row)

    out = args.out or REPO / "benchmarks" / "plan" / ("plan-cpu" if args.configs == "default" else "plan-cpu-suite")
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {**machine(), "model": model if args.configs == "default" or args.model else SUITE_MODEL_NAME, "configs": args.configs, "steps": args.steps,
            "metric": "max over the steps of (VmHWM during the step - VmRSS after setup and a warm-up step)",
            "predicted": "Plan.peak minus its static terms (base/teacher weights, trainable parameters, optimizer "
                         "state, weight copies): gradients, activations and the loss's working set",
            "live_mmap_threshold": LIVE_MMAP_THRESHOLD}
    out.with_suffix(".json").write_text(json.dumps({**meta, "results": rows}, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(meta, rows, wanted) + "\n")
    print(f"wrote {out.with_suffix('.md')} and .json", file=sys.stderr)


INTRO = """What is compared: the planner's *growth of one training step* (its peak minus the state that lives
across steps: gradients, activations, the loss's working set) against the resident memory a real
step adds, measured the way `scripts/bench_train.py` measures training memory (VmHWM after a reset,
minus VmRSS before the step). Each row runs tunekit's own trainer (`TrainRecipe.setup` +
`train_step`) in a fresh process forked from one that already holds the imported runtime, on the
planner's worst micro-batch (rows of `data.max_seq_len` tokens, one a token shorter so the batch is
padded, every token trained), one warm-up step on the same batch first (optimizer state,
first-call buffers, the matmul kernels oneDNN compiles per shape), then
the largest growth over the measured steps. The static terms (4-bit weights with their
quantization state, trainable tensors, optimizer state, a full fine-tune's bf16 weight copies) are not in
this table: `tests/plan/test_plan.py` checks them, and every tensor autograd saves, against the real objects byte for byte.

Two measurements per row:

- **live**: glibc's mmap threshold fixed at 128 KiB in the measured process, so that freed tensors
  leave it; its peak is the peak of live memory, which is what the planner models.
- **glibc default**: the allocator as a run uses it. glibc raises its mmap threshold after every
  large free; big tensors then come from a heap that keeps freed memory resident, so the first
  step's peak grows beyond the live peak (most with gradient checkpointing: the blocks recomputed
  in backward pile up); after the warm-up the heap holds that memory already and a step can grow
  less than the live peak. A fixed threshold removes that but made steps about 2x slower here (page faults on every
  large allocation), so tunekit does not set it; the CPU device total carries a stated margin instead
  (`allocator margin (glibc)` in `tunekit plan`)."""


def markdown(meta: dict, rows: list[dict], modes: list[str]) -> str:
    heads = {"live": "measured, live (MiB)", "glibc": "measured, glibc default (MiB)"}
    from tunekit.plan import CPU_ALLOCATOR_MARGIN, CPU_ALLOCATOR_MARGIN_CHECKPOINTED

    margin = "glibc" in modes
    what = "the default model" if meta["configs"] == "default" else "the test suite's model"
    lines = [f"# `tunekit plan` against measured memory on the CPU: {what}", "", INTRO, "",
             f"{meta['device']}; torch {meta['torch']}, transformers {meta['transformers']}; model: {meta['model']}; "
             f"{meta['steps']} measured steps per row. `python scripts/bench_plan.py --configs {meta['configs']}`.", "",
             f"- measured: {meta['metric']}.",
             f"- predicted: {meta['predicted']}.",
             f"- predicted + glibc margin: the CPU device total's stated margin, +{CPU_ALLOCATOR_MARGIN:.0%} of the "
             f"predicted growth (+{CPU_ALLOCATOR_MARGIN_CHECKPOINTED:.0%} with gradient checkpointing), against "
             "glibc as it comes.", "",
             "| configuration | predicted (MiB) | " + " | ".join(f"{heads[m]} | error" for m in modes)
             + (" | predicted + glibc margin (MiB) | error vs glibc |" if margin else " |") + " peak phase |",
             "|---|---:|" + "---:|---:|" * len(modes) + ("---:|---:|" if margin else "") + "---|"]
    for r in rows:
        cells = " | ".join(f"{r[f'measured_{m}_mib']:.0f} | {r[f'error_{m}_pct']:+.1f}%" for m in modes)
        extra = (f" | {r['predicted_mib'] + r['cpu_margin_mib']:.0f} | {r['error_glibc_margin_pct']:+.1f}%"
                 if margin else "")
        lines.append(f"| {r['name']} | {r['predicted_mib']:.0f} | {cells}{extra} | {r['phase']} |")
    live = [r["error_live_pct"] for r in rows if "error_live_pct" in r]
    if live:
        lines.append(f"\nPlanned vs live growth: {min(live):+.1f}% to {max(live):+.1f}%.")
    if margin:
        ratio = [r["measured_glibc_mib"] / r["measured_live_mib"] for r in rows if "measured_live_mib" in r]
        err = [r["error_glibc_margin_pct"] for r in rows]
        lines.append(f"With glibc's defaults the growth was {min(ratio):.2f}-{max(ratio):.2f}x the live growth; the "
                     f"planned growth with the margin was {min(err):+.0f}% to {max(err):+.0f}% off it.")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
