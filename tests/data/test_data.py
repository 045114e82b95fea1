"""Data: formats, prompt masking, EOS handling, malformed rows, batching."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch
from transformers import AutoTokenizer

from tunekit.data import (IGNORE, BatchSchedule, DataError, collate, eval_batches, eval_micro_batches, load_splits,
                          tokenize_rows)
from tunekit.data.formats import detect_format, read_rows
from tunekit.data.tokenize import encode_chat, ensure_chat_template


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    t = AutoTokenizer.from_pretrained(tiny_model_dir)
    ensure_chat_template(t)
    return t


def trained_text(tok, ex) -> str:
    return tok.decode([i for i, label in zip(ex["input_ids"], ex["labels"]) if label != IGNORE])


def test_alpaca_masks_prompt_and_learns_eos(tok):
    assert tok.pad_token_id == tok.eos_token_id  # SmolLM2: the case where masking by id would hide EOS
    rows = [{"instruction": "Name a color.", "input": "", "output": "Blue."}]
    [ex] = tokenize_rows(rows, "alpaca", "x.jsonl", tok, 512)
    assert trained_text(tok, ex) == "Blue." + tok.eos_token
    assert ex["labels"].count(tok.eos_token_id) == 1
    # the prompt (system + user turn + assistant header) is context only
    assert "Name a color." in tok.decode(ex["input_ids"])


def test_alpaca_input_field_goes_into_prompt(tok):
    rows = [{"instruction": "Translate.", "input": "bonjour", "output": "hello"}]
    [ex] = tokenize_rows(rows, "alpaca", "x.jsonl", tok, 512)
    text = tok.decode(ex["input_ids"])
    assert "Translate.\n\nbonjour" in text and trained_text(tok, ex) == "hello" + tok.eos_token


def test_multi_turn_chat_trains_every_assistant_turn_only(tok):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "Goodbye."},
    ]
    ids, labels = encode_chat(tok, messages, "x")
    assert tok.decode(ids) == tok.apply_chat_template(messages, tokenize=False)
    assert trained_text(tok, {"input_ids": ids, "labels": labels}) == f"Hello.{tok.eos_token}Goodbye.{tok.eos_token}"


def test_text_rows_train_every_token_plus_eos(tok):
    [ex] = tokenize_rows([{"text": "Once upon a time"}], "text", "x.jsonl", tok, 512)
    assert ex["input_ids"][-1] == tok.eos_token_id and ex["labels"] == ex["input_ids"]


def test_base_tokenizer_without_template_gets_chatml(tok):
    import copy

    bare = copy.deepcopy(tok)
    bare.chat_template = None
    ensure_chat_template(bare)
    [ex] = tokenize_rows([{"instruction": "Q", "output": "A"}], "alpaca", "x", bare, 512)
    assert trained_text(bare, ex) == "A" + bare.eos_token


@pytest.mark.parametrize("ext", [".jsonl", ".json", ".csv", ".parquet"])
def test_file_types_load(tmp_path, ext):
    rows = [{"instruction": f"q{i}", "input": "", "output": f"a{i}"} for i in range(5)]
    path = tmp_path / f"d{ext}"
    df = pd.DataFrame(rows)
    {".jsonl": lambda: df.to_json(path, orient="records", lines=True),
     ".json": lambda: path.write_text(json.dumps(rows)),
     ".csv": lambda: df.to_csv(path, index=False),
     ".parquet": lambda: df.to_parquet(path)}[ext]()
    got = read_rows(path)
    assert len(got) == 5 and detect_format(got, path) == "alpaca"


@pytest.mark.parametrize(
    "bad_row, expect",
    [
        ({"instruction": "q", "output": ""}, "'output' must be a non-empty string"),
        ({"instruction": "q", "output": 3}, "'output' must be a non-empty string"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant message"),
        ({"messages": [{"role": "bot", "content": "hi"}]}, "messages[0] needs a role"),
        ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                       {"role": "user", "content": "and?"}]}, "the conversation ends on a user turn (messages[2])"),
        ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ["a"]}]},
         "messages[1].content must be a non-empty string, got ['a']"),
    ],
)
def test_malformed_row_names_file_and_row(tmp_path, tok, bad_row, expect):
    good = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]} \
        if "messages" in bad_row else {"instruction": "q", "output": "a"}
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [good, good, bad_row]))
    with pytest.raises(DataError) as err:
        load_splits(str(path), None, "auto", tok, 512, 0.3, None, 0)
    assert f"{path}: row 3" in str(err.value) and expect in str(err.value)


def test_unparseable_and_unknown_columns(tmp_path, tok):
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"instruction": "q", "output": "a"}\n{not json\n')
    with pytest.raises(DataError, match="broken.jsonl"):
        read_rows(broken)
    odd = tmp_path / "odd.jsonl"
    odd.write_text('{"question": "q", "answer": "a"}\n')
    with pytest.raises(DataError, match="cannot tell the format"):
        load_splits(str(odd), None, "auto", tok, 512, 0.5, None, 0)
    txt = tmp_path / "x.txt"
    txt.write_text("x")
    with pytest.raises(DataError, match="unsupported file type"):
        read_rows(txt)


def test_allowed_file_shapes(tmp_path):
    """Accepted, not refused: a UTF-8 byte-order mark, blank lines between JSON lines (rows keep
    their line numbers), JSON lines in a .json file, CSV cells as text, a CSV field over the csv
    module's 128 KiB default."""
    qa = {"instruction": "q", "output": "4"}
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + (json.dumps(qa) + "\n\n").encode() * 2)
    rows = read_rows(bom)
    assert rows == [qa, qa] and rows.labels == ["row 1", "row 2 (line 3)"]
    raw = tmp_path / "raw.jsonl"  # U+2028 and U+0085 may stand unescaped inside a JSON string
    raw.write_text('{"text": "a\u2028b\u0085c"}\r\n{"text": "d"}\n', encoding="utf-8")
    assert read_rows(raw) == [{"text": "a\u2028b\u0085c"}, {"text": "d"}]
    lines = tmp_path / "lines.json"
    lines.write_text(json.dumps(qa) + "\n" + json.dumps(qa) + "\n")
    assert read_rows(lines) == [qa, qa]
    big = tmp_path / "big.csv"
    big.write_text("instruction,output\n" + "w " * 100_000 + ",4\n")
    [row] = read_rows(big)
    assert row["output"] == "4" and len(row["instruction"]) == 200_000


