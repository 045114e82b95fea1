#!/usr/bin/env python
"""The memory planner's CUDA figures beside published peak-memory measurements of other trainers.

No GPU is needed: every row is the planner's answer for tunekit running the same model, batch,
sequence, method, LoRA rank/targets, checkpointing and parallelism as the published run. The
published trainers are not tunekit, so the error mixes the planner's error with real differences
of implementation, which the document lists per source. Writes benchmarks/plan/plan-gpu-published.md.

    python scripts/plan_vs_published.py [--out benchmarks/plan/plan-gpu-published.md]
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GiB = 2**30

TORCHTUNE = ("torchtune README, 'Memory and training speed' table (github.com/pytorch/torchtune, README.md at "
             "commit 0031bfb): Llama 3.1 8B, 'batch size 2 (without gradient accumulation), a dataset packed to "
             "sequence length 2048, and torch compile enabled'; 'Peak Memory per GPU' (which torch counter is not "
             "stated)")
ANSWERAI = ("Answer.AI fsdp_qlora, benchmarks_03_2024.md (github.com/AnswerDotAI/fsdp_qlora): Llama-2 7B on two "
            "RTX 3090 with FSDP (or 'ddp' sharding) over both GPUs, dummy data truncated to the context length, "
            "peak memory per GPU (the text says the reported figure is peak *reserved*; for the LoRA bs 1 rows it "
            "also gives peak allocated: 8.28 and 9.16 GiB)")

DIFFERENCES = """## What separates the rows (not planner error)

The planner answers "what will tunekit allocate"; the published runs are other trainers. Known
differences, sized with the planner's own terms:

- torchtune, all three rows: its loss computes the output projection and cross-entropy in chunks,
  as tunekit's does (tunekit.losses.sft). torch.compile (on in the published runs) fuses elementwise
  ops and saves fewer activations. Its rows are packed with document masking; the plan's are packed
  too (`data.packing=true`: per-example attention, no mask tensor).
- torchtune QLoRA: torchao's NF4 covers the linear layers and leaves embeddings and output in bf16,
  as tunekit's precision policy does (docs/precision.md). The rows plan no activation offloading, as
  the published runs; with `model.offload_activations=true` (what `auto` picks on a card the step
  would not fit otherwise) the 8B QLoRA row plans {offloaded:.2f} GiB.
- torchtune LoRA on the A6000: the table does not say what differs from the 4090 row; with
  checkpointing off the plan is dominated by tunekit's saved activations (the row's largest term:
  over a bf16 base peft's LoRA branch keeps an fp32 copy of its input), which torchtune's LoRA (bf16
  throughout) does not keep.
