"""BitFit (Ben Zaken et al. 2021, arXiv:2106.10199): only the bias terms train.

Llama-family models (SmolLM2 included) have no biases, so BitFit here adds a zero bias b: (out,)
to each target projection (default every linear projection of every block: q,k,v,o,gate,up,down)
and trains only those: y = W x + b, unchanged at step 0.

The bias is an fp32 parameter named `bitfit_bias` on the projection itself, added by a forward
hook in fp32 and then cast to the projection's output dtype. It is deliberately not the layer's
own `.bias`: bitsandbytes' Linear4bit.forward casts `self.bias.data` to the input dtype in place,
which would silently turn a trained fp32 bias into bf16 after the first step.

Saved as adapter_model.safetensors with keys `<module>.bias` (the names the merged model uses)
plus a tunekit adapter_config.json. Merging yields a plain LlamaForCausalLM-style model with
config.attention_bias / config.mlp_bias set, the biases copied in (zeros for projections that did
not train), so the merged folder reloads with from_pretrained and gives the same logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, List

from tunekit import TunekitError
from tunekit.checks import names
from tunekit.methods.merging import dequantized_linear, replace_module, to_plain_model
from tunekit.methods.registry import Method, is_off, register
from tunekit.methods.bitfit.config import BitFitConfig
from tunekit.plan.shape import PROJECTIONS
from tunekit.plan.terms import PlanTerms, planned_projections

if TYPE_CHECKING:
    import torch
    import torch.nn as nn

ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Which config flag makes transformers' Llama create a bias on each projection.
BIAS_FLAG = {"q_proj": "attention_bias", "k_proj": "attention_bias", "v_proj": "attention_bias",
             "o_proj": "attention_bias", "gate_proj": "mlp_bias", "up_proj": "mlp_bias", "down_proj": "mlp_bias"}
PARAM = "bitfit_bias"
CONFIG_TYPE = "TUNEKIT_BITFIT"


@dataclass(frozen=True)
class BitFitPlan:
    targets: tuple = PROJECTIONS


def _add_bias(module: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
    # output: (..., out). Adding in fp32 keeps the small trained bias exact in the sum.
    if is_off():  # the base alone (tunekit.methods.registry.trained_part_off)
        return None
    return (output.float() + getattr(module, PARAM)).to(output.dtype)


def _targets(model: nn.Module, wanted: list[str]) -> list[tuple[str, nn.Module]]:
    """(full name, projection) for every wanted projection inside the decoder blocks."""
    from tunekit.model.layers import decoder_layers

    wanted = _target_names(wanted)
    inside = {id(m) for layer in decoder_layers(model) for m in layer.modules()}  # not lm_head and the like
    found = [(name, m) for name, m in model.named_modules() if name.rsplit(".", 1)[-1] in wanted and id(m) in inside]
    if not found:
        raise TunekitError(f"method.target_modules: no module named {wanted} in this model")
    return found


def _target_names(wanted) -> list[str]:
    wanted = names("method.target_modules", wanted, "projection names")
    if wanted == ["all-linear"]:
        return list(ALL_LINEAR)
    unknown = [n for n in wanted if n not in BIAS_FLAG]
    if unknown:
        raise TunekitError(f"method.target_modules: {unknown} are not Llama projections; choose from "
                           f"{list(ALL_LINEAR)} or [all-linear]")
    return wanted


@register("bitfit")
class BitFit(Method):
    can_merge = True
    can_switch_off = True
    config = BitFitConfig
    adapter_kinds = (CONFIG_TYPE,)
    plan_options_type = BitFitPlan
    plan_aliases = {"bitfit_targets": "targets"}

    def check_config(self, cfg, model: nn.Module | None = None, quantize: str = "none") -> None:
        targets = self.settings(cfg).target_modules
        _target_names(targets)
        if model is None:
            return
        for _, proj in _targets(model, targets):
            if hasattr(proj, PARAM):
                raise TunekitError("model: BitFit biases are already applied to this model")
            if getattr(proj, "bias", None) is not None:
                raise TunekitError(f"method.name=bitfit: the projections of {type(model).__name__} already have "
                                   "biases; BitFit here adds biases to bias-free (Llama-style) projections only")

    def apply(self, model: nn.Module, cfg) -> nn.Module:
        import torch
        import torch.nn as nn

        self.check_config(cfg, model)
        model.requires_grad_(False)
        targets = _targets(model, self.settings(cfg).target_modules)
        for _, proj in targets:
            device = proj.weight.device
            proj.register_parameter(PARAM, nn.Parameter(torch.zeros(proj.out_features, device=device)))
            proj.register_forward_hook(_add_bias)
        model.tunekit_bitfit_config = {
            "method": CONFIG_TYPE, "targets": sorted({n.rsplit(".", 1)[-1] for n, _ in targets}),
            "base_model_name_or_path": getattr(model.config, "_name_or_path", None) or None,
        }
        return model

    def _state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """{"model.layers.0.self_attn.q_proj.bias": (out,) parameter, ...}"""
        return {self.saved_key(name): p for name, p in model.named_parameters() if name.endswith(PARAM)}

    def owns(self, param_name: str) -> bool:
        return param_name.endswith(PARAM)

    def saved_key(self, param_name: str) -> str:
        return param_name.removesuffix(PARAM) + "bias"

    def write(self, model: nn.Module, out_dir: Path) -> None:
        from tunekit.methods.saving import save_tensors

        save_tensors(out_dir, self._state(model), model.tunekit_bitfit_config)

    def read(self, model: nn.Module, in_dir: Path) -> None:
        from tunekit.methods.saving import load_tensors_into

        load_tensors_into(in_dir, self._state(model))

    def merge(self, model: nn.Module) -> nn.Module:
        """Every projection of every block becomes an nn.Linear with a bias (the trained one, or
        zeros), so that config.attention_bias = config.mlp_bias = True describes the model exactly."""
        import torch
        import torch.nn as nn

        from tunekit.model.layers import is_4bit

        trained = self._state(model)
        # Every projection the flags will give a bias to, trained or not.
        projections = _targets(model, ["all-linear"])
        flags = {BIAS_FLAG[name.rsplit(".", 1)[-1]] for name, _ in projections}
        for name, proj in projections:
            if is_4bit(proj):
                plain = dequantized_linear(proj)  # fp32, read afresh from the packed codes
            else:  # reuse the frozen weight; "meta" skips initialising a weight we replace at once
                plain = nn.Linear(proj.in_features, proj.out_features, bias=False, device="meta")
                plain.weight = proj.weight
            trained_bias = trained.get(name + ".bias")
            bias = torch.zeros(proj.out_features, device=plain.weight.device, dtype=plain.weight.dtype)
            if trained_bias is not None:
                bias.copy_(trained_bias.detach())
            plain.bias = nn.Parameter(bias)
            replace_module(model, name, plain)  # the projection's hook goes with it
        for flag in flags:
            setattr(model.config, flag, True)
        del model.tunekit_bitfit_config
        return to_plain_model(model)

    def config_from_adapter(self, adapter_cfg: dict):
        from tunekit.methods import MethodConfig

        return MethodConfig(name="bitfit", target_modules=list(adapter_cfg["targets"]))

    # ------------------------------------------------------------ the training plan
    def plan_options(self, cfg) -> BitFitPlan:
        return BitFitPlan(targets=planned_projections(self.settings(cfg).target_modules))

    def plan_label(self, o: BitFitPlan) -> str:
        return "BitFit biases"

    def plan_terms(self, shape, setup) -> PlanTerms:
        """A bias (out,) per target projection; the fp32 add keeps nothing for backward."""
        o: BitFitPlan = setup.options
        return PlanTerms(trainable=tuple([shape.projection(p)[1] for p in o.targets] * shape.num_layers),
                         grad_outputs=frozenset(o.targets))
