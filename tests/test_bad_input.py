"""The bad-input catalogue: every malformed input a careful user can give, through the real CLI.

Each row is one command line and the culprit its error must name. Every case must end with exit
code 2, stderr exactly one `tunekit: error: <culprit>: ...` line (no traceback, no log lines),
and nothing written: not the run's output_dir, not the working directory.

Speed: every `tunekit` process start pays the import of torch, transformers, peft and hydra, so
the catalogue runs in forks of one server that imported tunekit once (tests/_cli_forker.py over
tunekit.commands.forkserver): each child runs `tunekit.commands.main.main(argv)` with its own
stdout/stderr, cwd and exit status, which is the real CLI path. `test_forker_matches_the_console_script`
checks a few rows through the installed `tunekit` script too.

Adding a case is one line in CASES: train(id, overrides, culprit) / export(...) / generate(...).
Placeholders: {tiny} the tiny model folder, {data} a good data file, {w} the folder of fixture
files built by `build_world`, {out} the case's own output_dir, {cwd} its working directory.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from _cli_forker import CliServer
from _helpers import fork_server, run_cli, snapshot
from tunekit.train.checkpoint import sha256_file
from tunekit.train.runlock import RunLock


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
OFFLINE = {"HF_HUB_OFFLINE": "1"}

CASES = [
    # ---- trainer.*
    train("max_steps-0", "trainer.max_steps=0", "trainer.max_steps: must be >= 1, got 0"),
    train("max_steps-neg", "trainer.max_steps=-5", "trainer.max_steps: must be >= 1"),
    train("max_steps-text", "trainer.max_steps=abc", "trainer.max_steps: Value 'abc'"),
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
    train("lr-nan", "trainer.lr=nan", "trainer.lr: must be a number, got nan"),
    train("lr-text", "trainer.lr=fast", "trainer.lr: Value 'fast'"),
    train("weight_decay-neg", "trainer.weight_decay=-1", "trainer.weight_decay: must be >= 0"),
    train("weight_decay-inf", "trainer.weight_decay=inf", "trainer.weight_decay: must be >= 0 and finite"),
    train("weight_decay-huge", "trainer.weight_decay=10000", "trainer.weight_decay: lr * weight_decay"),
    train("max_grad_norm-neg", "trainer.max_grad_norm=-1", "trainer.max_grad_norm: must be > 0, got -1"),
    train("max_grad_norm-0", "trainer.max_grad_norm=0", "trainer.max_grad_norm: must be > 0, got 0"),
    train("max_grad_norm-nan", "trainer.max_grad_norm=nan", "trainer.max_grad_norm: must be a number"),
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
    train("max_seq_len-4", "data.max_seq_len=4", "data.max_seq_len: must be >= 8, got 4"),
    train("max_seq_len-over-model", "data.max_seq_len=100000",
          "data.max_seq_len: 100000 is more than the 512 positions"),
    train("max_val_examples-0", "data.max_val_examples=0", "data.max_val_examples: must be >= 1, got 0"),
    train("max_val_examples-neg", "data.max_val_examples=-1", "data.max_val_examples: must be >= 1"),
    train("format-unknown", "data.format=xml", "data.format: Invalid value 'xml'"),
    train("packing-not-bool", "data.packing=maybe", "data.packing:"),
    # ---- model.* values
    train("quantize-unknown", "model.quantize=int3", "model.quantize: Invalid value 'int3'"),
    train("dtype-unknown", "model.dtype=fp8", "model.dtype: Invalid value 'fp8'"),
    train("model-path-empty", "model.path=''", "model.path: empty"),
    # ---- method.* (every method, none of them needs the model loaded)
    train("method-unknown", "method.name=nope", "method.name: unknown method 'nope'"),
    train("lora-r-0", "method.r=0", "method.r: must be >= 1, got 0"),
    train("lora-r-neg", "method.r=-4", "method.r: must be >= 1"),
    train("lora-r-float", "method.r=1.5", "method.r: Value '1.5'"),
    train("lora-alpha-neg", "method.alpha=-8", "method.alpha: must be > 0, got -8"),
    train("lora-alpha-0", "method.alpha=0", "method.alpha: must be > 0"),
    train("lora-alpha-inf", "method.alpha=inf", "method.alpha: must be > 0 and finite"),
    train("lora-dropout-2", "method.dropout=2.0", "method.dropout: must be in [0, 1), got 2"),
    train("lora-dropout-neg", "method.dropout=-0.1", "method.dropout: must be in [0, 1)"),
    train("lora-dropout-1", "method.dropout=1", "method.dropout: must be in [0, 1), got 1"),
    train("lora-targets-empty", "method.target_modules=[]", "method.target_modules: must be a non-empty list"),
    train("lora-targets-typo", "method.target_modules=[q_projj]", "method.target_modules: no module named 'q_projj'"),
    train("lora-targets-all-plus", "method.target_modules=[all-linear,q_proj]",
          "method.target_modules: all-linear stands alone"),
    train("lora-targets-twice", "method.target_modules=[q_proj,q_proj]", "method.target_modules: 'q_proj' is listed twice"),
    train("lora-targets-not-list", "method.target_modules=q_proj", "method.target_modules: must be a list, e.g. method.target_modules=[a,b]"),
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
    # ---- distill.*, kernels.*, tracker.*
    train("distill-alpha", "recipe=distill distill.alpha=1.5", "distill.alpha: must be in [0, 1], got 1.5"),
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
    train("val-missing", "data.val_path={w}/nope.jsonl", "data.val_path: file not found: {w}/nope.jsonl"),
    train("val-bad-row", f"data.val_path={D}/no_output.jsonl", "{w}/data/no_output.jsonl: row 2: 'output' must be"),
    train("val-empty", f"data.val_path={D}/empty.jsonl", "{w}/data/empty.jsonl: no rows"),
    train("data-hub-unreachable", "data.path=tunekit-tests/no-such-dataset",
          "data.path: 'tunekit-tests/no-such-dataset' is not a local file or folder (no {cwd}/tunekit-tests/"
          "no-such-dataset), and the Hugging Face hub could not be reached to load it as a dataset id"),
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
    train("lora-targets-embeddings", "method.target_modules=[embed_tokens]",
          "method.target_modules: 'embed_tokens' names Embedding modules"),
    train("out-symlink-loop", "output_dir={w}/loop", "output_dir: {w}/loop is a symlink loop"),
    train("out-dangling-symlink", "output_dir={w}/dangling/run",
          "output_dir: {w}/dangling/run lies under {w}/dangling, which is a dangling symlink"),
    train("resume-finished", "output_dir={w}/finished trainer.resume=true",
          "trainer.max_steps: the run in {w}/finished is finished; its checkpoint {w}/finished/checkpoints/step-000002 "
          "is at step 2, already at trainer.max_steps=2: nothing to resume. To train longer, raise trainer.max_steps"),
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
    raw("eval-data-changed", "eval {w}/fakerun",
        "data.path: {w}/data/changed.jsonl changed since the run {w}/fakerun trained on it"),
    export("export-out-symlink-into-run", "{w}/fakerun --format adapter --out {w}/runlink/export",
           "--out: {w}/runlink/export is inside the run folder {w}/fakerun (through a link"),
    export("export-out-under-file", "{w}/fakerun --format adapter --out {w}/afile/export",
           "--out: {w}/afile/export lies under {w}/afile, which is a file"),
    export("export-out-read-only", "{w}/fakerun --format adapter --out {w}/ro/export",
           "--out: cannot write in {w}/ro", user="nobody"),
]


# ----------------------------------------------------------------------------- fixture files
def _jsonl(path: Path, rows) -> None:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


def build_world(w: Path, tiny: Path) -> None:
    """Every bad file and folder the catalogue names, under w (world-readable)."""
    d, m = w / "data", w / "models"
    d.mkdir()
    m.mkdir()
    qa = {"instruction": "What is 2 plus 2?", "output": "4."}
    chat = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}
    _jsonl(d / "alpaca.jsonl", [qa] * 6)
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
    _bad_runs_and_adapters(w, tiny, config["hidden_size"])


def _bad_runs_and_adapters(w: Path, tiny: Path, hidden: int) -> None:
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
    # a killed run: config.yaml and a checkpoint, no adapter/ and no summary.json
    ckpt = w / "killed" / "checkpoints" / "step-000002" / "adapter"
    ckpt.mkdir(parents=True)
    (w / "killed" / "config.yaml").write_text(f"recipe: lora\nmodel:\n  path: {tiny}\ndata:\n  path: {w}/data/alpaca.jsonl\n")
    (ckpt / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "base_model_name_or_path": str(tiny)}))
    save_file({"base_model.model.x.lora_A.weight": torch.zeros(8, 64)}, ckpt / "adapter_model.safetensors")
    build_resume_world(w)


def build_resume_world(w: Path) -> None:
    """Run folders to resume that hold nothing to resume, or files resume cannot read back."""
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
        state = {"format": 2, "step": step, "rng": [{}], "fingerprint": {},
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


def _fill(text: str, places: dict) -> str:
    return re.sub(r"\{(tiny|data|w|out|cwd)\}", lambda mt: str(places[mt.group(1)]), text).replace("{{", "{").replace("}}", "}")


def _can_run_as(user: str) -> bool:
    if os.getuid() != 0:
        return True  # permissions already apply to us
    try:
        import pwd

        pwd.getpwnam(user)
        return True
    except KeyError:
        return False


@pytest.fixture(scope="module")
def world(tiny_model_dir, tiny_data):
    # Outside pytest's 0700 temp root: the permission cases run as `nobody` when we are root.
    w = Path(tempfile.mkdtemp(prefix="tunekit-bad-input-"))
    w.chmod(0o755)
    for sub in ("outs", "cwds"):
        (w / sub).mkdir()
        (w / sub).chmod(0o777)
    build_world(w, Path(tiny_model_dir))
    lock = RunLock.acquire(w / "locked")
    untouched = {name: snapshot(w / name) for name in UNTOUCHED}
    yield {"w": w, "tiny": Path(tiny_model_dir), "data": Path(tiny_data), "untouched": untouched}
    lock.release()
    (w / "ro").chmod(0o755)
    shutil.rmtree(w, ignore_errors=True)


def places_of(world: dict, case: Case) -> dict:
    return {**world, "out": world["w"] / "outs" / case.id, "cwd": world["w"] / "cwds" / case.id}


@pytest.fixture(scope="module")
def results(world):
    """Run the whole catalogue in one forking interpreter; {id: result}."""
    cases = []
    for case in CASES:
        places = places_of(world, case)
        places["cwd"].mkdir()
        places["cwd"].chmod(0o777)
        cases.append({"id": case.id, "argv": shlex.split(_fill(case.argv, places)), "cwd": str(places["cwd"]),
                      "env": case.env, "user": case.user if _can_run_as(case.user or "") and case.user else None})
    warmup = shlex.split(_fill(TRAIN_BASE, {**world, "out": world["w"] / "outs" / "warmup", "cwd": world["w"]}))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    # Two single-threaded children at a time: CI machines have 2 cores (TUNEKIT_CATALOGUE_JOBS overrides).
    jobs = int(os.environ.get("TUNEKIT_CATALOGUE_JOBS", min(2, len(os.sched_getaffinity(0)))))
    server = fork_server()  # this worker's, where it has one that serves this environment: no import of its own
    own = None if server is not None and server.serves(env) else CliServer(env)
    try:
        rows = (own or server).batch(cases, jobs, timeout=180, warmup=warmup)
    finally:
        if own is not None:
            own.close()
    print(f"{len(rows)} cases in {rows[0]['batch_seconds']} s ({jobs} at a time)")  # shown with -s
    if os.environ.get("TUNEKIT_CATALOGUE_DUMP"):  # for reading every message at once
        Path(os.environ["TUNEKIT_CATALOGUE_DUMP"]).write_text(json.dumps(rows))
    return {r["id"]: r for r in rows}


def test_catalogue_is_large_and_unique():
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids)), sorted({i for i in ids if ids.count(i) > 1})
    assert len(CASES) >= 100


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case, results, world):
    if case.user and not _can_run_as(case.user):
        pytest.skip(f"needs user {case.user!r} to drop root's permissions")
    places = places_of(world, case)
    r = results[case.id]
    lines = r["stderr"].strip().splitlines()
    assert r["code"] == case.code, r["stderr"][-3000:]
    assert len(lines) == 1 and lines[0].startswith("tunekit: error: "), r["stderr"][-3000:]
    assert _fill(case.culprit, places) in lines[0]
    assert not places["out"].exists(), "output_dir was created"
    assert not any(places["cwd"].iterdir()), f"wrote into the working directory: {list(places['cwd'].iterdir())}"


# Folders of build_world that refused runs were pointed at: they must come out exactly as they went in.
UNTOUCHED = ("userfiles", "handmade", "locked", "finished", "stepfive", "finished_bare", "metrics_latin1",
             "metrics_list", "ckpt_file", "step_text", "no_rng")


def test_refused_output_dirs_are_untouched(results, world):
    for name in UNTOUCHED:
        assert snapshot(world["w"] / name) == world["untouched"][name], name


def test_forker_matches_the_console_script(results, world):
    """Two rows through the installed `tunekit` script (a config error found before torch is
    imported, a model-folder error after): same exit code, same stderr as the forked child."""
    for case_id in ("lr-inf", "model-bert"):
        case = next(c for c in CASES if c.id == case_id)
        places = {**places_of(world, case), "cwd": world["w"] / "cwds" / case.id}
        r = run_cli(shlex.split(_fill(case.argv, places)), places["cwd"], env={"OMP_NUM_THREADS": "1"}, fresh=True)
        assert (r.returncode, r.stderr.strip()) == (results[case.id]["code"], results[case.id]["stderr"].strip())


def test_nan_weights_stop_before_training(world):
    """NaN weights show only in the loaded values (one pass over them, after the load): the run stops
    there, before any step, naming the folder and the first tensor. Not a catalogue row: the run's
    own progress lines (data, memory plan, precision) come before it on stderr."""
    out = world["w"] / "outs" / "nan-weights"
    args = shlex.split(_fill(TRAIN_BASE, {**world, "out": out})) + [f"model.path={world['w']}/models/nan"]
    r = run_cli(["train", *args], world["w"] / "cwds")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert lines[-1].startswith(f"tunekit: error: model.path: the weights in {world['w']}/models/nan hold NaN or "
                                "infinite values, in 20 tensor(s), first model.embed_tokens.weight"), lines[-1]
    assert not out.exists()


def test_generate_refuses_a_misfit_model_folder(world):
    """Every command that loads a base checks it as training does: `generate --model` on a folder whose
    config.json has one layer fewer than its weights. (Its memory line comes first: not a catalogue row.)"""
    cwd = world["w"] / "cwds"
    r = run_cli(["generate", "--model", f"{world['w']}/models/onelayer", "--prompt", "hi"], cwd)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert lines[-1].startswith(f"tunekit: error: --model: the weights in {world['w']}/models/onelayer do not "
                                "fit its config.json: 9 tensor(s) in the files fit no weight of the config "
                                "(model.layers.1.input_layernorm.weight, "), lines[-1]
    assert not r.stdout.strip()  # nothing generated


def test_missing_optional_library_is_one_line(monkeypatch):
    """A choice that needs bitsandbytes or wandb fails at validation, not as an ImportError mid-setup."""
    import importlib.util

    from tunekit import TunekitError
    from tunekit.config import ModelConfig, TrackerConfig, TrainConfig, TrainerConfig, _check_libraries

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("bitsandbytes", "wandb") else real(name, *a))
    with pytest.raises(TunekitError, match=r"^model.quantize: nf4 needs bitsandbytes, which is not installed"):
        _check_libraries(TrainConfig(model=ModelConfig(quantize="nf4")))
    with pytest.raises(TunekitError, match=r"^trainer.optimizer: paged_adamw_8bit needs bitsandbytes"):
        _check_libraries(TrainConfig(trainer=TrainerConfig(optimizer="paged_adamw_8bit")))
    with pytest.raises(TunekitError, match=r"^tracker.name: wandb needs the wandb package"):
        _check_libraries(TrainConfig(tracker=TrackerConfig(name="wandb")))
    _check_libraries(TrainConfig())  # adamw on a bf16 base needs neither


# Refusals that come after a model loaded (its memory line is on stderr first): the last line is checked.
LOADED = [
    ("generate-prompt-too-long", ["generate", "--model", "{tiny}", "--prompt", "word " * 600], None,
     "--prompt 1: the prompt is "),
    ("chat-system-refused", ["chat", "--model", "{w}/models/strict_template", "--system", "Be brief."], "Hi\n",
     "--system: the tokenizer's chat template refuses a system turn (no system turns here)"),
    ("chat-stdin-not-utf8", ["chat", "--model", "{tiny}", "--max-new-tokens", "2"], "caf\udce9\n",
     "stdin: not UTF-8 text (byte 0xe9)"),
]


@pytest.mark.parametrize("argv,stdin,culprit", [c[1:] for c in LOADED], ids=[c[0] for c in LOADED])
def test_refused_after_the_model_loads(world, argv, stdin, culprit):
    cwd = world["w"] / "cwds"
    args = [_fill(a, {**world, "out": cwd, "cwd": cwd}) for a in argv]
    if stdin is not None and "\udce9" in stdin:  # bytes that are not UTF-8, through a file the child reads
        r = _run_with_stdin_bytes(args, cwd, stdin.encode("utf-8", "surrogateescape"))
    else:
        r = run_cli(args, cwd, input=stdin)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert lines[-1].startswith(f"tunekit: error: {culprit}"), lines[-1]
    assert "prompt is" not in culprit or "with --max-new-tokens 64 that is more than the model's context of 512" in lines[-1]
    assert not r.stdout.strip()


def _run_with_stdin_bytes(args, cwd, data: bytes) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("tunekit")
    r = subprocess.run([str(exe), *args], input=data, capture_output=True, cwd=cwd, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    return subprocess.CompletedProcess(r.args, r.returncode, r.stdout.decode(errors="replace"),
                                       r.stderr.decode(errors="replace"))


def test_python_tag_in_a_run_config_runs_nothing(results, world):
    assert results["eval-config-python-tag"]["code"] == 2
    assert not (world["w"] / "pwned").exists()


def test_a_killed_runs_checkpoint_is_that_runs_adapter(world):
    """RUN/checkpoints/step-N/adapter of a run killed before adapter/ was written: opened as that run
    (its base, its method, its held-out split), not as a standalone adapter over the default data."""
    from tunekit.runs.open import open_source

    ckpt = world["w"] / "killed" / "checkpoints" / "step-000002" / "adapter"
    src = open_source(ckpt)
    assert src.kind == "run" and src.adapter_dir == ckpt
    assert src.run.run_dir == world["w"] / "killed"
    assert src.run.cfg.data.path == f"{world['w']}/data/alpaca.jsonl"


def test_full_disk_during_a_checkpoint_keeps_the_last_good_one(tmp_path):
    """A disk that fills while a checkpoint is written: one line naming the folder, the scratch folder
    gone, and the checkpoint before it byte for byte as it was."""
    import errno

    import torch

    from tunekit import TunekitError
    from tunekit.train.checkpoint import save_checkpoint

    param = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([param], lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    adapter = lambda d: (d.mkdir(), (d / "a.bin").write_bytes(b"ok"))  # noqa: E731
    save_checkpoint(tmp_path, 1, adapter, opt, sched, {}, [{}], keep=2)
    before = snapshot(tmp_path)

    def full(d):
        raise OSError(errno.ENOSPC, "No space left on device", str(d / "a.bin"))

    with pytest.raises(TunekitError, match=r"^no space left on .*checkpoints: saving step-000002 failed; the last "
                                           r"good checkpoint, .*step-000001, is intact"):
        save_checkpoint(tmp_path, 2, full, opt, sched, {}, [{}], keep=2)
    assert snapshot(tmp_path) == before


def test_doctor_again_into_its_own_stopped_output(tmp_path):
    """A doctor that stopped at a wrong --model left its --out behind: a second doctor may replace
    it; a user's folder that merely looks like one (logs/*.log) is refused and left as it was."""
    out = tmp_path / "doc"
    for _ in range(2):
        r = run_cli(["doctor", "--model", str(tmp_path / "missing"), "--out", str(out)], tmp_path)
        assert r.returncode != 0 and "missing" in r.stderr.strip().splitlines()[-1], r.stderr[-2000:]
        assert "is not a doctor report" not in r.stderr
    mine = tmp_path / "mine"
    (mine / "logs").mkdir(parents=True)
    (mine / "logs" / "notes.log").write_text("keep me")
    r = run_cli(["doctor", "--out", str(mine)], tmp_path)
    assert r.returncode != 0 and "is not a doctor report" in r.stderr
    assert (mine / "logs" / "notes.log").read_text() == "keep me"
