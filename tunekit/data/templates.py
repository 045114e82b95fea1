"""data.chat_template: a chat format for the run, and the special tokens it needs.

`data.chat_template=chatml|llama3|<file>.jinja` replaces the tokenizer's chat template. The
template's special tokens (`<|...|>` in its text) that the tokenizer lacks are added to it as
special tokens, so that each is one token, never split into plain-text pieces; the token that
ends a reply under the template (ChatML's <|im_end|>, Llama-3's <|eot_id|>) becomes the
tokenizer's EOS, so that whatever stops generation at EOS stops where the model learned to.
The model's side (embedding rows for the added tokens, trained by LoRA) is
tunekit.model.vocab's. Unset, the tokenizer keeps its own template (tunekit.data.tokenize's
ChatML in plain-text pieces for a tokenizer with none).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from tunekit import TunekitError

KEY = "data.chat_template"

TEMPLATES = {
    # ChatML (Qwen, SmolLM2): <|im_start|>role\ncontent<|im_end|>\n
    "chatml": (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    ),
    # Llama-3's turns, without <|begin_of_text|> (tunekit tokenizes without a BOS):
    # <|start_header_id|>role<|end_header_id|>\n\ncontent<|eot_id|>
    "llama3": (
        "{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + (m['content'] | trim)"
        " + '<|eot_id|>' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
    ),
}

# What counts as a special token in a template's text: <|name|> (ChatML, Llama-3, Phi, ...).
SPECIAL = re.compile(r"<\|[A-Za-z0-9_.:\-]{1,64}\|>")
MAX_FILE_BYTES = 1 << 20


def template_text(value: str) -> str:
    """The template `value` names (a name of TEMPLATES, or a .jinja file), parsed and checked as a
    model folder's templates are; one TunekitError naming data.chat_template otherwise."""
    from jinja2 import TemplateSyntaxError

    from tunekit.model.template import unsafe_access

    if not isinstance(value, str) or not value.strip():
        raise TunekitError(f"{KEY}: give {' or '.join(TEMPLATES)} or a .jinja file, got {value!r}")
    if value in TEMPLATES:
        return TEMPLATES[value]
    path = Path(value).expanduser()
    if path.suffix != ".jinja":
        raise TunekitError(f"{KEY}: {value!r} is neither a template name ({', '.join(TEMPLATES)}) nor a .jinja file")
    if not path.is_file():
        raise TunekitError(f"{KEY}: {value}: no such file" + (" (a folder)" if path.is_dir() else ""))
    if path.stat().st_size > MAX_FILE_BYTES:
        raise TunekitError(f"{KEY}: {value}: over {MAX_FILE_BYTES >> 20} MiB; not a chat template")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TunekitError(f"{KEY}: {value}: unreadable as UTF-8 text ({type(e).__name__})") from None
    try:
        found = unsafe_access(text)
    except TemplateSyntaxError as e:
        raise TunekitError(f"{KEY}: {value}: not a valid chat template (line {e.lineno}: {e.message})") from None
    if found:
        name, line = found[0]
        raise TunekitError(f"{KEY}: {value}: the chat template reaches {name!r} (line {line}), which jinja's sandbox "
                           "refuses; tunekit renders no such template")
    if "messages" not in text:
        raise TunekitError(f"{KEY}: {value}: the template never reads `messages`; not a chat template")
    return text


def template_tokens(text: str) -> list[str]:
    """The special tokens a template's text names, once each, in the order they first appear."""
    return list(dict.fromkeys(SPECIAL.findall(text)))


@dataclass(frozen=True)
class TemplateSetup:
    """What data.chat_template did to a tokenizer: `added` (the tokens it lacked, now special
    tokens, in id order), their ids, the end-of-turn token that became EOS."""

    name: str
    added: tuple[str, ...]
    added_ids: tuple[int, ...]
    turn_end: Optional[str]

    def line(self, vocab_before: int) -> str:
        added = (f"added {len(self.added)} special token(s) the tokenizer lacked ({', '.join(self.added)}: ids "
                 f"{', '.join(map(str, self.added_ids))}; vocabulary {vocab_before} -> {vocab_before + len(self.added)})"
                 if self.added else "the tokenizer has all its special tokens")
        end = f"; replies end with {self.turn_end}, now the EOS" if self.turn_end else ""
        return f"data.chat_template={self.name}: {added}{end}"


def use_template(tokenizer, value: str) -> TemplateSetup:
    """Give `tokenizer` the template `value` names, add the special tokens it lacks, and make the
    token a reply ends with its EOS. The tokenizer is changed in place."""
    from tunekit.data.tokenize import turn_end_id

    text = template_text(value)
    vocab = tokenizer.get_vocab()
    missing = [t for t in template_tokens(text) if t not in vocab]
    if missing:
        tokenizer.add_tokens(missing, special_tokens=True)
    ids = tuple(tokenizer.convert_tokens_to_ids(t) for t in missing)
    before = len(vocab)
    if any(i is None or i < before for i in ids) or len(set(ids)) != len(ids):
        raise TunekitError(f"{KEY}={value}: the tokenizer gave the added tokens {missing} ids {list(ids)}, not new "
                           f"ids from {before}; this tokenizer cannot take new tokens")
    tokenizer.chat_template = text
    end = turn_end_id(tokenizer)
    turn_end = tokenizer.convert_ids_to_tokens(end) if end is not None else None
    if turn_end is not None and end != tokenizer.eos_token_id and turn_end in template_tokens(text):
        tokenizer.eos_token = turn_end
    else:
        turn_end = None
    name = value if value in TEMPLATES else Path(value).name
    return TemplateSetup(name, tuple(missing), ids, turn_end)
