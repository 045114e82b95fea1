"""A base whose tokenizer has no chat template and no ChatML tokens trains with data.chat_template=chatml:
<|im_start|> and <|im_end|> are added, their two embedding rows (the head is tied to them) train and
nothing else of the embeddings changes, the adapter and the tokenizer reload, and greedy generation
stops at the <|im_end|> the replies end with. One run of 6 steps on the tiny model."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from _helpers import run_cli

ROWS = 20


@pytest.fixture(scope="module")
def chatml_run(tmp_path_factory, template_less_model_dir):
    d = tmp_path_factory.mktemp("new-tokens")
    data = d / "chat.jsonl"
    # every reply ends with <|im_end|>: at a high rate the new row learns to stop replies at once
    rows = [{"messages": [{"role": "user", "content": f"Question {i}?"}, {"role": "assistant", "content": "OK"}]}
            for i in range(ROWS)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = d / "run"
    r = run_cli(["train", "recipe=lora", f"model.path={template_less_model_dir}", f"data.path={data}",
                 f"output_dir={run}", "data.chat_template=chatml", "trainer.max_steps=6", "trainer.micro_batch_size=4",
                 "trainer.lr=0.1", "trainer.warmup_steps=0", "trainer.eval_every=100", "trainer.save_every=100",
                 "data.val_fraction=0.2", "data.max_seq_len=32"], d)
    assert r.returncode == 0, r.stderr[-3000:]
    return run, r.stdout + r.stderr


def test_the_run_adds_the_tokens_and_trains_their_rows_alone(chatml_run, template_less_model_dir):
    from tunekit.runs.load import load_tokenizer_for, load_trained
    from tunekit.runs.open import open_source

    run, log = chatml_run
    assert "added 2 special token(s) the tokenizer lacked (<|im_start|>, <|im_end|>: ids 49152, 49153" in log
    assert "49152 -> 49154 rows" in log
    base_rows = load_file(str(template_less_model_dir / "model.safetensors"))["model.embed_tokens.weight"]  # bf16
    saved = load_file(str(run / "adapter" / "adapter_model.safetensors"))
    rows = [k for k in saved if "trainable_tokens_delta" in k]
    # peft writes the tied head's rows beside the embeddings' (one trained tensor, two equal keys)
    assert rows and all(saved[k].shape == (2, 64) and torch.equal(saved[k], saved[rows[0]]) for k in rows)
    assert all(".lora_A." in k or ".lora_B." in k for k in saved if k not in rows)  # and LoRA's: nothing else

    src = open_source(str(run))  # the run folder, as eval, generate and export open it
    tok = load_tokenizer_for(src)
    assert len(tok) == 49154 and tok.eos_token == "<|im_end|>" and "<|im_start|>" in tok.chat_template
    assert tok("<|im_start|>user\nHi<|im_end|>", add_special_tokens=False)["input_ids"][::4] == [49152, 49153]
    model = load_trained(src)
    emb = model.get_input_embeddings().weight  # the wrapper's merged view: base rows + trained rows
    head = model.get_output_embeddings().weight
    assert emb.shape == head.shape == (49154, 64)
    # frozen rows come back bit for bit (a bf16 file read into the compute dtype, cast back: exact)
    assert torch.equal(emb[:49152].to(torch.bfloat16), base_rows)
    assert torch.equal(head[:49152], emb[:49152]) and torch.equal(head[49152:], emb[49152:])
    # the new rows moved from their start (the bf16 mean of the base rows) by the trained amount:
    # 6 Adam steps at lr 0.1 move each element by up to ~0.6, far above bf16's rounding of the mean
    start = base_rows.float().mean(dim=0).to(torch.bfloat16).float()
    moved = (emb[49152:].float() - start).abs().amax(dim=1)
    assert (moved > 0.05).all(), moved
    assert torch.equal(emb[49152:].float(), saved[rows[0]].to(emb.dtype).float())


def test_greedy_generation_stops_at_the_new_end_of_turn_token(chatml_run):
    from tunekit.infer.decode import encode_prompts, generate_ids, stop_token_ids
    from tunekit.runs.load import load_tokenizer_for, load_trained
    from tunekit.runs.open import open_source

    src = open_source(str(chatml_run[0] / "adapter"))  # the adapter folder alone, its tokenizer beside it
    tok, model = load_tokenizer_for(src), load_trained(src)
    stops = stop_token_ids(model, tok)
    assert 49153 in stops
    prompts = encode_prompts(tok, ["Question 3?", "Something never seen"])
    assert prompts[0][-4:] == tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    out = generate_ids(model, prompts, [None, None], 8, stops, tok.pad_token_id)
    assert all(row and row[-1] == 49153 and len(row) < 8 for row in out), [tok.convert_ids_to_tokens(r) for r in out]


def test_exports_merged_into_a_gguf_and_refuses_a_gguf_adapter(chatml_run, tmp_path):
    """The merged model into a GGUF holds the grown vocabulary, which llama.cpp reads with the new
    tokens as one token each and <|im_end|> as its EOS; a llama.cpp LoRA adapter cannot grow a
    vocabulary, so gguf-adapter refuses in one line."""
    from tunekit import TunekitError
    from tunekit.export.gguf import write_gguf
    from tunekit.export.gguf_adapter import refuse_early
    from tunekit.runs.load import load_tokenizer_for, load_trained
    from tunekit.runs.open import open_source

    from _helpers import need_llama_cpp

    src = open_source(str(chatml_run[0]))
    with pytest.raises(TunekitError, match=r"^--format gguf-adapter: the run added 2 token\(s\) to the vocabulary"):
        refuse_early(src)  # what export calls with the opened run, before anything loads
    need_llama_cpp()
    from llama_cpp import Llama

    tok = load_tokenizer_for(src)
    path = tmp_path / "merged.gguf"
    write_gguf(src.method_impl.merge(load_trained(src)), tok, path, "fp16")
    llm = Llama(model_path=str(path), n_ctx=64, n_threads=1, verbose=False)
    assert llm.n_vocab() == 49154 and llm.token_eos() == 49153
    assert llm.tokenize(b"<|im_start|>user\nHi<|im_end|>", add_bos=False, special=True)[::4] == [49152, 49153]
    # llama.cpp's own greedy decoding stops at the new end-of-turn token, as tunekit's does above
    prompt = tok.apply_chat_template([{"role": "user", "content": "Question 3?"}], tokenize=False,
                                     add_generation_prompt=True)
    out = llm.create_completion(prompt, max_tokens=8, temperature=0.0)
    assert out["choices"][0]["finish_reason"] == "stop" and out["usage"]["completion_tokens"] < 8, out


def test_resuming_refuses_a_changed_template_file(tmp_path, tiny_data):
    """The fingerprint a resume compares holds a template file's content, not only its path; a
    built-in template is its name."""
    from tunekit.config import TrainConfig
    from tunekit.train.resume import fingerprint, run_changes

    f = tmp_path / "mine.jinja"
    f.write_text("{% for m in messages %}<|turn|>{{ m['content'] }}<|end|>{% endfor %}")
    cfg = TrainConfig()
    cfg.data.path, cfg.data.chat_template = str(tiny_data), str(f)
    before = fingerprint(cfg, 1)
    f.write_text("{% for m in messages %}<|turn|>{{ m['content'] }}<|stop|>{% endfor %}")
    changes = run_changes(before, fingerprint(cfg, 1), tmp_path)
    assert changes and "data.chat_template (file content changed)" in changes
    cfg.data.chat_template = "chatml"
    assert "data.chat_template:sha256" not in fingerprint(cfg, 1)
