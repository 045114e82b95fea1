"""What a LoftQ start (tunekit.methods.lora.loftq) leaves beside the adapter, and the merges it implies.

A LoRA started from LoftQ trains B A from its start B_T A_T over the base Q_T (W: (out, in),
A: (r, in), B: (out, r), s = alpha / r). The two merged exports (`tunekit export --merge-into`):

* dequantized, the model that trained: dequant(Q_T) + s B A. Q_T is quant(W) for iters = 1 (the base
  the loader builds anyway) and quant(W - s B_{T-1} A_{T-1}) for iters >= 2, rebuilt from W and the
  base factors: `merge_target_base`, or `rebuild_loftq_base` on a freshly loaded 4-bit model (which
  evaluating the run needs too) followed by the usual merge.
* original, W plus what training changed: W + s (B A - B_T A_T) = `original_target_base` + s B A.
  W + s B A would count the start s B_T A_T (about W - dequant(Q_T)) twice.

File LOFTQ_INIT_FILE in the adapter folder: for each layer that kept LoftQ (module names of the base
model), `<module>.A` (r, in) and `<module>.B` (out, r) in fp32 as written into the layer, and with
iters >= 2 `<module>.base_A` (r, in), `<module>.base_B` (out, r); metadata: format, iters, r, scaling
and the quantization settings (JSON). A layer missing from it kept the plain start (B = 0, base quant(W)).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Optional

import torch

from tunekit import TunekitError
from tunekit.methods.lora.loftq import (LayerInit, LoftqInit, LoraTarget, QuantSettings, nf4_roundtrip,
                                   read_original_weight, same_codes, settings_record, shifted, tensor_key,
                                   write_packed)

LOFTQ_INIT_FILE = "loftq_init.safetensors"
FORMAT = "tunekit-loftq-1"
_PARTS = ("A", "B", "base_A", "base_B")
INIT_ATTR = "_tunekit_loftq_init"  # on the PeftModel: the LoftqInit its layers started from
SUBTRACTED_ATTR = "_tunekit_loftq_subtracted"  # ... and, over original weights, that W - s B_T A_T is done


# ------------------------------------------------------------------ the LoRA method's hooks
def start_loftq(model: torch.nn.Module, model_dir: str | Path, iters: int, log: Optional[Callable[[str], None]] = None,
                compute_device: Optional[torch.device] = None):
    """method.init=loftq on a freshly applied 4-bit LoRA model (before training, before its compute
    path is chosen): apply_loftq over every LoRA layer (on compute_device where given, else where
    each layer sits), the start kept on the model for saving."""
    from tunekit.methods.lora.loftq import apply_loftq, lora_scaling, lora_targets

    targets = lora_targets(model)
    r = next(iter(targets.values())).lora_A.weight.shape[0]
    report = apply_loftq(model, model_dir, targets, r=r, scaling=lora_scaling(model), iters=iters,
                         device=compute_device)
    object.__setattr__(model, INIT_ATTR, report.init)  # not a submodule or buffer: never in a state dict
    if log is not None:
        log(f"method lora: {report.summary()} ({sum(lay.seconds for lay in report.layers):.1f} s)")
    return report


def save_attached(model: torch.nn.Module, folder: Path) -> None:
    """Beside a saved adapter: the LoftQ start the model carries (nothing for any other model)."""
    init = getattr(model, INIT_ATTR, None)
    if init is not None:
        save_loftq_init(folder, init)


def after_load(model: torch.nn.Module, folder: Path, log: Optional[Callable[[str], None]] = None) -> None:
    """After a LoftQ-started adapter (folder holds LOFTQ_INIT_FILE) is applied: the start goes on
    the model (so that saving it again writes the file), and each listed layer's base becomes what
    the adapter's A, B belong on:

    * a 4-bit base: Q_T, the base the run trained over (rebuilt for iters >= 2; quant(W) is already
      it for iters = 1). Done at most once: a base that holds Q_T already is left as it is;
    * a high-precision base (the original weights, for a merge into them): W - s B_T A_T, so that
      the merged W + s (B A - B_T A_T) counts the start once, not twice."""
    from tunekit.methods.lora.loftq import PEFT_PREFIX
    from tunekit.model.layers import is_4bit

    init = load_loftq_init(folder)
    if init is None:
        return
    from peft.tuners.lora import LoraLayer

    layers = {n.removeprefix(PEFT_PREFIX): m for n, m in model.named_modules()
              if isinstance(m, LoraLayer) and "default" in m.lora_A}
    missing = [name for name in init.layers if name not in layers]
    if missing:
        raise TunekitError(f"{Path(folder) / LOFTQ_INIT_FILE}: names {missing[0]!r}, which is not a LoRA layer of "
                           "this model")
    object.__setattr__(model, INIT_ATTR, init)
    quantized = {name: is_4bit(layers[name].get_base_layer()) for name in init.layers}
    if any(quantized.values()) and init.iters >= 2:
        from tunekit.methods.lora.loftq import LoraTarget

        targets = {name: LoraTarget(layers[name].lora_A["default"], layers[name].lora_B["default"],
                                    layers[name].get_base_layer()) for name in init.layers if quantized[name]}
        rebuild_loftq_base(_model_dir(model), targets, init, log)
    done = getattr(model, SUBTRACTED_ATTR, set())
    with torch.no_grad():
        for name, layer in init.layers.items():
            if quantized[name] or name in done:
                continue
            weight = layers[name].get_base_layer().weight
            weight.copy_(original_target_base(weight, layer, init.scaling).to(weight.dtype))
            done.add(name)
    object.__setattr__(model, SUBTRACTED_ATTR, done)


def _model_dir(model: torch.nn.Module) -> str:
    """The folder the (peft-wrapped) model's base was loaded from."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    path = getattr(base.config, "_name_or_path", "") or ""
    if not Path(path).is_dir():
        raise TunekitError(f"LoftQ: rebuilding the 4-bit base needs the folder the base was loaded from, and the "
                           f"model names {path!r}, not a folder")
    return path


