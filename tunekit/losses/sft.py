"""Supervised fine-tuning loss: next-token cross-entropy on response tokens, as a sum.

Returning (sum, count) instead of a mean lets the trainer normalise by the number of trained
tokens in the whole accumulated (and all-reduced) batch. A mean of per-micro-batch means would
weight a token in a short micro-batch more than one in a long micro-batch.

The loss is computed from the decoder's last hidden states and the output head together
(`linear_cross_entropy`), a chunk of rows at a time, so the (tokens, vocab) logits of a whole
micro-batch never exist: on Llama-3-8B (vocabulary 128,256) at 2 x 2048 trained tokens they would be
2.0 GiB in fp32, with two more such buffers in the backward pass. Each chunk's logits are computed
in the head's dtype, upcast to fp32 for the log-sum-exp, and the chunk's gradient with respect to
its rows (and to the head, when it trains) is computed right away, in the forward pass: what is kept
for backward is one (tokens, hidden) gradient, not the logits. The backward pass only scales it by
the incoming gradient (the trainer's 1 / trained tokens). The head's matmuls are the same two per
row as an unchunked loss computes (logits, gradient of the rows), so chunking costs no compute.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tunekit.device.rounding import autocast_head

IGNORE = -100
# Elements of one chunk's (rows, vocab) logits: 2^24 = 64 MiB in fp32, whatever the vocabulary
# (Llama-3's 128,256: 130 rows a chunk; SmolLM2's 49,152: 341). The loss's working set is at most
# 6 bytes per element of a bf16 head (the fp32 logits, turned into the softmax gradient in place,
# beside the bf16 logits before and the gradient's bf16 cast after): ~100 MiB, which no longer
# grows with the trained tokens.
CHUNK_ELEMENTS = 1 << 24


def chunk_rows(vocab: int) -> int:
    """Rows per chunk of the loss for a vocabulary of `vocab` (at least 16: a matmul of fewer rows
    reads the whole head for little work)."""
    return max(16, CHUNK_ELEMENTS // max(vocab, 1))


def select_trained(states: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of `states` (batch, seq, dim) that predict a trained token, and those tokens.

    Position t predicts token t+1. Returns (rows (n, dim), targets (n,)).
    """
    shift_labels = labels[:, 1:]
    mask = shift_labels != IGNORE
    return states[:, :-1][mask], shift_labels[mask]


