"""How much of the model each FSDP rank holds: bytes of parameters and resident memory, per rank.

Run with several processes (two gloo ranks on a CPU: `accelerate launch --cpu` alone starts one process):

    ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 --num_machines 1 \\
        --mixed_precision no --dynamo_backend no scripts/bench_fsdp_memory.py [--quantize nf4] [--model DIR]

Each rank loads the base the way `tunekit train trainer.strategy=fsdp` does (host memory; 4-bit
codes stored as floats), applies LoRA r=16 to every projection, and shards it with
tunekit.train.fsdp.Sharded. Reported per rank: the bytes of parameters, buffers and 4-bit state it holds
(whole model vs its shards), and its memory (RSS on a CPU, allocated on a GPU) before loading,
with the whole model loaded and read once (what every DDP rank keeps), and after sharding. On a
CPU each reading follows glibc's malloc_trim, so that freed memory the allocator keeps is not
counted (the trainer does not trim: its RSS peak includes what the load left). Rank 0 prints a
table and writes --out as JSON. Memory figures are only meaningful on a quiet machine.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def settled_memory_mb(device: torch.device):
    """Memory held now, after garbage collection and (CPU, glibc) handing freed heap back."""
    from tunekit.device import facts as dev

    gc.collect()
    if device.type == "cpu":
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except OSError:
            pass
    return dev.current_memory_mb(device)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model folder (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--quantize", default="none", choices=["none", "nf4"])
    p.add_argument("--out", default=None, help="JSON report (default benchmarks/training/fsdp-memory-<device>-<quantize>.json)")
    args = p.parse_args()

    from accelerate import Accelerator

    from tunekit.device import facts as dev
    from tunekit.methods import MethodConfig
    from tunekit.train.fsdp import Sharded, held_bytes, quant_storage
    from tunekit.methods import get_method
    from tunekit.model import load_base_model, prepare_for_training, resolve_model_path

    acc = Accelerator()
    device = dev.rank_device(acc.device, acc.local_process_index)
    if acc.num_processes < 2:
        sys.exit("run with several processes (accelerate launch --num_processes 2 ...)")
    path = resolve_model_path(args.model)
    dtype = dev.compute_dtype("auto", dev.probe(device))
    sharded = Sharded(device, acc.num_processes, acc.process_index)
    before = settled_memory_mb(device)
    model = load_base_model(path, args.quantize, dtype, sharded.load_device, quant_storage(args.quantize, dtype))
    prepare_for_training(model, args.quantize, False)
    model = get_method("lora").apply(model, MethodConfig(dropout=0.0))
    with torch.no_grad():  # read every weight once: a file-mapped load is resident only once read
        for t in [*model.parameters(), *model.buffers()]:
            t.float().sum()
    loaded = settled_memory_mb(device)
    whole = held_bytes(model)
    sharded.shard(model)
    after = settled_memory_mb(device)
    row = {"rank": acc.process_index, "model_bytes": whole, "rank_bytes": sharded.rank_bytes,
           "memory_before_load_mb": before, "memory_whole_model_mb": loaded,
           "memory_after_shard_mb": after}
    rows = [None] * acc.num_processes
    dist.all_gather_object(rows, row)
    if acc.is_main_process:
        print(f"{path} ({args.quantize}, LoRA r=16), {acc.num_processes} ranks on {dev.probe(device).describe()}")
        print(f"{'rank':>4} {'whole MiB':>10} {'shard MiB':>10} {'share':>6} {'mem before':>11} {'whole loaded':>13} "
              f"{'after shard':>12}  (memory in MiB: RSS on a CPU)")
        for r in rows:
            print(f"{r['rank']:>4} {r['model_bytes'] / 2**20:>10.1f} {r['rank_bytes'] / 2**20:>10.1f} "
                  f"{r['rank_bytes'] / r['model_bytes']:>6.3f} {r['memory_before_load_mb']:>11.0f} "
                  f"{r['memory_whole_model_mb']:>13.0f} {r['memory_after_shard_mb']:>12.0f}")
        out = Path(args.out or f"benchmarks/training/fsdp-memory-{device.type}-{args.quantize}.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"model": str(path), "quantize": args.quantize, "ranks": rows,
                                   "device": dev.probe(device).describe(), "torch": torch.__version__,
                                   "note": "measured while other jobs shared the CPU" if os.environ.get("SHARED_CPU")
                                   else ""}, indent=2) + "\n")
        print(f"written {out}")
    acc.wait_for_everyone()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