def save_loftq_init(folder: str | Path, init: LoftqInit) -> Path:
    """Write `init` as folder/LOFTQ_INIT_FILE (the adapter folder); returns the path."""
    from safetensors.torch import save_file

    tensors = {}
    for name, layer in init.layers.items():
        for part in _PARTS:
            t = getattr(layer, part)
            if t is not None:
                tensors[f"{name}.{part}"] = t.detach().float().cpu().contiguous()
    meta = {"format": FORMAT, "iters": str(init.iters), "r": str(init.r), "scaling": repr(float(init.scaling)),
            "settings": json.dumps(init.settings, sort_keys=True)}
    path = Path(folder) / LOFTQ_INIT_FILE
    save_file(tensors, str(path), metadata=meta)
    return path


def saved_iters(folder: str | Path) -> Optional[int]:
    """The alternations of the LoftQ start saved in `folder` (its file's metadata alone), or None where
    there is none or it cannot be read (load_loftq_init then says why)."""
    from safetensors import SafetensorError, safe_open

    path = Path(folder) / LOFTQ_INIT_FILE
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            return int((f.metadata() or {})["iters"])
    except (SafetensorError, OSError, ValueError, KeyError):
        return None


def load_loftq_init(folder: str | Path) -> Optional[LoftqInit]:
    """The LoftqInit saved in `folder`; None when the folder has no LOFTQ_INIT_FILE (a plain start)."""
    from safetensors import SafetensorError, safe_open

    path = Path(folder) / LOFTQ_INIT_FILE
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        if meta.get("format") != FORMAT:
            raise ValueError(f"format {meta.get('format')!r}, expected {FORMAT!r}")
        init = LoftqInit(int(meta["iters"]), int(meta["r"]), float(meta["scaling"]), json.loads(meta["settings"]))
    except (SafetensorError, OSError, ValueError, KeyError) as e:
        first = (str(e).splitlines() or [""])[0][:120]
        raise TunekitError(f"{path}: not a LoftQ start file ({type(e).__name__}: {first})") from None
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        name, _, part = key.rpartition(".")
        if part not in _PARTS or not name:
            raise TunekitError(f"{path}: unexpected tensor {key!r}")
        parts.setdefault(name, {})[part] = t
    for name, p in parts.items():
        A, B = p.get("A"), p.get("B")
        ok = A is not None and B is not None and A.dim() == 2 and B.dim() == 2 and A.shape[0] == B.shape[1] == init.r
        ok = ok and ("base_A" in p) == ("base_B" in p) == (init.iters >= 2)
        ok = ok and all(p[k].shape == (A if k == "base_A" else B).shape for k in ("base_A", "base_B") if k in p)
        if not ok:
            raise TunekitError(f"{path}: the tensors of {name!r} do not form a rank-{init.r} LoftQ start "
                               f"(iters={init.iters}): {sorted((k, tuple(v.shape)) for k, v in p.items())}")
        init.layers[name] = LayerInit(A, B, p.get("base_A"), p.get("base_B"))
    return init


