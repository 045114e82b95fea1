"""Structured configs: the schema Hydra validates every recipe and command-line override against.

Hydra composes recipes/ (train.yaml + the groups model/, data/, trainer/, tracker/, recipe/) on
top of `TrainConfig`, so an unknown key or a value of the wrong type is rejected before anything
runs. Checks that need more than a type (files that must exist, positive sizes) live in
`validate()`. Only the recipe and the builders read this object; layers take plain arguments.
"""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Optional

from hydra.core.config_store import ConfigStore

from tunekit import TunekitError
from tunekit.checks import number, one_of, path_fits


class Optimizer(str, Enum):
    adamw = "adamw"
    adamw_8bit = "adamw_8bit"
    paged_adamw_8bit = "paged_adamw_8bit"
    paged_adamw_32bit = "paged_adamw_32bit"


class Quantize(str, Enum):
    none = "none"
    nf4 = "nf4"  # 4-bit NormalFloat with double quantization (QLoRA)


class DType(str, Enum):
    auto = "auto"  # bf16 where the device computes it natively, fp16 + loss scaling on sm_70/sm_75, else fp32
    bf16 = "bf16"
    fp16 = "fp16"  # with dynamic loss scaling (tunekit.train.loss_scale)
    fp32 = "fp32"


class FusedMode(str, Enum):
    auto = "auto"  # fused Triton LoRA kernels where they run natively (CUDA + triton)
    on = "on"
    off = "off"


class Strategy(str, Enum):
    ddp = "ddp"  # every rank holds the whole model; the trained part's gradients are summed (default)
    fsdp = "fsdp"  # FSDP2: base and trained part sharded over the ranks (bases larger than one device)


class DataFormat(str, Enum):
    auto = "auto"  # detected from the columns: messages -> chat, conversations -> sharegpt,
    #                prompt + completion -> prompt_completion, instruction -> alpaca, text -> text
    alpaca = "alpaca"
    chat = "chat"
    sharegpt = "sharegpt"
    prompt_completion = "prompt_completion"
    text = "text"


@dataclass
class ModelConfig:
    # A local Hugging Face model folder or a hub id; null = the embedded SmolLM2-135M-Instruct.
    path: Optional[str] = None
    quantize: Quantize = Quantize.none
    dtype: DType = DType.auto
    # true | false | auto: off when the plan says the step fits without it (a third less compute)
    gradient_checkpointing: Any = False
    # true | false | auto: with gradient checkpointing, keep each block's saved input in pinned host
    # memory instead of on the GPU (auto: on CUDA with checkpointing on; nothing to offload on a CPU)
    offload_activations: Any = "auto"
    # `tunekit plan` only: the config.json of a common size (llama-3-8b, llama-3-70b, ...), no weights
    preset: Optional[str] = None


@dataclass
class DataConfig:
    # .jsonl/.json/.csv/.parquet file; null = the embedded default dataset.
    path: Optional[str] = None
    # Held-out file; null = the default data's val split, or val_fraction of path.
    val_path: Optional[str] = None
    val_fraction: float = 0.05
    format: DataFormat = DataFormat.auto
    max_seq_len: int = 512
    max_val_examples: Optional[int] = 256  # >= 1; null = the whole held-out split
    # Concatenate each micro-batch into one row with per-example positions and attention
    # (no padding). Same examples and same loss as unpacked; faster on short examples.
    packing: bool = False


def _method_config() -> type:
    """The method.* schema: `name` and the keys of every registered method (tunekit.methods), each
    declared once, by the method that reads it (its `config` dataclass, with its defaults and
    comments). A key several methods read with different defaults (target_modules) defaults to
    null here: the chosen method's default, filled in by `validate`. Method modules import no
    torch, so building this costs what reading their dataclasses costs."""
    from tunekit.methods import config_schema

    return config_schema()


MethodConfig = _method_config()