def test_row_of_another_format_is_blamed_not_row_1(tmp_path, tok):
    """datasets unified the columns of all rows, so a chat row after alpaca rows made row 1 look
    like chat; each row now keeps its own keys."""
    path = tmp_path / "mixed.jsonl"
    chat = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    path.write_text("".join(json.dumps(r) + "\n" for r in [{"instruction": "q", "output": "a"}] * 2 + [chat]))
    with pytest.raises(DataError, match=r"mixed.jsonl: row 3: a chat row \(has messages\) in a file of alpaca rows"):
        load_splits(str(path), None, "auto", tok, 512, 0.3, None, 0)


def test_default_data_has_held_out_split(tok):
    train, val = load_splits(None, None, "auto", tok, 512, 0.05, None, 0)
    assert len(train) > 1000 and len(val) > 50
    as_text = {tuple(e["input_ids"]) for e in train}
    assert not any(tuple(e["input_ids"]) in as_text for e in val)  # no leak from train into val


def test_truncation_drops_rows_without_response(tok):
    rows = [{"instruction": "word " * 200, "output": "x"}, {"instruction": "q", "output": "a"}]
    out = tokenize_rows(rows, "alpaca", "x", tok, 64)
    assert len(out) == 1 and all(len(e["input_ids"]) <= 64 for e in out)


