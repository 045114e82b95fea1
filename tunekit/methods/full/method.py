"""Full fine-tuning: every weight of the model trains. Meant for small students (recipe=distill
with method.name=full), not for the 4-bit bases the PEFT methods serve.

The weights train in fp32 even when the base loads in bf16: AdamW updates of ~lr * 1 on weights
of ~1e-2 fall below bf16's resolution (8 significant bits) and would be lost. Where the precision
policy computes in bf16, the forward runs under bf16 autocast: matmuls on bf16 copies of the fp32
weights, norms and residual stream in fp32 (the embeddings' own dtype). Those copies are rounded
stochastically (tunekit.device.rounding: rounded to nearest, the steps below bf16's resolution never
reach the loss and the fp32 weights drift). Held-out evaluation computes in fp32, as `tunekit eval` and the
export read the saved weights. `save` writes a plain Hugging Face model folder, so "merging" is the
identity.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from tunekit import TunekitError
from tunekit.checks import one_of
from tunekit.methods.full.config import WEIGHT_ROUNDINGS, FullConfig
from tunekit.methods.registry import Method, register
from tunekit.plan.shape import PROJECTIONS
from tunekit.plan.terms import PlanTerms, Site

if TYPE_CHECKING:
    import torch.nn as nn


@register("full")
class FullFineTune(Method):
    config = FullConfig
    can_merge = True
    autocast = True  # fp32 master weights; matmuls in the policy's bf16 where the device has it
    trains_base = True

    def check_config(self, cfg, model: nn.Module | None = None, quantize: str = "none") -> None:
        one_of("method.weight_rounding", self.settings(cfg).weight_rounding, WEIGHT_ROUNDINGS)
        if quantize == "nf4":
            raise TunekitError("method.name=full: cannot train a 4-bit base; set model.quantize=none")

    def apply(self, model: nn.Module, cfg) -> nn.Module:
        quantized = any(getattr(p, "quant_state", None) is not None for p in model.parameters())
        self.check_config(cfg, model, "nf4" if quantized else "none")
        model.float()
        model.requires_grad_(True)
        if self.settings(cfg).weight_rounding == "stochastic":
            from tunekit.methods.full.rounding import round_stochastically

            round_stochastically(model)
        return model

    def owns(self, param_name: str) -> bool:
        return True  # every weight of the model

    def write(self, model: nn.Module, out_dir: Path) -> None:
        model.save_pretrained(out_dir, safe_serialization=True)

    def read(self, model: nn.Module, in_dir: Path) -> None:
        from tunekit.methods.saving import read_tensors

        # Method.load has checked that every trainable tensor is there in its shape; a tied output
        # head is saved once, under the embedding's name.
        missing, unexpected = model.load_state_dict(read_tensors(Path(in_dir)), strict=False)
        missing = [k for k in missing if not k.endswith("lm_head.weight")]
        if missing or unexpected:
            raise TunekitError(f"{in_dir}: weights do not fit this model (missing {missing[:3]}, unexpected {unexpected[:3]})")

    def merge(self, model: nn.Module) -> nn.Module:
        """Already a plain model: return it frozen, in the fp32 it trained in."""
        import torch

        from tunekit.methods.full.rounding import drop_copies

        if getattr(model, "is_gradient_checkpointing", False):
            model.gradient_checkpointing_disable()
        drop_copies(model)  # training's bf16 weight copies: 2 bytes a weight nothing reads any more
        return model.to(torch.float32).requires_grad_(False)

    # ------------------------------------------------------------ the training plan
    def plan_label(self, options) -> str:
        return "full fine-tune"

    def plan_terms(self, shape, setup) -> PlanTerms:
        """Every weight (fp32) trains; what autograd keeps for the weights' gradients on top of the
        frozen walk: each trained norm its (fp32) output, each projection its input, the embedding
        the token ids; under half-precision autocast, the matmuls' weight copies.

        A projection keeps the input its matmul read. In fp32 the projections of a group (q, k, v;
        gate, up) read one fp32 tensor, kept once; under autocast each casts the fp32 residual to
        the compute dtype itself, so each keeps its own cast (down_proj's input, the MLP's product,
        is already in the compute dtype)."""
        d, m, L = shape.hidden_size, shape.intermediate_size, shape.num_layers
        per_layer = [i * o for p in PROJECTIONS for i, o in [shape.projection(p)]] + [d, d]  # + the two norms
        head = [shape.head_params] if shape.head_params else []
        c = setup.compute_bytes
        qkv, gate_up = (4 * d, 4 * d) if c == 4 else (3 * c * d, 2 * c * d)
        keeps = {"input_norm": 4 * d, "post_norm": 4 * d, "final_norm": 4 * d, "qkv": qkv, "gate_up": gate_up,
                 "down": c * m, "embedding": 8}

        def saves(site: Site) -> int:
            if site.name in ("input_norm", "post_norm") and not site.input_grad:
                return 0  # as the walk counts the norm's own saves: only where its input needs a gradient
            return site.tokens * keeps.get(site.name, 0)

        # Under bf16 or fp16 autocast every matmul reads a half-precision copy of its weight, kept
        # for backward until the step's last gradient; the bf16 copies (rounding.py) stay until the
        # weights change. The head's copy is the tied embedding's or the head's own: V x d either way.
        matmul = L * sum(i * o for p in PROJECTIONS for i, o in [shape.projection(p)]) + shape.vocab_size * d
        copies = setup.compute_bytes * matmul if setup.compute_bytes < 4 else 0
        return PlanTerms(trainable=tuple(per_layer * L + [shape.embedding_params, d] + head), saves=saves,
                         grad_outputs=frozenset(PROJECTIONS), decoder_input_grad=True, weight_copy_bytes=copies)
