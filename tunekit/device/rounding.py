"""Half-precision copies of trained fp32 weights for the matmuls under autocast: stochastic rounding.

Used by a full fine-tune (tunekit.methods.full.rounding marks its weights), whose weights train in
fp32 and compute in bf16. Why not autocast's rounding to nearest:

Under bf16 autocast every matmul reads a bf16 copy of its fp32 weight. Autocast rounds that copy to
nearest, so the forward (and the gradient) sees round(W), a function of W that is flat between two
bf16 neighbours. A fine-tune's steps are far smaller than that gap: AdamW moves a weight by about
lr per step (2e-5 in the recipe), while the gap next to a weight of magnitude |w| is 2^(e - 7) for
|w| in [2^e, 2^(e+1)): 2.4e-4 for |w| ~ 0.05, so 80 steps move a weight by a few gaps at most. The
fp32 master then drifts inside its gap with no feedback from the loss (up to the midpoint where its
copy flips), and the fp32 weights a run saves are a worse model than the rounded one its loss saw:
benchmarks/README.md ("Under the precision policy and in fp32") has what that cost a short full
fine-tune, and what this rounding gave back.

Stochastic rounding makes the copy an unbiased estimate of the master: it rounds up with
probability equal to the distance to the lower neighbour, over the gap, so E[copy] = W and the
loss's gradient, averaged over steps, sees where W lies inside its gap. The matmuls stay bf16.

For fp32 to bf16 this is exact integer arithmetic on the bit pattern: bf16 is the top 16 bits of
an fp32, so adding a uniform integer in [0, 2^16) to the pattern and clearing the low 16 bits
rounds up exactly when the discarded bits plus the noise carry, with probability (low bits) / 2^16.
A carry into the exponent gives the next power of two, which is the right upper neighbour.
A weight that is not finite stays not finite (infinity's pattern plus noise is a NaN; torch's NaN
stays a NaN), and the trainer stops on it at the loss; a finite weight rounds to infinity only
within one gap of bf16's largest value, 3.4e38.

fp16 autocast (T4/V100) keeps its round-to-nearest: fp16 has 10 significant bits, a gap 8 times
finer than bf16's, and its copy is not made here.
"""

from __future__ import annotations

import torch

MARK = "_tunekit_stochastic_copy"  # set on a weight whose autocast copy rounds stochastically
COPY = "_tunekit_bf16_copy"  # (weight version, its bf16 copy), kept on the weight


def stochastic_bf16(w: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """fp32 `w` rounded to bf16 stochastically (see the module docstring); same shape, dtype bf16."""
    if w.dtype != torch.float32:
        raise ValueError(f"stochastic_bf16 takes fp32 weights, not {w.dtype}")
    bits = w.contiguous().view(torch.int32)
    out = torch.randint(0, 1 << 16, bits.shape, dtype=torch.int32, device=w.device, generator=generator)
    out.add_(bits).bitwise_and_(-(1 << 16))  # in place: one int32 buffer for the whole rounding
    return out.view(torch.float32).to(torch.bfloat16)  # exact: the low 16 bits are zero


class _StochasticCast(torch.autograd.Function):
    """The bf16 copy forward, the gradient back to the fp32 master unchanged (as autocast's cast).
    One copy per value of the weight: a step's micro-batches (gradient accumulation) and a
    checkpointed block's recomputation read the same copy, made again once the optimizer has
    changed the weight in place (its version counter moves)."""

    @staticmethod
    def forward(ctx, w):
        cached = getattr(w, COPY, None)
        if cached is None or cached[0] != w._version:
            cached = (w._version, stochastic_bf16(w.detach()))
            setattr(w, COPY, cached)
        return cached[1].detach()  # a fresh tensor over the copy: each use gets its own graph node

    @staticmethod
    def backward(ctx, grad):
        return grad.float()


def autocast_copy(w: torch.Tensor, device_type: str) -> torch.Tensor:
    """The copy of `w` a matmul under autocast computes with: the stochastic bf16 one for a marked
    fp32 weight while gradients are being recorded (training), autocast's own cast otherwise."""
    dtype = torch.get_autocast_dtype(device_type)
    if w.dtype != torch.float32 or dtype == torch.float32:
        return w
    if dtype == torch.bfloat16 and getattr(w, MARK, False) and torch.is_grad_enabled():
        return _StochasticCast.apply(w)
    return w.to(dtype)


def autocast_head(weight: torch.Tensor, bias: torch.Tensor | None,
                  device_type: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, bias) as an output head's matmul reads them, for a loss that runs the head itself with
    autocast off: under autocast an fp32 (trained) head's weight copy (`autocast_copy`) and its bias
    cast to the autocast dtype; unchanged outside autocast or for a head already in half precision."""
    if torch.is_autocast_enabled(device_type) and weight.dtype == torch.float32:
        dtype = torch.get_autocast_dtype(device_type)
        return autocast_copy(weight, device_type), None if bias is None else bias.to(dtype)
    return weight, bias
