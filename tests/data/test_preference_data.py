"""Preference rows (tunekit.data.preference): the three TRL forms detected and rendered with the chat
template, the loss on the completions only, the prompt's start cut first and counted, and each bad row
refused in one DataError naming file and row, before any tokenizer."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from tunekit.data import DataError, IGNORE
from tunekit.data.formats import Rows
from tunekit.data.preference import (PAIRS, UNPAIRED, check_rows, collate_preference, example_length,
                                     tokenize_preference)

U, A = "user", "assistant"


def msg(role, content):
    return {"role": role, "content": content}


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _rows(*rows):
    return Rows(list(rows), [f"row {i}" for i in range(1, len(rows) + 1)])


def _trained_text(tok, ids, labels):
    return tok.decode([t for t, label in zip(ids, labels) if label != IGNORE])


def _completion_span(tok, prompt, completion):
    """The reply's trained text rendered from the template alone: what follows the generation prompt,
    up to and including <|im_end|> (SmolLM2's ChatML)."""
    before = tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    after = tok.apply_chat_template(prompt + completion, tokenize=False)
    reply = after[len(before):]
    return reply[: reply.index("<|im_end|>") + len("<|im_end|>")]


def test_explicit_string_pairs_train_on_each_completion_only(tok):
    rows = _rows({"prompt": "What is 2+2?", "chosen": "It is 4.", "rejected": "It is 5."})
    (ex,), cut = tokenize_preference(rows, PAIRS, "p.jsonl", tok, 512)
    prompt = [msg(U, "What is 2+2?")]
    assert _trained_text(tok, ex["input_ids"], ex["labels"]) == _completion_span(tok, prompt, [msg(A, "It is 4.")])
    assert _trained_text(tok, ex["rejected_input_ids"], ex["rejected_labels"]) == \
        _completion_span(tok, prompt, [msg(A, "It is 5.")])
    # the prompt is the same tokens on both sides
    first = next(i for i, label in enumerate(ex["labels"]) if label != IGNORE)
    assert ex["input_ids"][:first] == ex["rejected_input_ids"][:first]
    assert cut.prompt_cut_rows == cut.completion_cut_rows == 0
    assert example_length(ex) == max(len(ex["input_ids"]), len(ex["rejected_input_ids"]))


def test_implicit_prompt_conversations_share_their_prefix_and_prompt_replies_do_not_train(tok):
    head = [msg(U, "Hi"), msg(A, "Hello there"), msg(U, "2+2?")]
    rows = _rows({"chosen": head + [msg(A, "4")], "rejected": head + [msg(A, "5")]})
    (ex,), _ = tokenize_preference(rows, PAIRS, "p.jsonl", tok, 512)
    assert _trained_text(tok, ex["input_ids"], ex["labels"]) == _completion_span(tok, head, [msg(A, "4")])
    assert "Hello there" not in _trained_text(tok, ex["rejected_input_ids"], ex["rejected_labels"])
    # the same row in the explicit message-list form gives the same tokens
    explicit = _rows({"prompt": head, "chosen": [msg(A, "4")], "rejected": [msg(A, "5")]})
    (ex2,), _ = tokenize_preference(explicit, PAIRS, "p.jsonl", tok, 512)
    assert ex2 == ex


def test_unpaired_rows_keep_their_label(tok):
    rows = _rows({"prompt": "Say hi", "completion": "Hi!", "label": True},
                 {"prompt": "Say hi", "completion": "Go away.", "label": False})
    examples, _ = tokenize_preference(rows, UNPAIRED, "k.jsonl", tok, 512)
    assert [e["desirable"] for e in examples] == [True, False]
    batch = collate_preference(examples, tok.pad_token_id)
    assert batch["desirable"].tolist() == [True, False] and batch["input_ids"].shape[0] == 2


def test_pairs_collate_chosen_first_then_rejected(tok):
    rows = _rows(*({"prompt": f"q{i}", "chosen": f"yes {i}", "rejected": f"no {i}"} for i in range(3)))
    examples, _ = tokenize_preference(rows, PAIRS, "p.jsonl", tok, 512)
    batch = collate_preference(examples, tok.pad_token_id)
    assert batch["input_ids"].shape[0] == 6
    for i, e in enumerate(examples):
        assert batch["input_ids"][i, : len(e["input_ids"])].tolist() == e["input_ids"]
        assert batch["labels"][3 + i, : len(e["rejected_labels"])].tolist() == e["rejected_labels"]


def test_truncation_keeps_the_end_of_the_prompt_and_counts_it(tok):
    long_prompt = "Tell me. " + " ".join(f"word{i}" for i in range(40)) + " LAST"
    rows = _rows({"prompt": long_prompt, "chosen": "Fine.", "rejected": "No way, I will not."})
    (full,), _ = tokenize_preference(rows, PAIRS, "p.jsonl", tok, 512)
    limit = 40
    (ex,), cut = tokenize_preference(rows, PAIRS, "p.jsonl", tok, limit)
    longest = max(len(full["input_ids"]), len(full["rejected_input_ids"]))
    assert cut.prompt_cut_rows == 1 and cut.prompt_tokens_lost == longest - limit
    assert max(len(ex["input_ids"]), len(ex["rejected_input_ids"])) == limit
    # what is kept is the end: both sides are their full rows less the same first tokens
    assert ex["input_ids"] == full["input_ids"][longest - limit:]
    assert ex["rejected_labels"] == full["rejected_labels"][longest - limit:]
    assert "LAST" in tok.decode(ex["input_ids"]) and "Tell" not in tok.decode(ex["input_ids"])
    assert cut.completion_cut_rows == 0


GOOD = {"prompt": "q", "chosen": "a", "rejected": "b"}
CHAT = [msg(U, "q"), msg(A, "a")]
BAD_ROWS = [
    ({"prompt": "q", "chosen": "same", "rejected": "same"}, "row 2: 'chosen' and 'rejected' are the same"),
    ({"prompt": "q", "chosen": "a"}, "row 2: no 'rejected': a preference pair needs both"),
    ({"prompt": "q", "chosen": "a", "rejected": [msg(A, "b")]}, "row 2: 'prompt', 'chosen' and 'rejected' must all be"),
    ({"prompt": "q", "completion": "a", "label": True}, "row 2: an unpaired row (prompt/completion/label) in a file of "
                                                        "preference pairs"),
    ({"chosen": CHAT, "rejected": CHAT}, "row 2: 'chosen' and 'rejected' are the same conversation"),
    ({"chosen": CHAT, "rejected": [msg(U, "other"), msg(A, "b")]}, "row 2: 'chosen' and 'rejected' share no prompt"),
    ({"chosen": "a", "rejected": "b"}, "row 2: 'chosen' and 'rejected' without a 'prompt' must be whole conversations"),
    ({"prompt": "q", "chosen": "", "rejected": "b"}, "row 2: 'chosen' must be a non-empty string"),
]
BAD_KTO = [
    ({"prompt": "q", "completion": "a", "label": "yes"}, "row 2: 'label' must be true (desirable) or false"),
    ({"prompt": "q", "completion": "a", "label": 1}, "row 2: 'label' must be true"),
    ({"prompt": "q", "completion": "a"}, "row 2: no 'label'"),
    (GOOD, "row 2: a preference pair (chosen/rejected) in a file of unpaired rows"),
]


@pytest.mark.parametrize("row,culprit", BAD_ROWS + BAD_KTO, ids=[c.split(": ", 1)[1][:30] for _, c in BAD_ROWS + BAD_KTO])
def test_bad_rows_are_one_line_naming_file_and_row(tmp_path, row, culprit):
    first = GOOD if (row, culprit) in BAD_ROWS else {"prompt": "q", "completion": "a", "label": True}
    path = tmp_path / "prefs.jsonl"
    path.write_text(json.dumps(first) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(DataError) as e:
        check_rows(path)
    assert str(e.value).startswith(f"{path}: {culprit}") and "\n" not in str(e.value)


def test_sft_rows_are_not_preference_rows(tmp_path):
    path = tmp_path / "alpaca.jsonl"
    path.write_text(json.dumps({"instruction": "q", "output": "a"}) + "\n")
    with pytest.raises(DataError, match=r"row 1: objective=preference needs preference rows"):
        check_rows(path)
