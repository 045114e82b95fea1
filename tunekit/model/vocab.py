"""Embedding rows for tokens a run adds to its tokenizer (data.chat_template's special tokens).

Sizing: the embeddings (and an untied output head) grow to exactly the tokenizer's length when
the tokenizer outgrows them, and never shrink. No padding rows: every row of the head is a logit
the model can emit, and a row no token stands for would be sampled as an id the tokenizer cannot
decode. Where the base already has spare rows (a vocabulary padded by its authors: Qwen, Llama-3),
the new ids take them and nothing grows.

Initialisation: each new row (input and, untied, output) starts at the mean of the base's rows
that tokens of the tokenizer before the addition stand for: a token the model has never seen
starts as "an average token", whose logit is an average logit, not a random outlier (Hewitt 2021,
"Initializing new word embeddings for pretrained language models").

What trains: those rows only. The method wraps the embeddings (and an untied head) with peft's
trainable tokens (LoraConfig.trainable_token_indices), whose trained rows are saved in the
adapter and written over the base's rows when it loads; the ids are recorded on the model as
NEW_TOKENS_ATTR for the method to read. A reloaded adapter names its ids in its
adapter_config.json, and the base grows the same way before it loads (`grow_for_adapter`). In
training the rows are computed apart from the frozen matrix (`lean_embeddings`, `token_rows`,
below), not through peft's full-size copies of it.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import MethodType
from typing import Optional, Sequence

import torch
import torch.nn as nn

from tunekit import TunekitError

NEW_TOKENS_ATTR = "tunekit_new_token_ids"


def new_token_ids(model: nn.Module) -> tuple[int, ...]:
    """The ids `grow_embeddings` recorded on the model (none: ())."""
    return tuple(getattr(model, NEW_TOKENS_ATTR, ()) or ())


def embedding_rows(model: nn.Module) -> int:
    return model.get_input_embeddings().weight.shape[0]


def head_is_tied(model: nn.Module) -> bool:
    head, inputs = model.get_output_embeddings(), model.get_input_embeddings()
    return head is None or head.weight is inputs.weight


def grow_embeddings(model: nn.Module, vocab_size: int, ids: Sequence[int], known: int) -> Optional[str]:
    """Make room for token ids `ids` (all < vocab_size, the tokenizer's length): resize the embeddings
    to vocab_size where they hold fewer rows, start each new row at the mean of rows [0, known) (the
    tokens the tokenizer had), and record the ids for the method. A line for the log; None where
    there are no ids."""
    if not ids:
        return None
    rows = embedding_rows(model)
    inputs = model.get_input_embeddings()
    if inputs.weight.device.type == "meta":
        raise TunekitError("data.chat_template: the tokens it adds need new embedding rows, which a base streamed "
                           "into FSDP shards cannot grow; train on one device, or give a tokenizer that has them")
    if vocab_size > rows:
        model.resize_token_embeddings(vocab_size, mean_resizing=False)
    weights = [model.get_input_embeddings().weight]
    if not head_is_tied(model):
        weights.append(model.get_output_embeddings().weight)
    index = torch.tensor(sorted(ids), device=weights[0].device)
    with torch.no_grad():
        for w in weights:
            mean = w[:known].float().mean(dim=0)  # (hidden,)
            w.index_copy_(0, index, mean.to(w.dtype).expand(len(index), -1).contiguous())
    object.__setattr__(model, NEW_TOKENS_ATTR, tuple(sorted(ids)))
    grown = f"{rows} -> {embedding_rows(model)} rows" if vocab_size > rows else f"in its {rows} rows (spare ones)"
    head = "tied to the embeddings" if head_is_tied(model) else "untied: its rows too"
    return (f"embeddings: {len(ids)} new token(s) {grown}, each started at the mean of the {known} known rows "
            f"(head {head}); only these rows train")


def peft_token_indices(model: nn.Module):
    """LoraConfig.trainable_token_indices for the recorded ids: the input embeddings' rows, and an
    untied head's too (peft ties a tied head's rows to the embeddings' by itself); None: no ids."""
    ids = list(new_token_ids(model))
    if not ids:
        return None
    if head_is_tied(model):
        return ids
    names = {m: n for n, m in model.named_modules()}
    embed = names[model.get_input_embeddings()].rsplit(".", 1)[-1]
    head = names[model.get_output_embeddings()].rsplit(".", 1)[-1]
    return {embed: ids, head: ids}


def adapter_token_ids(folder: Path) -> tuple[int, ...]:
    """The token ids a peft adapter folder trains (adapter_config.json's trainable_token_indices:
    a list, or one per module); () where it trains none or has no such config."""
    try:
        config = json.loads((Path(folder) / "adapter_config.json").read_text())
    except (OSError, ValueError):
        return ()
    found = config.get("trainable_token_indices") if isinstance(config, dict) else None
    if isinstance(found, dict):
        found = sorted({i for ids in found.values() for i in ids})
    if not found:
        return ()
    if not all(isinstance(i, int) and i >= 0 for i in found):
        raise TunekitError(f"{folder}/adapter_config.json: trainable_token_indices must be token ids, got {found!r:.80}")
    return tuple(sorted(found))


def grow_for_adapter(model: nn.Module, folder: Path, known: Optional[int] = None) -> Optional[str]:
    """Before an adapter with trained token rows loads: grow the base's embeddings to hold its highest
    id (the rows' starting values do not matter: the adapter's rows replace them) and record the
    ids; nothing for an adapter without them."""
    ids = adapter_token_ids(folder)
    if not ids:
        return None
    rows = embedding_rows(model)
    return grow_embeddings(model, max(rows, ids[-1] + 1), ids, min(known or rows, rows))


# ---------------------------------------------------------------- computing with the trained rows
# peft's trainable tokens compute with the whole matrix rebuilt around the trained rows (index_copy)
# on every forward and every read of the head's weight, and their backward forms a full-size
# gradient before it keeps the trained rows' part: 4 to 5 vocabulary x hidden matrices at a step's
# peak (benchmarks/training/new-tokens-memory-2026-11-27.md). Training reads them instead: the
# embeddings look the frozen rows up and put the trained rows in where the ids are new ones
# (`lean_embeddings`), and the loss takes the head as (frozen weight, ids, trained rows)
# (`token_rows`, tunekit.losses.sft). The same numbers (a row is a row), a (new tokens, hidden)
# gradient.


def token_rows(module: nn.Module):
    """(the frozen weight, its bias or None, the trained ids (k,), their trained rows (k, hidden)) of a
    peft trainable-tokens wrapper or layer with one active adapter, neither merged nor switched off;
    None for anything else (a plain layer: its weight is all there is)."""
    layer = getattr(module, "token_adapter", module)
    deltas = getattr(layer, "trainable_tokens_delta", None)
    if deltas is None or getattr(layer, "merged", False) or getattr(layer, "disable_adapters", False):
        return None
    active = list(getattr(layer, "active_adapters", ()))
    if len(active) != 1 or active[0] not in deltas:
        return None
    base = layer.get_base_layer()
    index = torch.tensor(layer.token_indices[active[0]], device=base.weight.device)
    return base.weight, getattr(base, "bias", None), index, deltas[active[0]]


def _lean_forward_adapters(self, x: torch.Tensor, active_adapters, *args, **kwargs) -> torch.Tensor:
    """peft's TrainableTokensLayer.forward_adapters for an Embedding in training, without the copy."""
    rows = token_rows(self)
    if rows is None or list(active_adapters) != list(self.active_adapters) \
            or not isinstance(self.get_base_layer(), nn.Embedding):
        return type(self).forward_adapters(self, x, active_adapters, *args, **kwargs)
    _, _, index, delta = rows
    out = self.get_base_layer()(x)  # the frozen rows, as the base computes them (its scale too)
    match = x.unsqueeze(-1) == index  # (..., k)
    new = delta[match.to(torch.int64).argmax(-1)].to(out.dtype)  # (..., hidden): a gather, not a matrix
    scale = self._get_embed_scale()
    if scale is not None:  # a scaled embedding (Gemma) scales the trained rows as peft does
        new = new * scale.to(new.dtype)
    return torch.where(match.any(-1, keepdim=True), new, out)


def lean_embeddings(model: nn.Module) -> int:
    """Give every peft trainable-tokens layer over an Embedding the lookup above; how many."""
    n = 0
    for m in model.modules():
        if token_rows(m) is not None and m is getattr(m, "token_adapter", m) \
                and isinstance(m.get_base_layer(), nn.Embedding):
            object.__setattr__(m, "forward_adapters", MethodType(_lean_forward_adapters, m))
            n += 1
    return n
