"""(IA)^3 (Liu et al. 2022, arXiv:2205.05638): learned vectors rescale keys, values and the MLP's inner activation.

Every target projection y = W x of every block gets a trained vector l, initialised to ones (so
the model is unchanged at step 0):

    output-scaled (k_proj, v_proj):          y = l * (W x)     l: (out,)   the keys, the values
    input-scaled  (down_proj, feedforward):   y = W (l * x)     l: (in,)    x = act(gate) * up

(method.target_modules, method.feedforward_modules; the paper's choice is the default.) The
vector is an fp32 parameter `ia3_l` on the projection, applied by a forward hook (output) or
pre-hook (input) as `(t * l).to(t.dtype)`: the product in fp32, rounded once to the stream's
dtype, which is what peft's IA3 layer computes over a bf16 base. It is not peft's layer:
peft 0.21's 4-bit IA3 layer (bnb Linear4bit) returns fp32 for a bf16 input, which breaks attention
over a bf16-compute 4-bit base; the hooks act the same over bf16 and 4-bit NF4 bases.

Saved in peft's IA3 format, so `peft.PeftModel.from_pretrained` loads it: adapter_config.json of
peft's IA3Config and adapter_model.safetensors with `base_model.model.<module>.ia3_l`, shaped as
peft shapes it, (out, 1) output-scaled and (1, in) input-scaled.

Merging scales the weight in place of the activation: rows of W by l (and the bias) for an
output-scaled projection, columns of W by l for an input-scaled one; in the base dtype over a bf16
base (as peft merges), in fp32 from the dequantized codes over a 4-bit base.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, List

from tunekit import TunekitError
from tunekit.checks import names
from tunekit.methods.merging import dequantized_linear, replace_module, to_plain_model
from tunekit.methods.registry import Method, is_off, register
from tunekit.methods.ia3.config import IA3Config
from tunekit.plan.shape import PROJECTIONS
from tunekit.plan.terms import PlanTerms, Site, planned_projections

if TYPE_CHECKING:
    import torch
    import torch.nn as nn

PARAM = "ia3_l"
PEFT_PREFIX = "base_model.model."  # peft's path to the wrapped model, in its file keys


@dataclass(frozen=True)
class IA3Plan:
    targets: tuple = ("k_proj", "v_proj", "down_proj")
    feedforward: tuple = ("down_proj",)


def _scale_output(module: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
    # output: (..., out); the fp32 product rounded once to the output's dtype
    if is_off():  # the base alone (tunekit.methods.registry.trained_part_off)
        return None
    return (output * getattr(module, PARAM).view(-1)).to(output.dtype)


def _scale_input(module: nn.Module, args):
    if is_off():
        return None
    x = args[0]  # (..., in)
    return ((x * getattr(module, PARAM).view(-1)).to(x.dtype), *args[1:])


def _resolve(c: IA3Config) -> tuple[list[str], list[str]]:
    """(targets, feedforward) as projection names; one error naming the key otherwise."""
    targets = names("method.target_modules", c.target_modules, "projection names")
    if targets == ["all-linear"]:
        targets = list(PROJECTIONS)
    unknown = [t for t in targets if t not in PROJECTIONS]
    if unknown:
        raise TunekitError(f"method.target_modules: {unknown} are not Llama projections; (IA)^3 here scales "
                           f"{list(PROJECTIONS)} or [all-linear]")
    feedforward = [] if list(c.feedforward_modules) == [] else names("method.feedforward_modules",
                                                                      c.feedforward_modules, "projection names")
    outside = [f for f in feedforward if f not in targets]
    if outside:
        raise TunekitError(f"method.feedforward_modules: {outside[0]!r} is not one of method.target_modules "
                           f"{targets}; the input-scaled projections are a subset of the targets")
    return targets, feedforward


def _projections(model: nn.Module, wanted: list[str]) -> list[tuple[str, nn.Module]]:
    """(full name, projection) for every wanted projection inside the decoder blocks."""
    from tunekit.model.layers import decoder_layers

    inside = {id(m) for layer in decoder_layers(model) for m in layer.modules()}  # not lm_head and the like
    found = [(n, m) for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in wanted and id(m) in inside]
    missing = sorted(set(wanted) - {n.rsplit(".", 1)[-1] for n, _ in found})
    if missing:
        raise TunekitError(f"method.target_modules: the decoder blocks of {type(model).__name__} have no "
                           f"{missing[0]!r} projection")
    return found


@register("ia3")
class IA3(Method):
    can_merge = True
    can_switch_off = True
    config = IA3Config
    adapter_kinds = ("IA3",)
    plan_options_type = IA3Plan

    def check_config(self, cfg, model: nn.Module | None = None, quantize: str = "none") -> None:
        targets, _ = _resolve(self.settings(cfg))
        if model is not None:
            for _, proj in _projections(model, targets):
                if hasattr(proj, PARAM):
                    raise TunekitError("model: (IA)^3 vectors are already applied to this model")

    def apply(self, model: nn.Module, cfg) -> nn.Module:
        import torch
        import torch.nn as nn

        self.check_config(cfg, model)
        targets, feedforward = _resolve(self.settings(cfg))
        model.requires_grad_(False)
        for name, proj in _projections(model, targets):
            scales_input = name.rsplit(".", 1)[-1] in feedforward
            shape = (1, proj.in_features) if scales_input else (proj.out_features, 1)  # peft's shapes
            proj.register_parameter(PARAM, nn.Parameter(torch.ones(shape, device=proj.weight.device)))
            if scales_input:
                proj.register_forward_pre_hook(_scale_input)
            else:
                proj.register_forward_hook(_scale_output)
        model.tunekit_ia3_config = {"target_modules": targets, "feedforward_modules": feedforward,
                                    "base_model_name_or_path": getattr(model.config, "_name_or_path", None) or None}
        return model

    def owns(self, param_name: str) -> bool:
        return param_name.endswith("." + PARAM)

    def saved_key(self, param_name: str) -> str:
        return PEFT_PREFIX + param_name

    def _state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return {self.saved_key(n): p for n, p in model.named_parameters() if self.owns(n)}

    def write(self, model: nn.Module, out_dir: Path) -> None:
        from peft import IA3Config as PeftIA3Config
        from safetensors.torch import save_file

        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        c = model.tunekit_ia3_config
        PeftIA3Config(task_type="CAUSAL_LM", target_modules=list(c["target_modules"]), inference_mode=True,
                      feedforward_modules=list(c["feedforward_modules"]),
                      base_model_name_or_path=c["base_model_name_or_path"]).save_pretrained(str(out_dir))
        save_file({k: v.detach().float().contiguous().cpu() for k, v in self._state(model).items()},
                  str(out_dir / "adapter_model.safetensors"))

    def read(self, model: nn.Module, in_dir: Path) -> None:
        from tunekit.methods.saving import load_tensors_into

        load_tensors_into(in_dir, self._state(model))

    def merge(self, model: nn.Module) -> nn.Module:
        """Each target becomes a plain nn.Linear with W scaled by l: rows (and the bias) where the
        output was scaled, columns where the input was."""
        import torch
        import torch.nn as nn

        from tunekit.model.layers import is_4bit

        for name, proj in [(n, m) for n, m in model.named_modules() if hasattr(m, PARAM)]:
            scale = getattr(proj, PARAM).detach().float()  # (out, 1): rows; (1, in): columns
            if is_4bit(proj):
                plain = dequantized_linear(proj)  # fp32, read afresh from the packed codes
            else:  # the frozen weight itself, scaled in place; "meta" skips initialising one we replace
                plain = nn.Linear(proj.in_features, proj.out_features, bias=False, device="meta")
                plain.weight, plain.bias = proj.weight, proj.bias
            with torch.no_grad():
                plain.weight.copy_((plain.weight.float() * scale).to(plain.weight.dtype))
                if plain.bias is not None and scale.shape[1] == 1:  # an output-scaled projection's bias
                    plain.bias.copy_((plain.bias.float() * scale.view(-1)).to(plain.bias.dtype))
            replace_module(model, name, plain)  # its hooks and vector go with it
        del model.tunekit_ia3_config
        return to_plain_model(model)

    def config_from_adapter(self, adapter_cfg: dict):
        """peft records module names or dotted paths; (IA)^3 here scales projections by name."""
        from tunekit.methods import MethodConfig

        def short(key):
            value = adapter_cfg[key] or []
            if isinstance(value, str):
                raise TunekitError(f"adapter_config.json: {key} is a pattern ({value!r}); tunekit reads a list of "
                                   "projection names")
            return sorted({v.rsplit(".", 1)[-1] for v in value})

        return MethodConfig(name="ia3", target_modules=short("target_modules"),
                            feedforward_modules=short("feedforward_modules"))

    # ------------------------------------------------------------ the training plan
    def plan_options(self, cfg) -> IA3Plan:
        c = self.settings(cfg)
        targets = planned_projections(c.target_modules)
        return IA3Plan(targets=targets, feedforward=tuple(f for f in c.feedforward_modules if f in targets))

    def plan_label(self, o: IA3Plan) -> str:
        return f"(IA)^3 vectors on {len(o.targets)} projections ({len(o.feedforward)} input-scaled)"

    def plan_terms(self, shape, setup) -> PlanTerms:
        """A vector per target; for backward, `t * l` keeps its tensor t (the vector's gradient is
        the sum of g * t): the projection's output where it scales the output, the site's input
        where it scales the input (one tensor for all the site's projections, and nothing where
        another op keeps it already), in the stream's dtype. No fp32 copy is made: the product
        promotes. Backward's working set gains the product's fp32 gradient and g * t, (T, dim) each."""
        o: IA3Plan = setup.options
        dims = {p: shape.projection(p)[0] if p in o.feedforward else shape.projection(p)[1] for p in o.targets}

        def saves(site: Site) -> int:
            outputs = sum(dims[p] for p in site.projections if p in o.targets and p not in o.feedforward)
            scaled_input = any(p in o.feedforward for p in site.projections) and not site.input_saved
            return site.tokens * site.dtype_bytes * (outputs + (site.in_dim(shape) if scaled_input else 0))

        per_token = shape.num_layers * sum(dims.values())  # one multiply per scaled element
        return PlanTerms(trainable=tuple([dims[p] for p in o.targets] * shape.num_layers), saves=saves,
                         grad_outputs=frozenset(o.targets), forward_flops_per_token=per_token,
                         # the input's gradient (g * l) and the vector's (g * t, summed over positions)
                         backward_flops_per_token=3 * per_token,
                         block_backward_per_token=8 * max(dims.values()))
