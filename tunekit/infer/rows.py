"""Held-out examples seen as a task: a prompt, a reference answer, and the classes when the answers
form a small closed set.

Rows come from the same tokenization as training ({"input_ids", "labels"} of tunekit.data), so
the prompt is exactly what the model saw before its reply and the reference is exactly what it
was trained to produce: the last trained span of the row (the final assistant reply up to and
including its end-of-turn token). Earlier assistant turns of a multi-turn row stay in the prompt,
with their labels, so the response loss can count them as training does.
"""

from __future__ import annotations

import string
import unicodedata
from collections import Counter
from dataclasses import dataclass
from typing import Optional

IGNORE = -100
MAX_CLASSES = 20


@dataclass
class TaskRow:
    prompt: list[int]  # token ids up to the final reply (chat template, generation prompt included)
    prompt_labels: list[int]  # labels over the prompt: IGNORE, or the token (earlier trained replies)
    answer: list[int]  # the final reply's trained tokens, ending in its end-of-turn token
    reference: str  # the reply's text (special tokens dropped)


@dataclass
class ClassSet:
    """A small closed set of answers: K classes, each with the token ids scored as its answer."""

    names: list[str]  # normalised class names (the key of each class)
    labels: list[str]  # display form: the most common reference text of each class
    answers: list[list[int]]  # token ids of each class's answer (its most common tokenization)

    def index(self, reference: str) -> int:
        return self.names.index(normalize(reference))


def normalize(text: str) -> str:
    """Case, surrounding whitespace and punctuation do not count: ' Positive.' == 'positive'.
    Inner whitespace runs count as one space."""
    text = " ".join(text.split()).casefold()
    is_punct = lambda ch: ch in string.punctuation or unicodedata.category(ch).startswith("P")  # noqa: E731
    start, end = 0, len(text)
    while start < end and (is_punct(text[start]) or text[start].isspace()):
        start += 1
    while end > start and (is_punct(text[end - 1]) or text[end - 1].isspace()):
        end -= 1
    return text[start:end]


def reply_ends(tokenizer) -> frozenset[int]:
    """The tokens a complete reply ends with: EOS, and the chat template's end of turn."""
    from tunekit.data.tokenize import turn_end_id

    return frozenset({tokenizer.eos_token_id, turn_end_id(tokenizer)} - {None})


def task_row(example: dict, tokenizer, ends: Optional[frozenset[int]] = None) -> Optional[TaskRow]:
    """The example's final reply as a task row; None when it has none to ask for: no context before
    it (plain-text rows train every token) or cut by data.max_seq_len before its end-of-turn token.
    `ends`: reply_ends(tokenizer), computed once by callers that ask for many rows."""
    ids, labels = example["input_ids"], example["labels"]
    trained = [j for j, lab in enumerate(labels) if lab != IGNORE]
    if not trained:
        return None
    end = trained[-1] + 1
    start = end - 1
    while start > 0 and labels[start - 1] != IGNORE:
        start -= 1
    if start == 0 or ids[end - 1] not in (reply_ends(tokenizer) if ends is None else ends):
        return None
    answer = ids[start:end]
    return TaskRow(list(ids[:start]), list(labels[:start]), list(answer),
                   tokenizer.decode(answer, skip_special_tokens=True).strip())


def task_rows(examples: list[dict], tokenizer) -> tuple[list[TaskRow], int]:
    """(task rows, number of examples skipped because they have no final reply to ask for)."""
    rows, kept = task_rows_kept(examples, tokenizer)
    return rows, len(examples) - len(rows)


def task_rows_kept(examples: list[dict], tokenizer) -> tuple[list[TaskRow], list[int]]:
    """(task rows, the index of each one's example): examples without a final reply to ask for are left out."""
    ends = reply_ends(tokenizer)
    rows = [task_row(e, tokenizer, ends) for e in examples]
    kept = [i for i, r in enumerate(rows) if r is not None]
    return [rows[i] for i in kept], kept


def closed_set(rows: list[TaskRow], max_classes: int = MAX_CLASSES) -> Optional[ClassSet]:
    """The classes when the references form a small closed set: 2..max_classes distinct normalised
    answers, and at least twice as many rows as classes (so free-form answers, nearly all distinct,
    never count as classes). None otherwise."""
    keys = [normalize(r.reference) for r in rows]
    counts = Counter(keys)
    if not 2 <= len(counts) <= max_classes or len(rows) < 2 * len(counts) or "" in counts:
        return None
    names = sorted(counts)
    labels, answers = [], []
    for name in names:
        mine = [r for r, k in zip(rows, keys) if k == name]
        labels.append(Counter(r.reference for r in mine).most_common(1)[0][0])
        answers.append(list(Counter(tuple(r.answer) for r in mine).most_common(1)[0][0]))
    return ClassSet(names, labels, answers)


def user_text(tokenizer, prompt: list[int]) -> str:
    """The last user message inside a chat-templated prompt, for display; the whole decoded prompt
    when the template's shape cannot be found."""
    marker = "\x00TUNEKIT\x00"
    full = tokenizer.decode(prompt, skip_special_tokens=False)
    try:
        probe = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False,
                                              add_generation_prompt=True)
    except Exception:  # no template, or one that refuses a lone user turn
        probe = ""
    if marker in probe:
        before, after = probe.split(marker)
        # the user turn's header: the shortest end of the template's text before a user message that
        # names the role ("user\n" in ChatML), else the longest end of it found in this prompt; its
        # last occurrence opens the last user turn
        head = next((before[k:] for k in range(len(before) - 1, -1, -1) if "user" in before[k:]), "")
        if not head or head not in full:
            head = next((before[k:] for k in range(len(before)) if before[k:] in full), "")
        if head and after and full.endswith(after):
            start = full.rindex(head) + len(head)
            if start <= len(full) - len(after):
                return full[start:len(full) - len(after)].strip()
    return tokenizer.decode(prompt, skip_special_tokens=True).strip()