@dataclass
class TrainerConfig:
    max_steps: int = 60
    # a positive int, or auto: the largest power of two up to 64 that the plan fits in free memory
    micro_batch_size: Any = 8
    grad_accum: int = 2
    optimizer: Optimizer = Optimizer.adamw
    lr: float = 2e-4
    weight_decay: float = 0.0
    warmup_steps: int = 5  # linear warmup, then cosine decay; >= max_steps means warmup only
    max_grad_norm: float = 1.0  # > 0; .inf turns clipping off (the norm is still logged)
    eval_every: int = 20
    save_every: int = 20
    keep_checkpoints: int = 2
    resume: bool = False
    # A fresh run wants an empty or new output_dir; true lets it write beside files already there
    # (which it leaves alone: tunekit deletes only what it can show it wrote).
    allow_nonempty_output_dir: bool = False
    # refuse, before loading, a run whose planned peak exceeds the device's free memory
    memory_check: bool = True
    # At every evaluation (rank 0; tunekit.train.task_eval): eval_samples held-out prompts answered
    # greedily beside their reference, printed and logged (metrics.jsonl, W&B table); 0: off.
    eval_samples: int = 3
    # Also measure the task metric on the first eval_task_rows held-out rows: exact match of greedy
    # answers, and accuracy by likelihood when the answers form a small closed set (classification).
    eval_task: bool = False
    eval_task_rows: int = 64
    # Greedy budget of those answers (never more than the longest reference + 4 tokens).
    eval_max_new_tokens: int = 48
    # Keep the adapter of the best evaluation in output_dir/best/ and export it as adapter/ at the
    # end (the last state stays in checkpoints/). best_metric: val_loss | val_accuracy |
    # val_exact_match | auto (the task metric when eval_task measures one, else val_loss).
    keep_best: bool = False
    best_metric: str = "auto"
    # How several processes share the work (accelerate launch --num_processes N). ddp: every rank
    # holds the whole model (default). fsdp: FSDP2 shards the frozen base, the trained part, its
    # gradients and optimizer state over the ranks, per decoder layer (tunekit.train.fsdp): for bases
    # larger than one device. With one process fsdp trains as a plain single process.
    strategy: Strategy = Strategy.ddp
    # Seconds a rank waits in a collective before the run fails (several processes only). auto:
    # 30 minutes plus what rank 0 may spend alone writing and reading back the largest checkpoint
    # the plan predicts (tunekit.device.facts.dist_timeout_s); NCCL's own default is 10 minutes.
    dist_timeout_s: Any = "auto"


class Divergence(str, Enum):
    forward_kl = "forward_kl"  # KL(teacher || student): mode covering (Hinton et al. 2015)
    reverse_kl = "reverse_kl"  # KL(student || teacher): mode seeking
    jsd = "jsd"  # generalized Jensen-Shannon with weight beta (Agarwal et al. 2024)


@dataclass
class DistillConfig:
    """Used when objective=distill: alpha * CE(labels) + (1 - alpha) * T^2 * D(teacher || student)."""

    # A local HF folder or hub id; null = the embedded SmolLM2-135M-Instruct.
    teacher: Optional[str] = None
    teacher_quantize: Quantize = Quantize.none
    alpha: float = 0.5
    temperature: float = 2.0
    divergence: Divergence = Divergence.forward_kl
    beta: float = 0.5  # only for divergence=jsd
    # Trained tokens per chunk of the loss: the (tokens, vocab) logits of both models never
    # exist at once (49k vocab: 1024 tokens = 200 MB fp32 per model).
    chunk_size: int = 1024
    # > 0: build the student from the teacher by keeping every k-th decoder layer (DistilBERT);
    # saved as a plain HF model in output_dir/student_base and used instead of model.path.
    student_keep_every: int = 0


@dataclass
class KernelsConfig:
    # tunekit's Triton LoRA-over-NF4 kernel instead of peft + bitsandbytes (same math, same adapter files)
    fused_lora: FusedMode = FusedMode.auto
    # the decoder layers' training forward through torch.compile (inductor), checked against eager
    # on a copy of one layer before the first step (tunekit/speed/torch_compile.py): 1.0-1.4x per step on the
    # development CPUs after 22-25 s of checking and compiling (56 s with inductor's cache empty):
    # the default 60-step run gains from a machine's second compiled run on
    compile: bool = False
    # torch's cuDNN attention kernel among the SDPA kernels it may choose on a GPU (true: torch's own
    # choice). cuDNN builds an execution plan per new sequence length, and training rows change
    # length every micro-batch; false leaves torch the flash and memory-efficient kernels, which need
    # none (docs/speed.md has the GPU figures)
    cudnn_attention: bool = False
    # packed rows (data.packing=true) attend per example through SDPA with no mask
    # (tunekit/speed/packed_attention.py); false: transformers' (T x T) block-diagonal mask, the
    # older path, kept to compare against (scripts/gpu_check.sh times both)
    packed_attention: bool = True


