"""Settings from the plan: resolve `auto`, and refuse before loading what cannot fit.

`trainer.micro_batch_size=auto` and `model.gradient_checkpointing=auto` pick the fastest settings
whose planned peak fits the device's free memory with AUTO_HEADROOM to spare:

* checkpointing off whenever the step fits without it (at micro-batch 1 at least): recomputing
  the forward pass costs a third more compute on every token, while a larger micro-batch only
  helps until the device is busy;
* the largest micro-batch in 64, 32, ..., 1 that fits (grad_accum is kept, so the global batch
  is micro-batch x grad_accum x ranks).

Explicit values are obeyed. If the plan says the configuration cannot fit, the run stops here,
before any weights load, with the plan's breakdown in one line (trainer.memory_check=false
turns that into a warning: the plan is for the worst micro-batch, full-length rows).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable, Optional

import torch

from tunekit import TunekitError
from tunekit.device.facts import DeviceFacts, available_memory_bytes, probe, rank_device
from tunekit.plan import AUTO_HEADROOM, GiB, Plan, predict
from tunekit.plan.inputs import planner_inputs, runs_sharded
from tunekit.plan.memory import estimated, method_of, micro_batch_words

log = logging.getLogger(__name__)
AUTO_MICRO_BATCHES = (64, 32, 16, 8, 4, 2, 1)


def is_auto(value) -> bool:
    """tunekit.train.checks.validate normalises the `auto` keys to an int/bool or the string "auto"."""
    return value == "auto"


def gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def breakdown(plan: Plan) -> str:
    """The terms of what the run still needs, in one line, largest first."""
    terms = plan.needed_terms()
    text = ", ".join(f"{k} {gib(v)}" for k, v in sorted(terms.items(), key=lambda kv: -kv[1]) if v > 0)
    if plan.facts.type == "cpu" and plan.ranks > 1:
        text += f"; per process, x {plan.ranks} processes"
    return text


def hints(plan: Plan) -> str:
    s = plan.setup
    keys = ["trainer.micro_batch_size or data.max_seq_len"]
    if not s.gradient_checkpointing:
        keys.append("model.gradient_checkpointing=true")
    if s.quantize != "nf4" and not method_of(s).trains_base:  # a method training the base's weights needs them whole
        keys.append("model.quantize=nf4")
    return "lower " + keys[0] + "".join(f", set {k}" for k in keys[1:])


def candidates(cfg, facts: Optional[DeviceFacts] = None, ranks: int = 1) -> list[tuple[int, bool, bool]]:
    """(micro_batch_size, gradient_checkpointing, offload_activations) to try, the fastest first:
    every size without checkpointing, then with it, then with its saved inputs offloaded to the host
    (where offloading can run at all: a GPU, checkpointing, no FSDP). Offloading copies every block's
    input out and back each micro-batch, so `auto` takes it only when nothing fits without it."""
    from tunekit.device.facts import offload_activations

    t, m = cfg.trainer, cfg.model
    sizes = AUTO_MICRO_BATCHES if is_auto(t.micro_batch_size) else (t.micro_batch_size,)
    ckpt = (False, True) if is_auto(m.gradient_checkpointing) else (m.gradient_checkpointing,)
    sharded = runs_sharded(cfg, ranks)
    out = []
    for c in ckpt:
        can = facts is not None and offload_activations(True, facts, c, sharded)
        setting = m.offload_activations
        offloads = ((False, True) if is_auto(setting) else (bool(setting),)) if can else (False,)
        out += [(b, c, o) for o in offloads for b in sizes]
    return out


def plan_for(cfg, facts: DeviceFacts, ranks: int, micro_batch: int, checkpointing: bool,
             offload: Optional[bool] = None) -> Plan:
    """The plan of these settings; `offload` None: model.offload_activations as set (auto: on where it can run)."""
    from dataclasses import replace

    shape, setup = planner_inputs(cfg, facts, ranks=ranks)
    from tunekit.device.facts import offload_activations

    sharded = runs_sharded(cfg, ranks)
    setting = cfg.model.offload_activations if offload is None else offload
    setup = replace(setup, micro_batch_size=micro_batch, gradient_checkpointing=checkpointing,
                    offload_activations=offload_activations(setting, facts, checkpointing, sharded))
    return predict(shape, setup, facts, ranks).as_run(sharded)  # a sharded run's ranks hold the FSDP figures


def choose(cfg, facts: DeviceFacts, available: Optional[int], ranks: int = 1) -> tuple[int, bool, Optional[Plan]]:
    """(micro_batch_size, gradient_checkpointing, plan of that choice) for this device. The plan's
    setup says whether the checkpointed inputs are offloaded (`offload_activations`).

    Raises TunekitError when nothing fits and trainer.memory_check is on.
    """
    tries = candidates(cfg, facts, ranks)
    auto = len(tries) > 1
    if available is None:  # free memory unknown: the safe end of each auto range
        b, c, _ = tries[-1] if auto else tries[0]
        return b, c, None
    plans = []
    for b, c, o in tries:
        plan = plan_for(cfg, facts, ranks, b, c, o)
        if plan.fits(available, AUTO_HEADROOM if auto else 0.0):
            return b, c, plan
        plans.append(plan)
    smallest = plans[-1]
    where = f"{facts.describe()}" + (f", {ranks} processes sharing it" if facts.type == "cpu" and ranks > 1 else "")
    msg = (f"memory: the planned peak {gib(smallest.needed_beyond_runtime())} does not fit the {gib(available)} free "
           f"on {where} ({breakdown(smallest)}); {hints(smallest)}")
    if cfg.trainer.memory_check:
        raise TunekitError(msg + ", or trainer.memory_check=false to try anyway")
    log.warning("%s (trainer.memory_check=false: trying anyway)", msg)
    return smallest.setup.micro_batch_size, smallest.setup.gradient_checkpointing, smallest


def saved_settings(output_dir: Path) -> dict:
    """micro_batch_size, gradient_checkpointing and the method's start (method.init) of the run saved in
    output_dir (config.yaml)."""
    import yaml

    try:
        saved = yaml.safe_load((Path(output_dir) / "config.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError):
        return {}
    return {"micro_batch_size": saved.get("trainer", {}).get("micro_batch_size"),
            "gradient_checkpointing": saved.get("model", {}).get("gradient_checkpointing"),
            "method_init": (saved.get("method") or {}).get("init")}


def resolve_memory_settings(cfg, device: torch.device, ranks: int = 1, local_rank: int = 0,
                            least: Callable[[int], int] = lambda n: n, output_dir: Optional[Path] = None) -> str:
    """Resolve cfg's `auto` values in place from the plan and refuse what cannot fit.

    Called by the trainer before anything loads. `least(n)` returns the smallest n over the
    ranks, so that every rank chooses from the same free memory (they must agree on the batch).
    A resumed run (trainer.resume, output_dir holding its config.yaml) keeps the values its first
    start chose: the batch schedule depends on them. Returns the start-up line to log.
    """
    if cfg.trainer.resume and output_dir is not None:
        kept = saved_settings(output_dir)
        if is_auto(cfg.trainer.micro_batch_size) and isinstance(kept.get("micro_batch_size"), int):
            cfg.trainer.micro_batch_size = kept["micro_batch_size"]
        if is_auto(cfg.model.gradient_checkpointing) and isinstance(kept.get("gradient_checkpointing"), bool):
            cfg.model.gradient_checkpointing = kept["gradient_checkpointing"]
    wants_auto = is_auto(cfg.trainer.micro_batch_size) or is_auto(cfg.model.gradient_checkpointing)
    device = rank_device(device, local_rank)
    facts = probe(device)
    try:
        planner_inputs(cfg, facts, ranks=ranks)
    except TunekitError as e:
        if wants_auto:
            raise TunekitError(f"{e} (needed to resolve auto settings; give explicit values)") from None
        return f"memory: not planned ({e})"
    available = available_memory_bytes(device)
    available = least(-1 if available is None else available)
    available = None if available < 0 else available
    b, c, plan = choose(cfg, facts, available, ranks)
    chosen = []
    if is_auto(cfg.trainer.micro_batch_size):
        chosen.append(f"trainer.micro_batch_size=auto -> {b}")
    if is_auto(cfg.model.gradient_checkpointing):
        chosen.append(f"model.gradient_checkpointing=auto -> {'on' if c else 'off'}")
    if is_auto(cfg.model.offload_activations):
        # what the plan chose (the safe end where free memory is unknown)
        o = plan.setup.offload_activations if plan is not None else candidates(cfg, facts, ranks)[-1][2]
        cfg.model.offload_activations = o
        if c and facts.type == "cuda":
            chosen.append(f"model.offload_activations=auto -> {'on' if o else 'off'}")
    cfg.trainer.micro_batch_size, cfg.model.gradient_checkpointing = b, c
    settings = ", ".join(chosen) or f"micro-batch {b}, gradient checkpointing {'on' if c else 'off'}"
    if plan is None:
        return f"memory: {settings}; free memory unknown on {facts.describe()}, not planned"
    free = f"{gib(available)} free on {facts.describe()}"
    return (f"memory: {settings}; planned peak {gib(plan.needed_beyond_runtime())} of {free} "
            f"(worst micro-batch: {micro_batch_words(plan.setup)} x {cfg.data.max_seq_len} tokens){estimate_note(plan)}")


def estimate_note(plan) -> str:
    """What a plan leaves out, said where it is shown: a method without planning hooks of its own."""
    if not estimated(plan.shape, plan.setup):
        return ""
    return (f"; an estimate: method {plan.setup.method!r} has no plan of its own, so what it adds (its trained "
            "tensors, their optimizer state, what its layers keep for backward) is not counted")