- Answer.AI: everything in bf16 (`--precision bf16`: LoRA weights, gradients and AdamW state 2 bytes
  each; tunekit keeps them fp32, ~0.5 GiB more per rank at r=64), the loss over full fp32 logits
  (tunekit's is chunked; Llama-2's 32k vocabulary keeps theirs small), figures are peak *reserved*
  (compare the `+ margin` column). The FSDP rows are planned as tunekit's `trainer.strategy=fsdp`
  runs them (base, trainable parameters, gradients and optimizer state split over the ranks;
  gathered blocks; peft's LoRA layers on every rank).
- Not comparable, left out: rows with CPU offload (Answer.AI's 70B on 2x3090 at 14.92 GiB keeps the
  weights in host memory, which the planner does not model), full fine-tunes (tunekit's `full`
  method trains in fp32), torchtune's 70B/405B rows (their configs could not be verified here).

Every figure above is planned, none measured: this script needs no GPU. The CUDA-specific parts of
the model (bool dropout masks, flash/efficient attention saving q, k, v, output and log-sum-exp, the
10% allocator margin and 0.5 GiB context) are stated assumptions; the CPU measurements
(`plan-cpu.md`) check everything the two devices share, and the GPU checks measured the plan on an
H200 (`benchmarks/gpu/check-h200-2026-11-27-second-lease.md`: 1.066x of the training peak on a
4-block model of Llama-3-8B's widths).
"""

# (source, label, published GiB, `tunekit plan` overrides, ranks, note). Each row is planned as
# `tunekit plan OVERRIDES --device cuda --memory 24 --gpus RANKS` plans it: the same composition,
# checks and setup as a run of those settings, so the figures follow the planner and the recipes.
TT_LORA = ["recipe=lora", "model.preset=llama-3-8b", "method.r=8",
           "method.target_modules=[q_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]"]
TT_COMMON = ["trainer.micro_batch_size=2", "data.max_seq_len=2048", "data.packing=true", "trainer.optimizer=adamw",
             "model.offload_activations=false"]
ROWS = [
    ("torchtune", "8B LoRA, 1x RTX 4090", 16.2, TT_LORA + TT_COMMON + ["model.gradient_checkpointing=true"], 1,
     "8B_lora_single_device defaults: r=8 on q,v,output_proj + MLP, activation checkpointing on"),
    ("torchtune", "8B LoRA, 1x A6000 (checkpointing assumed off)", 30.3,
     TT_LORA + TT_COMMON + ["model.gradient_checkpointing=false"], 1,
     "settings of this row are not stated; 14 GiB above the 4090 row suggests checkpointing off"),
    ("torchtune", "8B QLoRA, 1x RTX 4090", 7.4,
     ["recipe=qlora", "model.preset=llama-3-8b", "method.r=8", "method.init=default",
      "method.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]",
      "model.gradient_checkpointing=true"] + TT_COMMON, 1,
     "8B_qlora_single_device defaults: r=8 on q,k,v,output_proj + MLP, activation checkpointing on"),
]
for label, published, recipe, batch, ctx, strategy in [
    ("7B QLoRA FSDP, bs 1, ctx 512", 4.98, "qlora", 1, 512, "fsdp"),
    ("7B QLoRA FSDP, bs 1, ctx 2048", 5.21, "qlora", 1, 2048, "fsdp"),
    ("7B LoRA FSDP, bs 1, ctx 512", 10.24, "lora", 1, 512, "fsdp"),
    ("7B LoRA FSDP, bs 1, ctx 2048", 10.22, "lora", 1, 2048, "fsdp"),
    ("7B QLoRA FSDP, bs 4, ctx 2048", 11.22, "qlora", 4, 2048, "fsdp"),
    ("7B QLoRA FSDP, bs 10, ctx 2048", 20.97, "qlora", 10, 2048, "fsdp"),
    ("7B LoRA FSDP, bs 4, ctx 2048", 16.14, "lora", 4, 2048, "fsdp"),
    ("7B LoRA FSDP, bs 6, ctx 2048", 21.35, "lora", 6, 2048, "fsdp"),
    ("7B QLoRA DDP, bs 8, ctx 2048", 20.94, "qlora", 8, 2048, "ddp"),
    ("7B LoRA DDP, bs 4, ctx 2048", 22.04, "lora", 4, 2048, "ddp"),
]:
    ROWS.append(("Answer.AI", label, published,
                 [f"recipe={recipe}", "model.preset=llama-2-7b", "method.r=64", "method.dropout=0.1",
                  "method.target_modules=[q_proj,k_proj,v_proj,gate_proj,up_proj,down_proj]",
                  "model.gradient_checkpointing=true", "model.offload_activations=false", "trainer.optimizer=adamw",
                  f"trainer.micro_batch_size={batch}", f"data.max_seq_len={ctx}", f"trainer.strategy={strategy}"]
                 + (["method.init=default"] if recipe == "qlora" else []), 2,
                 "train.py defaults: r=64 on q,k,v,gate,up,down, dropout 0.1, bf16, checkpointing on"))


def plan_row(overrides: list[str], ranks: int) -> dict:
    """One rank's figures (`tunekit plan --json`'s per_rank entry of the run's strategy) for these settings."""
    import contextlib
    import io
    import json

    from tunekit.commands.plan import main as plan_main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        plan_main([*overrides, "--device", "cuda", "--memory", "24", "--gpus", str(ranks), "--json"])
    result = json.loads(out.getvalue())
    return result["per_rank"][result["strategy"]] if ranks > 1 else next(iter(result["per_rank"].values()))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "plan" / "plan-gpu-published.md")
    args = p.parse_args(argv)
    from tunekit.plan import CUDA_ALLOCATOR_MARGIN

    lines = ["# Memory planner (CUDA) beside published peak-memory figures", "",
             "Generated by `scripts/plan_vs_published.py` (no GPU involved). Each row: a published measurement "
             "of another trainer, and `tunekit plan` for tunekit running the same model, batch, sequence, method, "
             "LoRA rank and targets, checkpointing and sharding. `tunekit peak` is the planner's torch-allocated "
             f"peak; `+ margin` adds the stated allocator margin ({CUDA_ALLOCATOR_MARGIN:.0%}: reserved over "
             "allocated), the quantity closest to a reserved figure. Neither includes the CUDA context.", "",
             "| source | run | published (GiB) | tunekit peak (GiB) | + margin (GiB) | error (+margin vs published) "
             "| largest terms (GiB) |", "|---|---|---:|---:|---:|---:|---|"]
    errors = {}
    for source, label, published, overrides, ranks, note in ROWS:
        rank = plan_row(overrides, ranks)
        peak = rank["peak_bytes"] / GiB
        with_margin = peak * (1 + CUDA_ALLOCATOR_MARGIN)
        err = 100 * (with_margin / published - 1)
        errors.setdefault(source, []).append(err)
        top = ", ".join(f"{k} {v / GiB:.1f}" for k, v in sorted(rank["terms"].items(), key=lambda kv: -kv[1])[:3])
        lines.append(f"| {source} | {label} | {published} | {peak:.1f} | {with_margin:.1f} | {err:+.0f}% | {top} |")
    qlora = next(r for r in ROWS if r[1] == "8B QLoRA, 1x RTX 4090")
    offloaded = plan_row([*qlora[3], "model.offload_activations=true"], 1)["peak_bytes"] / GiB
    lines += ["", "Sources and settings:", "", f"- torchtune: {TORCHTUNE}.", f"- Answer.AI: {ANSWERAI}.", ""]
    for source, label, published, overrides, ranks, note in ROWS:
        lines.append(f"- {source}, {label}: {note}: `tunekit plan {shlex.join(overrides)} --device cuda --memory 24"
                     f"{f' --gpus {ranks}' if ranks > 1 else ''}`.")
    lines += ["", "Error range per source: " + "; ".join(
        f"{s} {min(e):+.0f}% to {max(e):+.0f}%" for s, e in errors.items()) + ".", "", DIFFERENCES.format(offloaded=offloaded)]
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
