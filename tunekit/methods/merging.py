"""From a training model to a plain transformers one: what every merging method (LoRA, BitFit, (IA)^3)
does once its trained part is folded into the weights.

`dequantized_linear` reads a bitsandbytes Linear4bit afresh from its packed codes into an fp32
nn.Linear, so that a merge adds to (or scales) exact fp32 weights with no 4-bit rounding of the
result; `to_plain_model` undoes what loading in 4-bit and preparing for training did. torch and
bitsandbytes are imported inside: method modules import this one at their top.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tunekit import TunekitError

if TYPE_CHECKING:
    import torch.nn as nn


def dequantized_linear(layer: nn.Module) -> nn.Linear:
    """An fp32 nn.Linear equal to a bitsandbytes Linear4bit, read afresh from its packed codes.

    The packed weight must be in bitsandbytes' portable layout: the loader turns off the CPU
    repack (keep_bnb_layout) after which dequantize_4bit silently returns wrong weights.
    """
    import bitsandbytes.functional as bnbf
    import torch
    import torch.nn as nn

    weight = layer.weight
    if getattr(weight.quant_state, "packing_format_for_cpu", False):
        raise TunekitError("model: a 4-bit layer was repacked into bitsandbytes' CPU inference layout; "
                           "load the base with tunekit.model.load_base_model, which prevents this")
    w = bnbf.dequantize_4bit(weight.data, weight.quant_state).float()  # (out, in)
    plain = nn.Linear(w.shape[1], w.shape[0], bias=layer.bias is not None, device=w.device, dtype=torch.float32)
    with torch.no_grad():
        plain.weight.copy_(w)
        if layer.bias is not None:
            plain.bias.copy_(layer.bias.float())
    return plain


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def to_plain_model(model: nn.Module) -> nn.Module:
    """Undo what loading in 4-bit and preparing for training did: a model that saves and runs as
    an ordinary transformers model. Remaining Linear4bit layers become fp32 nn.Linear, and then
    the whole model goes to fp32 (prepare_model_for_kbit_training already made norms and
    embeddings fp32); the input-grad hook and gradient checkpointing are switched off.
    """
    import torch

    from tunekit.model.layers import is_4bit

    quantized = [name for name, m in model.named_modules() if is_4bit(m)]
    for name in quantized:
        replace_module(model, name, dequantized_linear(model.get_submodule(name)))
    if quantized or getattr(model, "is_quantized", False):
        for attr in ("hf_quantizer", "quantization_method"):
            if hasattr(model, attr):
                delattr(model, attr)
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.is_quantized = False
        model.is_loaded_in_4bit = False
        model.float()
        model.config.dtype = torch.float32
    if getattr(model, "_require_grads_hook", None) is not None:
        model.disable_input_require_grads()
    # transformers 5 renamed gradient checkpointing to activation checkpointing
    if hasattr(model, "is_activation_checkpointing"):
        on, disable = model.is_activation_checkpointing, model.activation_checkpointing_disable
    else:
        on, disable = getattr(model, "is_gradient_checkpointing", False), model.gradient_checkpointing_disable
    if on:
        disable()
    model.config.use_cache = True
    model.requires_grad_(False)
    return model
