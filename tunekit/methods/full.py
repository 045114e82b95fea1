"""Full fine-tuning: every weight of the model trains. Meant for small students (recipe=distill
with method.name=full), not for the 4-bit bases the PEFT methods serve.

The weights train in fp32 even when the base loads in bf16: AdamW updates of ~lr * 1 on weights
of ~1e-2 fall below bf16's resolution (8 significant bits) and would be lost. Where the precision
policy computes in bf16, the forward runs under bf16 autocast: matmuls on bf16 copies of the fp32
weights, norms and residual stream in fp32 (the embeddings' own dtype). `save` writes a
plain Hugging Face model folder, so "merging" is the identity.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn
from tunekit import TunekitError
from tunekit.methods.registry import Method, register
from tunekit.methods.saving import read_tensors


@register("full")
class FullFineTune(Method):
    can_merge = True
    autocast = True  # fp32 master weights; matmuls in the policy's bf16 where the device has it

    @staticmethod
    def check_config(cfg, model: nn.Module | None = None, quantize: str = "none") -> None:
        if quantize == "nf4":
            raise TunekitError("method.name=full: cannot train a 4-bit base; set model.quantize=none")

    def apply(self, model: nn.Module, cfg) -> nn.Module:
        quantized = any(getattr(p, "quant_state", None) is not None for p in model.parameters())
        self.check_config(cfg, model, "nf4" if quantized else "none")
        model.float()
        model.requires_grad_(True)
        return model

    def owns(self, param_name: str) -> bool:
        return True  # every weight of the model

    def write(self, model: nn.Module, out_dir: Path) -> None:
        model.save_pretrained(out_dir, safe_serialization=True)

    def read(self, model: nn.Module, in_dir: Path) -> None:
        # Method.load has checked that every trainable tensor is there in its shape; a tied output
        # head is saved once, under the embedding's name.
        missing, unexpected = model.load_state_dict(read_tensors(Path(in_dir)), strict=False)
        missing = [k for k in missing if not k.endswith("lm_head.weight")]
        if missing or unexpected:
            raise TunekitError(f"{in_dir}: weights do not fit this model (missing {missing[:3]}, unexpected {unexpected[:3]})")

    def merge(self, model: nn.Module) -> nn.Module:
        """Already a plain model: return it frozen, in the fp32 it trained in."""
        if getattr(model, "is_gradient_checkpointing", False):
            model.gradient_checkpointing_disable()
        return model.to(torch.float32).requires_grad_(False)
