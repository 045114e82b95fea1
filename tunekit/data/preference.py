"""Preference rows (objective=preference): TRL's paired and unpaired forms, checked and tokenized.

Row forms, one per file (the first row decides; tunekit.data.formats reads the file):
  pairs, explicit prompt: {"prompt", "chosen", "rejected"}, all three strings (the prompt is the
      user's turn, chosen and rejected the assistant's replies) or all three message lists (the
      prompt's messages, then chosen's and rejected's assistant messages)
  pairs, implicit prompt: {"chosen", "rejected"}, each a whole conversation (message list); the
      prompt is the longest run of messages they share from the start (TRL's extract_prompt)
  unpaired (KTO): {"prompt", "completion", "label"}, prompt and completion as in TRL's
      prompt-completion rows, label true (desirable) or false (undesirable)

Each side is rendered with the chat template exactly as SFT renders a chat (tunekit.data.tokenize):
the loss counts the completion's tokens only (the prompt's own assistant turns, in a multi-turn
prompt, are context). A pair whose longer side exceeds data.max_seq_len loses the START of its
prompt (the turns nearest the completion are kept, as TRL keeps the prompt's end), the same tokens
from both sides; a completion longer than what is left loses its end. Both cuts are counted.
Every check here needs no tokenizer, so `check_rows` runs before anything loads.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from tunekit.data.batching import collate
from tunekit.data.formats import DataError, _messages, _need_str, read_rows
from tunekit.data.tokenize import IGNORE, encode_chat, end_of_turn_ids, ensure_chat_template

PAIRS, UNPAIRED = "pairs", "unpaired"
PAIR_KEYS, KTO_KEYS = ("chosen", "rejected"), ("prompt", "completion", "label")


def row_kind(row: dict) -> Optional[str]:
    """pairs (chosen + rejected), unpaired (prompt + completion + label) or None."""
    if any(row.get(k) is not None for k in PAIR_KEYS):
        return PAIRS
    if row.get("label") is not None or (row.get("completion") is not None and row.get("prompt") is not None):
        return UNPAIRED
    return None


def _what(kind: Optional[str]) -> str:
    return {PAIRS: "a preference pair (chosen/rejected)", UNPAIRED: "an unpaired row (prompt/completion/label)"}.get(
        kind, "neither a preference pair nor an unpaired row")


def detect_kind(rows: list[dict], path) -> str:
    kind = row_kind(rows[0])
    if kind is None:
        raise DataError(f"{path}: row 1: objective=preference needs preference rows: 'prompt'+'chosen'+'rejected', "
                        "'chosen'+'rejected' conversations, or 'prompt'+'completion'+'label' (KTO); its columns are "
                        f"{sorted(rows[0])}")
    return kind


def _side(value: Any, key: str, where: str) -> list[dict]:
    """A completion (chosen, rejected, completion) given as a message list: assistant messages only."""
    out = _messages(value, key, where)
    if any(m["role"] != "assistant" for m in out):
        raise DataError(f"{where}: '{key}' may hold assistant messages only (the reply that is scored)")
    return out


def _shared_prefix(chosen: list[dict], rejected: list[dict]) -> int:
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    return n


def pair_messages(row: dict, where: str) -> tuple[list[dict], list[dict], list[dict]]:
    """(prompt, chosen, rejected) message lists of a paired row; one DataError for a bad row."""
    chosen, rejected, prompt = row.get("chosen"), row.get("rejected"), row.get("prompt")
    for key, value in (("chosen", chosen), ("rejected", rejected)):
        if value is None:
            raise DataError(f"{where}: no {key!r}: a preference pair needs both 'chosen' and 'rejected', "
                            f"it has {sorted(k for k, v in row.items() if v is not None)}")
    if prompt is None:
        if isinstance(chosen, str) or isinstance(rejected, str):
            raise DataError(f"{where}: 'chosen' and 'rejected' without a 'prompt' must be whole conversations "
                            "(lists of {role, content}); give the prompt in 'prompt'")
        c, r = _messages(chosen, "chosen", where), _messages(rejected, "rejected", where)
        n = _shared_prefix(c, r)
        while n and c[n - 1]["role"] == "assistant":  # the prompt ends before a reply, never inside one
            n -= 1
        if c == r:
            raise DataError(f"{where}: 'chosen' and 'rejected' are the same conversation: nothing to prefer")
        if n == 0:
            raise DataError(f"{where}: 'chosen' and 'rejected' share no prompt: the implicit-prompt form needs "
                            "conversations that start with the same turns (or give 'prompt' explicitly)")
        head, c, r = c[:n], c[n:], r[n:]
        for key, side in (("chosen", c), ("rejected", r)):
            if not side or any(m["role"] != "assistant" for m in side):
                raise DataError(f"{where}: after the turns both share, {key!r} must go on with assistant turns only")
        return head, c, r
    if all(isinstance(v, str) for v in (prompt, chosen, rejected)):
        user = [{"role": "user", "content": _need_str(prompt, "'prompt'", where)}]
        c = [{"role": "assistant", "content": _need_str(chosen, "'chosen'", where)}]
        r = [{"role": "assistant", "content": _need_str(rejected, "'rejected'", where)}]
    elif all(isinstance(v, list) for v in (prompt, chosen, rejected)):
        user = _messages(prompt, "prompt", where)
        c, r = _side(chosen, "chosen", where), _side(rejected, "rejected", where)
    else:
        raise DataError(f"{where}: 'prompt', 'chosen' and 'rejected' must all be strings or all lists of "
                        f"{{role, content}}, got {type(prompt).__name__}, {type(chosen).__name__} and "
                        f"{type(rejected).__name__}")
    if c == r:
        raise DataError(f"{where}: 'chosen' and 'rejected' are the same: nothing to prefer")
    return user, c, r


def unpaired_messages(row: dict, where: str) -> tuple[list[dict], list[dict], bool]:
    """(prompt, completion, desirable) of a KTO row; one DataError for a bad row."""
    prompt, completion, label = row.get("prompt"), row.get("completion"), row.get("label")
    for key, value in (("prompt", prompt), ("completion", completion), ("label", label)):
        if value is None:
            raise DataError(f"{where}: no {key!r}: an unpaired (KTO) row needs 'prompt', 'completion' and 'label', "
                            f"it has {sorted(k for k, v in row.items() if v is not None)}")
    if not isinstance(label, bool):
        raise DataError(f"{where}: 'label' must be true (desirable) or false (undesirable), got {label!r:.40}")
    if isinstance(prompt, str) and isinstance(completion, str):
        return ([{"role": "user", "content": _need_str(prompt, "'prompt'", where)}],
                [{"role": "assistant", "content": _need_str(completion, "'completion'", where)}], label)
    if isinstance(prompt, list) and isinstance(completion, list):
        return _messages(prompt, "prompt", where), _side(completion, "completion", where), label
    raise DataError(f"{where}: 'prompt' and 'completion' must both be strings or both lists of {{role, content}}, "
                    f"got {type(prompt).__name__} and {type(completion).__name__}")


def iter_preference(rows, kind: str, path):
    """Yield (where, prompt, sides, desirable): sides = (chosen, rejected) for pairs, (completion,) for
    unpaired rows (desirable then True/False; None for pairs). A row of the other kind is refused."""
    labels = getattr(rows, "labels", None)
    for i, row in enumerate(rows, start=1):
        where = f"{path}: {labels[i - 1] if labels else f'row {i}'}"
        own = row_kind(row)
        if own != kind:
            raise DataError(f"{where}: {_what(own)} in a file of {'preference pairs' if kind == PAIRS else 'unpaired rows'} "
                            "(as its first row); one kind of row per file")
        if kind == PAIRS:
            prompt, c, r = pair_messages(row, where)
            yield where, prompt, (c, r), None
        else:
            prompt, completion, desirable = unpaired_messages(row, where)
            yield where, prompt, (completion,), desirable


def check_rows(path, key: str = "data.path") -> tuple[int, str]:
    """Read and check every row of a preference file (no tokenizer): (rows, kind)."""
    rows = read_rows(path, key)
    kind = detect_kind(rows, path)
    for part in (rows, rows.held_out):
        if part is not None:
            for _ in iter_preference(part, kind, path):
                pass
    return len(rows), kind


@dataclass
class PreferenceCut:
    """What data.max_seq_len cut from one split's preference rows."""

    rows: int = 0
    prompt_cut_rows: int = 0  # rows whose prompt lost its start
    prompt_tokens_lost: int = 0
    completion_cut_rows: int = 0  # rows with a completion that lost its end
    completion_tokens_lost: int = 0  # trained tokens past the cut, over both sides
    dropped: list = field(default_factory=list)  # rows with no trained token left on a side

    def as_dict(self) -> dict:
        return {k: v for k, v in vars(self).items() if k != "dropped"} | {"dropped_rows": len(self.dropped)}

    def phrase(self, what: str) -> str:
        parts = []
        if self.prompt_cut_rows:
            parts.append(f"{self.prompt_cut_rows} of {self.rows} {what} prompts lose their start "
                         f"({self.prompt_tokens_lost:,} tokens)")
        if self.completion_cut_rows:
            parts.append(f"{self.completion_cut_rows} {what} rows lose the end of a completion "
                         f"({self.completion_tokens_lost:,} trained tokens)")
        return "; ".join(parts) or f"no {what} row cut"


