"""How LoRA layers over a 4-bit base compute: peft + bitsandbytes, or tunekit's fused Triton kernel.

The choice is made once, before the first step, and never changes what is trained or saved:

* `FusedLoRALinear4bit` *is* peft's LoRA `Linear4bit` (a subclass that only replaces forward),
  and a layer is switched by changing its class in place. peft still finds every layer when it
  saves, loads, merges or disables adapters, and state-dict keys are untouched. (Swapping in a
  module of another type made peft 0.21 save adapters with 0 tensors: TRAPS.md.)
* On a CPU, `auto` takes the same layer math in plain torch + bitsandbytes with the LoRA matmuls
  in bf16 (tunekit/lora_compute.py: peft runs them in fp32, at a quarter of the CPU's bf16 speed),
  when the base computes in bf16; it is checked against the twin like the kernel (not timed: a
  rule, so that a resumed run takes the same path and stays bit-identical).
* `kernels.fused_lora=auto` proves the kernel on this device before trusting it: for every
  distinct weight shape of the model, one real layer's NF4 weight runs forward and backward
  through the fused op and through its pure-torch twin (tunekit_kernels.reference) on a few
  tokens; a compile error, a difference beyond the dtype's tolerance, or a fused layer slower
  than peft + bitsandbytes falls back to peft with one log line. `on` turns each of these into
  an error. The decision and its figures go into summary.json.

Device questions (is this CUDA, which capability, is triton there) go through tunekit.device.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch
import torch.nn as nn
from peft.tuners.lora.bnb import Linear4bit as PeftLoRALinear4bit

from tunekit import TunekitError
from tunekit import device as dev

log = logging.getLogger(__name__)

# Largest |fused - twin| / max |twin| accepted, per compute dtype. The twin computes in fp32 from
# the same dequantized weight, so the difference is the fused op's own rounding:
# fp32: tile-order summation over K <= ~16k terms, ~sqrt(K) * 2^-24 ~ 1e-5 typical; 1e-4 bounds
#       the rare worst case with room, and any real bug (a missing term) is O(1).
# bf16/fp16: operands and output are rounded once each (2^-8 / 2^-11 relative), plus the LoRA
#       branch rounded in the compute dtype; 3e-2 / 5e-3 leave 4x headroom over those.
CHECK_TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}
CHECK_TOKENS = 64  # correctness: enough rows for several tiles, cheap under the interpreter too
TIMING_TOKENS = 2048  # speed: a realistic micro-batch (tokens) for the fused-vs-peft comparison


class FusedLoRALinear4bit(PeftLoRALinear4bit):
    """peft's LoRA over a bitsandbytes Linear4bit, with the forward of tunekit_kernels.

    y = base(x) + scaling * B A dropout(x): (..., in) -> (..., out), W frozen NF4, computed in
    the base layer's compute dtype and written in x's dtype (fp32 under k-bit training), so a
    LoRA term below the compute dtype's rounding step is kept, as in peft. Anything the fused op
    does not cover (adapters disabled or merged, several active adapters, per-row adapter names)
    runs peft's own forward.
    """

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        active = [a for a in self.active_adapters if a in self.lora_A]
        if self.disable_adapters or self.merged or len(active) != 1 or args or kwargs:
            return super().forward(x, *args, **kwargs)
        import tunekit_kernels as tk

        name = active[0]
        weight = self.base_layer.weight
        quant = tk.from_quant_state(weight.data, weight.quant_state)
        dtype = self.base_layer.compute_dtype or x.dtype
        dropout = self.lora_dropout[name]
        p = float(dropout.p) if self.training and isinstance(dropout, nn.Dropout) else 0.0
        bias = self.base_layer.bias
        y = tk.fused_lora_linear(
            x.to(dtype), quant, self.lora_A[name].weight.to(dtype), self.lora_B[name].weight.to(dtype),
            float(self.scaling[name]), bias=None if bias is None else bias.to(dtype), dropout_p=p,
            out_dtype=x.dtype,
        )
        return y


class TorchLoRALinear4bit(PeftLoRALinear4bit):
    """peft's LoRA over a bitsandbytes Linear4bit, LoRA matmuls in the compute dtype (lora_compute.py)."""

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        active = [a for a in self.active_adapters if a in self.lora_A]
        if self.disable_adapters or self.merged or len(active) != 1 or args or kwargs:
            return super().forward(x, *args, **kwargs)
        from tunekit.lora_compute import lora4bit_compute

        name = active[0]
        dropout = self.lora_dropout[name]
        p = float(dropout.p) if self.training and isinstance(dropout, nn.Dropout) else 0.0
        return lora4bit_compute(x, self.base_layer, self.lora_A[name].weight, self.lora_B[name].weight,
                                float(self.scaling[name]), p)


