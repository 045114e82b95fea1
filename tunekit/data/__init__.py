"""Training rows: files, save_to_disk folders or hub ids -> format (alpaca, chat, ShareGPT,
prompt/completion, text) -> chat template -> tokenize -> mask all but the replies -> batches.

Owns reading and checking rows (one error line naming file and row), the masking rule, packing
and the batch schedule. May import tunekit.model (the tokenizer) and nothing above it.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import Optional

from tunekit.data.batching import (BatchSchedule, collate, collate_packed, count_tokens, eval_batches,
                                   eval_micro_batches)
from tunekit.data.formats import DEFAULT_DATA_DIR, DataError, detect_format, iter_examples, read_rows, row_char_limit
from tunekit.data.tokenize import IGNORE, encode_example, end_of_turn_ids, ensure_chat_template

log = logging.getLogger(__name__)

__all__ = ["BatchSchedule", "DataError", "Dropped", "Examples", "IGNORE", "Splits", "collate", "collate_packed",
           "count_tokens", "eval_batches", "eval_micro_batches", "load_splits", "tokenize_rows"]

SHOWN_ROWS = 5  # how many dropped rows the report names


@dataclass
class Dropped:
    """The rows of one file left out because data.max_seq_len cut every trained token of theirs."""

    path: str
    rows: list[str]  # their labels: "row 5", "row 9 (line 11)", "row 3 of split 'validation'"
    total: int  # rows the file holds
    max_len: int

    def line(self) -> str:
        shown = ", ".join(self.rows[:SHOWN_ROWS]) + (", ..." if len(self.rows) > SHOWN_ROWS else "")
        return (f"{self.path}: {len(self.rows)} of {self.total} rows dropped: no trained token within "
                f"data.max_seq_len={self.max_len} (their replies start past it): {shown}")


class Examples(list):
    """Tokenized examples ({"input_ids", "labels"}, each (seq,)); `dropped` says which rows of the
    file had no trained token left after truncation (None when none had)."""

    dropped: Optional[Dropped] = None


class Splits(tuple):
    """(train, val) examples, unpacked as before (`train, val = load_splits(...)`), plus `dropped`:
    one Dropped per file that lost rows to data.max_seq_len (each already logged once)."""

    def __new__(cls, train: list[dict], val: list[dict], dropped: list[Dropped]):
        self = super().__new__(cls, (train, val))
        self.dropped = dropped
        return self

    def __getnewargs__(self):  # copy and pickle rebuild it through __new__
        return self[0], self[1], self.dropped

    @property
    def train(self) -> list[dict]:
        return self[0]

    @property
    def val(self) -> list[dict]:
        return self[1]


def tokenize_rows(rows: list[dict], fmt: str, path, tokenizer, max_len: int, why: str = "") -> Examples:
    """Every row tokenized and masked (tunekit.data.tokenize). A row whose trained tokens all lie past
    max_len is dropped, and the file's dropped rows are logged in one line; all rows dropped is an error."""
    out, dropped = Examples(), []
    labels = getattr(rows, "labels", None)
    ends = end_of_turn_ids(tokenizer)
    for i, (where, messages, row) in enumerate(iter_examples(rows, fmt, path, why, row_char_limit(max_len))):
        ex = encode_example(tokenizer, messages, row, where, max_len, ends)
        if ex is None:
            dropped.append(labels[i] if labels else f"row {i + 1}")
        else:
            out.append(ex)
    if not out:
        raise DataError(f"{path}: no usable rows: none of its {len(dropped)} rows keeps a response token within "
                        f"data.max_seq_len={max_len}; raise it or shorten the prompts")
    if dropped:
        out.dropped = Dropped(str(path), dropped, len(rows), max_len)
        log.warning("%s", out.dropped.line())
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
) -> Splits:
    """(train, val) tokenized examples, with Splits.dropped. No path -> the embedded default data and
    its val split. data.path may be a file, a save_to_disk folder or a hub id (tunekit.data.sources);
    a dataset with a held-out split gives the val set when val_path is None."""
    ensure_chat_template(tokenizer)
    train_path = path if path else str(DEFAULT_DATA_DIR / "train.jsonl")
    if val_path is None and path is None:
        val_path = str(DEFAULT_DATA_DIR / "val.jsonl")
    why = "as its first row" if fmt == "auto" else f"data.format={fmt}"
    train_rows = read_rows(train_path)
    fmt_train = detect_format(train_rows, train_path) if fmt == "auto" else fmt

    val_rows = train_rows.held_out if val_path is None else read_rows(val_path, key="data.val_path")
    if val_rows is not None:
        val_name = train_path if val_path is None else val_path
        fmt_val = detect_format(val_rows, val_name) if fmt == "auto" else fmt
        # Validate every training row (clear error with its number) before any split.
        train = tokenize_rows(train_rows, fmt_train, train_path, tokenizer, max_len, why)
        val = tokenize_rows(val_rows, fmt_val, val_name, tokenizer, max_len, why)
    else:
        examples = tokenize_rows(train_rows, fmt_train, train_path, tokenizer, max_len, why)
        order = list(range(len(examples)))
        random.Random(seed).shuffle(order)
        n_val = max(1, int(len(examples) * val_fraction))
        if len(examples) - n_val < 1:
            raise DataError(f"{train_path}: {len(examples)} rows is too few to hold out a validation split")
        train, val = Examples(examples[i] for i in sorted(order[n_val:])), [examples[i] for i in sorted(order[:n_val])]
        train.dropped = examples.dropped
    if max_val_examples is not None:
        val = val[:max_val_examples]
    return Splits(train, val, [e.dropped for e in (train, val) if getattr(e, "dropped", None) is not None])
