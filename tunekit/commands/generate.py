"""`tunekit generate`: greedy answers from what any recipe trained, several rows in one batch.

    tunekit generate --adapter runs/x --prompt "Hi"                 # a run folder (or RUN/adapter, a merged folder, ...)
    tunekit generate --adapter runs/a/adapter --prompt "Hi" --adapter runs/b/adapter --prompt "Hi" --adapter none --prompt "Hi"
    tunekit generate --rows rows.jsonl                              # {"prompt": ..., "adapter": DIR or null} per line

One batch runs over one base, and each row must come out exactly as it would alone. That holds
for rows that differ only in a soft prompt (prompt tuning: per-row prompts, left padding,
per-row positions) or only in a LoRA adapter (peft's per-row adapter_names; "none" rows use the
bare base), all trained over the same base. A single source of any kind (adapters, BitFit, full,
merged) serves every row. Other mixtures are refused with one line: run them separately.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Optional

from tunekit import TunekitError
from tunekit.commands.parse import Parser, add_device_argument

log = logging.getLogger("tunekit")

MIXABLE = ("prompt_tuning", "lora")


def _read_rows(path: str) -> tuple[list[tuple[str, Optional[str]]], list[str]]:
    """(prompt, adapter) per row, and each row's name for errors ("FILE: row N", N its line)."""
    p = Path(path)
    if not p.is_file():
        raise TunekitError(f"--rows: file not found: {path}")
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise TunekitError(f"{path}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start:,})") from None
    except OSError as e:
        raise TunekitError(f"--rows: cannot read {path} ({e.strerror})") from None
    rows, labels = [], []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise TunekitError(f"{path}: row {n}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"]:
            raise TunekitError(f"{path}: row {n}: needs a non-empty string 'prompt'")
        adapter = row.get("adapter")
        if adapter is not None and not isinstance(adapter, str):
            raise TunekitError(f"{path}: row {n}: 'adapter' must be a folder path or null")
        rows.append((row["prompt"], adapter))
        labels.append(f"{path}: row {n}")
    if not rows:
        raise TunekitError(f"{path}: no rows")
    return rows, labels


def _pair(prompts: list[str], adapters: list[str]) -> list[tuple[str, Optional[str]]]:
    adapters = [None if a.lower() == "none" else a for a in adapters]
    if not adapters:
        adapters = [None] * len(prompts)
    elif len(adapters) == 1:
        adapters = adapters * len(prompts)
    elif len(adapters) != len(prompts):
        raise TunekitError(f"--adapter: {len(adapters)} adapters for {len(prompts)} prompts; give one adapter, "
                           "or one per --prompt (in order; 'none' for the plain base)")
    return list(zip(prompts, adapters))


def generate_workload(prompts: list[str], max_new_tokens: int):
    """All rows at once: every prompt's tokens (at most its UTF-8 bytes plus a chat template's
    few dozen) and the new tokens in the cache, one position's logits per row."""
    from tunekit.plan.inference import Workload

    longest = max(len(p.encode()) for p in prompts) + 64
    return Workload(kv_tokens=len(prompts) * (longest + max_new_tokens), forward_tokens=len(prompts) * longest,
                    logit_rows=len(prompts))


