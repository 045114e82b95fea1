"""Bottleneck adapters (Houlsby et al. 2019, arXiv:1902.00751) inside every decoder block.

Each adapter maps a sublayer's output h: (batch, seq, dim) to

    h + up(act(down(h)))      down: dim -> bottleneck, up: bottleneck -> dim, up initialised to 0

and sits where Houlsby put it: on the output of the attention sublayer and of the MLP sublayer,
before the block adds its residual. With `up` zero the model is unchanged at step 0. Houlsby also
trained the layer norms; here only the adapters train, so the method is "exactly the parameters
it added" like every other tunekit method.

peft has no such method, so it is built here on the model instance, without touching any
transformers class: the adapters (a ModuleDict down / act / up per sublayer) are registered as
children of each decoder layer (so they move, save and count with the model) and a forward hook on
`self_attn` / `mlp` rewrites the sublayer's output. Attention returns a tuple (output, weights);
only the output is adapted. The adapters compute in fp32 whatever the base (bf16 or 4-bit) and
hand back the sublayer's dtype.

Saved as adapter_model.safetensors (fp32, keys = the parameters' names in the model) plus a
tunekit adapter_config.json; an adapter is not a change to existing weights, so it cannot merge.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, List

from tunekit import TunekitError
from tunekit.checks import names, number, one_of
from tunekit.methods.registry import Method, is_off, register
from tunekit.methods.adapter.config import AdapterConfig
from tunekit.plan.terms import PlanTerms, Site

if TYPE_CHECKING:
    import torch
    import torch.nn as nn

ACTIVATIONS = ("gelu", "silu", "relu")  # torch.nn.GELU, SiLU, ReLU
SUBLAYERS = ("self_attn", "mlp")
SITES = {"self_attn": "attn_out", "mlp": "mlp_out"}  # where each adapter sits in the planner's block walk
CHILD = "bottleneck_adapters"  # the ModuleDict's name inside each decoder layer (in state-dict keys)
CONFIG_TYPE = "TUNEKIT_BOTTLENECK_ADAPTER"


@dataclass(frozen=True)
class AdapterPlan:
    bottleneck: int = 64
    sublayers: tuple = ("self_attn", "mlp")


def bottleneck(dim: int, width: int, activation: str, device=None) -> nn.ModuleDict:
    """One adapter: down (dim -> width), act, up (width -> dim) in fp32, up zero (identity at init)."""
    import torch
    import torch.nn as nn

    act = {"gelu": nn.GELU, "silu": nn.SiLU, "relu": nn.ReLU}[activation]()
    adapter = nn.ModuleDict({"down": nn.Linear(dim, width, device=device, dtype=torch.float32), "act": act,
                             "up": nn.Linear(width, dim, device=device, dtype=torch.float32)})
    nn.init.zeros_(adapter["up"].weight)  # identity at init: training starts from the base model
    nn.init.zeros_(adapter["up"].bias)
    return adapter


def run_bottleneck(adapter: nn.ModuleDict, h: torch.Tensor) -> torch.Tensor:
    """h + up(act(down(h))): (..., dim) -> (..., dim), computed in fp32, returned in h's dtype."""
    x = h.float()
    return (x + adapter["up"](adapter["act"](adapter["down"](x)))).to(h.dtype)


def _adapt_output(module: nn.Module, args, output, adapter: nn.ModuleDict):
    if is_off():  # the base alone (tunekit.methods.registry.trained_part_off)
        return None
    if isinstance(output, tuple):  # attention: (hidden (batch, seq, dim), attention weights or None)
        return (run_bottleneck(adapter, output[0]), *output[1:])
    return run_bottleneck(adapter, output)


