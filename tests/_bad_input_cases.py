"""The bad-input catalogue's rows: one command line each and the culprit its error must name.

Run by tests/commands/test_bad_input.py. Adding a case is one line in CASES: train(id, overrides, culprit) /
export(...) / generate(...). Placeholders: {tiny} the tiny model folder, {data} a good data file,
{w} the folder of fixture files built by tests/_bad_input_world.py, {out} the case's own
output_dir, {cwd} its working directory.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

@dataclass
class Case:
    id: str
    argv: str  # one shell-quoted string, placeholders in {}
    culprit: str  # must appear in the error line
    code: int = 2
    user: str | None = None  # run as this user (where tests run as root): permission cases
    env: dict = field(default_factory=dict)


# Every train case starts from these (a case's own key=value replaces the same key).
TRAIN_BASE = ("recipe=lora model.path={tiny} data.path={data} output_dir={out} trainer.max_steps=2 "
              "trainer.micro_batch_size=2 data.max_seq_len=64 data.val_fraction=0.2")


def train(id, overrides, culprit, **kw):
    base = dict(a.split("=", 1) for a in shlex.split(TRAIN_BASE))
    mine = shlex.split(overrides)
    keys = {a.split("=", 1)[0] for a in mine if "=" in a and not a.startswith("-")}
    args = [f"{k}={v}" for k, v in base.items() if k not in keys] + mine
    return Case(id, shlex.join(["train", *args]), culprit, **kw)


def export(id, args, culprit, **kw):
    return Case(id, "export " + args, culprit, **kw)


def generate(id, args, culprit, **kw):
    return Case(id, "generate " + args, culprit, **kw)


def raw(id, args, culprit, **kw):
    return Case(id, args, culprit, **kw)


M, D = "{w}/models", "{w}/data"
LONG = "a" * 300  # a folder name longer than any file system allows
DEEP = "/".join(["b" * 200] * 20)  # 20 names of 200 bytes: each allowed, together over PATH_MAX
OFFLINE = {"HF_HUB_OFFLINE": "1"}

CASES = [
    # ---- trainer.*
    train("max_steps-0", "trainer.max_steps=0", "trainer.max_steps: must be >= 1, got 0"),
    train("max_steps-neg", "trainer.max_steps=-5", "trainer.max_steps: must be >= 1"),
    train("max_steps-text", "trainer.max_steps=abc", "trainer.max_steps: must be a positive integer or auto, got 'abc'"),
    train("max_steps-float", "trainer.max_steps=2.5", "trainer.max_steps: must be an integer, got 2.5"),
    train("epochs-0", "trainer.epochs=0 trainer.max_steps=auto", "trainer.epochs: must be > 0, got 0"),
    train("epochs-neg", "trainer.epochs=-1 trainer.max_steps=auto", "trainer.epochs: must be > 0, got -1"),
    train("epochs-text", "trainer.epochs=abc trainer.max_steps=auto",
          "trainer.epochs: must be a positive number of passes over the training rows (e.g. 3 or 0.5), or null, got 'abc'"),
    train("epochs-inf", "trainer.epochs=inf trainer.max_steps=auto", "trainer.epochs: must be > 0 and finite, got inf"),
    train("epochs-and-max_steps", "trainer.epochs=1",  # the base sets trainer.max_steps=2
          "trainer.epochs=1 and trainer.max_steps=2 both set the run's length: keep one (trainer.max_steps=auto"),
    train("max_steps-typo", "trainer.max_stpes=10", "trainer.max_stpes: unknown config key"),
    train("trainer-unknown", "trainer.nope=1", "trainer.nope: unknown config key"),
    train("micro_batch-0", "trainer.micro_batch_size=0", "trainer.micro_batch_size: must be a positive integer or auto"),
    train("micro_batch-word", "trainer.micro_batch_size=big", "trainer.micro_batch_size: must be a positive integer or auto"),
    train("checkpointing-word", "model.gradient_checkpointing=maybe", "model.gradient_checkpointing: must be true, false or auto"),
    train("preset-unknown", "model.preset=llama-9", "model.preset"),
    train("preset-train", "model.preset=llama-3-8b", "model.preset: 'llama-3-8b' is a size for `tunekit plan` only"),
    train("grad_accum-0", "trainer.grad_accum=0", "trainer.grad_accum: must be >= 1"),
    train("eval_every-0", "trainer.eval_every=0", "trainer.eval_every: must be >= 1"),
    train("save_every-0", "trainer.save_every=0", "trainer.save_every: must be >= 1"),
    train("keep_checkpoints-0", "trainer.keep_checkpoints=0", "trainer.keep_checkpoints: must be >= 1"),
    train("warmup-neg", "trainer.warmup_steps=-1", "trainer.warmup_steps: must be >= 0"),
    train("lr-0", "trainer.lr=0", "trainer.lr: must be > 0, got 0"),
    train("lr-neg", "trainer.lr=-1e-4", "trainer.lr: must be > 0"),
    train("lr-inf", "trainer.lr=inf", "trainer.lr: must be > 0 and finite, got inf"),
    train("lr-nan", "trainer.lr=nan", "trainer.lr: must be > 0 and finite, got nan"),
    train("lr-text", "trainer.lr=fast", "trainer.lr: Value 'fast'"),
    train("weight_decay-neg", "trainer.weight_decay=-1", "trainer.weight_decay: must be >= 0"),
    train("weight_decay-inf", "trainer.weight_decay=inf", "trainer.weight_decay: must be >= 0 and finite"),
    train("weight_decay-nan", "trainer.weight_decay=nan", "trainer.weight_decay: must be >= 0 and finite, got nan"),
    train("weight_decay-huge", "trainer.weight_decay=10000", "trainer.weight_decay: lr * weight_decay"),
    train("max_grad_norm-neg", "trainer.max_grad_norm=-1", "trainer.max_grad_norm: must be > 0, got -1"),
    train("max_grad_norm-0", "trainer.max_grad_norm=0", "trainer.max_grad_norm: must be > 0, got 0"),
    train("max_grad_norm-nan", "trainer.max_grad_norm=nan", "trainer.max_grad_norm: must be > 0, got nan"),
    train("dist_timeout-nan", "trainer.dist_timeout_s=nan", "trainer.dist_timeout_s: must be >= 60 and finite, got nan"),
    train("dist_timeout-inf", "trainer.dist_timeout_s=inf", "trainer.dist_timeout_s: must be >= 60 and finite, got inf"),
    train("optimizer-unknown", "trainer.optimizer=sgd", "trainer.optimizer: Invalid value 'sgd'"),
    train("resume-not-bool", "trainer.resume=maybe", "trainer.resume:"),
    # ---- top level
    train("seed-neg", "seed=-1", "seed: must be in [0, 2147483647], got -1"),
    train("seed-huge", "seed=4294967296", "seed: must be in [0, 2147483647]"),
    train("seed-float", "seed=1.5", "seed: Value '1.5'"),
    train("objective-unknown", "objective=rl", "objective: unknown value 'rl'"),
    train("recipe-unknown", "recipe=nope", "recipe: Could not find 'recipe/nope'; available: adapter, bitfit"),
    train("sweep-recipe-unknown", "-m recipe=lora,nope", "Could not find 'recipe/nope'"),
    train("toplevel-unknown", "epochs=3", "epochs: unknown config key"),
    # ---- data.* values
    train("val_fraction-0", "data.val_fraction=0", "data.val_fraction: must be in (0, 1), got 0"),
    train("val_fraction-1", "data.val_fraction=1", "data.val_fraction: must be in (0, 1), got 1"),
    train("val_fraction-neg", "data.val_fraction=-0.1", "data.val_fraction: must be in (0, 1)"),
    train("val_fraction-nan", "data.val_fraction=nan", "data.val_fraction: must be in (0, 1), got nan"),
    train("val_fraction-inf", "data.val_fraction=inf", "data.val_fraction: must be in (0, 1), got inf"),
    train("max_seq_len-4", "data.max_seq_len=4", "data.max_seq_len: must be >= 8, got 4"),
    train("max_seq_len-over-model", "data.max_seq_len=100000",
          "data.max_seq_len: 100000 is more than the 512 positions"),
    train("max_val_examples-0", "data.max_val_examples=0", "data.max_val_examples: must be >= 1, got 0"),
    train("max_val_examples-neg", "data.max_val_examples=-1", "data.max_val_examples: must be >= 1"),
    train("format-unknown", "data.format=xml", "data.format: Invalid value 'xml'"),
    train("packing-not-bool", "data.packing=maybe", "data.packing:"),
    train("cache-not-bool", "data.cache=maybe", "data.cache: Value 'maybe' is not a valid bool"),
    train("cache-dir-is-file", f"data.cache_dir={D}/alpaca.jsonl", "data.cache_dir: {w}/data/alpaca.jsonl is a file; give a folder"),
    train("cache-dir-read-only", "data.cache_dir={w}/ro/tokenized",
          "data.cache_dir: cannot create {w}/ro/tokenized in {w}/ro (Permission denied)", user="nobody"),
    train("num_proc-0", "data.num_proc=0", "data.num_proc: must be >= 1, got 0"),
    train("chat_template-unknown", "data.chat_template=vicuna",
          "data.chat_template: 'vicuna' is neither a template name (chatml, llama3) nor a .jinja file"),
    train("chat_template-not-jinja", f"data.chat_template={D}/template.txt",
          "data.chat_template: '{w}/data/template.txt' is neither a template name"),
    train("chat_template-missing", f"data.chat_template={D}/nothing.jinja",
          "data.chat_template: {w}/data/nothing.jinja: no such file"),
    train("chat_template-broken", f"data.chat_template={D}/broken.jinja",
          "data.chat_template: {w}/data/broken.jinja: not a valid chat template (line "),
    train("chat_template-escape", f"data.chat_template={D}/escape.jinja",
          "data.chat_template: {w}/data/escape.jinja: the chat template reaches '__class__' (line 1)"),
    train("chat_template-no-messages", f"data.chat_template={D}/no_messages.jinja",
          "data.chat_template: {w}/data/no_messages.jinja: the template never reads `messages`"),
    # the tiny model's tokenizer (SmolLM2's) lacks Llama-3's tokens: added, and their rows only LoRA trains
    train("chat_template-new-tokens-ia3", "recipe=ia3 data.chat_template=llama3",
          "data.chat_template=llama3: adds <|start_header_id|>, <|end_header_id|>, <|eot_id|> to the tokenizer, "
          "whose new embedding rows method ia3 cannot train"),
    train("chat_template-new-tokens-pissa", "method.init=pissa data.chat_template=llama3",
          "whose new embedding rows peft cannot save beside a method.init=pissa start; use method.init=default"),
    train("chat_template-new-tokens-dpo", f"recipe=dpo data.path={D}/pairs.jsonl data.chat_template=llama3",
          "data.chat_template=llama3: adds <|start_header_id|>, <|end_header_id|>, <|eot_id|> to the tokenizer, whose "
          "trained rows the reference of preference.loss=dpo would read"),
    train("chat_template-new-tokens-distill", "recipe=distill distill.teacher={tiny} distill.student_keep_every=0 "
          "model.quantize=none data.chat_template=llama3",
          "data.chat_template=llama3: adds <|start_header_id|>, <|end_header_id|>, <|eot_id|> to the student's "
          "tokenizer, which the teacher's vocabulary lacks; distillation needs one vocabulary"),
    raw("data-prepare-cache-dir-is-file", f"data prepare model.path={{tiny}} data.path={{data}} data.cache_dir={D}/alpaca.jsonl",
        "data.cache_dir: {w}/data/alpaca.jsonl is a file; give a folder"),
    raw("data-unknown-action", "data tokenize", "data tokenize: unknown action; tunekit data prepare"),
    # ---- model.* values
    train("quantize-unknown", "model.quantize=int3", "model.quantize: Invalid value 'int3'"),
    train("dtype-unknown", "model.dtype=fp8", "model.dtype: Invalid value 'fp8'"),
    train("cudnn-attention-word", "kernels.cudnn_attention=maybe", "kernels.cudnn_attention: Value 'maybe' is not a valid bool"),
    train("model-path-empty", "model.path=''", "model.path: empty"),
    # ---- method.* (every method, none of them needs the model loaded)
    train("method-unknown", "method.name=nope", "method.name: unknown method 'nope'"),
    train("lora-r-0", "method.r=0", "method.r: must be >= 1, got 0"),
    train("lora-r-neg", "method.r=-4", "method.r: must be >= 1"),
    train("lora-r-float", "method.r=1.5", "method.r: Value '1.5'"),
    train("lora-alpha-neg", "method.alpha=-8", "method.alpha: must be > 0, got -8"),
    train("lora-alpha-0", "method.alpha=0", "method.alpha: must be > 0"),
    train("lora-alpha-inf", "method.alpha=inf", "method.alpha: must be > 0 and finite"),
    train("lora-alpha-nan", "method.alpha=nan", "method.alpha: must be > 0 and finite, got nan"),
    train("lora-dropout-nan", "method.dropout=nan", "method.dropout: must be in [0, 1), got nan"),
    train("loraplus-nan", "method.loraplus_lr_ratio=nan", "method.loraplus_lr_ratio: must be > 0 and finite, got nan"),
    train("loraplus-inf", "method.loraplus_lr_ratio=inf", "method.loraplus_lr_ratio: must be > 0 and finite, got inf"),
    train("loraplus-neg", "method.loraplus_lr_ratio=-16", "method.loraplus_lr_ratio: must be > 0, got -16"),
    train("lora-dropout-2", "method.dropout=2.0", "method.dropout: must be in [0, 1), got 2"),
    train("lora-dropout-neg", "method.dropout=-0.1", "method.dropout: must be in [0, 1)"),
    train("lora-dropout-1", "method.dropout=1", "method.dropout: must be in [0, 1), got 1"),
    train("lora-targets-empty", "method.target_modules=[]", "method.target_modules: must be a non-empty list"),
    train("lora-targets-typo", "method.target_modules=[q_projj]", "method.target_modules: no module named 'q_projj'"),
    train("lora-targets-all-plus", "method.target_modules=[all-linear,q_proj]",
          "method.target_modules: all-linear stands alone"),
    train("lora-targets-twice", "method.target_modules=[q_proj,q_proj]", "method.target_modules: 'q_proj' is listed twice"),
    train("lora-targets-not-list", "method.target_modules=q_proj", "method.target_modules: must be a list, e.g. method.target_modules=[a,b]"),
    train("lora-loftq-bf16", "method.init=loftq", "method.init=loftq: fits the LoRA start to what 4-bit rounding loses"),
    train("lora-loftq-iters-0", "recipe=qlora method.init=loftq method.loftq_iters=0", "method.loftq_iters: must be in [1, 10]"),
    train("lora-loftq-iters-alone", "recipe=qlora method.init=default method.loftq_iters=3",
          "method.loftq_iters=3: applies to method.init=loftq (or auto) only"),
    train("lora-loftq-dora", "recipe=qlora method.init=loftq method.use_dora=true", "method.use_dora: not with method.init=loftq"),
    train("full-weight-rounding", "recipe=full method.weight_rounding=truncate",
          "method.weight_rounding: unknown value 'truncate'; choose one of stochastic, nearest"),
    train("lora-weight-rounding", "recipe=lora method.weight_rounding=nearest",
          "method.weight_rounding: method 'lora' has no such key"),
    train("adapter-bottleneck-0", "recipe=adapter method.bottleneck=0", "method.bottleneck: must be >= 1"),
    train("adapter-activation", "recipe=adapter method.activation=tanh", "method.activation: unknown value 'tanh'"),
    train("adapter-sublayers-empty", "recipe=adapter method.sublayers=[]", "method.sublayers: must be a non-empty list"),
    train("adapter-sublayers-unknown", "recipe=adapter method.sublayers=[ffn]", "method.sublayers: 'ffn' is not a sublayer"),
    train("bitfit-targets-head", "recipe=bitfit method.target_modules=[lm_head]",
          "method.target_modules: ['lm_head'] are not Llama projections"),
    train("bitfit-targets-empty", "recipe=bitfit method.target_modules=[]", "method.target_modules: must be a non-empty"),
    train("prompt-tokens-0", "recipe=prompt_tuning method.num_virtual_tokens=0", "method.num_virtual_tokens: must be >= 1"),
    train("prompt-init-empty", "recipe=prompt_tuning method.prompt_init_text=''", "method.prompt_init_text: must be non-empty"),
    train("full-on-4bit", "method.name=full model.quantize=nf4", "method.name=full: cannot train a 4-bit base"),
    # ---- objective=preference: its keys, what it cannot run with, its rows
    train("preference-beta-0", f"recipe=dpo data.path={D}/pairs.jsonl preference.beta=0",
          "preference.beta: must be > 0, got 0"),
    train("preference-smoothing-ipo", f"recipe=dpo data.path={D}/pairs.jsonl preference.loss=ipo "
          "preference.label_smoothing=0.1", "preference.label_smoothing: 0.1 applies to preference.loss=dpo and simpo only"),
    train("preference-full-dpo", f"recipe=full objective=preference data.path={D}/pairs.jsonl",
          "method.name: preference.loss=dpo scores against the base with the trained part switched off"),
    train("preference-kto-kl-value", f"recipe=dpo data.path={D}/pairs.jsonl preference.loss=kto preference.kto_kl=mean",
          "preference.kto_kl: unknown value 'mean'; choose one of batch, zero"),
    train("preference-kto-one-row", f"recipe=dpo data.path={D}/pairs.jsonl preference.loss=kto trainer.micro_batch_size=1",
          "trainer.micro_batch_size: 1 with preference.loss=kto: KTO's KL estimate pairs each prompt"),
    train("preference-packing", f"recipe=dpo data.path={D}/pairs.jsonl data.packing=true",
          "data.packing: not with objective=preference"),
    train("preference-sft-rows", "recipe=dpo", "{data}: row 1: objective=preference needs preference rows"),
    train("preference-sources", f"recipe=dpo 'data.path=[{D}/pairs.jsonl,{D}/same_sides.jsonl]'",
          "data.path: a list of sources is not read with objective=preference yet"),
    train("preference-same-sides", f"recipe=dpo data.path={D}/same_sides.jsonl",
          "{w}/data/same_sides.jsonl: row 2: 'chosen' and 'rejected' are the same: nothing to prefer"),
    # ---- distill.*, kernels.*, tracker.*
    train("distill-alpha", "recipe=distill distill.alpha=1.5", "distill.alpha: must be in [0, 1], got 1.5"),
    train("distill-alpha-nan", "recipe=distill distill.alpha=nan", "distill.alpha: must be in [0, 1], got nan"),
    train("distill-temperature-nan", "recipe=distill distill.temperature=nan",
          "distill.temperature: must be > 0 and finite, got nan"),
    train("distill-beta-nan", "recipe=distill distill.beta=nan", "distill.beta: must be in (0, 1), got nan"),
    train("distill-temperature-0", "recipe=distill distill.temperature=0", "distill.temperature: must be > 0"),
    train("distill-temperature-inf", "recipe=distill distill.temperature=inf", "distill.temperature: must be > 0 and finite"),
    train("distill-beta-0", "recipe=distill distill.beta=0", "distill.beta: must be in (0, 1)"),
    train("distill-chunk-0", "recipe=distill distill.chunk_size=0", "distill.chunk_size: must be >= 1"),
    train("distill-keep-1", "recipe=distill distill.student_keep_every=1", "distill.student_keep_every: 1 keeps every layer"),
    train("distill-keep-neg", "recipe=distill distill.student_keep_every=-2", "distill.student_keep_every: must be >= 0"),
    train("distill-divergence", "recipe=distill distill.divergence=l2", "distill.divergence: Invalid value 'l2'"),
    train("distill-teacher-missing", "recipe=distill distill.teacher={w}/nope", "distill.teacher: no model folder at {w}/nope"),
    train("distill-teacher-bert", f"recipe=distill distill.teacher={M}/bert", "distill.teacher: {w}/models/bert/config.json describes BertForMaskedLM, not a causal"),
    train("distill-vocab-mismatch", f"recipe=distill distill.student_keep_every=0 model.quantize=none distill.teacher={M}/vocab100",
          "distill.teacher: {w}/models/vocab100 has vocab_size 100"),
    train("fused-on-without-4bit", "kernels.fused_lora=on model.quantize=none", "kernels.fused_lora: on needs a 4-bit base"),
    train("recipe-empty", "recipe=''", "recipe:"),
    train("data-fifo", f"data.path={D}/pipe.jsonl", "data.path: {w}/data/pipe.jsonl is not a regular file"),
    train("fused-unknown", "kernels.fused_lora=maybe", "kernels.fused_lora: Invalid value 'maybe'"),
    train("compile-with-fsdp", "kernels.compile=true trainer.strategy=fsdp", "kernels.compile: not with trainer.strategy=fsdp"),
    train("compile-not-a-bool", "kernels.compile=sometimes", "kernels.compile"),
    train("tracker-group-unknown", "tracker=nope", "Could not find 'tracker/nope'"),
    train("tracker-name-unknown", "tracker.name=tensorboard", "tracker.name: unknown value 'tensorboard'"),
    train("tracker-project-empty", "tracker.project=''", "tracker.project: empty"),
    # ---- Hydra syntax
    train("comma-in-path", "data.path=a,b.jsonl", "data.path: the value 'a,b.jsonl' holds an unquoted comma"),
    train("bracket-in-path", "data.path=a[1].jsonl", "data.path: cannot parse the value 'a[1].jsonl'"),
    train("brace-in-path", "output_dir=x{y}", "output_dir: cannot parse the value 'x{y}'"),
    train("not-key-value", "fast", "fast: not a key=value override"),
    train("interpolation", "output_dir=${{oops}}", "output_dir:"),
    train("unknown-flag", "--max-steps 10", "--max-steps: unknown flag"),
    # ---- data files and rows
    train("data-path-empty", "data.path=''", "data.path: empty"),
    train("data-missing", "data.path={w}/nope.jsonl", "data.path: file not found: {w}/nope.jsonl"),
    train("data-folder", f"data.path={D}/folder.jsonl", "data.path: {w}/data/folder.jsonl is a folder"),
    train("data-suffix", f"data.path={D}/notes.txt", "{w}/data/notes.txt: unsupported file type '.txt'"),
    train("data-empty", f"data.path={D}/empty.jsonl", "{w}/data/empty.jsonl: no rows (the file is empty)"),
    train("data-whitespace", f"data.path={D}/blank.jsonl", "{w}/data/blank.jsonl: no rows"),
    train("data-not-utf8", f"data.path={D}/latin1.jsonl", "{w}/data/latin1.jsonl: line 3: not UTF-8 text (byte 0xe9"),
    train("data-bad-json-line5", f"data.path={D}/badjson5.jsonl", "{w}/data/badjson5.jsonl: line 5: not valid JSON"),
    train("data-bad-json-line1", f"data.path={D}/badjson1.jsonl", "{w}/data/badjson1.jsonl: line 1: not valid JSON"),
    train("data-row-is-list", f"data.path={D}/listrow.jsonl", "{w}/data/listrow.jsonl: row 2: a JSON array, not an object"),
    train("data-row-is-null", f"data.path={D}/nullrow.jsonl", "{w}/data/nullrow.jsonl: row 3: a JSON null, not an object"),
    train("data-blank-lines", f"data.path={D}/gaps.jsonl", "{w}/data/gaps.jsonl: row 3 (line 5): 'output' must be"),
    train("data-alpaca-then-chat", f"data.path={D}/alpaca_then_chat.jsonl",
          "{w}/data/alpaca_then_chat.jsonl: row 4: a chat row (has messages) in a file of alpaca rows (as its first row)"),
    train("data-chat-then-alpaca", f"data.path={D}/chat_then_alpaca.jsonl",
          "{w}/data/chat_then_alpaca.jsonl: row 3: an alpaca row (has instruction+output) in a file of chat rows"),
    train("data-format-forced", f"data.path={D}/alpaca.jsonl data.format=chat",
          "{w}/data/alpaca.jsonl: row 1: an alpaca row (has instruction+output) in a file of chat rows (data.format=chat)"),
    train("data-no-output", f"data.path={D}/no_output.jsonl", "{w}/data/no_output.jsonl: row 2: 'output' must be a non-empty string, got None"),
    train("data-empty-output", f"data.path={D}/empty_output.jsonl", "{w}/data/empty_output.jsonl: row 2: 'output' must be a non-empty string, got ''"),
    train("data-number-output", f"data.path={D}/number_output.jsonl", "row 2: 'output' must be a non-empty string, got 3"),
    train("data-blank-instruction", f"data.path={D}/blank_instruction.jsonl", "row 1: 'instruction' must be a non-empty string"),
    train("data-input-not-text", f"data.path={D}/input_list.jsonl", "row 2: 'input' must be a non-empty string"),
    train("data-messages-text", f"data.path={D}/messages_str.jsonl", "row 2: 'messages' must be a non-empty list"),
    train("data-messages-empty", f"data.path={D}/messages_empty.jsonl", "row 2: 'messages' must be a non-empty list"),
    train("data-bad-role", f"data.path={D}/bad_role.jsonl", "row 2: messages[1] needs a role"),
    train("data-no-content", f"data.path={D}/no_content.jsonl", "row 2: messages[0].content must be a non-empty string"),
    train("data-no-assistant", f"data.path={D}/no_assistant.jsonl", "row 2: no assistant message"),
    train("data-empty-text", f"data.path={D}/empty_text.jsonl", "{w}/data/empty_text.jsonl: row 2: 'text' must be a non-empty string"),
    train("data-unknown-columns", f"data.path={D}/odd.jsonl", "{w}/data/odd.jsonl: cannot tell the format from the columns ['answer', 'question']"),
    train("data-csv-columns", f"data.path={D}/odd.csv", "{w}/data/odd.csv: cannot tell the format"),
    train("data-csv-extra-field", f"data.path={D}/extra.csv", "{w}/data/extra.csv: row 2 (line 3): more fields than the header"),
    train("data-csv-empty-output", f"data.path={D}/empty_output.csv", "{w}/data/empty_output.csv: row 2 (line 3): 'output' must be"),
    train("data-json-object", f"data.path={D}/object.json", "{w}/data/object.json: holds a JSON object; expected an array"),
    train("data-json-broken", f"data.path={D}/broken.json", "{w}/data/broken.json: line 3: not valid JSON"),
    train("data-json-array-of-text", f"data.path={D}/strings.json", "{w}/data/strings.json: row 2: a JSON string, not an object"),
    train("data-parquet-corrupt", f"data.path={D}/corrupt.parquet", "{w}/data/corrupt.parquet: cannot read as parquet"),
    train("data-huge-row", f"data.path={D}/huge_row.jsonl", "{w}/data/huge_row.jsonl: row 2: 1,200,000 characters, over the 1,000,000"),
    train("data-nested-too-deep", f"data.path={D}/deep.jsonl", "{w}/data/deep.jsonl: line 2: JSON nested too deeply"),
    train("data-one-row", f"data.path={D}/one_row.jsonl", "data.path: {w}/data/one_row.jsonl has 1 row(s): too few to hold out"),
    train("data-too-long", f"data.path={D}/too_long.jsonl", "{w}/data/too_long.jsonl: no usable rows: none of its 6 rows keeps a response token"),
    train("data-unreadable", f"data.path={D}/secret.jsonl", "data.path: cannot read {w}/data/secret.jsonl: Permission denied",
          user="nobody"),
    train("data-template-refuses", f"data.path={D}/system_chat.jsonl model.path={M}/strict_template",
          "{w}/data/system_chat.jsonl: row 2: the tokenizer's chat template refuses this conversation (no system turns here)"),
    # ---- data.path as a list of sources: each error names the source's index and path
    train("sources-unknown-key", "data.path='[{{path: {data}, wieght: 3}}]'", "data.path[0] ({data}): unknown key 'wieght'"),
    train("sources-weight-0", f"data.path='[{{data}}, {{{{path: {D}/alpaca.jsonl, weight: 0}}}}]'",
          "data.path[1] ({w}/data/alpaca.jsonl): weight: must be > 0, got 0"),
    train("sources-weight-and-rows", "data.path='[{{path: {data}, weight: 2, rows: 10}}]'",
          "data.path[0] ({data}): both weight and rows"),
    train("sources-fraction-over-1", "data.path='[{{path: {data}, fraction: 1.5}}]'",
          "data.path[0] ({data}): fraction: must be in (0, 1], got 1.5"),
    train("sources-empty-file", f"data.path='[{{data}}, {D}/empty.jsonl]'",
          "data.path[1]: {w}/data/empty.jsonl: no rows (the file is empty)"),
    train("sources-missing-file", "data.path='[{data}, {w}/nope.jsonl]'", "data.path[1]: file not found: {w}/nope.jsonl"),
    train("sources-no-usable-row", f"data.path='[{{data}}, {D}/too_long.jsonl]'",
          "data.path[1]: {w}/data/too_long.jsonl: no usable rows: none of its 6 rows keeps a response token"),
    train("val-missing", "data.val_path={w}/nope.jsonl", "data.val_path: file not found: {w}/nope.jsonl"),
    train("val-bad-row", f"data.val_path={D}/no_output.jsonl", "{w}/data/no_output.jsonl: row 2: 'output' must be"),
    train("val-empty", f"data.val_path={D}/empty.jsonl", "{w}/data/empty.jsonl: no rows"),
    train("data-hub-unreachable", "data.path=tunekit-tests/no-such-dataset",
          "data.path: 'tunekit-tests/no-such-dataset' is not a local file or folder (no {cwd}/tunekit-tests/"
          "no-such-dataset), and the Hugging Face hub could not be reached to load it as a dataset id"),
    # ---- model.adapter: the frozen start adapter
    train("start-adapter-missing", "model.adapter={w}/nope", "model.adapter: no such folder: {w}/nope"),
    train("start-adapter-no-adapter", "model.adapter={w}/userfiles", "model.adapter: {w}/userfiles holds no adapter"),
    train("start-adapter-other-base", "model.adapter={w}/adapters/other_base",
          "model.adapter: {w}/adapters/other_base was trained over {w}/models/wider, but model.path is {tiny}"),
    train("start-adapter-other-size", "model.adapter={w}/adapters/wide_start",
          "model.adapter: {w}/adapters/wide_start's tensor base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight "
          "has shape [4, 96], but model.layers.0.self_attn.q_proj of model.path is Linear(64 -> 64)"),
    train("start-adapter-ia3", "model.adapter={w}/adapters/ia3_start",
          "model.adapter: {w}/adapters/ia3_start holds a IA3 adapter; model.adapter takes a LoRA adapter"),
    train("start-adapter-method-ia3", "recipe=ia3 model.adapter={w}/adapters/lora_ok",
          "model.adapter: a frozen start adapter trains a new LoRA beside it, not method ia3"),
    train("start-adapter-chat-template", "model.adapter={w}/adapters/lora_ok data.chat_template=chatml",
          "model.adapter: not with data.chat_template yet"),
    export("start-adapter-export-adapter", "{w}/stackedrun --format adapter --out {out}",
           "--format adapter: {w}/stackedrun trained a new adapter over the frozen start adapter {w}/adapters/lora_ok"),
    export("start-adapter-changed", "{w}/stackedchanged --format merged --out {out}",
           "{w}/stackedchanged/config.yaml: model.adapter: {w}/adapters/lora_ok/adapter_model.safetensors changed since"),
    generate("start-adapter-copied-out", "--adapter {w}/adapters/over_start --prompt hi",
             "--adapter: {w}/adapters/over_start was trained over a frozen start adapter"),
    # ---- model folders
    train("model-missing", "model.path={w}/nope", "model.path: no model folder at {w}/nope"),
    train("model-is-file", f"model.path={D}/alpaca.jsonl", "model.path: {w}/data/alpaca.jsonl is a file"),
    train("model-no-config", f"model.path={M}/noconfig", "model.path: {w}/models/noconfig is a folder but has no config.json"),
    train("model-config-not-json", f"model.path={M}/badjson", "model.path: {w}/models/badjson/config.json is not valid JSON"),
    train("model-config-list", f"model.path={M}/listjson", "model.path: {w}/models/listjson/config.json holds a JSON list"),
    train("model-config-no-type", f"model.path={M}/notype", "model.path: {w}/models/notype/config.json has no model_type"),
    train("model-config-unknown-type", f"model.path={M}/unknowntype", "model_type 'llamazilla' is unknown"),
    train("model-bert", f"model.path={M}/bert", "model.path: {w}/models/bert/config.json describes BertForMaskedLM, not a causal language model"),
    train("model-t5", f"model.path={M}/t5", "describes T5ForConditionalGeneration, not a causal language model"),
    train("model-no-weights", f"model.path={M}/noweights", "model.path: {w}/models/noweights has no weights"),
    train("model-truncated-weights", f"model.path={M}/truncated", "model.path: {w}/models/truncated/model.safetensors is truncated"),
    train("model-garbage-weights", f"model.path={M}/garbage", "model.safetensors is not a valid safetensors file"),
    train("model-missing-shard", f"model.path={M}/sharded", "lacks 1 weight file(s) its model.safetensors.index.json lists"),
    # chat templates that reach for Python's internals: refused before any renders (nothing runs)
    train("model-template-escape", f"model.path={M}/hostile_template",
          "model.path: {w}/models/hostile_template/chat_template.jinja: the chat template reaches '__init__' (line 1), "
          "'__globals__' (line 1), which jinja's sandbox refuses"),
    train("model-template-escape-in-config", f"model.path={M}/hostile_config_template",
          "model.path: {w}/models/hostile_config_template/tokenizer_config.json (its chat_template): the chat template "
          "reaches '__init__'"),
    train("model-template-escape-at-render", f"model.path={M}/sneaky_template",
          "{w}/models/sneaky_template/chat_template.jinja: the chat template tried to reach what jinja's sandbox "
          "refuses (access to attribute '__init__' of 'type' object is unsafe.); the sandbox stopped it"),
    train("model-template-syntax", f"model.path={M}/broken_template",
          "model.path: {w}/models/broken_template/chat_template.jinja: not a valid chat template (line 1: "),
    generate("generate-template-escape", f"--model {M}/hostile_config_template --prompt hi",
             "--model: {w}/models/hostile_config_template/tokenizer_config.json (its chat_template): the chat template "
             "reaches '__init__'"),
    raw("chat-template-escape", f"chat --model {M}/hostile_template", "--model: {w}/models/hostile_template/chat_template.jinja"),
    # weights that do not fit their config.json (transformers would fill the gaps with random values)
    train("model-weights-too-few-layers", f"model.path={M}/threelayers",
          "model.path: the weights in {w}/models/threelayers do not fit its config.json: 9 weight(s) the config expects "
          "are missing from the files (model.layers.2.input_layernorm.weight, model.layers.2.mlp.down_proj.weight"),
    train("model-weights-too-many-layers", f"model.path={M}/onelayer",
          "model.path: the weights in {w}/models/onelayer do not fit its config.json: 9 tensor(s) in the files fit no "
          "weight of the config (model.layers.1.input_layernorm.weight, model.layers.1.mlp.down_proj.weight"),
    train("model-weights-renamed", f"model.path={M}/renamed",
          "model.path: the weights in {w}/models/renamed do not fit its config.json: 20 weight(s) the config expects are "
          "missing from the files (model.embed_tokens.weight, model.layers.0.input_layernorm.weight, "
          "model.layers.0.mlp.down_proj.weight, ...); 20 tensor(s) in the files fit no weight of the config "
          "(decoder.embed_tokens.weight, "),
    # prompt tuning wraps no projection: before this check, GPT-2 trained from random weights
    train("model-weights-other-architecture", f"recipe=prompt_tuning model.path={M}/gpt2",
          "model.path: the weights in {w}/models/gpt2 do not fit its config.json: 28 weight(s) the config expects are "
          "missing from the files (transformer.h.0.attn.c_attn.bias, "),
    train("model-weights-other-shape", f"model.path={M}/wider",
          "model.path: the weights in {w}/models/wider do not fit its config.json: 20 tensor(s) have another shape than "
          "the config gives them (model.embed_tokens.weight is [49152, 64] in the files, [49152, 96] in the config"),
    train("model-weights-one-shape", f"model.path={M}/oneshape",
          "model.path: the weights in {w}/models/oneshape do not fit its config.json: 1 tensor(s) have another shape than "
          "the config gives them (model.layers.1.self_attn.q_proj.weight is [32, 64] in the files, [64, 64] in the config)"),
    train("model-weights-one-shape-4bit", f"recipe=qlora model.path={M}/oneshape", "model.path: the weights in "
          "{w}/models/oneshape do not fit its config.json: 1 tensor(s) have another shape"),
    train("model-tokenizer-past-embeddings", f"model.path={M}/addedtok",
          "model.path: the tokenizer of {w}/models/addedtok has 49,154 token ids, its model 49,152 embedding rows "
          "(vocab_size in config.json): 2 added token(s) have none, e.g. 'What is' (id 49,152)"),
    train("model-no-tokenizer", f"model.path={M}/notok", "model.path: {w}/models/notok has no tokenizer"),
    train("model-bad-tokenizer", f"model.path={M}/badtok", "model.path: {w}/models/badtok/tokenizer.json is not a whole JSON object"),
    train("model-bad-values", f"model.path={M}/badvalues", "models/badvalues/config.json: Class validation error for validator 'validate_architecture': ValueError: The hidden size (64) is not a multiple"),
    train("model-hub-offline", "model.path=someorg/somemodel", "model.path: 'someorg/somemodel' is not a local folder, is not in the local hub cache",
          env=OFFLINE),
    train("model-not-hub-id", "model.path=a/b/c", "model.path: no model folder at a/b/c"),
    train("model-with-bias-bitfit", f"recipe=bitfit model.path={M}/biased", "method.name=bitfit: the projections of LlamaForCausalLM already have biases"),
    # ---- output_dir
    train("out-empty", "output_dir=''", "output_dir: empty"),
    train("out-is-file", "output_dir={w}/afile", "output_dir: {w}/afile is a file"),
    train("out-under-file", "output_dir={w}/afile/run", "output_dir: {w}/afile/run lies under {w}/afile, which is a file"),
    train("out-read-only", "output_dir={w}/ro/run", "output_dir: cannot create {w}/ro/run in {w}/ro (Permission denied)",
          user="nobody"),
    train("out-not-empty", "output_dir={w}/userfiles",
          "output_dir: {w}/userfiles is not empty and holds no tunekit run (.draft.tmp, notes.txt); give a new or empty"),
    train("out-not-empty-resume", "output_dir={w}/userfiles trainer.resume=true",
          "output_dir: {w}/userfiles is not empty and holds no tunekit run"),
    train("out-locked", "output_dir={w}/locked", "output_dir: {w}/locked is in use by another tunekit run (pid "),
    train("out-hand-made-checkpoint", "output_dir={w}/handmade trainer.resume=true",
          "output_dir: {w}/handmade/checkpoints/step-000002 is not a tunekit checkpoint (no trainer_state.json)"),
    # a name over the file system's NAME_MAX (255 bytes), and a path that leaves no room under PATH_MAX
    train("out-name-too-long", f"output_dir={{w}}/{LONG}",
          f"output_dir: the name '{'a' * 20}...{'a' * 12}' is 300 bytes long, more than the 255 a file or folder name"),
    train("out-name-too-long-inside", f"output_dir={{w}}/{LONG}/run", "output_dir: the name 'aaaa"),
    train("out-path-too-long", f"output_dir={{w}}/{DEEP}", "bytes tunekit needs for the files inside it that passes the 4096"),
    raw("doctor-out-name-too-long", f"doctor --out {{w}}/{LONG}", "--out: the name 'aaaa"),
    raw("eval-out-name-too-long", f"eval {{w}}/nope --out {{w}}/{LONG}/eval.json", "--out: the name 'aaaa"),
    train("out-allow-nonempty-word", "trainer.allow_nonempty_output_dir=maybe", "trainer.allow_nonempty_output_dir:"),
    # ---- training-side inputs: keys added with +, positions, targets, symlinks, runs with nothing to resume
    train("plus-key-typo", "+trainer.lr_typo=1", "trainer.lr_typo: unknown config key"),
    train("plus-key-toplevel", "+foo=1", "foo: unknown config key"),
    train("prompt-tokens-past-context", "recipe=prompt_tuning data.max_seq_len=500 method.num_virtual_tokens=20",
          "method.num_virtual_tokens: 20 virtual tokens + data.max_seq_len 500 = 520 positions, more than the 512"),
    train("lora-targets-modulelist", "method.target_modules=[layers]",
          "method.target_modules: 'layers' names ModuleList modules (model.layers), not Linear projections"),
    train("lora-targets-attention", "method.target_modules=[self_attn]",
          "method.target_modules: 'self_attn' names LlamaAttention modules"),
    # the head's LoRA would get no gradient (the loss reads the head's weight); a tied head is the embeddings too
    train("lora-targets-tied-head", "method.target_modules=[lm_head]",
          "method.target_modules: 'lm_head' is the output head of LlamaForCausalLM, and its weight is the input "
          "embeddings' (tie_word_embeddings is true for {tiny}/config.json)"),
    train("lora-targets-tied-head-among-others", "recipe=qlora method.target_modules=[q_proj,lm_head]",
          "drop 'lm_head' from method.target_modules"),
    train("lora-targets-untied-head", f"model.path={M}/untied method.target_modules=[lm_head]",
          "method.target_modules: 'lm_head' is the output head of LlamaForCausalLM: a LoRA on it would not train"),
    train("lora-targets-embeddings", "method.target_modules=[embed_tokens]",
          "method.target_modules: 'embed_tokens' names Embedding modules"),
    train("out-symlink-loop", "output_dir={w}/loop", "output_dir: {w}/loop is a symlink loop"),
    train("out-dangling-symlink", "output_dir={w}/dangling/run",
          "output_dir: {w}/dangling/run lies under {w}/dangling, which is a dangling symlink"),
    train("resume-finished", "output_dir={w}/finished trainer.resume=true",
          "trainer.max_steps: the run in {w}/finished is finished; its checkpoint {w}/finished/checkpoints/step-000002 "
          "is at step 2, already at trainer.max_steps=2: nothing to resume. To train longer, raise trainer.max_steps"),
    # a finished run resumed with its seed or its recipe changed: every conflict in the one line
    train("resume-finished-seed-changed", "output_dir={w}/finished trainer.resume=true seed=1",
          "trainer.resume: the run in {w}/finished cannot be resumed as configured, for 2 reasons: (1) "
          "trainer.max_steps: the run in {w}/finished is finished; its checkpoint {w}/finished/checkpoints/step-000002 "
          "is at step 2, already at trainer.max_steps=2: nothing to resume. To train longer, raise trainer.max_steps "
          "above 2; (2) trainer.resume: this config differs from the run saved in "
          "{w}/finished/checkpoints/step-000002 in seed (0 -> 1); these shape the trained weights"),
    train("resume-finished-recipe-changed", "output_dir={w}/finished trainer.resume=true recipe=qlora",
          "for 2 reasons: (1) trainer.max_steps: the run in {w}/finished is finished"),
    train("resume-seed-changed", "output_dir={w}/stepfive trainer.resume=true trainer.max_steps=9 seed=3",
          "trainer.resume: this config differs from the run saved in {w}/stepfive/checkpoints/step-000005 in "
          "seed (0 -> 3)"),
    train("resume-past-max-steps", "output_dir={w}/stepfive trainer.resume=true",
          "trainer.max_steps: the checkpoint {w}/stepfive/checkpoints/step-000005 is at step 5, past"),
    train("resume-finished-no-checkpoint", "output_dir={w}/finished_bare trainer.resume=true",
          "trainer.resume: the run in {w}/finished_bare is finished"),
    train("resume-metrics-not-utf8", "output_dir={w}/metrics_latin1 trainer.resume=true trainer.max_steps=9",
          "{w}/metrics_latin1/metrics.jsonl: line 2: not UTF-8 text"),
    train("resume-metrics-list-row", "output_dir={w}/metrics_list trainer.resume=true trainer.max_steps=9",
          "{w}/metrics_list/metrics.jsonl: line 2: a JSON list, not an object"),
    train("resume-checkpoints-file", "output_dir={w}/ckpt_file trainer.resume=true",
          "output_dir: {w}/ckpt_file/checkpoints is not a folder"),
    train("resume-step-text", "output_dir={w}/step_text trainer.resume=true trainer.max_steps=9",
          "trainer.resume: no intact checkpoint in {w}/step_text/checkpoints (step-000002: "
          "{w}/step_text/checkpoints/step-000002/trainer_state.json: 'step' must be a whole number"),
    train("resume-rng-missing", "output_dir={w}/no_rng trainer.resume=true trainer.max_steps=9",
          "{w}/no_rng/checkpoints/step-000002/trainer_state.json: 'rng' (the random state of every rank) is missing"),
    # ---- export and generate: generic argument errors (their own rows come with their rewrites)
    export("export-no-run-dir", "--format adapter --out {out}", "export: the following arguments are required: RUN_DIR"),
    export("export-bad-format", "{w} --format zip --out {out}", "export: argument --format: invalid choice: 'zip'"),
    # float options: NaN and inf would pass or refuse every export whatever it kept
    export("export-kl-nan", "{w}/fakerun --format merged --out {out} --kl-threshold nan",
           "--kl-threshold: must be >= 0 nats/token and finite, got nan"),
    export("export-kl-inf", "{w}/fakerun --format merged --out {out} --kl-threshold inf",
           "--kl-threshold: must be >= 0 nats/token and finite, got inf"),
    export("export-kl-negative", "{w}/fakerun --format merged --out {out} --kl-threshold -0.1",
           "--kl-threshold: must be >= 0 nats/token, got -0.1"),
    export("export-min-gain-nan", "{w}/fakerun --format merged --out {out} --min-gain nan",
           "--min-gain: must be in [0, 1.5], got nan"),
    export("export-min-task-gain-inf", "{w}/fakerun --format merged --out {out} --min-task-gain inf",
           "--min-task-gain: must be in [0, 1.5], got inf"),
    export("export-run-missing", "{w}/nope --format adapter --out {out}", "RUN_DIR: no such folder: {w}/nope"),
    export("export-not-a-run", f"{D} --format adapter --out {{out}}", "RUN_DIR: {w}/data is not a tunekit run (no config.yaml"),
    generate("generate-no-prompt", "", "--prompt: give at least one --prompt"),
    generate("generate-rows-missing", "--rows {w}/nope.jsonl", "--rows: file not found: {w}/nope.jsonl"),
    generate("generate-rows-and-prompt", "--rows {w}/nope.jsonl --prompt hi", "--rows: give either --rows or --prompt"),
    generate("generate-model-missing", "--model {w}/nope --prompt hi", "--model: no model folder at {w}/nope"),
    generate("generate-model-bert", f"--model {M}/bert --prompt hi", "--model: {w}/models/bert/config.json describes BertForMaskedLM"),
    generate("generate-model-bad-config", f"--model {M}/badjson --prompt hi", "--model: {w}/models/badjson/config.json is not valid JSON"),
    generate("generate-hub-offline", "--model someorg/somemodel --prompt hi", "--model: 'someorg/somemodel' is not a local folder",
             env=OFFLINE),
    raw("eval-no-run", "eval", "eval: the following arguments are required: RUN"),
    raw("eval-run-missing", "eval {w}/nope", "RUN: no such folder: {w}/nope"),
    raw("eval-batch", "eval {w}/nope --batch-size 0", "--batch-size: must be > 0"),
    raw("chat-run-missing", "chat {w}/nope", "RUN: no such folder: {w}/nope"),
    generate("generate-tokens-text", "--prompt hi --max-new-tokens abc", "generate: argument --max-new-tokens: invalid int"),
    generate("generate-tokens-0", "--prompt hi --max-new-tokens 0", "--max-new-tokens: must be > 0"),
    raw("plan-device", "plan --device tpu", "plan: argument --device: invalid choice: 'tpu'"),
    raw("plan-memory", "plan --memory -1", "plan: --memory: must be > 0 GiB"),
    raw("plan-gpus", "plan --gpus 0", "plan: --gpus: must be >= 1"),
    raw("plan-preset", "plan model.preset=gpt-9", "model.preset"),
    raw("plan-key", "plan trainer.max_stpes=3", "trainer.max_stpes: unknown config key"),
    raw("doctor-flag", "doctor --bogus", "doctor: unrecognized arguments: --bogus"),
    raw("doctor-steps", "doctor --steps 1", "--steps: need at least 2"),
    raw("doctor-override", "doctor --out {out} nonsense", "doctor: 'nonsense' is not a KEY=VALUE config override"),
    raw("unknown-command", "fly", "fly: unknown command (choose from: train, generate"),
    # ---- eval, generate, chat, export and plan on bad runs, adapters and values
    raw("plan-memory-nan", "plan --memory nan", "plan: --memory: must be > 0 GiB and finite, got nan"),
    raw("plan-memory-inf", "plan --memory inf", "plan: --memory: must be > 0 GiB and finite, got inf"),
    raw("chat-temperature-nan", "chat --temperature nan", "--temperature: must be >= 0 and finite, got nan"),
    raw("chat-temperature-inf", "chat --temperature inf", "--temperature: must be >= 0 and finite, got inf"),
    raw("chat-temperature-neg", "chat --temperature -0.5", "chat: --temperature: must be >= 0, got -0.5"),
    raw("chat-top-p-nan", "chat --top-p nan", "chat: --top-p: must be in (0, 1], got nan"),
    raw("chat-top-p-inf", "chat --top-p inf", "chat: --top-p: must be in (0, 1], got inf"),
    raw("chat-top-p-0", "chat --top-p 0", "chat: --top-p: must be in (0, 1], got 0"),
    raw("plan-override-nan", "plan trainer.lr=nan", "trainer.lr: must be > 0 and finite, got nan"),
    raw("doctor-override-nan", "doctor --out {out} trainer.max_grad_norm=nan", "trainer.max_grad_norm: must be > 0, got nan"),
    raw("doctor-override-key", "doctor --out {out} trainer.max_stpes=3", "trainer.max_stpes: unknown config key"),
    generate("generate-rows-not-utf8", f"--rows {D}/latin1.jsonl", "{w}/data/latin1.jsonl: not UTF-8 text (byte 0xe9"),
    generate("generate-adapter-truncated", "--adapter {w}/adapters/truncated --prompt hi",
             "--adapter: {w}/adapters/truncated/adapter_model.safetensors is truncated"),
    generate("generate-adapter-config-binary", "--adapter {w}/adapters/binary --prompt hi",
             "{w}/adapters/binary/adapter_config.json: not readable JSON (UnicodeDecodeError"),
    generate("generate-mixed-soft-prompt-corrupt", f"--rows {D}/mixed_rows.jsonl",
             "--adapter: {w}/adapters/soft_bad/adapter_model.safetensors is not a valid safetensors file"),
    raw("eval-config-python-tag", "eval {w}/tagged", "{w}/tagged/config.yaml: not a tunekit config (could not determine a constructor"),
    export("export-config-python-tag", "{w}/tagged --format adapter --out {out}",
           "{w}/tagged/config.yaml: not a tunekit config (could not determine a constructor"),
    raw("eval-distill-run-without-student", "eval {w}/distill_no_student",
        "{w}/distill_no_student: a distillation run whose student base ({w}/distill_no_student/student_base) is not there"),
    export("export-distill-run-without-student", "{w}/distill_no_student --format merged --out {out}",
           "{w}/distill_no_student: a distillation run whose student base ({w}/distill_no_student/student_base) is not there"),
    raw("eval-data-changed", "eval {w}/fakerun",
        "data.path: {w}/data/changed.jsonl changed since the run {w}/fakerun trained on it"),
    raw("eval-pairs-to-sft-run", "eval {w}/fakerun --data {w}/data/pairs.jsonl",
        "--data: {w}/data/pairs.jsonl holds preference rows, which are scored with a preference run's own loss"),
    export("export-out-symlink-into-run", "{w}/fakerun --format adapter --out {w}/runlink/export",
           "--out: {w}/runlink/export is inside the run folder {w}/fakerun (through a link"),
    export("export-out-under-file", "{w}/fakerun --format adapter --out {w}/afile/export",
           "--out: {w}/afile/export lies under {w}/afile, which is a file"),
    export("export-out-read-only", "{w}/fakerun --format adapter --out {w}/ro/export",
           "--out: cannot write in {w}/ro", user="nobody"),
]
