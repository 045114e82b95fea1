"""Rebuild what a finished run trained, from its folder alone, fresh from disk.

RUN_DIR/config.yaml   the resolved TrainConfig -> same base (path, quantize, dtype), same method
RUN_DIR/adapter/      method.save() output + the tokenizer the run used (chat template included)

The base is loaded with tunekit's own loader (keep_bnb_layout: no bitsandbytes CPU repack on
eval forwards: tunekit.model.loader explains why), so one load serves a whole export: the base's loss, then the trained
model's logits (apply + load on the same storage), then the merge into the dequantized weights,
which consumes it. `load_original_base` reads the high-precision weights for the other target.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from tunekit import TunekitError
from tunekit.config import TrainConfig, load_run_config, plain
from tunekit.speed.device import DeviceFacts, compute_dtype, probe


@dataclass
class Run:
    """A finished training run: its folder, resolved config and the base it trained over."""

    run_dir: Path
    cfg: TrainConfig
    model_path: str
    quantize: str  # "nf4" | "none"
    dtype: torch.dtype  # compute dtype of the base: the run's model.dtype on the device it is opened for
    device: torch.device = torch.device("cpu")  # where its models load (the command's --device)

    @property
    def adapter_dir(self) -> Path:
        return self.run_dir / "adapter"

    @property
    def method(self):
        from tunekit.methods import get_method

        return get_method(self.cfg.method.name)


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


def open_run(run_dir: str | Path, facts: DeviceFacts | None = None, adapter: Path | None = None) -> Run:
    """Read RUN_DIR/config.yaml and check the run finished (adapter/ written); one clear error otherwise.
    `facts`: the device the run's models will load on (default: the CPU); its compute dtype is
    the run's model.dtype decided for that device, as training decides it. `adapter`: an adapter
    folder of the run chosen instead (RUN/checkpoints/step-N/adapter): then the run need not have
    finished, as a killed run has only its checkpoints."""
    from tunekit.model import resolve_model_path

    run_dir = Path(run_dir).expanduser()
    if not run_dir.is_dir():
        raise TunekitError(f"RUN_DIR: no such folder: {run_dir}")
    cfg_path = run_dir / "config.yaml"
    if not cfg_path.is_file():
        raise TunekitError(f"RUN_DIR: {run_dir} is not a tunekit run (no config.yaml; pass the output_dir of `tunekit train`)")
    if adapter is not None:
        if not (adapter / "adapter_model.safetensors").is_file():
            raise TunekitError(f"RUN_DIR: {adapter} has no adapter_model.safetensors (a checkpoint cut short?)")
    elif not (run_dir / "adapter" / "adapter_model.safetensors").is_file():
        ckpts = sorted(p.name for p in (run_dir / "checkpoints").glob("step-*")) if (run_dir / "checkpoints").is_dir() else []
        hint = f"; checkpoints there: {', '.join(ckpts)} (resume the run to finish it)" if ckpts else ""
        raise TunekitError(f"RUN_DIR: {run_dir} has no finished adapter (adapter/adapter_model.safetensors){hint}")
    cfg = read_run_config(cfg_path)
    model_path = resolve_model_path(cfg.model.path)
    facts = facts or probe(torch.device("cpu"))
    return Run(run_dir, cfg, model_path, plain(cfg.model.quantize), compute_dtype(plain(cfg.model.dtype), facts),
               facts.device)


def load_base(run: Run) -> nn.Module:
    """The frozen base exactly as the run trained over it, in eval mode.

    Uses the trainer's own preparation (every frozen weight in the precision policy's compute
    dtype); gradient checkpointing has no numeric effect and is left off.
    """
    from tunekit.model import load_base_model, prepare_for_training

    model = load_base_model(run.model_path, run.quantize, run.dtype, run.device)
    prepare_for_training(model, run.quantize, gradient_checkpointing=False)
    return model.eval()


def apply_and_load(run: Run, base: nn.Module, adapter_dir: Path | None = None) -> nn.Module:
    """method.apply + method.load(adapter) on `base` (its storage is reused): the trained model, eval mode."""
    method = run.method
    model = method.apply(base, run.cfg.method)
    method.load(model, Path(adapter_dir or run.adapter_dir))
    model.requires_grad_(False)
    return model.eval()


def trained_model(run: Run, adapter_dir: Path | None = None) -> nn.Module:
    """Base + method.apply + method.load(adapter): the model the run ended with, in eval mode."""
    return apply_and_load(run, load_base(run), adapter_dir)


def load_original_base(run: Run) -> nn.Module:
    """The base's own high-precision weights from model.path (never 4-bit), in fp32, eval mode.

    The weights a merge into the original model adds the fine-tune to; fp32 so that the sum
    W + delta is exact before the export's dtype rounds it once.
    """
    from tunekit.model import load_base_model

    return load_base_model(run.model_path, "none", torch.float32, run.device).eval()


def run_tokenizer(run: Run, adapter_dir: Path | None = None):
    """The tokenizer saved with the adapter (it carries the chat template the run trained with);
    a checkpoint's adapter folder may hold none: then the finished adapter's, else the base's."""
    from tunekit.model import load_tokenizer

    for folder in (adapter_dir, run.adapter_dir):
        if folder is not None and any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
            return load_tokenizer(str(folder))
    return load_tokenizer(str(run.model_path))


