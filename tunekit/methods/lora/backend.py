"""How LoRA layers over a 4-bit base compute: peft + bitsandbytes, or tunekit's fused Triton kernel.

The choice is made once, before the first step, and never changes what is trained or saved:

* `FusedLoRALinear4bit` *is* peft's LoRA `Linear4bit` (a subclass that only replaces forward),
  and a layer is switched by changing its class in place. peft still finds every layer when it
  saves, loads, merges or disables adapters, and state-dict keys are untouched. (Swapping in a
  module of another type made peft 0.21 save adapters with 0 tensors.)
* On a CPU, `auto` takes the same layer math in plain torch + bitsandbytes with the LoRA matmuls
  in bf16 (tunekit/methods/lora/compute_dtype.py: peft runs them in fp32, several times slower on a CPU),
  when the base computes in bf16; it is checked against the twin like the kernel (not timed: a
  rule, so that a resumed run takes the same path and stays bit-identical).
* `kernels.fused_lora=auto` proves the kernel on this device before trusting it: for every
  distinct weight shape of the model, one real layer's NF4 weight runs forward and backward
  through the fused op and through its pure-torch twin (tunekit_kernels.reference) on a few
  tokens; a compile error or a difference beyond the dtype's tolerance falls back to peft with
  one log line, and so does a kernel that is correct but slower than peft + bitsandbytes. `on`
  turns a failure into an error, but keeps a correct kernel that is merely slower (the user asked
  for it) and logs that it is. The decision and its figures go into summary.json.
* With several processes (DDP), each rank proves the kernel on its own GPU, but timings differ
  from rank to rank: `agree_on_backend` hands every rank rank 0's decision, so all of them compute
  alike.

Device questions (is this CUDA, which capability, is triton there) go through tunekit.device.facts.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
from peft.tuners.lora.bnb import Linear4bit as PeftLoRALinear4bit

from tunekit import TunekitError
from tunekit.device import facts as dev

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
    the base layer's compute dtype and written in x's dtype (the residual stream's), as peft adds
    its LoRA output to the base layer's. Anything the fused op
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
        from tunekit.methods.lora.compute_dtype import lora4bit_compute

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
    """The proof run for one weight shape: errors relative to the twin, times in ms (CUDA only).
    `passed`: within the dtype's tolerance and no error (None until checked)."""

    shape: tuple[int, int]
    max_rel_err: float = float("nan")
    fused_ms: Optional[float] = None
    peft_ms: Optional[float] = None
    error: Optional[str] = None
    passed: Optional[bool] = None


@dataclass
class KernelProof:
    """What `prove_kernel` found: correct (every shape within tolerance, nothing raised), and on
    CUDA the summed forward + backward times of one layer per shape against peft + bitsandbytes."""

    correct: bool
    reason: str
    checks: list
    fused_ms: Optional[float] = None
    peft_ms: Optional[float] = None

    @property
    def slower(self) -> bool:
        """Correct but slower than peft + bitsandbytes (False where not timed)."""
        return self.correct and self.fused_ms is not None and self.peft_ms is not None and self.fused_ms > self.peft_ms


