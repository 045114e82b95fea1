"""Where rows come from (save_to_disk folders, hub ids) and rows that truncation leaves untrained."""

from __future__ import annotations

import json
import logging
import re

import datasets
import pytest
from transformers import AutoTokenizer

from tunekit.config import DataConfig
from tunekit.data.checks import check_data_files
from tunekit.data import IGNORE, DataError, load_splits, sources, tokenize_rows
from tunekit.data.formats import check_file, read_rows
from tunekit.data.tokenize import ensure_chat_template


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    t = AutoTokenizer.from_pretrained(tiny_model_dir)
    ensure_chat_template(t)
    return t


def qa(i: int, long: bool = False) -> dict:
    return {"instruction": ("word " * 200 if long else "") + f"What is {i} plus {i}?", "output": f"{2 * i}."}


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _trains(ex) -> bool:
    return any(label != IGNORE for label in ex["labels"][1:])


# ----------------------------------------------------------------------------- truncation report
def test_rows_truncated_to_no_trained_token_are_dropped_and_reported_once(tmp_path, tok, caplog):
    rows = [qa(i, long=i in (2, 5)) for i in range(1, 10)]
    path = _jsonl(tmp_path / "rows.jsonl", rows)
    with caplog.at_level(logging.INFO, logger="tunekit"):
        splits = load_splits(str(path), None, "auto", tok, 64, 0.25, None, 0)
    train, val = splits
    assert len(train) + len(val) == 7 and all(_trains(e) for e in train + val)
    [dropped] = splits.dropped
    assert (dropped.path, dropped.rows, dropped.total, dropped.max_len) == (str(path), ["row 2", "row 5"], 9, 64)
    lines = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert lines == [f"{path}: 2 of 9 rows dropped: no trained token within data.max_seq_len=64 "
                     "(their replies start past it): row 2, row 5"]


def test_rows_cut_but_still_trained_are_counted_with_the_trained_tokens_they_lose(tmp_path, tok):
    """Text rows train on every token: a row of n words is n tokens plus an EOS, of which all but the
    first are trained tokens. At data.max_seq_len=16, rows of 30, 20 and 16 words lose 15, 5 and 1
    trained tokens; rows of 5 and 15 words fit. A chat row cut after its reply's <|im_end|> loses
    context only (ChatML's newline): cut, 0 lost. Each split counts its own rows."""
    words = (5, 30, 20, 16, 15)
    rows = [{"text": " ".join(["word"] * n)} for n in words]
    assert [len(tok(r["text"])["input_ids"]) for r in rows] == list(words)  # one token a word, no BOS
    ex = tokenize_rows(rows, "text", "t.jsonl", tok, 16)
    assert ex.truncation().as_dict() == {"rows": 5, "truncated_rows": 3, "trained_tokens": 5 + 15 * 4,
                                         "trained_tokens_lost": 15 + 5 + 1}
    assert ex.truncation().phrase("training") == "3 of 5 training rows cut, losing 21 of 86 trained tokens (24.4%)"

    chat = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}
    [whole] = tokenize_rows([chat], "chat", "c.jsonl", tok, 512)
    assert tok.decode(whole["input_ids"][-2:]) == "<|im_end|>\n" and whole["labels"][-1] == IGNORE
    cut = tokenize_rows([chat], "chat", "c.jsonl", tok, len(whole["input_ids"]) - 1)
    assert cut.truncation().as_dict() == {"rows": 1, "truncated_rows": 1, "trained_tokens": 3, "trained_tokens_lost": 0}
    assert cut[0]["labels"] == whole["labels"][:-1]

    train = _jsonl(tmp_path / "train.jsonl", rows)
    val = _jsonl(tmp_path / "val.jsonl", [rows[1], rows[0]])
    splits = load_splits(str(train), str(val), "auto", tok, 16, 0.1, 1, 0)  # max_val_examples=1: the first
    assert splits.train.truncation() == ex.truncation()
    assert splits.val.truncation().as_dict() == {"rows": 1, "truncated_rows": 1, "trained_tokens": 15,
                                                 "trained_tokens_lost": 15}
    held = load_splits(str(train), None, "auto", tok, 16, 0.4, None, 0)  # the file split in two: counts split too
    both = [held.train.truncation(), held.val.truncation()]
    assert [t.rows for t in both] == [3, 2] and sum(t.truncated_rows for t in both) == 3
    assert sum(t.trained_tokens_lost for t in both) == 21


