"""The export's task check: does the exported model still answer the held-out rows as the trained one did?

The loss check (tunekit.export.fidelity) measures held-out loss over every response token. On a
task with short answers most of a fine-tune's loss gain is learning the answer's format, which a
merge into other weights keeps while the answers themselves change: a QLoRA adapter merged into
the original high-precision weights keeps ~100% of the loss gain on the tweet-sentiment task
while 23 of its 150 answers change (benchmarks/export/deploy-tweet-sentiment-*.md). So where the
held-out rows have answers (the rows `tunekit eval` scores: a closed set of answers is scored by
likelihood, anything else by exact match of the greedy answer), the export is also scored on
them, exactly as `tunekit eval` scores a model, and compared row by row with the trained model:

    task gain kept = (exported - base) / (trained - base)   on the task metric, over the same rows

The gate (tunekit.export.gate) refuses an export that keeps less than a set share of that gain,
when the rows can tell: the rows the trained model got right and the export wrong (lost) against
the reverse (won) must differ beyond chance (McNemar's statistic (lost - won) / sqrt(lost + won)
>= TASK_Z), so that one row flipped by rounding among a few dozen is not a refusal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

from tunekit.infer.rows import ClassSet, TaskRow

# Rows scored by default: enough that a few lost rows can read as significant, few enough that
# scoring a 135M model several times stays a fraction of the export.
DEFAULT_TASK_ROWS = 200
# Exact match is a task metric for short answers (a label, a number, a name); replies longer than
# this are scored by the loss check alone.
MAX_EXACT_MATCH_TOKENS = 32


@dataclass
class TaskCheck:
    """The held-out task rows and the base's and trained model's per-row results on them (score_base
    first, then score)."""

    rows: list[TaskRow]
    classes: Optional[ClassSet]
    where: str  # where the rows come from
    base: Optional[list[bool]] = None  # per row: the untuned base answered it right
    trained: Optional[list[bool]] = None  # per row: the trained model answered it right

    @property
    def metric(self) -> str:
        return "accuracy" if self.classes is not None else "exact_match"

    def score(self, model, tokenizer) -> list[bool]:
        """Per row: `model` answers it right, scored as `tunekit eval` scores (batches of 16).
        model: a torch model, or a callable (rows, classes) -> TaskResult (llama.cpp's scorer)."""
        from tunekit.infer.score import score_rows

        closed = self.classes is not None
        if callable(model) and not hasattr(model, "parameters"):
            result = model(self.rows, self.classes, tokenizer=tokenizer, batch_size=16, generate=not closed)
        else:
            result = score_rows(model, tokenizer, self.rows, self.classes, batch_size=16, generate=not closed)
        return [(r.predicted == r.truth) if closed else r.exact for r in result.rows]

    def score_base(self, model, tokenizer) -> list[bool]:
        """The base's rows, scored as any model's (a PreferenceCheck's base is also its reference)."""
        return self.score(model, tokenizer)

    def cannot_score(self, model) -> Optional[str]:
        """Why `model` (what scorer_for gave) cannot be scored here; None: it can."""
        return None


@dataclass
class PreferenceCheck:
    """A preference run's held-out pairs, scored by the run's own loss (tunekit.infer.preference): a pair is
    right where the model's implied reward of the chosen completion exceeds the rejected one's. For a
    loss with a reference, the reference is the base the export measures first (score_base): the base
    itself then gets every pair wrong (every margin 0), and the trained model's accuracy is its gain."""

    rows: list[dict]  # preference examples (tunekit.data.preference)
    scorer: object  # tunekit.infer.preference.PairScorer
    where: str
    classes: None = None
    base: Optional[list[bool]] = None
    trained: Optional[list[bool]] = None
    reference: object = None  # the base's Logps, for a loss with a reference

    metric = "preference_accuracy"

    def _logps(self, model, tokenizer):
        from tunekit.infer.preference import completion_logps

        return completion_logps(model, self.rows, tokenizer.pad_token_id, 16)[0]

    def score_base(self, model, tokenizer) -> list[bool]:
        logps = self._logps(model, tokenizer)
        if self.scorer.needs_reference:
            self.reference = logps
        return self.scorer.figures(logps, self.reference).correct

    def score(self, model, tokenizer) -> list[bool]:
        return self.scorer.figures(self._logps(model, tokenizer), self.reference).correct

    def cannot_score(self, model) -> Optional[str]:
        from torch import nn

        return None if isinstance(model, nn.Module) else "preference pairs are scored on a torch model only"


def task_check(cfg, tokenizer, data: Optional[str], max_rows: int) -> tuple[Optional[TaskCheck], str]:
    """The rows of the task check, or (None, why not). A preference run's own held-out rows (or --data
    of preference rows) give a PreferenceCheck."""
    from tunekit.runs.heldout import heldout_examples, is_preference_data
    from tunekit.infer.rows import closed_set, task_rows

    if max_rows <= 0:
        return None, "--task-rows 0"
    if getattr(cfg, "objective", None) == "preference" and (data is None or is_preference_data(data)):
        return _preference_check(cfg, tokenizer, data, max_rows)
    examples, where = heldout_examples(cfg, tokenizer, data)
    rows, _ = task_rows(examples, tokenizer)
    if not rows:
        return None, f"{where}: no held-out row has a prompt and a reply to score"
    rows = rows[:max_rows]
    classes = closed_set(rows)
    longest = max(len(r.answer) for r in rows)
    if classes is None and longest > MAX_EXACT_MATCH_TOKENS:
        # Long free-text replies almost never match exactly, as trained or exported: the metric
        # would read 0% on both sides and decide nothing, at the price of greedy decoding every
        # reply three or more times.
        return None, (f"{where}: the replies are free text (up to {longest} tokens), not answers to match; "
                      "--data FILE with short answers or a closed set of them enables the task check")
    return TaskCheck(rows, classes, where), where


def _preference_check(cfg, tokenizer, data: Optional[str], max_rows: int) -> tuple[Optional[PreferenceCheck], str]:
    from tunekit.infer.preference import PairScorer
    from tunekit.runs.heldout import heldout_preference

    scorer = PairScorer(cfg.preference)
    examples, kind, where = heldout_preference(cfg, tokenizer, data)
    if not scorer.paired or kind != "pairs":
        return None, f"{where}: unpaired (KTO) rows have no preference accuracy; the loss check alone judges the export"
    return PreferenceCheck(examples[:max_rows], scorer, where), where


def _rate(correct: list[bool]) -> float:
    return sum(correct) / max(len(correct), 1)


def compare_task(check: TaskCheck, exported: list[bool]) -> dict:
    """The task section of the fidelity report: the metric for base, trained and exported, the
    share of the trained model's task gain the export keeps, and the row-by-row changes."""
    base, trained = _rate(check.base), _rate(check.trained)
    exp = _rate(exported)
    lost = sum(t and not e for t, e in zip(check.trained, exported))
    won = sum(e and not t for t, e in zip(check.trained, exported))
    gain = trained - base
    return {
        "metric": check.metric, "rows": len(check.rows), "data": check.where,
        "classes": check.classes.labels if check.classes is not None else None,
        "base": base, "trained": trained, "exported": exp,
        "gain": gain, "gain_kept": (exp - base) / gain if gain > 0 else None,
        "lost_rows": lost, "won_rows": won,
        "z": (lost - won) / math.sqrt(lost + won) if lost + won else 0.0,
    }


def scorer_for(exported) -> Optional[Callable]:
    """What TaskCheck.score takes for a reloaded export: the model itself, llama.cpp's task
    scorer for a llama.cpp model, or None when there is none."""
    from torch import nn

    if isinstance(exported, nn.Module):
        return exported
    owner = getattr(exported, "__self__", None)  # LlamaCppModel.logits, bound
    score = getattr(owner, "score_task", None)
    return score
