"""The mixed-precision policy: which dtype each part of a training step stores and computes in.

One decision per run, a plain function of `model.dtype` and the device facts (tunekit.device.facts), made
before the base loads, logged once and written to summary.json. The trainer, `tunekit plan`,
evaluation, generation and export all take their dtypes from it, so they agree.

Where the device computes bf16 natively (CUDA sm_80+, CPUs with AVX512-BF16 or AMX), `auto` gives:

* frozen weights stored in bf16: a bf16 base's linears, and over a 4-bit base everything that is
  not quantized (embeddings, output head, norms); the 4-bit linears dequantize to bf16;
* activations in bf16: the residual stream, every projection's output, attention's q/k/v (so a GPU
  can pick SDPA's flash or memory-efficient kernel, which need half-precision inputs);
* fp32 where rounding would cost accuracy: norm statistics (transformers' RMSNorm computes its
  variance in fp32), attention's softmax (the SDPA kernels accumulate in fp32), the cross-entropy
  (logits upcast chunk by chunk, tunekit.losses.sft), and the trained parameters, their gradients
  and optimizer state (AdamW updates of lr * O(1) on weights of ~1e-2 fall below bf16's 8 bits);
* TF32 for the fp32 matmuls that remain (peft's fp32 LoRA branches) on CUDA sm_80+.

Why a bf16 residual stream rather than fp32 residuals under autocast (what peft's
prepare_model_for_kbit_training + TRL's `bf16=True` compute). Error: each of a model's 2L residual
additions rounds to bf16, a relative error of at most 2^-9 per element (uniform, rms 2^-9/sqrt(3)),
independent from layer to layer, so the hidden state reaching the head carries a relative error of
about sqrt(2L) * 2^-9 / sqrt(3): 2.6e-3 for 2 layers, 7e-3 for 30 (SmolLM2-135M), 8e-3 for 32
(Llama-3-8B). Every projection already rounds its input to bf16 under autocast (2^-9 each), so the
residual rounding is of the same order as what the standard stack accepts, and the weights the base
was pretrained and published in are bf16 to begin with. Memory: the residual stream and every saved
activation take half the bytes (on Llama-3-8B at 2 x 2048 tokens with gradient checkpointing the
saved block inputs go from 2.0 to 1.0 GiB), and the frozen embeddings and head of a 4-bit base from
4 to 2 bytes per parameter (1.05B parameters on Llama-3-8B: 3.9 -> 2.0 GiB). A LoRA update below
bf16's resolution of the base output is still trained: the gradient passes through the rounded sum
unchanged, and the term shows in the forward once it has grown (as in any bf16 model, e.g. tunekit's
`lora` recipe over a bf16 base, which always ran this way).

Methods whose trained weights make up the model itself (`full`) keep an fp32 master copy of every
weight and compute under bf16 autocast (`autocast` below): matmuls in bf16, everything else in the
weights' fp32.

A GPU with fp16 tensor cores but no bf16 ones (V100 sm_70, T4 and RTX 20xx sm_75) computes the
same parts in fp16 instead, with dynamic loss scaling (tunekit.train.loss_scale): fp16 keeps 3 more
significand bits than bf16 but 3 fewer exponent bits, so gradients flowing back through the base are
scaled up by a power of two to stay clear of fp16's underflow (2^-24), and a step whose gradients
overflow (65504) is skipped and counted. fp32 there would run 4-8x slower, on CUDA cores.

Elsewhere: a CPU without native bf16 emulates it at several times fp32's cost, so `auto` is fp32
there (TF32 needs sm_80 as well). `model.dtype=fp32` keeps strict fp32 everywhere, TF32 off;
`model.dtype=bf16` or `fp16` is obeyed even where it is emulated (slow, but the same numbers).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch

from tunekit import TunekitError
from tunekit.device import facts as dev

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Precision:
    """What one run stores and computes in. Trained parameters, their gradients and optimizer state
    are fp32 and the loss is computed in fp32 in every policy."""

    compute: torch.dtype  # frozen weights, activations, attention, the base's matmuls
    tf32: bool  # fp32 matmuls may use TF32 tensor cores (CUDA sm_80+, and not model.dtype=fp32)
    reason: str

    @property
    def half(self) -> bool:
        return self.compute != torch.float32

    @property
    def loss_scaling(self) -> bool:
        """fp16 trains with dynamic loss scaling (tunekit.train.loss_scale); bf16 has fp32's range."""
        return self.compute == torch.float16

    def autocast(self, device: torch.device, wanted: bool = True):
        """bf16 autocast for a method whose fp32 trained weights are the model's own (`full`);
        a no-op for the others (their frozen weights are already in the compute dtype) and in fp32."""
        if not (wanted and self.half):
            return contextlib.nullcontext()
        return torch.autocast(torch.device(device).type, dtype=self.compute)

    def describe(self) -> str:
        name = dev.dtype_name(self.compute)
        if not self.half:
            return f"precision: fp32 everywhere{' (TF32 matmuls)' if self.tf32 else ''} ({self.reason})"
        return (f"precision: {name} weights, activations and attention; fp32 norm statistics, softmax, loss and "
                f"trained parameters{'; TF32 for fp32 matmuls' if self.tf32 else ''}"
                f"{'; dynamic loss scaling' if self.loss_scaling else ''} ({self.reason})")

    def as_dict(self) -> dict:
        return {"compute": dev.dtype_name(self.compute), "frozen": dev.dtype_name(self.compute),
                "trained": "fp32", "loss": "fp32", "tf32": self.tf32, "loss_scaling": self.loss_scaling,
                "reason": self.reason}


