"""Every check of a composed config that needs no model weights, before anything loads.

Each room checks its own part beside its code: the data.* keys and files (tunekit.data.checks),
the model.* keys (tunekit.model.checks), the method's keys (its `check_config`; no key of
another method: tunekit.methods.check_own_keys, from the command line's composition). This module checks the trainer's, the kernels',
the tracker's and distillation's keys, the run folder, the libraries a choice needs and the model
folders against the method's targets (which needs both rooms), and `validate` runs them all,
cheapest first. Each raises TunekitError naming the key (or the file and row).
"""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path
from typing import Optional

from tunekit import TunekitError
from tunekit.checks import number, one_of, path_fits, text
from tunekit.config import (AUTO, BEST_METRICS, DEFAULT_MAX_STEPS, OBJECTIVES, SEED_MAX, TRACKERS, Divergence,
                            FusedMode, Optimizer, Quantize, Strategy, TrainConfig, plain)
from tunekit.data.checks import check_data_files, check_data_values
from tunekit.methods import check_method_config, fill_method_defaults, get_method
from tunekit.model.checks import check_model_values
from tunekit.train.preference import check_preference_config

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
       check_settings (a key of another method is refused where the command line is composed,
       tunekit.commands.compose, which sees every job of a sweep)
    2. output_dir (and data.cache_dir) can be created and written   (a probe folder, removed at once)
    3. the libraries a choice needs            (bitsandbytes, wandb)
    4. data files: every row read and checked  (no tokenizer)
    5. model folders: config.json, weights, tokenizer; the method's targets against the model
       built on the meta device (no weights)
    """
    check_settings(cfg)
    if cfg.model.preset is not None:
        from tunekit.plan.shape import preset_shape

        preset_shape(cfg.model.preset)  # a known name
    check_writable_dir(cfg.output_dir)
    check_cache_dir(cfg)
    check_libraries(cfg)
    check_data_files(cfg.data, cfg.objective)
    check_model_folders(cfg)


def check_settings(cfg: TrainConfig) -> None:
    """The values of every key, the method's own included: all of validate() that reads no file and
    no model (`tunekit doctor` checks its overrides with it before its runs start)."""
    # The two keys that also take `auto` become an int / a bool, or "auto" for TrainRecipe.setup
    # to resolve from the memory plan.
    cfg.trainer.micro_batch_size = _auto_int(cfg.trainer.micro_batch_size, "trainer.micro_batch_size")
    cfg.model.gradient_checkpointing = _auto_bool(cfg.model.gradient_checkpointing, "model.gradient_checkpointing")
    cfg.model.offload_activations = _auto_bool(cfg.model.offload_activations, "model.offload_activations")
    check_run_length(cfg.trainer)
    check_values(cfg)
    fill_method_defaults(cfg.method)  # a null key: the chosen method's default
    check_method_config(cfg.method, None, plain(cfg.model.quantize))


def check_run_length(t) -> None:
    """trainer.max_steps (a positive int, or auto / null) and trainer.epochs (a positive number, or
    null): one of them sizes the run. Without epochs, max_steps=auto becomes DEFAULT_MAX_STEPS here;
    with epochs it stays auto until the run knows its rows and global batch (tunekit.train.build)."""
    if t.max_steps is None or (isinstance(t.max_steps, str) and t.max_steps.strip().lower() == AUTO):
        t.max_steps = AUTO
    elif isinstance(t.max_steps, str):
        raise TunekitError(f"trainer.max_steps: must be a positive integer or auto, got {t.max_steps!r}")
    else:
        number("trainer.max_steps", t.max_steps, ge=1, integer=True)
    if t.epochs is None:
        if t.max_steps == AUTO:
            t.max_steps = DEFAULT_MAX_STEPS
        return
    if isinstance(t.epochs, bool) or not isinstance(t.epochs, (int, float)):
        raise TunekitError(f"trainer.epochs: must be a positive number of passes over the training rows "
                           f"(e.g. 3 or 0.5), or null, got {t.epochs!r}")
    number("trainer.epochs", t.epochs, gt=0)
    if t.max_steps != AUTO:
        raise TunekitError(f"trainer.epochs={t.epochs:g} and trainer.max_steps={t.max_steps} both set the run's "
                           "length: keep one (trainer.max_steps=auto, its default, lets trainer.epochs decide)")


def check_values(cfg: TrainConfig) -> None:
    """Types, ranges and choices of every key except the method's (the model's and the data's by
    their rooms' checks, in this order so that the first bad key of a command line is named)."""
    t, dist = cfg.trainer, cfg.distill
    for key in ("micro_batch_size", "grad_accum", "eval_every", "save_every", "keep_checkpoints"):
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
    text("output_dir", cfg.output_dir, "a folder for the run", allow_none=False)
    check_model_values(cfg.model)
    check_data_values(cfg.data)

    one_of("objective", cfg.objective, OBJECTIVES)
    text("distill.teacher", dist.teacher, "a model folder, or null for the default model")
    one_of("distill.teacher_quantize", plain(dist.teacher_quantize), [q.value for q in Quantize])
    number("distill.alpha", dist.alpha, ge=0, le=1)
    number("distill.temperature", dist.temperature, gt=0)
    one_of("distill.divergence", plain(dist.divergence), [x.value for x in Divergence])
    number("distill.beta", dist.beta, gt=0, lt=1)
    number("distill.chunk_size", dist.chunk_size, ge=1, integer=True)
    number("distill.student_keep_every", dist.student_keep_every, ge=0, integer=True)
    check_preference_config(cfg)
    if dist.student_keep_every == 1:
        raise TunekitError("distill.student_keep_every: 1 keeps every layer (no smaller student); use 0 to train "
                           "model.path as the student, or 2 or more")

    one_of("kernels.fused_lora", plain(cfg.kernels.fused_lora), [x.value for x in FusedMode])
    if plain(cfg.kernels.fused_lora) == "on" and plain(cfg.model.quantize) != "nf4":
        raise TunekitError("kernels.fused_lora: on needs a 4-bit base (the kernel fuses NF4 dequantization into "
                           "LoRA's matmul); set model.quantize=nf4, or kernels.fused_lora=auto")
    if cfg.kernels.compile and plain(t.strategy) == "fsdp":
        raise TunekitError("kernels.compile: not with trainer.strategy=fsdp (FSDP2 wraps every decoder layer's "
                           "forward itself); set kernels.compile=false, or trainer.strategy=ddp")
    if plain(t.strategy) == "fsdp":
        from tunekit.train.fsdp import check_config

        check_config(plain(cfg.kernels.fused_lora), cfg.objective)
    one_of("tracker.name", cfg.tracker.name, TRACKERS)
    text("tracker.project", cfg.tracker.project, "a project name", allow_none=False)
    check_start_settings(cfg)