def test_multi_turn_row_cut_in_its_second_reply_trains_the_first(tok):
    chat = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                         {"role": "user", "content": "word " * 100}, {"role": "assistant", "content": "Bye."}]}
    [ex] = tokenize_rows([chat], "chat", "x.jsonl", tok, 64)
    trained = tok.decode([t for t, label in zip(ex["input_ids"], ex["labels"]) if label != IGNORE])
    assert trained == "Hello." + tok.eos_token and len(ex["input_ids"]) == 64


def test_report_names_a_few_rows_and_val_files_report_their_own(tmp_path, tok):
    train = _jsonl(tmp_path / "train.jsonl", [qa(i, long=i % 2 == 0) for i in range(20)])
    val = _jsonl(tmp_path / "val.jsonl", [qa(1), qa(2, long=True), qa(3)])
    splits = load_splits(str(train), str(val), "auto", tok, 64, 0.1, None, 0)
    assert [len(d.rows) for d in splits.dropped] == [10, 1] and len(splits.train) == 10 and len(splits.val) == 2
    assert splits.dropped[0].line().endswith("row 1, row 3, row 5, row 7, row 9, ...")
    assert splits.dropped[1].line().startswith(f"{val}: 1 of 3 rows dropped")


def test_all_rows_truncated_is_one_error(tmp_path, tok):
    path = _jsonl(tmp_path / "long.jsonl", [qa(i, long=True) for i in range(4)])
    culprit = f"{path}: no usable rows: none of its 4 rows keeps a response token within data.max_seq_len=64"
    with pytest.raises(DataError, match="^" + re.escape(culprit)):
        load_splits(str(path), None, "auto", tok, 64, 0.25, None, 0)


# ----------------------------------------------------------------------------- save_to_disk folders
def test_a_saved_dataset_trains_as_the_same_rows_in_a_file(tmp_path, tok):
    rows = [qa(i) for i in range(10)]
    folder = tmp_path / "saved"
    datasets.Dataset.from_list(rows).save_to_disk(str(folder))
    check_data_files(DataConfig(path=str(folder), max_seq_len=64, val_fraction=0.2))  # the config check accepts it
    assert check_file(folder, "auto", "data.path") == (10, "alpaca")
    got = load_splits(str(folder), None, "auto", tok, 64, 0.2, None, 0)
    want = load_splits(str(_jsonl(tmp_path / "same.jsonl", rows)), None, "auto", tok, 64, 0.2, None, 0)
    assert tuple(got) == tuple(want)


@pytest.mark.parametrize("held", ["validation", "test"])
def test_a_saved_dataset_dict_gives_its_held_out_split(tmp_path, tok, held):
    train_rows, held_rows = [qa(i) for i in range(6)], [qa(i) for i in range(100, 103)]
    folder = tmp_path / "dd"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(train_rows),
                          held: datasets.Dataset.from_list(held_rows)}).save_to_disk(str(folder))
    check_data_files(DataConfig(path=str(folder), max_seq_len=64))
    train, val = load_splits(str(folder), None, "auto", tok, 64, 0.5, None, 0)
    assert train == tokenize_rows(train_rows, "alpaca", "x", tok, 64)  # every train row, none held out
    assert val == tokenize_rows(held_rows, "alpaca", "x", tok, 64)
    _, val = load_splits(str(_jsonl(tmp_path / "t.jsonl", train_rows)), str(folder), "auto", tok, 64, 0.5, None, 0)
    assert val == tokenize_rows(held_rows, "alpaca", "x", tok, 64)  # as data.val_path: the held-out split


def test_saved_dataset_errors_name_folder_split_and_row(tmp_path):
    bad = tmp_path / "bad"
    datasets.DatasetDict({"train": datasets.Dataset.from_list([qa(1), qa(2)]),
                          "validation": datasets.Dataset.from_list([qa(3), {"instruction": "q", "output": ""}])}
                         ).save_to_disk(str(bad))
    culprit = f"{bad}: row 2 of split 'validation': 'output' must be a non-empty string"
    with pytest.raises(DataError, match="^" + re.escape(culprit)):
        check_data_files(DataConfig(path=str(bad)))
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "train.jsonl").write_text(json.dumps(qa(1)) + "\n")
    culprit = f"data.path: {plain} is a folder, and not one datasets' save_to_disk wrote"
    with pytest.raises(DataError, match="^" + re.escape(culprit)):
        read_rows(plain)
    splits = tmp_path / "splits"
    datasets.DatasetDict({"a": datasets.Dataset.from_list([qa(1)]),
                          "b": datasets.Dataset.from_list([qa(2)])}).save_to_disk(str(splits))
    with pytest.raises(DataError, match=r"^data.path: .*splits has splits \['a', 'b'\] but no 'train' split"):
        read_rows(splits)