def test_collate_masks_padding_by_position_not_id():
    eos = 7
    exs = [{"input_ids": [1, 2, eos], "labels": [IGNORE, 2, eos]}, {"input_ids": [1, eos], "labels": [IGNORE, eos]}]
    b = collate(exs, pad_id=eos)
    assert b["input_ids"].tolist() == [[1, 2, eos], [1, eos, eos]]
    assert b["labels"].tolist() == [[IGNORE, 2, eos], [IGNORE, eos, IGNORE]]
    assert b["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]


def test_schedule_is_deterministic_and_splits_ranks():
    lengths = list(range(10, 47))
    one = BatchSchedule(lengths, 2, 2, world_size=1, rank=0, seed=3)
    ranks = [BatchSchedule(lengths, 2, 1, world_size=2, rank=r, seed=3) for r in range(2)]
    for step in range(12):  # crosses epoch boundaries (37 examples, 4 per step)
        whole = sorted(i for mb in one.micro_batches(step) for i in mb)
        parts = [i for r in ranks for mb in r.micro_batches(step) for i in mb]
        assert sorted(parts) == whole and len(set(whole)) == len(whole)
    again = BatchSchedule(lengths, 2, 2, 1, 0, seed=3)
    assert again.micro_batches(5) == one.micro_batches(5)
    assert BatchSchedule(lengths, 2, 2, 1, 0, seed=4).micro_batches(0) != one.micro_batches(0)


def test_schedule_resumed_on_another_number_of_ranks_goes_on_with_the_next_example():
    """Three steps on two ranks (8 examples a step), then a resume as one process (4 a step): the
    examples the resumed steps take are the ones an uninterrupted run on two ranks would have taken
    next, in the same data order, across an epoch boundary (37 examples)."""
    lengths = list(range(10, 47))
    two = [BatchSchedule(lengths, 2, 2, world_size=2, rank=r, seed=3) for r in range(2)]
    alone = BatchSchedule(lengths, 2, 2, world_size=1, rank=0, seed=3, resumed=(3, two[0].start(3)))
    assert two[0].start(3) == 24 and alone.start(3) == 24 and alone.start(5) == 32
    for before, after in ((3, 3), (4, 5)):  # a step of two ranks == the next two steps of one process
        whole = sorted(i for r in two for mb in r.micro_batches(before) for i in mb)
        assert sorted(i for s in (after, after + 1) for mb in alone.micro_batches(s) for i in mb) == whole
    assert alone.epoch_of(10) == 52 / 37


def test_epoch_covers_every_example_once():
    sched = BatchSchedule([5] * 20, 5, 1, 1, 0, seed=0)
    seen = [i for step in range(4) for mb in sched.micro_batches(step) for i in mb]
    assert sorted(seen) == list(range(20))
    assert torch.tensor(seen).unique().numel() == 20


def test_group_by_length_is_optimal_and_keeps_the_memory_bound():
    """Micro-batches of one step: fewest padded tokens + a fixed cost per micro-batch, at most
    `cap` examples each, never more padded tokens than cap x the longest (the fixed-size bound)."""
    import itertools
    import random

    from tunekit.data.batching import group_by_length

    rng = random.Random(0)
    for _ in range(200):
        n, cap, over = rng.randint(1, 9), rng.randint(1, 4), rng.choice([0, 8, 32])
        lengths = sorted((rng.randint(1, 300) for _ in range(n)), reverse=True)
        groups = group_by_length(lengths, cap, over)
        assert [i for g in groups for i in g] == list(range(n)) and all(1 <= len(g) <= cap for g in groups)
        cost = lambda gs: sum(len(g) * lengths[g[0]] + over for g in gs)  # noqa: E731
        best = min(cost([list(range(a, b)) for a, b in zip((0, *cuts), (*cuts, n))])  # every split
                   for k in range(n) for cuts in itertools.combinations(range(1, n), k)
                   if all(0 < b - a <= cap for a, b in zip((0, *cuts), (*cuts, n))))
        assert cost(groups) == best
        assert max(len(g) * lengths[g[0]] for g in groups) <= cap * lengths[0]
    # one long example no longer pads seven short ones to its length
    assert group_by_length([256] + [40] * 7, 8) == [[0], [1, 2, 3, 4, 5, 6, 7]]


def test_held_out_micro_batches_keep_each_ranks_rows_and_cut_padding():
    """The trainer's held-out micro-batches: the rows eval_batches gives each rank, each once, at most
    micro_batch_size a batch, longest first, with no more padded positions than the fixed order;
    packed runs (no padding to save) take consecutive runs of micro_batch_size."""
    import random

    rng = random.Random(0)
    padded = lambda batches, lengths: sum(len(b) * max(lengths[i] for i in b) for b in batches)  # noqa: E731
    for _ in range(50):
        lengths = [rng.choice([rng.randint(5, 40), rng.randint(100, 300)]) for _ in range(rng.randint(1, 40))]
        cap, world = rng.randint(1, 8), rng.randint(1, 3)
        for rank in range(world):
            fixed = eval_batches(len(lengths), cap, world, rank)
            grouped = eval_micro_batches(lengths, cap, world, rank)
            assert sorted(i for b in grouped for i in b) == sorted(i for b in fixed for i in b)
            assert all(1 <= len(b) <= cap for b in grouped)
            flat = [i for b in grouped for i in b]
            assert [lengths[i] for i in flat] == sorted((lengths[i] for i in flat), reverse=True)
            assert padded(grouped, lengths) <= padded(fixed, lengths)
            packed = eval_micro_batches(lengths, cap, world, rank, min_padding=False)
            assert [len(b) for b in packed] == [len(b) for b in fixed] and [i for b in packed for i in b] == flat
    # one long row no longer pads the short ones that share its batch in the fixed order
    assert eval_micro_batches([40, 256, 40, 40], 4, 1, 0) == [[1], [0, 2, 3]]


MULTI_TURN = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
              {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"},
              {"role": "assistant", "content": "Goodbye."}]


@pytest.mark.parametrize("row, fmt", [
    ({"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"},
                        {"from": "gpt", "value": "Hello."}, {"from": "human", "value": "Bye"},
                        {"from": "gpt", "value": "Goodbye."}]}, "sharegpt"),
    ({"prompt": MULTI_TURN[:2], "completion": MULTI_TURN[2:3]}, "prompt_completion"),
])
def test_sharegpt_and_prompt_completion_rows_train_as_their_chat(tok, tmp_path, row, fmt):
    """Detected from their columns, they become the chat rows they are: token by token the same
    input and the same trained tokens (every assistant turn, nothing else)."""
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(row) + "\n")
    assert detect_format(read_rows(path), path) == fmt
    [ex] = tokenize_rows([row], fmt, "x.jsonl", tok, 512)
    messages = MULTI_TURN if fmt == "sharegpt" else MULTI_TURN[:3]
    [ref] = tokenize_rows([{"messages": messages}], "chat", "x.jsonl", tok, 512)
    assert ex["input_ids"] == ref["input_ids"] and ex["labels"] == ref["labels"]