PATHS = {"peft": PeftLoRALinear4bit, "fused": FusedLoRALinear4bit, "torch": TorchLoRALinear4bit}


def lora_4bit_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, layer) of every peft LoRA layer over a bitsandbytes 4-bit weight, fused or not."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, PeftLoRALinear4bit)]


def set_path(layers: list[nn.Module], path: str) -> None:
    """Switch layers between peft's forward and tunekit's; nothing else about them changes."""
    for layer in layers:
        layer.__class__ = PATHS[path]


@dataclass
class KernelCheck:
    """The proof run for one weight shape: errors relative to the twin, times in ms (CUDA only)."""

    shape: tuple[int, int]
    max_rel_err: float = float("nan")
    fused_ms: Optional[float] = None
    peft_ms: Optional[float] = None
    error: Optional[str] = None


@dataclass
class FusedDecision:
    """What summary.json records: which path the LoRA layers use, and why."""

    mode: str
    path: str  # "fused" (Triton) | "torch" (compute-dtype LoRA, CPU) | "peft"
    reason: str
    layers: int = 0
    checks: list = field(default_factory=list)

    def as_dict(self) -> dict:
        return {**asdict(self), "checks": [asdict(c) for c in self.checks]}


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest absolute difference over the largest magnitude of `expected` (NaN stays NaN)."""
    a, e = actual.double(), expected.double()
    return ((a - e).abs().max() / e.abs().max().clamp_min(1e-30)).item()


def check_layer(layer: nn.Module, dtype: torch.dtype, tokens: int = CHECK_TOKENS, seed: int = 0,
                path: str = "fused") -> float:
    """Max relative error of tunekit's op (`path`) against the fp32 twin on `layer`'s real NF4 weight.

    Random x (tokens, in), random non-zero LoRA factors of the layer's rank (the trained B starts
    at zero, which would hide half the op) and a random output gradient; compares y, dx, dA, dB.
    Raises whatever the kernel raises (e.g. a Triton compile error).
    """
    import tunekit_kernels as tk
    from tunekit_kernels.reference import lora_linear_reference

    name = next(iter(layer.lora_A))
    weight = layer.base_layer.weight
    quant = tk.from_quant_state(weight.data, weight.quant_state)
    n_out, n_in = quant.shape
    r = layer.lora_A[name].weight.shape[0]
    device = weight.device
    g = torch.Generator(device="cpu").manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g).to(device)  # noqa: E731
    x, A, B, dy = rand(tokens, n_in), rand(r, n_in) / n_in**0.5, rand(n_out, r) / r**0.5, rand(tokens, n_out)
    scaling = float(layer.scaling[name])

    def run(fn, cast):
        with torch.enable_grad():  # the check may be asked for under no_grad (evaluation, generation)
            xs, As, Bs = (t.to(cast).requires_grad_() for t in (x, A, B))
            y = fn(xs, As, Bs)
            y.backward(dy.to(cast))
        return [y.detach(), xs.grad, As.grad, Bs.grad]

    if path == "fused":
        fused = run(lambda a, b, c: tk.fused_lora_linear(a, quant, b, c, scaling), dtype)
    else:
        from tunekit.lora_compute import lora4bit_compute

        # bitsandbytes computes the base in its compute dtype whatever x's dtype; x comes in as in training
        fused = run(lambda a, b, c: lora4bit_compute(a, layer.base_layer, b.float(), c.float(), scaling), dtype)
    twin = run(lambda a, b, c: lora_linear_reference(a, quant, b, c, scaling), torch.float32)
    return max(rel_err(f, t) for f, t in zip(fused, twin))


def _median_ms(step, device: torch.device, reps: int = 5) -> float:
    for _ in range(2):  # warm-up: compilation and autotuning happen here
        step()
    times = []
    for _ in range(reps):
        dev.synchronize(device)
        start = time.perf_counter()
        step()
        dev.synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def time_layer(layer: nn.Module, dtype: torch.dtype, tokens: int = TIMING_TOKENS,
               path: str = "fused") -> tuple[float, float]:
    """(tunekit's ms, peft ms) for forward + backward of `layer` on `tokens` random rows."""
    n_in = layer.base_layer.in_features
    device = layer.base_layer.weight.device
    x = torch.randn(tokens, n_in, device=device, dtype=dtype, requires_grad=True)
    fused_cls = layer.__class__

    def step_with(cls):
        def step():
            layer.__class__ = cls
            with torch.enable_grad():
                layer(x).float().sum().backward()
            x.grad = None
        return step

    try:
        fused = _median_ms(step_with(PATHS[path]), device)
        peft = _median_ms(step_with(PeftLoRALinear4bit), device)
    finally:
        layer.__class__ = fused_cls
        layer.zero_grad(set_to_none=True)
    return fused, peft


def _distinct_shapes(layers: list[tuple[str, nn.Module]]) -> list[nn.Module]:
    seen, out = set(), []
    for _, layer in layers:
        shape = (layer.base_layer.out_features, layer.base_layer.in_features)
        if shape not in seen:
            seen.add(shape)
            out.append(layer)
    return out


def prove_kernel(layers: list[tuple[str, nn.Module]], dtype: torch.dtype, facts: dev.DeviceFacts,
                 path: str = "fused") -> tuple[bool, str, list]:
    """Run the checks on one layer per weight shape. Returns (trusted, reason, checks)."""
    checks, timed = [], facts.type == "cuda"
    what = "the fused kernel" if path == "fused" else "the compute-dtype LoRA"
    for layer in _distinct_shapes(layers):
        c = KernelCheck((layer.base_layer.out_features, layer.base_layer.in_features))
        checks.append(c)
        try:
            c.max_rel_err = check_layer(layer, dtype, path=path)
        except Exception as e:  # a Triton compile or launch failure: any type, reported by name
            c.error = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"
            return False, f"{what} failed on a {c.shape[0]}x{c.shape[1]} layer ({c.error})", checks
        if not c.max_rel_err <= CHECK_TOL[dtype]:
            return False, (f"{what} differs from its reference by {c.max_rel_err:.2e} (relative) on a "
                           f"{c.shape[0]}x{c.shape[1]} layer, above the {CHECK_TOL[dtype]:.0e} allowed in "
                           f"{dtype}"), checks
        if timed:
            c.fused_ms, c.peft_ms = time_layer(layer, dtype, path=path)
    if timed:
        fused, peft = sum(c.fused_ms for c in checks), sum(c.peft_ms for c in checks)
        if fused > peft:
            return False, (f"{what} is slower than peft + bitsandbytes here ({fused:.2f} ms vs "
                           f"{peft:.2f} ms, forward + backward of one layer per shape)"), checks
        speed = f", {peft / fused:.2f}x peft's speed"
    else:
        speed = (" (speed not compared: the interpreter is for tests)" if path == "fused"
                 else " (bf16 instead of fp32 LoRA matmuls)" if dtype == torch.bfloat16 else "")
    worst = max(c.max_rel_err for c in checks)
    return True, f"checked against its reference on {len(checks)} layer shapes (max rel. err {worst:.1e}){speed}", checks


def choose_lora_path(model: nn.Module, mode: str, facts: dev.DeviceFacts, dtype: torch.dtype) -> FusedDecision:
    """Decide, prove and apply the LoRA path for `model`; returns the decision for the log and summary.

    mode: auto (CUDA: the Triton kernel where it runs, passes its checks and is faster; CPU: the
    compute-dtype LoRA, checked, when the base computes in bf16 or an fp32 base fits dequantized
    in memory; else peft) | on (the Triton kernel or a clear error) | off (peft).
    """
    layers = lora_4bit_layers(model)
    set_path([m for _, m in layers], "peft")  # peft's forward unless tunekit's earns its place below
    from tunekit.lora_compute import drop_dense

    for _, m in layers:
        drop_dense(m.base_layer)
    if mode == "off":
        return FusedDecision(mode, "peft", "kernels.fused_lora=off")
    if not layers:
        if mode == "on":
            raise TunekitError("kernels.fused_lora=on: no LoRA layer over a 4-bit base "
                               "(use it with model.quantize=nf4 and method.name=lora)")
        return FusedDecision(mode, "peft", "no LoRA layer over a 4-bit base")
    from tunekit_kernels._runtime import interpreting, triton_importable

    supported, why = dev.fused_kernel_support(facts, dtype, triton_importable(), interpreting())
    if mode == "auto" and facts.type != "cuda":
        return _cpu_path(model, layers, mode, facts, dtype, why)
    if not supported:
        if mode == "on":
            raise TunekitError(f"kernels.fused_lora=on: the fused kernel cannot run here: {why}")
        return FusedDecision(mode, "peft", why)
    trusted, reason, checks = prove_kernel(layers, dtype, facts)
    if not trusted:
        if mode == "on":
            raise TunekitError(f"kernels.fused_lora=on: {reason}; use kernels.fused_lora=auto or off")
        return FusedDecision(mode, "peft", reason + "; using peft + bitsandbytes", checks=checks)
    set_path([m for _, m in layers], "fused")
    return FusedDecision(mode, "fused", reason, layers=len(layers), checks=checks)


def _cpu_path(model, layers, mode: str, facts: dev.DeviceFacts, dtype: torch.dtype, why: str) -> FusedDecision:
    """auto off CUDA: the Triton kernel is out (only an interpreter runs it there). Two things pay
    on a CPU: the LoRA matmuls in bf16 where the base computes in bf16, and, in bf16 or fp32, the
    frozen base kept dequantized where memory allows (tunekit.device.dense_cache_fits) instead of
    dequantized twice per layer per micro-batch. An fp32 base without room for that copy gains
    nothing over peft's own fp32 math, so peft stays."""
    if dtype not in (torch.bfloat16, torch.float32):
        return FusedDecision(mode, "peft", f"the base computes in {dtype} ({why})")
    dense = sum(m.base_layer.in_features * m.base_layer.out_features for _, m in layers) * dtype.itemsize
    fits = dev.dense_cache_fits(dense, facts)
    if dtype == torch.float32 and not fits:
        return FusedDecision(mode, "peft", "the base computes in fp32 and a dequantized copy of it would take more "
                             f"than an eighth of memory, so peft's fp32 LoRA is as fast ({why})")
    trusted, reason, checks = prove_kernel(layers, dtype, facts, path="torch")
    if not trusted:
        return FusedDecision(mode, "peft", reason + "; using peft + bitsandbytes", checks=checks)
    set_path([m for _, m in layers], "torch")
    from tunekit.lora_compute import cache_dense

    cached = ""
    if fits:
        kept = sum(cache_dense(m.base_layer, dtype) for _, m in layers)
        cached = (f"; the 4-bit base also kept dequantized in {dev.dtype_name(dtype)} ({kept / 2**20:.0f} MiB, "
                  "dequantized once)")
    what = "LoRA matmuls in bf16" if dtype == torch.bfloat16 else "peft's fp32 LoRA math"
    return FusedDecision(mode, "torch", f"{what} on {facts.describe()}{cached}, {reason}",
                         layers=len(layers), checks=checks)
