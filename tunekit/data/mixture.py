"""Several datasets in one run: `data.path` as a list of sources, each drawn in its own proportion.

A source is a string (what data.path takes: a file, a save_to_disk folder, a hub id) or a mapping:

  path      (required) the same
  name      its name in the log and the evaluation's keys (eval/<name>/loss); default: the path's stem
  format    its own data.format (default: data.format)
  split     the split of a saved or hub dataset that it reads (then no held-out split of its own is
            taken from the dataset: data.val_fraction of that split is held out)
  weight    > 0, relative: the weighted sources are drawn in proportion to their weights
  fraction  in (0, 1]: that share of the source's training rows (rounded, at least one)
  rows      >= 1: that many rows (more than the source has: whole passes over it, then part of one)

At most one of weight, fraction and rows; with none, the source gives every training row.

Held out: each source's own rows, at data.val_fraction (a seeded shuffle, as one file's split), or its
dataset's held-out split; data.max_val_examples caps the held-out set as a whole (each of N sources
keeps at most ceil(max / N) rows). With data.val_path, that file is the held-out set and every source
trains on all its rows. Evaluation reports each source's held-out loss beside the whole's (the trainer's
eval/<name>/loss; `tunekit eval` each source's figures).

The draw (`draw_counts`, `draw_rows`): a pure function of the seed, the sources and their rows, made
once per run before the batch schedule; the schedule then passes over the drawn rows epoch after
epoch (tunekit.data.batching.BatchSchedule). A resumed run draws the same rows, and its schedule
goes on at the checkpoint's data position, so it trains the rows an uninterrupted run would have.
Weighted sources together take as many rows as they can without repeating one: the source that
runs out first at its weight gives all its rows, the others their weight's share of that.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from contextlib import contextmanager
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, Optional

from tunekit import TunekitError
from tunekit.checks import number

SOURCE_KEYS = ("path", "name", "format", "split", "weight", "fraction", "rows")
AMOUNT_KEYS = ("weight", "fraction", "rows")
FORMATS = ("auto", "alpaca", "chat", "sharegpt", "prompt_completion", "text")  # tunekit.config.DataFormat


@dataclass(frozen=True)
class Source:
    index: int  # its position in data.path's list, from 0
    path: str
    name: str
    format: Optional[str] = None  # None: data.format
    split: Optional[str] = None
    weight: Optional[float] = None
    fraction: Optional[float] = None
    rows: Optional[int] = None

    @property
    def key(self) -> str:
        return f"data.path[{self.index}]"

    @property
    def label(self) -> str:
        """How errors name it: "data.path[1] (data/b.jsonl)"."""
        return f"{self.key} ({self.path})"

    def settings(self) -> dict:
        """What the user set, beside the path (the run's summary and fingerprint); the name where it is
        not the path's own stem."""
        out = {k: getattr(self, k) for k in SOURCE_KEYS[2:] if getattr(self, k) is not None}
        return {"name": self.name, **out} if self.name != stem(self.path) else out

    def amount(self) -> str:
        """"weight 3", "fraction 0.5", "rows 500", or "every row"."""
        return next((f"{k} {getattr(self, k):g}" for k in AMOUNT_KEYS if getattr(self, k) is not None), "every row")


def stem(path: str) -> str:
    """A source's default name: its file's or folder's stem ("data/a.jsonl" -> "a", "org/set" -> "set")."""
    return Path(path.rstrip("/")).stem or path


def is_mixture(value: Any) -> bool:
    """Whether data.path holds a list of sources (a Python list, or OmegaConf's before to_object)."""
    return isinstance(value, (list, tuple)) or type(value).__name__ == "ListConfig"


def _mapping(item: Any, index: int) -> dict:
    if isinstance(item, str):
        return {"path": item}
    if hasattr(item, "items") and not isinstance(item, dict):  # a DictConfig
        item = dict(item.items())
    if not isinstance(item, dict):
        raise TunekitError(f"data.path[{index}]: a source is a data path or a mapping {{path: ..., weight: ...}}, "
                           f"got {item!r:.80}")
    path = item.get("path")
    if not isinstance(path, str) or not path.strip():
        raise TunekitError(f"data.path[{index}]: a source mapping needs 'path' (a data file, save_to_disk folder or "
                           f"hub id), got {item!r:.120}")
    label = f"data.path[{index}] ({path})"
    unknown = sorted(set(item) - set(SOURCE_KEYS), key=str)
    if unknown:
        raise TunekitError(f"{label}: unknown key {unknown[0]!r}; a source takes {', '.join(SOURCE_KEYS[:-3])} and "
                           f"one of {', '.join(AMOUNT_KEYS)}")
    return item


def _source(item: Any, index: int) -> Source:
    """One source, its values checked (no file is read)."""
    m = _mapping(item, index)
    label = f"data.path[{index}] ({m['path']})"
    given = [k for k in AMOUNT_KEYS if m.get(k) is not None]
    if len(given) > 1:
        raise TunekitError(f"{label}: both {given[0]} and {given[1]}; a source's share is one of "
                           f"{', '.join(AMOUNT_KEYS)}")
    if m.get("weight") is not None:
        number(f"{label}: weight", m["weight"], gt=0)
    if m.get("fraction") is not None:
        number(f"{label}: fraction", m["fraction"], gt=0, le=1)
    if m.get("rows") is not None:
        number(f"{label}: rows", m["rows"], ge=1, integer=True)
    for key in ("name", "split"):
        if key in m and (not isinstance(m[key], str) or not m[key].strip()):
            raise TunekitError(f"{label}: {key} must be a non-empty string, got {m[key]!r:.80}")
    if "name" in m and "/" in m["name"]:
        raise TunekitError(f"{label}: name {m['name']!r} holds a '/': the evaluation's keys are eval/<name>/loss")
    fmt = m.get("format")
    if fmt is not None and str(fmt) not in FORMATS:
        raise TunekitError(f"{label}: format {fmt!r} is not one of {', '.join(FORMATS)}")
    name = m.get("name") or stem(m["path"])
    return Source(index, m["path"], name, None if fmt is None else str(fmt), m.get("split"),
                  m.get("weight"), m.get("fraction"), m.get("rows"))


def parse_sources(value: Any) -> list[Source]:
    """data.path's list as Sources; one TunekitError naming the source (its index and path) otherwise."""
    if not is_mixture(value):
        raise TunekitError(f"data.path: give a data path, a list of sources or null, got {value!r:.80}")
    items = list(value)
    if not items:
        raise TunekitError("data.path: an empty list of sources; give at least one, or null for the default data")
    sources = [_source(item, i) for i, item in enumerate(items)]
    seen: dict[str, Source] = {}
    for s in sources:
        if s.name in seen:
            raise TunekitError(f"{s.label}: its name {s.name!r} is also {seen[s.name].label}'s; give each a name "
                               "of its own (name: ...), as the evaluation reports each source by its name")
        seen[s.name] = s
    return sources


@contextmanager
def naming(source: Source):
    """Every DataError about a source's files and rows names the source: "data.path[1]: b.jsonl: row 3: ..."."""
    from tunekit.data.formats import DataError

    try:
        yield
    except DataError as e:
        text = str(e)
        if text.startswith(source.key):
            raise
        raise DataError(f"{source.key}: {text}" if source.path in text else f"{source.label}: {text}") from None


# ----------------------------------------------------------------------------- the draw
def _exact(x: float) -> Fraction:
    return Fraction(repr(float(x)))


def apportion(total: int, shares: list[Fraction]) -> list[int]:
    """`total` split in proportion to `shares` by largest remainder: each gets the floor of its exact
    share or one more, and they sum to `total` (ties to the earlier)."""
    whole = sum(shares)
    exact = [total * s / whole for s in shares]
    out = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(shares)), key=lambda i: (-(exact[i] - out[i]), i))
    for i in by_remainder[: total - sum(out)]:
        out[i] += 1
    return out


