"""The files and folders the bad-input catalogue's rows name: every malformed data file, model
folder, run, checkpoint and output folder, built once under one folder by `build_world`."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from tunekit.owned import sha256_file

# ----------------------------------------------------------------------------- fixture files
def _jsonl(path: Path, rows) -> None:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


def build_world(w: Path, tiny: Path, run_fingerprint: dict) -> None:
    """Every bad file and folder the catalogue names, under w (world-readable). run_fingerprint: what
    the catalogue's train rows train (tunekit.train.resume.fingerprint), recorded by its hand-made runs."""
    d, m = w / "data", w / "models"
    d.mkdir()
    m.mkdir()
    qa = {"instruction": "What is 2 plus 2?", "output": "4."}
    chat = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}
    _jsonl(d / "alpaca.jsonl", [qa] * 6)
    pair = {"prompt": "What is 2 plus 2?", "chosen": "4.", "rejected": "5."}
    _jsonl(d / "pairs.jsonl", [pair] * 6)
    _jsonl(d / "same_sides.jsonl", [pair, {**pair, "rejected": "4."}] + [pair] * 4)
    (d / "folder.jsonl").mkdir()
    (d / "notes.txt").write_text("hello\n")
    (d / "empty.jsonl").write_text("")
    (d / "blank.jsonl").write_text("\n   \n\t\n")
    (d / "latin1.jsonl").write_bytes(b"".join(json.dumps(qa).encode() + b"\n" for _ in range(2))
                                     + '{"instruction": "caf\u00e9", "output": "x"}\n'.encode("latin-1"))
    _jsonl(d / "badjson5.jsonl", [qa] * 4 + ['{"instruction": "q", "output": "a",}'])
    _jsonl(d / "badjson1.jsonl", ["{instruction: q}", qa])
    _jsonl(d / "listrow.jsonl", [qa, "[1, 2]", qa])
    _jsonl(d / "nullrow.jsonl", [qa, qa, "null"])
    (d / "gaps.jsonl").write_text(json.dumps(qa) + "\n\n" + json.dumps(qa) + "\n\n" + json.dumps({"instruction": "q"}) + "\n")
    _jsonl(d / "alpaca_then_chat.jsonl", [qa] * 3 + [chat, chat])
    _jsonl(d / "chat_then_alpaca.jsonl", [chat] * 2 + [qa])
    _jsonl(d / "no_output.jsonl", [qa, {"instruction": "q"}, qa])
    _jsonl(d / "empty_output.jsonl", [qa, {"instruction": "q", "output": ""}, qa])
    _jsonl(d / "number_output.jsonl", [qa, {"instruction": "q", "output": 3}, qa])
    _jsonl(d / "blank_instruction.jsonl", [{"instruction": "  ", "output": "a"}, qa])
    _jsonl(d / "input_list.jsonl", [qa, {"instruction": "q", "input": ["x"], "output": "a"}])
    _jsonl(d / "messages_str.jsonl", [chat, {"messages": "hi"}])
    _jsonl(d / "messages_empty.jsonl", [chat, {"messages": []}])
    _jsonl(d / "bad_role.jsonl", [chat, {"messages": [{"role": "user", "content": "q"}, {"role": "bot", "content": "a"}]}])
    _jsonl(d / "no_content.jsonl", [chat, {"messages": [{"role": "user"}, {"role": "assistant", "content": "a"}]}])
    _jsonl(d / "no_assistant.jsonl", [chat, {"messages": [{"role": "user", "content": "q"}]}])
    _jsonl(d / "empty_text.jsonl", [{"text": "Once upon a time."}, {"text": ""}])
    _jsonl(d / "odd.jsonl", [{"question": "q", "answer": "a"}])
    (d / "odd.csv").write_text("question,answer\nq,a\nq2,a2\n")
    (d / "extra.csv").write_text("instruction,output\nq,a\nq,a,surplus\n")
    (d / "empty_output.csv").write_text("instruction,input,output\nq,,a\nq,,\n")
    (d / "object.json").write_text(json.dumps({"rows": [qa]}))
    (d / "broken.json").write_text('[\n  {"instruction": "q", "output": "a"},\n  {"instruction": "q" "output": "a"}\n]\n')
    (d / "strings.json").write_text(json.dumps([qa, "just text"]))
    (d / "corrupt.parquet").write_bytes(b"PAR1 this is not parquet at all PAR1")
    _jsonl(d / "one_row.jsonl", [qa])
    system = {"messages": [{"role": "system", "content": "Be brief."}, *chat["messages"]]}
    _jsonl(d / "system_chat.jsonl", [chat, system] + [chat] * 4)
    _jsonl(d / "huge_row.jsonl", [{"text": "Short."}, {"text": "All work and no play. " * 54_545 + "x" * 10}])
    _jsonl(d / "deep.jsonl", [qa, "[" * 100_000 + "]" * 100_000])
    _jsonl(d / "too_long.jsonl", [{"instruction": "word " * 200, "output": "x"}] * 6)
    os.mkfifo(d / "pipe.jsonl")
    _jsonl(d / "secret.jsonl", [qa] * 6)
    (d / "secret.jsonl").chmod(0)
    (d / "broken.jinja").write_text("{% for m in messages %}{{ m['content'] }}\n")  # no endfor
    (d / "escape.jinja").write_text("{{ messages.__class__.__init__.__globals__ }}")
    (d / "no_messages.jinja").write_text("{{ bos_token }}")
    (d / "template.txt").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")

    config = json.loads((tiny / "config.json").read_text())
    tok_files = [p for p in tiny.iterdir() if p.name.startswith(("tokenizer", "special_tokens", "chat_template"))]

    def model(name, cfg=config, weights=True, tokenizer=True) -> Path:
        f = m / name
        f.mkdir()
        if cfg is not None:
            (f / "config.json").write_text(cfg if isinstance(cfg, str) else json.dumps(cfg))
        if weights:
            (f / "model.safetensors").symlink_to(tiny / "model.safetensors")
        if tokenizer:
            for p in tok_files:
                (f / p.name).symlink_to(p)
        return f

    model("noconfig", cfg=None)
    model("badjson", cfg='{"model_type": "llama",')
    model("listjson", cfg="[1, 2]")
    model("notype", cfg={k: v for k, v in config.items() if k != "model_type"})
    model("unknowntype", cfg={**config, "model_type": "llamazilla"})
    model("bert", cfg={"model_type": "bert", "architectures": ["BertForMaskedLM"], "vocab_size": 100})
    model("t5", cfg={"model_type": "t5", "architectures": ["T5ForConditionalGeneration"]})
    model("noweights", weights=False)
    model("vocab100", cfg={**config, "vocab_size": 100})
    model("badvalues", cfg={**config, "num_attention_heads": 5})  # hidden 64 is not a multiple of 5 heads
    f = model("biased", weights=False)  # a real model with biases (Qwen-style), for BitFit's refusal
    from transformers import AutoConfig, AutoModelForCausalLM

    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny, attention_bias=True, mlp_bias=True)).save_pretrained(f)
    model("notok", tokenizer=False)
    f = model("strict_template", tokenizer=False)  # a chat template that refuses system turns (as Llama-2's did)
    for p in tok_files:
        if p.name != "chat_template.jinja":
            (f / p.name).symlink_to(p)
    (f / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system turns here') }}{% endif %}"
        "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    _hostile_templates(model, tok_files)
    model("threelayers", cfg={**config, "num_hidden_layers": 3})
    model("onelayer", cfg={**config, "num_hidden_layers": 1})
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer, GPT2Config

    tensors = load_file(tiny / "model.safetensors")
    save_file({k.replace("model.", "decoder.", 1): v for k, v in tensors.items()},
              model("renamed", weights=False) / "model.safetensors", metadata={"format": "pt"})
    q_proj = "model.layers.1.self_attn.q_proj.weight"
    save_file({**tensors, q_proj: tensors[q_proj][:32].clone()}, model("oneshape", weights=False) / "model.safetensors",
              metadata={"format": "pt"})
    gpt2 = GPT2Config(vocab_size=config["vocab_size"], n_embd=config["hidden_size"], n_layer=2, n_head=4,
                      n_positions=config["max_position_embeddings"], bos_token_id=config["bos_token_id"],
                      eos_token_id=config["eos_token_id"]).to_dict()
    model("gpt2", cfg={**gpt2, "architectures": ["GPT2LMHeadModel"]})
    # tokens added to the tokenizer, the embeddings never resized; "What is" opens every row of the data
    tok = AutoTokenizer.from_pretrained(tiny)
    tok.add_tokens(["What is", "<|tool|>"])
    tok.save_pretrained(model("addedtok", tokenizer=False))
    save_file({k: torch.full_like(v, float("nan")) for k, v in tensors.items()},
              model("nan", weights=False) / "model.safetensors", metadata={"format": "pt"})
    model("wider", cfg={**config, "hidden_size": 96, "head_dim": 16})
    # the tiny model with an output head of its own (the tiny model's is tied to its embeddings)
    save_file({**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"].clone()},
              model("untied", cfg={**config, "tie_word_embeddings": False}, weights=False) / "model.safetensors",
              metadata={"format": "pt"})
    f = model("badtok", tokenizer=False)
    (f / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    f = model("truncated", weights=False)
    blob = (tiny / "model.safetensors").read_bytes()
    (f / "model.safetensors").write_bytes(blob[: len(blob) // 2])
    f = model("garbage", weights=False)
    (f / "model.safetensors").write_bytes(b"\xff" * 64)
    f = model("sharded", weights=False)
    (f / "model-00001-of-00002.safetensors").symlink_to(tiny / "model.safetensors")
    (f / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))

    (w / "afile").write_text("not a folder\n")
    (w / "userfiles").mkdir()  # a folder of the user's, given as output_dir
    (w / "userfiles" / ".draft.tmp").write_text("a draft\n")
    (w / "userfiles" / "notes.txt").write_text("notes\n")
    (w / "handmade" / "checkpoints" / "step-000002").mkdir(parents=True)  # a run with a folder named as a checkpoint
    (w / "handmade" / "config.yaml").write_text("recipe: lora\n")
    (w / "handmade" / "checkpoints" / "step-000002" / "notes.txt").write_text("mine\n")
    (w / "locked").mkdir()  # held by the test process itself (the `world` fixture), as by a running run
    (w / "ro").mkdir()
    (w / "ro").chmod(0o555)
    _bad_runs_and_adapters(w, tiny, config["hidden_size"], run_fingerprint)


# A template that formats the turns as ChatML, with `extra` rendered after them.
CHATML_AND = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
              "{% endfor %}EXTRA{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def _hostile_templates(model, tok_files) -> None:
    """Model folders whose chat template reaches for Python's internals (the classic way out of
    jinja's sandbox: a type's __init__, then its function's __globals__, then os), as
    chat_template.jinja, as tokenizer_config.json's chat_template, and built at render time where
    no parse can see the name; and a template that does not parse."""
    def templated(name: str, template: str, in_config: bool = False) -> None:
        f = model(name, tokenizer=False)
        for p in tok_files:
            if p.name not in ("chat_template.jinja", "tokenizer_config.json"):
                (f / p.name).symlink_to(p)
        config = json.loads(next(p for p in tok_files if p.name == "tokenizer_config.json").read_text())
        config.pop("chat_template", None)
        if in_config:
            config["chat_template"] = template
        else:
            (f / "chat_template.jinja").write_text(template)
        (f / "tokenizer_config.json").write_text(json.dumps(config))

    escape = "{{ namespace.__init__.__globals__['os'].system('touch pwned') }}"
    templated("hostile_template", CHATML_AND.replace("EXTRA", escape))
    templated("hostile_config_template", CHATML_AND.replace("EXTRA", escape), in_config=True)
    # '__in' ~ 'it__' is a name only the rendering builds: the sandbox itself stops it there
    templated("sneaky_template", CHATML_AND.replace("EXTRA", "{{ (namespace|attr('__in' ~ 'it__')).globals }}"))
    templated("broken_template", CHATML_AND.replace("EXTRA", "{% if %}"))


def _bad_runs_and_adapters(w: Path, tiny: Path, hidden: int, run_fingerprint: dict) -> None:
    """Hand-made run and adapter folders for eval, export and generate: configs and headers only,
    no model is ever loaded for them."""
    import torch
    from safetensors.torch import save_file

    (w / "tagged" / "adapter").mkdir(parents=True)  # executes nothing: a safe loader refuses the tag
    (w / "tagged" / "config.yaml").write_text(f'recipe: lora\nmodel: !!python/object/apply:os.system ["touch {w}/pwned"]\n')
    (w / "tagged" / "adapter" / "adapter_model.safetensors").write_bytes(b"")
    run = w / "fakerun"  # a run whose data file changed after training started
    (run / "adapter").mkdir(parents=True)
    _jsonl(w / "data" / "changed.jsonl", [{"instruction": "What is 2 plus 2?", "output": "4."}] * 6)
    # its base: a folder of world's own (readable by the `nobody` of the permission rows; never loaded)
    shutil.copytree(tiny, w / "models" / "copied")
    for f in [w / "models" / "copied", *(w / "models" / "copied").iterdir()]:
        f.chmod(0o755 if f.is_dir() else 0o644)
    (run / "config.yaml").write_text(f"recipe: lora\nmodel:\n  path: {w}/models/copied\n"
                                     f"data:\n  path: {w}/data/changed.jsonl\n")
    (run / "adapter" / "adapter_model.safetensors").write_bytes(b"")
    (run / "data.sha256.json").write_text(json.dumps({"data.path:sha256": "0" * 64, "data.val_path:sha256": None}))
    (w / "runlink").symlink_to(run)
    # a distillation run that cut its student from the teacher, moved without its student_base/
    nostudent = w / "distill_no_student"
    (nostudent / "adapter").mkdir(parents=True)
    (nostudent / "config.yaml").write_text(f"recipe: distill\nobjective: distill\nmodel:\n  quantize: nf4\n"
                                           f"distill:\n  teacher: {tiny}\n  student_keep_every: 2\n"
                                           f"data:\n  path: {w}/data/alpaca.jsonl\n")
    (nostudent / "adapter" / "adapter_model.safetensors").write_bytes(b"")
    a = w / "adapters"
    for name, kind in (("truncated", "LORA"), ("soft_ok", "PROMPT_TUNING"), ("soft_bad", "PROMPT_TUNING")):
        (a / name).mkdir(parents=True)
        (a / name / "adapter_config.json").write_text(json.dumps(
            {"peft_type": kind, "base_model_name_or_path": str(tiny), "num_virtual_tokens": 4}))
    save_file({"prompt_embeddings": torch.zeros(4, hidden)}, a / "soft_ok" / "adapter_model.safetensors")
    (a / "soft_bad" / "adapter_model.safetensors").write_bytes(b"\xff" * 64)
    save_file({"base_model.model.x.lora_A.weight": torch.zeros(8, 64)}, a / "truncated" / "adapter_model.safetensors")
    blob = (a / "truncated" / "adapter_model.safetensors").read_bytes()
    (a / "truncated" / "adapter_model.safetensors").write_bytes(blob[:-100])
    (a / "binary").mkdir()
    (a / "binary" / "adapter_config.json").write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe binary")
    (a / "binary" / "adapter_model.safetensors").write_bytes(b"")
    _jsonl(w / "data" / "mixed_rows.jsonl", [{"prompt": "hi", "adapter": str(a / "soft_ok")},
                                             {"prompt": "hi", "adapter": str(a / "soft_bad")}])
    _start_adapters(w, a, tiny)
    # a killed run: config.yaml and a checkpoint, no adapter/ and no summary.json
    ckpt = w / "killed" / "checkpoints" / "step-000002" / "adapter"
    ckpt.mkdir(parents=True)
    (w / "killed" / "config.yaml").write_text(f"recipe: lora\nmodel:\n  path: {tiny}\ndata:\n  path: {w}/data/alpaca.jsonl\n")
    (ckpt / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "base_model_name_or_path": str(tiny)}))
    save_file({"base_model.model.x.lora_A.weight": torch.zeros(8, 64)}, ckpt / "adapter_model.safetensors")
    build_resume_world(w, run_fingerprint)


def _start_adapters(w: Path, a: Path, tiny: Path) -> None:
    """model.adapter's folders (a LoRA start, of another base, of another size, of another method), and runs
    that trained over a start: one whole, one whose start changed since."""
    import torch
    from safetensors.torch import save_file

    q = "base_model.model.model.layers.0.self_attn.q_proj"
    for name, kind, base, width in (("lora_ok", "LORA", str(tiny), 64), ("other_base", "LORA", str(w / "models" / "wider"), 64),
                                    ("wide_start", "LORA", None, 96), ("ia3_start", "IA3", str(tiny), 64),
                                    ("over_start", "LORA", str(tiny), 64)):
        (a / name).mkdir(parents=True)
        (a / name / "adapter_config.json").write_text(json.dumps(
            {"peft_type": kind, "base_model_name_or_path": base, "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}))
        save_file({f"{q}.lora_A.weight": torch.zeros(4, width), f"{q}.lora_B.weight": torch.zeros(width, 4)},
                  a / name / "adapter_model.safetensors")
    # an adapter saved by a run over a start (tunekit.methods.lora.stacked.RECORD), copied out of its run
    (a / "over_start" / "start_adapter.json").write_text(json.dumps({"start_adapter": str(a / "lora_ok")}))
    for run, sha in (("stackedrun", sha256_file(a / "lora_ok" / "adapter_model.safetensors")), ("stackedchanged", "0" * 64)):
        (w / run / "adapter").mkdir(parents=True)
        (w / run / "config.yaml").write_text(f"recipe: lora\nmodel:\n  path: {tiny}\n  adapter: {a / 'lora_ok'}\n"
                                             f"data:\n  path: {w}/data/alpaca.jsonl\n")
        (w / run / "adapter" / "adapter_model.safetensors").write_bytes(b"")
        (w / run / "data.sha256.json").write_text(json.dumps({"model.adapter:sha256": sha}))


def build_resume_world(w: Path, run_fingerprint: dict) -> None:
    """Run folders to resume that hold nothing to resume, or files resume cannot read back; their
    checkpoints record run_fingerprint, so that only what a row changes differs."""
    from safetensors.torch import save_file

    (w / "loop").symlink_to(w / "loop2")
    (w / "loop2").symlink_to(w / "loop")
    (w / "dangling").symlink_to(w / "gone")

    def run(name, step=2, finished=False, state_edit=None, metrics=b'{"step": 1, "loss": 2.0}\n'):
        out = w / name
        (out / "checkpoints").mkdir(parents=True)
        (out / "config.yaml").write_text("recipe: lora\n")
        (out / "metrics.jsonl").write_bytes(metrics)
        if finished:
            (out / "adapter").mkdir()
            (out / "adapter" / "adapter_model.safetensors").write_bytes(b"weights")
            (out / "summary.json").write_text('{"steps": 2}\n')
        if step is None:
            return
        ckpt = out / "checkpoints" / f"step-{step:06d}"
        ckpt.mkdir()
        save_file({}, str(ckpt / "optimizer.safetensors"))
        state = {"format": 2, "step": step, "rng": [{}], "fingerprint": run_fingerprint,
                 "files": {"optimizer.safetensors": sha256_file(ckpt / "optimizer.safetensors")}}
        (ckpt / "trainer_state.json").write_text(json.dumps(state_edit(state) if state_edit else state))

    run("finished", finished=True)
    run("stepfive", step=5)
    run("finished_bare", step=None, finished=True)
    run("metrics_latin1", metrics=b'{"step": 1}\n{"note": "caf\xe9"}\n')
    run("metrics_list", metrics=b'{"step": 1}\n[1, 2]\n')
    run("ckpt_file", step=None)
    (w / "ckpt_file" / "checkpoints").rmdir()
    (w / "ckpt_file" / "checkpoints").write_text("not a folder\n")
    run("step_text", state_edit=lambda st: {**st, "step": "two"})
    run("no_rng", state_edit=lambda st: {k: v for k, v in st.items() if k != "rng"})