def _encode_side(tokenizer, prompt: list[dict], side: list[dict], where: str, ends) -> tuple[list[int], list[int]]:
    """(ids, labels) of prompt + side, trained on the side's tokens only."""
    ids, labels = encode_chat(tokenizer, prompt + side, where, ends)
    last = max((i for i, m in enumerate(prompt) if m["role"] == "assistant"), default=None)
    if last is not None:  # the prompt's own replies are context
        context, _ = encode_chat(tokenizer, prompt[: last + 1], where, ends)
        labels = [IGNORE] * len(context) + labels[len(context):]
    return ids, labels


def _first_trained(labels: list[int]) -> int:
    return next((i for i, label in enumerate(labels) if label != IGNORE), len(labels))


def encode_preference(tokenizer, prompt, sides, max_len: int, where: str, ends, cut: PreferenceCut) -> Optional[list]:
    """[(ids, labels)] per side, cut to max_len: the shared prompt loses its start first, then each
    completion its end. None where a side keeps no trained token (counted in `cut.dropped`)."""
    encoded = [_encode_side(tokenizer, prompt, side, where, ends) for side in sides]
    start = min(_first_trained(labels) for _, labels in encoded)  # the shared prompt's tokens
    longest = max(len(ids) for ids, _ in encoded)
    cut.rows += 1
    drop = min(max(0, longest - max_len), max(0, start - 1))  # keep at least the prompt's last token
    if drop:
        cut.prompt_cut_rows += 1
        cut.prompt_tokens_lost += drop
    out, lost = [], 0
    for ids, labels in encoded:
        ids, labels = ids[drop:], labels[drop:]
        lost += sum(label != IGNORE for label in labels[max_len:])
        ids, labels = ids[:max_len], labels[:max_len]
        if all(label == IGNORE for label in labels[1:]):
            cut.dropped.append(where)
            return None
        out.append((ids, labels))
    if lost:
        cut.completion_cut_rows += 1
        cut.completion_tokens_lost += lost
    return out