@register("adapter")
class BottleneckAdapter(Method):
    can_merge = False
    can_switch_off = True
    config = AdapterConfig
    adapter_kinds = (CONFIG_TYPE,)
    plan_options_type = AdapterPlan
    plan_aliases = {"adapter_bottleneck": "bottleneck", "adapter_sublayers": "sublayers"}

    def check_config(self, cfg, model: nn.Module | None = None, quantize: str = "none") -> None:
        c = self.settings(cfg)
        number("method.bottleneck", c.bottleneck, ge=1, integer=True)
        one_of("method.activation", c.activation, sorted(ACTIVATIONS))
        sublayers = names("method.sublayers", c.sublayers, "sublayers")
        bad = [s for s in sublayers if s not in SUBLAYERS]
        if bad:
            raise TunekitError(f"method.sublayers: {bad[0]!r} is not a sublayer; choose from {list(SUBLAYERS)}")
        if model is not None:
            import torch.nn as nn

            from tunekit.model.layers import decoder_layers

            layer = decoder_layers(model)[0]
            absent = [s for s in sublayers if not isinstance(getattr(layer, s, None), nn.Module)]
            if absent:
                raise TunekitError(f"method.sublayers: the decoder blocks of {type(model).__name__} have no "
                                   f"{absent[0]!r} sublayer")

    def apply(self, model: nn.Module, cfg) -> nn.Module:
        import torch.nn as nn

        from tunekit.model.layers import decoder_layers

        self.check_config(cfg, model)
        c = self.settings(cfg)
        width, activation, sublayers = c.bottleneck, c.activation, list(c.sublayers)
        model.requires_grad_(False)
        dim = model.config.hidden_size
        for layer in decoder_layers(model):
            if hasattr(layer, CHILD):
                raise TunekitError("model: bottleneck adapters are already applied to this model")
            device = next(layer.parameters()).device
            adapters = nn.ModuleDict({s: bottleneck(dim, width, activation, device) for s in sublayers})
            layer.add_module(CHILD, adapters)
            for s in sublayers:
                # with_kwargs=False: the hook sees (module, args, output) and its return replaces output
                getattr(layer, s).register_forward_hook(
                    lambda mod, args, out, a=adapters[s]: _adapt_output(mod, args, out, a))
        model.tunekit_adapter_config = {
            "method": CONFIG_TYPE, "bottleneck": width, "activation": activation, "targets": sublayers,
            "hidden_size": dim, "num_layers": len(decoder_layers(model)),
            "base_model_name_or_path": getattr(model.config, "_name_or_path", None) or None,
        }
        return model

    def _state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return {name: p for name, p in model.named_parameters() if f".{CHILD}." in name}

    def owns(self, param_name: str) -> bool:
        return f".{CHILD}." in param_name

    def write(self, model: nn.Module, out_dir: Path) -> None:
        from tunekit.methods.saving import save_tensors

        save_tensors(out_dir, self._state(model), model.tunekit_adapter_config)

    def read(self, model: nn.Module, in_dir: Path) -> None:
        from tunekit.methods.saving import load_tensors_into

        load_tensors_into(in_dir, self._state(model))

    def config_from_adapter(self, adapter_cfg: dict):
        from tunekit.methods import MethodConfig

        return MethodConfig(name="adapter", bottleneck=int(adapter_cfg["bottleneck"]),
                            activation=adapter_cfg["activation"], sublayers=list(adapter_cfg["targets"]))

    # ------------------------------------------------------------ the training plan
    def plan_options(self, cfg) -> AdapterPlan:
        c = self.settings(cfg)
        return AdapterPlan(bottleneck=c.bottleneck, sublayers=tuple(c.sublayers))

    def plan_label(self, o: AdapterPlan) -> str:
        return f"adapters (bottleneck {o.bottleneck})"

    def plan_terms(self, shape, setup) -> PlanTerms:
        o: AdapterPlan = setup.options
        d, b = shape.hidden_size, o.bottleneck
        sites = {SITES[s] for s in o.sublayers}

        def saves(site: Site) -> int:
            # the fp32 input (cast from the sublayer's output), down's output and the activation's
            return site.tokens * (4 * d + 8 * b) if site.name in sites else 0

        flops = 2 * 2 * d * b * len(o.sublayers) * shape.num_layers  # down and up, per position
        # the attention adapter's parameters make the sublayer's output need a gradient (o_proj
        # stands for it, down_proj for the MLP's)
        outputs = {"self_attn": "o_proj", "mlp": "down_proj"}
        return PlanTerms(trainable=tuple([n for _ in o.sublayers for n in (d * b, b, b * d, d)] * shape.num_layers),
                         saves=saves, grad_outputs=frozenset(outputs[s] for s in o.sublayers),
                         forward_flops_per_token=flops, backward_flops_per_token=2 * flops)