def batch_model(adapters: list[Optional[str]], model: Optional[str], quantize: Optional[str], dtype: str,
                facts=None, work=None):
    """(model to run, tokenizer, per-row soft prompts, per-row peft adapter names or None) for rows
    that use the given adapters (None: the bare base), on the device of `facts` (default the CPU).
    Checks every source, and with `work` the memory it needs there, before loading."""
    from tunekit.runs.load import load_base, load_tokenizer_for, load_trained
    from tunekit.runs.memory import check_memory
    from tunekit.runs.open import base_source, open_source

    names = list(dict.fromkeys(a for a in adapters if a is not None))
    sources = {a: open_source(a, model, quantize, dtype, what="--adapter", facts=facts) for a in names}

    def fits(src) -> None:
        if work is not None:
            log.info("%s", check_memory(src, work, "tunekit generate", "fewer prompts at once shrink the KV cache"))

    if not sources:  # the bare base for every row
        src = base_source(model, quantize, dtype, facts)
        fits(src)
        return load_trained(src), load_tokenizer_for(src), [None] * len(adapters), None
    if len(sources) == 1 and None not in adapters:
        src = sources[names[0]]
        fits(src)
        return load_trained(src), load_tokenizer_for(src), [None] * len(adapters), None
    kinds = {s.method for s in sources.values()}
    if len(kinds) > 1 or not kinds <= set(MIXABLE):
        odd = next(s for s in sources.values() if s.method not in MIXABLE or len(kinds) > 1)
        raise TunekitError(f"--adapter: one batch cannot mix {odd.describe()} with other rows; per-row mixing "
                           "works for prompt-tuning or LoRA adapters over one base (and 'none' rows): run the "
                           "others separately")
    first = sources[names[0]]
    other = next((s for s in sources.values() if s.same_base_key != first.same_base_key), None)
    if other is not None:
        raise TunekitError(f"--adapter: rows use adapters trained over different bases ({first.describe()}; "
                           f"{other.describe()}); run them separately")
    fits(first)
    base = load_base(first)
    tokenizer = load_tokenizer_for(first)
    if kinds == {"prompt_tuning"}:
        from tunekit.methods.prompt_tuning import load_soft_prompt

        hidden = base.config.hidden_size
        prompts = {a: load_soft_prompt(s.adapter_dir, hidden) for a, s in sources.items()}
        return base, tokenizer, [prompts.get(a) if a else None for a in adapters], None
    from peft import PeftModel

    label = {a: f"a{i}" for i, a in enumerate(names)}
    peft_model = PeftModel.from_pretrained(base, str(sources[names[0]].adapter_dir), adapter_name=label[names[0]])
    for a in names[1:]:
        peft_model.load_adapter(str(sources[a].adapter_dir), adapter_name=label[a])
    peft_model.requires_grad_(False).eval()
    return peft_model, tokenizer, [None] * len(adapters), [label[a] if a else "__base__" for a in adapters]


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="tunekit generate",
        description="Greedy generation with what any recipe trained; rows may mix prompt-tuning or LoRA "
                    "adapters over one base in one batch, each row as it would come out alone.",
        epilog="example: tunekit generate --adapter runs/a --prompt 'Hi' --adapter none --prompt 'Hi'",
    )
    p.add_argument("--model", help="base model folder for adapter folders outside a run, and for 'none' rows "
                                    "(default: the base an adapter names, else the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--adapter", action="append", default=[], metavar="DIR",
                   help="a run folder, an adapter folder, a model folder, or 'none'; one for all prompts, or one per --prompt")
    p.add_argument("--prompt", action="append", default=[], metavar="TEXT", help="a user message (repeatable)")
    p.add_argument("--rows", metavar="FILE", help='a .jsonl file of {"prompt": ..., "adapter": DIR or null}')
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto",
                   help="compute dtype of a base loaded for adapter folders (a run keeps its own)")
    p.add_argument("--quantize", choices=["none", "nf4"], help="load an adapter folder's base in 4-bit NF4")
    p.add_argument("--no-chat-template", action="store_true", help="feed prompts as raw text")
    p.add_argument("--json", action="store_true", help="print one JSON object per row")
    add_device_argument(p)
    return p


def main(argv: list[str]) -> None:
    from tunekit.infer.decode import generate

    args = build_parser().parse_args(argv)
    if args.rows and (args.prompt or args.adapter):
        raise TunekitError("--rows: give either --rows or --prompt/--adapter, not both")
    if not args.rows and not args.prompt:
        raise TunekitError("--prompt: give at least one --prompt TEXT (or --rows FILE)")
    if args.max_new_tokens <= 0:
        raise TunekitError(f"--max-new-tokens: must be > 0, got {args.max_new_tokens}")
    if args.rows:
        rows, labels = _read_rows(args.rows)
    else:
        rows = _pair(args.prompt, args.adapter)
        labels = [f"--prompt {i + 1}" for i in range(len(rows))]
    from tunekit.device.facts import command_facts

    model, tokenizer, softs, names = batch_model([a for _, a in rows], args.model, args.quantize, args.dtype,
                                                 command_facts(args.device),
                                                 generate_workload([p for p, _ in rows], args.max_new_tokens))
    texts = generate(model, tokenizer, [p for p, _ in rows], softs if any(s is not None for s in softs) else None,
                     args.max_new_tokens, chat_template=not args.no_chat_template, adapter_names=names, labels=labels)
    for i, ((prompt, adapter), text) in enumerate(zip(rows, texts)):
        if args.json:
            print(json.dumps({"prompt": prompt, "adapter": adapter, "completion": text}))
        else:
            print(f"[{i}] adapter: {adapter or 'none'}\n> {prompt}\n{text}\n")
    sys.stdout.flush()
