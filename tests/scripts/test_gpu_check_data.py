"""The GPU check's generated rows: the DPO variant's pairs (run only on a GPU, or with --variants 7)
pass the preference checks a run makes before anything loads, and the planner's rows are longer than
any max_seq_len the check uses."""

from __future__ import annotations

from test_bench_task import _script


def test_the_dpo_variants_pairs_are_valid_preference_rows(tmp_path):
    from tunekit.data.preference import check_rows

    path = _script("gpu_check_data").pairs_rows(tmp_path)
    assert check_rows(str(path)) == (64, "pairs")
    assert _script("gpu_check_data").pairs_rows(tmp_path) == path  # written once


def test_the_planners_rows_are_long(tmp_path):
    import json

    rows = [json.loads(x) for x in _script("gpu_check_data").long_rows(tmp_path).read_text().splitlines()]
    assert len(rows) == 64 and min(len(r["text"].split()) for r in rows) > 2048  # words: more tokens still
