"""`tunekit eval`'s figures of preference rows (tunekit.infer.preference) and of each source of a mixture
(tunekit.infer.report.source_reports), from given log-probabilities and per-row results, against hand
computations. End to end: tests/train/test_preference_run.py (a DPO run's pairs) and
tests/data/test_mixture.py (a run on two sources).

Tolerance of the figures below: every input is exact in fp32 (halves and quarters), the rewards multiply
them by beta = 0.1 once (relative rounding 6e-8) and the means add at most 4 of them: each figure is
within a few ulp of values <= 1.5, well under abs 1e-6. A wrong sign, side or normalisation moves a
figure by >= 0.0125."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from tunekit.infer.preference import Logps, PairScorer, preference_table
from tunekit.infer.report import source_reports, sources_table
from tunekit.infer.score import RowResult, TaskResult

TOL = 1e-6


def _cfg(loss: str, beta: float = 0.1, gamma: float = 0.5) -> SimpleNamespace:
    return SimpleNamespace(loss=loss, beta=beta, gamma=gamma, label_smoothing=0.0, desirable_weight=1.0,
                           undesirable_weight=1.0)


def _logps(chosen, rejected, tokens=None) -> Logps:
    sums = torch.tensor([chosen, rejected], dtype=torch.float32).T
    n = torch.ones_like(sums, dtype=torch.long) if tokens is None else torch.tensor(tokens).T
    return Logps(sums, n)


def test_dpo_accuracy_and_margin_are_the_implied_rewards_against_the_reference():
    policy = _logps([-10.0, -12.0, -8.0, -8.5], [-11.0, -11.5, -9.0, -7.0])
    ref = _logps([-10.5, -11.0, -8.5, -9.0], [-10.5, -12.0, -8.0, -8.0])
    # by hand: log-ratios chosen 0.5, -1, 0.5, 0.5; rejected -0.5, 0.5, -1, 1
    margins = [0.1 * (0.5 + 0.5), 0.1 * (-1 - 0.5), 0.1 * (0.5 + 1), 0.1 * (0.5 - 1)]  # .1 -.15 .15 -.05
    mean = sum(margins) / 4
    sd = math.sqrt(sum((m - mean) ** 2 for m in margins) / 3)
    got = PairScorer(_cfg("dpo")).figures(policy, ref)
    assert got.correct == [True, False, True, False]
    m = got.metrics
    assert m["pairs"] == 4 and m["preference_accuracy"] == 0.5
    assert m["preference_accuracy_se"] == pytest.approx(math.sqrt(0.5 * 0.5 / 4), abs=TOL)
    assert m["margin"] == pytest.approx(mean, abs=TOL) and m["margin_se"] == pytest.approx(sd / 2, abs=TOL)
    assert m["rewards_chosen"] == pytest.approx(0.1 * 0.125, abs=TOL) and m["rewards_rejected"] == pytest.approx(0, abs=TOL)
    assert m["loss"] == pytest.approx(sum(math.log1p(math.exp(-x)) for x in margins) / 4, abs=TOL)
    # the base is the reference: every margin 0, no pair ordered right, the loss at zero margin
    base = PairScorer(_cfg("dpo")).figures(ref, ref).metrics
    assert base["preference_accuracy"] == 0 and base["margin"] == 0 and base["loss"] == pytest.approx(math.log(2))
    table = preference_table(m, base, "head")
    assert "preference accuracy             0.0%     50.0%     +50.0   (+- 25.0% trained)" in table
    # what each model ranks first by its own log-prob per token (one token a side here): the trained model
    # prefers chosen in pairs 1 and 3 (-10 > -11, -8 > -9); the base in pair 2 only (-11 > -12; pair 1 ties)
    assert m["likelihood_accuracy"] == 0.5 and base["likelihood_accuracy"] == 0.25
    assert "prefers chosen (per token)     25.0%     50.0%     +25.0   (+- 25.0% trained)" in table


@pytest.mark.parametrize("loss", ["simpo", "orpo"])
def test_reference_free_losses_order_pairs_by_the_per_token_log_prob(loss):
    # summed, pair 1 prefers rejected (-6 < -4) and pair 2 chosen; per token (3 and 1 tokens) the reverse
    policy = _logps([-6.0, -4.0], [-4.0, -6.0], tokens=[[3, 1], [1, 3]])
    got = PairScorer(_cfg(loss)).figures(policy, None)
    assert got.correct == [True, False]
    assert got.values == pytest.approx([0.1 * (-2 + 4), 0.1 * (-4 + 2)], abs=TOL)
    assert got.metrics["rewards_chosen"] == pytest.approx(0.1 * (-2 - 4) / 2, abs=TOL)


def test_kto_reports_the_mean_reward_of_desirable_and_undesirable_rows():
    policy = Logps(torch.tensor([[-5.0], [-6.0], [-7.0]]), torch.ones(3, 1, dtype=torch.long))
    ref = Logps(torch.tensor([[-5.5], [-6.0], [-6.0]]), torch.ones(3, 1, dtype=torch.long))
    got = PairScorer(_cfg("kto")).figures(policy, ref, torch.tensor([True, False, False]))
    m = got.metrics
    assert got.correct is None and "preference_accuracy" not in m
    assert (m["rows"], m["desirable"], m["undesirable"]) == (3, 1, 2)
    assert m["reward_desirable"] == pytest.approx(0.05, abs=TOL) and m["reward_desirable_se"] == 0.0
    assert m["reward_undesirable"] == pytest.approx(-0.05, abs=TOL)
    assert m["reward_undesirable_se"] == pytest.approx(math.sqrt(2 * 0.05 ** 2) / math.sqrt(2), abs=TOL)
    assert m["reward_gap"] == pytest.approx(0.1, abs=TOL)
    # zero-KL KTO: desirable 1 - sigmoid(beta l), undesirable 1 - sigmoid(-beta l)
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    assert m["loss"] == pytest.approx((1 - sig(0.05) + 1 - sig(0.0) + 1 - sig(0.1)) / 3, abs=TOL)
    assert "desirable - undesirable" in preference_table(m, None, "head")


def _result(losses: list[tuple[float, int]]) -> TaskResult:
    return TaskResult([RowResult("", False, None, None, s, n) for s, n in losses], None, False)


def test_each_source_is_scored_over_its_own_rows_only():
    # held-out examples 0-2 are source a's, 3-4 b's, 5 c's; example 1 and 5 have no reply to score
    groups = [("a", [0, 1, 2]), ("b", [3, 4]), ("c", [5])]
    kept = [0, 2, 3, 4]
    trained = _result([(2.0, 2), (4.0, 2), (3.0, 1), (9.0, 3)])
    base = _result([(4.0, 2), (6.0, 2), (6.0, 1), (12.0, 3)])
    a, b, c = source_reports(groups, kept, trained, base)
    assert (a["examples"], a["rows"], b["rows"], c["rows"]) == (3, 2, 2, 0)
    assert a["trained"]["loss"] == pytest.approx(6 / 4) and b["trained"]["loss"] == pytest.approx(12 / 4)
    assert a["base"]["loss"] == pytest.approx(10 / 4) and b["difference"]["loss"] == pytest.approx(12 / 4 - 18 / 4)
    assert c["trained"] is None
    # --max-rows 3: b keeps its first row only
    _, b3, _ = source_reports(groups, kept[:3], _result([(2.0, 2), (4.0, 2), (3.0, 1)]))
    assert b3["rows"] == 1 and b3["trained"]["loss"] == pytest.approx(3.0) and "base" not in b3
    lines = sources_table([a, b, c]).splitlines()
    assert lines[0] == "per source (base -> trained):"
    assert lines[2].split() == ["a", "2", "2.5000", "->", "1.5000", "12.18", "->", "4.48"]
    assert lines[4].split()[:2] == ["c", "0"] and "no row to score" in lines[4]