def decide(name: str, facts: dev.DeviceFacts) -> Precision:
    """model.dtype (auto | bf16 | fp16 | fp32) on a device -> the policy (see the module docstring)."""
    if name not in ("auto", "bf16", "fp16", "fp32"):
        raise ValueError(f"unknown dtype name {name!r}")
    compute = dev.compute_dtype(name, facts)  # the one rule for the dtype; the reasons below
    native = dev.native_bf16(facts)
    tf32 = facts.type == "cuda" and native and name != "fp32"
    if name == "fp32":
        return Precision(compute, False, "model.dtype=fp32")
    if name == "bf16":
        return Precision(compute, tf32, "model.dtype=bf16" + ("" if native else f"; {facts.describe()} emulates bf16 (slow)"))
    if name == "fp16":
        fast = dev.fp16_tensor_cores(facts) or (facts.type == "cuda" and native)
        return Precision(compute, tf32, "model.dtype=fp16" + ("" if fast else f"; {facts.describe()} may emulate fp16 (slow)"))
    if native:
        return Precision(compute, tf32, f"{facts.describe()} computes bf16 natively")
    if compute == torch.float16:
        return Precision(compute, False, f"{facts.describe()} has fp16 but no bf16 tensor cores (sm_80+)")
    if facts.type == "cuda":
        return Precision(compute, False, f"{facts.describe()} is older than sm_70: no fp16 or bf16 tensor cores")
    return Precision(compute, False, f"{facts.describe()} has no native bf16")


def agree(mine: Precision, facts: dev.DeviceFacts, broadcast_object) -> Precision:
    """Every rank computes in the dtype rank 0 decided. `broadcast_object(obj)` returns rank 0's
    `obj` on every rank (a plain function in tests). Ranks on different GPU models could otherwise
    decide bf16 on one and fp16 or fp32 on another, and train different numbers under one run.
    TF32 stays each rank's own (a matmul switch of its device, the same numbers up to TF32 rounding
    where both have it). A rank that can only emulate rank 0's dtype says so in one warning line;
    one that cannot compute it at all (bf16 on a GPU older than sm_70) is refused in one line."""
    theirs = broadcast_object({"compute": dev.dtype_name(mine.compute), "reason": mine.reason})
    compute = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[theirs["compute"]]
    if compute == mine.compute:
        return mine
    if facts.type == "cuda" and compute != torch.float32 and facts.capability is not None \
            and tuple(facts.capability) < dev.FP16_MIN_CAPABILITY:
        raise TunekitError(f"precision: rank 0 computes in {theirs['compute']}, which {facts.describe()} cannot run; "
                           "ranks must share a precision: set model.dtype=fp32")
    if compute == torch.bfloat16 and not dev.native_bf16(facts):
        log.warning("precision: rank 0 computes in bf16 (%s); %s emulates it (slow)", theirs["reason"], facts.describe())
    native = facts.type == "cuda" and dev.native_bf16(facts)
    return Precision(compute, native and compute != torch.float32, f"rank 0's precision: {theirs['reason']}")


