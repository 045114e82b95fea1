"""Structured configs: the schema Hydra validates every recipe and command-line override against.

Hydra composes recipes/ (train.yaml + the groups model/, data/, trainer/, tracker/, recipe/) on
top of `TrainConfig`, so an unknown key or a value of the wrong type is rejected before anything
runs. Checks that need more than a type (files that must exist, positive sizes) live in
`validate()`. Only the recipe and the builders read this object; layers take plain arguments.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore

from tunekit import TunekitError


class Optimizer(str, Enum):
    adamw = "adamw"
    adamw_8bit = "adamw_8bit"
    paged_adamw_8bit = "paged_adamw_8bit"
    paged_adamw_32bit = "paged_adamw_32bit"


class Quantize(str, Enum):
    none = "none"
    nf4 = "nf4"  # 4-bit NormalFloat with double quantization (QLoRA)


class DType(str, Enum):
    auto = "auto"  # bf16 where the device computes it natively, else fp32
    bf16 = "bf16"
    fp32 = "fp32"


class FusedMode(str, Enum):
    auto = "auto"  # fused Triton LoRA kernels where they run natively (CUDA + triton)
    on = "on"
    off = "off"


class DataFormat(str, Enum):
    auto = "auto"  # detected from the columns: messages -> chat, instruction -> alpaca, text -> text
    alpaca = "alpaca"
    chat = "chat"
    text = "text"


@dataclass
class ModelConfig:
    # A local Hugging Face model folder or a hub id; null = the embedded SmolLM2-135M-Instruct.
    path: Optional[str] = None
    quantize: Quantize = Quantize.none
    dtype: DType = DType.auto
    # true | false | auto: off when the plan says the step fits without it (a third less compute)
    gradient_checkpointing: Any = False
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
    max_val_examples: Optional[int] = 256
    # Concatenate each micro-batch into one row with per-example positions and attention
    # (no padding). Same examples and same loss as unpacked; faster on short examples.
    packing: bool = False


@dataclass
class MethodConfig:
    name: str = "lora"
    # LoRA (Hu et al. 2021)
    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.05
    # LoRA and BitFit: which projections; "all-linear" = q,k,v,o,gate,up,down of every block.
    target_modules: List[str] = field(default_factory=lambda: ["all-linear"])
    # Bottleneck adapters (Houlsby et al. 2019): width of dim -> bottleneck -> dim, its
    # nonlinearity (gelu | silu | relu), and the sublayers whose output is adapted.
    bottleneck: int = 64
    activation: str = "gelu"
    sublayers: List[str] = field(default_factory=lambda: ["self_attn", "mlp"])
    # Prompt tuning (Lester et al. 2021): soft prompt length, and the text whose token embeddings
    # initialise it (repeated/truncated to num_virtual_tokens); null = random vocabulary rows.
    num_virtual_tokens: int = 20
    prompt_init_text: Optional[str] = None


@dataclass
class TrainerConfig:
    max_steps: int = 60
    # a positive int, or auto: the largest power of two up to 64 that the plan fits in free memory
    micro_batch_size: Any = 8
    grad_accum: int = 2
    optimizer: Optimizer = Optimizer.adamw
    lr: float = 2e-4
    weight_decay: float = 0.0
    warmup_steps: int = 5
    max_grad_norm: float = 1.0
    eval_every: int = 20
    save_every: int = 20
    keep_checkpoints: int = 2
    resume: bool = False
    # refuse, before loading, a run whose planned peak exceeds the device's free memory
    memory_check: bool = True


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
    """Make `train_schema` available to the defaults list of recipes/train.yaml."""
    ConfigStore.instance().store(name="train_schema", node=TrainConfig)


TRACKERS = ("none", "wandb")
OBJECTIVES = ("sft", "distill")


def plain(value):
    """An Enum member's value, or the value itself: configs built in Python may use plain strings."""
    return value.value if isinstance(value, Enum) else value


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
    """Checks beyond types. Raises TunekitError naming the key and the bad value.

    Normalises the two keys that also take `auto` (trainer.micro_batch_size to an int,
    model.gradient_checkpointing to a bool, or the string "auto" for TrainRecipe.setup to resolve).
    """

    def need(ok: bool, key: str, msg: str) -> None:
        if not ok:
            raise TunekitError(f"{key}: {msg}")

    t = cfg.trainer
    t.micro_batch_size = _auto_int(t.micro_batch_size, "trainer.micro_batch_size")
    cfg.model.gradient_checkpointing = _auto_bool(cfg.model.gradient_checkpointing, "model.gradient_checkpointing")
    for key in ("max_steps", "grad_accum", "eval_every", "save_every"):
        need(getattr(t, key) > 0, f"trainer.{key}", f"must be > 0, got {getattr(t, key)}")
    need(t.lr > 0, "trainer.lr", f"must be > 0, got {t.lr}")
    need(t.warmup_steps >= 0, "trainer.warmup_steps", f"must be >= 0, got {t.warmup_steps}")
    need(t.keep_checkpoints >= 1, "trainer.keep_checkpoints", "must be >= 1")
    need(cfg.data.max_seq_len >= 8, "data.max_seq_len", f"must be >= 8, got {cfg.data.max_seq_len}")
    need(0 < cfg.data.val_fraction < 1, "data.val_fraction", f"must be in (0, 1), got {cfg.data.val_fraction}")
    need(cfg.objective in OBJECTIVES, "objective", f"unknown objective {cfg.objective!r}; choose one of {OBJECTIVES}")
    d = cfg.distill
    need(0 <= d.alpha <= 1, "distill.alpha", f"must be in [0, 1], got {d.alpha}")
    need(d.temperature > 0, "distill.temperature", f"must be > 0, got {d.temperature}")
    need(0 < d.beta < 1, "distill.beta", f"must be in (0, 1), got {d.beta}")
    need(d.chunk_size >= 1, "distill.chunk_size", f"must be >= 1, got {d.chunk_size}")
    need(d.student_keep_every >= 0, "distill.student_keep_every", f"must be >= 0, got {d.student_keep_every}")
    if d.teacher is not None:
        from tunekit.model.loader import resolve_model_path

        resolve_model_path(d.teacher, key="distill.teacher")
    need(cfg.tracker.name in TRACKERS, "tracker.name", f"unknown tracker {cfg.tracker.name!r}; choose one of {TRACKERS}")
    for key in ("path", "val_path"):
        value = getattr(cfg.data, key)
        if value is not None:
            need(Path(value).is_file(), f"data.{key}", f"file not found: {value}")
    if cfg.model.path is not None:
        from tunekit.model.loader import resolve_model_path

        resolve_model_path(cfg.model.path)  # a local path must be a model folder; hub ids pass
    if cfg.model.preset is not None:
        from tunekit.plan.shape import preset_shape

        preset_shape(cfg.model.preset)  # a known name


def check_trainable(cfg: TrainConfig) -> None:
    """What `train` needs beyond `validate` (which `tunekit plan` shares): real weights."""
    if cfg.model.preset is not None:
        raise TunekitError(f"model.preset: {cfg.model.preset!r} is a size for `tunekit plan` only (no weights); "
                           "train from model.path")
