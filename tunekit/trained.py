"""Open what a user trained, for generation, chat and evaluation: a run, an adapter or a model folder.

A source is one of:

    RUN/ (config.yaml + adapter/)      the run's exact setup: its base (path, 4-bit or not, compute dtype,
                                       QLoRA preparation), its method, its adapter (tunekit.export.run)
    RUN/adapter, RUN/best/adapter,     that run's setup with this adapter folder
    RUN/checkpoints/step-N/adapter
    an adapter folder elsewhere        peft LoRA or prompt tuning (adapter_config.json "peft_type"), tunekit
                                       bottleneck adapters or BitFit ("method"), over --model, else the base its
                                       config names, else the default model; --quantize nf4 for a 4-bit base
    a model folder (config.json)       a merged export, a full fine-tune, any causal LM, loaded as it is

`open_source` checks the path and reads configs only; `load_trained` / `load_base` build models
(fresh every call, in eval mode, frozen) on the source's device: the command's --device, by
default the first GPU, else the CPU. The compute dtype is decided from that device's facts, as
training decides it (bf16 where native, else fp32). `check_memory` is the planner's check that
the model and the command's work fit there, before anything loads. Every problem is one line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn

from tunekit import TunekitError
from tunekit import device as dev
from tunekit.device import DeviceFacts
# adapter_config.json "peft_type" (peft) or "method" (tunekit) -> tunekit method name
ADAPTER_KINDS = {"LORA": "lora", "PROMPT_TUNING": "prompt_tuning", "TUNEKIT_BOTTLENECK_ADAPTER": "adapter",
                 "TUNEKIT_BITFIT": "bitfit"}


@dataclass
class Source:
    path: Path
    kind: str  # run | adapter | model
    method: Optional[str]  # lora | prompt_tuning | adapter | bitfit | full; None for a model folder
    base_path: str  # the base model folder (a model folder is its own base)
    quantize: str  # none | nf4
    dtype: torch.dtype
    run: object = None  # tunekit.export.run.Run for kind "run"
    adapter_dir: Optional[Path] = None
    adapter_cfg: dict = field(default_factory=dict)
    base_override: Optional[str] = None  # --base-model: the untuned base of a model folder
    facts: DeviceFacts = field(default_factory=lambda: dev.probe(torch.device("cpu")))  # where it loads

    @property
    def device(self) -> torch.device:
        return self.facts.device

    def describe(self) -> str:
        if self.kind == "run":
            what = f"run ({self.run.cfg.recipe}: {self.method})"
        else:
            what = f"{self.method} adapter" if self.kind == "adapter" else "model folder"
        base = "" if self.kind == "model" else f" over {self.base_path} ({'4-bit NF4' if self.quantize == 'nf4' else self.dtype})"
        return f"{self.path}: {what}{base}, on {self.facts.describe()}"

    @property
    def same_base_key(self) -> tuple:
        return (self.base_path, self.quantize, self.dtype)


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise TunekitError(f"{path}: not readable JSON ({type(e).__name__}: {str(e).splitlines()[0][:120]})") from None
    if not isinstance(data, dict):
        raise TunekitError(f"{path}: expected a JSON object")
    return data


def _enclosing_run(path: Path) -> Optional[Path]:
    """The run folder an adapter folder lives in (RUN/adapter, RUN/x/adapter, RUN/checkpoints/step-N/adapter)."""
    for parent in list(path.parents)[:3]:
        if (parent / "config.yaml").is_file() and (parent / "adapter").exists():
            return parent
    return None


def _open_run(run_dir: Path, facts: DeviceFacts):
    """tunekit.export.run.open_run, plus full fine-tunes: their adapter/ is a whole model folder
    (config.json + model.safetensors), which open_run's check for adapter_model.safetensors refuses."""
    from tunekit.export.run import Run, open_run

    try:
        return open_run(run_dir, facts)
    except TunekitError:
        if not ((run_dir / "adapter" / "config.json").is_file() and any((run_dir / "adapter").glob("*.safetensors"))):
            raise
    from tunekit.config import load_run_config, plain
    from tunekit.model import resolve_model_path

    cfg = load_run_config(run_dir / "config.yaml")
    return Run(run_dir, cfg, resolve_model_path(cfg.model.path), plain(cfg.model.quantize),
               dev.compute_dtype(plain(cfg.model.dtype), facts), facts.device)


