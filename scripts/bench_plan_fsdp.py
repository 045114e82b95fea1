#!/usr/bin/env python
"""The memory planner against two FSDP ranks (trainer.strategy=fsdp, gloo on the CPU), rank by rank.

What scripts/bench_plan.py does for one process, for each rank of a two-rank FSDP2 run: the parent
imports the runtime and builds the suite's random Llama once, then forks two children with the
environment `accelerate launch --multi_gpu` gives a gloo rank on the CPU (ACCELERATE_USE_CPU, RANK,
WORLD_SIZE, MASTER_ADDR/PORT). Each runs tunekit's own trainer:

    TrainRecipe.setup() (load, apply the method, shard) -> this rank's state by the plan's terms
    -> one warm-up step on the planner's worst micro-batch (optimizer state, first-call buffers)
    -> reset VmHWM -> measured steps -> the largest growth (VmHWM - VmRSS before the step)

with glibc's mmap threshold fixed so that freed tensors leave the process (live memory, as the
plan models). Compared per rank:

* the step's growth against the plan's per-rank peak minus its per-rank state (weights,
  trainable parameters, optimizer state): gradient shards, activations, the loss, the weights
  FSDP gathers and frees within the step;
* the state after sharding, term by term: base weights (this rank's shards of every frozen
  parameter plus the 4-bit quantization state, which stays whole), trainable shards, optimizer
  state, against the plan's terms, with the bound FSDP2's padding allows (`shard_terms`).

How the base was loaded does not matter: everything is read after setup.

    python scripts/bench_plan_fsdp.py     # writes benchmarks/plan/plan-cpu-fsdp.md/.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import tempfile
from pathlib import Path

from benchlib import (LIVE_MMAP_THRESHOLD, quiet_libraries, M_MMAP_THRESHOLD, SUITE_MODEL_NAME, FixedSchedule, build_suite_model,
                      machine, rss_kib, versions, warm_parent, worst_batch)

REPO = Path(__file__).resolve().parents[1]
# FSDP over two gloo ranks (--configs fsdp): the suite's model (built once, already the measured
# test's), trainer.strategy=fsdp, each rank measured as above. Batches sized so that a rank's step
# grows ~80-150 MiB (far above the few MiB of allocator noise, > 40 MiB with room) in seconds on a
# shared 2-core machine; one row without checkpointing (the loss's phase peaks), one with it over a
# 4-bit base (a block's backward peaks: the block gathered again and recomputed).
FSDP_CONFIGS = [
    ("fsdp lora, 2x512", "recipe=lora trainer.strategy=fsdp trainer.micro_batch_size=2 data.max_seq_len=512"),
    # r=7: LoRA's A matrices (7 rows) do not split evenly, so rank 0 holds 4 rows and rank 1 three
    ("fsdp qlora ckpt r=7, 4x512", "recipe=qlora trainer.strategy=fsdp model.gradient_checkpointing=true "
     "method.r=7 trainer.micro_batch_size=4 data.max_seq_len=512"),
]
RANKS = 2


def shard_terms(model, world: int) -> dict:
    """This rank's state after sharding, by the plan's terms, and the bound on how far each may be
    from the plan's even split (total // world) because FSDP2 cuts dim 0 into chunks of
    ceil(d0 / world) rows (padding the last): a rank holds ceil(d0 / world) rows of a parameter,
    or fewer, or none. With two ranks each is off d0 / 2 by half a row where d0 is odd (ceil and
    floor of d0 / 2) and by nothing where d0 is even: the bound is the sum of those half rows. With
    more ranks rank 0, the fullest, is over by at most (world - 1) / world row; a later rank can be
    under by more (d0 = 5 on 4 ranks: 2, 2, 1, 0 rows), so the bound holds for every rank only at 2."""
    from torch.distributed.tensor import DTensor

    from tunekit.train.fsdp import held_bytes

    seen, out = set(), {"base weights": 0, "trainable parameters": 0, "buffers": 0}
    bound = {"base weights": 0.0, "trainable parameters": 0.0}
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        local = p.to_local() if isinstance(p, DTensor) else p
        term = "trainable parameters" if p.requires_grad else "base weights"
        out[term] += local.numel() * local.element_size()
        if isinstance(p, DTensor) and p.shape and p.shape[0] % world:
            bound[term] += (world - 1) / world * (p.numel() // p.shape[0]) * p.element_size()
    out["buffers"] = sum(b.numel() * b.element_size() for b in model.buffers())
    # what held_bytes counts beyond parameters and buffers: the 4-bit quantization state (replicated)
    out["quantization state"] = held_bytes(model) - sum(out.values())
    out["base weights"] += out["quantization state"]
    out["held"] = held_bytes(model)
    bound["optimizer state"] = 2 * bound["trainable parameters"]  # two fp32 moments per element (32-bit AdamW)
    return {"state": out, "padding_bound": bound}


def optimizer_bytes(optimizer) -> int:
    """Bytes of the optimizer's state tensors (as tests/plan/test_plan.py counts them)."""
    import torch

    seen, total = set(), 0
    for state in optimizer.state.values():
        for k, v in state.items():
            if torch.is_tensor(v) and v.numel() > 1 and not k.startswith("qmap"):
                if v.untyped_storage().data_ptr() not in seen:
                    seen.add(v.untyped_storage().data_ptr())
                    total += v.untyped_storage().nbytes()
    return total


