"""From a training config to the planner's plain inputs (a builder: it reads the config object).

`planner_inputs(cfg, facts)` returns the student's ModelShape and a TrainSetup with every
decision the memory model needs resolved for the device: the compute dtype (model.dtype=auto ->
bf16 where native), the student of a distillation (teacher every k-th layer), the method's own
planner options (`Method.plan_options`: a LoRA rank and targets, "all-linear" = the seven
projections, as in peft) and what its layers decide on this device (`Method.plan_setup`), the
dropout mask's size on this device type. `auto` values must be resolved before (plan.choose does
that by asking the planner).

Under trainer.strategy=fsdp on several ranks (`runs_sharded`) the setup is the one FSDP2 runs: the
checkpointed inputs stay on the device (tunekit.device.facts.offload_activations, sharded) and LoRA
over a 4-bit base computes through peft's layers (tunekit.train.strategy.FSDP2.choose_lora_backend):
an fp32 copy of every LoRA input, no fused kernel, no dense cache, whatever the method's own rules
for one device would say. The compute-dtype path has not been run over FSDP2's sharded 4-bit codes.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional


from tunekit.device.facts import DeviceFacts, compute_dtype, fsdp_projection_units, offload_activations
from tunekit.plan.memory import TrainSetup, method_of_name
from tunekit.plan.shape import ModelShape, model_shape, student_shape


def _value(v):
    return getattr(v, "value", v)


def runs_sharded(cfg, ranks: int) -> bool:
    """Whether a run of cfg over `ranks` processes shards its model (FSDP2): trainer.strategy=fsdp
    with more than one rank (one process trains as a plain single process)."""
    return _value(cfg.trainer.strategy) == "fsdp" and ranks > 1


def reference_is_base(cfg) -> bool:
    """Whether the run's loss scores against the base with the trained part switched off (a preference
    loss with a reference): a start that moves the base away from the model it starts from cannot."""
    from tunekit.losses.preference import has_reference

    return getattr(cfg, "objective", "sft") == "preference" and has_reference(_value(cfg.preference.loss))


def preference_setup(p) -> dict:
    """What a preference node decides for memory: a pair is two rows in one forward (KTO's unpaired
    rows one), a loss with a reference runs it each step unless precompute_ref computed it once, and
    KTO's KL estimate scores the mismatched rows twice more."""
    from tunekit.losses.preference import has_reference

    loss = _value(p.loss)
    return {"rows_per_example": 1 if loss == "kto" else 2,
            "reference_forward": has_reference(loss) and not p.precompute_ref,
            "kl_forwards": 2 if loss == "kto" and getattr(p, "kto_kl", "batch") == "batch" else 0}


def planner_inputs(cfg, facts: DeviceFacts, teacher_shape: Optional[ModelShape] = None,
                   student: Optional[ModelShape] = None, ranks: int = 1,
                   sharded: Optional[bool] = None) -> tuple[ModelShape, TrainSetup]:
    """(student shape, TrainSetup) of a composed TrainConfig on a device with these facts.

    The shapes are read from config.json files (or presets) unless passed in. `sharded`: plan the
    setup FSDP2 runs (None: what cfg runs over `ranks` processes, `runs_sharded`); `tunekit plan`
    asks for both to show the DDP and FSDP columns.
    """
    sharded = runs_sharded(cfg, ranks) if sharded is None else sharded
    m, t, d = cfg.method, cfg.trainer, cfg.distill
    distill = cfg.objective == "distill"
    if distill and teacher_shape is None:
        teacher_shape = model_shape(d.teacher, None, key="distill.teacher")
    if student is None:
        if distill and d.student_keep_every:
            student = student_shape(teacher_shape, d.student_keep_every)
        else:
            student = model_shape(cfg.model.path, getattr(cfg.model, "preset", None))
    dtype = compute_dtype(_value(cfg.model.dtype), facts)
    method = method_of_name(m.name)  # the method's planning hooks, registered by tunekit.methods
    setup = TrainSetup(
        method=m.name, options=method.plan_options(m),
        quantize=_value(cfg.model.quantize), compute_bytes=dtype.itemsize,
        gradient_checkpointing=cfg.model.gradient_checkpointing, micro_batch_size=t.micro_batch_size,
        grad_accum=t.grad_accum, seq_len=cfg.data.max_seq_len, packing=cfg.data.packing,
        packed_attention=bool(cfg.data.packing) and cfg.kernels.packed_attention and not cfg.kernels.compile
        and not method.prepends_positions,
        optimizer=_value(t.optimizer), dropout_mask_bytes=1 if facts.type == "cuda" else 4,
        offload_activations=offload_activations(getattr(cfg.model, "offload_activations", False), facts,
                                                cfg.model.gradient_checkpointing is True, sharded),
        fsdp_projection_units=sharded and fsdp_projection_units(facts.type, ranks),
    )
    setup = method.plan_setup(setup, student, cfg, facts, dtype)
    if sharded:  # FSDP2 keeps peft's LoRA layers on every rank (module docstring)
        setup = replace(setup, lora_compute=False, fused_kernel=False, dense_cache_bytes=0)
    if cfg.objective == "preference":
        setup = replace(setup, **preference_setup(cfg.preference))
    if distill:
        setup = replace(setup, teacher=teacher_shape, teacher_quantize=_value(d.teacher_quantize),
                        distill_chunk=d.chunk_size)
    return student, setup