def open_source(path: str | Path, model: Optional[str] = None, quantize: Optional[str] = None, dtype: str = "auto",
                base_model: Optional[str] = None, what: str = "RUN", facts: Optional[DeviceFacts] = None) -> Source:
    """Recognise `path` (see the module docstring). model/quantize/dtype choose the base of a
    standalone adapter folder; base_model names the untuned base of a model folder (for --base);
    facts: the device it will load on (tunekit.device.command_facts; default the CPU)."""
    from tunekit.model import resolve_model_path

    facts = facts or dev.probe(torch.device("cpu"))

    if quantize not in (None, "none", "nf4"):
        raise TunekitError(f"--quantize: unknown {quantize!r}; choose none or nf4")
    p = Path(path).expanduser()
    if not p.exists():
        raise TunekitError(f"{what}: no such folder: {path}")
    if not p.is_dir():
        raise TunekitError(f"{what}: {path} is a file; give a run folder, an adapter folder or a model folder")
    run_dir = p if (p / "config.yaml").is_file() else (_enclosing_run(p) if (p / "adapter_config.json").is_file()
                                                       or (p / "config.json").is_file() else None)
    if run_dir is not None:
        run = _open_run(run_dir, facts)
        if model is not None and resolve_model_path(model, key="--model") != run.model_path:
            raise TunekitError(f"--model: {run_dir} trained over {run.model_path}; drop --model for a run")
        if quantize is not None and quantize != run.quantize:
            raise TunekitError(f"--quantize: {run_dir} trained over a {run.quantize} base; drop --quantize for a run")
        adapter = p if p != run_dir else run.adapter_dir
        return Source(p, "run", run.cfg.method.name, run.model_path, run.quantize, run.dtype, run=run,
                      adapter_dir=adapter, base_override=base_model, facts=facts)
    dt = dev.compute_dtype(dtype, facts)
    if (p / "adapter_config.json").is_file():
        cfg = _read_json(p / "adapter_config.json")
        kind = cfg.get("peft_type") or cfg.get("method")
        if kind not in ADAPTER_KINDS:
            raise TunekitError(f"{what}: {p} holds a {kind} adapter; tunekit loads {', '.join(ADAPTER_KINDS)}")
        if not (p / "adapter_model.safetensors").is_file():
            raise TunekitError(f"{what}: {p} has no adapter_model.safetensors")
        named = cfg.get("base_model_name_or_path")
        base = resolve_model_path(model, key="--model") if model is not None else resolve_model_path(
            named, key=f"{p / 'adapter_config.json'}: base_model_name_or_path (pass --model)")
        return Source(p, "adapter", ADAPTER_KINDS[kind], base, quantize or "none", dt, adapter_dir=p, adapter_cfg=cfg,
                      base_override=base_model, facts=facts)
    if (p / "config.json").is_file():
        if model is not None:
            raise TunekitError(f"--model: {p} is a model folder already; use --base-model to name its base")
        return Source(p, "model", None, str(p), quantize or "none", dt, base_override=base_model, facts=facts)
    raise TunekitError(f"{what}: {p} is neither a tunekit run (config.yaml), an adapter folder "
                       "(adapter_config.json) nor a model folder (config.json)")


def _plain_base(path: str, quantize: str, dtype: torch.dtype, device: torch.device) -> nn.Module:
    from tunekit.model import load_base_model, prepare_for_training

    model = load_base_model(path, quantize, dtype, device)
    prepare_for_training(model, quantize, gradient_checkpointing=False)  # the trainer's own base preparation
    return model.eval()


def load_base(src: Source) -> nn.Module:
    """The untuned base the source trained over, prepared as the trainer prepares it."""
    if src.base_override is not None:
        from tunekit.model import resolve_model_path

        return _plain_base(resolve_model_path(src.base_override, key="--base-model"), src.quantize, src.dtype, src.device)
    if src.kind == "run":
        from tunekit.export.run import load_base as run_base

        return run_base(src.run)
    if src.kind == "model":
        raise TunekitError(f"--base: the base of the model folder {src.path} is unknown; name it with --base-model DIR")
    return _plain_base(src.base_path, src.quantize, src.dtype, src.device)


