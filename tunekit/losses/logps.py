"""Per-sequence log-probabilities of the trained tokens, from hidden states and the output head in
chunks: what the preference objectives score (tunekit.train.preference).

As in tunekit.losses.sft, the (tokens, vocab) logits never exist for the whole micro-batch: each chunk
of rows is projected by the head, reduced to its tokens' log-probabilities in fp32, and the gradient of
each log-probability with respect to its row, (onehot - softmax) W, is formed right away and kept as one
(tokens, hidden) tensor. The backward pass scales it row by row with the incoming per-token gradient
(which, unlike SFT's, differs per sequence). A trained head's gradient needs that incoming gradient
inside the vocabulary-sized product, so it is recomputed chunk by chunk in the backward pass (one
more head matmul per chunk; only where the head trains). Under FSDP a frozen untied head is never
gathered: its vocabulary slices come from the ranks one at a time (tunekit.losses.sliced_head), as for
the SFT loss.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tunekit.device.rounding import autocast_head
from tunekit.losses.sft import IGNORE, _sharded, chunk_rows


class _LinearLogProbs(torch.autograd.Function):
    """log softmax(rows W^T + b)[targets] per row, (n,) fp32; gradients as autograd gives them."""

    @staticmethod
    def forward(ctx, rows, weight, bias, targets, chunk: int):
        need_rows, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[2]
        out = torch.empty(rows.shape[0], dtype=torch.float32, device=rows.device)
        grad_rows = torch.empty_like(rows) if need_rows else None
        for i in range(0, rows.shape[0], chunk):
            x, t = rows[i : i + chunk], targets[i : i + chunk]
            z = F.linear(x, weight, bias).float()  # (c, V)
            lse = torch.logsumexp(z, dim=-1)
            out[i : i + chunk] = z.gather(1, t[:, None]).squeeze(1) - lse
            if need_rows:
                g = z.sub_(lse[:, None]).exp_().neg_()  # -softmax, in place of the logits
                g[torch.arange(t.shape[0], device=t.device), t] += 1.0  # d logp / d z = onehot - softmax
                grad_rows[i : i + chunk] = g.to(weight.dtype) @ weight
        ctx.save_for_backward(grad_rows, rows if (need_w or need_b) else None, weight, bias, targets)
        ctx.chunk, ctx.need = chunk, (need_rows, need_w, need_b)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        grad_rows, rows, weight, bias, targets = ctx.saved_tensors
        need_rows, need_w, need_b = ctx.need
        g_rows = (grad_rows.float() * grad_out[:, None]).to(grad_rows.dtype) if need_rows else None
        g_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        g_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
        if need_w or need_b:
            for i in range(0, rows.shape[0], ctx.chunk):
                x, t = rows[i : i + ctx.chunk], targets[i : i + ctx.chunk]
                g = torch.softmax(F.linear(x, weight, bias).float(), dim=-1).neg_()
                g[torch.arange(t.shape[0], device=t.device), t] += 1.0
                g.mul_(grad_out[i : i + ctx.chunk, None])
                if need_b:
                    g_b += g.sum(0)
                if need_w:
                    g_w += g.t().to(weight.dtype) @ x
        return (g_rows, None if g_w is None else g_w.to(weight.dtype), None if g_b is None else g_b.to(bias.dtype),
                None, None)


def token_logps(rows: torch.Tensor, head: nn.Module, targets: torch.Tensor) -> torch.Tensor:
    """(n,) fp32 log-probabilities of `targets` under head(rows), chunked (module docstring)."""
    sharded = _sharded(head.weight)
    if sharded:  # FSDP, a frozen head without bias: its vocabulary slices one at a time, never gathered
        from tunekit.losses.sliced_head import frozen_head_slices, sliced_token_logps

        slices = frozen_head_slices(head)
        if slices is not None:
            return sliced_token_logps(rows, targets, slices, head.weight.dtype)
    if sharded and (head.weight.requires_grad or not hasattr(head, "unshard")):  # FSDP, a trained head: unchunked
        return torch.log_softmax(head(rows.to(head.weight.dtype)).float(), -1).gather(1, targets[:, None]).squeeze(1)
    if sharded:  # FSDP, a frozen head not laid out in slices (a bias): gathered for the loss, let go after
        head.unshard()
    try:
        from tunekit.model.vocab import token_rows

        added = token_rows(head)  # a run's added tokens: peft's rebuilt matrix (a full copy), its base's bias
        weight, bias = head.weight, (added[1] if added is not None else head.bias)
        weight, bias = autocast_head(weight, bias, rows.device.type)
        with torch.autocast(rows.device.type, enabled=False):
            return _LinearLogProbs.apply(rows.to(weight.dtype), weight, bias, targets, chunk_rows(weight.shape[0]))
    finally:
        if sharded:
            head.reshard()


def sequence_logps(hidden: torch.Tensor, head: nn.Module, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-prob of each row's trained tokens (batch,) fp32, their count (batch,) int64) from the
    decoder's last hidden states (batch, seq, dim); position t predicts token t + 1."""
    shift = labels[:, 1:]
    mask = shift != IGNORE
    rows, targets = hidden[:, :-1][mask], shift[mask]
    which = torch.arange(labels.shape[0], device=labels.device)[:, None].expand_as(shift)[mask]
    per_token = token_logps(rows, head, targets)
    sums = torch.zeros(labels.shape[0], dtype=torch.float32, device=hidden.device).index_add(0, which, per_token)
    return sums, mask.sum(1)
