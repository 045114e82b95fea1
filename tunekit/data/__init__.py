"""Training rows: files, save_to_disk folders or hub ids -> format (alpaca, chat, ShareGPT,
prompt/completion, text) -> chat template -> tokenize -> mask all but the replies -> batches.

Owns reading and checking rows (one error line naming file and row), the masking rule, packing
and the batch schedule. May import tunekit.model (the tokenizer) and nothing above it.
"""

from __future__ import annotations

import contextvars
import logging
import random
from dataclasses import dataclass
from typing import Optional

from tunekit.data.batching import (BatchSchedule, collate, collate_packed, count_tokens, eval_batches,
                                   eval_micro_batches)
from tunekit.data.cache import TokenCache
from tunekit.data.encode import encode_rows
from tunekit.data.formats import DEFAULT_DATA_DIR, DataError, detect_format, read_rows
from tunekit.data.tokenize import IGNORE, end_of_turn_ids, ensure_chat_template

log = logging.getLogger(__name__)

__all__ = ["BatchSchedule", "DataError", "Dropped", "Examples", "IGNORE", "Splits", "TokenCache", "Truncation", "collate",
           "collate_packed",
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


@dataclass
class Truncation:
    """What data.max_seq_len cut from the examples of one split that still train (the rows it cut to
    nothing are `Dropped`, reported apart). Trained tokens are those with a label, less each
    example's first (no token predicts it)."""

    rows: int  # examples of the split
    truncated_rows: int  # of them, cut at data.max_seq_len
    trained_tokens: int  # trained tokens the examples keep
    trained_tokens_lost: int  # trained tokens past the cut

    def as_dict(self) -> dict:
        return dict(vars(self))

    def phrase(self, what: str) -> str:
        """"12 of 900 training rows cut, losing 340 of 51,200 trained tokens (0.7%)"."""
        if not self.truncated_rows:
            return f"no {what} row cut"
        whole = self.trained_tokens + self.trained_tokens_lost
        return (f"{self.truncated_rows} of {self.rows} {what} rows cut, losing {self.trained_tokens_lost:,} of "
                f"{whole:,} trained tokens ({100 * self.trained_tokens_lost / max(whole, 1):.1f}%)")


class Examples(list):
    """Tokenized examples ({"input_ids", "labels"}, each (seq,)); `dropped` says which rows of the
    file had no trained token left after truncation (None when none had); `lost`, one entry per
    example, how many trained tokens data.max_seq_len cut from it (None: it fit)."""

    dropped: Optional[Dropped] = None
    lost: Optional[list[Optional[int]]] = None

    def subset(self, indices) -> "Examples":
        """The examples at `indices`, each with its own `lost` (a split, or the first N held-out rows)."""
        out = Examples(self[i] for i in indices)
        out.dropped = self.dropped
        out.lost = [self.lost[i] for i in indices] if self.lost is not None else None
        return out

    @classmethod
    def joined(cls, parts: list["Examples"]) -> "Examples":
        """The examples of every part, in order, each with its own `lost` (the sources of a mixture)."""
        out = cls(e for part in parts for e in part)
        out.lost = [n for part in parts for n in (part.lost if part.lost is not None else [None] * len(part))]
        return out

    def truncation(self) -> Truncation:
        lost = self.lost or [None] * len(self)
        return Truncation(len(self), sum(n is not None for n in lost),
                          sum(sum(label != IGNORE for label in e["labels"][1:]) for e in self), sum(n or 0 for n in lost))


class Splits(tuple):
    """(train, val) examples, unpacked as before (`train, val = load_splits(...)`), plus `dropped`:
    one Dropped per file that lost rows to data.max_seq_len (each already logged once). What the cut
    took from the rows that still train: `train.truncation()`, `val.truncation()`.

    A list of sources (tunekit.data.mixture) adds `sources` (one SourceReport each: rows available,
    drawn, held out) and `val_groups` ([(source name, its indices into val)], None where data.val_path
    holds out); both None for one path."""

    def __new__(cls, train: list[dict], val: list[dict], dropped: list[Dropped], sources: Optional[list] = None,
                val_groups: Optional[list[tuple[str, list[int]]]] = None):
        self = super().__new__(cls, (train, val))
        self.dropped = dropped
        self.sources = sources
        self.val_groups = val_groups
        return self

    def __getnewargs__(self):  # copy and pickle rebuild it through __new__
        return self[0], self[1], self.dropped, self.sources, self.val_groups

    @property
    def train(self) -> list[dict]:
        return self[0]

    @property
    def val(self) -> list[dict]:
        return self[1]


# While load_splits reads several files or sources, what tokenize_rows would log (a cache hit, dropped
# rows) waits until every one of them has loaded: a source that fails then stops the run with its
# error line alone, not after lines about the sources before it.
_HELD: contextvars.ContextVar[Optional[list]] = contextvars.ContextVar("tunekit_data_held_lines", default=None)


def _say(level: int, message: str) -> None:
    held = _HELD.get()
    if held is None:
        log.log(level, "%s", message)
    else:
        held.append((level, message))


def tokenize_rows(rows: list[dict], fmt: str, path, tokenizer, max_len: int, why: str = "",
                  cache: Optional[TokenCache] = None, num_proc: Optional[int] = 1) -> Examples:
    """Every row tokenized and masked (tunekit.data.tokenize). A row whose trained tokens all lie past
    max_len is dropped, and the file's dropped rows are logged in one line; all rows dropped is an error.

    cache: a TokenCache to take the examples from, or to store them in (tunekit.data.cache); the
    report of dropped and cut rows is the same either way. num_proc: processes that encode (None:
    auto, several from tunekit.data.encode.AUTO_ROWS rows); the examples are the same either way."""
    entry = cache.entry(str(path), rows, fmt, tokenizer, max_len) if cache is not None else None
    got = entry.load() if entry is not None else None
    if got is not None:
        _say(logging.INFO, f"tokenized rows from cache {entry.folder}")
        examples, lost, dropped_at = got.examples, got.lost, got.dropped
    else:
        encoded = encode_rows(rows, fmt, path, why, tokenizer, max_len, end_of_turn_ids(tokenizer), num_proc)
        examples = [ex for ex, _ in encoded if ex is not None]
        lost = [n for ex, n in encoded if ex is not None]
        dropped_at = [i for i, (ex, _) in enumerate(encoded) if ex is None]
        if entry is not None and examples:
            entry.store(examples, lost, dropped_at)
    out = Examples(examples)
    out.lost = lost
    labels = getattr(rows, "labels", None)
    dropped = [labels[i] if labels else f"row {i + 1}" for i in dropped_at]
    if not out:
        raise DataError(f"{path}: no usable rows: none of its {len(dropped)} rows keeps a response token within "
                        f"data.max_seq_len={max_len}; raise it or shorten the prompts")
    if dropped:
        out.dropped = Dropped(str(path), dropped, len(rows), max_len)
        _say(logging.WARNING, out.dropped.line())
    return out


def hold_out(examples: Examples, val_fraction: float, seed: int, path) -> tuple[Examples, Examples]:
    """(train, val): val_fraction of the examples (at least one) held out by a shuffle seeded by `seed`,
    each part in file order. The file's dropped rows stay with the training part (reported once)."""
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    n_val = max(1, int(len(examples) * val_fraction))
    if len(examples) - n_val < 1:
        raise DataError(f"{path}: {len(examples)} rows is too few to hold out a validation split")
    train, val = examples.subset(sorted(order[n_val:])), examples.subset(sorted(order[:n_val]))
    val.dropped = None
    return train, val


def load_splits(
    path,
    val_path: Optional[str],
    fmt: str,
    tokenizer,
    max_len: int,
    val_fraction: float,
    max_val_examples: Optional[int],
    seed: int,
    cache: Optional[TokenCache] = None,
    num_proc: Optional[int] = None,
) -> Splits:
    """(train, val) tokenized examples, with Splits.dropped. No path -> the embedded default data and
    its val split. data.path may be a file, a save_to_disk folder or a hub id (tunekit.data.sources);
    a dataset with a held-out split gives the val set when val_path is None. A list of sources:
    tunekit.data.mixture.load_mixture. cache, num_proc: as tokenize_rows (each file, or each source of a
    list, is an entry of its own; its held-out part is split off after, from its examples, so a cached
    file splits as a fresh one). What reading them logs comes once all have loaded (_HELD)."""
    held: list = []
    token = _HELD.set(held)
    try:
        splits = _load_splits(path, val_path, fmt, tokenizer, max_len, val_fraction, max_val_examples, seed, cache,
                              num_proc)
    finally:
        _HELD.reset(token)
    for level, message in held:
        log.log(level, "%s", message)
    return splits


def _load_splits(path, val_path, fmt, tokenizer, max_len, val_fraction, max_val_examples, seed, cache,
                 num_proc) -> Splits:
    ensure_chat_template(tokenizer)
    from tunekit.data.mixture import is_mixture, load_mixture

    if is_mixture(path):
        return load_mixture(path, val_path, fmt, tokenizer, max_len, val_fraction, max_val_examples, seed, cache,
                            num_proc)
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
        train = tokenize_rows(train_rows, fmt_train, train_path, tokenizer, max_len, why, cache, num_proc)
        val = tokenize_rows(val_rows, fmt_val, val_name, tokenizer, max_len, why, cache, num_proc)
    else:
        examples = tokenize_rows(train_rows, fmt_train, train_path, tokenizer, max_len, why, cache, num_proc)
        train, val = hold_out(examples, val_fraction, seed, train_path)
    if max_val_examples is not None:
        val = val.subset(range(min(max_val_examples, len(val))))
    return Splits(train, val, [e.dropped for e in (train, val) if getattr(e, "dropped", None) is not None])
