"""The config's schema: plain data, the keys of every recipe and command line with their types
and defaults. It imports nothing of tunekit, so every room may read it.

Hydra composes recipes/ (train.yaml + the groups model/, data/, trainer/, tracker/, recipe/) on
top of `TrainConfig`, so an unknown key or a value of the wrong type is rejected before anything
runs. The `method` node holds `name` here; each method declares its own keys beside its code
(tunekit/methods/<name>/), and tunekit.methods joins them into the node's schema when a command
line is composed (`tunekit.methods.train_schema`). Checks that need more than a type (ranges,
files that must exist, a key of another method) live in the room that owns the part they check,
gathered by tunekit.train.checks.validate.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional


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
    # A LoRA adapter to start from, loaded frozen (a tunekit run folder, or a peft adapter folder):
    # the run trains a new adapter beside it, and a preference reference is base + this adapter.
    adapter: Optional[str] = None


@dataclass
class DataConfig:
    # .jsonl/.json/.csv/.parquet file, save_to_disk folder or hub id; null = the embedded default
    # dataset. Or a list of sources, each such a string or {path, name, format, split, and one of
    # weight | fraction | rows} (tunekit.data.mixture): Any, since the schema cannot say "str or list".
    path: Any = None
    # Held-out file; null = the default data's val split, or val_fraction of path.
    val_path: Optional[str] = None
    val_fraction: float = 0.05
    format: DataFormat = DataFormat.auto
    # The run's chat format: chatml | llama3 | a .jinja file; null: the tokenizer's own template.
    # Special tokens it names that the tokenizer lacks are added, and their embedding rows train
    # (docs/data.md#chat-templates-and-new-tokens).
    chat_template: Optional[str] = None
    max_seq_len: int = 512
    max_val_examples: Optional[int] = 256  # >= 1; null = the whole held-out split
    # Concatenate each micro-batch into one row with per-example positions and attention
    # (no padding). Same examples and same loss as unpacked; faster on short examples.
    packing: bool = False
    # Tokenize each file once and reuse the examples while nothing that shapes them changes
    # (docs/data.md#tokenized-cache); false: tokenize every run.
    cache: bool = True
    # Folder of the tokenized cache; null: $TUNEKIT_DATA_CACHE, else ~/.cache/tunekit/tokenized.
    cache_dir: Optional[str] = None
    # Processes that tokenize; null: auto (several from 20,000 rows). Same examples for any value.
    num_proc: Optional[int] = None


@dataclass
class MethodConfig:
    """The method node as the schema knows it: which method. Its keys are the method's own
    (tunekit/methods/<name>/), joined in by tunekit.methods.config_schema."""

    name: str = "lora"


# trainer.max_steps=auto without trainer.epochs
DEFAULT_MAX_STEPS = 60


@dataclass
class TrainerConfig:
    # Optimizer steps: a positive int, or auto (null too): trainer.epochs' count where it is set,
    # else DEFAULT_MAX_STEPS. Setting both epochs and a number of steps is refused.
    max_steps: Any = "auto"
    # Passes over the training rows, e.g. 3 or 0.5; null: off (max_steps decides). The step count
    # follows from the rows and the global batch (tunekit.data.batching.steps_for_epochs).
    epochs: Any = None
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


# The folder of a run (output_dir) that holds the student a distillation cuts from its teacher
# (distill.student_keep_every): written by tunekit.train.build, read by every command that opens the run.
STUDENT_DIR = "student_base"


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


class PreferenceLoss(str, Enum):
    dpo = "dpo"  # Rafailov et al. 2023; needs the reference (the base, trained part off)
    ipo = "ipo"  # Azar et al. 2023; needs the reference
    orpo = "orpo"  # Hong et al. 2024; reference-free, with the chosen side's NLL
    simpo = "simpo"  # Meng et al. 2024; reference-free, length-normalised
    kto = "kto"  # Ethayarajh et al. 2024; unpaired rows (prompt, completion, label)


@dataclass
class PreferenceConfig:
    """Used when objective=preference (tunekit.losses.preference; docs/preference.md). Defaults: TRL's."""

    loss: PreferenceLoss = PreferenceLoss.dpo
    # DPO/IPO/KTO: strength of the pull towards the reference (IPO's tau); ORPO: the odds-ratio
    # term's weight (lambda); SimPO: the reward scale
    beta: float = 0.1
    label_smoothing: float = 0.0  # dpo (conservative DPO) and simpo only: in [0, 0.5)
    gamma: float = 0.5  # simpo only: the target reward margin
    desirable_weight: float = 1.0  # kto only
    undesirable_weight: float = 1.0  # kto only
    # kto only: its reference point z, KL(policy || reference) estimated per micro-batch from each
    # prompt paired with the previous row's completion (`batch`, TRL's `kto`: two more no-grad
    # forwards), or 0 (`zero`, TRL's `apo_zero_unpaired`)
    kto_kl: str = "batch"
    # dpo/ipo/kto: compute every row's reference log-probs once before training (one forward over the
    # data) instead of a reference forward in every micro-batch (TRL's precompute_ref_log_probs)
    precompute_ref: bool = False


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
    objective: str = "sft"  # sft | distill | preference
    output_dir: str = "runs/default"
    seed: int = 0
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    method: MethodConfig = field(default_factory=MethodConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    tracker: TrackerConfig = field(default_factory=TrackerConfig)
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    preference: PreferenceConfig = field(default_factory=PreferenceConfig)


TRACKERS = ("none", "wandb")
OBJECTIVES = ("sft", "distill", "preference")
BEST_METRICS = ("auto", "val_loss", "val_accuracy", "val_exact_match")


# Keys that runs written by earlier versions of tunekit carry and this one no longer has: dropped when
# such a run's config.yaml is read back, so that eval and export still open it.
RETIRED_KEYS = (("kernels", "head_matmul"),)  # an fp32-head math mode, replaced by the precision policy
SEED_MAX = 2**31 - 1  # numpy seeds must fit 32 bits; ranks add 1000 * rank on top
AUTO = "auto"


def plain(value):
    """An Enum member's value, or the value itself: configs built in Python may use plain strings."""
    return value.value if isinstance(value, Enum) else value
