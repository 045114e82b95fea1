#!/usr/bin/env python
"""Where a training step's time goes: torch.profiler over tunekit's own train_step.

Builds the run exactly as `tunekit train` does (recipe + overrides), runs --warmup steps, then
profiles --steps steps and prints (and with --out writes as markdown) the top operators by self
CPU time, grouped into the families that matter for a QLoRA step: 4-bit dequantization, matmuls,
attention, norms/elementwise/casts, the optimizer, and the rest.

    python scripts/profile_train.py                                   # default qlora, seq 256, micro 8 x 2
    python scripts/profile_train.py --set model.gradient_checkpointing=false --out benchmarks/profile/profile-cpu-after.md
    python scripts/profile_train.py --roofline --out benchmarks/profile/roofline-cpu.md   # + the least time of each op

--roofline records shapes, re-runs the profiled steps unprofiled for their wall time, and appends
`scripts/roofline.py`'s analysis: every matmul shape timed alone, the rest bounded by bandwidth
(with --out, its figures also go to the .json beside the markdown).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from benchlib import build_cfg, lengths, matmul_peak, step_examples, useful_flops

FAMILIES = [  # (family, substrings of an op name), first match wins
    # kernels.compile=true: an inductor graph's own time is its fused elementwise kernels (first: its
    # name ends in a hash, which could hold another family's substring)
    ("compiled regions (inductor's fused kernels)", ("## Call CompiledFxGraph",)),
    ("torch.compile guards and wrappers", ("TorchDynamo", "CompiledFunction", "Torch-Compiled Region",
                                          "Pregraph bytecode")),
    ("4-bit dequantize / gemm_4bit", ("bitsandbytes", "dequantize", "gemm_4bit", "4bit")),
    ("matmul (mm/addmm/bmm/linear)", ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear",
                                      "aten::_weight_int", "mkldnn", "onednn")),
    ("attention (sdpa)", ("attention", "sdpa", "_flash", "_efficient")),
    ("casts and copies", ("aten::to", "aten::_to_copy", "aten::copy_", "aten::clone", "aten::contiguous")),
    ("elementwise and norms", ("aten::mul", "aten::add", "aten::div", "aten::pow", "aten::rsqrt", "aten::mean",
                               "aten::silu", "aten::neg", "aten::cat", "aten::sub", "aten::sum", "aten::exp",
                               "aten::where", "aten::masked", "aten::index", "aten::fill", "aten::zero")),
    ("loss (log_softmax / nll)", ("log_softmax", "nll_loss", "cross_entropy")),
    ("optimizer", ("optim", "adam", "Adam", "_foreach")),
]


def family(name: str) -> str:
    for fam, keys in FAMILIES:
        if any(k in name for k in keys):
            return fam
    return "other"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="qlora")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--packing", default="false")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--out", type=Path, help="write the summary as markdown here")
    p.add_argument("--roofline", action="store_true", help="append the roofline of the profiled steps")
    args = p.parse_args(argv)

    import torch
    from torch.profiler import ProfilerActivity, profile

    from tunekit.train.loop import TrainRecipe

    spec = {"recipe": args.recipe, "steps": args.warmup + args.steps, "micro_batch_size": args.micro_batch_size,
            "grad_accum": args.grad_accum, "seq_len": args.seq_len, "packing": args.packing, "model": None,
            "data": None, "set": args.set}
    out_dir = tempfile.mkdtemp(prefix="tunekit-profile-")
    cfg = build_cfg(spec, out_dir)
    r = TrainRecipe(cfg, Path(out_dir))
    r.setup()
    for step in range(args.warmup):
        r.train_step(step)
    tokens = 0
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=args.roofline) as prof:
        for step in range(args.warmup, args.warmup + args.steps):
            tokens += r.train_step(step)["input_tokens"]
    wall = time.perf_counter() - start
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    by_family = defaultdict(float)
    for e in events:
        by_family[family(e.key)] += e.self_cpu_time_total
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[: args.top]
    lines = [f"# Profile: recipe={args.recipe}, seq {args.seq_len}, micro {args.micro_batch_size} x "
             f"{args.grad_accum}, packing {args.packing}, overrides {' '.join(args.set) or '(none)'}", "",
             f"- {args.steps} profiled steps after {args.warmup} warm-up: {wall:.2f} s wall (with profiler "
             f"overhead), {tokens} input tokens, {tokens / wall:.1f} tokens/s; torch {torch.__version__}, "
             f"{torch.get_num_threads()} threads",
             f"- the operators' self time sums to {total / 1e6:.2f} s of those {wall:.2f} s; the rest is outside "
             "every recorded operator: Python between them (module calls, the data collator, the training "
             "loop) and the profiler's own cost", "",
             "| family | self CPU s | share |", "|---|---:|---:|"]
    for fam, t in sorted(by_family.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {fam} | {t / 1e6:.2f} | {100 * t / total:.1f}% |")
    lines += ["", f"Top {args.top} operators by self CPU time:", "", "| op | calls | self CPU s | share |",
              "|---|---:|---:|---:|"]
    for e in top:
        lines.append(f"| `{e.key}` | {e.count} | {e.self_cpu_time_total / 1e6:.2f} | "
                     f"{100 * e.self_cpu_time_total / total:.1f}% |")
    if args.roofline:
        summary, roof = roofline_lines(r, cfg, range(args.warmup, args.warmup + args.steps), prof.events())
        lines += [""] + roof
        if args.out:
            args.out.with_suffix(".json").write_text(json.dumps(summary, indent=1) + "\n")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


def roofline_lines(r, cfg, steps: range, events) -> tuple[dict, list[str]]:
    """Re-run the profiled steps unprofiled (same batches: the schedule is a function of the step; the
    weights move on, which changes no shape), count their useful FLOPs as bench_train does, and hand
    all of it to roofline.analyze."""
    import torch
    from transformers import AutoConfig

    import roofline
    from tunekit.model import resolve_model_path

    model_dir = resolve_model_path(cfg.model.path)
    flops = sum(useful_flops(model_dir, r.trainable_params, lengths(step_examples(r.train_data, r.schedule, step)),
                             r.train_step(step)["trained_tokens"]) for step in steps)
    wall = float("inf")
    for _ in range(2):  # the better of two unprofiled passes: the first after profiling can run cold
        start = time.perf_counter()
        for step in steps:
            r.train_step(step)
        wall = min(wall, time.perf_counter() - start)
    c = AutoConfig.from_pretrained(model_dir)
    head = c.hidden_size // c.num_attention_heads
    dims = {c.hidden_size, c.intermediate_size, c.num_key_value_heads * head, c.vocab_size, head,
            c.num_attention_heads, int(getattr(cfg.method, "r", 0) or 0)}
    # MFU against the peak of the dtype the base computes in, as bench_train reports it: on a CPU
    # without native bf16 that is fp32 (emulated bf16 runs at a fraction of it and is never chosen)
    dtype = str(r.dtype).removeprefix("torch.")
    peak = matmul_peak(dtype)["gflops"]
    summary, lines = roofline.analyze(events, family, wall, flops, peak, dims,
                                      peak_dtype={"bfloat16": "bf16", "float32": "fp32"}.get(dtype, dtype))
    return summary | {"torch": torch.__version__, "threads": torch.get_num_threads()}, lines


if __name__ == "__main__":
    main()
