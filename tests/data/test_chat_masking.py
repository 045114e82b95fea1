"""Multi-turn masking, token by token, under the chat templates a tokenizer may carry.

The rule (tunekit.data.tokenize): every assistant turn trains on what the template emits after its
generation prompt up to and including the end-of-turn token, and no other token trains. The
expected (input_ids, labels) are built here from the rendered text alone: each reply's span
starts where render(messages[:i], add_generation_prompt=True) ends and ends after the
end-of-turn marker this test names per template; the text is tokenized in pieces cut at the
span edges (a prompt is tokenized on its own, as at generation time) and a token trains iff
it lies inside a span. For the template with {% generation %} markers, transformers' own
return_assistant_tokens_mask is a second, independent reference.
"""

from __future__ import annotations

import copy
import json

import pytest
from transformers import AutoTokenizer

from tunekit.data import IGNORE, tokenize_rows
from tunekit.data.tokenize import encode_chat, turn_end_id

LLAMA3 = ("{% for message in messages %}{% set content = '<|start_header_id|>' + message['role'] + "
          "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
          "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
ALTERNATE = ("{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
             "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}")
LLAMA2 = ("{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
          "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
          "{% set system_message = false %}{% endif %}{% for message in loop_messages %}" + ALTERNATE +
          "{% if loop.index0 == 0 and system_message != false %}"
          "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
          "{% else %}{% set content = message['content'] %}{% endif %}{% if message['role'] == 'user' %}"
          "{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
          "{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}")
MISTRAL = ("{{ bos_token }}{% for message in messages %}" + ALTERNATE +
           "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
           "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
           "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}")
GEMMA = ("{{ bos_token }}{% for message in messages %}" + ALTERNATE +
         "{% if message['role'] == 'assistant' %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
         "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
         "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")
CHATML_MARKED = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
                 "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}"
                 "{% endgeneration %}{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\n' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# special tokens between the generation prompt and the content (a channel header, as gpt-oss's,
# whose EOS <|return|> ends only a final answer: a turn in the history ends with <|end|>)
CHANNEL = ("{% for m in messages %}{% if m['role'] == 'assistant' %}"
           "{{ '<|start|>assistant<|channel|>final<|message|>' + m['content'] + '<|end|>' }}"
           "{% else %}{{ '<|start|>' + m['role'] + '<|message|>' + m['content'] + '<|end|>' }}{% endif %}"
           "{% endfor %}{% if add_generation_prompt %}{{ '<|start|>assistant' }}{% endif %}")
# turns end in plain text: no special token to learn, so tunekit appends an EOS to each reply
PLAIN = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n\n' }}{% endfor %}"
         "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")

LLAMA3_TOKENS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|end_of_text|>"]
# id: (template (None: the default tokenizer's own ChatML), special tokens to add, bos, eos,
#      the end-of-turn marker, whether the template takes a system turn, the trained text of each reply)
TEMPLATES = {
    "chatml-default": (None, [], None, None, "<|im_end|>", True,
                       ["Hello! How can I help?<|im_end|>", " Goodbye.\n\nSee you.<|im_end|>"]),
    "llama3": (LLAMA3, LLAMA3_TOKENS, "<|begin_of_text|>", "<|eot_id|>", "<|eot_id|>", True,
               ["Hello! How can I help?<|eot_id|>", "Goodbye.\n\nSee you.<|eot_id|>"]),
    # a base tokenizer: EOS is <|end_of_text|>, the turn still ends at <|eot_id|> and nothing is appended
    "llama3-eos-end-of-text": (LLAMA3, LLAMA3_TOKENS, "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", True,
                               ["Hello! How can I help?<|eot_id|>", "Goodbye.\n\nSee you.<|eot_id|>"]),
    "llama2-inst": (LLAMA2, ["<s>", "</s>"], "<s>", "</s>", "</s>", True,
                    [" Hello! How can I help? </s>", " Goodbye.\n\nSee you. </s>"]),
    "mistral-inst": (MISTRAL, ["<s>", "</s>"], "<s>", "</s>", "</s>", False,
                     ["Hello! How can I help?</s>", " Goodbye.\n\nSee you.</s>"]),
    # EOS (<eos>) is not what ends a turn: <end_of_turn> is, and the newline after it is context
    "gemma": (GEMMA, ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"], "<bos>", "<eos>", "<end_of_turn>",
              False, ["Hello! How can I help?<end_of_turn>", "Goodbye.\n\nSee you.<end_of_turn>"]),
    "chatml-generation-markers": (CHATML_MARKED, [], None, None, "<|im_end|>", True,
                                  ["Hello! How can I help?<|im_end|>", " Goodbye.\n\nSee you.<|im_end|>"]),
    "channel-header": (CHANNEL, ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>"], None,
                       "<|return|>", "<|end|>",
                       True, ["<|channel|>final<|message|>Hello! How can I help?<|end|>",
                              "<|channel|>final<|message|> Goodbye.\n\nSee you.<|end|>"]),
    "plain-text-turns": (PLAIN, [], None, None, "\n\n", True,
                         ["Hello! How can I help?\n\n<|im_end|>", " Goodbye.\n\nSee you.\n\n<|im_end|>"]),
}
SYSTEM = [{"role": "system", "content": "Be brief."}]
CHAT = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Say bye\n"}, {"role": "assistant", "content": " Goodbye.\n\nSee you."}]


