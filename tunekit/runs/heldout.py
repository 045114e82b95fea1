"""A run's held-out data, as the run itself split it: checked unchanged, then re-made.

`check_data_unchanged` refuses a run whose data files changed since training started (the split
would silently be another one); `heldout_batches` rebuilds the first validation micro-batches
(what `tunekit export` measures fidelity on; a preference run's pairs as one sequence per side);
`heldout_split` the held-out examples `tunekit eval` scores, each source's apart for a list of
sources; `heldout_preference` a preference run's held-out pairs (or KTO rows).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from tunekit import TunekitError
from tunekit.config import plain
from tunekit.runs.open import Run

DEFAULT_MAX_LEN = 2048  # --data over a model folder or adapter, which records no data.max_seq_len


def check_data_unchanged(run: Run) -> None:
    """Refuse when a data file the run trained on changed since (checksums recorded at its start,
    tunekit.train.resume.DATA_FINGERPRINT): re-splitting it would give another held-out set, possibly rows
    the run trained on, and the score would silently measure something else. Runs from before
    the record are not checked."""
    from tunekit.data.formats import DEFAULT_DATA_DIR
    from tunekit.data.mixture import describe, fingerprint as data_fingerprint, is_mixture, parse_sources
    from tunekit.data.sources import looks_like_hub_id
    from tunekit.train.resume import DATA_FINGERPRINT

    record = run.run_dir / DATA_FINGERPRINT
    if not record.is_file():
        return
    try:
        saved = json.loads(record.read_text())
    except (OSError, ValueError) as e:
        raise TunekitError(f"{record}: not readable JSON ({type(e).__name__}); it records the data the run trained on") from None
    d = run.cfg.data
    for s in parse_sources(d.path) if is_mixture(d.path) else []:
        if not Path(s.path).exists() and not looks_like_hub_id(s.path):
            raise TunekitError(f"{s.key}: {s.path}, which the run {run.run_dir} trained on, is gone; restore it, or "
                               "score a file of your choice with --data FILE")
    train = d.path if is_mixture(d.path) else Path(d.path) if d.path else DEFAULT_DATA_DIR / "train.jsonl"
    files = {"data.path": train,
             "data.val_path": Path(d.val_path) if d.val_path else (DEFAULT_DATA_DIR / "val.jsonl" if not d.path else None)}
    for key, path in files.items():
        want = saved.get(f"{key}:sha256") if isinstance(saved, dict) else None
        if path is None or not isinstance(want, str):
            continue
        if not is_mixture(path) and not path.exists() and not looks_like_hub_id(str(path)):
            raise TunekitError(f"{key}: {path}, which the run {run.run_dir} trained on, is gone; restore it, or "
                               "score a file of your choice with --data FILE")
        if data_fingerprint(path, key) != want:
            raise TunekitError(f"{key}: {describe(path)} changed since the run {run.run_dir} trained on it (its sha256 "
                               "differs from the one recorded at the start of training): its held-out split would no "
                               "longer be the run's; restore the file, or score a file of your choice with --data FILE")


def heldout_batches(run: Run, tokenizer, n_batches: int) -> list[dict[str, torch.Tensor]]:
    """The examples of the first n_batches micro-batches of the run's validation split, padded:
    each {input_ids, attention_mask, labels}: (batch, seq).

    Regrouped by length (same examples, at most micro_batch_size per batch, a new batch when a
    sequence is 1.5x longer than the batch's first): with right padding and a causal mask the
    real positions never see the padding, so grouping changes no figure, but it cuts the padded
    positions every forward pays for. Padded rather than packed even for packed runs: every
    consumer of an export (peft, transformers, llama.cpp) runs padded/single sequences."""
    from tunekit.data import collate, eval_batches, load_splits

    d = run.cfg.data
    if run.cfg.objective == "preference":  # each side of a pair (KTO: each row) is a sequence of its own
        pairs, _, _ = heldout_preference(run.cfg, tokenizer, None)
        val = [side for e in pairs for side in _sides(e)]
    else:
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


def _sides(example: dict) -> list[dict]:
    """A preference example's sequences as SFT-shaped examples: chosen then rejected (KTO: the row)."""
    out = [{"input_ids": example["input_ids"], "labels": example["labels"]}]
    if "rejected_input_ids" in example:
        out.append({"input_ids": example["rejected_input_ids"], "labels": example["rejected_labels"]})
    return out


def is_preference_data(data: str | None) -> bool:
    """Whether the file (or dataset) `data` holds preference rows (pairs or KTO's unpaired rows), judged
    by its first row as a preference run's data is. A KTO row {prompt, completion, label} would also
    read as an SFT prompt/completion row: its label decides."""
    from tunekit.data.formats import read_rows
    from tunekit.data.preference import row_kind

    if data is None:
        return False
    rows = read_rows(data, "--data")
    return bool(len(rows)) and row_kind(rows[0]) is not None and (
        "completion" not in rows[0] or rows[0].get("label") is not None)


def heldout_preference(cfg, tokenizer, data: str | None) -> tuple[list[dict], str, str]:
    """A preference run's held-out examples (tunekit.data.preference: pairs, or KTO's unpaired rows), their
    kind (pairs | unpaired) and where they come from: `data` (a file of preference rows), else the
    run's own split, made as the trainer made it."""
    from tunekit.data.formats import read_rows
    from tunekit.data.preference import detect_kind, load_preference_splits, tokenize_preference

    d = cfg.data
    if data is not None:
        rows = read_rows(data, "--data")
        if rows.held_out is not None:
            rows, data = rows.held_out, f"{data} (its held-out split)"
        kind = detect_kind(rows, data)
        examples, _ = tokenize_preference(rows, kind, data, tokenizer, d.max_seq_len)
        return examples, kind, data
    _, val, kind, _ = load_preference_splits(d.path, d.val_path, tokenizer, d.max_seq_len, d.val_fraction,
                                             d.max_val_examples, cfg.seed)
    where = d.val_path or f"{d.val_fraction:g} of {d.path} (the run's split)"
    return val, kind, where


@dataclass
class HeldOut:
    """Tokenized held-out examples, where they come from, and with a list of sources in data.path each
    source's name and its examples' indices (None for one path, or where data.val_path holds out)."""

    examples: list[dict]
    where: str
    groups: Optional[list[tuple[str, list[int]]]] = None


def heldout_examples(cfg, tokenizer, data: str | None) -> tuple[list[dict], str]:
    """Tokenized held-out examples and a line saying where they come from (heldout_split)."""
    split = heldout_split(cfg, tokenizer, data)
    return split.examples, split.where


def heldout_split(cfg, tokenizer, data: str | None) -> HeldOut:
    """Tokenized held-out examples and where they come from: `data` (any file, save_to_disk folder or
    hub id `tunekit train` reads), else the run's held-out split (cfg: its TrainConfig; each source's
    part of it for a list of sources), else the default data's."""
    from tunekit.config import plain
    from tunekit.data import load_splits, tokenize_rows
    from tunekit.data.formats import detect_format, read_rows
    from tunekit.data.mixture import describe

    max_len = cfg.data.max_seq_len if cfg is not None else DEFAULT_MAX_LEN
    if data is not None:
        from tunekit.data.tokenize import ensure_chat_template

        ensure_chat_template(tokenizer)
        rows = read_rows(data, "--data")  # its own format, whatever the run trained on
        if rows.held_out is not None:  # a saved or hub dataset with a held-out split: score that split
            rows, data = rows.held_out, f"{data} (its held-out split)"
        return HeldOut(tokenize_rows(rows, detect_format(rows, data), data, tokenizer, max_len), data)
    if cfg is not None:
        d = cfg.data
        splits = load_splits(d.path, d.val_path, plain(d.format), tokenizer, d.max_seq_len, d.val_fraction,
                             d.max_val_examples, cfg.seed)
        where = d.val_path or (f"{d.val_fraction:g} of {describe(d.path)} (the run's split)" if d.path
                               else "the default data's val split")
        return HeldOut(splits.val, where, splits.val_groups)
    _, val = load_splits(None, None, "auto", tokenizer, max_len, 0.05, None, 0)
    return HeldOut(val, "the default data's val split")
