"""From a training config to the planner's plain inputs (a builder: it reads the config object).

`planner_inputs(cfg, facts)` returns the student's ModelShape and a TrainSetup with every
decision the memory model needs resolved for the device: the compute dtype (model.dtype=auto ->
bf16 where native), the student of a distillation (teacher every k-th layer), the LoRA targets
("all-linear" = the seven projections, as in peft), the dropout mask's size on this device type.
`auto` values must be resolved before (plan.choose does that by asking the planner).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch

from tunekit import TunekitError
from tunekit.speed.device import DeviceFacts, compute_dtype, dense_cache_fits, offload_activations
from tunekit.plan.memory import TrainSetup
from tunekit.plan.shape import PROJECTIONS, ModelShape, model_shape, student_shape


def _value(v):
    return getattr(v, "value", v)


def _targets(names, key: str) -> tuple:
    names = list(names)
    if names == ["all-linear"]:
        return PROJECTIONS
    unknown = [n for n in names if n not in PROJECTIONS]
    if unknown:
        raise TunekitError(f"{key}: the planner models the projections {list(PROJECTIONS)}; cannot plan {unknown}")
    return tuple(names)


def planner_inputs(cfg, facts: DeviceFacts, teacher_shape: Optional[ModelShape] = None,
                   student: Optional[ModelShape] = None) -> tuple[ModelShape, TrainSetup]:
    """(student shape, TrainSetup) of a composed TrainConfig on a device with these facts.

    The shapes are read from config.json files (or presets) unless passed in.
    """
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
    setup = TrainSetup(
        method=m.name, lora_r=m.r, lora_targets=_targets(m.target_modules, "method.target_modules"),
        lora_dropout=m.dropout, bitfit_targets=_targets(m.target_modules, "method.target_modules"),
        adapter_bottleneck=m.bottleneck, adapter_sublayers=tuple(m.sublayers), num_virtual_tokens=m.num_virtual_tokens,
        quantize=_value(cfg.model.quantize), compute_bytes=2 if dtype == torch.bfloat16 else 4,
        gradient_checkpointing=cfg.model.gradient_checkpointing, micro_batch_size=t.micro_batch_size,
        grad_accum=t.grad_accum, seq_len=cfg.data.max_seq_len, packing=cfg.data.packing,
        optimizer=_value(t.optimizer), dropout_mask_bytes=1 if facts.type == "cuda" else 4,
        offload_activations=offload_activations(getattr(cfg.model, "offload_activations", False), facts,
                                                cfg.model.gradient_checkpointing is True),
    )
    if (setup.quantize == "nf4" and setup.method == "lora" and dtype == torch.bfloat16
            and _value(cfg.kernels.fused_lora) != "off"):
        # tunekit.speed.lora_path's rule: the LoRA matmuls in bf16 (the CPU's torch path, the GPU's fused kernel
        # or, where that is not trusted, the same torch path), never peft's fp32 branch
        setup = replace(setup, lora_compute=True, fused_kernel=facts.type == "cuda")
    if (facts.type == "cpu" and setup.quantize == "nf4" and setup.method == "lora"
            and dtype in (torch.bfloat16, torch.float32) and _value(cfg.kernels.fused_lora) == "auto"):
        # tunekit.speed.lora_path._torch_path's rule: the base kept dequantized in its compute dtype
        weights = sum(i * o for p in setup.lora_targets for i, o in [student.projection(p)])
        dense = setup.compute_bytes * student.num_layers * weights
        if dense_cache_fits(dense, facts):
            setup = replace(setup, dense_cache_bytes=dense)
    if distill:
        setup = replace(setup, teacher=teacher_shape, teacher_quantize=_value(d.teacher_quantize),
                        distill_chunk=d.chunk_size)
    return student, setup
