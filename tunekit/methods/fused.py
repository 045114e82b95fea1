"""Route LoRA-over-NF4 layers through tunekit's fused Triton kernel (kernels/, tunekit_kernels).

`enable_fused_lora` swaps every peft LoRA layer whose base is a bitsandbytes Linear4bit for a
`FusedLoRALinear4bit` that holds the *same* child modules under the same names (`base_layer`,
`lora_A`, `lora_B`, `lora_dropout`). State-dict keys, and so saved adapters, are unchanged and
stay PEFT-compatible; no transformers or peft class is modified.
"""

from __future__ import annotations

import logging

import torch
import torch.nn as nn

from tunekit import TunekitError

log = logging.getLogger(__name__)


class FusedLoRALinear4bit(nn.Module):
    """y = base(x) + scaling * B A dropout(x), base frozen NF4, via tunekit_kernels.fused_lora_linear.

    x: (batch, seq, in) -> (batch, seq, out). Computes in the base layer's compute dtype, as
    bitsandbytes does, and returns x's dtype.
    """

    def __init__(self, peft_layer: nn.Module, adapter: str = "default"):
        super().__init__()
        self.base_layer = peft_layer.base_layer
        self.lora_A = peft_layer.lora_A
        self.lora_B = peft_layer.lora_B
        self.lora_dropout = peft_layer.lora_dropout
        self.adapter = adapter
        self.scaling = float(peft_layer.scaling[adapter])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import tunekit_kernels as tk

        weight = self.base_layer.weight
        quant = tk.from_quant_state(weight.data, weight.quant_state)
        dtype = self.base_layer.compute_dtype or x.dtype
        dropout = self.lora_dropout[self.adapter]
        p = float(dropout.p) if self.training and isinstance(dropout, nn.Dropout) else 0.0
        bias = self.base_layer.bias
        y = tk.fused_lora_linear(
            x.to(dtype), quant,
            self.lora_A[self.adapter].weight.to(dtype), self.lora_B[self.adapter].weight.to(dtype),
            self.scaling, bias=None if bias is None else bias.to(dtype), dropout_p=p,
        )
        return y.to(x.dtype)


def enable_fused_lora(model: nn.Module, mode: str, device: torch.device) -> int:
    """mode: auto (on where the kernels run natively: CUDA) | on (required) | off.

    Returns the number of layers now using the fused kernel.
    """
    if mode == "off":
        return 0
    import tunekit_kernels as tk

    available = tk.is_available(device)
    if mode == "auto" and (device.type != "cuda" or not available):
        return 0
    if not available:
        raise TunekitError(
            f"kernels.fused_lora=on: the Triton kernels cannot run on {device} "
            "(they need CUDA and triton; on a CPU only TRITON_INTERPRET=1, for tests)"
        )
    from bitsandbytes.nn import Linear4bit
    from peft.tuners.lora import LoraLayer

    swaps = [(name, m) for name, m in model.named_modules()
             if isinstance(m, LoraLayer) and isinstance(m.base_layer, Linear4bit)]
    if mode == "on" and not swaps:
        raise TunekitError("kernels.fused_lora=on: no LoRA layer over a 4-bit base (use with model.quantize=nf4 and LoRA)")
    for name, layer in swaps:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, FusedLoRALinear4bit(layer))
    return len(swaps)