def tokenize_preference(rows, kind: str, path, tokenizer, max_len: int) -> tuple[list[dict], PreferenceCut]:
    """Examples: pairs {"input_ids", "labels" (chosen), "rejected_input_ids", "rejected_labels"}, unpaired
    {"input_ids", "labels", "desirable"}; and what truncation cut."""
    ensure_chat_template(tokenizer)
    ends, cut, out = end_of_turn_ids(tokenizer), PreferenceCut(), []
    for where, prompt, sides, desirable in iter_preference(rows, kind, path):
        enc = encode_preference(tokenizer, prompt, sides, max_len, where, ends, cut)
        if enc is None:
            continue
        ex = {"input_ids": enc[0][0], "labels": enc[0][1]}
        if kind == PAIRS:
            ex.update(rejected_input_ids=enc[1][0], rejected_labels=enc[1][1])
        else:
            ex["desirable"] = desirable
        out.append(ex)
    if not out:
        raise DataError(f"{path}: no usable rows: no completion token of any row fits data.max_seq_len={max_len}")
    return out, cut


def example_length(e: dict) -> int:
    """The longer side of a pair (what its micro-batch pads to), or the row's length."""
    return max(len(e["input_ids"]), len(e.get("rejected_input_ids", ())))



def mismatched_rows(examples: list[dict], max_len: int) -> list[dict]:
    """KTO's KL rows: row i's prompt followed by row i-1's completion (the first row takes the last
    row's), as TRL cycles completions within a batch; each cut to max_len keeping its start. The
    prompt is everything before a row's first trained token (its chat header included)."""
    out = []
    for e, prev in zip(examples, examples[-1:] + examples[:-1]):
        start, cut = _first_trained(e["labels"]), _first_trained(prev["labels"])
        ids = e["input_ids"][:start] + prev["input_ids"][cut:]
        labels = [IGNORE] * start + prev["labels"][cut:]
        out.append({"input_ids": ids[:max_len], "labels": labels[:max_len]})
    return out