def check_data_unchanged(run: Run) -> None:
    """Refuse when a data file the run trained on changed since (checksums recorded at its start,
    tunekit.train.resume.DATA_FINGERPRINT): re-splitting it would give another held-out set, possibly rows
    the run trained on, and the score would silently measure something else. Runs from before
    the record are not checked."""
    import json

    from tunekit.train.checkpoint import sha256_file
    from tunekit.data.formats import DEFAULT_DATA_DIR
    from tunekit.train.resume import DATA_FINGERPRINT

    record = run.run_dir / DATA_FINGERPRINT
    if not record.is_file():
        return
    try:
        saved = json.loads(record.read_text())
    except (OSError, ValueError) as e:
        raise TunekitError(f"{record}: not readable JSON ({type(e).__name__}); it records the data the run trained on") from None
    d = run.cfg.data
    files = {"data.path": Path(d.path) if d.path else DEFAULT_DATA_DIR / "train.jsonl",
             "data.val_path": Path(d.val_path) if d.val_path else (DEFAULT_DATA_DIR / "val.jsonl" if not d.path else None)}
    for key, path in files.items():
        want = saved.get(f"{key}:sha256") if isinstance(saved, dict) else None
        if path is None or not isinstance(want, str):
            continue
        if not path.is_file():
            raise TunekitError(f"{key}: {path}, which the run {run.run_dir} trained on, is gone; restore it, or "
                               "score a file of your choice with --data FILE")
        if sha256_file(path) != want:
            raise TunekitError(f"{key}: {path} changed since the run {run.run_dir} trained on it (its sha256 differs "
                               "from the one recorded at the start of training): its held-out split would no longer "
                               "be the run's; restore the file, or score a file of your choice with --data FILE")


def heldout_batches(run: Run, tokenizer, n_batches: int) -> list[dict[str, torch.Tensor]]:
    """The examples of the first n_batches micro-batches of the run's validation split, padded:
    each {input_ids, attention_mask, labels}: (batch, seq).

    Regrouped by length (same examples, at most micro_batch_size per batch, a new batch when a
    sequence is 1.5x longer than the batch's first): with right padding and a causal mask the
    real positions never see the padding, so grouping changes no figure, but it cuts the padded
    positions every forward pays for (default run: 3184 -> 1968 positions for 1792 real tokens).
    Padded rather than packed even for packed runs: every consumer of an export (peft,
    transformers, llama.cpp) runs padded/single sequences."""
    from tunekit.data import collate, eval_batches, load_splits

    d = run.cfg.data
    _, val = load_splits(d.path, d.val_path, plain(d.format), tokenizer, d.max_seq_len, d.val_fraction,
                         d.max_val_examples, run.cfg.seed)
    size = run.cfg.trainer.micro_batch_size
    chosen = [i for idx in eval_batches(len(val), size, 1, 0)[:n_batches] for i in idx]
    chosen.sort(key=lambda i: len(val[i]["input_ids"]))
    groups: list[list[int]] = []
    for i in chosen:
        n = len(val[i]["input_ids"])
        if not groups or len(groups[-1]) == size or n > 1.5 * len(val[groups[-1][0]]["input_ids"]):
            groups.append([])
        groups[-1].append(i)
    return [collate([val[i] for i in idx], tokenizer.pad_token_id) for idx in groups]
