"""scripts/bench_preference.py's pairs: what the learning table's task asks (its runs are tunekit's
own `train` and `eval`, tested elsewhere; the whole script ran on the tiny model by hand)."""

from __future__ import annotations

from test_bench_task import _script


def _row(text: str, label: str) -> dict:
    return {"messages": [{"role": "user", "content": f"Tweet: {text}"}, {"role": "assistant", "content": label}]}


def test_each_row_becomes_a_pair_with_a_wrong_label_rejected_and_kto_unfolds_it():
    bench = _script("bench_preference")
    rows = [_row(f"t{i}", label) for i, label in enumerate(["negative", "neutral", "positive"] * 20)]
    pairs = bench.pairs_from(rows, seed=0)
    assert [p["prompt"] for p in pairs] == [r["messages"][0]["content"] for r in rows]
    assert all(p["chosen"] == r["messages"][1]["content"] != p["rejected"] for p, r in zip(pairs, rows))
    assert all(p["rejected"] in ("negative", "neutral", "positive") for p in pairs)
    assert len({p["rejected"] for p in pairs if p["chosen"] == "neutral"}) == 2  # both wrong labels drawn
    assert bench.pairs_from(rows, seed=0) == pairs != bench.pairs_from(rows, seed=1)  # seeded
    kto = bench.unpaired(pairs)
    assert len(kto) == 2 * len(pairs) and [r["label"] for r in kto[:4]] == [True, False, True, False]
    assert kto[1] == {"prompt": pairs[0]["prompt"], "completion": pairs[0]["rejected"], "label": False}