def _method_cfg(src: Source):
    """The MethodConfig that rebuilds a standalone tunekit adapter folder's structure."""
    from tunekit.config import MethodConfig

    c = src.adapter_cfg
    if src.method == "prompt_tuning":
        return MethodConfig(name="prompt_tuning", num_virtual_tokens=int(c["num_virtual_tokens"]))
    if src.method == "adapter":
        return MethodConfig(name="adapter", bottleneck=int(c["bottleneck"]), activation=c["activation"],
                            sublayers=list(c["targets"]))
    return MethodConfig(name="bitfit", target_modules=list(c["targets"]))


def load_trained(src: Source) -> nn.Module:
    """Base + trained part, exactly as trained; frozen, eval mode."""
    if src.kind == "run":
        from tunekit.export.run import trained_model

        return trained_model(src.run, src.adapter_dir)
    if src.kind == "model":
        from tunekit.model import load_base_model

        return load_base_model(str(src.path), src.quantize, src.dtype, src.device).eval()
    base = load_base(src)
    if src.method == "lora":  # any peft LoRA folder (tunekit's, TRL's, ...) with peft's own loader
        from peft import PeftModel

        try:
            model = PeftModel.from_pretrained(base, str(src.adapter_dir))
        except (ValueError, KeyError, RuntimeError) as e:
            raise TunekitError(f"{src.path}: this LoRA adapter does not fit {src.base_path} "
                               f"({str(e).splitlines()[0][:160]})") from None
    else:
        from tunekit.methods import get_method

        method = get_method(src.method)
        try:
            model = method.apply(base, _method_cfg(src))
        except KeyError as e:
            raise TunekitError(f"{src.path}/adapter_config.json: missing key {e}") from None
        method.load(model, src.adapter_dir)
    model.requires_grad_(False)
    return model.eval()


def load_tokenizer_for(src: Source):
    """The tokenizer saved beside the adapter/model (it carries the chat template trained with),
    else the base's."""
    from tunekit.model import load_tokenizer

    if src.kind == "run":
        from tunekit.export.run import run_tokenizer

        return run_tokenizer(src.run)
    folder = src.adapter_dir if src.kind == "adapter" else src.path
    has_tok = any((Path(folder) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))
    return load_tokenizer(str(folder) if has_tok else src.base_path)


def base_source(model: Optional[str], quantize: Optional[str], dtype: str, facts: Optional[DeviceFacts] = None) -> Source:
    """A plain base model (--model, or the default) as a source, for rows with no adapter."""
    from tunekit.model import resolve_model_path

    path = resolve_model_path(model, key="--model")
    facts = facts or dev.probe(torch.device("cpu"))
    return Source(Path(path), "model", None, path, quantize or "none", dev.compute_dtype(dtype, facts), facts=facts)


def trained_part_bytes(src: Source) -> int:
    """Memory of what is loaded on top of the base: the adapter's tensors, at most fp32 (its files
    hold them in their stored dtype). A full fine-tune and a model folder replace the base's own
    weights instead: nothing on top."""
    if src.kind == "model" or src.method == "full" or src.adapter_dir is None:
        return 0
    stored = sum(f.stat().st_size for f in Path(src.adapter_dir).glob("*.safetensors"))
    return 2 * stored  # bf16 files loaded as fp32 masters at worst


def check_memory(src: Source, work, what: str, hint: str = "") -> str:
    """The planner's check that `src` and `work` (tunekit.plan.inference.Workload) fit on the
    source's device, before anything loads: a line for the log, or a TunekitError naming the
    largest terms and what to change. A model the planner cannot read (not a Llama-style
    config.json) is not checked."""
    from tunekit.plan.inference import check_fits, inference_memory
    from tunekit.plan.shape import model_shape

    try:
        shape = model_shape(src.base_path, None, key=str(src.base_path))
    except TunekitError as e:
        return f"memory: not checked ({e})"
    quantize = src.quantize
    if src.kind == "model" and quantize == "none":
        config = Path(src.base_path) / "config.json"
        if config.is_file() and "quantization_config" in _read_json(config):
            quantize = "nf4"  # a re-quantized export loads as 4-bit whatever --quantize says
    e = torch.empty((), dtype=src.dtype).element_size()
    terms = inference_memory(shape, quantize, e, work, trained_part_bytes(src))
    return check_fits(terms, src.facts, dev.available_memory_bytes(src.device), what, hint)