def test_prompt_completion_strings_are_a_user_turn_and_its_reply(tok):
    [ex] = tokenize_rows([{"prompt": "Name a color.", "completion": "Blue."}], "prompt_completion", "x.jsonl", tok, 512)
    [ref] = tokenize_rows([{"instruction": "Name a color.", "output": "Blue."}], "alpaca", "x.jsonl", tok, 512)
    assert ex == ref and trained_text(tok, ex) == "Blue." + tok.eos_token


@pytest.mark.parametrize("bad_row, expect", [
    ({"conversations": [{"from": "human", "value": "hi"}]}, "no assistant ('gpt') turn"),
    ({"conversations": [{"from": "robot", "value": "hi"}, {"from": "gpt", "value": "a"}]},
     "conversations[0] needs 'from' in"),
    ({"conversations": [{"from": "human", "value": ""}, {"from": "gpt", "value": "a"}]},
     "conversations[0].value must be a non-empty string"),
    ({"prompt": "q", "completion": [{"role": "assistant", "content": "a"}]}, "must both be strings or both lists"),
    ({"prompt": [{"role": "user", "content": "q"}], "completion": [{"role": "user", "content": "a"}]},
     "'completion' may hold assistant messages only"),
    ({"conversations": []}, "'conversations' must be a non-empty list of {from, value}, got []"),
    ({"conversations": "hi"}, "'conversations' must be a non-empty list"),
    ({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"},
                        {"from": "human", "value": "b"}]},
     "the conversation ends on a user turn (conversations[2]); the last turn must be the assistant's reply"),
    ({"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "q"},
                        {"from": "gpt", "value": 3}]},
     "conversations[2].value must be a non-empty string, got 3"),
    ({"conversations": [{"from": "human"}, {"from": "gpt", "value": "a"}]},
     "conversations[0].value must be a non-empty string, got None"),
    ({"conversations": [{"value": "q"}, {"from": "gpt", "value": "a"}]}, "conversations[0] needs 'from' in"),
    ({"conversations": [{"from": 1, "value": "q"}, {"from": "gpt", "value": "a"}]}, "conversations[0] needs 'from' in"),
    ({"conversations": ["q", {"from": "gpt", "value": "a"}]}, "conversations[0] needs 'from' in"),
    ({"prompt": "q"}, "no 'completion': a prompt_completion row needs 'prompt' and 'completion', it has ['prompt']"),
    ({"completion": "a", "prompt": None}, "no 'prompt': a prompt_completion row needs"),
    ({"prompt": "q", "completion": ""}, "'completion' must be a non-empty string, got ''"),
    ({"prompt": 3, "completion": "a"}, "must both be strings or both lists of {role, content}, got int and str"),
    ({"prompt": [{"role": "human", "content": "q"}], "completion": [{"role": "assistant", "content": "a"}]},
     "prompt[0] needs a role in ['assistant', 'system', 'user']"),
    ({"prompt": [{"role": "user", "content": 5}], "completion": [{"role": "assistant", "content": "a"}]},
     "prompt[0].content must be a non-empty string, got 5"),
    ({"prompt": [{"role": "user", "content": "q"}], "completion": []}, "'completion' must be a non-empty list"),
])
def test_malformed_sharegpt_and_prompt_completion_rows_name_file_and_row(tmp_path, tok, bad_row, expect):
    good = ({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
            if "conversations" in bad_row else {"prompt": "q", "completion": "a"})
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [good, good, bad_row]))
    with pytest.raises(DataError) as err:
        load_splits(str(path), None, "auto", tok, 512, 0.3, None, 0)
    assert f"{path}: row 3" in str(err.value) and expect in str(err.value)


