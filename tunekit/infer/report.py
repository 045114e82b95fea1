"""The eval report: a short table for a person, eval.json for a script.

    held-out: <where the rows come from>: N rows, K classes: <labels>
                                  base   trained    change
    response loss / perplexity    per token of the reference replies
    exact match                   greedy answer == reference, normalised
    accuracy (likelihood)         closed answer sets only, with the majority-class share
    per class: rows, predicted, correct (base -> trained)
"""

from __future__ import annotations

from typing import Optional

from tunekit.infer.rows import TaskRow, user_text
from tunekit.infer.score import TaskResult

COMPARED = ("loss", "ppl", "exact_match", "accuracy")


def difference(base: dict, trained: dict) -> dict:
    return {k: trained[k] - base[k] for k in COMPARED if k in base and k in trained}


def _fmt(key: str, value: Optional[float]) -> str:
    if value is None:
        return "-"
    if key in ("exact_match", "accuracy"):
        return f"{100 * value:.1f}%"
    return f"{value:.4f}" if key == "loss" else f"{value:.2f}"


def _fmt_change(key: str, value: float) -> str:
    return f"{100 * value:+.1f}" if key in ("exact_match", "accuracy") else f"{value:+.4f}" if key == "loss" else ""


def table(trained: dict, base: Optional[dict] = None, header: str = "") -> str:
    names = {"loss": "response loss", "ppl": "perplexity", "exact_match": "exact match",
             "accuracy": "accuracy (likelihood)"}
    lines = [header] if header else []
    cols = ["base", "trained", "change"] if base else ["trained"]
    lines.append(f"{'':24}" + "".join(f"{c:>10}" for c in cols))
    for key, name in names.items():
        if key not in trained:
            continue
        row = f"{name:24}"
        if base:
            row += f"{_fmt(key, base.get(key)):>10}{_fmt(key, trained[key]):>10}"
            row += f"{_fmt_change(key, trained[key] - base[key]) if key in base else '':>10}"
        else:
            row += f"{_fmt(key, trained[key]):>10}"
        if key == "accuracy":
            row += f"   (majority class {100 * trained['majority']:.1f}%)"
        lines.append(row)
    if "per_class" in trained:
        arrow = " (base -> trained)" if base else ""
        lines.append(f"per class: rows, predicted, correct{arrow}")
        for label, t in trained["per_class"].items():
            if base:
                b = base["per_class"][label]
                lines.append(f"  {label[:16]:16}{t['rows']:>5}{b['predicted']:>6} -> {t['predicted']:<5}"
                             f"{b['correct']:>5} -> {t['correct']}")
            else:
                lines.append(f"  {label[:16]:16}{t['rows']:>5}{t['predicted']:>7}{t['correct']:>7}")
    return "\n".join(lines)


def source_reports(groups: list[tuple[str, list[int]]], kept: list[int], trained: TaskResult,
                   base: Optional[TaskResult] = None) -> list[dict]:
    """Each source's own figures, over its rows of the held-out set. groups: [(source name, the indices of
    its held-out examples)]; kept: the example index of each scored row (rows without a reply to score,
    or past --max-rows, are not scored). A source with no scored row has no figures (None)."""
    row_of = {example: j for j, example in enumerate(kept)}
    out = []
    for name, examples in groups:
        mine = [row_of[i] for i in examples if i in row_of]
        entry = {"name": name, "examples": len(examples), "rows": len(mine), "trained": None}
        for side, result in (("trained", trained), ("base", base)):
            if result is not None and mine:
                entry[side] = TaskResult([result.rows[j] for j in mine], result.classes, result.generated).summarize()
        if base is not None and mine:
            entry["difference"] = difference(entry["base"], entry["trained"])
        out.append(entry)
    return out


def sources_table(sources: list[dict]) -> str:
    """One line per source: its rows and the table's figures (base -> trained where the base was scored)."""
    names = {"loss": "loss", "ppl": "ppl", "exact_match": "exact", "accuracy": "accuracy"}
    first = next((s for s in sources if s["trained"] is not None), None)
    keys = [k for k in names if first is not None and k in first["trained"]]
    with_base = first is not None and "base" in first
    width = 24 if with_base else 12
    lines = ["per source" + (" (base -> trained)" if with_base else "") + ":",
             f"  {'':16}{'rows':>6}" + "".join(f"{names[k]:>{width}}" for k in keys)]
    for src in sources:
        line = f"  {src['name'][:16]:16}{src['rows']:>6}"
        if src["trained"] is None:
            lines.append(line + "   (no row to score)")
            continue
        for k in keys:
            cell = _fmt(k, src["trained"][k])
            line += f"  {(_fmt(k, src['base'][k]) + ' -> ' + cell) if with_base else cell:>{width - 2}}"
        lines.append(line)
    return "\n".join(lines)


def clip(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[:width - 1] + "…"


def sample_lines(tokenizer, rows: list[TaskRow], result: TaskResult, n: int, width: int = 60) -> list[str]:
    """One line per row: [ok]/[x] prompt -> answer (ref reference)."""

    pairs = list(zip(rows, result.rows))[:n]
    prompts = distinct_parts([user_text(tokenizer, r.prompt) for r, _ in pairs])
    out = []
    for (r, res), prompt in zip(pairs, prompts):
        mark = "ok" if res.exact else " x"
        out.append(f"  [{mark}] {clip(prompt, width)!r} -> {clip(res.answer, 40)!r} (ref {clip(r.reference, 30)!r})")
    return out


def answers_json(tokenizer, rows: list[TaskRow], result: TaskResult, base: Optional[TaskResult] = None) -> list[dict]:
    out = []
    for i, (r, res) in enumerate(zip(rows, result.rows)):
        row = {"prompt": user_text(tokenizer, r.prompt), "reference": r.reference, "answer": res.answer,
               "exact": res.exact}
        if result.classes is not None:
            row["predicted"] = result.classes.labels[res.predicted]
        if base is not None:
            row["base_answer"] = base.rows[i].answer
            row["base_exact"] = base.rows[i].exact
            if base.classes is not None:
                row["base_predicted"] = base.classes.labels[base.rows[i].predicted]
        out.append(row)
    return out


def distinct_parts(texts: list[str], min_shared: int = 16) -> list[str]:
    """Texts with the start they all share (an instruction repeated in every prompt) replaced by
    "…", cut at a word boundary, so a one-line display shows what differs."""
    texts = [" ".join(t.split()) for t in texts]
    if len(texts) < 2:
        return texts
    shared = texts[0]
    for t in texts[1:]:
        while not t.startswith(shared):
            shared = shared[:-1]
    shared = shared[:shared.rfind(" ") + 1] if " " in shared else ""
    if len(shared) < min_shared:
        return texts
    return ["…" + t[len(shared):] for t in texts]
