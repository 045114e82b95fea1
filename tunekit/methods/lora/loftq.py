"""LoftQ: a quantization-aware LoRA start for QLoRA (Li et al. 2023, "LoftQ: LoRA-Fine-Tuning-Aware
Quantization for Large Language Models", arXiv:2310.08659).

QLoRA trains s B A over a frozen quant(W) (s = the LoRA scaling, alpha / r); with the standard start
B = 0 the model starts from dequant(quant(W)), and NF4 loses much of a small model. LoftQ chooses the
4-bit base Q and the LoRA start together so that dequant(Q) + s B A is closer to W, alternating T
times from B_0 A_0 = 0:

    Q_t = quant(W - s B_{t-1} A_{t-1})
    B_t, A_t = rank-r SVD fit of (W - dequant(Q_t)) / s:  U S V^T -> B = U_r sqrt(S_r), A = sqrt(S_r) V_r^T

Shapes: W, Q: (out, in); A: (r, in); B: (out, r). The layer starts from Q_T, A_T, B_T. With T = 1
the base stays quant(W), exactly what the loader built, and only the LoRA start changes. With
T >= 2 the base is requantized against B_{T-1} A_{T-1} (the "base factors"), which whatever rebuilds
the base later (evaluating or exporting the run) must know; `save_loftq_init` writes them, and the
LoRA start, beside the adapter.

Unlike peft's `loftq_init`, which needs the whole model in full precision, the original weights are
read one tensor at a time from the model folder's safetensors: peak memory is the 4-bit model plus
one layer in fp32 (and its SVD). Quantization mirrors the loaded layer exactly (blocksize, NF4,
double quantization, the dtype it was quantized from, quant_storage), so a packed weight written
here is what bitsandbytes would have built from the same W'. What a run must keep to rebuild
its base and merge exactly (`loftq_init.safetensors`, the merge targets) is in tunekit.methods.lora.loftq_io.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, NamedTuple, Optional

import torch
import torch.nn as nn

from tunekit import TunekitError

_log = logging.getLogger("tunekit")

PEFT_PREFIX = "base_model.model."  # peft's path to the wrapped transformers model


@dataclass(frozen=True)
class QuantSettings:
    """How a Linear4bit weight is quantized. `dtype`: the dtype W is cast to before quantizing (the
    model's dtype at load, which is also the compute dtype); dequantize returns it."""

    quant_type: str = "nf4"
    double_quant: bool = True
    blocksize: int = 64
    dtype: torch.dtype = torch.bfloat16
    quant_storage: torch.dtype = torch.uint8

    @classmethod
    def from_loader(cls, dtype: torch.dtype, quant_storage: Optional[torch.dtype] = None) -> "QuantSettings":
        """The settings tunekit.model.loader's BitsAndBytesConfig gives a model loaded in `dtype`.
        transformers passes no blocksize to Linear4bit, so the block is bitsandbytes' default."""
        import bitsandbytes as bnb

        from tunekit.model.loader import load_kwargs

        q = load_kwargs("nf4", dtype, torch.device("cpu"), quant_storage)["quantization_config"]
        return cls(quant_type=q.bnb_4bit_quant_type, double_quant=bool(q.bnb_4bit_use_double_quant),
                   blocksize=bnb.nn.Params4bit(torch.empty(0)).blocksize, dtype=dtype,
                   quant_storage=q.bnb_4bit_quant_storage)

    @classmethod
    def of_layer(cls, layer: nn.Module) -> "QuantSettings":
        """The settings a loaded bitsandbytes Linear4bit was quantized with (its QuantState)."""
        weight = layer.weight
        state = getattr(weight, "quant_state", None)
        if state is None:
            raise TunekitError(f"LoftQ: {type(layer).__name__} is not a 4-bit layer (no quant_state); LoftQ starts QLoRA only")
        if getattr(state, "packing_format_for_cpu", False):
            raise TunekitError("LoftQ: a 4-bit layer was repacked into bitsandbytes' CPU inference layout; load the "
                               "base with tunekit.model.load_base_model, which prevents this")
        return cls(quant_type=state.quant_type, double_quant=bool(state.nested), blocksize=state.blocksize,
                   dtype=state.dtype, quant_storage=weight.data.dtype)


def nf4_roundtrip(w: torch.Tensor, settings: QuantSettings = QuantSettings()):
    """(packed, dequantized) of w (out, in): packed is a quantized bitsandbytes Params4bit (codes +
    quant_state) equal to what Linear4bit builds from w; dequantized (out, in) in settings.dtype is
    what that layer's forward multiplies by."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnbf

    x = w.detach().to(settings.dtype).contiguous()
    data, state = bnbf.quantize_4bit(x, blocksize=settings.blocksize, compress_statistics=settings.double_quant,
                                     quant_type=settings.quant_type, quant_storage=settings.quant_storage)
    packed = bnb.nn.Params4bit(data, requires_grad=False, quant_state=state, blocksize=settings.blocksize,
                               compress_statistics=settings.double_quant, quant_type=settings.quant_type,
                               quant_storage=settings.quant_storage, bnb_quantized=True)
    return packed, bnbf.dequantize_4bit(data, state)


def same_codes(a, b) -> bool:
    """Whether two packed 4-bit weights are bit-for-bit the same: codes and every quant_state tensor
    (absmax, code table, second-level absmax and its table, and the packed shape/dtype/offset)."""
    sa, sb = a.quant_state.as_dict(packed=True), b.quant_state.as_dict(packed=True)
    # bytes, not values: codes stored as a float dtype (FSDP) may spell NaN, which never equals itself
    codes_a, codes_b = (t.data.contiguous().view(torch.uint8).cpu() for t in (a, b))
    return (a.data.dtype == b.data.dtype and torch.equal(codes_a, codes_b) and sa.keys() == sb.keys()
            and all(torch.equal(sa[k].cpu(), sb[k].cpu()) for k in sa))


def low_rank_fit(residual: torch.Tensor, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B (out, r), A (r, in)): the best rank-r approximation B A of residual (out, in) in Frobenius
    norm (Eckart-Young), sqrt of the singular values on each side, as peft's LoftQ splits them."""
    u, s, vh = torch.linalg.svd(residual, full_matrices=False)
    root = s[:r].sqrt()
    return (u[:, :r] * root).contiguous(), (root[:, None] * vh[:r]).contiguous()


def shifted(w: torch.Tensor, base_A: Optional[torch.Tensor], base_B: Optional[torch.Tensor], scaling: float,
            dtype: torch.dtype) -> torch.Tensor:
    """W - s B A (out, in) in `dtype`: what is quantized. Computed in fp64, where every product of two
    fp32 numbers is exact and the r-term sums round at ~1e-16, then rounded to fp32 and to `dtype`
    (the same two steps on every device): rebuilding the base elsewhere (another machine, CPU vs
    GPU, another BLAS) quantizes the same input unless a value falls within ~1e-16 of a rounding
    boundary, where fp32 arithmetic would differ at 1e-7."""
    if base_A is None:
        return w.to(torch.float32).to(dtype)
    dev = w.device
    delta = base_B.to(dev, torch.float64) @ base_A.to(dev, torch.float64)
    # in place: two fp64 (out, in) tensors at a time, not four; -(s d) + w is w - s d bit for bit
    delta.mul_(-scaling).add_(w.to(torch.float64))
    return delta.to(torch.float32).to(dtype)


@dataclass
class LoftqResult:
    """One layer's LoftQ start. A (r, in), B (out, r) fp32 (None for iters=0); packed: the 4-bit
    base Q_T; plain: quant(W), the loader's base; base_A/base_B: the factors Q_T was quantized against
    (None for iters <= 1). err_*: Frobenius norms of W - dequant(quant(W)) and W - dequant(Q_T) - s B A."""

    A: Optional[torch.Tensor]
    B: Optional[torch.Tensor]
    packed: object
    plain: object
    err_plain: float
    err_loftq: float
    iters: int
    base_A: Optional[torch.Tensor] = None
    base_B: Optional[torch.Tensor] = None


def _check_args(w: torch.Tensor, r: int, scaling: float, iters: int) -> None:
    if w.dim() != 2:
        raise TunekitError(f"LoftQ: a weight must be 2-D (out, in), got shape {tuple(w.shape)}")
    if isinstance(r, bool) or not isinstance(r, int) or not 1 <= r <= min(w.shape):
        raise TunekitError(f"LoftQ: rank r={r!r} must be an integer in 1..{min(w.shape)} for a weight of shape {tuple(w.shape)}")
    if not (isinstance(scaling, (int, float)) and 0 < scaling < float("inf")):
        raise TunekitError(f"LoftQ: the LoRA scaling must be a positive finite number, got {scaling!r}")
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 0:
        raise TunekitError(f"LoftQ: iters must be an integer >= 0, got {iters!r}")


def loftq_iterates(w: torch.Tensor, r: int, scaling: float, settings: QuantSettings = QuantSettings(),
                   device=None) -> Iterator[LoftqResult]:
    """LoftqResult for T = 1, 2, ... in turn (each T's start, computed in fp32 on `device`)."""
    _check_args(w, r, scaling, 1)
    W = w.detach().to(device if device is not None else w.device, torch.float32)
    plain, deq = nf4_roundtrip(W, settings)
    err_plain = torch.linalg.vector_norm(W - deq.float()).item()
    packed, prev_A, prev_B, t = plain, None, None, 0
    while True:
        t += 1
        if t > 1:  # Q_t = quant(W - s B_{t-1} A_{t-1})
            packed, deq = nf4_roundtrip(shifted(W, prev_A, prev_B, scaling, settings.dtype), settings)
        B, A = low_rank_fit((W - deq.float()) / scaling, r)
        err = torch.linalg.vector_norm(W - deq.float() - scaling * (B @ A)).item()
        yield LoftqResult(A, B, packed, plain, err_plain, err, t, prev_A, prev_B)
        prev_A, prev_B = A, B
        del deq


def loftq_layer(w: torch.Tensor, r: int, scaling: float, iters: int, settings: QuantSettings = QuantSettings(),
                device=None) -> LoftqResult:
    """LoftQ start of one weight w (out, in) after `iters` alternations (0: the plain start)."""
    _check_args(w, r, scaling, iters)
    if iters == 0:
        W = w.detach().to(device if device is not None else w.device, torch.float32)
        plain, deq = nf4_roundtrip(W, settings)
        err = torch.linalg.vector_norm(W - deq.float()).item()
        return LoftqResult(None, None, plain, plain, err, err, 0)
    for result in loftq_iterates(w, r, scaling, settings, device):
        if result.iters == iters:
            return result


def keeps_loftq(result: LoftqResult) -> bool:
    """Per layer: start from LoftQ only where it moved base + adapter closer to W than quant(W) alone;
    otherwise the caller keeps quant(W) and the standard LoRA init (B = 0)."""
    return result.iters > 0 and result.A is not None and result.err_loftq < result.err_plain


# ------------------------------------------------------------------ original weights, one at a time

def tensor_key(module_name: str) -> str:
    """safetensors key of a Linear's weight from its module name in a loaded transformers model (or
    in the peft model wrapping it): model.layers.0.self_attn.q_proj -> model.layers.0.self_attn.q_proj.weight."""
    return module_name.removeprefix(PEFT_PREFIX) + ".weight"


def _weight_file(folder: Path, key: str) -> tuple[Path, str] | None:
    from safetensors import safe_open

    index, single = folder / "model.safetensors.index.json", folder / "model.safetensors"
    # a checkpoint saved from the bare decoder (AutoModel) has its keys without the head model's prefix
    candidates = [key] + ([key.split(".", 1)[1]] if "." in key else [])
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise TunekitError(f"{index}: not a safetensors index (JSON with a weight_map): {type(e).__name__}") from None
        return next(((folder / weight_map[k], k) for k in candidates if k in weight_map), None)
    if single.is_file():
        with safe_open(str(single), framework="pt", device="cpu") as f:
            keys = set(f.keys())
        return next(((single, k) for k in candidates if k in keys), None)
    raise TunekitError(f"LoftQ: {folder} holds no model.safetensors or model.safetensors.index.json; LoftQ reads the "
                       "original weights one tensor at a time from safetensors files")


def read_original_weight(model_dir: str | Path, tensor_name: str) -> torch.Tensor:
    """One tensor of the model folder, as stored (CPU), reading nothing else: safe_open maps the file
    and get_tensor copies that tensor's bytes only. Single or sharded safetensors."""
    from safetensors import safe_open

    folder = Path(model_dir)
    found = _weight_file(folder, tensor_name)
    if found is None:
        raise TunekitError(f"LoftQ: no tensor {tensor_name!r} in the safetensors files of {folder}; LoftQ needs the "
                           "original weight of every LoRA target (is this the folder the model was loaded from?)")
    path, key = found
    if not path.is_file():
        raise TunekitError(f"LoftQ: {path} is missing, named for {key!r} by the index of {folder}")
    with safe_open(str(path), framework="pt", device="cpu") as f:
        return f.get_tensor(key)


# ------------------------------------------------------------------ over a LoRA model

class LoraTarget(NamedTuple):
    lora_A: nn.Module  # nn.Linear, weight (r, in)
    lora_B: nn.Module  # nn.Linear, weight (out, r)
    base: nn.Module  # bitsandbytes Linear4bit, weight (out, in) packed


def lora_targets(model: nn.Module, adapter: str = "default") -> dict[str, LoraTarget]:
    """{module name in the base model: LoraTarget} for every peft LoRA layer over a 4-bit Linear."""
    from peft.tuners.lora import LoraLayer

    out = {}
    for name, m in model.named_modules():
        if isinstance(m, LoraLayer) and adapter in m.lora_A and hasattr(m.get_base_layer().weight, "quant_state"):
            out[name.removeprefix(PEFT_PREFIX)] = LoraTarget(m.lora_A[adapter], m.lora_B[adapter], m.get_base_layer())
    if not out:
        raise TunekitError(f"LoftQ: the model has no LoRA layer (adapter {adapter!r}) over a 4-bit base layer")
    return out


def lora_scaling(model: nn.Module, adapter: str = "default") -> float:
    """The one scaling (alpha / r) of the model's LoRA layers; LoftQ fits (W - dequant Q) / s."""
    from peft.tuners.lora import LoraLayer

    values = {m.scaling[adapter] for m in model.modules() if isinstance(m, LoraLayer) and adapter in m.scaling}
    if len(values) != 1:
        raise TunekitError(f"LoftQ: expected one LoRA scaling across layers, got {sorted(values)}")
    return float(values.pop())


def write_packed(base: nn.Module, packed) -> None:
    """Make a Linear4bit's weight `packed` (codes + quant_state). Copied into the layer's own tensors
    where the layouts agree (they do for settings read off the layer): the Parameter and QuantState
    objects stay, so anything holding them (the module's own quant_state, an optimizer, FSDP) sees
    the new weight; a layer whose layout differs gets the new tensors instead."""
    weight, old, new = base.weight, base.weight.quant_state, packed.quant_state
    fits = (weight.data.shape == packed.data.shape and weight.data.dtype == packed.data.dtype
            and (old.quant_type, old.blocksize, old.dtype, bool(old.nested))
            == (new.quant_type, new.blocksize, new.dtype, bool(new.nested))
            and old.absmax.shape == new.absmax.shape and torch.equal(old.code, new.code.to(old.code.device))
            and (not old.nested or (old.state2.absmax.shape == new.state2.absmax.shape
                                    and torch.equal(old.state2.code, new.state2.code.to(old.state2.code.device)))))
    with torch.no_grad():
        if fits:
            weight.data.copy_(packed.data)
            old.absmax.copy_(new.absmax)
            if old.nested:
                old.offset.copy_(new.offset)
                old.state2.absmax.copy_(new.state2.absmax)
            return
        weight.data = packed.data.to(weight.device)
    new.to(weight.device)
    weight.quant_state = new
    base.quant_state = new


@dataclass
class LayerInit:
    """What a LoftQ start leaves that a later rebuild or merge needs: the LoRA start A (r, in),
    B (out, r) as written into the layer, and the base factors (None for iters=1)."""

    A: torch.Tensor
    B: torch.Tensor
    base_A: Optional[torch.Tensor] = None
    base_B: Optional[torch.Tensor] = None


@dataclass
class LoftqInit:
    iters: int
    r: int
    scaling: float
    settings: dict  # QuantSettings of the layers, as strings (recorded; checked on rebuild)
    layers: dict[str, LayerInit] = field(default_factory=dict)  # only the layers that kept LoftQ


@dataclass
class LayerReport:
    name: str
    err_plain: float
    err_loftq: float
    kept: bool
    seconds: float


@dataclass
class LoftqReport:
    layers: list[LayerReport]
    init: LoftqInit

    @property
    def kept(self) -> int:
        return sum(lay.kept for lay in self.layers)

    def summary(self) -> str:
        reduction = [1 - lay.err_loftq / lay.err_plain for lay in self.layers if lay.err_plain > 0]
        mean = 100 * sum(reduction) / max(1, len(reduction))
        return (f"LoftQ (iters={self.init.iters}, r={self.init.r}): kept in {self.kept}/{len(self.layers)} layers; "
                f"||W - base - s B A|| {mean:.1f}% below ||W - quant(W)|| on average")


def settings_record(settings: QuantSettings) -> dict:
    return {"quant_type": settings.quant_type, "double_quant": settings.double_quant, "blocksize": settings.blocksize,
            "dtype": str(settings.dtype).removeprefix("torch."),
            "quant_storage": str(settings.quant_storage).removeprefix("torch.")}


def _loftq_one(model_dir: Path, name: str, target: LoraTarget, r: int, scaling: float,
               iters: int, device: Optional[torch.device] = None) -> tuple[LoftqResult, QuantSettings]:
    """Read one weight, compute its start (on `device`, else where the layer sits); the
    full-precision tensors die on return.

    Computed elsewhere than where the base was quantized (FSDP: the base quantized in host memory,
    the start on rank 0's GPU), the first quantization must give the loaded layer's codes, as it
    does on the same device; bitsandbytes' CPU and CUDA NF4 quantizers are meant to agree code for
    code, and where they do not, this layer is computed again where the layer sits (one warning
    line), never started from codes the base does not hold."""
    lora_A, lora_B, base = target
    settings = QuantSettings.of_layer(base)
    if lora_A.weight.shape[0] != r:
        raise TunekitError(f"LoftQ: {name}: lora_A has {lora_A.weight.shape[0]} rows, expected r={r}")
    if bool(lora_B.weight.any()):
        raise TunekitError(f"LoftQ: {name}: lora_B is not zero; LoftQ starts a fresh LoRA, before training or loading")
    w = read_original_weight(model_dir, tensor_key(name))
    if tuple(w.shape) != tuple(base.weight.quant_state.shape):
        raise TunekitError(f"LoftQ: {tensor_key(name)} in {model_dir} has shape {tuple(w.shape)}, the loaded layer "
                           f"{tuple(base.weight.quant_state.shape)}")
    here = base.weight.device
    result = loftq_layer(w, r, scaling, iters, settings, device=device or here)
    if device is not None and torch.device(device) != here and not same_codes(result.plain, base.weight):
        _log.warning("LoftQ: %s: %s quantizes it to other NF4 codes than the base's (quantized on %s): "
                     "this layer's start is computed on %s instead", tensor_key(name), device, here, here)
        result = loftq_layer(w, r, scaling, iters, settings, device=here)
    if not same_codes(result.plain, base.weight):
        raise TunekitError(f"LoftQ: {tensor_key(name)} in {model_dir} does not quantize to the loaded layer's codes: "
                           "not the folder the model was loaded from, or the layer was changed since")
    return result, settings


def _return_freed_memory() -> None:
    """Hand the pages of the layer just done back to the OS (glibc's malloc_trim; elsewhere nothing).
    A layer's temporaries below glibc's mmap threshold (32 MiB at most) are carved from the heap,
    where the long-lived tensors of the model and the LoRA sit between them: freed, they would stay
    resident, growing with every layer."""
    global _TRIM
    if _TRIM is None:
        try:
            import ctypes

            _TRIM = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _TRIM = False
    if _TRIM:
        _TRIM(0)


_TRIM = None


@torch.no_grad()
def apply_loftq(model: nn.Module, model_dir: str | Path, targets: Optional[dict[str, LoraTarget]] = None, *,
                r: int, scaling: float, iters: int, log: Optional[Callable[[str], None]] = None,
                device: Optional[torch.device] = None) -> LoftqReport:
    """Start the LoRA layers of a freshly built 4-bit LoRA model from LoftQ, one layer at a time.

    targets: {module name: (lora_A, lora_B, base Linear4bit)}, default `lora_targets(model)`.
    Where `keeps_loftq`, the base's packed weight becomes Q_T and lora_A / lora_B take A_T / B_T
    (cast to their dtype); elsewhere the layer is left as built. Returns per-layer errors and the
    LoftqInit to save with `save_loftq_init`.
    """
    targets = lora_targets(model) if targets is None else targets
    folder = Path(model_dir)
    layers, record, base_factors = [], None, {}
    for name, target in targets.items():
        start = time.perf_counter()
        result, settings = _loftq_one(folder, name, target, r, scaling, iters, device)
        record = record or settings_record(settings)
        kept = keeps_loftq(result)
        errs = (result.err_plain, result.err_loftq)
        if kept:
            if result.packed is not result.plain:
                write_packed(target.base, result.packed)
            target.lora_A.weight.copy_(result.A.to(target.lora_A.weight.dtype))
            target.lora_B.weight.copy_(result.B.to(target.lora_B.weight.dtype))
            if result.base_A is not None:
                base_factors[name] = (result.base_A.cpu(), result.base_B.cpu())
        del result
        _return_freed_memory()
        layers.append(LayerReport(name, *errs, kept, time.perf_counter() - start))
        if log is not None:
            lay = layers[-1]
            log(f"LoftQ {name}: ||W - Q - sBA|| {lay.err_loftq:.4g} vs plain {lay.err_plain:.4g}: "
                f"{'LoftQ' if kept else 'plain start'}")
    init = {lay.name: LayerInit(targets[lay.name].lora_A.weight.detach().float().cpu().clone(),
                                targets[lay.name].lora_B.weight.detach().float().cpu().clone(),
                                *base_factors.get(lay.name, (None, None)))
            for lay in layers if lay.kept}
    report = LoftqReport(layers, LoftqInit(iters, r, float(scaling), record or {}, init))
    if log is not None:
        log(report.summary())
    return report