@pytest.mark.parametrize("epochs, rows, batch, steps", [
    (3, 600, 16, 113),    # 37.5 steps an epoch: 112.5 rounded up; the last step is whole
    (2, 64, 16, 8),       # exact: no rounding
    (0.5, 7, 2, 2),       # half of 7 rows is 4 rows (rounded up), 2 steps of 2
    (0.1, 30, 1, 3),      # 0.1 x 30 in floats is 3.0000000000000004: still 3 steps, not 4
    (1, 5, 16, 1),        # a batch larger than the data: one step
    (0.01, 10, 4, 1),     # a sliver of an epoch still trains a step
])
def test_steps_for_epochs_round_up_to_whole_steps(epochs, rows, batch, steps):
    from tunekit.data.batching import steps_for_epochs

    assert steps_for_epochs(epochs, rows, batch) == steps


def test_steps_for_epochs_counts_ranks_and_a_resume():
    from tunekit.data.batching import describe_epochs, steps_for_epochs

    # micro 8 x accum 2 x 2 ranks: a global batch of 32, 600 rows x 3 = 1800 -> 56.25 -> 57 steps
    assert steps_for_epochs(3, 600, 8 * 2 * 2) == 57
    line = describe_epochs(3, 600, 8, 2, 2, 57)
    assert line == ("trainer.epochs=3: 600 training rows / global batch 32 (micro_batch_size 8 x grad_accum 2 x "
                    "2 ranks) = 18.75 steps an epoch -> 57 steps (the last step is whole: its last 24 rows are the "
                    "first of the next pass's order)")
    assert describe_epochs(1.5, 39, 4, 2, 1, 8).endswith(
        "1.5 epochs = 59 rows (rounded up) -> 8 steps (the last step is whole: 5 rows past 1.5 epochs)")
    # resumed on the same ranks: the same count from any checkpoint
    assert all(steps_for_epochs(3, 600, 32, (k, 32 * k)) == 57 for k in (1, 20, 56))
    # resumed on one rank after 20 steps on two (640 rows done): 1160 rows left at 16 a step -> 73 more
    assert steps_for_epochs(3, 600, 16, (20, 640)) == 20 + 73
    # a checkpoint past the epochs' rows: no step left (the resume is then refused)
    assert steps_for_epochs(1, 600, 32, (30, 960)) == 30


def test_a_resumed_schedule_takes_the_same_rows_across_an_epoch_boundary():
    """The rows of step k are a function of k: a schedule built at a resume gives the rows an
    uninterrupted one does, also for the step that straddles two epochs (10 rows, 4 a step: step 2
    takes rows 8-9 of epoch 0's order and 0-1 of epoch 1's)."""
    lengths = [3 + i for i in range(10)]
    whole = BatchSchedule(lengths, 2, 2, 1, 0, seed=5)
    resumed = BatchSchedule(lengths, 2, 2, 1, 0, seed=5, resumed=(2, 8))
    for k in (2, 3, 7):
        assert resumed.micro_batches(k) == whole.micro_batches(k)
    assert whole.epoch_of(2) == 0.8 and whole.epoch_of(3) == 1.2
    straddle = sorted(i for mb in whole.micro_batches(2) for i in mb)
    assert straddle == sorted(whole._perm(0)[8:] + whole._perm(1)[:2])
