"""Open what a user trained, for generation, chat and evaluation: a run, an adapter or a model folder
(and, for evaluation, a GGUF file).

A source is one of:

    RUN/ (config.yaml + adapter/)      the run's exact setup: its base (path, 4-bit or not, compute dtype,
                                       QLoRA preparation), its method, its adapter (tunekit.runs.run)
    RUN/adapter, RUN/best/adapter,     that run's setup with this adapter folder
    RUN/checkpoints/step-N/adapter
    an adapter folder elsewhere        peft LoRA or prompt tuning (adapter_config.json "peft_type"), tunekit
                                       bottleneck adapters or BitFit ("method"), over --model, else the base its
                                       config names, else the default model; --quantize nf4 for a 4-bit base
    a model folder (config.json)       a merged export, a full fine-tune, any causal LM, loaded as it is
    a .gguf file                       scored by llama.cpp on the CPU (tunekit.infer.gguf; `tunekit eval`
                                       only); its tokenizer is the one inside the file, unless --model names
                                       a folder with the model's tokenizer or one sits beside the file

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
from tunekit.speed import device as dev
from tunekit.speed.device import DeviceFacts
# adapter_config.json "peft_type" (peft) or "method" (tunekit) -> tunekit method name
ADAPTER_KINDS = {"LORA": "lora", "PROMPT_TUNING": "prompt_tuning", "TUNEKIT_BOTTLENECK_ADAPTER": "adapter",
                 "TUNEKIT_BITFIT": "bitfit"}


@dataclass
class Source:
    path: Path
    kind: str  # run | adapter | model | gguf
    method: Optional[str]  # lora | prompt_tuning | adapter | bitfit | full; None for a model folder
    base_path: str  # the base model folder (a model folder is its own base)
    quantize: str  # none | nf4
    dtype: torch.dtype
    run: object = None  # tunekit.runs.run.Run for kind "run"
    adapter_dir: Optional[Path] = None
    adapter_cfg: dict = field(default_factory=dict)
    base_override: Optional[str] = None  # --base-model: the untuned base of a model folder or GGUF file
    tokenizer_dir: Optional[str] = None  # a GGUF's tokenizer folder (--model, or beside it); None: the GGUF's own
    facts: DeviceFacts = field(default_factory=lambda: dev.probe(torch.device("cpu")))  # where it loads
    # what the user typed to name base_path, for errors about that folder (a misfit model given as
    # --model must not be blamed on a config key the user never wrote)
    base_key: str = "model.path"

    @property
    def device(self) -> torch.device:
        return self.facts.device

    def describe(self) -> str:
        if self.kind == "gguf":
            tok = f"tokenizer from {self.tokenizer_dir}" if self.tokenizer_dir else "its own tokenizer"
            base = f"; --base-model {self.base_override} on {self.facts.describe()}" if self.base_override else ""
            return f"{self.path}: GGUF file ({tok}), scored by llama.cpp on the CPU{base}"
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
    except (OSError, ValueError) as e:  # ValueError: JSONDecodeError, and UnicodeDecodeError of binary bytes
        raise TunekitError(f"{path}: not readable JSON ({type(e).__name__}: {str(e).splitlines()[0][:120]})") from None
    if not isinstance(data, dict):
        raise TunekitError(f"{path}: expected a JSON object")
    return data


def _enclosing_run(path: Path) -> Optional[Path]:
    """The run folder an adapter folder lives in (RUN/adapter, RUN/x/adapter, RUN/checkpoints/step-N/adapter).
    A killed run has no adapter/ yet, only checkpoints: its checkpoint adapters are still its own."""
    for parent in list(path.resolve().parents)[:3]:
        if (parent / "config.yaml").is_file() and ((parent / "adapter").exists()
                                                   or (parent / "checkpoints") in path.resolve().parents):
            return parent
    return None


def _open_run(run_dir: Path, facts: DeviceFacts, adapter: Optional[Path] = None):
    """tunekit.runs.run.open_run, plus full fine-tunes: their adapter/ is a whole model folder
    (config.json + model.safetensors), which open_run's check for adapter_model.safetensors refuses.
    `adapter`: a folder of the run other than its adapter/ (a checkpoint's)."""
    from tunekit.runs.run import Run, open_run, read_run_config

    folder = adapter or run_dir / "adapter"
    try:
        return open_run(run_dir, facts, adapter)
    except TunekitError:
        if not ((folder / "config.json").is_file() and any(folder.glob("*.safetensors"))):
            raise
    from tunekit.config import plain
    from tunekit.model import resolve_model_path

    cfg = read_run_config(run_dir / "config.yaml")
    return Run(run_dir, cfg, resolve_model_path(cfg.model.path), plain(cfg.model.quantize),
               dev.compute_dtype(plain(cfg.model.dtype), facts), facts.device)


def open_source(path: str | Path, model: Optional[str] = None, quantize: Optional[str] = None, dtype: str = "auto",
                base_model: Optional[str] = None, what: str = "RUN", facts: Optional[DeviceFacts] = None) -> Source:
    """Recognise `path` (see the module docstring). model/quantize/dtype choose the base of a
    standalone adapter folder; base_model names the untuned base of a model folder (for --base);
    facts: the device it will load on (tunekit.speed.device.command_facts; default the CPU)."""
    from tunekit.model import resolve_model_path

    facts = facts or dev.probe(torch.device("cpu"))

    if quantize not in (None, "none", "nf4"):
        raise TunekitError(f"--quantize: unknown {quantize!r}; choose none or nf4")
    p = Path(path).expanduser()
    if not p.exists():
        raise TunekitError(f"{what}: no such {'file' if p.suffix.lower() == '.gguf' else 'folder'}: {path}")
    if p.is_file() and p.suffix.lower() == ".gguf":
        return _open_gguf(p, model, quantize, dtype, base_model, what, facts)
    if not p.is_dir():
        raise TunekitError(f"{what}: {path} is a file; give a run folder, an adapter folder or a model folder "
                           "(tunekit eval also takes a .gguf file)")
    run_dir = p if (p / "config.yaml").is_file() else (_enclosing_run(p) if (p / "adapter_config.json").is_file()
                                                       or (p / "config.json").is_file() else None)
    if run_dir is not None:
        run = _open_run(run_dir, facts, None if p.resolve() == run_dir.resolve() else p)
        if model is not None and resolve_model_path(model, key="--model") != run.model_path:
            raise TunekitError(f"--model: {run_dir} trained over {run.model_path}; drop --model for a run")
        if quantize is not None and quantize != run.quantize:
            raise TunekitError(f"--quantize: {run_dir} trained over a {run.quantize} base; drop --quantize for a run")
        adapter = p if p.resolve() != run_dir.resolve() else run.adapter_dir
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
        from tunekit.model.folder import _safetensors_header

        # a truncated or damaged weights file is named here, before any model loads (peft and the
        # soft-prompt reader would fail mid-load with safetensors' own error)
        _safetensors_header(p / "adapter_model.safetensors", what)
        named = cfg.get("base_model_name_or_path")
        base = resolve_model_path(model, key="--model") if model is not None else resolve_model_path(
            named, key=f"{p / 'adapter_config.json'}: base_model_name_or_path (pass --model)")
        return Source(p, "adapter", ADAPTER_KINDS[kind], base, quantize or "none", dt, adapter_dir=p, adapter_cfg=cfg,
                      base_override=base_model, facts=facts,
                      base_key="--model" if model is not None else f"{p / 'adapter_config.json'}: base_model_name_or_path")
    if (p / "config.json").is_file():
        if model is not None:
            raise TunekitError(f"--model: {p} is a model folder already; use --base-model to name its base")
        return Source(p, "model", None, str(p), quantize or "none", dt, base_override=base_model, facts=facts,
                      base_key=what)
    raise TunekitError(f"{what}: {p} is neither a tunekit run (config.yaml), an adapter folder "
                       "(adapter_config.json) nor a model folder (config.json)")


GGUF_MAGIC = b"GGUF"


def is_gguf_file(path: str | Path) -> bool:
    """`path` names an existing .gguf file (what open_source takes as a GGUF source)."""
    p = Path(path).expanduser()
    return p.suffix.lower() == ".gguf" and p.is_file()


def _open_gguf(p: Path, model: Optional[str], quantize: Optional[str], dtype: str, base_model: Optional[str],
               what: str, facts: DeviceFacts) -> Source:
    """A GGUF file: the magic checked here (the model is loaded by llama.cpp when scored); the
    tokenizer folder chosen: --model, else a tokenizer saved beside the file, else the file's own."""
    from tunekit.infer.llamacpp import unavailable
    from tunekit.model import resolve_model_path

    try:
        with open(p, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise TunekitError(f"{what}: cannot read {p} ({e.strerror})") from None
    if magic != GGUF_MAGIC:
        raise TunekitError(f"{what}: {p} is not a GGUF file (it does not start with the GGUF magic bytes)")
    if quantize is not None:
        raise TunekitError(f"--quantize: {p} is a GGUF file, scored as its tensors are stored; drop --quantize")
    why = unavailable()
    if why:
        raise TunekitError(f"{what}: {p} is scored by llama.cpp, and {why}; bash scripts/setup.sh builds it")
    tok_dir = None
    if model is not None:
        tok_dir = resolve_model_path(model, key="--model")
    elif any((p.parent / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        tok_dir = str(p.parent)
    return Source(p, "gguf", None, str(p), "none", dev.compute_dtype(dtype, facts), base_override=base_model,
                  tokenizer_dir=tok_dir, facts=facts)


def load_gguf_tokenizer(path: Path):
    """The tokenizer stored in a GGUF file, as transformers reads it (vocabulary, merges, special
    ids, chat template)."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as e:  # gguf's reader and transformers' converter raise their own types for a bad file
        raise TunekitError(f"{path}: transformers cannot read the tokenizer in this GGUF file "
                           f"({type(e).__name__}: {str(e).splitlines()[0][:160]}); pass --model DIR naming "
                           "a folder with the model's tokenizer") from None
    if tok.eos_token_id is None:
        raise TunekitError(f"{path}: the tokenizer in this GGUF file has no EOS token; pass --model DIR")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token  # as tunekit.model.load_tokenizer: padding is masked by length
    return tok


def _not_torch(src: Source):
    return TunekitError(f"{src.path}: a GGUF file runs in llama.cpp, which only `tunekit eval` drives; "
                        "generate and chat take a run, an adapter folder or a model folder")


def _plain_base(path: str, quantize: str, dtype: torch.dtype, device: torch.device, key: str) -> nn.Module:
    from tunekit.model import load_base_model, prepare_for_training

    model = load_base_model(path, quantize, dtype, device, key=key)
    prepare_for_training(model, quantize, gradient_checkpointing=False)  # the trainer's own base preparation
    return model.eval()


def load_base(src: Source) -> nn.Module:
    """The untuned base the source trained over, prepared as the trainer prepares it."""
    if src.base_override is not None:
        from tunekit.model import resolve_model_path

        return _plain_base(resolve_model_path(src.base_override, key="--base-model"), src.quantize, src.dtype, src.device,
                           "--base-model")
    if src.kind == "run":
        from tunekit.runs.run import load_base as run_base

        return run_base(src.run)
    if src.kind == "model":
        raise TunekitError(f"--base: the base of the model folder {src.path} is unknown; name it with --base-model DIR")
    if src.kind == "gguf":
        raise TunekitError(f"--base: the base of the GGUF file {src.path} is unknown; name its untuned Hugging Face "
                           "model folder with --base-model DIR")
    return _plain_base(src.base_path, src.quantize, src.dtype, src.device, src.base_key)


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
    if src.kind == "gguf":
        raise _not_torch(src)
    if src.kind == "run":
        from tunekit.runs.run import trained_model

        return trained_model(src.run, src.adapter_dir)
    if src.kind == "model":
        from tunekit.model import load_base_model

        return load_base_model(str(src.path), src.quantize, src.dtype, src.device, key=src.base_key).eval()
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
        from tunekit.runs.run import run_tokenizer

        return run_tokenizer(src.run, src.adapter_dir)
    if src.kind == "gguf":
        return load_tokenizer(src.tokenizer_dir) if src.tokenizer_dir else load_gguf_tokenizer(src.path)
    folder = src.adapter_dir if src.kind == "adapter" else src.path
    has_tok = any((Path(folder) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))
    return load_tokenizer(str(folder), key=src.base_key if src.kind == "model" else str(folder)) if has_tok else \
        load_tokenizer(src.base_path, key=src.base_key)


def base_source(model: Optional[str], quantize: Optional[str], dtype: str, facts: Optional[DeviceFacts] = None) -> Source:
    """A plain base model (--model, or the default) as a source, for rows with no adapter."""
    from tunekit.model import resolve_model_path

    path = resolve_model_path(model, key="--model")
    facts = facts or dev.probe(torch.device("cpu"))
    return Source(Path(path), "model", None, path, quantize or "none", dev.compute_dtype(dtype, facts), facts=facts,
                  base_key="--model")


def trained_part_bytes(src: Source) -> int:
    """Memory of what is loaded on top of the base: the adapter's tensors, at most fp32 (its files
    hold them in their stored dtype). A full fine-tune and a model folder replace the base's own
    weights instead: nothing on top."""
    if src.kind in ("model", "gguf") or src.method == "full" or src.adapter_dir is None:
        return 0
    stored = sum(f.stat().st_size for f in Path(src.adapter_dir).glob("*.safetensors"))
    return 2 * stored  # bf16 files loaded as fp32 masters at worst


def check_memory(src: Source, work, what: str, hint: str = "") -> str:
    """The planner's check that `src` and `work` (tunekit.plan.inference.Workload) fit on the
    source's device, before anything loads: a line for the log, or a TunekitError naming the
    largest terms and what to change. A model the planner cannot read (not a Llama-style
    config.json) is not checked.

    A GGUF file is not checked: llama.cpp maps it (its pages are the file's, shared and evictable)
    and its scoring cache is sized to one batch. With --base, what loads on the device is the
    untuned Hugging Face base (--base-model): that is checked."""
    from tunekit.plan.inference import check_fits, inference_memory
    from tunekit.plan.shape import model_shape

    if src.kind == "gguf":
        if src.base_override is None:
            return (f"memory: not checked for a GGUF file ({src.path.stat().st_size / 2**20:.0f} MiB, mapped by "
                    "llama.cpp on the CPU)")
        from dataclasses import replace

        from tunekit.model import resolve_model_path

        src = replace(src, kind="model", base_path=resolve_model_path(src.base_override, key="--base-model"))
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