def matmul_settings(p: Precision, facts: dev.DeviceFacts) -> dict:
    """The process-wide torch switch the policy sets: {"float32_matmul_precision": "high"} (TF32 for
    fp32 matmuls) or "highest" on CUDA; {} on a CPU, where "high" would let oneDNN round fp32
    operands to bf16 (a plain function: tested with fake facts)."""
    if facts.type != "cuda":
        return {}
    return {"float32_matmul_precision": "high" if p.tf32 else "highest"}


def apply(p: Precision, facts: dev.DeviceFacts) -> None:
    """Set the process-wide switch of `matmul_settings` (nothing on a CPU)."""
    settings = matmul_settings(p, facts)
    if "float32_matmul_precision" in settings:
        torch.set_float32_matmul_precision(settings["float32_matmul_precision"])


def set_cudnn_attention(enabled: bool) -> bool:
    """kernels.cudnn_attention: whether scaled_dot_product_attention may choose cuDNN's kernel
    (torch's default: yes). Process-wide, as torch's own switch is, so that a checkpointed block's
    recomputation in backward chooses as its forward did. Returns the previous setting (to restore)."""
    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(bool(enabled))
    return before


# ------------------------------------------------------------------ what a step actually ran
def attention_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask=None, dropout_p: float = 0.0,
                     is_causal: bool = False, scale=None, enable_gqa: bool = False) -> str:
    """The kernel torch's scaled_dot_product_attention dispatches these inputs to (FLASH_ATTENTION,
    EFFICIENT_ATTENTION, CUDNN_ATTENTION, MATH...), asked of torch's own chooser; "unknown" where
    this torch cannot say. On a GPU, fp32 inputs rule the flash kernel out."""
    from torch.nn.attention import SDPBackend

    try:
        choice = torch._fused_sdp_choice(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
        return SDPBackend(choice).name
    except Exception:  # noqa: BLE001 - a private chooser whose signature moves between torch versions
        return "unknown"


def received(t: torch.Tensor) -> torch.dtype:
    """The dtype an autocast-listed op (matmuls, linear, scaled_dot_product_attention) computes `t` in:
    autocast's dtype where it is on for t's device and t is a float wider than it, else t's own."""
    kind = t.device.type
    if torch.is_autocast_enabled(kind) and t.is_floating_point():
        return torch.get_autocast_dtype(kind)
    return t.dtype


@contextlib.contextmanager
def observe_attention(record: dict):
    """Record what the first scaled_dot_product_attention call inside receives: the dtypes of q, k
    and v, whether a mask came with them, and the kernel torch picks for them. The attention modules
    call torch.nn.functional.scaled_dot_product_attention by name, so the function is wrapped for the
    duration (one training step) and put back after."""
    import torch.nn.functional as F

    real = F.scaled_dot_product_attention

    def wrapped(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *args, **kwargs):
        if not record:
            record.update({"q": dev.dtype_name(received(q)), "k": dev.dtype_name(received(k)),
                           "v": dev.dtype_name(received(v)),
                           "mask": attn_mask is not None, "device": q.device.type,
                           "kernel": attention_kernel(q, k, v, attn_mask, dropout_p, is_causal,
                                                      kwargs.get("scale"), kwargs.get("enable_gqa", False))})
        return real(q, k, v, attn_mask, dropout_p, is_causal, *args, **kwargs)

    F.scaled_dot_product_attention = wrapped
    try:
        yield record
    finally:
        F.scaled_dot_product_attention = real