def sft_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: (batch, seq, vocab); labels: (batch, seq) with IGNORE on untrained positions.

    The reference form (all logits given). Cross-entropy is computed in fp32 whatever the logits'
    dtype: bf16 log-softmax over a 49k vocabulary loses ~2 decimal digits.
    Returns (summed loss: scalar fp32, number of trained tokens: scalar int64).
    """
    rows, targets = select_trained(logits, labels)
    return F.cross_entropy(rows.float(), targets, reduction="sum"), torch.tensor(targets.numel())


class _LinearCrossEntropy(torch.autograd.Function):
    """sum_i CE(rows_i W^T + b, target_i), chunk by chunk; gradients formed in the forward pass.

    rows (n, d) and W (V, d) in the head's compute dtype; bias (V,) or None. Returns an fp32 scalar.
    """

    @staticmethod
    def forward(ctx, rows, weight, bias, targets, chunk: int, index=None, extra=None):
        need_rows, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[2]
        need_extra = extra is not None and ctx.needs_input_grad[6]
        grad_rows = torch.empty_like(rows) if need_rows else None
        acc = torch.float64 if rows.dtype == torch.float64 else torch.float32  # accumulators
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_b else None
        grad_extra = torch.zeros(extra.shape, dtype=acc, device=extra.device) if need_extra else None
        extra_bias = None if bias is None or extra is None else bias[index]
        total = torch.zeros((), dtype=acc, device=rows.device)
        for i in range(0, rows.shape[0], chunk):
            x, t = rows[i : i + chunk], targets[i : i + chunk]
            z = F.linear(x, weight, bias)
            z = z if z.dtype == torch.float64 else z.float()  # (c, V) fp32 (fp64 stays: gradcheck)
            if extra is not None:  # rows `index` of the head are `extra`'s (the run's added tokens)
                z[:, index] = F.linear(x, extra, extra_bias).to(z.dtype)
            lse = torch.logsumexp(z, dim=-1)
            total += (lse - z.gather(1, t[:, None]).squeeze(1)).sum()
            if need_rows or need_w or need_b or need_extra:
                g = z.sub_(lse[:, None]).exp_()  # softmax, in place of the logits
                g[torch.arange(t.shape[0], device=t.device), t] -= 1.0  # d CE / d z = softmax - onehot
                if need_b:
                    grad_b += g.sum(0)
                g = g.to(weight.dtype)
                g_extra = None
                if extra is not None:  # the replaced rows' columns go through `extra`, not `weight`
                    g_extra = g[:, index].clone()
                    g[:, index] = 0
                    if need_extra:
                        grad_extra += g_extra.t() @ x
                if need_rows:
                    grad_rows[i : i + chunk] = g @ weight
                    if g_extra is not None:
                        grad_rows[i : i + chunk] += g_extra @ extra
                if need_w:
                    grad_w += g.t() @ x
        ctx.save_for_backward(grad_rows, grad_w, grad_b, grad_extra)
        ctx.dtypes = (rows.dtype, weight.dtype, None if bias is None else bias.dtype,
                      None if extra is None else extra.dtype)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grads = [None if g is None else (g * grad_total).to(dtype) for g, dtype in zip(ctx.saved_tensors, ctx.dtypes)]
        return (*grads[:3], None, None, None, grads[3])


def linear_cross_entropy(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         targets: torch.Tensor, chunk: int | None = None,
                         replaced: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Summed cross-entropy of head(rows) against targets without forming all logits at once.

    rows (n, d), weight (V, d), bias (V,) or None, targets (n,) -> fp32 scalar. The rows are cast to
    the weight's dtype (the head computes in its own dtype; for a trained fp32 head under autocast,
    the autocast dtype). Gradients flow to rows, weight and bias as autograd would give them.
    replaced=(index (k,), extra (k, d)): the head's rows `index` are `extra`'s instead of `weight`'s
    (a run's added tokens, trained apart from the frozen head: tunekit.model.vocab.token_rows); extra is
    cast to the weight's dtype and gets its gradient, a (k, d) one, never a (V, d) one.
    """
    weight, bias = autocast_head(weight, bias, rows.device.type)
    rows = rows.to(weight.dtype)
    index, extra = replaced if replaced is not None else (None, None)
    if extra is not None:
        extra = extra.to(weight.dtype)
    with torch.autocast(rows.device.type, enabled=False):
        return _LinearCrossEntropy.apply(rows, weight, bias, targets, chunk or chunk_rows(weight.shape[0]), index,
                                         extra)


def sft_loss_from_hidden(hidden: torch.Tensor, head: nn.Module, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss from the decoder's last hidden states (batch, seq, dim) and the output head.

    The head runs only on the positions that predict a trained token (on chat data about a third of
    all positions), chunk by chunk (module docstring).
    """
    from tunekit.model.vocab import token_rows

    rows, targets = select_trained(hidden, labels)
    n = torch.tensor(targets.numel())
    added = token_rows(head)  # a run's added tokens: the frozen head and their trained rows, apart
    if added is not None and not _sharded(added[0]):
        weight, bias, index, extra = added
        return linear_cross_entropy(rows, weight, bias, targets, replaced=(index, extra)), n
    weight = head.weight
    if not _sharded(weight):
        return linear_cross_entropy(rows, weight, getattr(head, "bias", None), targets), n
    # FSDP: an untied head is a unit of its own, its weight a shard outside the module's call. A frozen
    # head's slices come to every rank one at a time (tunekit.losses.sliced_head), never the whole
    # head; where its layout is not the one that expects (a bias, another mesh), it is gathered for
    # the loss and let go after. A trained one (no gradient would reach its shards through a gather
    # by hand) runs through the module's own call, unchunked.
    if head.weight.requires_grad or not hasattr(head, "unshard"):
        return F.cross_entropy(head(rows.to(head.weight.dtype)).float(), targets, reduction="sum"), n
    from tunekit.losses.sliced_head import frozen_head_slices, sliced_cross_entropy

    slices = frozen_head_slices(head)
    if slices is not None:
        return sliced_cross_entropy(rows, targets, slices, head.weight.dtype), n
    head.unshard()
    try:
        return linear_cross_entropy(rows, head.weight, getattr(head, "bias", None), targets), n
    finally:
        head.reshard()


def _sharded(weight: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        return False
    return isinstance(weight, DTensor)
