"""datasets -> format -> chat template -> tokenize -> mask prompt -> batch."""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Optional

from tunekit.data.batching import (BatchSchedule, collate, collate_packed, count_tokens, eval_batches,
                                   eval_micro_batches)
from tunekit.data.formats import DEFAULT_DATA_DIR, DataError, detect_format, iter_examples, read_rows, row_char_limit
from tunekit.data.tokenize import IGNORE, encode_example, ensure_chat_template

log = logging.getLogger(__name__)

__all__ = ["BatchSchedule", "DataError", "IGNORE", "collate", "collate_packed", "count_tokens", "eval_batches",
           "eval_micro_batches", "load_splits", "tokenize_rows"]


def tokenize_rows(rows: list[dict], fmt: str, path, tokenizer, max_len: int, why: str = "") -> list[dict]:
    out, dropped = [], 0
    for where, messages, row in iter_examples(rows, fmt, path, why, row_char_limit(max_len)):
        ex = encode_example(tokenizer, messages, row, where, max_len)
        if ex is None:
            dropped += 1
        else:
            out.append(ex)
    if not out:
        raise DataError(f"{path}: no usable rows: none of its {dropped} rows keeps a response token within "
                        f"data.max_seq_len={max_len}; raise it or shorten the prompts")
    if dropped:
        log.warning("%s: %d rows have no response token within data.max_seq_len=%d; skipped", path, dropped, max_len)
    return out


def load_splits(
    path: Optional[str],
    val_path: Optional[str],
    fmt: str,
    tokenizer,
    max_len: int,
    val_fraction: float,
    max_val_examples: Optional[int],
    seed: int,
) -> tuple[list[dict], list[dict]]:
    """(train, val) tokenized examples. No path -> the embedded default data and its val split."""
    ensure_chat_template(tokenizer)
    train_path = Path(path) if path else DEFAULT_DATA_DIR / "train.jsonl"
    if val_path is None and path is None:
        val_path = str(DEFAULT_DATA_DIR / "val.jsonl")
    why = "as its first row" if fmt == "auto" else f"data.format={fmt}"
    train_rows = read_rows(train_path)
    fmt_train = detect_format(train_rows, train_path) if fmt == "auto" else fmt

    if val_path is not None:
        val_rows = read_rows(val_path, key="data.val_path")
        fmt_val = detect_format(val_rows, val_path) if fmt == "auto" else fmt
        # Validate every training row (clear error with its number) before any split.
        train = tokenize_rows(train_rows, fmt_train, train_path, tokenizer, max_len, why)
        val = tokenize_rows(val_rows, fmt_val, val_path, tokenizer, max_len, why)
    else:
        examples = tokenize_rows(train_rows, fmt_train, train_path, tokenizer, max_len, why)
        order = list(range(len(examples)))
        random.Random(seed).shuffle(order)
        n_val = max(1, int(len(examples) * val_fraction))
        if len(examples) - n_val < 1:
            raise DataError(f"{train_path}: {len(examples)} rows is too few to hold out a validation split")
        val = [examples[i] for i in sorted(order[:n_val])]
        train = [examples[i] for i in sorted(order[n_val:])]
    if max_val_examples is not None:
        val = val[:max_val_examples]
    return train, val