def draw_counts(available: list[int], sources: list[Source]) -> list[int]:
    """How many rows each source gives the training set, from its training rows `available`:
    `rows` exactly; `fraction` x available, rounded half up, at least 1; none of the three: all of them.
    The weighted sources together: the most rows they can give in proportion to their weights with no
    row drawn twice (the source with the fewest rows per unit of weight gives all of its own), split by
    largest remainder. A weighted source whose share rounds to 0 rows gets 0 (load_mixture refuses it)."""
    counts = []
    for n, s in zip(available, sources):
        if s.rows is not None:
            counts.append(int(s.rows))
        elif s.fraction is not None:
            counts.append(max(1, math.floor(_exact(s.fraction) * n + Fraction(1, 2))))
        else:
            counts.append(n)
    weighted = [i for i, s in enumerate(sources) if s.weight is not None]
    if weighted:
        weights = [_exact(sources[i].weight) for i in weighted]
        size = min(available[i] * sum(weights) / w for i, w in zip(weighted, weights))
        for i, c in zip(weighted, apportion(math.floor(size), weights)):
            counts[i] = c
    return counts


def draw_rows(n: int, count: int, seed: int, index: int) -> list[int]:
    """Which of a source's `n` training rows (0..n-1) the training set holds, `count` of them: whole
    passes over all n (in order), then the first rows of a permutation seeded by (seed, index), in
    order. count == n gives every row in order (a list of one source trains as that one path)."""
    passes, rest = divmod(count, n)
    out = list(range(n)) * passes
    if rest:
        order = list(range(n))
        random.Random(f"tunekit-draw:{seed}:{index}").shuffle(order)
        out += sorted(order[:rest])
    return out


