"""`kernels.compile=true`: the decoder layers' training forward through torch.compile, checked first.

What it buys: inductor fuses the elementwise chains between the matmuls (the residual stream,
RMSNorm, rotary, SiLU and the gate product, the LoRA sums), which eager PyTorch runs as separate
passes over memory, so a step gets cheaper and keeps fewer intermediate tensors. What it costs: the
check and the compile at start, longer on a machine's first compiled run (inductor's cache in
/tmp/torchinductor_$USER empty), so it pays off only past some number of steps, which depends on
how much of the step the fused work was (measured per machine: benchmarks/README.md). It stays off
by default: untried on a GPU, and every run would need a working C++ compiler.

How:

* Each decoder layer's `forward` becomes a plain attribute that calls the compiled forward while
  autograd records (training steps, and the recomputation of gradient checkpointing) and the eager
  one otherwise: evaluations, sample answers and generation with a KV cache stay eager and compile
  nothing. The module, its parameters and state-dict keys are untouched, so saving, resuming and
  export are the eager run's (a saved adapter never knows it was compiled).
* Before the first step `check()` proves the compiler on this build and device: a copy of the last layer,
  with every zero-initialised trained tensor (LoRA's B, an adapter's up-projection) given random
  values so that the trained branch matters and dropout off so that both sides draw no random mask,
  runs forward and backward eager and compiled on the layer's real inputs (captured from a short
  forward of the model), for a batch of two rows and for one row alone (CHECK_LENGTHS: the graphs
  the steps will run); the outputs and every gradient must agree within the tolerance below.
  Found that way: torch 2.13's inductor dropped `alpha` from `y.add_(a @ b, alpha=s)`, which
  halved every LoRA term at alpha/r = 2 (tunekit/methods/lora/compute_dtype.py no longer writes it so).
  A compile error or a difference stops the run with a message naming kernels.compile.
* Not with trainer.strategy=fsdp (refused with the config, before anything loads): FSDP2 hooks
  every layer's forward itself.

Tolerance. Compiled and eager run the same ops in the same dtype; inductor changes only the
rounding of fused elementwise chains (kept in fp32 registers instead of rounded to the storage
dtype after each op) and may re-block reductions. For fp32 storage that is a few 2^-24 per op over
chains of ~10 ops and reductions over K <= 1536 terms (sqrt(K) * 2^-24 ~ 2e-6 typical): 1e-4 of
the largest magnitude leaves 50x headroom. For bf16/fp16 storage each skipped rounding is up to
2^-9 / 2^-12 relative, and a gradient passes many of them (attention, rotary, the norm: ~10 eager
roundings on the way to q_proj's LoRA A); a LoRA A gradient is also a sum over tokens whose terms
cancel, which multiplies each term's rounding error relative to the result by Σ|term| / |Σ term|,
a factor no bound on the roundings fixes. On the default model in bf16 the largest difference comes
close to the 3e-2 the fused kernel's check uses (tunekit/methods/lora/backend.py) over a bf16 base, with
nothing wrong (benchmarks/training/compile-check-*.md). So in half precision a tensor that differs
from eager by more than that tolerance is judged against the layer run in fp32 (the same weights and
inputs, every op in fp32): the compiled result passes if it is within the tolerance of that, or no
further from it than twice eager's own distance, i.e. the compiler skipped roundings rather than
computed something else; compiled and eager come out about equally far from fp32. Any real fault (a
dropped or doubled term) is O(1) of the trained branch, which the random B keeps comparable to the
layer's output, far beyond either test.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn

from tunekit import TunekitError
from tunekit.methods.lora.backend import CHECK_TOL, rel_err
from tunekit.model.layers import decoder_layers

log = logging.getLogger(__name__)

# The analysis in the module docstring gives the fused kernel's bounds (tunekit/methods/lora/backend.py): one table.
TOL = CHECK_TOL
# The check's batches: real rows cut to these lengths, the two together and the first alone. Lengths
# that are prime, because dynamo specialises a dimension equal to a static width of the model (a
# 32-token row against k_proj's 32 outputs made the sequence length a constant), and both row
# counts, because it specialises a dimension of size 1 too: a micro-batch of one row (a long row
# that length grouping puts alone, every micro-batch at trainer.micro_batch_size=1) has no padding,
# so no mask, and runs a graph of its own. The graphs the check compiles are then the ones the
# training steps reuse, and each is checked before a step runs it.
CHECK_LENGTHS = (37, 29)
# True on a compiled layer (a plain attribute: never saved). A compiled layer's forward closes over
# the layer itself, so a deep copy of it would still run the original: copy first (check() does).
ATTR = "_tunekit_compiled"


@dataclass
class CompileDecision:
    on: bool
    reason: str
    layers: int = 0
    check: dict = field(default_factory=dict)  # max relative difference per compared tensor, check seconds

    def as_dict(self) -> dict:
        return asdict(self)


def compile_fn(fn):
    """The compiler, one place (a test swaps it for a faulty one to see the check fail)."""
    return torch.compile(fn, dynamic=True)


class _Captured(Exception):
    pass


def capture_layer_inputs(model: nn.Module, layer: nn.Module, inputs: dict) -> tuple[tuple, dict]:
    """The positional and keyword arguments the decoder passes `layer` for the model inputs `inputs`
    (one forward as a training step makes it, stopped at the layer): hidden states, rotary
    embeddings, mask, whatever this family passes."""
    from tunekit.model.loader import decoder_and_head

    seen = {}

    def hook(module, args, kwargs):
        seen["args"], seen["kwargs"] = args, kwargs
        raise _Captured

    handle = layer.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            decoder_and_head(model)[0](**inputs, use_cache=False)
    except _Captured:
        pass
    finally:
        handle.remove()
    if "args" not in seen:
        raise TunekitError("kernels.compile: the model's forward never reached its first decoder layer")
    return seen["args"], seen["kwargs"]


def _first_tensor(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def check(model: nn.Module, layer: nn.Module, batches: Sequence[dict], dtype: torch.dtype) -> dict:
    """Layer `layer`'s copy, eager against compiled, forward and backward, on each of `batches` (model
    inputs, see CHECK_LENGTHS; the module docstring has the rest). Returns the largest relative
    difference of the output, the input gradient and the trained tensors' gradients; raises
    TunekitError beyond the tolerance or on a compile error."""
    twin = copy.deepcopy(layer)
    gen = torch.Generator(device="cpu").manual_seed(0)
    with torch.no_grad():
        for p in twin.parameters():
            if p.requires_grad and not p.any():  # zero-initialised: give the branch a say
                p.copy_((torch.randn(p.shape, generator=gen) * 0.1).to(p.device, p.dtype))
    for m in twin.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    cases = {}
    for inputs in batches:
        args, kwargs = capture_layer_inputs(model, layer, inputs)
        if args:
            hidden, rest = args[0], args[1:]
        else:  # passed by name
            kwargs = dict(kwargs)
            hidden, rest = kwargs.pop("hidden_states"), ()
        # A loss that weights every output element differently, so that each gradient is a real check
        weights = torch.randn(hidden.shape, generator=gen).to(hidden.device, torch.float32)
        rows, positions = hidden.shape[:2]
        cases[f"{rows} row{'s' * (rows != 1)} of {positions} positions"] = (hidden, rest, kwargs, weights)

    def run(module, hidden, rest, kwargs, weights):
        # through the module's __call__, as training calls it (gradient checkpointing included)
        x = hidden.detach().clone().requires_grad_(True)
        for p in module.parameters():
            p.grad = None
        out = _first_tensor(module(x, *rest, **kwargs))
        (out.float() * weights).sum().backward()
        grads = {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}
        return {"output": out.detach(), "input_grad": x.grad.detach(), **grads}

    t0 = time.perf_counter()
    with torch.enable_grad():
        references = {}
        if dtype != torch.float32:  # the same layer and inputs with every op in fp32 (module docstring)
            try:
                wide = _fp32_copy(twin)
                references = {label: run(wide, *_fp32(case[:3]), case[3]) for label, case in cases.items()}
            except Exception as e:  # a layer this widening does not fit: no check, so no compiling
                raise TunekitError(f"kernels.compile: the check could not run the decoder layer in fp32 "
                                   f"({type(e).__name__}: {str(e).strip()[:200]}); "
                                   f"run with kernels.compile=false") from e
        wants = {label: run(twin, *case) for label, case in cases.items()}
        compile_layers([twin])
        try:
            gots = {label: run(twin, *case) for label, case in cases.items()}
        except Exception as e:  # inductor raises many kinds; the user needs the gist and the way out
            first = str(e).strip().splitlines()[0] if str(e).strip() else repr(e)
            raise TunekitError(f"kernels.compile: torch.compile failed on this build ({type(e).__name__}: "
                               f"{first[:300]}); run with kernels.compile=false") from e
    tol = TOL.get(dtype, TOL[torch.bfloat16])
    result = {"max_rel_diff": 0.0, "worst": None, "tolerance": tol, "compared": 0, "batches": list(cases)}
    near_all, judged = [], []
    for label in cases:
        got, want, reference = gots[label], wants[label], references.get(label)
        if set(got) != set(want) or len(want) == 2:  # 2: the output and input gradient, no trained tensor
            trained = [sorted(set(r) - {"output", "input_grad"})[:3] for r in (got, want)]
            raise TunekitError(f"kernels.compile: the compiled layer computed gradients for {trained[0]}, "
                               f"eager for {trained[1]}; run with kernels.compile=false")
        diffs = {name: rel_err(got[name], want[name]) for name in want}
        # (compiled, eager) distance from the layer in fp32, per tensor: half precision only
        near = {n: (rel_err(got[n], r), rel_err(want[n], r)) for n, r in reference.items()} if reference else {}
        failed = judge(diffs, near, tol)
        if failed:
            errs = near.get(failed)
            raise TunekitError(f"kernels.compile: the compiled decoder layer differs from eager by "
                               f"{diffs[failed]:.2e} of its largest value in {failed} on a batch of {label} "
                               f"(tolerance {tol:.0e} for {dtype})"
                               + (f", and from the layer in fp32 by {errs[0]:.2e}, beyond that and twice "
                                  f"eager's {errs[1]:.2e}" if errs else "") + "; run with kernels.compile=false")
        worst = max(diffs, key=diffs.get)
        if result["worst"] is None or diffs[worst] > result["max_rel_diff"]:
            result |= {"max_rel_diff": diffs[worst], "worst": worst, "worst_batch": label}
        result["compared"] += len(diffs)
        near_all += near.values()
        judged += [f"{n} ({label})" for n in diffs if diffs[n] > tol]
    if near_all:
        result |= {"fp32_distance": {"compiled": max(c for c, _ in near_all), "eager": max(e for _, e in near_all)},
                   "judged_against_fp32": judged}
    return result | {"seconds": time.perf_counter() - t0}


def judge(diffs: dict, near: dict, tol: float) -> str | None:
    """The first compared tensor that fails, or None. diffs: {name: relative difference, compiled
    against eager}; near: {name: (compiled's, eager's) relative distance from the layer run in fp32},
    empty in fp32. A tensor within `tol` of eager passes; beyond it, it passes only if near shows the
    compiled result within `tol` of fp32 or at most twice as far from it as eager (module docstring).
    NaN fails."""
    for name, d in diffs.items():
        if d <= tol:
            continue
        if name not in near or d != d:
            return name
        compiled_err, eager_err = near[name]
        if not compiled_err <= max(tol, 2 * eager_err):
            return name
    return None


def _fp32(obj):
    """Floating tensors in obj (a tensor, or tuples/lists/dicts of them) as fp32; the rest as is."""
    if isinstance(obj, torch.Tensor):
        return obj.float() if obj.is_floating_point() else obj
    if isinstance(obj, (tuple, list)):
        return type(obj)(_fp32(o) for o in obj)
    if isinstance(obj, dict):
        return {k: _fp32(v) for k, v in obj.items()}
    return obj


def _fp32_copy(layer: nn.Module) -> nn.Module:
    """The layer with every floating parameter and buffer in fp32 and its 4-bit projections computing
    in fp32 (their codes stay; a kept dequantized weight is widened, so the same weight values)."""
    from tunekit.methods.lora.compute_dtype import CACHE_ATTR

    ref = copy.deepcopy(layer).float()
    for m in ref.modules():
        if getattr(m, "compute_dtype", None) is not None:
            m.compute_dtype = torch.float32
        if isinstance(getattr(m, CACHE_ATTR, None), torch.Tensor):
            setattr(m, CACHE_ATTR, getattr(m, CACHE_ATTR).float())
    return ref


def _forward_of(layer: nn.Module, *args, **kwargs):
    """One function for every layer (the layer an argument): dynamo then traces one graph that all
    decoder layers of a model share, instead of one per layer (each a recompile, and past
    torch._dynamo's cache limit of 8 the rest would silently run eager)."""
    return type(layer).forward(layer, *args, **kwargs)


def _input_needs_grad(args: tuple, kwargs: dict) -> bool:
    hidden = args[0] if args else kwargs.get("hidden_states")
    return isinstance(hidden, torch.Tensor) and hidden.requires_grad


def compile_layers(layers) -> None:
    """Route each layer's forward through the compiler while autograd records and its input needs a
    gradient; eager otherwise.

    The input condition leaves out the first decoder layer of a method that trains nothing below
    it (LoRA, adapters, BitFit over a frozen embedding). Its graph differs from the other layers'
    (no input gradient), so dynamo compiled it separately, twice over in the first step (a
    micro-batch of one row, unpadded and so without a mask, is a variant of its own): leaving it
    eager drops the first step's recompiles from 3 to 1, and the one left, the one-row graph, is
    compiled and checked by check() instead. Eager, that layer forgoes 1/L of the compiled step's
    gain for L layers, which adds up to the compile time saved only after many hundreds of steps
    (benchmarks/history/training-speed.md). A method that trains below the first layer (prompt
    tuning's soft prompt) gives it an input that needs a gradient, and it is compiled."""
    compiled = compile_fn(_forward_of)
    for layer in layers:
        eager = layer.forward

        def forward(*args, _layer=layer, _eager=eager, **kwargs):
            if torch.is_grad_enabled() and _input_needs_grad(args, kwargs):
                return compiled(_layer, *args, **kwargs)
            return _eager(*args, **kwargs)

        setattr(layer, ATTR, True)
        layer.forward = forward


def apply(model: nn.Module, batches: Sequence[dict], dtype: torch.dtype) -> CompileDecision:
    """kernels.compile=true: check the compiler on the last layer's copy, then compile every decoder layer."""
    try:
        layers = decoder_layers(model)
    except TunekitError as e:
        raise TunekitError(f"kernels.compile: {e}".replace("the adapter method needs", "compiling needs")) from e
    wrapped = [i for i, layer in enumerate(layers) if "forward" in vars(layer)]
    if wrapped:  # e.g. accelerate's offloading hooks: the compiled path calls the class's forward
        raise TunekitError(f"kernels.compile: decoder layer {wrapped[0]}'s forward is already replaced by "
                           f"something else (an offloading hook?); run with kernels.compile=false")
    # The last layer: its input requires grad, as every layer's but the first does in training
    result = check(model, layers[-1], batches, dtype)
    compile_layers(layers)
    near = result.get("fp32_distance")
    return CompileDecision(True, f"torch.compile (inductor) over {len(layers)} decoder layers' training forward "
                                 "(where their input needs a gradient); "
                                 f"the last checked against eager: {result['max_rel_diff']:.1e} of the largest "
                                 f"value at most ({result['worst']}, {result['worst_batch']})"
                                 + (f"; from the layer in fp32 compiled {near['compiled']:.1e}, "
                                    f"eager {near['eager']:.1e}" if near else "") + f", in {result['seconds']:.1f} s",
                           len(layers), result)
