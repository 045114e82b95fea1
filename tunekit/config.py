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
from typing import List, Optional

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
    gradient_checkpointing: bool = False


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
    micro_batch_size: int = 8
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
    # At every evaluation (rank 0; tunekit.taskeval.training): eval_samples held-out prompts answered
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
BEST_METRICS = ("auto", "val_loss", "val_accuracy", "val_exact_match")


def plain(value):
    """An Enum member's value, or the value itself: configs built in Python may use plain strings."""
    return value.value if isinstance(value, Enum) else value


def validate(cfg: TrainConfig) -> None:
    """Checks beyond types. Raises TunekitError naming the key and the bad value."""

    def need(ok: bool, key: str, msg: str) -> None:
        if not ok:
            raise TunekitError(f"{key}: {msg}")

    t = cfg.trainer
    for key in ("max_steps", "micro_batch_size", "grad_accum", "eval_every", "save_every"):
        need(getattr(t, key) > 0, f"trainer.{key}", f"must be > 0, got {getattr(t, key)}")
    need(t.lr > 0, "trainer.lr", f"must be > 0, got {t.lr}")
    need(t.warmup_steps >= 0, "trainer.warmup_steps", f"must be >= 0, got {t.warmup_steps}")
    need(t.keep_checkpoints >= 1, "trainer.keep_checkpoints", "must be >= 1")
    need(t.eval_samples >= 0, "trainer.eval_samples", f"must be >= 0, got {t.eval_samples}")
    need(t.eval_task_rows > 0, "trainer.eval_task_rows", f"must be > 0, got {t.eval_task_rows}")
    need(t.eval_max_new_tokens > 0, "trainer.eval_max_new_tokens", f"must be > 0, got {t.eval_max_new_tokens}")
    need(t.best_metric in BEST_METRICS, "trainer.best_metric",
         f"unknown {t.best_metric!r}; choose one of {', '.join(BEST_METRICS)}")
    need(t.eval_task or t.best_metric not in ("val_accuracy", "val_exact_match"), "trainer.best_metric",
         f"{t.best_metric} is measured only with trainer.eval_task=true")
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
