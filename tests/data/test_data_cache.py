"""The tokenized cache: its key, the round trip, entries a killed or foreign writer left, `tunekit data
prepare` (whose 2 worker processes must give the examples of 1), and packed rows' count."""

from __future__ import annotations

import json
import logging
import socket

import pytest
from transformers import AutoTokenizer

import tunekit.data.cache as cache_mod
from tunekit.data import TokenCache, load_splits, tokenize_rows
from tunekit.data.batching import pack_rows
from tunekit.data.formats import Rows, read_rows
from tunekit.data.tokenize import ensure_chat_template
from tunekit.owned import MAGIC, MARKER, PREFIX

from _helpers import run_cli


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    t = AutoTokenizer.from_pretrained(tiny_model_dir)
    ensure_chat_template(t)
    return t


def _rows() -> Rows:
    """Rows that fit, rows cut at 40 tokens, and rows whose reply starts past 40 (dropped), each labelled as
    a file with blank lines would label them."""
    rows = [{"instruction": f"What is {i} plus {i}?", "output": f"{2 * i}." + " It is easy." * (i % 4)}
            for i in range(6)]
    rows[2] = {"instruction": "Tell me. " * 30, "output": "No."}  # its reply starts past 40 tokens
    rows[4] = {"instruction": "Tell me. " * 40, "output": "No."}
    return Rows(rows, [f"row {i + 1} (line {i + 3})" for i in range(len(rows))])


def test_each_part_of_the_key_changes_it(tok, tiny_model_dir, monkeypatch):
    rows = _rows()
    key, parts = cache_mod.cache_key(rows, "alpaca", tok, 40)
    assert set(parts) == {"rows", "format", "tokenizer", "chat_template", "max_seq_len", "code"}
    same = Rows([dict(r) for r in rows], [f"row {i}" for i in range(len(rows))])  # other labels, same content
    assert cache_mod.cache_key(same, "alpaca", tok, 40)[0] == key
    changed = Rows([dict(r) for r in rows], rows.labels)
    changed[5]["output"] += "!"
    assert cache_mod.cache_key(changed, "alpaca", tok, 40)[0] != key
    assert cache_mod.cache_key(rows[:-1], "alpaca", tok, 40)[0] != key  # one row fewer
    assert cache_mod.cache_key(rows, "chat", tok, 40)[0] != key
    assert cache_mod.cache_key(rows, "alpaca", tok, 41)[0] != key
    other = AutoTokenizer.from_pretrained(tiny_model_dir)
    ensure_chat_template(other)
    assert cache_mod.cache_key(rows, "alpaca", other, 40)[0] == key  # another load of the same tokenizer
    other.chat_template = tok.chat_template.replace("<|im_start|>", "<|im_start|> ", 1)
    assert cache_mod.cache_key(rows, "alpaca", other, 40)[0] != key
    other.chat_template = tok.chat_template
    other.add_tokens(["<new-token>"])
    assert cache_mod.cache_key(rows, "alpaca", other, 40)[0] != key
    fresh = AutoTokenizer.from_pretrained(tiny_model_dir)
    fresh.chat_template = tok.chat_template
    fresh.eos_token = "<|endoftext|>"  # another EOS: another end of each text row
    assert cache_mod.cache_key(rows, "alpaca", fresh, 40)[0] != key
    import transformers

    monkeypatch.setattr(transformers, "__version__", transformers.__version__ + ".post1")
    assert cache_mod.cache_key(rows, "alpaca", tok, 40)[0] != key


def _lines(caplog, word: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if word in r.getMessage()]


def test_examples_from_the_cache_are_those_of_a_fresh_tokenization(tok, tmp_path, tiny_data, caplog):
    rows = _rows()
    with caplog.at_level(logging.INFO, logger="tunekit"):
        fresh = tokenize_rows(rows, "alpaca", "x.jsonl", tok, 40)
        cache = TokenCache(tmp_path / "c")
        stored = tokenize_rows(rows, "alpaca", "x.jsonl", tok, 40, cache=cache)
        assert not _lines(caplog, "from cache")
        caplog.clear()
        again = TokenCache(tmp_path / "c")
        cached = tokenize_rows(rows, "alpaca", "x.jsonl", tok, 40, cache=again)
    [(_, what, folder)] = again.events
    assert what == "hit" and _lines(caplog, "from cache") == [f"tokenized rows from cache {folder}"]
    assert cache.events[0][1] == "written" and cache.events[0][2] == folder
    for got in (stored, cached):
        assert got == fresh and got.lost == fresh.lost and got.truncation() == fresh.truncation()
        assert got.dropped == fresh.dropped
    assert fresh.truncation().truncated_rows >= 1 and fresh.dropped.rows == ["row 3 (line 5)", "row 5 (line 7)"]
    assert _lines(caplog, "dropped") == [fresh.dropped.line()]  # reported from the cache as without it
    # a whole split: the examples split by seed as fresh ones
    want = load_splits(str(tiny_data), None, "auto", tok, 64, 0.2, None, 0)
    for _ in range(2):
        got = load_splits(str(tiny_data), None, "auto", tok, 64, 0.2, None, 0, cache=TokenCache(tmp_path / "c"))
        assert got == want and got.train.lost == want.train.lost and got.val.lost == want.val.lost


