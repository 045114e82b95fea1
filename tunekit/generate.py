"""Greedy generation where every row of one batch may use its own trained soft prompt.

Prompt tuning (Lester et al. 2021) leaves the base untouched, so one loaded base serves many
tasks at once: row i of a batch is [its soft prompt P_i: (N_i, dim)] + [its chat-templated prompt
tokens], rows of different lengths are left-padded, and position ids count from each row's first
real (or virtual) token, so every row computes exactly what it would alone:

    row i:  pad ... pad | P_i (N_i positions) | prompt tokens | generated tokens
    mask:     0 ...  0  |        1 ...        |     1 ...     |   1 ...
    pos:      0 ...  0  |  0 ... N_i - 1      |  N_i ...      |   ...

Python: `generate(model, tokenizer, prompts, soft_prompts, max_new_tokens)`;
command line: `tunekit generate --adapter DIR --prompt TEXT [--adapter DIR2 --prompt TEXT2 ...]`
or `--rows file.jsonl` with {"prompt": ..., "adapter": ... | null} per line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.nn as nn

from tunekit import TunekitError


def encode_prompts(tokenizer, prompts: Sequence[str], chat_template: bool = True) -> list[list[int]]:
    """Token ids of each prompt, as a user turn plus the assistant's generation prompt (as in training)."""
    from tunekit.data.tokenize import ensure_chat_template

    if not chat_template:
        return [tokenizer(p, add_special_tokens=True)["input_ids"] for p in prompts]
    ensure_chat_template(tokenizer)
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
             for p in prompts]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


