"""`tunekit plan recipe=X [overrides] [--device cpu|cuda] [--memory GiB] [--gpus N] [--json]`.

Composes the same config tree as `tunekit train` (recipes/ + overrides, validated the same way),
reads the model's config.json (or model.preset=...), and prints the planned peak memory of one
training step with its breakdown, the margins of the device, whether it fits, the peak with
gradient checkpointing toggled, and the FLOPs of one optimizer step. Nothing is loaded.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from typing import Optional

from tunekit import TunekitError
from tunekit.commands.parse import Parser, check_number
from tunekit.config import plain
from tunekit.device.facts import available_memory_bytes, compute_dtype, default_device, dtype_name, planning_facts
from tunekit.plan import GiB, Plan, predict
from tunekit.plan.inputs import planner_inputs, runs_sharded
from tunekit.plan.choose import estimate_note
from tunekit.plan.memory import method_of, micro_batch_words
from tunekit.plan.shape import preset_names, preset_source

EXAMPLES = """examples:
  tunekit plan recipe=qlora                                   # the default model on this machine
  tunekit plan recipe=qlora model.preset=llama-3-8b data.max_seq_len=4096 --device cuda --memory 24
  tunekit plan recipe=qlora model.preset=llama-3-70b trainer.micro_batch_size=1 --device cuda --memory 24 --gpus 2
  tunekit plan recipe=lora model.path=/models/llama trainer.micro_batch_size=4 --json