# ----------------------------------------------------------------------------- hub ids
def test_a_hub_id_loads_with_load_dataset(tmp_path, tok, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no local path named like the id
    monkeypatch.setattr(sources, "_LOADED", {})
    calls = []

    def load_dataset(name, *args, **kw):
        calls.append(name)
        return datasets.DatasetDict({"train": datasets.Dataset.from_list([qa(i) for i in range(8)])})

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    check_data_files(DataConfig(path="tatsu-lab/alpaca", max_seq_len=64, val_fraction=0.25))
    train, val = load_splits("tatsu-lab/alpaca", None, "auto", tok, 64, 0.25, None, 0)
    assert (len(train), len(val)) == (6, 2) and calls == ["tatsu-lab/alpaca"]  # loaded once for both


def test_an_unreachable_hub_is_one_error_naming_the_id(tmp_path, tok, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sources, "_LOADED", {})
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the real load_dataset, answering at once
    with pytest.raises(DataError) as err:
        check_data_files(DataConfig(path="tunekit-tests/no-such-dataset"))
    msg = str(err.value)
    assert msg.startswith(f"data.path: 'tunekit-tests/no-such-dataset' is not a local file or folder "
                          f"(no {tmp_path}/tunekit-tests/no-such-dataset), and the Hugging Face hub could not be "
                          "reached") and "\n" not in msg
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(sources, "_hub_resolves", lambda: False)  # no name lookup: no 25 s of retries
    with pytest.raises(DataError, match="hub could not be reached to load it as a dataset id .its host name does "):
        load_splits("tatsu-lab/alpaca", None, "auto", tok, 64, 0.25, None, 0)


def test_a_hub_that_has_no_such_dataset_says_so(tmp_path, monkeypatch):
    from datasets.exceptions import DatasetNotFoundError

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sources, "_LOADED", {})
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(sources, "_hub_resolves", lambda: True)

    def missing(name, *args, **kw):
        raise DatasetNotFoundError(f"Dataset '{name}' doesn't exist on the Hub or cannot be accessed.")

    monkeypatch.setattr(datasets, "load_dataset", missing)
    with pytest.raises(DataError, match=r"^data.val_path: 'me/typo' is not a local file or folder .*, and the hub "
                                        r"has no dataset 'me/typo'"):
        read_rows("me/typo", key="data.val_path")
    with pytest.raises(DataError, match=r"^data.path: file not found: me/typo.jsonl"):  # a file name: never the hub
        read_rows("me/typo.jsonl")


def test_data_fingerprint_tracks_the_rows_behind_a_path(tmp_path, monkeypatch):
    """What resume compares: a file's SHA-256 as before (old checkpoints still match), and a digest
    of a saved folder's files or a hub dataset's splits that moves when the rows do."""
    import hashlib

    from tunekit.data.sources import data_fingerprint

    path = _jsonl(tmp_path / "rows.jsonl", [qa(1)])
    assert data_fingerprint(path) == hashlib.sha256(path.read_bytes()).hexdigest()  # what checkpoints record
    folder = tmp_path / "saved"
    datasets.Dataset.from_list([qa(1), qa(2)]).save_to_disk(str(folder))
    before = data_fingerprint(folder)
    assert data_fingerprint(folder) == before
    datasets.Dataset.from_list([qa(1), qa(3)]).save_to_disk(str(tmp_path / "other"))
    assert data_fingerprint(tmp_path / "other") != before
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sources, "_LOADED", {})
    monkeypatch.setattr(datasets, "load_dataset", lambda name: datasets.DatasetDict(
        {"train": datasets.Dataset.from_list([qa(1)]), "test": datasets.Dataset.from_list([qa(2)])}))
    hub = data_fingerprint("some/dataset")
    assert len(hub) == 64 and hub == data_fingerprint("some/dataset")