def settings_from_record(record: dict) -> QuantSettings:
    """QuantSettings from the strings `settings_record` wrote."""
    try:
        return QuantSettings(quant_type=record["quant_type"], double_quant=bool(record["double_quant"]),
                             blocksize=int(record["blocksize"]), dtype=getattr(torch, record["dtype"]),
                             quant_storage=getattr(torch, record["quant_storage"]))
    except (KeyError, AttributeError, TypeError, ValueError) as e:
        raise TunekitError(f"LoftQ: unreadable quantization settings {record!r} ({type(e).__name__})") from None


def merge_target_base(original_w: torch.Tensor, layer: Optional[LayerInit], scaling: float,
                      settings: QuantSettings) -> torch.Tensor:
    """fp32 (out, in): the base a LoftQ-started layer trained over, dequant(Q_T), rebuilt from the
    original W (out, in); merged = this + s B A is the trained layer's weight. layer None (a plain
    start) or without base factors (iters = 1): dequant(quant(W))."""
    base_A = None if layer is None else layer.base_A
    base_B = None if layer is None else layer.base_B
    w = original_w.to(torch.float32)
    _, deq = nf4_roundtrip(shifted(w, base_A, base_B, scaling, settings.dtype), settings)
    return deq.float()


def original_target_base(original_w: torch.Tensor, layer: Optional[LayerInit], scaling: float) -> torch.Tensor:
    """fp32 (out, in): W - s B_T A_T, so that this + s B A = W + what training changed (B A - B_T A_T)
    in a merge into the original weights. layer None (a plain start, B_T = 0): W."""
    w = original_w.to(torch.float32)
    if layer is None:
        return w.clone()
    return w - scaling * (layer.B.to(w.device, torch.float32) @ layer.A.to(w.device, torch.float32))


@torch.no_grad()
def rebuild_loftq_base(model_dir: str | Path, targets: dict[str, LoraTarget], init: LoftqInit,
                       log: Optional[Callable[[str], None]] = None) -> int:
    """Give a freshly loaded 4-bit LoRA model the base its run trained over: each layer with base
    factors (iters >= 2) gets Q_T = quant(W - s base_B base_A) in place of quant(W), W read from
    `model_dir` one tensor at a time. The adapter's own A, B come from loading the adapter as usual.
    Returns the number of layers rebuilt."""
    missing = [name for name in init.layers if name not in targets]
    if missing:
        raise TunekitError(f"LoftQ: the start file names {missing[0]!r}, which is not a LoRA layer of this model")
    rebuilt = 0
    for name, layer in init.layers.items():
        if layer.base_A is None:
            continue
        base = targets[name].base
        settings = QuantSettings.of_layer(base)
        # The dtype may differ (an export computes in fp32 what trained in bf16): W - s B A is rounded to
        # the run's dtype as it was when the run started, then quantized in the layer's. Values a bf16
        # tensor holds quantize to the same codes and absmax from fp32; only the dequantized dtype differs.
        run = settings_from_record(init.settings) if init.settings else settings
        mine, theirs = settings_record(settings), settings_record(run)
        if {k: v for k, v in mine.items() if k != "dtype"} != {k: v for k, v in theirs.items() if k != "dtype"}:
            raise TunekitError(f"LoftQ: {name} is loaded with quantization {mine}, the run started from {theirs}; "
                               "load the base as the run did")
        rebuilt += _rebuild_one(Path(model_dir), name, layer, init.scaling, base, settings, run.dtype)
    if log is not None:
        log(f"LoftQ: rebuilt the 4-bit base of {rebuilt} layer(s) (iters={init.iters})")
    return rebuilt


def _rebuild_one(model_dir: Path, name: str, layer: LayerInit, scaling: float, base, settings: QuantSettings,
                 run_dtype: torch.dtype) -> int:
    """1 where the layer's codes were quant(W) and are now Q_T; 0 where they were Q_T already (a
    resumed run rebuilds its base before loading its checkpoint, which would rebuild it again)."""
    w = read_original_weight(model_dir, tensor_key(name)).to(base.weight.device, torch.float32)
    packed, _ = nf4_roundtrip(shifted(w, layer.base_A, layer.base_B, scaling, run_dtype), settings)
    if same_codes(packed, base.weight):
        return 0
    plain, _ = nf4_roundtrip(w, settings)
    if not same_codes(plain, base.weight):
        raise TunekitError(f"LoftQ: {tensor_key(name)} in {model_dir} does not quantize to the loaded layer's codes: "
                           "not the folder the model was loaded from, or the layer was changed since")
    write_packed(base, packed)
    return 1