def check_start_settings(cfg: TrainConfig) -> None:
    """model.adapter (a frozen LoRA start under a new LoRA): what it can run with, before any file is read."""
    if cfg.model.adapter is None:
        return
    m = cfg.method
    if m.name != "lora":
        raise TunekitError(f"model.adapter: a frozen start adapter trains a new LoRA beside it, not method {m.name}; "
                           "use recipe=lora, qlora or dpo (or export the start merged and train on that folder)")
    for key, off, what in (("use_dora", False, "DoRA"), ("init", "default", f"method.init={m.init}")):
        if getattr(m, key, off) not in (off, None) and not (key == "init" and m.init == "auto"):  # auto: default here
            raise TunekitError(f"model.adapter: not with {what} (the new adapter must start at zero over base + start "
                               f"adapter); set method.{key}={str(off).lower()}")
    if getattr(cfg.data, "chat_template", None) is not None:
        raise TunekitError("model.adapter: not with data.chat_template yet (new token rows over a frozen start are "
                           "untested); train the template's tokens in the start's own run")
    if plain(cfg.trainer.strategy) == "fsdp":
        raise TunekitError("model.adapter: not with trainer.strategy=fsdp yet (only the DDP and single-process runs "
                           "stack a frozen adapter); set trainer.strategy=ddp")
    if cfg.objective == "distill" and cfg.distill.student_keep_every:
        raise TunekitError("model.adapter: not with distill.student_keep_every (the cut student is not the base the "
                           "adapter trained over); set distill.student_keep_every=0")


def check_writable_dir(path: str, key: str = "output_dir") -> None:
    """The run folder is, or can become, a writable folder: refused before Hydra or the run create it.

    Writability is probed by creating (and at once removing) a hidden folder: permission bits
    say nothing for root, and a read-only mount or a sandbox can refuse what os.access allows.
    """
    text(key, path, "a folder for the run")
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


def check_cache_dir(cfg: TrainConfig) -> None:
    """data.cache_dir, where it is given and the cache is on, is or can become a writable folder (the
    default folder is not checked: where it cannot be written, the run goes on uncached, with a warning)."""
    if cfg.data.cache and cfg.data.cache_dir is not None:
        check_writable_dir(cfg.data.cache_dir, "data.cache_dir")


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
        return e.errno == errno.ELOOP
    return False


def check_libraries(cfg: TrainConfig) -> None:
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


def check_model_folders(cfg: TrainConfig) -> None:
    """The folders the run loads, from their small files; then the method against the model's layout
    (built on the meta device). The default model is checked only once converted (the conversion
    is the first run's job)."""
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
    start = None
    if cfg.model.adapter is not None:
        from tunekit.model.start_adapter import check_start_base, open_start

        start = open_start(cfg.model.adapter)
    if student is None:
        if start is not None:
            check_start_base(start, cfg.model.path)
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
    if start is not None:  # the frozen start: the base it trained over, tensors that fit its layers
        check_start_base(start, cfg.model.path, skeleton)


def check_trainable(cfg: TrainConfig) -> None:
    """What `train` needs beyond `validate` (which `tunekit plan` shares): real weights."""
    if cfg.model.preset is not None:
        raise TunekitError(f"model.preset: {cfg.model.preset!r} is a size for `tunekit plan` only (no weights); "
                           "train from model.path")
