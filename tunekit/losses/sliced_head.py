"""Cross-entropy against an output head held in vocabulary slices, never whole: FSDP's frozen head.

Under FSDP an untied head is a unit of its own, each rank holding a slice of its vocabulary rows.
Gathering it whole for the loss holds, for a moment, the all-gather's buffer and the gathered
weight: twice the head (Llama-3-8B: 2 x 1.0 GiB on every rank), more than a decoder layer. Here the
slices come one at a time instead (each rank broadcasts its own in turn), and the loss is
accumulated over them as FlashAttention accumulates attention over key blocks (Dao et al. 2022):
per row a running maximum m and sum s of exp(z - m), rescaled when m grows, and, for the gradient,
a running sum of exp(z - m) W_slice, likewise rescaled. After the last slice

    loss_i = m_i + log s_i - z_i[target_i]
    d loss_i / d row_i = (sum_v softmax_iv W_v) - W_target_i = acc_i / s_i - W_target_i

which is what `tunekit.losses.sft.linear_cross_entropy` computes from the whole head, with the same
two head-sized matmuls per row (logits, gradient). A rank then holds one received slice at a time
(the head / ranks) besides its own. The gradient is formed in the forward pass, as there, and the
backward pass only scales it: no slice is needed again. The head must be frozen and without bias
(a trained head runs through FSDP's own gather; see tunekit.losses.sft).

Rounding: exp(z - m) lies in (0, 1] and is cast to the head's dtype before its matmul with the
slice, as linear_cross_entropy casts the softmax; the sums and the accumulator are fp32.
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch
import torch.nn.functional as F

from tunekit.losses.sft import chunk_rows

Slices = Callable[[], Iterator[tuple[int, torch.Tensor]]]  # yields (first vocabulary row, its rows of W)


def online_cross_entropy(rows: torch.Tensor, targets: torch.Tensor, slices: Slices,
                         need_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(summed cross-entropy fp32 scalar, d loss / d rows in rows' dtype or None) of rows (n, d)
    against the head whose vocabulary rows `slices()` yields slice by slice, in any order."""
    per_row, grad = online_row_cross_entropy(rows, targets, slices, need_grad)
    return per_row.sum(), grad


