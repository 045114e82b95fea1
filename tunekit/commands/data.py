"""`tunekit data prepare [overrides...]`: tokenize a run's rows into the tokenized cache ahead of time.

The overrides compose as for `tunekit train` (recipes/ + key=value, the same checks of the data.*
keys and rows). Only the tokenizer loads, never the model's weights. The rows are tokenized as the
run will tokenize them (data.max_seq_len, data.format, the chat template, data.num_proc) and stored
in the cache (data.cache_dir), so that `tunekit train` with the same data starts without tokenizing.
Printed: examples and tokens per split, the rows data.max_seq_len cuts or drops, and how full packed
rows of data.max_seq_len slots would be.
"""

from __future__ import annotations

import sys
import time

from tunekit import TunekitError
from tunekit.config import plain

USAGE = """usage: tunekit data prepare [key=value ...]

Tokenize the rows a run of the same overrides trains on, once, into the tokenized cache
(data.cache_dir; default ~/.cache/tunekit/tokenized): `tunekit train` with the same data, tokenizer,
format and data.max_seq_len then starts without tokenizing. Loads the tokenizer only.

examples:
  tunekit data prepare recipe=qlora data.path=train.jsonl
  tunekit data prepare recipe=lora data.path=train.jsonl model.path=/models/llama data.max_seq_len=2048
  tunekit data prepare data.path=big.jsonl data.num_proc=8        # 8 processes tokenize"""


def check_for_prepare(cfg) -> None:
    """What `prepare` needs of a config: every key's value, the cache folder, every data row (no model)."""
    from tunekit.data.checks import check_data_files
    from tunekit.train.checks import check_cache_dir, check_settings

    check_settings(cfg)
    check_cache_dir(cfg)
    check_data_files(cfg.data)


def tokenizer_source(cfg) -> tuple[str, str]:
    """(folder, key) whose tokenizer the run tokenizes with: the student's, which a cut of the teacher
    (distill.student_keep_every) shares with the teacher."""
    from tunekit.model.folder import resolve_model_path

    if cfg.objective == "distill" and cfg.distill.student_keep_every:
        return resolve_model_path(cfg.distill.teacher, key="distill.teacher"), "distill.teacher"
    return resolve_model_path(cfg.model.path), "model.path"


def report(cfg, splits, cache, seconds: float) -> str:
    """The lines `prepare` prints: per split examples and tokens, cuts, drops, packing, the cache."""
    from tunekit.data import IGNORE
    from tunekit.data.batching import pack_rows

    d = cfg.data
    lines = [r.line() for r in splits.sources or []]  # a list of sources: what each has, gives and holds out
    for name, examples in (("train", splits.train), ("held-out", splits.val)):
        tokens = sum(len(e["input_ids"]) for e in examples)
        trained = sum(sum(label != IGNORE for label in e["labels"][1:]) for e in examples)
        lines.append(f"{name}: {len(examples):,} examples, {tokens:,} tokens, {trained:,} trained")
    lines.append(f"data.max_seq_len={d.max_seq_len}: {splits.train.truncation().phrase('training')}, "
                 f"{splits.val.truncation().phrase('held-out')}")
    lines += [f"dropped: {dropped.line()}" for dropped in splits.dropped]
    lengths = [len(e["input_ids"]) for e in splits.train]
    rows = pack_rows(lengths, d.max_seq_len)
    slots = rows * d.max_seq_len
    trained = splits.train.truncation().trained_tokens
    lines.append(f"packing at data.max_seq_len={d.max_seq_len}: the {len(lengths):,} training examples fill {rows:,} "
                 f"rows of {d.max_seq_len} slots: input tokens take {100 * sum(lengths) / slots:.1f}% of the slots, "
                 f"trained tokens {100 * trained / slots:.1f}%")
    if cache is None:
        lines.append("cache: off (data.cache=false): nothing stored")
    else:
        said = {"hit": "already cached", "written": "cached", "skipped": "not cached (see the warning above)"}
        lines += [f"cache: {name}: {said[what]} in {folder}" for name, what, folder in cache.events]
    lines.append(f"done in {seconds:.1f} s")
    return "\n".join(lines)


def prepare(cfg) -> str:
    from tunekit.data import load_splits
    from tunekit.data.cache import cache_for
    from tunekit.model.loader import load_tokenizer

    if cfg.objective == "preference":
        raise TunekitError("data prepare: objective=preference: preference pairs are tokenized by the run itself and "
                           "not cached; data prepare tokenizes the rows of objective=sft or distill")
    start = time.perf_counter()
    folder, key = tokenizer_source(cfg)
    tokenizer = load_tokenizer(folder, key)
    d = cfg.data
    if d.chat_template is not None:  # the run's tokenizer: its template and tokens (the cache keys on both)
        from tunekit.data.templates import use_template

        use_template(tokenizer, d.chat_template)
    cache = cache_for(d.cache, d.cache_dir)
    splits = load_splits(d.path, d.val_path, plain(d.format), tokenizer, d.max_seq_len, d.val_fraction,
                         d.max_val_examples, cfg.seed, cache=cache, num_proc=d.num_proc)
    return report(cfg, splits, cache, time.perf_counter() - start)


def main(argv: list[str]) -> None:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return
    action, overrides = argv[0], argv[1:]
    if action != "prepare":
        raise TunekitError(f"data {action}: unknown action; tunekit data prepare [key=value ...] (tunekit data --help)")
    if {"-h", "--help"} & set(overrides):
        print(USAGE)
        return
    flags = [a for a in overrides if a.startswith("-")]
    if flags:
        raise TunekitError(f"data prepare: {flags[0]}: unknown flag; data prepare takes key=value overrides only "
                           "(tunekit data --help)")
    from tunekit.commands.compose import compose_configs

    (cfg,) = compose_configs(overrides, check=check_for_prepare)
    print(prepare(cfg))
    sys.stdout.flush()
