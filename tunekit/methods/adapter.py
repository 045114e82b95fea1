"""Bottleneck adapters (Houlsby et al. 2019, arXiv:1902.00751) inside every decoder block.

Each adapter maps a sublayer's output h: (batch, seq, dim) to

    h + up(act(down(h)))      down: dim -> bottleneck, up: bottleneck -> dim, up initialised to 0

and sits where Houlsby put it: on the output of the attention sublayer and of the MLP sublayer,
before the block adds its residual. With `up` zero the model is unchanged at step 0. Houlsby also
trained the layer norms; here only the adapters train, so the method is "exactly the parameters
it added" like every other tunekit method.

peft has no such method, so it is built here on the model instance, without touching any
transformers class: the adapters are registered as children of each decoder layer (so they move,
save and count with the model) and a forward hook on `self_attn` / `mlp` rewrites the sublayer's
output. Attention returns a tuple (output, weights); only the output is adapted. The adapters
compute in fp32 whatever the base (bf16 or 4-bit) and hand back the sublayer's dtype.

Saved as adapter_model.safetensors (fp32, keys = the parameters' names in the model) plus a
tunekit adapter_config.json; an adapter is not a change to existing weights, so it cannot merge.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn

from tunekit import TunekitError
from tunekit.checks import names, number, one_of
from tunekit.methods.registry import Method, register
from tunekit.methods.saving import load_tensors_into, save_tensors

ACTIVATIONS = {"gelu": nn.GELU, "silu": nn.SiLU, "relu": nn.ReLU}
SUBLAYERS = ("self_attn", "mlp")
CHILD = "bottleneck_adapters"  # the ModuleDict's name inside each decoder layer (in state-dict keys)
CONFIG_TYPE = "TUNEKIT_BOTTLENECK_ADAPTER"


class Bottleneck(nn.Module):
    """h + up(act(down(h))): (..., dim) -> (..., dim), computed in fp32, returned in h's dtype."""

    def __init__(self, dim: int, bottleneck: int, activation: str, device=None):
        super().__init__()
        self.down = nn.Linear(dim, bottleneck, device=device, dtype=torch.float32)
        self.act = ACTIVATIONS[activation]()
        self.up = nn.Linear(bottleneck, dim, device=device, dtype=torch.float32)
        nn.init.zeros_(self.up.weight)  # identity at init: training starts from the base model
        nn.init.zeros_(self.up.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = h.float()
        return (x + self.up(self.act(self.down(x)))).to(h.dtype)


def _adapt_output(module: nn.Module, args, output, adapter: Bottleneck):
    if isinstance(output, tuple):  # attention: (hidden (batch, seq, dim), attention weights or None)
        return (adapter(output[0]), *output[1:])
    return adapter(output)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder blocks of a transformers causal LM (model.model.layers for Llama and kin)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise TunekitError(f"model: {type(base).__name__} has no decoder.layers; the adapter method needs them")
    return layers


@register("adapter")
class BottleneckAdapter(Method):
    can_merge = False

    @staticmethod
    def check_config(cfg, model: nn.Module | None = None, quantize: str = "none") -> None:
        number("method.bottleneck", cfg.bottleneck, ge=1, integer=True)
        one_of("method.activation", cfg.activation, sorted(ACTIVATIONS))
        sublayers = names("method.sublayers", cfg.sublayers, "sublayers")
        bad = [s for s in sublayers if s not in SUBLAYERS]
        if bad:
            raise TunekitError(f"method.sublayers: {bad[0]!r} is not a sublayer; choose from {list(SUBLAYERS)}")
        if model is not None:
            layer = decoder_layers(model)[0]
            absent = [s for s in sublayers if not isinstance(getattr(layer, s, None), nn.Module)]
            if absent:
                raise TunekitError(f"method.sublayers: the decoder blocks of {type(model).__name__} have no "
                                   f"{absent[0]!r} sublayer")

    def apply(self, model: nn.Module, cfg) -> nn.Module:
        self.check_config(cfg, model)
        bottleneck, activation, sublayers = cfg.bottleneck, cfg.activation, list(cfg.sublayers)
        model.requires_grad_(False)
        dim = model.config.hidden_size
        for layer in decoder_layers(model):
            if hasattr(layer, CHILD):
                raise TunekitError("model: bottleneck adapters are already applied to this model")
            device = next(layer.parameters()).device
            adapters = nn.ModuleDict({s: Bottleneck(dim, bottleneck, activation, device) for s in sublayers})
            layer.add_module(CHILD, adapters)
            for s in sublayers:
                # with_kwargs=False: the hook sees (module, args, output) and its return replaces output
                getattr(layer, s).register_forward_hook(
                    lambda mod, args, out, a=adapters[s]: _adapt_output(mod, args, out, a))
        model.tunekit_adapter_config = {
            "method": CONFIG_TYPE, "bottleneck": bottleneck, "activation": activation, "targets": sublayers,
            "hidden_size": dim, "num_layers": len(decoder_layers(model)),
            "base_model_name_or_path": getattr(model.config, "_name_or_path", None) or None,
        }
        return model

    def _state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return {name: p for name, p in model.named_parameters() if f".{CHILD}." in name}

    def owns(self, param_name: str) -> bool:
        return f".{CHILD}." in param_name

    def write(self, model: nn.Module, out_dir: Path) -> None:
        save_tensors(out_dir, self._state(model), model.tunekit_adapter_config)

    def read(self, model: nn.Module, in_dir: Path) -> None:
        load_tensors_into(in_dir, self._state(model))
