"""Open what a user trained: a run, an adapter or a model folder, or a GGUF file, as one `Source`.

A source is one of:

    RUN/ (config.yaml + adapter/)      the run's exact setup: its base (path, 4-bit or not, compute dtype,
                                       QLoRA preparation), its method, its adapter
    RUN/adapter, RUN/best/adapter,     that run's setup with this adapter folder
    RUN/checkpoints/step-N/adapter
    an adapter folder elsewhere        peft LoRA or prompt tuning (adapter_config.json "peft_type"), tunekit
                                       bottleneck adapters or BitFit ("method"), over --model, else the base its
                                       config names, else the default model; --quantize nf4 for a 4-bit base
    a model folder (config.json)       a merged export, a full fine-tune, any causal LM, loaded as it is
    a .gguf file                       scored by llama.cpp on the CPU (tunekit.infer.gguf; `tunekit eval`
                                       only); its tokenizer is the one inside the file, unless --model names
                                       a folder with the model's tokenizer or one sits beside the file

`open_source` checks the path and reads configs only (a run's config.yaml strictly: one that does
not parse into tunekit's schema is one error line); tunekit.runs.load builds the models, on the
source's device: the command's --device, by default the first GPU, else the CPU. The compute
dtype is decided from that device's facts, as training decides it (bf16 where native, else fp32).
Every problem is one line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from tunekit import TunekitError
from tunekit.config import TrainConfig
from tunekit.device import facts as dev
from tunekit.device.facts import DeviceFacts
from tunekit.model.start_adapter import StartAdapter

# adapter_config.json "peft_type" (peft) or "method" (tunekit) -> tunekit method name
GGUF_MAGIC = b"GGUF"


@dataclass
class Run:
    """A training run's folder and its resolved config (config.yaml, typed)."""

    run_dir: Path
    cfg: TrainConfig

    @property
    def adapter_dir(self) -> Path:
        """Where the finished run saved its trained part (method.save() output + tokenizer)."""
        return self.run_dir / "adapter"


@dataclass
class Source:
    path: Path
    kind: str  # run | adapter | model | gguf
    method: Optional[str]  # lora | prompt_tuning | adapter | bitfit | full; None for a model folder or GGUF
    base_path: str  # the base model folder (a model folder is its own base)
    quantize: str  # none | nf4
    dtype: torch.dtype  # the compute dtype of the base on `facts`' device
    run: Optional[Run] = None  # kind "run": the run it belongs to
    adapter_dir: Optional[Path] = None  # the trained part's folder (kind run or adapter)
    adapter_cfg: dict = field(default_factory=dict)  # a standalone adapter folder's adapter_config.json
    base_override: Optional[str] = None  # --base-model: the untuned base of a model folder or GGUF file
    tokenizer_dir: Optional[str] = None  # a GGUF's tokenizer folder (--model, or beside it); None: the GGUF's own
    facts: DeviceFacts = field(default_factory=lambda: dev.probe(torch.device("cpu")))  # where it loads
    # what the user typed to name base_path, for errors about that folder (a misfit model given as
    # --model must not be blamed on a config key the user never wrote)
    base_key: str = "model.path"
    # a run trained over a frozen start adapter (model.adapter): loaded under the run's adapter
    start: Optional[StartAdapter] = None

    @property
    def device(self) -> torch.device:
        return self.facts.device

    @property
    def method_impl(self):
        """The tunekit Method that applies, loads, merges and saves this source's trained part."""
        from tunekit.methods import get_method

        return get_method(self.method)

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


def load_run_config(path: Path) -> TrainConfig:
    """A run's saved config.yaml, merged into the schema (enums and defaults come back typed)."""
    from omegaconf import OmegaConf

    from tunekit.config import RETIRED_KEYS
    from tunekit.methods import train_schema

    saved = OmegaConf.load(path)
    for group, key in RETIRED_KEYS:
        if isinstance(saved.get(group), dict) or OmegaConf.is_dict(saved.get(group)):
            saved[group].pop(key, None)
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(train_schema()), saved))


def read_run_config(cfg_path: Path) -> TrainConfig:
    """A run's config.yaml, typed; one line naming the file for anything else. OmegaConf parses with
    a safe YAML loader, so a Python tag (`!!python/object/...`) runs nothing: it is a YAMLError,
    refused here like any text that is not a tunekit config (binary bytes too)."""
    import yaml
    from omegaconf.errors import OmegaConfBaseException

    try:
        # Merge into the schema so enum values and defaults come back typed, as in training.
        return load_run_config(cfg_path)
    except (OmegaConfBaseException, ValueError, yaml.YAMLError) as e:  # UnicodeDecodeError is a ValueError
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TunekitError(f"{cfg_path}: not a tunekit config ({first[:200]})") from None
    except OSError as e:
        raise TunekitError(f"{cfg_path}: cannot read ({e.strerror})") from None