@pytest.fixture(scope="module")
def smollm2(default_model_dir):
    return AutoTokenizer.from_pretrained(default_model_dir)


def _tokenizer(base, template, specials, bos, eos):
    tok = copy.deepcopy(base)
    if specials:
        tok.add_tokens(specials, special_tokens=True)
    if bos:
        tok.bos_token = bos
    if eos:
        tok.eos_token = eos
    if template:
        tok.chat_template = template
    return tok


def expected(tok, messages, eot: str, appends_eos: bool):
    """(input_ids, labels) built from the rendered conversation, independently of tunekit's code."""
    full = tok.apply_chat_template(messages, tokenize=False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            prompt = tok.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
            assert full.startswith(prompt)
            content = m["content"].strip()  # some templates trim it
            after_content = full.index(content, len(prompt)) + len(content)
            spans.append((len(prompt), full.index(eot, after_content) + len(eot)))
    bounds = sorted({0, len(full), *(edge for span in spans for edge in span)})
    ids, labels = [], []
    for a, b in zip(bounds, bounds[1:]):
        enc = tok(full[a:b], add_special_tokens=False, return_offsets_mapping=True)
        for t, (s, e) in zip(enc["input_ids"], enc["offset_mapping"]):
            inside = any(lo <= a + s and a + e <= hi for lo, hi in spans)
            ids.append(t)
            labels.append(t if inside else IGNORE)
        if appends_eos and any(hi == b for _, hi in spans):
            ids.append(tok.eos_token_id)
            labels.append(tok.eos_token_id)
    assert appends_eos or tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False) == full
    return ids, labels


def trained_runs(tok, ids, labels) -> list[str]:
    """The decoded text of each run of consecutive trained tokens."""
    runs, current = [], []
    for t, label in zip(ids, labels):
        if label != IGNORE:
            current.append(t)
        elif current:
            runs.append(current)
            current = []
    runs += [current] if current else []
    return [tok.decode(r, skip_special_tokens=False, clean_up_tokenization_spaces=False) for r in runs]


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_every_assistant_turn_and_nothing_else_trains(smollm2, name):
    template, specials, bos, eos, eot, system, replies = TEMPLATES[name]
    tok = _tokenizer(smollm2, template, specials, bos, eos)
    messages = (SYSTEM if system else []) + CHAT
    ids, labels = encode_chat(tok, messages, "x.jsonl: row 1")
    want_ids, want_labels = expected(tok, messages, eot, appends_eos=name == "plain-text-turns")
    assert ids == want_ids
    for j, (got, want) in enumerate(zip(labels, want_labels)):  # every token, named on a mismatch
        assert got == want, f"token {j} {tok.decode([ids[j]])!r}: label {got}, expected {want}"
    assert len(labels) == len(want_labels)
    assert trained_runs(tok, ids, labels) == replies
    # what generation should stop at: the token every reply ends with (EOS where none is special)
    assert turn_end_id(tok) == ids[max(j for j, label in enumerate(labels) if label != IGNORE)]
    assert turn_end_id(tok) == (tok.eos_token_id if name == "plain-text-turns" else tok.convert_tokens_to_ids(eot))
    # the same through the row path (the labels a training step sees)
    [ex] = tokenize_rows([{"messages": messages}], "chat", "x.jsonl", tok, 4096)
    assert ex == {"input_ids": ids, "labels": labels}


