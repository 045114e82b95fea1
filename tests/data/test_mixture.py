"""data.path as a list of sources (tunekit.data.mixture): the draw, each source held out and
evaluated apart, the fingerprint, and one short run through the CLI."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest
from transformers import AutoTokenizer

from _helpers import read_jsonl, run_cli, tiny_args
from tunekit import TunekitError
from tunekit.data import BatchSchedule, DataError, load_splits
from tunekit.data.mixture import Source, draw_counts, draw_rows, fingerprint, parse_sources
from tunekit.data.sources import data_fingerprint
from tunekit.data.tokenize import ensure_chat_template


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    t = AutoTokenizer.from_pretrained(tiny_model_dir)
    ensure_chat_template(t)
    return t


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def two_files(tmp_path):
    """a: 20 alpaca rows; b: 10 prompt/completion rows (another format, to tell the sources' rows apart)."""
    a = _jsonl(tmp_path / "a.jsonl", [{"instruction": f"What is {i} plus {i}?", "output": f"{2 * i}."}
                                      for i in range(20)])
    b = _jsonl(tmp_path / "b.jsonl", [{"prompt": f"Story number {i}", "completion": "It ends here."}
                                      for i in range(10)])
    return a, b


def _src(**kw) -> Source:
    return Source(kw.pop("index", 0), "x.jsonl", "x", **kw)


# ----------------------------------------------------------------------------- the sources' values
def test_sources_are_strings_or_mappings_named_by_stem_or_name():
    got = parse_sources(["data/a.jsonl", {"path": "d/b.parquet", "weight": 2, "name": "bee", "format": "alpaca"},
                         {"path": "org/dataset", "split": "train", "rows": 5}])
    assert [(s.index, s.name, s.path) for s in got] == [(0, "a", "data/a.jsonl"), (1, "bee", "d/b.parquet"),
                                                         (2, "dataset", "org/dataset")]
    assert got[1].settings() == {"name": "bee", "format": "alpaca", "weight": 2}
    assert got[2].settings() == {"split": "train", "rows": 5} and got[0].amount() == "every row"


@pytest.mark.parametrize("value, message", [
    ([{"path": "a.jsonl", "wieght": 3}], r"^data.path\[0\] \(a.jsonl\): unknown key 'wieght'"),
    (["a.jsonl", {"path": "b.jsonl", "weight": 0}], r"^data.path\[1\] \(b.jsonl\): weight: must be > 0, got 0"),
    ([{"path": "b.jsonl", "weight": -1.5}], r"^data.path\[0\] \(b.jsonl\): weight: must be > 0, got -1.5"),
    ([{"path": "b.jsonl", "weight": 2, "rows": 5}], r"^data.path\[0\] \(b.jsonl\): both weight and rows"),
    ([{"path": "b.jsonl", "fraction": 1.5}], r"^data.path\[0\] \(b.jsonl\): fraction: must be in \(0, 1\], got 1.5"),
    ([{"path": "b.jsonl", "fraction": 0}], r"^data.path\[0\] \(b.jsonl\): fraction: must be in \(0, 1\], got 0"),
    ([{"path": "b.jsonl", "rows": 2.5}], r"^data.path\[0\] \(b.jsonl\): rows: must be an integer"),
    ([{"weight": 2}], r"^data.path\[0\]: a source mapping needs 'path'"),
    (["x/a.jsonl", "y/a.jsonl"],
     r"^data.path\[1\] \(y/a.jsonl\): its name 'a' is also data.path\[0\] \(x/a.jsonl\)'s"),
    ([], r"^data.path: an empty list of sources"),
    ([3], r"^data.path\[0\]: a source is a data path or a mapping"),
])
def test_a_bad_source_is_one_error_naming_its_index_and_path(value, message):
    with pytest.raises(TunekitError, match=message):
        parse_sources(value)


# ----------------------------------------------------------------------------- the draw
def test_rows_are_drawn_exactly_and_fractions_rounded_half_up():
    sources = [_src(rows=7), _src(rows=3), _src(fraction=0.5), _src(fraction=0.01), _src()]
    assert draw_counts([3, 100, 7, 10, 6], sources) == [7, 3, 4, 1, 6]


@pytest.mark.parametrize("available, weights", [
    ([100, 100], [3, 1]), ([10, 1000, 37], [1, 1, 1]), ([50, 80, 13], [0.2, 0.5, 0.3]), ([7, 9], [1e-3, 2.5e-3])])
def test_weights_share_the_rows_in_proportion_within_rounding_and_repeat_none(available, weights):
    sources = [_src(index=i, weight=w) for i, w in enumerate(weights)]
    counts = draw_counts(available, sources)
    exact = [Fraction(repr(w)) for w in weights]
    total = sum(counts)
    # largest remainder: each within one row of its exact share of the total, none past its own rows
    assert all(abs(c - total * w / sum(exact)) < 1 for c, w in zip(counts, exact))
    assert all(c <= n for c, n in zip(counts, available))
    # as many as the weights allow: the source with the fewest rows per unit of weight gives all of them
    limiting = min(range(len(weights)), key=lambda i: Fraction(available[i]) / exact[i])
    assert counts[limiting] == available[limiting]


def test_weighted_and_fixed_sources_mix():
    counts = draw_counts([40, 40, 10], [_src(weight=1), _src(weight=3), _src(rows=25)])
    assert counts == [13, 40, 25]  # 40 x 4/3 = 53.3 -> 53 rows, split 13.3 : 40


def test_the_same_seed_draws_the_same_rows():
    assert draw_rows(50, 10, seed=0, index=1) == draw_rows(50, 10, seed=0, index=1)
    assert draw_rows(50, 10, seed=0, index=1) != draw_rows(50, 10, seed=1, index=1)
    assert draw_rows(50, 10, seed=0, index=1) != draw_rows(50, 10, seed=0, index=2)
    assert draw_rows(6, 6, seed=3, index=0) == list(range(6))  # every row: the source as it is
    more = draw_rows(4, 10, seed=0, index=0)  # two whole passes, then 2 rows of a third
    assert more[:8] == [0, 1, 2, 3] * 2 and len(more) == 10 and len(set(more[8:])) == 2


# ----------------------------------------------------------------------------- the splits
def _ids(examples) -> list[tuple]:
    return [tuple(e["input_ids"]) for e in examples]


def test_each_source_is_held_out_apart_and_drawn_the_same_again(two_files, tok):
    a, b = two_files
    value = [{"path": str(a), "rows": 30}, {"path": str(b), "fraction": 0.5, "name": "stories"}]
    splits = load_splits(value, None, "auto", tok, 64, 0.2, None, seed=0)
    # a: 4 of 20 held out, 16 train -> 30 drawn (one pass and 14); b: 2 of 10 held out, 8 -> 4 drawn
    assert [(r.source.name, r.available, r.drawn, r.held_out) for r in splits.sources] == [
        ("a", 16, 30, 4), ("stories", 8, 4, 2)]
    assert [(name, len(rows)) for name, rows in splits.val_groups] == [("a", 4), ("stories", 2)]
    story = tok("Story", add_special_tokens=False)["input_ids"][0]
    is_story = [story in e["input_ids"] for e in splits.val]
    assert is_story == [False] * 4 + [True] * 2  # each group holds its own source's rows
    assert sum(story in e["input_ids"] for e in splits.train) == 4
    assert not set(_ids(splits.val)) & set(_ids(splits.train))  # held-out rows never train
    again = load_splits(value, None, "auto", tok, 64, 0.2, None, seed=0)  # a resumed run's draw
    assert _ids(again.train) == _ids(splits.train) and _ids(again.val) == _ids(splits.val)
    other = load_splits(value, None, "auto", tok, 64, 0.2, None, seed=1)
    assert _ids(other.train) != _ids(splits.train)


def test_a_resumed_run_trains_the_rest_of_the_same_order(two_files, tok):
    a, b = two_files
    train = load_splits([{"path": str(a), "weight": 1}, {"path": str(b), "weight": 1}], None, "auto", tok, 64,
                        0.2, None, seed=5).train
    lengths = [len(e["input_ids"]) for e in train]
    whole = BatchSchedule(lengths, 2, 2, 1, 0, seed=5)
    again = load_splits([{"path": str(a), "weight": 1}, {"path": str(b), "weight": 1}], None, "auto", tok, 64,
                        0.2, None, seed=5).train
    resumed = BatchSchedule([len(e["input_ids"]) for e in again], 2, 2, 1, 0, seed=5, resumed=(3, whole.start(3)))
    for step in range(3, 12):  # across the first pass's end
        assert [_ids([train[i] for i in mb]) for mb in whole.micro_batches(step)] == \
               [_ids([again[i] for i in mb]) for mb in resumed.micro_batches(step)]


def test_one_source_in_a_list_trains_as_the_path_alone(tiny_data, tok):
    alone = load_splits(str(tiny_data), None, "auto", tok, 64, 0.2, 5, seed=0)
    listed = load_splits([str(tiny_data)], None, "auto", tok, 64, 0.2, 5, seed=0)
    assert _ids(listed.train) == _ids(alone.train) and _ids(listed.val) == _ids(alone.val)


def test_a_weight_that_draws_no_row_and_a_source_with_none_left_are_refused(two_files, tmp_path, tok):
    a, b = two_files
    with pytest.raises(DataError, match=r"^data.path\[1\] \(.*b.jsonl\): weight 0.001 of the weighted sources' "
                                        r"1.001 draws none of its 8 rows"):
        load_splits([{"path": str(a), "weight": 1}, {"path": str(b), "weight": 0.001}], None, "auto", tok, 64, 0.2,
                    None, seed=0)
    long = _jsonl(tmp_path / "long.jsonl", [{"instruction": "word " * 100, "output": "x"}] * 3)
    with pytest.raises(DataError, match=r"^data.path\[1\]: .*long.jsonl: no usable rows"):
        load_splits([str(a), str(long)], None, "auto", tok, 64, 0.2, None, seed=0)


def test_a_source_reads_the_split_it_names_of_a_saved_dataset(two_files, tmp_path, tok):
    import datasets

    a, _ = two_files
    folder = tmp_path / "saved"
    rows = [{"text": f"Saved row {i}."} for i in range(10)]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:2]),
                          "test": datasets.Dataset.from_list(rows)}).save_to_disk(str(folder))
    splits = load_splits([str(a), {"path": str(folder), "split": "test"}], None, "auto", tok, 64, 0.2, None, seed=0)
    assert [(r.available, r.held_out) for r in splits.sources] == [(16, 4), (8, 2)]  # 10 rows of 'test', 2 held out
    with pytest.raises(DataError, match=r"^data.path\[1\]: .*saved has splits \['train', 'test'\], no split 'dev'"):
        load_splits([str(a), {"path": str(folder), "split": "dev"}], None, "auto", tok, 64, 0.2, None, seed=0)
    with pytest.raises(DataError, match=r"^data.path\[0\]: split 'test' picks a split of a save_to_disk folder"):
        load_splits([{"path": str(a), "split": "test"}], None, "auto", tok, 64, 0.2, None, seed=0)


