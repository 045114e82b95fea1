"""Questions about a loaded model's structure, asked by methods, compilation and FSDP alike.

`decoder_layers(model)`: the repeated decoder blocks of a transformers causal LM, under a peft
wrapper or not. `is_4bit(module)`: whether a module's weight is a bitsandbytes 4-bit parameter.
One definition each, so that the adapter method, BitFit, torch.compile and FSDP sharding all agree
on which blocks and which layers they mean.
"""

from __future__ import annotations

import torch.nn as nn

from tunekit import TunekitError


def is_4bit(module: nn.Module) -> bool:
    """A bitsandbytes Linear4bit (or any module whose weight carries a 4-bit quant_state)."""
    return getattr(getattr(module, "weight", None), "quant_state", None) is not None


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder blocks of a transformers causal LM, in order (model.model.layers for Llama and
    kin), through a peft wrapper; one error line when the model has none."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise TunekitError(f"model: {type(base).__name__} has no decoder layers (tunekit finds a causal LM's "
                           "repeated blocks at get_decoder().layers, as in Llama and kin)")
    return list(layers)
