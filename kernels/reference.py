"""Pure-torch twins of the Triton ops: the oracles the tests compare against.

They run anywhere (CPU, any GPU, no Triton) and are written for reading, not speed:
``lora_linear_reference`` materialises the full dequantized weight.
"""

from __future__ import annotations

import torch

from .quant import NF4Weight


def dequant_nf4_reference(quant: NF4Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dense (out, in) weight from an NF4 weight using plain indexing ops.

    Same operation order as bitsandbytes (fp32 scale = code2[q] * absmax2 + offset,
    value = code[nibble] * scale, one cast at the end), so it is bit-exact with
    ``bitsandbytes.functional.dequantize_4bit``.
    """
    quant.validate()
    n = quant.numel
    idx = torch.arange(n, device=quant.device)
    byte = quant.packed[idx // 2].long()
    nibble = torch.where(idx % 2 == 0, byte >> 4, byte & 0xF)
    block = idx // quant.blocksize
    if quant.nested:
        n_blocks = quant.absmax.numel()
        blocks = torch.arange(n_blocks, device=quant.device)
        scale = quant.code2[quant.absmax.long()] * quant.absmax2[blocks // quant.blocksize2]
        scale = scale + quant.offset
    else:
        scale = quant.absmax
    w = quant.code[nibble] * scale[block]
    return w.reshape(quant.shape).to(dtype)


def dropout_noise(x: torch.Tensor, p: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """Dropout keep-mask (bool, shape of x) drawn as ATen's CPU dropout draws it.

    ``torch.nn.functional.dropout`` on CPU calls ``bernoulli_(1 - p)`` on a tensor like
    ``x``; doing the same here means that, with the same seed, the fused op drops the
    same elements as peft's ``nn.Dropout`` (CUDA dropout uses another RNG stream).
    """
    return torch.empty_like(x).bernoulli_(1.0 - p, generator=generator).bool()


def apply_dropout(x: torch.Tensor, keep: torch.Tensor, p: float) -> torch.Tensor:
    """x * keep / (1 - p) with ATen's rounding order (noise scaled first, then multiplied)."""
    return x * keep.to(x.dtype).div_(1.0 - p)


def lora_linear_reference(
    x: torch.Tensor,
    quant: NF4Weight,
    A: torch.Tensor,
    B: torch.Tensor,
    scaling: float,
    bias: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """LoRA (Hu et al. 2021) over a frozen NF4 base, with peft's semantics.

    ``y = x @ W^T + bias + scaling * (dropout(x) @ A^T) @ B^T`` with x (tokens, in) or
    (batch, seq, in), A (r, in), B (out, r), W = dequant(quant) of shape (out, in).
    Differentiable in x, A and B by ordinary autograd.  ``keep`` (bool, shape of x)
    fixes the dropout mask; otherwise one is drawn with :func:`dropout_noise`.
    """
    w = dequant_nf4_reference(quant, x.dtype)
    y = torch.nn.functional.linear(x, w, None if bias is None else bias.to(x.dtype))
    x_lora = x
    if dropout_p > 0.0:
        keep = dropout_noise(x, dropout_p) if keep is None else keep
        x_lora = apply_dropout(x, keep, dropout_p)
    return y + (x_lora @ A.t() @ B.t()) * scaling
