"""Tokenize rows into (input_ids, labels) with the loss on response tokens only.

The masking rule: a chat trains on every assistant turn's tokens, from the end of the template's
generation prompt up to and including the end-of-turn token the template emits after the reply
(ChatML's <|im_end|>, Llama-3's <|eot_id|>, Gemma's <end_of_turn>, Llama-2/Mistral's </s>), and
on no other token: system and user turns, the headers, and what the template adds after the
end-of-turn token (ChatML's newline) are context, label -100.

How: the chat is rendered with the tokenizer's chat template on prefixes of the conversation.
render(messages[:i], add_generation_prompt=True) is the prompt a model sees when it is asked for
turn i; render(messages[:i + 1]) minus that prompt is the text the model must generate. The
prompt is tokenized as a piece of its own, as at generation time, so the reply starts at a token
boundary exactly as generated tokens do. The end-of-turn token is the first EOS or special token
of the reply after the reply's content (special tokens some templates put before the content,
e.g. a channel header, are not its end). A template whose turns end in plain text (no EOS, no
special token) gets an EOS appended to each reply: the model must learn to stop somewhere.

The EOS is always in the labels: padding is masked by sequence length in the collator, never by
token id, so a pad token equal to EOS (SmolLM2) cannot hide it.
"""

from __future__ import annotations

from typing import Optional

from tunekit import TunekitError
from tunekit.data.formats import DataError
from tunekit.model.template import sandbox_refusal

IGNORE = -100

# Used only when a tokenizer ships no chat template (base models); ChatML is the common default.
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + eos_token + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def ensure_chat_template(tokenizer) -> None:
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = CHATML


def end_of_turn_ids(tokenizer) -> frozenset[int]:
    """The tokens that can end an assistant turn: EOS and every special token, less BOS and UNK
    (UNK can stand inside a reply's content; BOS opens a sequence, never closes a turn)."""
    ids = set(tokenizer.all_special_ids)
    for i, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(added, "special", False):
            ids.add(i)
    ids -= {tokenizer.unk_token_id, tokenizer.bos_token_id}
    ids.add(tokenizer.eos_token_id)
    ids.discard(None)
    return frozenset(ids)


def render_chat(tokenizer, messages: list[dict], generation_prompt: bool) -> str:
    """The chat template's text for `messages` (every rendering of a template goes through here). A
    template that jinja's sandbox stops (it reached for Python's internals in a way no check before
    could see) is one TunekitError naming its file; the template's other errors are the caller's."""
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except Exception as e:
        refused = sandbox_refusal(tokenizer, e)
        if refused is None:
            raise
        raise refused from None


def _render(tokenizer, messages: list[dict], generation_prompt: bool) -> str:
    if not messages and not generation_prompt:
        return ""
    return render_chat(tokenizer, messages, generation_prompt)


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"] if text else []


def _reply_end(tokenizer, reply: str, content: str, ends: frozenset[int]) -> tuple[list[int], Optional[int]]:
    """(the reply's token ids, how many of them train: up to and including its end-of-turn token;
    None when the template emits none)."""
    try:
        enc = tokenizer(reply, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = enc["input_ids"], enc["offset_mapping"]
    except (NotImplementedError, ValueError, TypeError):  # a slow tokenizer: no character offsets
        ids, offsets = _ids(tokenizer, reply), None
    first = 0  # the first token that may be the end of the turn: the first after the content
    at = reply.find(content.strip())
    if offsets is not None and at >= 0:
        content_end = at + len(content.strip())
        first = next((j for j, (start, _) in enumerate(offsets) if start >= content_end), len(ids))
    cut = next((j + 1 for j in range(first, len(ids)) if ids[j] in ends), None)
    return ids, cut


def encode_chat(tokenizer, messages: list[dict], where: str,
                ends: Optional[frozenset[int]] = None) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of one conversation, each (seq,); labels are IGNORE except on the
    assistant turns' tokens (see the module docstring)."""
    ends = end_of_turn_ids(tokenizer) if ends is None else ends
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
        except TunekitError:
            raise
        except Exception as e:  # jinja2's TemplateError: templates raise_exception() on turns they refuse
            reason = " ".join(str(e).split())[:200] or type(e).__name__
            raise DataError(f"{where}: the tokenizer's chat template refuses this conversation ({reason})") from None
        if not (before.startswith(done) and after.startswith(before)):
            raise DataError(f"{where}: the tokenizer's chat template does not render turn by turn; cannot mask prompts")
        context = _ids(tokenizer, before[len(done):])
        reply, cut = _reply_end(tokenizer, after[len(before):], m["content"], ends)
        if cut is None:  # the template ends the turn in plain text: train the reply, then an EOS
            trained, tail = reply + [eos], []
        else:  # what the template adds after the end-of-turn token (a newline) is context
            trained, tail = reply[:cut], reply[cut:]
        input_ids += context + trained + tail
        labels += [IGNORE] * len(context) + trained + [IGNORE] * len(tail)
        done = after
    return input_ids, labels


def turn_end_id(tokenizer) -> Optional[int]:
    """The token a trained reply ends with under the tokenizer's chat template: <|im_end|> (ChatML),
    <|eot_id|> (Llama-3), <end_of_turn> (Gemma), </s> ([INST] templates); EOS where turns end in
    plain text. A model tuned here stops its replies there, so generation should stop there too,
    besides EOS (they differ where a base tokenizer's EOS is <|end_of_text|>, or for Gemma)."""
    if not getattr(tokenizer, "chat_template", None):
        return tokenizer.eos_token_id  # training renders with CHATML, whose turns end in EOS
    probe = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    try:
        ids, labels = encode_chat(tokenizer, probe, "chat template")
    except DataError:  # a template that refuses the probe: EOS is the best guess
        return tokenizer.eos_token_id
    trained = [t for t, label in zip(ids, labels) if label != IGNORE]
    return trained[-1] if trained else tokenizer.eos_token_id


def encode_text(tokenizer, text: str) -> tuple[list[int], list[int]]:
    ids = tokenizer(text, add_special_tokens=True)["input_ids"] + [tokenizer.eos_token_id]
    return ids, list(ids)


def encode_example(tokenizer, messages: Optional[list[dict]], row: dict, where: str, max_len: int,
                   ends: Optional[frozenset[int]] = None) -> tuple[Optional[dict], Optional[int]]:
    """(example, lost): the example {"input_ids", "labels"} (each (seq,), seq <= max_len), or None if no
    trained token survives the truncation; `lost` is None where the row fits max_len, else how many
    trained tokens the cut took (0 when it took context only)."""
    if messages is None:
        input_ids, labels = encode_text(tokenizer, row["text"])
    else:
        input_ids, labels = encode_chat(tokenizer, messages, where, ends)
    lost = sum(label != IGNORE for label in labels[max_len:]) if len(input_ids) > max_len else None
    input_ids, labels = input_ids[:max_len], labels[:max_len]
    # labels[0] is never predicted (no token before it), so it does not count as trained
    if all(label == IGNORE for label in labels[1:]):
        return None, lost
    return {"input_ids": input_ids, "labels": labels}, lost