@dataclass
class FusedDecision:
    """What summary.json records: which path the LoRA layers use, and why.

    `dense_dtype`: the dtype the 4-bit base is also kept dequantized in (torch path, CPU), if it is.
    `decided_by`: "rank 0" once `agree_on_backend` has made every rank take rank 0's decision.
    `rejected_checks`: the per-shape figures of a kernel that was proven and not taken (on a GPU the
    fused kernel's, when the torch path replaced it): the reason's totals, shape by shape."""

    mode: str
    path: str  # "fused" (Triton) | "torch" (compute-dtype LoRA, CPU) | "peft"
    reason: str
    layers: int = 0
    checks: list = field(default_factory=list)
    dense_dtype: Optional[str] = None
    decided_by: Optional[str] = None
    rejected_checks: list = field(default_factory=list)

    def as_dict(self) -> dict:
        return {**asdict(self), "checks": [asdict(c) for c in self.checks],
                "rejected_checks": [asdict(c) for c in self.rejected_checks]}

    @classmethod
    def from_dict(cls, d: dict) -> "FusedDecision":
        def parse(rows):
            return [KernelCheck(**{**c, "shape": tuple(c["shape"])}) for c in rows]

        return cls(**{**d, "checks": parse(d.get("checks", [])), "rejected_checks": parse(d.get("rejected_checks", []))})


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
            # a copy even where `cast` is t's dtype (.to would return t itself): each run's own leaves,
            # so that one run's gradients are not the other's tensors, accumulated into
            xs, As, Bs = (t.to(cast, copy=True).requires_grad_() for t in (x, A, B))
            y = fn(xs, As, Bs)
            y.backward(dy.to(cast))
        return [y.detach(), xs.grad, As.grad, Bs.grad]

    if path == "fused":
        fused = run(lambda a, b, c: tk.fused_lora_linear(a, quant, b, c, scaling), dtype)
    else:
        from tunekit.methods.lora.compute_dtype import lora4bit_compute

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


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter as peft would save it (its own collection, as save_pretrained makes it), cloned."""
    from peft import get_peft_model_state_dict

    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}


def adapter_change(before: dict[str, torch.Tensor], model: nn.Module) -> Optional[str]:
    """What differs between `before` (adapter_state) and the adapter peft collects from `model` now:
    None if nothing, else a sentence (tensors lost or gained, values changed)."""
    from peft import get_peft_model_state_dict

    after = get_peft_model_state_dict(model)
    if set(after) != set(before):
        return (f"peft collects {len(after)} adapter tensors, {len(before)} before "
                f"(first differing: {sorted(set(after) ^ set(before))[0]})")
    changed = [k for k in before if not torch.equal(before[k], after[k].detach())]
    if changed:
        return f"{len(changed)} adapter tensors changed value (first: {changed[0]})"
    return None


def _distinct_shapes(layers: list[tuple[str, nn.Module]]) -> list[nn.Module]:
    seen, out = set(), []
    for _, layer in layers:
        shape = (layer.base_layer.out_features, layer.base_layer.in_features)
        if shape not in seen:
            seen.add(shape)
            out.append(layer)
    return out


def prove_kernel(layers: list[tuple[str, nn.Module]], dtype: torch.dtype, facts: dev.DeviceFacts,
                 path: str = "fused") -> KernelProof:
    """Run the checks on one layer per weight shape, and on CUDA time them against peft + bitsandbytes.

    Not correct: a check raised (a Triton compile or launch error) or differs from the twin beyond
    the dtype's tolerance; the checks stop at the first such shape. Slower is not incorrect: the
    proof says so (`KernelProof.slower`) and the caller decides.
    """
    checks, timed = [], facts.type == "cuda"
    what = "the fused kernel" if path == "fused" else "the compute-dtype LoRA"
    for layer in _distinct_shapes(layers):
        c = KernelCheck((layer.base_layer.out_features, layer.base_layer.in_features))
        checks.append(c)
        try:
            c.max_rel_err = check_layer(layer, dtype, path=path)
        except Exception as e:  # a Triton compile or launch failure: any type, reported by name
            c.error = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"
            c.passed = False
            return KernelProof(False, f"{what} failed on a {c.shape[0]}x{c.shape[1]} layer ({c.error})", checks)
        c.passed = bool(c.max_rel_err <= CHECK_TOL[dtype])
        if not c.passed:
            return KernelProof(False, (f"{what} differs from its reference by {c.max_rel_err:.2e} (relative) on a "
                                       f"{c.shape[0]}x{c.shape[1]} layer, above the {CHECK_TOL[dtype]:.0e} allowed in "
                                       f"{dtype}"), checks)
        if timed:
            c.fused_ms, c.peft_ms = time_layer(layer, dtype, path=path)
    worst = max(c.max_rel_err for c in checks)
    checked = f"checked against its reference on {len(checks)} layer shapes (max rel. err {worst:.1e})"
    if not timed:
        speed = (" (speed not compared: the interpreter is for tests)" if path == "fused"
                 else " (bf16 instead of fp32 LoRA matmuls)" if dtype == torch.bfloat16 else "")
        return KernelProof(True, checked + speed, checks)
    fused, peft = sum(c.fused_ms for c in checks), sum(c.peft_ms for c in checks)
    if fused > peft:
        reason = (f"{what} is correct but slower than peft + bitsandbytes here ({fused:.2f} ms vs {peft:.2f} ms, "
                  f"forward + backward of one layer per shape; {checked})")
    else:
        reason = f"{checked}, {peft / fused:.2f}x peft's speed"
    return KernelProof(True, reason, checks, round(fused, 4), round(peft, 4))


def choose_lora_backend(model: nn.Module, mode: str, facts: dev.DeviceFacts, dtype: torch.dtype) -> FusedDecision:
    """Decide, prove and apply the LoRA path for `model`; returns the decision for the log and summary.

    mode: auto (CUDA: the Triton kernel where it runs, passes its checks and is faster; correct but
    slower keeps peft; CPU: the compute-dtype LoRA, checked, when the base computes in bf16 or an
    fp32 base fits dequantized in memory; else peft) | on (the Triton kernel where it runs and passes
    its checks, slower or not, which a warning then says; else a clear error) | off (peft).
    With several ranks, pass the result through `agree_on_backend`.
    """
    layers = lora_4bit_layers(model)
    set_path([m for _, m in layers], "peft")  # peft's forward unless tunekit's earns its place below
    from tunekit.methods.lora.compute_dtype import drop_dense

    for _, m in layers:
        drop_dense(m.base_layer)
    if mode == "off":
        return FusedDecision(mode, "peft", "kernels.fused_lora=off")
    if any(m.use_dora.get(a) for _, m in layers for a in m.active_adapters):
        if mode == "on":  # neither the kernel nor the compute-dtype path computes DoRA's magnitude
            from tunekit.methods.lora.variants import DORA_NOT_FUSED

            raise TunekitError(DORA_NOT_FUSED)
        return FusedDecision(mode, "peft", "DoRA (method.use_dora): peft's layers compute its magnitude",
                             layers=len(layers))
    if not layers:
        if mode == "on":
            raise TunekitError("kernels.fused_lora=on: no LoRA layer over a 4-bit base "
                               "(use it with model.quantize=nf4 and method.name=lora)")
        return FusedDecision(mode, "peft", "no LoRA layer over a 4-bit base")
    from tunekit_kernels._runtime import interpreting, triton_importable

    supported, why = dev.fused_kernel_support(facts, dtype, triton_importable(), interpreting())
    if mode == "auto" and facts.type != "cuda":
        return _torch_path(model, layers, mode, facts, dtype, why)
    if not supported:
        if mode == "on":
            raise TunekitError(f"kernels.fused_lora=on: the fused kernel cannot run here: {why}")
        return _gpu_fallback(model, layers, mode, facts, dtype, why)
    proof = prove_kernel(layers, dtype, facts)
    if not proof.correct:
        if mode == "on":
            raise TunekitError(f"kernels.fused_lora=on: {proof.reason}; use kernels.fused_lora=auto or off")
        return _gpu_fallback(model, layers, mode, facts, dtype, proof.reason, proof.checks)
    reason = proof.reason
    if proof.slower:
        if mode == "auto":
            return _gpu_fallback(model, layers, mode, facts, dtype, reason, proof.checks)
        reason += "; kernels.fused_lora=on: using it as asked"
        log.warning("kernels: %s", reason)
    set_path([m for _, m in layers], "fused")
    return FusedDecision(mode, "fused", reason, layers=len(layers), checks=proof.checks)


def _gpu_fallback(model, layers, mode: str, facts: dev.DeviceFacts, dtype: torch.dtype, why: str,
                  checks: Optional[list] = None) -> FusedDecision:
    """auto on CUDA where the fused kernel is not taken: in bf16 the same torch path as on a CPU (the
    LoRA matmuls in bf16, the input kept once as it came), not peft's fp32 branch, which keeps an fp32
    copy of every LoRA input (the precision policy; half of a checkpointed Llama-3-8B block's saved
    bytes); in fp32 peft, whose fp32 branch then adds nothing."""
    if dtype != torch.bfloat16:
        return FusedDecision(mode, "peft", why + "; using peft + bitsandbytes", checks=checks or [])
    decision = _torch_path(model, layers, mode, facts, dtype, why)
    decision.reason = f"{why}; instead: {decision.reason}"
    if decision.checks is not checks and checks:
        decision.rejected_checks = list(checks)
    return decision


def _torch_path(model, layers, mode: str, facts: dev.DeviceFacts, dtype: torch.dtype, why: str) -> FusedDecision:
    """The LoRA matmuls in the compute dtype in plain torch (tunekit.methods.lora.compute_dtype), checked against
    the twin: auto off CUDA, where the Triton kernel is out (only an interpreter runs it there), and
    on CUDA in bf16 where the kernel is not taken. Two things pay
    on a CPU: the LoRA matmuls in bf16 where the base computes in bf16, and, in bf16 or fp32, the
    frozen base kept dequantized where memory allows (tunekit.device.facts.dense_cache_fits) instead of
    dequantized twice per layer per micro-batch. An fp32 base without room for that copy gains
    nothing over peft's own fp32 math, so peft stays."""
    if dtype not in (torch.bfloat16, torch.float32):
        return FusedDecision(mode, "peft", f"the base computes in {dtype} ({why})")
    dense = sum(m.base_layer.in_features * m.base_layer.out_features for _, m in layers) * dtype.itemsize
    fits = dev.dense_cache_fits(dense, facts)
    if dtype == torch.float32 and not fits:
        return FusedDecision(mode, "peft", "the base computes in fp32 and a dequantized copy of it would take more "
                             f"than an eighth of memory, so peft's fp32 LoRA is as fast ({why})")
    proof = prove_kernel(layers, dtype, facts, path="torch")
    if not proof.correct:
        return FusedDecision(mode, "peft", proof.reason + "; using peft + bitsandbytes", checks=proof.checks)
    set_path([m for _, m in layers], "torch")
    from tunekit.methods.lora.compute_dtype import cache_dense

    cached = ""
    if fits:
        kept = sum(cache_dense(m.base_layer, dtype) for _, m in layers)
        cached = (f"; the 4-bit base also kept dequantized in {dev.dtype_name(dtype)} ({kept / 2**20:.0f} MiB, "
                  "dequantized once)")
    what = "LoRA matmuls in bf16" if dtype == torch.bfloat16 else "peft's fp32 LoRA math"
    return FusedDecision(mode, "torch", f"{what} on {facts.describe()}{cached}, {proof.reason}",
                         layers=len(layers), checks=proof.checks, dense_dtype=dev.dtype_name(dtype) if fits else None)


