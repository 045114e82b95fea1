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
from dataclasses import replace
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
  ops and saves fewer activations. Its packed rows use document masking; the plan assumes padded
  rows with a float attention mask per block (16 MiB per block here).
- torchtune QLoRA: torchao's NF4 covers the linear layers and leaves embeddings and output in bf16,
  as tunekit's precision policy does (docs/precision.md); tunekit also offloads the checkpointed
  blocks' inputs to host memory on CUDA (model.offload_activations=auto).
- torchtune LoRA on the A6000: the table does not say what differs from the 4090 row; with
  checkpointing off the plan is dominated by tunekit's saved activations (36 GiB; every LoRA
  branch keeps an fp32 copy of its input), which torchtune's LoRA (bf16 throughout) does not keep.
- Answer.AI: everything in bf16 (`--precision bf16`: LoRA weights, gradients and AdamW state 2 bytes
  each; tunekit keeps them fp32, ~0.5 GiB more per rank at r=64), the loss over full fp32 logits
  like tunekit's (Llama-2's 32k vocabulary keeps it small), figures are peak *reserved* (compare the
  `+ margin` column). The plan's FSDP model (base, trainable parameters, gradients and optimizer
  state split over the ranks; two gathered blocks) is the one tunekit's FSDP work will use.
- Not comparable, left out: rows with CPU offload (Answer.AI's 70B on 2x3090 at 14.92 GiB keeps the
  weights in host memory, which the planner does not model), full fine-tunes (tunekit's `full`
  method trains in fp32), torchtune's 70B/405B rows (their configs could not be verified here).

No figure above was measured by us on a GPU: this machine has none. The CUDA-specific parts of the
model (bool dropout masks, flash/efficient attention saving q, k, v, output and log-sum-exp, the
10% allocator margin and 0.5 GiB context) are stated assumptions; the CPU measurements
(`plan-cpu.md`) check everything the two devices share.
"""

# (source, label, published GiB, preset, TrainSetup fields, ranks, sharded, note)
ROWS = [
    ("torchtune", "8B LoRA, 1x RTX 4090", 16.2, "llama-3-8b",
     dict(lora_r=8, lora_targets=("q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
          gradient_checkpointing=True), 1, False,
     "8B_lora_single_device defaults: r=8 on q,v,output_proj + MLP, activation checkpointing on"),
    ("torchtune", "8B LoRA, 1x A6000 (checkpointing assumed off)", 30.3, "llama-3-8b",
     dict(lora_r=8, lora_targets=("q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
          gradient_checkpointing=False), 1, False,
     "settings of this row are not stated; 14 GiB above the 4090 row suggests checkpointing off"),
    ("torchtune", "8B QLoRA, 1x RTX 4090", 7.4, "llama-3-8b",
     dict(quantize="nf4", lora_r=8, lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                  "down_proj"), gradient_checkpointing=True), 1, False,
     "8B_qlora_single_device defaults: r=8 on q,k,v,output_proj + MLP, activation checkpointing on"),
]
FSDP_LORA = dict(lora_r=64, lora_dropout=0.1, lora_targets=("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj",
                                                            "down_proj"), gradient_checkpointing=True)
for label, published, quantize, batch, ctx, sharded in [
    ("7B QLoRA FSDP, bs 1, ctx 512", 4.98, "nf4", 1, 512, True),
    ("7B QLoRA FSDP, bs 1, ctx 2048", 5.21, "nf4", 1, 2048, True),
    ("7B LoRA FSDP, bs 1, ctx 512", 10.24, "none", 1, 512, True),
    ("7B LoRA FSDP, bs 1, ctx 2048", 10.22, "none", 1, 2048, True),
    ("7B QLoRA FSDP, bs 4, ctx 2048", 11.22, "nf4", 4, 2048, True),
    ("7B QLoRA FSDP, bs 10, ctx 2048", 20.97, "nf4", 10, 2048, True),
    ("7B LoRA FSDP, bs 4, ctx 2048", 16.14, "none", 4, 2048, True),
    ("7B LoRA FSDP, bs 6, ctx 2048", 21.35, "none", 6, 2048, True),
    ("7B QLoRA DDP, bs 8, ctx 2048", 20.94, "nf4", 8, 2048, False),
    ("7B LoRA DDP, bs 4, ctx 2048", 22.04, "none", 4, 2048, False),
]:
    ROWS.append(("Answer.AI", label, published, "llama-2-7b",
                 dict(FSDP_LORA, quantize=quantize, micro_batch_size=batch, seq_len=ctx), 2, sharded,
                 "train.py defaults: r=64 on q,k,v,gate,up,down, dropout 0.1, bf16, checkpointing on"))


def plan_row(preset: str, fields: dict, ranks: int, sharded: bool):
    from tunekit.device.facts import DeviceFacts
    from tunekit.plan import predict
    from tunekit.plan.memory import TrainSetup
    from tunekit.plan.shape import preset_shape

    setup = TrainSetup(micro_batch_size=2, seq_len=2048, packing=False, optimizer="adamw", dropout_mask_bytes=1)
    setup = replace(setup, **fields)  # torchtune rows: 2 rows of 2048 tokens (packed per row there)
    facts = DeviceFacts("cuda", 0, (8, 0), "GPU", 24 * GiB)
    plan = predict(preset_shape(preset), setup, facts, ranks)
    memory = plan.fsdp if sharded else plan.memory
    return plan, memory


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
    for source, label, published, preset, fields, ranks, sharded, note in ROWS:
        plan, memory = plan_row(preset, fields, ranks, sharded)
        peak = memory.total / GiB
        with_margin = peak * (1 + CUDA_ALLOCATOR_MARGIN)
        err = 100 * (with_margin / published - 1)
        errors.setdefault(source, []).append(err)
        top = ", ".join(f"{k} {v / GiB:.1f}" for k, v in sorted(memory.terms.items(), key=lambda kv: -kv[1])[:3])
        lines.append(f"| {source} | {label} | {published} | {peak:.1f} | {with_margin:.1f} | {err:+.0f}% | {top} |")
    lines += ["", "Sources and settings:", "", f"- torchtune: {TORCHTUNE}.", f"- Answer.AI: {ANSWERAI}.", ""]
    for source, label, published, preset, fields, ranks, sharded, note in ROWS:
        lines.append(f"- {source}, {label}: {note}.")
    lines += ["", "Error range per source: " + "; ".join(
        f"{s} {min(e):+.0f}% to {max(e):+.0f}%" for s, e in errors.items()) + ".", "", DIFFERENCES]
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