def adapter_kind(cfg: dict, folder: Path, what: str) -> str:
    """The tunekit method that wrote (or reads) a standalone adapter folder, from its adapter_config.json:
    each method names the kinds it reads (tunekit.methods.adapter_kinds)."""
    from tunekit.methods.registry import adapter_kinds

    kinds = adapter_kinds()
    kind = cfg.get("peft_type") or cfg.get("method")
    if kind not in kinds:
        raise TunekitError(f"{what}: {folder} holds a {kind} adapter; tunekit loads {', '.join(kinds)}")
    return kinds[kind]


def _read_json(path: Path) -> dict:
    """A JSON object file; one line naming it for anything else."""
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


def _holds_trained_part(folder: Path) -> bool:
    """method.save() finished there: an adapter's adapter_model.safetensors, or for a full fine-tune
    a whole model folder (config.json + its safetensors)."""
    return (folder / "adapter_model.safetensors").is_file() or (
        (folder / "config.json").is_file() and any(folder.glob("*.safetensors")))


def _open_run(run_dir: Path, adapter: Optional[Path], what: str) -> Run:
    """RUN_DIR's config.yaml, once the run's trained part is known to be there: its adapter/, or
    `adapter` (a folder of the run chosen instead, e.g. a checkpoint's: then the run need not have
    finished, as a killed run has only its checkpoints)."""
    if adapter is not None:
        if not _holds_trained_part(adapter):
            raise TunekitError(f"{what}: {adapter} has no adapter_model.safetensors (a checkpoint cut short?)")
    elif not _holds_trained_part(run_dir / "adapter"):
        ckpts = sorted(p.name for p in (run_dir / "checkpoints").glob("step-*")) if (run_dir / "checkpoints").is_dir() else []
        hint = f"; checkpoints there: {', '.join(ckpts)} (resume the run to finish it)" if ckpts else ""
        raise TunekitError(f"{what}: {run_dir} has no finished adapter (adapter/adapter_model.safetensors){hint}")
    return Run(run_dir, read_run_config(run_dir / "config.yaml"))


def _start_of(run: Run) -> Optional[StartAdapter]:
    """The frozen start adapter a run trained over (model.adapter), as it was: the file whose sha256 the
    run recorded at its start (tunekit.train.resume.DATA_FINGERPRINT); one line where it is gone or changed."""
    from tunekit.model.start_adapter import open_start
    from tunekit.train.resume import DATA_FINGERPRINT

    if run.cfg.model.adapter is None:
        return None
    key = f"{run.run_dir / 'config.yaml'}: model.adapter"
    start = open_start(run.cfg.model.adapter, key=key)
    record = run.run_dir / DATA_FINGERPRINT
    want = _read_json(record).get("model.adapter:sha256") if record.is_file() else None
    if want is None:
        raise TunekitError(f"{key}: {run.run_dir} does not record which content of {start.folder} it trained over "
                           f"({record}); the run and its start adapter cannot be matched")
    if want != start.sha256:
        raise TunekitError(f"{key}: {start.folder / 'adapter_model.safetensors'} changed since the run {run.run_dir} "
                           "trained over it (its sha256 differs from the one recorded at the start of training); "
                           "restore that adapter to use this run")
    return start


def trained_base(cfg: TrainConfig, run_dir: Path) -> str:
    """The base a run trained over: model.path, or for a distillation that cut its student from the
    teacher (distill.student_keep_every), the student it wrote to RUN/student_base (tunekit.train.build)."""
    from tunekit.config import STUDENT_DIR, plain
    from tunekit.model import resolve_model_path

    if plain(cfg.objective) == "distill" and cfg.distill.student_keep_every:
        student = Path(run_dir) / STUDENT_DIR
        if not (student / "config.json").is_file():
            raise TunekitError(f"{run_dir}: a distillation run whose student base ({student}) is not there; it is "
                               "written before training starts, so this run never started or the folder was moved")
        return str(student)
    return resolve_model_path(cfg.model.path)


