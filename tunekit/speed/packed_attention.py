"""Attention for packed rows without a dense mask: each example attends within itself, through
SDPA's fast kernels.

A packed micro-batch is one row of several examples with position_ids restarting at 0 for each
(tunekit.data.batching.collate_packed). Left to itself, transformers turns those restarts into a
(T x T) block-diagonal causal mask: O(T^2) memory per layer's saved activations, and a mask rules
out SDPA's flash kernel on a GPU. Here the row is cut at the restarts and each example runs through
`scaled_dot_product_attention(is_causal=True)` alone, with no mask: the same attention (an example
never sees another; a causal mask within each), the kernels torch picks for plain causal
attention, and O(T) memory. The boundaries come with the batch as host integers
(`packed_lengths`), so no layer reads them from the device.

How it reaches the layers: transformers calls the attention function registered under the
model's `config._attn_implementation`; this module registers `NAME`, and a name without a mask
builder of its own makes transformers pass no mask at all. So it is only right for batches with no
padding and a KV cache: training and evaluation forwards of packed runs. Generation with padded
prompts switches back to the model's own implementation (`plain`). It holds for a whole run, not a
context around the forward, so that a checkpointed block's recomputation in backward attends as
its forward did.

Cost: one SDPA call per example per layer instead of one per row, which on a GPU adds kernel
launches for rows of many short examples (scripts/gpu_check.sh times packed training).
"""

from __future__ import annotations

import contextlib
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

NAME = "tunekit_packed"
_registered = False


def per_example_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
                          scaling: Optional[float] = None, packed_lengths: Optional[Sequence[int]] = None,
                          **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: q (batch, heads, seq, head_dim), k and v (batch, kv_heads,
    seq, head_dim) -> ((batch, seq, heads, head_dim), None).

    packed_lengths: the examples' lengths along the row (batch 1), summing to seq. Without them, the
    row's position_ids say where examples start (read from the device: a caller that did not pass
    the lengths, e.g. a model sharing this config); without either, one causal sequence per row. A
    mask here means a caller that should not be on this path."""
    if attention_mask is not None:
        raise RuntimeError(f"{NAME} attention got a mask: it serves unpadded packed rows only")
    gqa = key.shape[1] != query.shape[1]
    positions = kwargs.get("position_ids")
    if packed_lengths is None and positions is not None and positions.shape[0] == 1:
        packed_lengths = lengths_of(positions[0].tolist())
    lengths = list(packed_lengths) if packed_lengths is not None else [query.shape[2]]
    if sum(lengths) != query.shape[2] or (len(lengths) > 1 and query.shape[0] != 1):
        raise RuntimeError(f"{NAME}: example lengths {lengths[:4]}... do not tile a (1, {query.shape[2]}) row")
    # torch.split, not slicing: backward joins the pieces' gradients in one concatenation, where
    # each slice's backward would write a zero-filled tensor the size of the whole row (n examples:
    # n row-sized fills per q, k and v per layer, the largest host and memory cost on a GPU profile)
    drop = dropout if module.training else 0.0
    outs = [F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=drop, scale=scaling, enable_gqa=gqa)
            for q, k, v in zip(*(t.split(lengths, dim=2) for t in (query, key, value)))]
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Make NAME an attention implementation transformers knows (once per process)."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(NAME, per_example_attention)
        _registered = True


def _configs(model) -> list:
    """Every config object the model's attention layers read _attn_implementation from."""
    seen, out = set(), []
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation") and id(cfg) not in seen:
            seen.add(id(cfg))
            out.append(cfg)
    return out


def use(model) -> str:
    """Switch `model` to per-example attention; returns the implementation it had."""
    register()
    configs = _configs(model)
    before = configs[0]._attn_implementation if configs else "sdpa"
    for cfg in configs:
        cfg._attn_implementation = NAME
    return before


@contextlib.contextmanager
def plain(model, implementation: Optional[str]):
    """Within: `model` attends with `implementation` (its own, for generation with padded prompts
    and a KV cache); back to whatever it had after. A no-op for None."""
    if implementation is None:
        yield
        return
    configs = _configs(model)
    before = [cfg._attn_implementation for cfg in configs]
    for cfg in configs:
        cfg._attn_implementation = implementation
    try:
        yield
    finally:
        for cfg, b in zip(configs, before):
            cfg._attn_implementation = b


def lengths_of(positions: Sequence[int]) -> list[int]:
    """The examples' lengths in a packed row from its position ids (each example restarts at 0)."""
    starts = [i for i, p in enumerate(positions) if p == 0] or [0]
    return [b - a for a, b in zip(starts, starts[1:] + [len(positions)])]
