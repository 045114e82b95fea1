"""The export gate's decisions (tunekit.export.gate) on fidelity figures given directly: which rule
decides, and when it refuses. The exports that produce those figures: test_export.py."""

from __future__ import annotations

import pytest

from tunekit.export.gate import KL_FALLBACK, decide


# ---------------------------------------------------------------- the gate
def _fid(gain: float, kept: float, kl: float = 1e-2, tok: float = 1.0, se: float = 0.005) -> dict:
    return {"gain": gain, "gain_kept": kept, "gain_kept_se": se, "kl_mean": kl, "tokenizer_agreement": tok}


@pytest.mark.parametrize("fid, lossy, accepted, rule", [
    (_fid(0.82, 0.985, kl=9.3e-3), False, True, "gain_kept"),   # a measured bf16 merge: KL 9.3e-3, 98.5% kept
    (_fid(0.82, 0.02, kl=4e-3), False, False, "gain_kept"),     # adapter rounded away: small KL, nothing kept
    (_fid(0.82, 0.89), False, False, "gain_kept"),
    (_fid(0.82, 0.60, kl=0.1), True, True, "gain_kept"),        # Q4_K_M keeps most of it: a deliberate lossy type
    (_fid(0.82, 0.05, kl=0.1), True, False, "gain_kept"),       # NF4 re-quantization erased it
    (_fid(0.82, -3.0, kl=2.0), False, False, "gain_kept"),      # broken export: worse than the base
    (_fid(0.004, 0.3, kl=1e-3), False, True, "kl (gain not measurable)"),
    (_fid(0.004, 0.3, kl=5e-3), False, False, "kl (gain not measurable)"),
    (_fid(-0.02, None, kl=1e-3), False, True, "kl (gain not measurable)"),  # the run got worse: no fraction
    (_fid(0.04, 0.70, kl=5e-3, se=0.15), False, False, "kl (gain not measurable)"),  # 2 steps, 57 tokens: too noisy
    (_fid(0.04, 0.70, kl=1e-3, se=0.15), False, True, "kl (gain not measurable)"),
    (_fid(0.04, -0.26, kl=1e-3, se=0.51), False, False, "gain_kept"),  # noisy, yet clearly below 90%
    (_fid(0.74, 1.17, kl=0.55, se=0.05), False, True, "gain_kept"),    # merged into original: better than trained
    (dict(_fid(0.74, 0.95, kl=0.3), adapter_effect=0.1, adapter_effect_se=0.02), False, False, "adapter_effect"),
    (dict(_fid(0.74, 1.17, kl=0.55), adapter_effect=0.78, adapter_effect_se=0.05), False, True, "gain_kept"),
    (_fid(0.82, 1.0, kl=0.0, tok=0.97), False, False, "tokenizer"),
    (_fid(0.82, float("nan"), kl=float("nan")), True, False, "finite"),  # an f16 weight over 65504 became inf
])
def test_gate_decides_on_the_fraction_of_gain_kept(fid, lossy, accepted, rule):
    verdict = decide(fid, adapter=False, lossy=lossy)
    assert verdict["accepted"] is accepted and verdict["rule"] == rule
    assert (verdict["why"] is None) is accepted


def test_gate_bounds_can_be_moved_and_adapters_must_be_exact():
    assert decide(_fid(0.82, 0.8), adapter=False, lossy=False, min_gain=0.75)["accepted"]
    assert not decide(_fid(0.82, 0.99, kl=2e-3), adapter=False, lossy=False, kl_threshold=1e-3)["accepted"]
    assert decide(_fid(0.004, 0.3, kl=KL_FALLBACK), adapter=False, lossy=False)["accepted"]
    assert not decide(_fid(0.82, 1.0, kl=1e-4), adapter=True, lossy=False)["accepted"]
    assert decide(_fid(0.82, 1.0, kl=0.0), adapter=True, lossy=False)["accepted"]


# ---------------------------------------------------------------- the task check
def _task(trained: int, exported: int, lost: int, won: int, rows: int = 150, base: int = 53) -> dict:
    from tunekit.export.task import TaskCheck, compare_task

    # rows 0..trained-1 right for the trained model; the export loses `lost` of them and wins `won` others
    t = [i < trained for i in range(rows)]
    e = [(i < trained and i >= lost) or (trained <= i < trained + won) for i in range(rows)]
    assert sum(e) == exported
    check = TaskCheck(rows=[None] * rows, classes=None, where="x", base=[i < base for i in range(rows)], trained=t)
    return compare_task(check, e)


def test_the_task_gate_refuses_changed_answers_and_not_a_flipped_row():
    from tunekit.export.gate import TASK_MIN_GAIN_KEPT, task_verdict

    # an export that answers 126 of 150 rows where the trained model answered 137 (base 53):
    # 13 lost, 2 won: McNemar 11 / sqrt(15) = 2.8, it keeps (126-53)/(137-53) = 87% of the task gain
    changed = _task(137, 126, 13, 2)
    assert changed["gain_kept"] == pytest.approx(73 / 84) and changed["z"] == pytest.approx(11 / 15 ** 0.5)
    refusal = task_verdict(changed, lossy=False)
    assert refusal["rule"] == "task" and refusal["bound"] == TASK_MIN_GAIN_KEPT and not refusal["accepted"]
    assert "84.0% where the trained model's is 91.3%" in refusal["why"] and "13 rows lost, 2 won" in refusal["why"]
    assert task_verdict(changed, lossy=False, min_task_gain=0.8) is None  # the user's own bound
    # a preference run's task check: pairs ordered right by the implied reward
    assert task_verdict(dict(changed, metric="preference_accuracy"), lossy=False)["why"].startswith(
        "its preference accuracy on 150 held-out rows is 84.0%")
    # rounding flips a row or two either way: kept ~100%, never refused
    assert task_verdict(_task(137, 137, 2, 2), lossy=False) is None
    # few rows: 3 lost of a 10-row gain is 70% kept, but 3 / sqrt(3) = 1.7 cannot tell it from chance
    few = _task(14, 11, 3, 0, rows=20, base=4)
    assert few["gain_kept"] == pytest.approx(0.7) and task_verdict(few, lossy=False) is None
    # a run that gained nothing on the task has nothing to keep
    assert task_verdict(_task(53, 50, 3, 0), lossy=False) is None
    # the loss rule decides first; an export it accepts is then refused on the task
    fid = {"gain": 0.5, "gain_kept": 0.99, "gain_kept_se": 0.01, "kl_mean": 1e-3, "task": changed}
    assert decide(fid, adapter=False, lossy=False)["rule"] == "task"
    assert decide(dict(fid, gain_kept=0.5), adapter=False, lossy=False)["rule"] == "gain_kept"