@dataclass
class TrackerConfig:
    name: str = "none"  # none | wandb
    project: str = "tunekit"
    run_name: Optional[str] = None


@dataclass
class TrainConfig:
    recipe: str = "custom"
    objective: str = "sft"  # sft | distill
    output_dir: str = "runs/default"
    seed: int = 0
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    method: MethodConfig = field(default_factory=MethodConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    tracker: TrackerConfig = field(default_factory=TrackerConfig)
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)


def register_schema() -> None:
    """Make `train_schema` available to the defaults list of recipes/train.yaml. Once a process:
    building the structured config takes ~65 ms, and Hydra hands each compose a deep copy anyway."""
    store = ConfigStore.instance()
    if "train_schema.yaml" not in store.repo:
        store.store(name="train_schema", node=TrainConfig)


TRACKERS = ("none", "wandb")
OBJECTIVES = ("sft", "distill")
BEST_METRICS = ("auto", "val_loss", "val_accuracy", "val_exact_match")


# Keys that runs written by earlier versions of tunekit carry and this one no longer has: dropped when
# such a run's config.yaml is read back, so that eval and export still open it.
RETIRED_KEYS = (("kernels", "head_matmul"),)  # an fp32-head math mode, replaced by the precision policy


def load_run_config(path: Path) -> "TrainConfig":
    """A run's saved config.yaml, merged into the schema (enums and defaults come back typed)."""
    from omegaconf import OmegaConf

    saved = OmegaConf.load(path)
    for group, key in RETIRED_KEYS:
        if isinstance(saved.get(group), dict) or OmegaConf.is_dict(saved.get(group)):
            saved[group].pop(key, None)
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainConfig), saved))


def plain(value):
    """An Enum member's value, or the value itself: configs built in Python may use plain strings."""
    return value.value if isinstance(value, Enum) else value


SEED_MAX = 2**31 - 1  # numpy seeds must fit 32 bits; ranks add 1000 * rank on top
AUTO = "auto"
_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


def _auto_int(value, key: str):
    """A positive int (also given as a string of digits) or "auto"; one error otherwise."""
    if isinstance(value, str) and value.strip().lower() == AUTO:
        return AUTO
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise TunekitError(f"{key}: must be a positive integer or auto, got {value!r}")
    return value