# ----------------------------------------------------------------------------- the run's view
def fingerprint(value: Any, key: str = "data.path") -> str:
    """A hex digest that changes when any source's rows or settings change (what resume compares):
    data_fingerprint (tunekit.data.sources) of a single path as before; for a list, one digest over each
    source's settings and data_fingerprint."""
    from tunekit.data.sources import data_fingerprint

    if not is_mixture(value):
        return data_fingerprint(value, key)
    h = hashlib.sha256()
    for s in parse_sources(value):
        with naming(s):
            own = data_fingerprint(s.path, s.key)
        h.update(json.dumps({"path": s.path, **s.settings(), "data": own}, sort_keys=True).encode() + b"\0")
    return h.hexdigest()


def describe(value: Any) -> str:
    """data.path in words, for lines that name the run's data: the path, or "3 sources (a, b, c)"."""
    if not is_mixture(value):
        return str(value)
    names = [s.name for s in parse_sources(value)]
    return f"{len(names)} source{'s' if len(names) != 1 else ''} ({', '.join(names)})"


@dataclass
class SourceReport:
    """One source of a run's mix: what the log line and summary.json say of it."""

    source: Source
    available: int  # training rows it has (after its held-out rows and the rows data.max_seq_len dropped)
    drawn: int  # rows it gives the training set
    held_out: int  # held-out rows it gives the evaluation
    total: int  # rows of the whole training set

    def as_dict(self) -> dict:
        return {"name": self.source.name, "path": self.source.path, **self.source.settings(),
                "available": self.available, "drawn": self.drawn, "share": self.drawn / max(self.total, 1),
                "held_out": self.held_out}

    def line(self) -> str:
        passes = f", {self.drawn / self.available:.3g} passes over it" if self.drawn > self.available else ""
        return (f"data: source {self.source.name} ({self.source.path}, {self.source.amount()}): "
                f"{self.available} rows available, {self.drawn} drawn{passes} = "
                f"{100 * self.drawn / max(self.total, 1):.1f}% of {self.total} training rows; {self.held_out} held out")