def broadcast_from_rank0(obj: Any) -> Any:
    """Rank 0's `obj` (picklable) on every rank; `obj` itself where no process group is running."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def agree_on_backend(decision: FusedDecision, broadcast_object: Callable[[Any], Any],
                  model: Optional[nn.Module] = None) -> FusedDecision:
    """Every rank takes the LoRA path rank 0 decided; returns that decision, `decided_by="rank 0"`.

    Each rank decides on its own first (`choose_lora_backend` proves and times the kernel on its own
    GPU); timings differ from rank to rank, so `auto` could otherwise train with the fused kernel on
    some ranks and with peft on others. `broadcast_object(obj)` must return rank 0's `obj` on every
    rank (`broadcast_from_rank0`; a plain function in tests). Where this rank decided otherwise, its
    LoRA layers (of `model`) are switched to rank 0's path and a warning says so. A rank whose own
    check found the kernel wrong or failing refuses rank 0's `fused` (TunekitError): its GPU would
    compute wrong gradients or crash mid-run.
    """
    agreed = FusedDecision.from_dict(broadcast_object(decision.as_dict()))
    agreed.decided_by = "rank 0"
    if agreed.path == decision.path and agreed.dense_dtype == decision.dense_dtype:
        return agreed
    failed = [c for c in decision.checks if c.passed is False]
    if agreed.path == "fused" and failed:
        c = failed[0]
        raise TunekitError(f"kernels: rank 0 chose the fused kernel, but on this rank it "
                           f"{'failed (' + c.error + ')' if c.error else f'differs by {c.max_rel_err:.2e}'} on a "
                           f"{c.shape[0]}x{c.shape[1]} layer; do the GPUs differ? Use kernels.fused_lora=off")
    if model is None:
        raise ValueError("agree_on_backend: this rank decided otherwise than rank 0; pass the model to switch it")
    log.warning("kernels: this rank found %s (%s); taking rank 0's decision: %s (%s)",
                decision.path, decision.reason, agreed.path, agreed.reason)
    apply_path(model, agreed)
    return agreed


def apply_path(model: nn.Module, decision: FusedDecision) -> None:
    """Put `model`'s LoRA layers on `decision`'s path (a decision made elsewhere, e.g. on rank 0)."""
    from tunekit.methods.lora.compute_dtype import cache_dense, drop_dense

    layers = [m for _, m in lora_4bit_layers(model)]
    for m in layers:
        drop_dense(m.base_layer)
    set_path(layers, decision.path)
    if decision.path == "torch" and decision.dense_dtype:
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[decision.dense_dtype]
        for m in layers:
            cache_dense(m.base_layer, dtype)