def test_generation_markers_agree_with_transformers_assistant_mask(smollm2):
    """transformers' return_assistant_tokens_mask marks the tokens inside {% generation %}: the
    content and <|im_end|>, the same tokens tunekit trains (found without the markers)."""
    template, specials, bos, eos, *_ = TEMPLATES["chatml-generation-markers"]
    tok = _tokenizer(smollm2, template, specials, bos, eos)
    messages = SYSTEM + CHAT + [{"role": "user", "content": "One more?"}, {"role": "assistant", "content": "No."}]
    ref = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, labels = encode_chat(tok, messages, "x")
    assert ids == list(ref["input_ids"])
    assert [int(label != IGNORE) for label in labels] == list(ref["assistant_masks"])
    assert sum(ref["assistant_masks"]) > 3 * 2  # three replies, each several tokens and its <|im_end|>


def test_content_spelling_a_special_token_does_not_end_the_turn(smollm2):
    """A reply whose text holds "<|im_end|>" (tokenized as the special token) trains to its real end."""
    tok = copy.deepcopy(smollm2)
    messages = [{"role": "user", "content": "How does ChatML end a turn?"},
                {"role": "assistant", "content": "With <|im_end|> after the reply."}]
    ids, labels = encode_chat(tok, messages, "x")
    assert trained_runs(tok, ids, labels) == ["With <|im_end|> after the reply.<|im_end|>"]


@pytest.mark.parametrize("name", ["llama3-eos-end-of-text", "gemma"])
def test_generation_and_task_rows_end_where_training_ended_the_reply(smollm2, name):
    """Where the template's end of turn is not EOS, a model tuned here ends its reply at the end of
    turn: generation must stop there, and a row whose reply ends there is a complete task row."""
    from types import SimpleNamespace

    from tunekit.infer.decode import stop_token_ids
    from tunekit.infer.rows import task_rows

    template, specials, bos, eos, eot, system, replies = TEMPLATES[name]
    tok = _tokenizer(smollm2, template, specials, bos, eos)
    end = tok.convert_tokens_to_ids(eot)
    assert end != tok.eos_token_id  # the case this test is about
    no_gen_config = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=None))
    assert end in stop_token_ids(no_gen_config, tok)
    ids, labels = encode_chat(tok, CHAT, "x.jsonl: row 1")
    rows, skipped = task_rows([{"input_ids": ids, "labels": labels}], tok)
    assert skipped == 0 and rows[0].answer[-1] == end


def test_template_check_passes_these_templates_and_finds_every_way_to_name_an_internal(smollm2, tmp_path):
    """tunekit.model.template parses every template above (the {% generation %} block included) and
    finds none of them hostile; the same attribute named as .attr, ['attr'] or |attr('attr') is found,
    with its line, as jinja's sandbox would refuse it. The folder check names the file it read."""
    from tunekit import TunekitError
    from tunekit.model.template import check_chat_templates, unsafe_access

    for template in [smollm2.chat_template, *(t[0] for t in TEMPLATES.values() if t[0] is not None)]:
        assert unsafe_access(template) == []
    assert unsafe_access("{{ x.__class__ }}\n{{ y['__globals__'] }}\n{{ z|attr('__init__') }}{{ g.gi_frame }}") == [
        ("__class__", 1), ("__globals__", 2), ("__init__", 3), ("gi_frame", 3)]
    assert unsafe_access("{{ m['_id'] }}{{ m._private }}") == []  # a dict key, which the sandbox allows
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "default", "template": "{{ messages }}"}, {"name": "tools", "template": "{{ cycler.__init__ }}"}]}))
    with pytest.raises(TunekitError, match=r"^model.path: .*tokenizer_config.json \(its chat_template 'tools'\): "
                                           r"the chat template reaches '__init__' \(line 1\)"):
        check_chat_templates(tmp_path, "model.path")