def online_row_cross_entropy(rows: torch.Tensor, targets: torch.Tensor, slices: Slices,
                             need_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(cross-entropy of each row (n,) fp32, d loss_i / d row_i (n, d) in rows' dtype or None): as
    online_cross_entropy, per row (the preference losses weigh each token's log-probability by its
    own sequence's gradient)."""
    n, d = rows.shape
    dev = rows.device
    f = torch.float64 if rows.dtype == torch.float64 else torch.float32  # the sums' dtype (fp64: gradcheck)
    m = torch.full((n,), float("-inf"), dtype=f, device=dev)
    s = torch.zeros(n, dtype=f, device=dev)
    target_logit = torch.zeros(n, dtype=f, device=dev)
    acc = torch.zeros(n, d, dtype=f, device=dev) if need_grad else None
    target_row = torch.zeros(n, d, dtype=f, device=dev) if need_grad else None
    for lo, part in slices():
        rows_here = part.shape[0]
        if rows_here == 0:
            continue
        inside = (targets >= lo) & (targets < lo + rows_here)
        chunk = chunk_rows(rows_here)
        for i in range(0, n, chunk):
            x = rows[i : i + chunk]
            z = F.linear(x, part).to(f)  # (c, rows_here)
            here = inside[i : i + chunk].nonzero().squeeze(1)
            local = targets[i : i + chunk][here] - lo
            if here.numel():
                target_logit[i + here] = z[here, local]
                if need_grad:
                    target_row[i + here] = part[local].to(f)
            m_old = m[i : i + chunk]
            m_new = torch.maximum(m_old, z.max(dim=1).values)
            scale = torch.exp(m_old - m_new)  # 0 at the first slice (m_old = -inf)
            e = z.sub_(m_new[:, None]).exp_()  # exp(z - m_new), in place of the logits
            s[i : i + chunk] = s[i : i + chunk] * scale + e.sum(dim=1)
            if need_grad:
                acc[i : i + chunk] = acc[i : i + chunk] * scale[:, None] + (e.to(part.dtype) @ part).to(f)
            m[i : i + chunk] = m_new
    per_row = m + torch.log(s) - target_logit
    grad = (acc / s[:, None] - target_row).to(rows.dtype) if need_grad else None
    return per_row, grad


class _SlicedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, targets, slices: Slices):
        total, grad = online_cross_entropy(rows, targets, slices, ctx.needs_input_grad[0])
        ctx.save_for_backward(grad)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        (grad,) = ctx.saved_tensors
        return (None if grad is None else (grad * grad_total).to(grad.dtype)), None, None


class _SlicedTokenLogps(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, targets, slices: Slices):
        per_row, grad = online_row_cross_entropy(rows, targets, slices, ctx.needs_input_grad[0])
        ctx.save_for_backward(grad)
        return (-per_row).float()

    @staticmethod
    def backward(ctx, grad_out):
        (grad,) = ctx.saved_tensors  # d ce_i / d row_i; log p_i = -ce_i
        if grad is None:
            return None, None, None
        return (grad.float() * -grad_out[:, None]).to(grad.dtype), None, None


def sliced_token_logps(rows: torch.Tensor, targets: torch.Tensor, slices: Slices, dtype: torch.dtype) -> torch.Tensor:
    """(n,) fp32 log-probabilities of `targets` under a frozen head given by `slices` (its dtype
    `dtype`); each row's gradient reaches `rows` scaled by its own incoming gradient."""
    with torch.autocast(rows.device.type, enabled=False):
        return _SlicedTokenLogps.apply(rows.to(dtype), targets, slices)


def sliced_cross_entropy(rows: torch.Tensor, targets: torch.Tensor, slices: Slices, dtype: torch.dtype) -> torch.Tensor:
    """Summed cross-entropy (fp32 scalar) of rows (n, d) against a frozen head given by `slices`
    (its dtype `dtype`); the gradient reaches `rows`."""
    with torch.autocast(rows.device.type, enabled=False):
        return _SlicedCrossEntropy.apply(rows.to(dtype), targets, slices)


# ------------------------------------------------------------------ FSDP: the ranks' slices
def fsdp_row_counts(vocab: int, ranks: int) -> list[int]:
    """Vocabulary rows each rank holds of a parameter FSDP2 shards along dim 0: torch.chunk's cut,
    ceil(vocab / ranks) rows a rank, the last ranks fewer or none."""
    per = -(-vocab // ranks)
    return [max(0, min(per, vocab - r * per)) for r in range(ranks)]


def broadcast_slices(weight) -> Slices | None:
    """The slices of an FSDP-sharded (DTensor, Shard(0) over one mesh dimension) head weight, each
    rank's broadcast in turn to all; None where the weight is not laid out so (the caller gathers)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(weight, DTensor) or weight.device_mesh.ndim != 1 or list(weight.placements) != [Shard(0)]:
        return None
    group = weight.device_mesh.get_group()
    ranks, me = dist.get_world_size(group), dist.get_rank(group)
    counts = fsdp_row_counts(weight.shape[0], ranks)
    local = weight.to_local()
    if local.shape[0] != counts[me]:
        return None
    starts = [sum(counts[:r]) for r in range(ranks)]

    def slices() -> Iterator[tuple[int, torch.Tensor]]:
        buf = torch.empty(max(counts), weight.shape[1], dtype=local.dtype, device=local.device)
        for r in range(ranks):
            if counts[r] == 0:
                continue
            part = local.contiguous() if r == me else buf[: counts[r]]
            dist.broadcast(part, src=dist.get_global_rank(group, r), group=group)
            yield starts[r], part

    return slices


def frozen_head_slices(head) -> Slices | None:
    """broadcast_slices of an FSDP head the loss may take slice by slice: frozen, without bias, laid out
    as FSDP2 shards it; None for any other head (the caller gathers it or calls it)."""
    if head.weight.requires_grad or getattr(head, "bias", None) is not None:
        return None
    return broadcast_slices(head.weight)