def open_source(path: str | Path, model: Optional[str] = None, quantize: Optional[str] = None, dtype: str = "auto",
                base_model: Optional[str] = None, what: str = "RUN", facts: Optional[DeviceFacts] = None,
                runs_only: bool = False) -> Source:
    """Recognise `path` (see the module docstring). model/quantize/dtype choose the base of a
    standalone adapter folder; base_model names the untuned base of a model folder (for --base);
    facts: the device it will load on (tunekit.device.facts.command_facts; default the CPU).
    runs_only: `path` must be a run folder itself (what `tunekit export` takes)."""
    from tunekit.model import resolve_model_path

    facts = facts or dev.probe(torch.device("cpu"))
    if quantize not in (None, "none", "nf4"):
        raise TunekitError(f"--quantize: unknown {quantize!r}; choose none or nf4")
    p = Path(path).expanduser()
    if not p.exists():
        gguf = p.suffix.lower() == ".gguf" and not runs_only
        raise TunekitError(f"{what}: no such {'file' if gguf else 'folder'}: {path}")
    if runs_only and not (p / "config.yaml").is_file():
        raise TunekitError(f"{what}: {p} is not a tunekit run (no config.yaml; pass the output_dir of `tunekit train`)")
    if p.is_file() and p.suffix.lower() == ".gguf":
        return _open_gguf(p, model, quantize, dtype, base_model, what, facts)
    if not p.is_dir():
        raise TunekitError(f"{what}: {path} is a file; give a run folder, an adapter folder or a model folder "
                           "(tunekit eval also takes a .gguf file)")
    run_dir = p if (p / "config.yaml").is_file() else (_enclosing_run(p) if (p / "adapter_config.json").is_file()
                                                       or (p / "config.json").is_file() else None)
    if run_dir is not None:
        chosen = None if p.resolve() == run_dir.resolve() else p
        run = _open_run(run_dir, chosen, what)
        from tunekit.config import plain

        base = trained_base(run.cfg, run_dir)
        run_quantize = plain(run.cfg.model.quantize)
        if model is not None and resolve_model_path(model, key="--model") != base:
            raise TunekitError(f"--model: {run_dir} trained over {base}; drop --model for a run")
        if quantize is not None and quantize != run_quantize:
            raise TunekitError(f"--quantize: {run_dir} trained over a {run_quantize} base; drop --quantize for a run")
        # the compute dtype: the run's model.dtype decided for this device, as training decides it
        return Source(p, "run", run.cfg.method.name, base, run_quantize,
                      dev.compute_dtype(plain(run.cfg.model.dtype), facts), run=run,
                      adapter_dir=chosen or run.adapter_dir, base_override=base_model, facts=facts,
                      start=_start_of(run))
    dt = dev.compute_dtype(dtype, facts)
    if (p / "adapter_config.json").is_file():
        cfg = _read_json(p / "adapter_config.json")
        method = adapter_kind(cfg, p, what)
        if (p / "start_adapter.json").is_file():  # tunekit.methods.lora.stacked.RECORD
            raise TunekitError(f"{what}: {p} was trained over a frozen start adapter (model.adapter; see "
                               f"{p / 'start_adapter.json'}), so it is not the trained model alone; open its run "
                               "folder, or use the run's merged export")
        if not (p / "adapter_model.safetensors").is_file():
            raise TunekitError(f"{what}: {p} has no adapter_model.safetensors")
        from tunekit.model.folder import _safetensors_header

        # a truncated or damaged weights file is named here, before any model loads (peft and the
        # soft-prompt reader would fail mid-load with safetensors' own error)
        _safetensors_header(p / "adapter_model.safetensors", what)
        named = cfg.get("base_model_name_or_path")
        base = resolve_model_path(model, key="--model") if model is not None else resolve_model_path(
            named, key=f"{p / 'adapter_config.json'}: base_model_name_or_path (pass --model)")
        return Source(p, "adapter", method, base, quantize or "none", dt, adapter_dir=p, adapter_cfg=cfg,
                      base_override=base_model, facts=facts,
                      base_key="--model" if model is not None else f"{p / 'adapter_config.json'}: base_model_name_or_path")
    if (p / "config.json").is_file():
        if model is not None:
            raise TunekitError(f"--model: {p} is a model folder already; use --base-model to name its base")
        return Source(p, "model", None, str(p), quantize or "none", dt, base_override=base_model, facts=facts,
                      base_key=what)
    raise TunekitError(f"{what}: {p} is neither a tunekit run (config.yaml), an adapter folder "
                       "(adapter_config.json) nor a model folder (config.json)")


def base_source(model: Optional[str], quantize: Optional[str], dtype: str, facts: Optional[DeviceFacts] = None) -> Source:
    """A plain base model (--model, or the default) as a source, for rows with no adapter."""
    from tunekit.model import resolve_model_path

    path = resolve_model_path(model, key="--model")
    facts = facts or dev.probe(torch.device("cpu"))
    return Source(Path(path), "model", None, path, quantize or "none", dev.compute_dtype(dtype, facts), facts=facts,
                  base_key="--model")


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
