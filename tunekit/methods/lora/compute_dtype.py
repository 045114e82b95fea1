"""LoRA over a 4-bit base with the LoRA matmuls in the base's compute dtype (plain torch + bitsandbytes).

    y = base(x) + scaling * (dropout(x) A^T) B^T       x (tokens, in), A (r, in), B (out, r)

peft computes the LoRA branch in the adapter's fp32 (it casts x up to fp32, then the product back
down to the base's dtype). On a CPU with native bf16, fp32 matrix work runs several times slower
than bf16, and the rank-r products are the skinny, memory-bound kind that suffer most, so on a
small model the fp32 LoRA branches are a large share of a training step
(benchmarks/history/training-speed.md).

Here x, A and B are rounded to the compute dtype once and every product accumulates in fp32 inside
the bf16 GEMM, which is what autocast and the Triton kernel in kernels/ do; A and B stay fp32
master weights and their gradients come back in fp32. The base matmul is bitsandbytes' own
(forward through the layer, backward as its MatMul4Bit does: dy @ dequant(W)), so the frozen
path computes exactly what peft + bitsandbytes computes. The base output and the LoRA term are
added in x's dtype, as peft adds them. At initialisation (B = 0) the output is bit-identical to
peft's; afterwards the LoRA term itself differs by bf16 rounding (a few 2^-9, relative to the term).

With an fp32 base (a CPU without native bf16, where model.dtype=auto computes in fp32) the same
code is peft's fp32 math; what it buys there is the dense cache below: the base is not dequantized
twice per layer per micro-batch, at the price of one dense copy of it in memory, with the same
losses.
"""

from __future__ import annotations

import bitsandbytes as bnb
import torch
import torch.nn as nn


CACHE_ATTR = "_tunekit_dense"  # a plain attribute, not a buffer: never saved, never in a state dict


def _dequantized(base_layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """The frozen weight (out, in) in `dtype`: the layer's dense cache when it has one."""
    cached = getattr(base_layer, CACHE_ATTR, None)
    if cached is not None and cached.dtype == dtype:
        return cached
    import bitsandbytes.functional as bnbf

    w = base_layer.weight
    return bnbf.dequantize_4bit(w.data, w.quant_state).to(dtype)


def cache_dense(base_layer: nn.Module, dtype: torch.dtype) -> int:
    """Keep the layer's dequantized weight: the base is frozen, so dequantizing it twice per
    micro-batch (forward and backward), every step, redoes the same work. Costs 2 bytes per weight
    in bf16 (4 in fp32) on top of the 4-bit codes. Returns the bytes kept."""
    dense = _dequantized(base_layer, dtype)
    setattr(base_layer, CACHE_ATTR, dense)
    return dense.numel() * dense.element_size()


def drop_dense(base_layer: nn.Module) -> None:
    if hasattr(base_layer, CACHE_ATTR):
        delattr(base_layer, CACHE_ATTR)


class LoRA4bitCompute(torch.autograd.Function):
    """x (tokens, in) -> (tokens, out) in x's dtype; A, B fp32 parameters, gradients fp32."""

    @staticmethod
    def forward(ctx, x, A, B, base_layer, scaling: float, dropout_p: float):
        dtype = base_layer.compute_dtype or x.dtype
        xc = x.to(dtype)
        w = base_layer.weight
        bias = None if base_layer.bias is None else base_layer.bias.to(dtype)
        with torch.no_grad():
            if getattr(base_layer, CACHE_ATTR, None) is not None:
                # bit-identical to bitsandbytes' CPU gemm_4bit, which dequantizes and calls linear
                y = torch.nn.functional.linear(xc, _dequantized(base_layer, dtype), bias)
            else:  # bitsandbytes' 4-bit matmul (+ bias), as Linear4bit.forward calls it
                y = bnb.matmul_4bit(xc, w.t(), bias=bias, quant_state=w.quant_state)
        keep = None
        xl = xc
        if dropout_p > 0:
            keep = torch.empty_like(xc).bernoulli_(1.0 - dropout_p)
            xl = xc * keep / (1.0 - dropout_p)
        xa = xl @ A.to(dtype).t()  # (tokens, r)
        # The sum is taken in x's dtype, as peft adds its LoRA output to the base's: the residual
        # stream's dtype (bf16 under the bf16 precision policy, where a term below 2^-8 of the output
        # shows in the forward only once it has grown, its gradient flowing all along; fp32 where x
        # is fp32, which keeps even a 1e-4 term). The scaling is folded
        # into B, an (out, r) copy, not passed as add_(..., alpha=): torch 2.13's inductor drops
        # that alpha from the sum of a matmul product (torch.compile over these layers halved every
        # LoRA term at alpha/r = 2). For a power-of-two scaling, as every recipe's 32/16, both forms
        # give the same bits.
        y = y.to(x.dtype).add_(xa @ (B * scaling).to(dtype).t())
        ctx.save_for_backward(xl, xa, A, B, keep)
        ctx.base_layer, ctx.scaling, ctx.dropout_p, ctx.in_dtype = base_layer, scaling, dropout_p, x.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        xl, xa, A, B, keep = ctx.saved_tensors
        dtype, s = xl.dtype, ctx.scaling
        dyc = dy.to(dtype)
        dxa = (dyc @ B.to(dtype)) * s  # (tokens, r)
        dB = (dyc.t() @ xa).float() * s if ctx.needs_input_grad[2] else None
        dA = (dxa.t() @ xl).float() if ctx.needs_input_grad[1] else None
        dx = None
        if ctx.needs_input_grad[0]:
            dx = dyc @ _dequantized(ctx.base_layer, dtype)  # bitsandbytes' MatMul4Bit backward
            if keep is None:  # the LoRA term added in place: one (tokens, in) buffer, not three
                dx = dx.addmm_(dxa, A.to(dtype)).to(ctx.in_dtype)
            else:
                dx = (dx + (dxa @ A.to(dtype)) * keep / (1.0 - ctx.dropout_p)).to(ctx.in_dtype)
        return dx, dA, dB, None, None, None


def lora4bit_compute(x: torch.Tensor, base_layer: nn.Module, A: torch.Tensor, B: torch.Tensor, scaling: float,
                     dropout_p: float = 0.0) -> torch.Tensor:
    """x (..., in) -> (..., out) in x's dtype."""
    lead = x.shape[:-1]
    y = LoRA4bitCompute.apply(x.reshape(-1, x.shape[-1]), A, B, base_layer, float(scaling), float(dropout_p))
    return y.reshape(*lead, y.shape[-1])
