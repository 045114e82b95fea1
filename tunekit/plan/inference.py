"""Memory of the commands that run a trained model (eval, generate, chat, export), before it loads.

Each is a plain function of the model's shape, how it is loaded and how much it computes at once,
like the training plan (tunekit.plan.memory), so a command can refuse a device that cannot hold
the model with one line naming what to change, instead of failing halfway with CUDA's
out-of-memory error. Terms:

* weights: the base as loaded (tunekit.plan.memory.base_weight_bytes: NF4 + double quantization
  for the projections of a 4-bit base, the compute dtype for the rest), plus the trained part;
* KV cache: keys and values of every layer for the tokens cached at the peak, compute dtype;
* working set: one decoder block's transient tensors for the largest forward (no autograd:
  nothing is kept across blocks): the residual, its normed copy, the block output, q/k/v, the
  attention output, gate, up and their product;
* logits: `logit_rows` positions of fp32 logits, twice (the logits and one softmax-sized
  temporary).

On CUDA the caching allocator reserves more than it hands out: the same margin as the training
plan's (tunekit.plan.CUDA_ALLOCATOR_MARGIN). The CUDA context and, on a CPU, the process's own
runtime are already spent when free memory is read, so they are not counted again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from tunekit import TunekitError
from tunekit.device.facts import DeviceFacts
from tunekit.plan.memory import base_weight_bytes
from tunekit.plan.shape import ModelShape

GiB = 2**30


@dataclass(frozen=True)
class Workload:
    """How much the command computes at once, in tokens."""

    kv_tokens: int  # tokens whose keys and values are cached at the peak (0: no cache)
    forward_tokens: int  # tokens of the largest forward
    logit_rows: int  # positions whose fp32 logits exist at once


def inference_memory(shape: ModelShape, quantize: str, compute_bytes: int, work: Workload,
                     trained_bytes: int = 0) -> dict[str, int]:
    """Peak bytes by term (see the module docstring)."""
    return {"base weights": base_weight_bytes(shape, quantize, compute_bytes),
            **({"trained part": trained_bytes} if trained_bytes else {}),
            **activation_terms(shape, compute_bytes, work)}


def activation_terms(shape: ModelShape, compute_bytes: int, work: Workload) -> dict[str, int]:
    """KV cache, one block's working set and the logits of `work`."""
    e, d, m = compute_bytes, shape.hidden_size, shape.intermediate_size
    terms = {
        "KV cache": 2 * shape.num_layers * work.kv_tokens * shape.kv_dim * e,
        "working set (one block)": work.forward_tokens * (3 * d + shape.q_dim + 2 * shape.kv_dim + 3 * m) * e,
        "logits": 2 * work.logit_rows * shape.vocab_size * 4,
    }
    return {k: v for k, v in terms.items() if v}


def with_margin(terms: dict[str, int], facts: DeviceFacts) -> dict[str, int]:
    """The terms plus the device's own overhead on top of torch's tensors."""
    from tunekit.plan import CUDA_ALLOCATOR_MARGIN

    if facts.type != "cuda":
        return dict(terms)
    return {**terms, "allocator margin": int(CUDA_ALLOCATOR_MARGIN * sum(terms.values()))}


def gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB / 10 else f"{n / 2**20:.1f} MiB"


def check_fits(terms: dict[str, int], facts: DeviceFacts, available: Optional[int], what: str, hint: str = "") -> str:
    """One line for the log when `terms` fit in `available` bytes (None: unknown, not checked);
    otherwise a TunekitError naming the largest terms and the way out (`hint`: the command's own
    knobs, after --device cpu for a GPU)."""
    terms = with_margin(terms, facts)
    need = sum(terms.values())
    if available is None:
        return f"memory: {what} needs about {gib(need)} on {facts.describe()} (free memory unknown, not checked)"
    if need <= available:
        return f"memory: {what} needs about {gib(need)} of {gib(available)} free on {facts.describe()}"
    largest = ", ".join(f"{k} {gib(v)}" for k, v in sorted(terms.items(), key=lambda kv: -kv[1])[:3])
    way_out = "; ".join((["--device cpu runs it in host memory"] if facts.type == "cuda" else []) + ([hint] if hint else []))
    raise TunekitError(f"{what} needs about {gib(need)} on {facts.describe()} ({largest}) but {gib(available)} "
                       f"is free" + (f": {way_out}" if way_out else ""))