def collate_preference(examples: list[dict], pad_id: int, kl_max_len: Optional[int] = None) -> dict[str, torch.Tensor]:
    """A micro-batch of N pairs as 2N rows, the chosen sides first then the rejected in the same order
    (one forward for both); of N unpaired rows as N rows with their `desirable` flags, and with
    `kl_max_len` their mismatched rows (`mismatched_rows`) as kl_input_ids, kl_attention_mask, kl_labels.
    Rows whose reference log-probs were computed once (preference.precompute_ref) carry them as
    `ref_logps`, (2N,) or (N,) in the rows' order."""
    if "rejected_input_ids" in examples[0]:
        sides = [{"input_ids": e["input_ids"], "labels": e["labels"]} for e in examples]
        sides += [{"input_ids": e["rejected_input_ids"], "labels": e["rejected_labels"]} for e in examples]
        batch = collate(sides, pad_id)
    else:
        batch = collate(examples, pad_id)
        batch["desirable"] = torch.tensor([bool(e["desirable"]) for e in examples])
        if kl_max_len is not None:
            batch.update({f"kl_{k}": v for k, v in collate(mismatched_rows(examples, kl_max_len), pad_id).items()})
    if all("ref_logps" in e for e in examples):
        batch["ref_logps"] = torch.tensor([e["ref_logps"][side] for side in range(len(examples[0]["ref_logps"]))
                                           for e in examples], dtype=torch.float32)
    return batch


def load_preference_splits(path: str, val_path: Optional[str], tokenizer, max_len: int, val_fraction: float,
                           max_val_examples: Optional[int], seed: int):
    """(train, val) preference examples and (train cut, val cut): data.val_path, a dataset's held-out
    split, or data.val_fraction of data.path's rows held out (as tunekit.data.load_splits does)."""
    rows = read_rows(path)
    kind = detect_kind(rows, path)
    val_rows = rows.held_out if val_path is None else read_rows(val_path, key="data.val_path")
    train, train_cut = tokenize_preference(rows, kind, path, tokenizer, max_len)
    if val_rows is not None:
        val_name = path if val_path is None else val_path
        if detect_kind(val_rows, val_name) != kind:
            raise DataError(f"{val_name}: row 1 is {_what(row_kind(val_rows[0]))}, but the training rows are "
                            f"{'preference pairs' if kind == PAIRS else 'unpaired rows'}; one kind of row for both")
        val, val_cut = tokenize_preference(val_rows, kind, val_name, tokenizer, max_len)
    else:
        order = list(range(len(train)))
        random.Random(seed).shuffle(order)
        n_val = max(1, int(len(train) * val_fraction))
        if len(train) - n_val < 1:
            raise DataError(f"{path}: {len(train)} rows is too few to hold out a validation split")
        val, train = [train[i] for i in sorted(order[:n_val])], [train[i] for i in sorted(order[n_val:])]
        val_cut = None  # the file's cut is counted once, with the training rows
    if max_val_examples is not None:
        val = val[:max_val_examples]
    return train, val, kind, (train_cut, val_cut)


__all__ = ["PAIRS", "UNPAIRED", "PreferenceCut", "check_rows", "collate_preference", "detect_kind", "example_length",
           "iter_preference", "load_preference_splits", "mismatched_rows", "row_kind", "tokenize_preference"]
