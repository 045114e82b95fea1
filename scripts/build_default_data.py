"""Build tunekit's embedded default dataset from the chatterbot-corpus package.

chatterbot-corpus (BSD-3-Clause, https://github.com/gunthercox/chatterbot-corpus) ships ~2k
English question/answer pairs as YAML. We turn them into alpaca-style rows
({"instruction", "input", "output"}), drop exact duplicates and degenerate pairs, shuffle with a
fixed seed and hold out a validation split stratified by topic, so every topic is seen in both.

Run once by a maintainer; its output is committed under tunekit/data/default/:

    pip install --no-deps chatterbot-corpus==1.3.3 pyyaml
    python scripts/build_default_data.py
"""

from __future__ import annotations

import argparse
import json
import random
from importlib.util import find_spec
from pathlib import Path

import yaml

OUT = Path(__file__).resolve().parents[1] / "tunekit" / "data" / "default"


def corpus_dir() -> Path:
    spec = find_spec("chatterbot_corpus")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("chatterbot-corpus is not installed: pip install --no-deps chatterbot-corpus==1.3.3")
    return Path(list(spec.submodule_search_locations)[0]) / "data" / "english"


def pairs_from(path: Path) -> list[dict]:
    doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    rows = []
    for conv in doc.get("conversations") or []:
        # A conversation is a list of turns; each consecutive (turn, next turn) is a Q/A pair.
        turns = [str(t).strip() for t in conv if t is not None and str(t).strip()]
        for q, a in zip(turns, turns[1:]):
            rows.append({"instruction": q, "input": "", "output": a, "topic": path.stem})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--val-fraction", type=float, default=0.08)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    seen, rows = set(), []
    for path in sorted(corpus_dir().glob("*.yml")):
        for row in pairs_from(path):
            key = (row["instruction"].lower(), row["output"].lower())
            if key in seen or len(row["output"]) < 2:
                continue
            seen.add(key)
            rows.append(row)

    rng = random.Random(args.seed)
    by_topic: dict[str, list[dict]] = {}
    for row in rows:
        by_topic.setdefault(row["topic"], []).append(row)
    train, val = [], []
    for topic in sorted(by_topic):
        group = by_topic[topic]
        rng.shuffle(group)
        n_val = max(1, round(len(group) * args.val_fraction))
        val += group[:n_val]
        train += group[n_val:]
    rng.shuffle(train)
    rng.shuffle(val)

    OUT.mkdir(parents=True, exist_ok=True)
    for name, split in (("train", train), ("val", val)):
        with open(OUT / f"{name}.jsonl", "w", encoding="utf-8") as f:
            for row in split:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"wrote {len(train)} train and {len(val)} val rows to {OUT}")


if __name__ == "__main__":
    main()
