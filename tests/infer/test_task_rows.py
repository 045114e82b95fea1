"""The task metric's parts as plain functions: answer normalisation, the samples' display, the
rows a task is scored on and when they form a closed set of classes (the whole evaluation against
oracles: test_taskeval.py)."""

from __future__ import annotations

from transformers import AutoTokenizer

from test_taskeval import colour_rows


def test_normalize_ignores_case_surrounding_space_and_punctuation():
    from tunekit.infer.rows import normalize

    assert normalize("  Positive. ") == normalize("positive") == "positive"
    assert normalize("«Hello, world!»") == "hello, world"
    assert normalize("New   York") == "new york"
    assert normalize("positive") != normalize("negative")
    assert normalize("...") == ""


def test_sample_display_drops_the_shared_instruction():
    from tunekit.infer.report import distinct_parts

    shared = "Classify the sentiment of this tweet. Tweet: "
    assert distinct_parts([shared + "I love it", shared + "meh"]) == ["…I love it", "…meh"]
    assert distinct_parts(["What is 2+2?", "What is 3+3?"]) == ["What is 2+2?", "What is 3+3?"]  # short: kept
    assert distinct_parts([shared + "x"]) == [shared + "x"]


def test_task_rows_and_closed_set(tiny_model_dir):
    from tunekit.data import tokenize_rows
    from tunekit.infer.rows import closed_set, task_rows, user_text

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    examples = tokenize_rows(colour_rows(12), "chat", "x", tok, 64)
    rows, skipped = task_rows(examples, tok)
    assert skipped == 0 and len(rows) == 12
    assert rows[0].reference == "Red." and rows[1].reference == "green"
    assert rows[0].answer[-1] == tok.eos_token_id
    assert any(lab != -100 for lab in rows[0].prompt_labels)  # row 0 is two-turn: "Hello!" is trained
    assert user_text(tok, rows[1].prompt) == "Item 1 is green. Which colour is item 1?"
    classes = closed_set(rows)
    assert classes.names == ["blue", "green", "red"] and classes.labels == ["blue", "green", "red"]
    # free-form answers are not a closed set; nor are too few rows per class
    free = tokenize_rows([{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
                          for i in range(10)], "chat", "x", tok, 64)
    assert closed_set(task_rows(free, tok)[0]) is None
    assert closed_set(rows[:5]) is None
    # a reply cut by max_seq_len has no end-of-turn token: nothing to ask for
    full = tokenize_rows(colour_rows(3)[1:2], "chat", "x", tok, 64)[0]["input_ids"]
    cut = tokenize_rows(colour_rows(3)[1:2], "chat", "x", tok, len(full) - 2)  # the tail "\n" and the EOS go
    assert task_rows(cut, tok) == ([], 1)
    text = tokenize_rows([{"text": "plain text"}], "text", "x", tok, 64)
    assert task_rows(text, tok) == ([], 1)