def _auto_bool(value, key: str):
    """true/false (as OmegaConf spells them: yes/no, on/off, 1/0) or "auto"; one error otherwise."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text == AUTO:
        return AUTO
    if text in _TRUE or text in _FALSE:
        return text in _TRUE
    raise TunekitError(f"{key}: must be true, false or auto, got {value!r}")


def validate(cfg: TrainConfig) -> None:
    """Every check that needs no model weights, cheapest first; each raises TunekitError naming the
    key (or the file and row). Runs before anything loads (tunekit.commands.compose.check_overrides) and again in the job.

    1. values and ranges of every key, the method's own checks (ranges and names, no model):
       check_settings
    2. output_dir can be created and written   (a probe folder, removed at once)
    3. the libraries a choice needs            (bitsandbytes, wandb)
    4. data files: every row read and checked  (no tokenizer)
    5. model folders: config.json, weights, tokenizer; the method's targets against the model
       built on the meta device (no weights)
    """
    check_settings(cfg)
    if cfg.model.preset is not None:
        from tunekit.plan.shape import preset_shape

        preset_shape(cfg.model.preset)  # a known name
    check_output_dir(cfg.output_dir)
    _check_libraries(cfg)
    _check_data(cfg.data)
    from tunekit.methods.registry import ignored_keys

    for key in ignored_keys(cfg.method):
        logging.getLogger("tunekit").warning("%s: method %r has no such key; it is ignored", key, cfg.method.name)
    _check_models(cfg)


def check_settings(cfg: TrainConfig) -> None:
    """The values of every key, the method's own included: all of validate() that reads no file and
    no model (`tunekit doctor` checks its overrides with it before its runs start)."""
    # The two keys that also take `auto` become an int / a bool, or "auto" for TrainRecipe.setup
    # to resolve from the memory plan.
    cfg.trainer.micro_batch_size = _auto_int(cfg.trainer.micro_batch_size, "trainer.micro_batch_size")
    cfg.model.gradient_checkpointing = _auto_bool(cfg.model.gradient_checkpointing, "model.gradient_checkpointing")
    cfg.model.offload_activations = _auto_bool(cfg.model.offload_activations, "model.offload_activations")
    check_values(cfg)
    from tunekit.methods import check_method_config, fill_method_defaults

    fill_method_defaults(cfg.method)  # a null key: the chosen method's default
    check_method_config(cfg.method, None, plain(cfg.model.quantize))


def check_values(cfg: TrainConfig) -> None:
    """Types, ranges and choices of every key except the method's (each method's check_config)."""
    t, d, m, dist = cfg.trainer, cfg.data, cfg.model, cfg.distill
    for key in ("max_steps", "micro_batch_size", "grad_accum", "eval_every", "save_every", "keep_checkpoints"):
        if getattr(t, key) != AUTO:
            number(f"trainer.{key}", getattr(t, key), ge=1, integer=True)
    number("trainer.warmup_steps", t.warmup_steps, ge=0, integer=True)  # >= max_steps: warmup only, allowed
    number("trainer.lr", t.lr, gt=0)
    number("trainer.weight_decay", t.weight_decay, ge=0)
    if t.lr * t.weight_decay >= 1:  # AdamW multiplies every weight by (1 - lr * wd) per step
        raise TunekitError(f"trainer.weight_decay: lr * weight_decay = {t.lr * t.weight_decay:g} >= 1 would flip "
                           "or zero every weight at each step; lower it")
    number("trainer.max_grad_norm", t.max_grad_norm, gt=0, allow_inf=True)  # inf: no clipping
    if t.dist_timeout_s != AUTO:
        number("trainer.dist_timeout_s", t.dist_timeout_s, ge=60)  # below a minute: a save could never finish
    number("trainer.eval_samples", t.eval_samples, ge=0, integer=True)
    number("trainer.eval_task_rows", t.eval_task_rows, ge=1, integer=True)
    number("trainer.eval_max_new_tokens", t.eval_max_new_tokens, ge=1, integer=True)
    one_of("trainer.best_metric", t.best_metric, BEST_METRICS)
    if not t.eval_task and t.best_metric in ("val_accuracy", "val_exact_match"):
        raise TunekitError(f"trainer.best_metric: {t.best_metric} is measured only with trainer.eval_task=true")
    one_of("trainer.optimizer", plain(t.optimizer), [o.value for o in Optimizer])
    one_of("trainer.strategy", plain(t.strategy), [x.value for x in Strategy])
    number("seed", cfg.seed, ge=0, le=SEED_MAX, integer=True)
    _optional_text("output_dir", cfg.output_dir, "a folder for the run", allow_none=False)

    _optional_text("model.path", m.path, "a model folder, or null for the default model")
    one_of("model.quantize", plain(m.quantize), [q.value for q in Quantize])
    one_of("model.dtype", plain(m.dtype), [x.value for x in DType])

    _optional_text("data.path", d.path, "a data file, or null for the default data")
    _optional_text("data.val_path", d.val_path, "a data file, or null to hold out data.val_fraction")
    number("data.val_fraction", d.val_fraction, gt=0, lt=1)
    one_of("data.format", plain(d.format), [f.value for f in DataFormat])
    number("data.max_seq_len", d.max_seq_len, ge=8, integer=True)
    if d.max_val_examples is not None:
        number("data.max_val_examples", d.max_val_examples, ge=1, integer=True)

    one_of("objective", cfg.objective, OBJECTIVES)
    _optional_text("distill.teacher", dist.teacher, "a model folder, or null for the default model")
    one_of("distill.teacher_quantize", plain(dist.teacher_quantize), [q.value for q in Quantize])
    number("distill.alpha", dist.alpha, ge=0, le=1)
    number("distill.temperature", dist.temperature, gt=0)
    one_of("distill.divergence", plain(dist.divergence), [x.value for x in Divergence])
    number("distill.beta", dist.beta, gt=0, lt=1)
    number("distill.chunk_size", dist.chunk_size, ge=1, integer=True)
    number("distill.student_keep_every", dist.student_keep_every, ge=0, integer=True)
    if dist.student_keep_every == 1:
        raise TunekitError("distill.student_keep_every: 1 keeps every layer (no smaller student); use 0 to train "
                           "model.path as the student, or 2 or more")

    one_of("kernels.fused_lora", plain(cfg.kernels.fused_lora), [x.value for x in FusedMode])
    if plain(cfg.kernels.fused_lora) == "on" and plain(m.quantize) != "nf4":
        raise TunekitError("kernels.fused_lora: on needs a 4-bit base (the kernel fuses NF4 dequantization into "
                           "LoRA's matmul); set model.quantize=nf4, or kernels.fused_lora=auto")
    if cfg.kernels.compile and plain(t.strategy) == "fsdp":
        raise TunekitError("kernels.compile: not with trainer.strategy=fsdp (FSDP2 wraps every decoder layer's "
                           "forward itself); set kernels.compile=false, or trainer.strategy=ddp")
    if plain(t.strategy) == "fsdp":
        from tunekit.train.fsdp import check_config

        check_config(plain(cfg.kernels.fused_lora), cfg.objective)
    one_of("tracker.name", cfg.tracker.name, TRACKERS)
    _optional_text("tracker.project", cfg.tracker.project, "a project name", allow_none=False)


def _optional_text(key: str, value, what: str, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, str) or not value.strip():
        raise TunekitError(f"{key}: empty; give {what}")


def check_output_dir(path: str, key: str = "output_dir") -> None:
    """The run folder is, or can become, a writable folder: refused before Hydra or the run create it.

    Writability is probed by creating (and at once removing) a hidden folder: permission bits
    say nothing for root, and a read-only mount or a sandbox can refuse what os.access allows.
    """
    _optional_text(key, path, "a folder for the run")
    path_fits(key, path)  # before any stat(): a name over NAME_MAX fails each one with ENAMETOOLONG
    p = Path(path).expanduser()
    # A symlink whose target is missing, or a loop of symlinks: exists() says False, so it would pass
    # for a new folder, and creating it fails later with a traceback.
    link = next((q for q in (p, *p.parents) if q.is_symlink() and not _resolves(q)), None)
    if link is not None:
        try:
            dest = os.readlink(link)
        except OSError:
            dest = "?"
        what = "a symlink loop" if _is_loop(link) else f"a dangling symlink (to {dest}, which does not exist)"
        where = f"{p} is" if link == p else f"{p} lies under {link}, which is"
        raise TunekitError(f"{key}: {where} {what}; give a real folder")
    try:
        if p.exists() and not p.is_dir():
            raise TunekitError(f"{key}: {p} is a file; give a folder")
        parent = p
        while not parent.exists():
            parent = parent.parent
    except OSError as e:
        raise TunekitError(f"{key}: cannot inspect {p}: {e.strerror or e}") from None
    if not parent.is_dir():
        raise TunekitError(f"{key}: {p} lies under {parent}, which is a file")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".tunekit-write-probe-", dir=parent))
    except OSError as e:
        where = "in" if parent == p else f"{p} in"
        raise TunekitError(f"{key}: cannot create {where} {parent} ({e.strerror or e}); choose a writable "
                           "folder") from None


def _resolves(link: Path) -> bool:
    try:
        return link.exists()
    except OSError:  # ELOOP on some platforms
        return False


def _is_loop(link: Path) -> bool:
    try:
        link.resolve(strict=True)
    except RuntimeError:  # pathlib's "Symlink loop"
        return True
    except OSError as e:
        import errno

        return e.errno == errno.ELOOP
    return False


def _check_libraries(cfg: TrainConfig) -> None:
    """A choice that needs an optional library fails here rather than as an ImportError mid-setup."""
    from importlib.util import find_spec

    wants_bnb = [("trainer.optimizer", plain(cfg.trainer.optimizer))] if plain(cfg.trainer.optimizer) != "adamw" else []
    if plain(cfg.model.quantize) == "nf4":
        wants_bnb.append(("model.quantize", "nf4"))
    if cfg.objective == "distill" and plain(cfg.distill.teacher_quantize) == "nf4":
        wants_bnb.append(("distill.teacher_quantize", "nf4"))
    if wants_bnb and find_spec("bitsandbytes") is None:
        key, value = wants_bnb[0]
        raise TunekitError(f"{key}: {value} needs bitsandbytes, which is not installed: pip install bitsandbytes "
                           "(or trainer.optimizer=adamw and model.quantize=none)")
    if cfg.tracker.name == "wandb" and find_spec("wandb") is None:
        raise TunekitError("tracker.name: wandb needs the wandb package: pip install wandb (or tracker=none)")


def _check_data(d: DataConfig) -> None:
    """Every row of the data files, read and checked (no tokenizer); the held-out split must leave
    training rows."""
    from tunekit.data.formats import check_file, row_char_limit

    for key in ("path", "val_path"):
        value = getattr(d, key)
        if value is None:
            continue
        rows, _ = check_file(value, plain(d.format), f"data.{key}", row_char_limit(d.max_seq_len))
        if key == "path" and d.val_path is None and rows - max(1, int(rows * d.val_fraction)) < 1:
            raise TunekitError(f"data.path: {value} has {rows} row(s): too few to hold out data.val_fraction="
                               f"{d.val_fraction} and train on the rest; add rows or give data.val_path")


def _check_models(cfg: TrainConfig) -> None:
    """The folders the run loads, from their small files; then the method against the model's layout
    (built on the meta device). The default model is checked only once converted (the conversion
    is the first run's job)."""
    from tunekit.methods import check_method_config, get_method
    from tunekit.model.default import converted_default_dir
    from tunekit.model.folder import check_weights_match, max_positions, model_skeleton, read_json, resolve_model_path

    def local(path: Optional[str], key: str) -> Optional[Path]:
        if path is None:
            return converted_default_dir()
        resolved = Path(resolve_model_path(path, key=key))
        return resolved if resolved.is_dir() else None  # a hub id: checked by resolve, no local layout

    if cfg.model.preset is not None:
        return  # a size for `tunekit plan`: no folder to check (`train` refuses it in check_trainable)
    student_key, student = "model.path", local(cfg.model.path, "model.path")
    if cfg.objective == "distill":
        teacher = local(cfg.distill.teacher, "distill.teacher")
        if cfg.distill.student_keep_every:  # the student is the teacher with fewer layers
            student_key, student = "distill.teacher", teacher
        elif teacher is not None and student is not None:
            sizes = [read_json(p / "config.json", k).get("vocab_size") for p, k in
                     ((student, "model.path"), (teacher, "distill.teacher"))]
            if sizes[0] != sizes[1]:
                raise TunekitError(f"distill.teacher: {teacher} has vocab_size {sizes[1]}, the student "
                                   f"{student} {sizes[0]}; distillation needs the same vocabulary")
        if teacher is not None and student != teacher:
            check_weights_match(teacher, model_skeleton(str(teacher), "distill.teacher"), "distill.teacher")
    if student is None:
        return
    limit = max_positions(read_json(student / "config.json", student_key))
    if limit is not None and cfg.data.max_seq_len > limit:
        raise TunekitError(f"data.max_seq_len: {cfg.data.max_seq_len} is more than the {limit} positions the model "
                           f"in {student} was built for; lower it to {limit} or less")
    if limit is not None:  # what the method adds to every row (a soft prompt) shares the model's positions
        get_method(cfg.method.name).check_context(cfg.method, cfg.data.max_seq_len, limit, str(student))
    skeleton = model_skeleton(str(student), student_key)
    check_weights_match(student, skeleton, student_key)
    check_method_config(cfg.method, skeleton, plain(cfg.model.quantize))
    get_method(cfg.method.name).check_training(cfg.method, skeleton)  # what a run cannot train (LoRA on the head)


def check_trainable(cfg: TrainConfig) -> None:
    """What `train` needs beyond `validate` (which `tunekit plan` shares): real weights."""
    if cfg.model.preset is not None:
        raise TunekitError(f"model.preset: {cfg.model.preset!r} is a size for `tunekit plan` only (no weights); "
                           "train from model.path")