@torch.no_grad()
def generate_ids(model: nn.Module, rows: Sequence[Sequence[int]], soft_prompts: Sequence[Optional[torch.Tensor]],
                 max_new_tokens: int, stop_ids: Sequence[int], pad_id: int) -> list[list[int]]:
    """Greedy decoding of a left-padded batch with per-row soft prompts.

    rows: token ids per row; soft_prompts: per row None or (N_i, dim). Returns the new token ids
    of each row, up to and including its first stop token.
    """
    if len(rows) != len(soft_prompts):
        raise TunekitError(f"generate: {len(rows)} prompts but {len(soft_prompts)} soft prompts")
    embed = model.get_input_embeddings()
    device, dtype, dim = embed.weight.device, embed.weight.dtype, embed.weight.shape[1]
    pieces = []
    for ids, soft in zip(rows, soft_prompts):
        e = embed(torch.tensor(list(ids), dtype=torch.long, device=device))  # (L_i, dim)
        if soft is not None:
            if soft.dim() != 2 or soft.shape[1] != dim:
                raise TunekitError(f"generate: a soft prompt of shape {tuple(soft.shape)} does not fit a model "
                                   f"of hidden size {dim}")
            e = torch.cat([soft.to(device=device, dtype=dtype), e])
        pieces.append(e)
    batch, width = len(pieces), max(p.shape[0] for p in pieces)
    inputs = torch.zeros(batch, width, dim, device=device, dtype=dtype)
    mask = torch.zeros(batch, width, dtype=torch.long, device=device)
    for i, p in enumerate(pieces):
        inputs[i, width - p.shape[0]:] = p
        mask[i, width - p.shape[0]:] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # (batch, width): 0 at each row's first real slot

    out = model(inputs_embeds=inputs, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
    stop = torch.tensor(sorted(set(stop_ids)), device=device)
    new = torch.empty(batch, 0, dtype=torch.long, device=device)
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    for _ in range(max_new_tokens):
        token = out.logits[:, -1].argmax(-1)  # (batch,)
        token = torch.where(done, torch.full_like(token, pad_id), token)
        new = torch.cat([new, token[:, None]], dim=1)
        done |= torch.isin(token, stop)
        if done.all():
            break
        mask = torch.cat([mask, mask.new_ones(batch, 1)], dim=1)
        positions = positions[:, -1:] + 1
        out = model(input_ids=token[:, None], attention_mask=mask, position_ids=positions,
                    past_key_values=out.past_key_values, use_cache=True)
    result = []
    for row in new.tolist():
        cut = next((j + 1 for j, t in enumerate(row) if t in set(stop_ids)), len(row))
        result.append(row[:cut])
    return result


def generate(model: nn.Module, tokenizer, prompts: Sequence[str], soft_prompts: Optional[Sequence[Optional[torch.Tensor]]] = None,
             max_new_tokens: int = 64, chat_template: bool = True) -> list[str]:
    """Greedy completions of `prompts`, row i conditioned on soft_prompts[i] ((N_i, dim) or None)."""
    soft_prompts = list(soft_prompts) if soft_prompts is not None else [None] * len(prompts)
    if max_new_tokens <= 0:
        raise TunekitError(f"generate: max_new_tokens must be > 0, got {max_new_tokens}")
    if not prompts:
        return []
    stop = [tokenizer.eos_token_id]
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    stop += [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    was_training = model.training
    model.eval()
    try:
        ids = generate_ids(model, encode_prompts(tokenizer, prompts, chat_template), soft_prompts, max_new_tokens, stop, pad)
    finally:
        model.train(was_training)
    return [tokenizer.decode(row, skip_special_tokens=True) for row in ids]


def _read_rows(path: str) -> list[tuple[str, Optional[str]]]:
    p = Path(path)
    if not p.is_file():
        raise TunekitError(f"--rows: file not found: {path}")
    rows = []
    for n, line in enumerate(p.read_text().splitlines(), start=1):
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
    if not rows:
        raise TunekitError(f"{path}: no rows")
    return rows


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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tunekit generate",
        description="Greedy generation; each prompt may use its own prompt-tuning adapter, all in one batch.",
        epilog="example: tunekit generate --adapter runs/a/adapter --prompt 'Hi' --adapter none --prompt 'Hi'",
    )
    p.add_argument("--model", help="base model folder or hub id (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--adapter", action="append", default=[], metavar="DIR",
                   help="a prompt-tuning adapter folder, or 'none'; one for all prompts, or one per --prompt")
    p.add_argument("--prompt", action="append", default=[], metavar="TEXT", help="a user message (repeatable)")
    p.add_argument("--rows", metavar="FILE", help='a .jsonl file of {"prompt": ..., "adapter": DIR or null}')
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto")
    p.add_argument("--no-chat-template", action="store_true", help="feed prompts as raw text")
    p.add_argument("--json", action="store_true", help="print one JSON object per row")
    return p


def main(argv: list[str]) -> None:
    args = build_parser().parse_args(argv)
    if args.rows and (args.prompt or args.adapter):
        raise TunekitError("--rows: give either --rows or --prompt/--adapter, not both")
    if not args.rows and not args.prompt:
        raise TunekitError("--prompt: give at least one --prompt TEXT (or --rows FILE)")
    rows = _read_rows(args.rows) if args.rows else _pair(args.prompt, args.adapter)

    from tunekit.methods.prompt_tuning import load_soft_prompt
    from tunekit.model import compute_dtype, load_base_model, load_tokenizer, resolve_model_path

    from transformers import AutoConfig

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    path = resolve_model_path(args.model, key="--model")
    hidden = AutoConfig.from_pretrained(path).hidden_size
    cache: dict[str, torch.Tensor] = {}
    for _, adapter in rows:  # every adapter is checked before the model loads
        if adapter is not None and adapter not in cache:
            cache[adapter] = load_soft_prompt(adapter, hidden)
    tokenizer = load_tokenizer(path)
    model = load_base_model(path, "none", compute_dtype(args.dtype, device), device)
    texts = generate(model, tokenizer, [p for p, _ in rows], [cache.get(a) if a else None for _, a in rows],
                     args.max_new_tokens, chat_template=not args.no_chat_template)
    for i, ((prompt, adapter), text) in enumerate(zip(rows, texts)):
        if args.json:
            print(json.dumps({"prompt": prompt, "adapter": adapter, "completion": text}))
        else:
            print(f"[{i}] adapter: {adapter or 'none'}\n> {prompt}\n{text}\n")
    sys.stdout.flush()