# ----------------------------------------------------------------------------- reading and drawing
def _source_examples(s: Source, fmt: str, tokenizer, max_len: int, val_fraction: Optional[float], seed: int,
                     cache=None, num_proc: Optional[int] = None):
    """(training examples, held-out examples or None) of one source: its dataset's held-out split, else
    val_fraction of its rows; None where data.val_path holds out (val_fraction None). cache, num_proc:
    tunekit.data.tokenize_rows'."""
    from tunekit.data import hold_out, tokenize_rows
    from tunekit.data.formats import detect_format, read_rows

    own = s.format or fmt
    why = "as its first row" if own == "auto" else (f"format={own}" if s.format else f"data.format={own}")

    def tokenized(rows):
        return tokenize_rows(rows, detect_format(rows, s.path) if own == "auto" else own, s.path, tokenizer, max_len, why,
                             cache, num_proc)

    rows = read_rows(s.path, s.key, s.split)
    examples = tokenized(rows)
    if val_fraction is None:
        return examples, None
    if rows.held_out is not None:
        return examples, tokenized(rows.held_out)
    return hold_out(examples, val_fraction, seed, s.path)


def load_mixture(value: Any, val_path: Optional[str], fmt: str, tokenizer, max_len: int, val_fraction: float,
                 max_val_examples: Optional[int], seed: int, cache=None, num_proc: Optional[int] = None):
    """tunekit.data.load_splits for a list of sources: the drawn training rows of every source, the
    held-out rows of each (Splits.val_groups: each source's name and its rows of the held-out set;
    None where data.val_path holds out) and what was drawn (Splits.sources, SourceReports)."""
    from tunekit.data import Examples, Splits, tokenize_rows
    from tunekit.data.formats import DataError, detect_format, read_rows

    sources = parse_sources(value)
    cap = None if max_val_examples is None else -(-max_val_examples // len(sources))
    trains, vals = [], []
    for s in sources:
        with naming(s):
            train, val = _source_examples(s, fmt, tokenizer, max_len, None if val_path else val_fraction, seed, cache,
                                          num_proc)
        trains.append(train)
        vals.append(val if val is None or cap is None else val.subset(range(min(cap, len(val)))))
    counts = draw_counts([len(t) for t in trains], sources)
    for s, c, t in zip(sources, counts, trains):
        if c == 0:
            total = sum(x.weight for x in sources if x.weight is not None)
            raise DataError(f"{s.label}: weight {s.weight:g} of the weighted sources' {total:g} draws none of its "
                            f"{len(t)} rows (its share rounds to 0); raise its weight, or give it rows: N")
    drawn = [t.subset(draw_rows(len(t), c, seed, s.index)) for s, c, t in zip(sources, counts, trains)]
    train = Examples.joined(drawn)
    if val_path is None:
        val, groups, at = Examples.joined(vals), [], 0
        for s, v in zip(sources, vals):
            groups.append((s.name, list(range(at, at + len(v)))))
            at += len(v)
    else:
        rows = read_rows(val_path, key="data.val_path")
        why = "as its first row" if fmt == "auto" else f"data.format={fmt}"
        own = detect_format(rows, val_path) if fmt == "auto" else fmt
        val = tokenize_rows(rows, own, val_path, tokenizer, max_len, why, cache, num_proc)
        if max_val_examples is not None:
            val = val.subset(range(min(max_val_examples, len(val))))
        groups = None
    reports = [SourceReport(s, len(t), c, len(v) if v is not None else 0, len(train))
               for s, t, c, v in zip(sources, trains, counts, vals)]
    dropped = [t.dropped for t in trains if t.dropped is not None]
    held = vals if groups is not None else [val]  # a dataset's held-out split drops rows of its own
    dropped += [v.dropped for v in held if v is not None and v.dropped is not None]
    return Splits(train, val, dropped, sources=reports, val_groups=groups)
