"""LoRA (Hu et al. 2021, arXiv:2106.09685) through peft, on a bf16 or 4-bit NF4 base.

W x + (alpha / r) * B A dropout(x), with A: (r, in) Kaiming-initialised and B: (out, r) zero, so
the model is unchanged at step 0. peft keeps the frozen layer as `base_layer` and names the
adapter weights `lora_A` / `lora_B`, so what we save is a standard PEFT adapter folder that
`peft.PeftModel.from_pretrained` loads. Over a 4-bit base this is QLoRA (Dettmers et al. 2023).
"""

from __future__ import annotations

from pathlib import Path

import torch.nn as nn
from peft import LoraConfig, PeftModel, get_peft_model, set_peft_model_state_dict
from safetensors.torch import load_file

from tunekit import TunekitError
from tunekit.methods import register


@register("lora")
class LoRA:
    can_merge = True

    def apply(self, model: nn.Module, cfg) -> nn.Module:
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
        except ValueError as e:  # peft says which target module it could not find
            raise TunekitError(f"method.target_modules: {e}") from None

    def save(self, model: PeftModel, out_dir: Path) -> None:
        model.save_pretrained(out_dir, safe_serialization=True)

    def load(self, model: PeftModel, in_dir: Path) -> None:
        state = load_file(str(Path(in_dir) / "adapter_model.safetensors"))
        result = set_peft_model_state_dict(model, state)
        missing = [k for k in result.unexpected_keys if "lora_" in k]
        if missing:
            raise TunekitError(f"{in_dir}: adapter does not fit this model (unexpected keys {missing[:3]})")