def test_a_killed_write_a_damaged_entry_and_a_foreign_folder_are_never_trusted(tok, tmp_path, caplog):
    rows = _rows()
    fresh = tokenize_rows(rows, "alpaca", "x.jsonl", tok, 40)
    root = tmp_path / "c"
    entry = TokenCache(root).entry("x.jsonl", rows, "alpaca", tok, 40)
    # what a write killed halfway leaves: its marked scratch folder (a dead pid), the data half there
    scratch = root / f"{PREFIX}{entry.key[:64]}-abc"
    (scratch / "new").mkdir(parents=True)
    (scratch / "new" / cache_mod.DATA).write_bytes(b"half")
    (scratch / MARKER).write_text(json.dumps({"tunekit": MAGIC, "pid": 2 ** 30, "host": socket.gethostname(),
                                              "target": entry.key}))
    with caplog.at_level(logging.INFO, logger="tunekit"):
        cache = TokenCache(root)
        assert tokenize_rows(rows, "alpaca", "x.jsonl", tok, 40, cache=cache) == fresh
        assert cache.events[0][1] == "written" and not scratch.exists()  # the leftover is gone
        # a damaged entry of tunekit's: warned, tokenized, replaced
        data = entry.folder / cache_mod.DATA
        data.write_bytes(data.read_bytes()[:-8])
        cache = TokenCache(root)
        assert tokenize_rows(rows, "alpaca", "x.jsonl", tok, 40, cache=cache) == fresh
        assert [w for _, w, _ in cache.events] == ["written"]
        assert len(_lines(caplog, "damaged tokenized-cache entry")) == 1
        cache = TokenCache(root)
        assert tokenize_rows(rows, "alpaca", "x.jsonl", tok, 40, cache=cache) == fresh
        assert [w for _, w, _ in cache.events] == ["hit"]
        # a folder under the key's name that tunekit did not write: warned, used for nothing, left as it is
        other = tmp_path / "other"
        foreign = TokenCache(other).entry("x.jsonl", rows, "alpaca", tok, 40).folder
        foreign.mkdir(parents=True)
        (foreign / cache_mod.DATA).write_bytes(data.read_bytes())  # even a copy of real data: no manifest
        cache = TokenCache(other)
        assert tokenize_rows(rows, "alpaca", "x.jsonl", tok, 40, cache=cache) == fresh
    assert [w for _, w, _ in cache.events] == ["skipped"] and len(_lines(caplog, "not an entry of tunekit's")) == 1
    assert sorted(p.name for p in foreign.iterdir()) == [cache_mod.DATA]


def test_data_prepare_fills_the_cache_with_2_processes_as_1_would(tiny_model_dir, tiny_data, tmp_path, tok):
    r = run_cli(["data", "prepare", "recipe=lora", f"model.path={tiny_model_dir}", f"data.path={tiny_data}",
                 "data.max_seq_len=40", "data.val_fraction=0.2", f"data.cache_dir={tmp_path / 'c'}", "data.num_proc=2"],
                cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    rows = read_rows(str(tiny_data))
    one = tokenize_rows(rows, "alpaca", str(tiny_data), tok, 40, num_proc=1)
    # cuts, and drops spread over most of the 8 chunks the 2 workers share
    assert one.truncation().truncated_rows > 0 and len(one.dropped.rows) > len(rows) // 2
    entry = TokenCache(tmp_path / "c").entry(str(tiny_data), rows, "alpaca", tok, 40)
    two = entry.load()  # what the 2 worker processes tokenized
    assert two is not None and two.examples == list(one) and two.lost == one.lost
    assert [f"row {i + 1}" for i in two.dropped] == one.dropped.rows  # 38 of 48 rows dropped, in both chunks
    held = max(1, int(len(one) * 0.2))
    out = r.stdout
    assert f"train: {len(one) - held} examples" in out and f"held-out: {held} examples" in out
    assert f"dropped: {one.dropped.line()}" in out and "data.max_seq_len=40: " in out
    assert "packing at data.max_seq_len=40: the " in out
    assert f"cache: {tiny_data}: cached in {entry.folder}" in out and "tokenized rows from cache" not in r.stderr


def test_packed_rows_are_counted_best_fit_decreasing():
    assert pack_rows([5, 3, 5, 3, 2], 8) == 3  # 5+3, 5+3, 2
    assert pack_rows([8, 8, 1], 8) == 3
    assert pack_rows([4, 4, 4, 4], 8) == 2
    assert pack_rows([6, 2, 5, 3, 4, 4], 8) == 3  # 6+2, 5+3, 4+4: each row full
    assert pack_rows([], 8) == 0
