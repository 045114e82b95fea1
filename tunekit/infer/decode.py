"""Greedy decoding and continuation scoring over one left-padded batch, for every kind of trained model.

Row i of a batch is [its soft prompt P_i: (N_i, dim), if any] + [its prompt tokens]; rows of
different lengths are left-padded, and position ids count from each row's first real (or virtual)
token, so every row computes exactly what it would alone:

    row i:  pad ... pad | P_i (N_i positions) | prompt tokens | generated tokens
    mask:     0 ...  0  |        1 ...        |     1 ...     |   1 ...
    pos:      0 ...  0  |  0 ... N_i - 1      |  N_i ...      |   ...

A trained model reaches this module through `generation_view(model)`: (a causal LM, its soft
prompt or None). LoRA (peft), bottleneck adapters, BitFit, full and merged models are causal LMs
as they are; prompt tuning (Lester et al. 2021) hands over its untouched base and its trained
prompt, so one base serves many prompts in one batch. Several LoRA adapters over one base share a
batch through peft's per-row `adapter_names` (each row runs only its own adapter).

One prompt pass (`prefill`) serves three consumers: greedy decoding (`greedy`), the log-likelihood
of given continuations (`score_continuations`: a reference answer, the classes of a classification
task) and, with keep_hidden, the loss on trained tokens inside the prompt (tunekit.taskeval).

Python: `generate(model, tokenizer, prompts, soft_prompts, max_new_tokens)`; the command line is
tunekit.commands.generate (`tunekit generate`) and tunekit.commands.chat (`tunekit chat`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from tunekit import TunekitError


def generation_view(model: nn.Module) -> tuple[nn.Module, Optional[torch.Tensor]]:
    """(the causal LM that runs, the soft prompt (N, dim) every row gets, or None)."""
    view = getattr(model, "tunekit_generation_view", None)
    return view() if view is not None else (model, None)


def stop_token_ids(model: nn.Module, tokenizer) -> list[int]:
    """EOS of the tokenizer, the token its chat template ends a reply with (what a model tuned here
    learned to stop at: it differs from EOS for a base tokenizer whose EOS is <|end_of_text|>, or for
    Gemma), plus the model's generation-config EOS ids."""
    from tunekit.data.tokenize import turn_end_id

    stop = [tokenizer.eos_token_id, turn_end_id(tokenizer)]
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    stop += [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
    return sorted({s for s in stop if s is not None})


def pad_token_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def encode_prompts(tokenizer, prompts: Sequence[str], chat_template: bool = True) -> list[list[int]]:
    """Token ids of each prompt, as a user turn plus the assistant's generation prompt (as in training)."""
    return [encode_messages(tokenizer, [{"role": "user", "content": p}], chat_template) for p in prompts]


def encode_messages(tokenizer, messages: list[dict], chat_template: bool = True) -> list[int]:
    """A conversation rendered with the chat template, ending in the assistant's generation prompt.
    Without the template (raw text mode) the messages' contents are simply joined."""
    from tunekit.data.tokenize import ensure_chat_template, render_chat

    if not chat_template:
        return tokenizer("\n".join(m["content"] for m in messages), add_special_tokens=True)["input_ids"]
    ensure_chat_template(tokenizer)
    text = render_chat(tokenizer, messages, generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@dataclass
class Prefix:
    """A left-padded batch after its prompt pass: what decoding and scoring continue from."""

    cache: object  # transformers Cache over the `width` prompt positions (greedy() extends it in place)
    mask: torch.Tensor  # (batch, width) long: 1 on real and virtual positions, 0 on padding
    next_pos: torch.Tensor  # (batch, 1) position id of each row's next token
    last_logits: torch.Tensor  # (batch, vocab) fp32 logits at each row's last position
    hidden: Optional[torch.Tensor] = None  # (batch, width, dim) last hidden states (keep_hidden=True)
    adapter_names: Optional[list[str]] = None  # per-row peft LoRA adapter names, or None
    shared: int = 0  # tokens of a prefix every row shares, run once (see prefill)
    shared_width: int = 0  # positions of that shared block (soft prompt included)

    def token_slots(self, row: int, n: int) -> list[int]:
        """Where the n prompt tokens of `row` sit along `width` (rows are right-aligned; a shared
        prefix sits at the start, before the rows' own padded tokens)."""
        width = self.mask.shape[1]
        if not self.shared:
            return [width - n + j for j in range(n)]
        return [self.shared_width - self.shared + j for j in range(self.shared)] + \
            [width - (n - j) for j in range(self.shared, n)]


def _left_pad(model: nn.Module, rows: Sequence[Sequence[int]], soft_prompts: Sequence[Optional[torch.Tensor]]):
    """(inputs_embeds (batch, width, dim), mask (batch, width), position ids (batch, width))."""
    if len(rows) != len(soft_prompts):
        raise TunekitError(f"generate: {len(rows)} prompts but {len(soft_prompts)} soft prompts")
    if not rows:
        raise TunekitError("generate: no prompts")
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
        if e.shape[0] == 0:
            raise TunekitError("generate: an empty prompt (no tokens and no soft prompt)")
        pieces.append(e)
    batch, width = len(pieces), max(p.shape[0] for p in pieces)
    inputs = torch.zeros(batch, width, dim, device=device, dtype=dtype)
    mask = torch.zeros(batch, width, dtype=torch.long, device=device)
    for i, p in enumerate(pieces):
        inputs[i, width - p.shape[0]:] = p
        mask[i, width - p.shape[0]:] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # 0 at each row's first real slot
    return inputs, mask, positions


def _peft_kwargs(adapter_names: Optional[list[str]]) -> dict:
    return {"adapter_names": list(adapter_names)} if adapter_names else {}


MIN_SHARED = 16  # a shared prefix shorter than this is not worth a pass of its own


def shared_prefix_len(rows: Sequence[Sequence[int]], soft_prompts: Sequence[Optional[torch.Tensor]]) -> int:
    """Tokens every row starts with (the system prompt and instruction of templated prompts), when
    every row has the same soft prompt; each row keeps at least one token of its own."""
    if len(rows) < 2 or any(s is not soft_prompts[0] for s in soft_prompts):
        return 0
    n = min(len(r) for r in rows) - 1
    first = rows[0]
    for j in range(max(n, 0)):
        if any(r[j] != first[j] for r in rows):
            return j
    return max(n, 0)


def _run(model, keep_hidden: bool, adapter_names, **inputs):
    """(last hidden states (batch, seq, dim) or None, fp32 logits at the last position, cache)."""
    from tunekit.model import decoder_and_head

    if keep_hidden:
        decoder, head = decoder_and_head(model)
        out = decoder(use_cache=True, **inputs)
        hidden = out.last_hidden_state
        return hidden, head(hidden[:, -1].to(head.weight.dtype)).float(), out.past_key_values
    out = model(use_cache=True, logits_to_keep=1, **inputs, **_peft_kwargs(adapter_names))
    return None, out.logits[:, -1].float(), out.past_key_values


@torch.no_grad()
def prefill(model: nn.Module, rows: Sequence[Sequence[int]], soft_prompts: Optional[Sequence[Optional[torch.Tensor]]] = None,
            adapter_names: Optional[list[str]] = None, keep_hidden: bool = False, share_prefix: bool = True) -> Prefix:
    """Run the prompts once. rows: token ids per row; soft_prompts: per row None or (N_i, dim).

    keep_hidden runs the decoder and the output head apart (as training does) and keeps the last
    hidden states of every prompt position for scoring; otherwise the model's own forward runs,
    which is what carries peft's per-row adapter_names.

    A prefix all rows share (>= MIN_SHARED tokens, same soft prompt, no per-row adapters) runs
    once at batch 1; its cache is repeated over the batch and only the rows' own tokens run,
    left-padded after it (the padding is masked, positions continue from the prefix):

        row i:  shared prefix (positions 0..W0-1) | pad ... | own tokens (positions W0, W0+1, ...)
    """
    soft_prompts = list(soft_prompts) if soft_prompts is not None else [None] * len(rows)
    if adapter_names is not None and len(adapter_names) != len(rows):
        raise TunekitError(f"generate: {len(rows)} prompts but {len(adapter_names)} adapter names")
    if keep_hidden and adapter_names:
        raise TunekitError("generate: scoring runs one adapter per batch, not per-row adapters")
    shared = shared_prefix_len(rows, soft_prompts) if share_prefix and not adapter_names else 0
    if shared < MIN_SHARED:
        inputs, mask, positions = _left_pad(model, rows, soft_prompts)
        hidden, last, cache = _run(model, keep_hidden, adapter_names, inputs_embeds=inputs, attention_mask=mask,
                                   position_ids=positions)
        return Prefix(cache, mask, positions[:, -1:] + 1, last, hidden, adapter_names)
    batch = len(rows)
    pre_in, pre_mask, pre_pos = _left_pad(model, [rows[0][:shared]], soft_prompts[:1])  # (1, W0, dim)
    pre_hidden, _, cache = _run(model, keep_hidden, None, inputs_embeds=pre_in, attention_mask=pre_mask,
                                position_ids=pre_pos)
    cache.batch_repeat_interleave(batch)
    width0 = pre_in.shape[1]
    own_in, own_mask, _ = _left_pad(model, [r[shared:] for r in rows], [None] * batch)
    mask = torch.cat([pre_mask.expand(batch, -1), own_mask], dim=1)
    positions = width0 + (own_mask.cumsum(-1) - 1).clamp(min=0)
    hidden, last, cache = _run(model, keep_hidden, None, inputs_embeds=own_in, attention_mask=mask,
                               position_ids=positions, past_key_values=cache)
    if keep_hidden:
        hidden = torch.cat([pre_hidden.expand(batch, -1, -1), hidden], dim=1)  # (batch, W0 + own width, dim)
    return Prefix(cache, mask, positions[:, -1:] + 1, last, hidden, adapter_names, shared, width0)


def argmax_token(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(-1)


@torch.no_grad()
def greedy(model: nn.Module, prefix: Prefix, max_new_tokens: int, stop_ids: Sequence[int], pad_id: int,
           on_token: Optional[Callable[[list[int]], None]] = None,
           pick: Callable[[torch.Tensor], torch.Tensor] = argmax_token) -> list[list[int]]:
    """Decode from a prefix (extending its cache in place). Returns each row's new token ids up to
    and including its first stop token. on_token(tokens of this step, one per row) streams them;
    pick(logits (batch, vocab)) -> (batch,) chooses the next token (argmax: greedy)."""
    if max_new_tokens <= 0:
        raise TunekitError(f"generate: max_new_tokens must be > 0, got {max_new_tokens}")
    logits, cache, mask, pos = prefix.last_logits, prefix.cache, prefix.mask, prefix.next_pos
    batch, device = mask.shape[0], mask.device
    stop = torch.tensor(sorted(set(stop_ids)), device=device)
    new, done = [], torch.zeros(batch, dtype=torch.bool, device=device)
    for step in range(max_new_tokens):
        token = pick(logits)
        token = torch.where(done, torch.full_like(token, pad_id), token)  # (batch,)
        new.append(token)
        if on_token is not None:
            on_token(token.tolist())
        done |= torch.isin(token, stop)
        if done.all() or step == max_new_tokens - 1:
            break
        mask = torch.cat([mask, mask.new_ones(batch, 1)], dim=1)
        out = model(input_ids=token[:, None], attention_mask=mask, position_ids=pos, past_key_values=cache,
                    use_cache=True, **_peft_kwargs(prefix.adapter_names))
        pos = pos + 1
        logits, cache = out.logits[:, -1].float(), out.past_key_values
    stop_set, result = set(stop_ids), []
    for row in torch.stack(new, dim=1).tolist():
        cut = next((j + 1 for j, t in enumerate(row) if t in stop_set), len(row))
        result.append(row[:cut])
    return result


@torch.no_grad()
def score_continuations(model: nn.Module, prefix: Prefix, continuations: Sequence[Sequence[Sequence[int]]],
                        pad_id: int = 0) -> torch.Tensor:
    """log p(continuation | prompt), summed over its tokens, for C continuations of every row.

    continuations[i][c]: non-empty token ids (the same C for every row). The prompt pass is
    shared: its cache is copied and repeated C times, and only the continuation tokens run.
    Returns (batch, C) fp32. The prefix (its cache included) is left as it was.
    """
    from tunekit.model import decoder_and_head

    batch = prefix.mask.shape[0]
    if len(continuations) != batch or len({len(c) for c in continuations}) != 1:
        raise TunekitError("score: give the same number of continuations for every row of the batch")
    n_cont = len(continuations[0])
    flat = [list(c) for row in continuations for c in row]
    if any(not c for c in flat):
        raise TunekitError("score: an empty continuation")
    device = prefix.mask.device
    lengths = torch.tensor([len(c) for c in flat], device=device)
    width = int(lengths.max())
    tokens = torch.full((len(flat), width), pad_id, dtype=torch.long, device=device)
    for i, c in enumerate(flat):
        tokens[i, :len(c)] = torch.tensor(c, device=device)
    first = F.log_softmax(prefix.last_logits, dim=-1).repeat_interleave(n_cont, 0)  # (batch * C, vocab)
    total = first.gather(1, tokens[:, :1]).squeeze(1)  # (batch * C,)
    if width > 1:
        # Input position j predicts token j + 1; positions past a continuation's end are masked keys
        # (they come after every real position, so they change nothing that is read).
        inputs = tokens[:, :-1]
        valid = torch.arange(width - 1, device=device)[None] < (lengths - 1)[:, None]  # (batch * C, width - 1)
        cache = copy.deepcopy(prefix.cache)
        cache.batch_repeat_interleave(n_cont)
        mask = torch.cat([prefix.mask.repeat_interleave(n_cont, 0), valid.long()], dim=1)
        pos = prefix.next_pos.repeat_interleave(n_cont, 0) + torch.arange(width - 1, device=device)[None]
        decoder, head = decoder_and_head(model)
        hidden = decoder(input_ids=inputs, attention_mask=mask, position_ids=pos, past_key_values=cache,
                         use_cache=True).last_hidden_state  # (batch * C, width - 1, dim)
        logits = head(hidden[valid].to(head.weight.dtype)).float()  # (n, vocab)
        logp = -F.cross_entropy(logits, tokens[:, 1:][valid], reduction="none")
        owner = torch.arange(len(flat), device=device)[:, None].expand_as(valid)[valid]
        total = total.index_add(0, owner, logp)
    return total.view(batch, n_cont)


@torch.no_grad()
def generate_ids(model: nn.Module, rows: Sequence[Sequence[int]], soft_prompts: Sequence[Optional[torch.Tensor]],
                 max_new_tokens: int, stop_ids: Sequence[int], pad_id: int,
                 adapter_names: Optional[list[str]] = None) -> list[list[int]]:
    """Greedy decoding of a left-padded batch; row i with soft_prompts[i] ((N_i, dim) or None) and,
    over a peft model with several LoRA adapters, adapter_names[i] ("__base__": no adapter).
    Returns the new token ids of each row, up to and including its first stop token."""
    if len(rows) != len(soft_prompts):
        raise TunekitError(f"generate: {len(rows)} prompts but {len(soft_prompts)} soft prompts")
    if max_new_tokens <= 0:
        raise TunekitError(f"generate: max_new_tokens must be > 0, got {max_new_tokens}")
    prefix = prefill(model, rows, soft_prompts, adapter_names)
    return greedy(model, prefix, max_new_tokens, stop_ids, pad_id)


def check_context(lm: nn.Module, rows: Sequence[Sequence[int]], soft_prompts: Sequence[Optional[torch.Tensor]],
                  max_new_tokens: int, labels: Optional[Sequence[str]] = None) -> None:
    """Refuse a row whose prompt (soft prompt included) plus max_new_tokens outgrows the model's
    positions: past them, rotary positions the model never saw give garbage, not an error."""
    limit = getattr(getattr(lm, "config", None), "max_position_embeddings", None)
    if not limit:
        return
    for i, (ids, soft) in enumerate(zip(rows, soft_prompts)):
        n = len(ids) + (0 if soft is None else soft.shape[0])
        if n + max_new_tokens > limit:
            label = labels[i] if labels is not None else f"prompt {i + 1}"
            raise TunekitError(f"{label}: the prompt is {n:,} tokens (chat template and soft prompt included), and with "
                               f"--max-new-tokens {max_new_tokens:,} that is more than the model's context of "
                               f"{limit:,} tokens; shorten it or lower --max-new-tokens")


def generate(model: nn.Module, tokenizer, prompts: Sequence[str], soft_prompts: Optional[Sequence[Optional[torch.Tensor]]] = None,
             max_new_tokens: int = 64, chat_template: bool = True, adapter_names: Optional[list[str]] = None,
             labels: Optional[Sequence[str]] = None) -> list[str]:
    """Greedy completions of `prompts` by any trained model (a prompt-tuning model uses its own
    soft prompt); row i conditioned on soft_prompts[i] ((N_i, dim) or None) when given. labels[i]
    names row i in errors (default "prompt i+1")."""
    lm, own_prompt = generation_view(model)
    if soft_prompts is not None and own_prompt is not None:
        raise TunekitError("generate: this model carries its own soft prompt; pass its base to give per-row prompts")
    soft_prompts = list(soft_prompts) if soft_prompts is not None else [own_prompt] * len(prompts)
    if max_new_tokens <= 0:
        raise TunekitError(f"generate: max_new_tokens must be > 0, got {max_new_tokens}")
    if not prompts:
        return []
    rows = encode_prompts(tokenizer, prompts, chat_template)
    check_context(lm, rows, soft_prompts, max_new_tokens, labels)
    was_training = lm.training
    lm.eval()
    try:
        ids = generate_ids(lm, rows, soft_prompts, max_new_tokens,
                           stop_token_ids(lm, tokenizer), pad_token_id(tokenizer), adapter_names)
    finally:
        lm.train(was_training)
    return [tokenizer.decode(row, skip_special_tokens=True) for row in ids]
