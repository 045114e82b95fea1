"""The output head's fp32 matmuls on a CPU's bf16 units (oneDNN's bf16 math mode), checked first.

Under k-bit training the output head (tied to the embedding for SmolLM2) is fp32, as
prepare_model_for_kbit_training leaves it for peft and TRL, and fp32 GEMMs on an AVX512-BF16 CPU
run at about a quarter of bf16's speed. The head's two products per micro-batch, logits = rows W^T
and the gradient back into the rows, dlogits W (49152 x 576 for the default model), were the
largest matmul item of a qlora step: benchmarks/roofline-cpu.md, 0.63 s of its 2.3 s matmul floor,
at 120-150 GFLOP/s.

torch lets oneDNN compute an fp32 matmul with bf16 hardware (`torch.backends.mkldnn.matmul.
fp32_precision = "bf16"`): inputs and output stay fp32; how the library splits the fp32 values
is its business. On the development VM (AMD EPYC, oneDNN in torch 2.13) it measured ~1e-6
relative error at 2.3x fp32's speed, so it carries several bf16 terms per value; a plain rounding
of the inputs to bf16 would be ~4e-3. That is an observation of one build on one CPU, so it is not
trusted: `check()` runs the head's real weight both ways, forward and backward, against an fp64
reference, and only an error within TOLERANCE (below) turns the mode on, and then only around
the head's own two matmuls (every other fp32 matmul keeps strict fp32). The distrust was earned: on
a 2-core Intel VM with AMX (2026-11-25, the same torch) the mode rounded each operand once to bf16
(2^-8.7 per product on the default model's head) and the check kept the head in strict fp32.

Error measure. For y = sum_i x_i w_i over K terms, write the arithmetic's error per product as a
relative eps: err ~ eps * sqrt(sum_i (x_i w_i)^2) for independent rounding. check() estimates eps
as rms(err) / rms(sqrt(sum_i (x_i w_i)^2)). Expected: a plain rounding of both operands to bf16
(8 significant bits, each off by up to 2^-9 relative, uniformly) gives 2^-9 * sqrt(2/3) ~ 2^-9.6;
schemes that carry each fp32 value as two or three bf16 pieces drop terms of 2^-16 to 2^-18
relative; fp32 itself rounds at 2^-24 per operation. Measured on the default model's head (dev
VM, 32 random rows): strict fp32 2^-21.8 forward / 2^-21.4 backward (K = 49152), the bf16 math
mode 2^-21.3 / 2^-20.7, a plain bf16 rounding 2^-9.3 / 2^-9.3. TOLERANCE = 2^-14 accepts every
scheme of 14 or more bits and rejects plain bf16 by 26x. At the bound a logit's error is typically
2^-14 times sqrt(sum_i (x_i w_i)^2) <= ||x|| ||w_row||, the largest value that logit could take.
The measured effect on the default run's losses is in benchmarks/cpu-speed.md.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn

from tunekit import device as dev

log = logging.getLogger(__name__)

TOLERANCE = 2.0 ** -14  # per-product relative error accepted (see the module docstring)
# eps of a single rounding of both operands to bf16 (2^-9.6 expected, see above): what oneDNN's mode
# does on the Intel VM with AMX (2^-8.7 on the default model's head, 2026-11-25). There the check's
# refusal is this CPU's known behaviour, said once in the run's log; anything else that fails is a warning.
PLAIN_ROUNDING = (2.0 ** -11, 2.0 ** -8)
CHECK_ROWS = 8  # rows of the check (eps is an rms over 8 x vocab and 8 x hidden errors): ~0.3 s in fp64
ATTR = "_tunekit_head_math"  # a plain attribute on the head module: never saved, never in a state dict


@dataclass
class HeadDecision:
    mode: str  # the kernels.head_matmul setting: auto | fp32
    math: str  # what the head's matmuls use: "bf16" (oneDNN bf16 math mode) or "fp32"
    reason: str
    eps: dict = field(default_factory=dict)  # measured per-product error, forward and backward

    def as_dict(self) -> dict:
        return asdict(self)


def wanted(mode: str, facts: dev.DeviceFacts, head_dtype: torch.dtype, torch_has_mode: bool) -> tuple[bool, str]:
    """Whether to try the bf16 math mode, from plain facts: a CPU with native bf16, an fp32 head,
    a torch that has the switch, and kernels.head_matmul=auto."""
    if mode != "auto":
        return False, "kernels.head_matmul=fp32"
    if facts.type != "cpu":
        return False, f"{facts.describe()}: the switch is oneDNN's, for CPU matmuls"
    if not facts.cpu_bf16:
        return False, f"{facts.describe()} has no native bf16"
    if head_dtype != torch.float32:
        return False, f"the head is {head_dtype}, not fp32"
    if not torch_has_mode:
        return False, "this torch has no torch.backends.mkldnn.matmul.fp32_precision"
    return True, "CPU with native bf16, fp32 head"


def torch_has_mode() -> bool:
    return hasattr(getattr(torch.backends.mkldnn, "matmul", None), "fp32_precision")


@contextmanager
def bf16_math():
    """fp32 matmuls inside may use bf16 hardware (oneDNN); the previous setting comes back after."""
    knob = torch.backends.mkldnn.matmul
    before = knob.fp32_precision
    knob.fp32_precision = "bf16"
    try:
        yield
    finally:
        knob.fp32_precision = before


def per_product_error(a: torch.Tensor, b: torch.Tensor, got: torch.Tensor) -> float:
    """eps of `got` ~ a @ b (fp32) against fp64: rms(err) / rms(sqrt(sum_i (a_i b_i)^2))."""
    a64, b64 = a.double(), b.double()
    err = got.double() - a64 @ b64
    scale = ((a64 * a64) @ (b64 * b64)).sqrt()
    return float(err.pow(2).mean().sqrt() / scale.pow(2).mean().sqrt().clamp_min(1e-300))


def check(weight: torch.Tensor, rows: int = CHECK_ROWS, seed: int = 0) -> dict:
    """Per-product error of the head's forward (x W^T) and input gradient (g W) in the bf16 math
    mode, on the real weight with random rows of unit scale (eps is scale-free)."""
    gen = torch.Generator().manual_seed(seed)
    w = weight.detach()
    x = torch.randn(rows, w.shape[1], generator=gen)
    g = torch.randn(rows, w.shape[0], generator=gen) / w.shape[0] ** 0.5
    with bf16_math():
        y = torch.nn.functional.linear(x, w)
        dx = g @ w
    return {"forward": per_product_error(x, w.t(), y), "backward": per_product_error(g, w, dx)}


def choose(head: nn.Module, mode: str, facts: dev.DeviceFacts) -> HeadDecision:
    """Decide the head's matmul math once, before the first step, and mark the head with it."""
    weight = head.weight
    ok, reason = wanted(mode, facts, weight.dtype, torch_has_mode())
    if not ok:
        return HeadDecision(mode, "fp32", reason)
    eps = check(weight)
    worst = max(eps.values())
    if not worst <= TOLERANCE:  # also catches a NaN
        if all(PLAIN_ROUNDING[0] < e < PLAIN_ROUNDING[1] for e in eps.values()):
            why = "oneDNN's bf16 math mode rounds fp32 operands to bf16 on this CPU"
        else:
            why = "bf16 math mode failed its check"
            log.warning("output head: oneDNN's bf16 math mode measured %.2e error per product (bound %.1e); "
                        "keeping strict fp32", worst, TOLERANCE)
        return HeadDecision(mode, "fp32", f"{why} ({worst:.2e} > {TOLERANCE:.1e})", eps)
    setattr(head, ATTR, "bf16")
    return HeadDecision(mode, "bf16", f"{reason}; checked: {worst:.1e} error per product <= {TOLERANCE:.1e}", eps)


class _HeadLinear(torch.autograd.Function):
    """y = x W^T (+ b) with both of the head's matmuls (and W's gradient, when it trains) in the
    bf16 math mode; everything else in the step keeps strict fp32."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        with bf16_math():
            y = torch.nn.functional.linear(x, weight, bias)
        ctx.save_for_backward(x if weight.requires_grad else None, weight)  # x only for W's gradient
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx = dw = db = None
        with bf16_math():
            if ctx.needs_input_grad[0]:
                dx = dy @ weight
            if ctx.needs_input_grad[1]:
                dw = dy.t() @ x
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy.sum(0)
        return dx, dw, db


def head_logits(rows: torch.Tensor, head: nn.Module) -> torch.Tensor:
    """head(rows) for rows (n, hidden): through the checked bf16 math mode when choose() marked the
    head, else the module's own forward."""
    x = rows.to(head.weight.dtype)
    if getattr(head, ATTR, None) == "bf16" and x.dim() == 2:
        return _HeadLinear.apply(x, head.weight, head.bias)
    return head(x)


def clear(head: nn.Module) -> None:
    if hasattr(head, ATTR):
        delattr(head, ATTR)