def test_the_fingerprint_covers_every_source_and_its_settings(two_files):
    a, b = two_files
    value = [{"path": str(a), "weight": 2}, str(b)]
    before = fingerprint(value)
    assert fingerprint(value) == before and fingerprint(str(a)) == data_fingerprint(a)  # one path: as before
    assert data_fingerprint(value) == before
    assert fingerprint([{"path": str(a), "weight": 3}, str(b)]) != before
    assert fingerprint([{"path": str(a), "weight": 2}, {"path": str(b), "name": "other"}]) != before
    b.write_text(b.read_text().replace("ends", "stops"))
    assert fingerprint(value) != before


# ----------------------------------------------------------------------------- through the CLI
def test_a_run_on_two_sources_logs_each_and_evaluates_each(tiny_model_dir, two_files, tmp_path):
    a, b = two_files
    sources = f"[{{path: '{a}', weight: 3}}, {{path: '{b}', rows: 20, name: stories}}]"
    out = tmp_path / "run"
    # two steps, evaluated before and after; no samples, no checkpoint: the data is what is tested. In
    # fp32, so that `tunekit eval`'s figures meet the trainer's to summation order (below)
    r = run_cli(["train", *tiny_args(tiny_model_dir, sources, out, "trainer.max_steps=2", "trainer.eval_samples=0",
                                     "trainer.save_every=10", "model.dtype=fp32")], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"data: source a ({a}, weight 3): 16 rows available, 16 drawn = 44.4% of 36 training rows; 4 held out" \
        in r.stderr
    assert "data: source stories" in r.stderr and "20 drawn, 2.5 passes over it = 55.6%" in r.stderr
    evals = [row for row in read_jsonl(out / "metrics.jsonl") if "val_loss" in row]
    assert [row["step"] for row in evals] == [0, 2]
    for row in evals:
        own = [row["eval/a/loss"], row["eval/stories/loss"]]
        # the whole's loss is the token-weighted mean of the sources': between them (up to float64 rounding)
        assert min(own) - 1e-9 <= row["val_loss"] <= max(own) + 1e-9
    summary = json.loads((out / "summary.json").read_text())
    assert [(s["name"], s["drawn"]) for s in summary["data"]["sources"]] == [("a", 16), ("stories", 20)]
    # `tunekit eval` reports each source beside the whole, each over its own held-out rows: the trainer's
    # last evaluation (the saved adapter is the step-2 model). Both in fp32: per-token losses ~10.8, each a
    # log-sum-exp over 49k logits from 64-wide dot products, summed in another order (a KV-cached prompt pass
    # against the trainer's padded batch): a few 1e-6 relative, under 1e-4 absolute. The two sources differ
    # by more than 1e-3 after training, so a row counted with the wrong source would show.
    done = run_cli(["eval", str(out), "--json", "--no-generate"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    last = evals[-1]
    by_name = {s["name"]: s for s in report["sources"]}
    assert [(s["name"], s["examples"], s["rows"]) for s in report["sources"]] == [("a", 4, 4), ("stories", 2, 2)]
    assert abs(last["eval/a/loss"] - last["eval/stories/loss"]) > 1e-3
    for name in ("a", "stories"):
        assert by_name[name]["trained"]["loss"] == pytest.approx(last[f"eval/{name}/loss"], abs=1e-4), name
    assert report["trained"]["loss"] == pytest.approx(last["val_loss"], abs=1e-4)
