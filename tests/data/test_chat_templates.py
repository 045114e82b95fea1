"""data.chat_template (tunekit.data.templates): the template it names, the special tokens it adds to a
tokenizer that lacks them, the EOS it sets, and how replies are masked under it."""

from __future__ import annotations

import pytest

from tunekit import TunekitError
from tunekit.data.templates import TEMPLATES, template_text, template_tokens, use_template
from tunekit.data.tokenize import IGNORE, encode_chat, turn_end_id
from tunekit.model import load_tokenizer

CHAT = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]


def test_template_tokens_are_read_from_the_text_once_each_in_order():
    assert template_tokens(TEMPLATES["chatml"]) == ["<|im_start|>", "<|im_end|>"]
    assert template_tokens(TEMPLATES["llama3"]) == ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    assert template_tokens("{{ '[INST]' }}<s> plain <|a b|>") == []  # only <|name|> counts


@pytest.mark.parametrize("name, tokens, end", [("chatml", ["<|im_start|>", "<|im_end|>"], "<|im_end|>"),
                                               ("llama3", ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
                                                "<|eot_id|>")])
def test_a_template_less_tokenizer_gets_the_tokens_and_replies_end_with_the_new_eos(template_less_model_dir, name,
                                                                                   tokens, end):
    tok = load_tokenizer(str(template_less_model_dir))
    before = len(tok)
    assert not tok.chat_template and all(t not in tok.get_vocab() for t in tokens)
    setup = use_template(tok, name)
    assert setup.added == tuple(tokens) and setup.added_ids == tuple(range(before, before + len(tokens)))
    assert len(tok) == before + len(tokens) and tok.chat_template == TEMPLATES[name]
    assert tok.eos_token == end == setup.turn_end and turn_end_id(tok) == tok.eos_token_id
    for t, i in zip(tokens, setup.added_ids):  # one token each, never plain-text pieces
        assert tok(t, add_special_tokens=False)["input_ids"] == [i]
    ids, labels = encode_chat(tok, CHAT, "row 1")
    trained = [t for t, label in zip(ids, labels) if label != IGNORE]
    assert tok.decode(trained) == "Hello." + end and trained[-1] == tok.eos_token_id
    again = use_template(tok, name)  # a second time: nothing to add
    assert again.added == () and len(tok) == before + len(tokens)


def test_a_tokenizer_that_has_the_tokens_keeps_its_vocabulary(tiny_model_dir):
    tok = load_tokenizer(str(tiny_model_dir))  # SmolLM2's: ChatML's tokens are ids 1 and 2, <|im_end|> its EOS
    before, eos = len(tok), tok.eos_token_id
    setup = use_template(tok, "chatml")
    assert setup.added == () and len(tok) == before and tok.eos_token_id == eos == turn_end_id(tok)
    assert "the tokenizer has all its special tokens" in setup.line(before)


def test_a_jinja_file_is_read_and_checked(tmp_path):
    f = tmp_path / "mine.jinja"
    f.write_text("{% for m in messages %}<|turn|>{{ m['content'] }}<|end|>{% endfor %}")
    assert template_tokens(template_text(str(f))) == ["<|turn|>", "<|end|>"]
    with pytest.raises(TunekitError, match=r"^data.chat_template: 'chatml2' is neither a template name"):
        template_text("chatml2")
