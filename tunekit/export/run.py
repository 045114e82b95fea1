"""Rebuild what a finished run trained, from its folder alone, fresh from disk.

RUN_DIR/config.yaml   the resolved TrainConfig -> same base (path, quantize, dtype), same method
RUN_DIR/adapter/      method.save() output + the tokenizer the run used (chat template included)

The base is loaded with tunekit's own loader (keep_bnb_layout: no bitsandbytes CPU repack on
eval forwards, TRAPS.md), so one load serves a whole export: the base's loss, then the trained
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
from tunekit.device import DeviceFacts, compute_dtype, probe


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


def open_run(run_dir: str | Path, facts: DeviceFacts | None = None) -> Run:
    """Read RUN_DIR/config.yaml and check the run finished (adapter/ written); one clear error otherwise.
    `facts`: the device the run's models will load on (default: the CPU); its compute dtype is
    the run's model.dtype decided for that device, as training decides it."""
    from omegaconf.errors import OmegaConfBaseException

    from tunekit.model import resolve_model_path

    run_dir = Path(run_dir).expanduser()
    if not run_dir.is_dir():
        raise TunekitError(f"RUN_DIR: no such folder: {run_dir}")
    cfg_path = run_dir / "config.yaml"
    if not cfg_path.is_file():
        raise TunekitError(f"RUN_DIR: {run_dir} is not a tunekit run (no config.yaml; pass the output_dir of `tunekit train`)")
    adapter = run_dir / "adapter"
    if not (adapter / "adapter_model.safetensors").is_file():
        ckpts = sorted(p.name for p in (run_dir / "checkpoints").glob("step-*")) if (run_dir / "checkpoints").is_dir() else []
        hint = f"; checkpoints there: {', '.join(ckpts)} (resume the run to finish it)" if ckpts else ""
        raise TunekitError(f"RUN_DIR: {run_dir} has no finished adapter (adapter/adapter_model.safetensors){hint}")
    try:
        # Merge into the schema so enum values and defaults come back typed, as in training.
        cfg = load_run_config(cfg_path)
    except (OmegaConfBaseException, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TunekitError(f"{cfg_path}: not a tunekit config ({first})") from None
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


def run_tokenizer(run: Run):
    """The tokenizer saved with the adapter (it carries the chat template the run trained with)."""
    from tunekit.model import load_tokenizer

    has_tok = any((run.adapter_dir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))
    return load_tokenizer(str(run.adapter_dir if has_tok else run.model_path))


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