presets: """


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = Parser(
        prog="tunekit plan", description=__doc__.split("\n\n")[1].replace("\n", " "),
        epilog=EXAMPLES + ", ".join(preset_names()), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="config overrides, as for tunekit train (recipe=qlora ...)")
    p.add_argument("--device", choices=["cpu", "cuda"], help="plan for this kind of device (default: this machine's)")
    p.add_argument("--memory", type=float, metavar="GiB", help="the device's memory (default: what is free now)")
    p.add_argument("--gpus", type=int, default=1, metavar="N", help="processes (ranks): DDP and FSDP figures per rank")
    p.add_argument("--json", action="store_true", help="one JSON object (a list for a sweep) instead of tables")
    args = p.parse_args(argv)
    if args.gpus < 1:
        p.error(f"--gpus: must be >= 1, got {args.gpus}")
    # a NaN budget compares false with everything (every plan would "fit"), an infinite one fits anything
    check_number(p, "--memory", args.memory, gt=0, unit="GiB")
    return args


def fmt(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def budget(plan: Plan, memory_gib: Optional[float]) -> tuple[Optional[int], int, str]:
    """(bytes to compare with, bytes needed, what they are): the device's size with every margin,
    or what is free now against what is still needed beyond the running process."""
    if memory_gib is not None:
        return int(memory_gib * GiB), plan.device_total(), f"a {memory_gib:g} GiB device"
    if plan.facts.type == "cuda" and plan.facts.total_memory is None:  # assumed GPU, size unknown
        return None, plan.device_total(), "an unknown amount (give --memory)"
    import torch

    free = available_memory_bytes(torch.device(plan.facts.type))
    return free, plan.needed_beyond_runtime(), "free now"


def as_dict(plan: Plan, memory_gib: Optional[float], cfg) -> dict:
    run = plan.as_run(runs_sharded(cfg, plan.ranks))  # the strategy cfg asks for: its setup, its figures
    limit, needed, what = budget(run, memory_gib)
    out = {
        "recipe": cfg.recipe, "model": asdict(plan.shape), "total_params": plan.shape.total_params,
        "strategy": "fsdp" if run is not plan else ("ddp" if plan.ranks > 1 else "single"),
        "setup": {k: (asdict(v) if hasattr(v, "__dataclass_fields__") else v) for k, v in vars(run.setup).items()},
        "device": {"type": plan.facts.type, "name": plan.facts.name, "describe": plan.facts.describe()},
        "ranks": plan.ranks,
        "per_rank": {"ddp" if plan.ranks > 1 else "single": _memory_dict(plan, plan.memory)},
        "needed_bytes": needed, "limit_bytes": limit, "limit": what,
        "fits": None if limit is None else needed <= limit,
        "flops": plan.flops,
    }
    if plan.fsdp is not None:
        from tunekit.plan.host import plan_host_per_node

        out["per_rank"]["fsdp"] = _memory_dict(plan, plan.fsdp)
        out["fsdp_host_per_node_bytes"] = plan_host_per_node(plan, plan.ranks)
    alt = toggled(run)
    out["toggle_gradient_checkpointing"] = {"gradient_checkpointing": alt.setup.gradient_checkpointing,
                                            "peak_bytes": alt.peak, "device_total_bytes": alt.device_total(),
                                            "flops_total": alt.flops["total"]}
    return out


def toggled(run: Plan) -> Plan:
    """`run` with gradient checkpointing the other way (the same strategy's figures)."""
    flip = {"gradient_checkpointing": not run.setup.gradient_checkpointing}
    sharded = run.fsdp is not None and run.memory is run.fsdp
    return predict(run.shape, replace(run.setup, **flip), run.facts, run.ranks,
                   replace(run.setup, **flip) if sharded else None).as_run(sharded)


def _memory_dict(plan: Plan, memory) -> dict:
    return {"terms": memory.terms, "sharded_terms": list(memory.sharded), "peak_bytes": memory.total, "phase": memory.phase,
            "overhead": plan.overhead(memory), "device_total_bytes": plan.device_total(memory)}


def cell(memory, name: str, ranks: int) -> str:
    """One term of one column: its size, marked where it is this rank's share of a split term."""
    if name not in memory.terms:
        return "-"
    return fmt(memory.terms[name]) + (f" (1/{ranks})" if name in memory.sharded else "")


def render(plan: Plan, memory_gib: Optional[float], cfg, source: str) -> str:
    run = plan.as_run(runs_sharded(cfg, plan.ranks))  # the strategy cfg asks for: its setup, its figures
    s, shape = run.setup, plan.shape
    cols = [("per process", plan.memory)] if plan.fsdp is None else [
        (f"per rank, DDP x{plan.ranks}", plan.memory), (f"per rank, FSDP x{plan.ranks}", plan.fsdp)]
    method = method_of(s).plan_label(s.options)
    compute = dtype_name(compute_dtype(plain(cfg.model.dtype), plan.facts))
    base = "NF4 + double quant" if s.quantize == "nf4" else compute
    lines = [
        f"tunekit plan: recipe={cfg.recipe}, {shape.name} ({shape.total_params / 1e9:.3f}B params; {source})",
        f"  {method} over a {base} base, {compute} compute, optimizer {s.optimizer}",
        f"  worst micro-batch: {micro_batch_words(s)} x {s.seq_len} tokens{' (packed)' if s.packing else ''}, "
        f"grad_accum {s.grad_accum}, gradient checkpointing {'on' if s.gradient_checkpointing else 'off'}"
        + (f"; teacher {s.teacher.name} ({s.teacher_quantize}), chunk {s.distill_chunk}" if s.teacher else ""),
        f"  device: {plan.facts.describe()}" + (f" x {plan.ranks}" if plan.ranks > 1 else ""),
        *([f"  {note.removeprefix('; ')}"] if (note := estimate_note(plan)) else []),
        "",
    ]
    names = []
    for _, mem in cols:
        names += [k for k in mem.terms if k not in names]
    width = max(len(n) for n in names + ["+ " + k for k in plan.overhead()] + ["device total (with margins)"]) + 2
    header = f"  {'':{width}}" + "".join(f"{title:>24}" for title, _ in cols)
    lines += [header]
    for n in names:
        lines.append(f"  {n:{width}}" + "".join(f"{cell(mem, n, plan.ranks):>24}" for _, mem in cols))
    lines.append(f"  {'peak of one step':{width}}" + "".join(f"{fmt(mem.total):>24}" for _, mem in cols))
    for n in plan.overhead():
        lines.append(f"  {'+ ' + n:{width}}" + "".join(f"{fmt(plan.overhead(mem)[n]):>24}" for _, mem in cols))
    lines.append(f"  {'device total (with margins)':{width}}" + "".join(f"{fmt(plan.device_total(mem)):>24}"
                                                                       for _, mem in cols))
    if plan.fsdp is not None:
        lines += [f"  (FSDP: 1/{plan.ranks} marks this rank's share of a term split over the ranks; the other rows",
                  "  are whole on every rank" + (", as is the 4-bit quantization state inside base weights"
                                                 if plan.setup.quantize == "nf4" else "") + ")"]
    grads = run.memory.terms.get("gradients")
    lines.append(f"  (the peak falls in: {run.memory.phase}"
                 + ("; no gradient exists yet there with grad_accum 1" if grads == 0 and s.grad_accum == 1 else "")
                 + ")")
    if plan.fsdp is not None:
        from tunekit.plan.host import plan_host_per_node

        host = fmt(plan_host_per_node(plan, plan.ranks))
        lines.append(f"  (FSDP host memory per node for the model while rank 0 streams the base: {host},"
                     " besides each process's own runtime)")
    for n, v in run.memory.host.items():
        lines.append(f"  ({n}: {fmt(v)} in pinned host memory, model.offload_activations)")
    limit, needed, what = budget(run, memory_gib)
    sharing = f", {plan.ranks} processes sharing it" if plan.facts.type == "cpu" and plan.ranks > 1 else ""
    column = f" (from the {'FSDP' if run is not plan else 'DDP'} x{plan.ranks} column)" if plan.ranks > 1 else ""
    if limit is None:
        verdict = f"needs {fmt(needed)} per device{column}; {what}"
    else:
        verdict = (f"{'fits' if needed <= limit else 'does NOT fit'}: needs {fmt(needed)}{column} of {what}"
                   + ("" if memory_gib is not None else f" ({fmt(limit)}{sharing})"))
        if plan.fsdp is not None and run is plan and needed > limit:
            fsdp_needed = plan.device_total(plan.fsdp) if memory_gib is not None else plan.device_total(plan.fsdp) - (
                plan.device_total() - plan.needed_beyond_runtime())
            verdict += f"; FSDP over {plan.ranks} ranks would need {fmt(fsdp_needed)} per rank"
    lines += ["", f"  {verdict}"]
    alt = toggled(run)
    change = alt.flops["total"] / plan.flops["total"] - 1
    lines.append(f"  gradient checkpointing {'on' if alt.setup.gradient_checkpointing else 'off'} instead: peak "
                 f"{fmt(alt.peak)} ({fmt(alt.device_total())} with margins), {change:+.0%} compute")
    f = plan.flops
    lines.append(f"  compute: {f['total'] / 1e12:.2f} TFLOP per optimizer step per rank ({f['tokens']:,} positions; "
                 f"forward {f['forward'] / 1e12:.2f}, backward {f['backward'] / 1e12:.2f}, recompute "
                 f"{f['recompute'] / 1e12:.2f}, head and loss {f['head and loss'] / 1e12:.2f}"
                 + (f", reference {f['reference'] / 1e12:.2f}" if "reference" in f else "")
                 + (f", KTO KL {f['KTO KL'] / 1e12:.2f}" if "KTO KL" in f else "") + ")")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    from tunekit.commands.compose import compose_configs

    configs = compose_configs(args.overrides)
    facts = planning_facts(args.device or default_device().type,
                           None if args.memory is None else int(args.memory * GiB))
    results, texts = [], []
    for cfg in configs:
        chose = resolve_auto(cfg, facts, args.memory, args.gpus)
        # the DDP (or single-process) column, and FSDP's with the paths FSDP2 runs
        shape, setup = planner_inputs(cfg, facts, ranks=args.gpus, sharded=False)
        fsdp_setup = planner_inputs(cfg, facts, student=shape, ranks=args.gpus, sharded=True)[1] if args.gpus > 1 else None
        plan = predict(shape, setup, facts, args.gpus, fsdp_setup)
        if cfg.model.preset:
            source = f"preset {cfg.model.preset}: {preset_source(cfg.model.preset)}"
        else:
            source = "config.json of " + (cfg.model.path or "the embedded default model")
        results.append({**as_dict(plan, args.memory, cfg), "auto": chose})
        texts.append(render(plan, args.memory, cfg, source)
                     + "".join(f"\n  {k}=auto -> {v} (what `tunekit train` picks for this device)"
                               for k, v in chose.items()))
    if args.json:
        print(json.dumps(results[0] if len(results) == 1 else results, indent=2, default=str))
    else:
        print("\n\n".join(texts))
    sys.stdout.flush()


def resolve_auto(cfg, facts, memory_gib: Optional[float], ranks: int) -> dict:
    """Resolve `auto` settings in place as `tunekit train` would on this device (with --memory: a
    device of that size, its runtime or CUDA context spent); returns {key: chosen value}."""
    from tunekit.plan.choose import candidates, choose, is_auto

    keys = [k for k, v in (("trainer.micro_batch_size", cfg.trainer.micro_batch_size),
                           ("model.gradient_checkpointing", cfg.model.gradient_checkpointing),
                           ("model.offload_activations", cfg.model.offload_activations)) if is_auto(v)]
    if not keys:
        return resolve_start(cfg, facts, ranks)
    if memory_gib is not None:
        spent = 0.5 * GiB if facts.type == "cuda" else 0.65 * GiB  # CUDA context / CPU runtime, as the plan states
        available = int(memory_gib * GiB - spent)
    else:
        import torch

        available = available_memory_bytes(torch.device(facts.type))
    try:
        b, c, plan = choose(cfg, facts, available, ranks)
        o = plan.setup.offload_activations if plan is not None else candidates(cfg, facts, ranks)[-1][2]
    except TunekitError:  # nothing fits: plan the safest choice, whose table then says so
        b, c, o = candidates(cfg, facts, ranks)[-1]
    cfg.trainer.micro_batch_size, cfg.model.gradient_checkpointing = b, c
    if is_auto(cfg.model.offload_activations):
        cfg.model.offload_activations = o
    values = {"trainer.micro_batch_size": b, "model.gradient_checkpointing": "on" if c else "off",
              "model.offload_activations": "on" if o else "off"}
    # offloading is a choice only where it can run (a GPU, with checkpointing)
    return {**{k: values[k] for k in keys if k != "model.offload_activations" or (c and facts.type == "cuda")},
            **resolve_start(cfg, facts, ranks)}


def resolve_start(cfg, facts, ranks: int) -> dict:
    """The method's `auto` start as `tunekit train` resolves it (LoRA's method.init=auto), where the run's
    steps are a number here (trainer.epochs counts them from the rows, at train time)."""
    from tunekit.config import DEFAULT_MAX_STEPS
    from tunekit.methods import get_method
    from tunekit.plan.choose import plan_for

    if getattr(cfg.trainer, "epochs", None) is not None:
        return {}
    steps = cfg.trainer.max_steps if isinstance(cfg.trainer.max_steps, int) else DEFAULT_MAX_STEPS
    try:
        plan = plan_for(cfg, facts, ranks, cfg.trainer.micro_batch_size, bool(cfg.model.gradient_checkpointing))
    except TunekitError:
        plan = None
    note = get_method(cfg.method.name).resolve_start(cfg, facts, plan, steps)
    return {"method.init": note.split("-> ", 1)[1]} if note else {}

