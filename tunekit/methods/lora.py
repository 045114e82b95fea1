"""LoRA (Hu et al. 2021, arXiv:2106.09685) through peft, on a bf16 or 4-bit NF4 base.

W x + (alpha / r) * B A dropout(x), with A: (r, in) Kaiming-initialised and B: (out, r) zero, so
the model is unchanged at step 0. peft keeps the frozen layer as `base_layer` and names the
adapter weights `lora_A` / `lora_B`, so what we save is a standard PEFT adapter folder that
`peft.PeftModel.from_pretrained` loads. Over a 4-bit base this is QLoRA (Dettmers et al. 2023).

Merging folds B A into W: peft's merge_and_unload on a bf16 base; on a 4-bit base each Linear4bit
is dequantized to fp32 from its packed codes and the fp32 delta added, so no 4-bit rounding of
the sum. The helpers that turn a 4-bit (and possibly gradient-checkpointed) training model into a
plain fp32 one are shared with the other merging methods (bitfit).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn
from peft import LoraConfig, PeftModel, get_peft_model, set_peft_model_state_dict
from safetensors.torch import load_file

from tunekit import TunekitError
from tunekit.checks import names, number
from tunekit.methods.registry import Method, register


def is_4bit(module: nn.Module) -> bool:
    return getattr(getattr(module, "weight", None), "quant_state", None) is not None


def dequantized_linear(layer: nn.Module) -> nn.Linear:
    """An fp32 nn.Linear equal to a bitsandbytes Linear4bit, read afresh from its packed codes.

    The packed weight must be in bitsandbytes' portable layout: the loader turns off the CPU
    repack (keep_bnb_layout) after which dequantize_4bit silently returns wrong weights.
    """
    import bitsandbytes.functional as bnbf

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


def check_targets(targets: list[str], model: nn.Module | None) -> list[str]:
    """method.target_modules: [all-linear] alone, or names that each match a module (peft matches a
    name or a dotted suffix of a module's path)."""
    targets = names("method.target_modules", targets)
    if "all-linear" in targets and len(targets) > 1:
        raise TunekitError(f"method.target_modules: all-linear stands alone, got {targets}")
    if model is None or targets == ["all-linear"]:
        return targets
    modules = [n for n, _ in model.named_modules()]
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in modules)]
    if missing:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise TunekitError(f"method.target_modules: no module named {missing[0]!r} in {type(model).__name__}; "
                           f"its linear layers are {linear}, or use [all-linear]")
    # peft matches a name against every module, containers included: a ModuleList (layers), an
    # attention block (self_attn) or the embeddings would fail deep inside peft with an error that
    # blames something else (or wrap layers LoRA is not meant for). LoRA here wraps Linear layers.
    by_name = dict(model.named_modules())
    for t in targets:
        hits = [n for n in by_name if n == t or n.endswith("." + t)]
        if not any(isinstance(by_name[n], nn.Linear) for n in hits):
            linear = sorted({n.rsplit(".", 1)[-1] for n, m in by_name.items() if isinstance(m, nn.Linear)})
            raise TunekitError(f"method.target_modules: {t!r} names {type(by_name[hits[0]]).__name__} modules "
                               f"({hits[0]}), not Linear projections; LoRA wraps Linear layers: choose from "
                               f"{linear}, or use [all-linear]")
    return targets


@register("lora")
class LoRA(Method):
    can_merge = True

    @staticmethod
    def check_config(cfg, model: nn.Module | None = None, quantize: str = "none") -> None:
        number("method.r", cfg.r, ge=1, integer=True)
        number("method.alpha", cfg.alpha, gt=0)  # the update is scaled by alpha / r: < 0 flips it, 0 removes it
        number("method.dropout", cfg.dropout, ge=0, lt=1)
        check_targets(cfg.target_modules, model)

    def apply(self, model: nn.Module, cfg) -> nn.Module:
        self.check_config(cfg, model)
        targets = list(cfg.target_modules)
        if targets == ["all-linear"]:
            targets = "all-linear"  # peft's own shorthand: every Linear but the output head
        lora_cfg = LoraConfig(
            r=cfg.r,
            lora_alpha=cfg.alpha,
            lora_dropout=cfg.dropout,
            target_modules=targets,
            bias="none",
            task_type="CAUSAL_LM",
        )
        try:
            return get_peft_model(model, lora_cfg)
        except ValueError as e:  # what check_config cannot see (a module type peft does not wrap)
            raise TunekitError(f"method: peft refuses this LoRA config: {str(e).splitlines()[0]}") from None

    def owns(self, param_name: str) -> bool:
        return ".lora_A." in param_name or ".lora_B." in param_name

    def saved_key(self, param_name: str) -> str:
        """peft's file keys drop the adapter name: ...lora_A.default.weight -> ...lora_A.weight."""
        return param_name.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")

    def write(self, model: PeftModel, out_dir: Path) -> None:
        model.save_pretrained(out_dir, safe_serialization=True)

    def read(self, model: PeftModel, in_dir: Path) -> None:
        state = load_file(str(Path(in_dir) / "adapter_model.safetensors"))
        result = set_peft_model_state_dict(model, state)
        unexpected = [k for k in result.unexpected_keys if "lora_" in k]
        if unexpected:
            raise TunekitError(f"{in_dir}: adapter does not fit this model (unexpected keys {unexpected[:3]})")

    def merge(self, model: PeftModel) -> nn.Module:
        """W + (alpha / r) B A in every LoRA layer; fp32 over a 4-bit base, the base dtype otherwise."""
        from peft.tuners.lora import LoraLayer

        lora_layers = [(name, m) for name, m in model.named_modules() if isinstance(m, LoraLayer)]
        if not any(is_4bit(m.get_base_layer()) for _, m in lora_layers):
            return to_plain_model(model.merge_and_unload())
        base = model.get_base_model()
        prefix = "base_model.model."  # peft's path to the wrapped model
        for name, layer in lora_layers:
            merged = dequantized_linear(layer.get_base_layer()) if is_4bit(layer.get_base_layer()) else None
            if merged is None:  # a high-precision layer in a 4-bit model: peft merges it in place
                layer.merge()
                merged = layer.get_base_layer()
            else:
                with torch.no_grad():
                    for adapter in layer.active_adapters:
                        merged.weight += layer.get_delta_weight(adapter).float()  # (out, in)
            replace_module(base, name.removeprefix(prefix), merged)
        return to_plain_model(base)
