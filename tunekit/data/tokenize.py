"""Tokenize rows into (input_ids, labels) with the loss on response tokens only.

A chat is rendered with the tokenizer's chat template piece by piece: everything up to an
assistant turn's generation prompt is context (label -100), the assistant's text up to and
including its end-of-turn token is trained. The EOS is always in the labels: padding is masked
by sequence length in the collator, never by token id, so a pad token equal to EOS (SmolLM2)
cannot hide it.
"""

from __future__ import annotations

from typing import Optional

from tunekit.data.formats import DataError

IGNORE = -100

# Used only when a tokenizer ships no chat template (base models); ChatML is the common default.
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + eos_token + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def ensure_chat_template(tokenizer) -> None:
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = CHATML


def _render(tokenizer, messages: list[dict], generation_prompt: bool) -> str:
    if not messages and not generation_prompt:
        return ""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"] if text else []


def encode_chat(tokenizer, messages: list[dict], where: str) -> tuple[list[int], list[int]]:
    eos = tokenizer.eos_token_id
    input_ids: list[int] = []
    labels: list[int] = []
    done = ""  # text rendered so far
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        try:
            before = _render(tokenizer, messages[:i], generation_prompt=True)
            after = _render(tokenizer, messages[: i + 1], generation_prompt=False)
        except Exception as e:  # jinja2's TemplateError: templates raise_exception() on turns they refuse
            reason = " ".join(str(e).split())[:200] or type(e).__name__
            raise DataError(f"{where}: the tokenizer's chat template refuses this conversation ({reason})") from None
        if not (before.startswith(done) and after.startswith(before)):
            raise DataError(f"{where}: the tokenizer's chat template does not render turn by turn; cannot mask prompts")
        context = _ids(tokenizer, before[len(done):])
        reply = _ids(tokenizer, after[len(before):])
        # Train up to and including the first EOS; what the template adds after it (a newline) is
        # context, and a template that ends a turn without EOS gets one appended.
        cut = reply.index(eos) + 1 if eos in reply else len(reply)
        trained, tail = reply[:cut], reply[cut:]
        if eos not in trained:
            trained = trained + [eos]
        input_ids += context + trained + tail
        labels += [IGNORE] * len(context) + trained + [IGNORE] * len(tail)
        done = after
    return input_ids, labels


def encode_text(tokenizer, text: str) -> tuple[list[int], list[int]]:
    ids = tokenizer(text, add_special_tokens=True)["input_ids"] + [tokenizer.eos_token_id]
    return ids, list(ids)


def encode_example(tokenizer, messages: Optional[list[dict]], row: dict, where: str, max_len: int):
    """Returns {"input_ids", "labels"} truncated to max_len, or None if no trained token survives."""
    if messages is None:
        input_ids, labels = encode_text(tokenizer, row["text"])
    else:
        input_ids, labels = encode_chat(tokenizer, messages, where)
    input_ids, labels = input_ids[:max_len], labels[:max_len]
    # labels[0] is never predicted (no token before it), so it does not count as trained
    if all(label == IGNORE for label in labels[1:]):
        return None
    return {"input_ids": input_ids, "labels": labels}