def measure_rank(overrides: list[str], out: Path, steps: int, world: int) -> dict:
    """One FSDP rank (its process group from the environment), measured as `measure` measures."""
    import torch

    from tunekit.commands.compose import compose_configs
    from tunekit.commands.plan import resolve_auto
    from tunekit.device.facts import probe
    from tunekit.plan import dynamic_bytes, predict
    from tunekit.plan.inputs import planner_inputs
    from tunekit.train.loop import TrainRecipe

    (cfg,) = compose_configs(overrides + [f"output_dir={out}/run", "trainer.eval_every=1000000",
                                          "trainer.save_every=1000000", "trainer.max_steps=10", "trainer.grad_accum=1"])
    facts = probe(torch.device("cpu"))
    resolve_auto(cfg, facts, None, world)
    shape, setup = planner_inputs(cfg, facts, ranks=world)
    plan = predict(shape, setup, facts, world, setup).as_run(True)
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    base = rss_kib()
    r = TrainRecipe(cfg, out / "run")
    r.setup()
    after_setup = rss_kib()
    held = shard_terms(r.model, world)
    t = cfg.trainer
    rows = worst_batch(cfg.data.max_seq_len, t.micro_batch_size, shape.vocab_size, r.tokenizer.eos_token_id)
    r.train_data, r.schedule = rows, FixedSchedule(len(rows), t.grad_accum)
    r.train_step(0)
    held["state"]["optimizer state"] = optimizer_bytes(r.optimizer)
    before = rss_kib()
    Path("/proc/self/clear_refs").write_text("5")
    peaks = []
    for step in range(1, steps + 1):
        row = r.train_step(step)
        peaks.append((rss_kib("VmHWM") - before) / 1024)
    return {"rank": r.strategy.rank, "measured_mib": max(peaks), "peaks_mib": peaks,
            "setup_mib": (after_setup - base) / 1024, "after_warmup_mib": (before - base) / 1024,
            "predicted_mib": dynamic_bytes(plan.memory) / 2**20, "predicted_peak_mib": plan.peak / 2**20,
            "phase": plan.memory.phase, "planned_terms": dict(plan.memory.terms),
            "rank_bytes": r.strategy.sharded.rank_bytes, "model_bytes": r.strategy.sharded.full_bytes,
            **held, "loss": row["loss"]}


def run_ranks(overrides: list[str], work: Path, steps: int, mmap_threshold: int, world: int = RANKS) -> list:
    """measure_rank in `world` forked children, each with the environment `accelerate launch
    --multi_gpu` gives a gloo rank on the CPU (ACCELERATE_USE_CPU, RANK, WORLD_SIZE, MASTER_*)."""
    import socket

    out = Path(tempfile.mkdtemp(dir=work))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    children = []
    for rank in range(world):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # child
            os.close(read)
            os.environ.update({"ACCELERATE_USE_CPU": "true", "ACCELERATE_MIXED_PRECISION": "no", "RANK": str(rank),
                               "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
                               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
            try:
                if mmap_threshold:
                    ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, mmap_threshold)
                result = {"ok": True, **measure_rank(overrides, out, steps, world)}
            except BaseException as e:
                import traceback

                result = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
            with os.fdopen(write, "w") as f:
                f.write(json.dumps(result))
            os._exit(0)
        os.close(write)
        children.append((pid, read))
    results = []
    for pid, read in children:
        with os.fdopen(read) as f:
            data = f.read()
        os.waitpid(pid, 0)
        results.append(json.loads(data) if data else {"ok": False, "error": "rank died without a result"})
    return results


STATE_TERMS = ("base weights", "trainable parameters", "optimizer state")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model folder (default: the suite's random Llama, built under --work)")
    p.add_argument("--work", type=Path, help="folder for the model and the runs (default: a temp folder)")
    p.add_argument("--steps", type=int, default=1, help="measured optimizer steps per configuration (max peak)")
    p.add_argument("--out", type=Path, help="output path without suffix (default benchmarks/plan/plan-cpu-fsdp)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    quiet_libraries()
    from tunekit.model import default_model_dir

    work = args.work or Path(tempfile.mkdtemp(prefix="bench-plan-fsdp-"))
    work.mkdir(parents=True, exist_ok=True)
    model = args.model or str(build_suite_model(work / "suite-llama", str(default_model_dir())))
    warm_parent(model)
    rows = []
    for name, over in FSDP_CONFIGS:
        ranks = run_ranks(over.split() + [f"model.path={model}"], work, args.steps, LIVE_MMAP_THRESHOLD)
        for r in ranks:
            if not r["ok"]:
                sys.exit(f"{name} (a rank): {r['error']}\n{r.get('trace', '')}")
            r.pop("ok")
            r["error_pct"] = 100 * (r["predicted_mib"] / r["measured_mib"] - 1)
            print(f"{name:24s} rank {r['rank']} measured {r['measured_mib']:7.1f} MiB  predicted "
                  f"{r['predicted_mib']:7.1f} MiB  {r['error_pct']:+6.1f}%  ({r['phase']})", file=sys.stderr, flush=True)
        rows.append({"name": name, "overrides": over, "ranks": ranks})
    out = args.out or REPO / "benchmarks" / "plan" / "plan-cpu-fsdp"
    out.parent.mkdir(parents=True, exist_ok=True)
    import datetime

    meta = {**machine(), "versions": versions(("torch", "transformers", "peft", "accelerate", "bitsandbytes")),
            "date": datetime.date.today().isoformat(), "cores": os.cpu_count(), "model": args.model or SUITE_MODEL_NAME, "world_size": RANKS,
            "steps": args.steps,
            "metric": "per rank: max over the steps of (VmHWM during the step - VmRSS after setup and a warm-up step)",
            "predicted": "the plan's per-rank FSDP peak minus its per-rank state (base weights, trainable "
                         "parameters, optimizer state)", "live_mmap_threshold": LIVE_MMAP_THRESHOLD}
    out.with_suffix(".json").write_text(json.dumps({**meta, "results": rows}, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(meta, rows) + "\n")
    print(f"wrote {out.with_suffix('.md')} and .json", file=sys.stderr)


CHANGED = """What this measurement corrected in the planner (tunekit/plan/memory.py): a 4-bit base's
quantization state (absmax, code tables) is a module attribute, not a parameter, so FSDP leaves it
whole on every rank; the plan had split it (qlora: 65,208 bytes per rank under). The gathered
weights had been counted as state that lives across steps, but every step gathers and frees them
(the root unit too, once its backward ends); left out of the step's figure the lora row read -9%.
And an 8-bit optimizer now chooses 8- or 32-bit state by the size of each rank's shard."""


def markdown(meta: dict, rows: list[dict]) -> str:
    mib = 2**20
    lines = ["# `tunekit plan` against two FSDP ranks on the CPU", "", __doc__.split("\n\n", 1)[1].rsplit("\n\n", 1)[0],
             "", f"{meta['date']}; {meta['device']} per rank, {meta['cores']} cores, no GPU; "
             + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()) + f"; model: {meta['model']}; "
             f"{meta['world_size']} gloo ranks; {meta['steps']} measured step(s) after the warm-up. "
             "`python scripts/bench_plan_fsdp.py`.", "",
             "## A step's growth, per rank", "",
             "| configuration | rank | predicted (MiB) | measured, live (MiB) | error | of which gathered weights, planned (MiB) | peak phase |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for row in rows:
        for r in row["ranks"]:
            lines.append(f"| {row['name']} | {r['rank']} | {r['predicted_mib']:.1f} | {r['measured_mib']:.1f} | "
                         f"{r['error_pct']:+.1f}% | {r['planned_terms'].get('gathered blocks (FSDP)', 0) / mib:.1f} | "
                         f"{r['phase']} |")
    lines += ["", "## The state after sharding, per rank (bytes)", "",
              "| configuration | rank | term | planned | measured | difference | padding bound |",
              "|---|---:|---|---:|---:|---:|---:|"]
    for row in rows:
        for r in row["ranks"]:
            for term in STATE_TERMS:
                planned, got = r["planned_terms"][term], r["state"][term]
                lines.append(f"| {row['name']} | {r['rank']} | {term} | {planned:,} | {got:,} | {got - planned:+,} | "
                             f"{r['padding_bound'].get(term, 0):,.0f} |")
    errs = [r["error_pct"] for row in rows for r in row["ranks"]]
    buffers = sorted({r["state"]["buffers"] for row in rows for r in row["ranks"]})
    lines += ["", f"Planned vs measured step growth: {min(errs):+.1f}% to {max(errs):+.1f}%. Besides these, each rank "
              f"holds the model's buffers whole (rotary frequencies: {', '.join(map(str, buffers))} bytes), which the "
              "plan does not count.",
              "", CHANGED, "", "Measured while other jobs shared the CPU (memory figures do not depend on it)."]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
