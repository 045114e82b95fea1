"""Knowledge-distillation loss: CE on the labels plus a divergence to a teacher, as a sum.

Loss per trained token (Hinton et al. 2015; DistilBERT, Sanh et al. 2019)::

    alpha * CE(student logits at T=1, label) + (1 - alpha) * T**2 * D(teacher, student at T)

where ``D`` is one of

* ``"forward_kl"``: KL(p_t || p_s) = sum_v p_t (log p_t - log p_s)   (mode covering; Hinton's choice)
* ``"reverse_kl"``: KL(p_s || p_t) = sum_v p_s (log p_s - log p_t)   (mode seeking)
* ``"jsd"``: generalized Jensen-Shannon divergence, as in TRL's GKD trainer (Agarwal et al. 2024,
  "On-policy distillation of language models")::

      m = beta * p_t + (1 - beta) * p_s
      JSD_beta = beta * KL(p_t || m) + (1 - beta) * KL(p_s || m)

  beta must lie in the open interval (0, 1); beta = 0.5 is the symmetric JSD (bounded by log 2).
  At the edges this formula tends to 0 (m collapses onto one distribution and the other term's
  weight vanishes), so it carries no signal there. TRL special-cases beta = 0 / 1 as forward /
  reverse KL; we raise ValueError instead and let the caller ask for ``"forward_kl"`` or
  ``"reverse_kl"`` by name, so a value of beta never silently switches the objective.

p_t = softmax(teacher_logits / T), p_s = softmax(student_logits / T). The CE term uses T = 1: it
is the ordinary SFT objective on hard labels, and softening it would only rescale its gradient.
The T**2 factor keeps the divergence's gradient magnitude roughly independent of T (its gradient
w.r.t. the logits scales as 1/T).

Like ``sft_loss``, the losses return (sum over trained tokens, trained token count): the trainer
normalises by the token count of the whole accumulated, all-reduced batch. Position t predicts
token t+1; labels == -100 are not trained. Everything after the logits is computed in fp32 (fp64
inputs stay fp64, which the gradchecks in the tests need). The teacher is a fixed target: no
gradient flows into teacher logits or teacher hidden states.

``chunked_distill_loss`` takes hidden states and head weights instead of logits and processes the
trained rows in chunks, recomputing each chunk's logits in the backward pass, so neither model's
full (tokens, vocab) fp32 logits exist at any time: peak extra memory is O(chunk_size * vocab).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from tunekit.losses.sft import IGNORE

DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """fp32 for fp16/bf16/fp32 inputs; fp64 stays fp64 (gradcheck needs it)."""
    return x if x.dtype == torch.float64 else x.float()


def _log_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    logits = _upcast(logits)
    if temperature != 1.0:
        logits = logits / temperature
    return F.log_softmax(logits, dim=-1)


def _kl_from_log_probs(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per row from log-probabilities: (rows, vocab) x2 -> (rows,)."""
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def forward_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
               temperature: float = 1.0) -> torch.Tensor:
    """KL(p_teacher || p_student) per row. logits: (rows, vocab) each -> (rows,), fp32.

    Both distributions are softened by ``temperature``; the T**2 factor is not applied here.
    """
    return _kl_from_log_probs(_log_probs(teacher_logits, temperature),
                              _log_probs(student_logits, temperature))


def reverse_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
               temperature: float = 1.0) -> torch.Tensor:
    """KL(p_student || p_teacher) per row. logits: (rows, vocab) each -> (rows,), fp32."""
    return _kl_from_log_probs(_log_probs(student_logits, temperature),
                              _log_probs(teacher_logits, temperature))


def _check_beta(beta: float) -> None:
    if not 0.0 < beta < 1.0:
        raise ValueError(
            f"generalized JSD needs beta in the open interval (0, 1), got {beta}; "
            "at beta = 0 or 1 it is identically 0, use divergence='forward_kl' or 'reverse_kl'"
        )


def generalized_jsd(student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float = 0.5,
                    temperature: float = 1.0) -> torch.Tensor:
    """beta * KL(p_t || m) + (1 - beta) * KL(p_s || m), m = beta p_t + (1 - beta) p_s, per row.

    logits: (rows, vocab) each -> (rows,), fp32. beta in (0, 1), else ValueError (see module doc).
    log m is computed as logaddexp(log p_t + log beta, log p_s + log(1 - beta)): forming m in
    probability space and taking its log would underflow for the tail of a 49k vocabulary.
    """
    _check_beta(beta)
    log_pt = _log_probs(teacher_logits, temperature)
    log_ps = _log_probs(student_logits, temperature)
    log_m = torch.logaddexp(log_pt + math.log(beta), log_ps + math.log1p(-beta))
    return beta * _kl_from_log_probs(log_pt, log_m) + (1.0 - beta) * _kl_from_log_probs(log_ps, log_m)


def divergence(student_logits: torch.Tensor, teacher_logits: torch.Tensor, kind: str = "forward_kl",
               beta: float = 0.5, temperature: float = 1.0) -> torch.Tensor:
    """Dispatch on ``kind`` (one of DIVERGENCES). logits: (rows, vocab) each -> (rows,), fp32."""
    if kind == "forward_kl":
        return forward_kl(student_logits, teacher_logits, temperature)
    if kind == "reverse_kl":
        return reverse_kl(student_logits, teacher_logits, temperature)
    if kind == "jsd":
        return generalized_jsd(student_logits, teacher_logits, beta, temperature)
    raise ValueError(f"unknown divergence {kind!r}; expected one of {DIVERGENCES}")


def _check_args(alpha: float, temperature: float, kind: str, beta: float) -> None:
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if not temperature > 0.0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if kind not in DIVERGENCES:
        raise ValueError(f"unknown divergence {kind!r}; expected one of {DIVERGENCES}")
    if kind == "jsd":
        _check_beta(beta)


def _rows_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor | None,
               targets: torch.Tensor, alpha: float, temperature: float, kind: str,
               beta: float) -> torch.Tensor:
    """Summed loss over already-selected rows. logits: (rows, vocab); targets: (rows,).

    The reference formula, differentiated by autograd; the chunked path re-implements it with a
    hand-derived gradient (_chunk_loss_and_grad) and the tests hold the two equal. A term
    whose weight is 0 is skipped (alpha = 1 needs no teacher logits at all).
    """
    total = student_logits.new_zeros((), dtype=_upcast(student_logits).dtype)
    if alpha > 0.0:
        ce = F.cross_entropy(_upcast(student_logits), targets, reduction="sum")
        total = total + alpha * ce
    if alpha < 1.0:
        div = divergence(student_logits, teacher_logits.detach(), kind, beta, temperature).sum()
        total = total + (1.0 - alpha) * temperature**2 * div
    return total


def _trained_mask(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(batch, seq) labels -> (mask over the first seq-1 positions, shifted labels)."""
    shift_labels = labels[:, 1:]
    return shift_labels != IGNORE, shift_labels


def distill_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor,
                 alpha: float, temperature: float, divergence: str = "forward_kl",
                 beta: float = 0.5) -> tuple[torch.Tensor, torch.Tensor]:
    """student_logits, teacher_logits: (batch, seq, vocab); labels: (batch, seq), IGNORE = untrained.

    Position t predicts token t+1 (same shift as sft_loss). Returns (summed loss over trained
    tokens: scalar fp32, number of trained tokens: scalar int64). The teacher logits are detached.
    With alpha = 1 this equals sft_loss. Raises ValueError on mismatched vocab or shapes.
    """
    _check_args(alpha, temperature, divergence, beta)
    if student_logits.shape[-1] != teacher_logits.shape[-1]:
        raise ValueError(f"teacher vocab size {teacher_logits.shape[-1]} != student vocab size "
                         f"{student_logits.shape[-1]}; distillation needs a shared vocabulary")
    if student_logits.shape[:2] != teacher_logits.shape[:2] or student_logits.shape[:2] != labels.shape:
        raise ValueError(f"shape mismatch: student logits {tuple(student_logits.shape)}, teacher logits "
                         f"{tuple(teacher_logits.shape)}, labels {tuple(labels.shape)}")
    mask, shift_labels = _trained_mask(labels)
    # Select trained positions first: only they need the (tokens, vocab) fp32 copies.
    picked_s = student_logits[:, :-1, :][mask]
    picked_t = teacher_logits[:, :-1, :][mask]
    loss_sum = _rows_loss(picked_s, picked_t, shift_labels[mask], alpha, temperature, divergence, beta)
    return loss_sum, mask.sum()


def _head_params(head: nn.Module | torch.Tensor, bias: torch.Tensor | None, who: str):
    """An nn.Linear or a (vocab, hidden) weight (+ optional bias) -> (weight, bias)."""
    if isinstance(head, nn.Linear):
        if bias is not None:
            raise ValueError(f"{who}: pass a bias only with a weight tensor, not with an nn.Linear")
        return head.weight, head.bias
    if isinstance(head, torch.Tensor):
        if head.dim() != 2:
            raise ValueError(f"{who} weight must be (vocab, hidden), got shape {tuple(head.shape)}")
        return head, bias
    # A wrapped head (e.g. a LoRA'd lm_head) computes more than x @ W^T; reading its .weight would
    # silently drop the adapter. The caller should pass the effective (merged) weight instead.
    raise TypeError(f"{who} must be an nn.Linear or a (vocab, hidden) weight tensor, "
                    f"got {type(head).__name__}")


def _rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Row-wise dot product (rows, V) x2 -> (rows,) as a batched matmul: unlike (a * b).sum(-1)
    it does not materialise a (rows, V) product."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(-1)


def _chunk_loss_and_grad(h_s, w_s, b_s, h_t, w_t, b_t, targets, alpha, temperature, kind, beta,
                         want_grad):
    """Loss sum of one chunk of rows and, if want_grad, its gradient w.r.t. the student logits.

    h_s (rows, H_s), h_t (rows, H_t), targets (rows,) -> (scalar, (rows, vocab) fp32 or None).
    The same formula as _rows_loss, but with the gradient derived by hand and buffers reused in
    place: about 3-4 (rows, vocab) fp32 buffers are alive at once, where autograd through
    _rows_loss keeps ~8 (saved log-softmaxes, differences, products, and their grads). With
    q = softmax(z/T), p = softmax(teacher/T), s = z/T, d/dz = (1/T) d/ds and
      forward KL:  dD/ds = q - p
      reverse KL:  dD/ds = q * (log q - log p - D)
      JSD(beta):   dD/ds = q * (u - sum_v q u),  u = (1 - beta) (log q - log m)
      CE (T = 1):  dCE/dz = softmax(z) - onehot(target)
    Checked against autograd through distill_loss by the tests (values, grads, gradcheck).
    """
    z = _upcast(F.linear(h_s, w_s, b_s))
    loss = z.new_zeros(())
    grad = None
    if alpha < 1.0:
        log_p = _log_probs(F.linear(h_t, w_t, b_t), temperature)  # teacher logits die here
        log_q = _log_probs(z, temperature)
        if kind == "forward_kl":
            p = log_p.exp()
            div = _rowdot(p, log_p.sub_(log_q)).sum()
            g = log_q.exp_().sub_(p) if want_grad else None
        elif kind == "reverse_kl":
            q = log_q.exp()
            diff = log_q.sub_(log_p)  # log q - log p, in log_q's buffer
            del log_p
            kl = _rowdot(q, diff).unsqueeze(-1)  # (rows, 1)
            div = kl.sum()
            g = diff.sub_(kl).mul_(q) if want_grad else None
        else:
            log_m = torch.logaddexp(log_p + math.log(beta), log_q + math.log1p(-beta))
            p, q = log_p.exp(), log_q.exp()
            kl_t = _rowdot(p, log_p.sub_(log_m)).sum()
            del p, log_p
            u = log_q.sub_(log_m)  # log q - log m
            del log_m
            div = beta * kl_t + (1.0 - beta) * _rowdot(q, u).sum()
            if want_grad:
                u.mul_(1.0 - beta)
                g = u.sub_(_rowdot(q, u).unsqueeze(-1)).mul_(q)
        loss = loss + (1.0 - alpha) * temperature**2 * div
        if want_grad:
            grad = g.mul_((1.0 - alpha) * temperature)  # T^2 from the loss, 1/T from s = z/T
    if alpha > 0.0:
        log_sm = F.log_softmax(z, dim=-1)
        del z
        rows = torch.arange(log_sm.shape[0], device=log_sm.device)
        loss = loss - alpha * log_sm[rows, targets].sum()
        if want_grad:
            sm = log_sm.exp_()
            sm[rows, targets] -= 1.0
            grad = sm.mul_(alpha) if grad is None else grad.add_(sm, alpha=alpha)
    return loss, grad


class _ChunkedDistill(torch.autograd.Function):
    """Sum of the distillation loss over rows, chunk by chunk; backward recomputes the logits.

    Only the inputs (hidden rows, head weights, targets) are saved, never logits, so between
    forward and backward nothing of size (tokens, vocab) is alive, and during either pass at most
    one chunk's (chunk, vocab) working set is.
    """

    @staticmethod
    def forward(ctx, h_s, w_s, b_s, h_t, w_t, b_t, targets, alpha, temperature, kind, beta, chunk_size):
        acc_dtype = torch.float64 if h_s.dtype == torch.float64 else torch.float32
        total = torch.zeros((), dtype=acc_dtype, device=h_s.device)
        for start in range(0, h_s.shape[0], chunk_size):
            stop = start + chunk_size
            loss, _ = _chunk_loss_and_grad(h_s[start:stop], w_s, b_s, h_t[start:stop], w_t, b_t,
                                           targets[start:stop], alpha, temperature, kind, beta, False)
            total += loss
        ctx.save_for_backward(h_s, w_s, b_s, h_t, w_t, b_t, targets)
        ctx.args = (alpha, temperature, kind, beta, chunk_size)
        return total

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        h_s, w_s, b_s, h_t, w_t, b_t, targets = ctx.saved_tensors
        alpha, temperature, kind, beta, chunk_size = ctx.args
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        # Head grads are summed over chunks: accumulate in fp32 so a bf16 head does not round
        # at every chunk, cast once at the end.
        acc_dtype = torch.float64 if w_s.dtype == torch.float64 else torch.float32
        grad_h = torch.empty_like(h_s) if need_h else None
        grad_w = torch.zeros(w_s.shape, dtype=acc_dtype, device=w_s.device) if need_w else None
        grad_b = torch.zeros(b_s.shape, dtype=acc_dtype, device=b_s.device) if need_b else None
        for start in range(0, h_s.shape[0], chunk_size):
            stop = start + chunk_size
            h = h_s[start:stop]
            _, g = _chunk_loss_and_grad(h, w_s, b_s, h_t[start:stop], w_t, b_t, targets[start:stop],
                                        alpha, temperature, kind, beta, True)
            g = g.mul_(grad_out).to(w_s.dtype)  # (rows, vocab): d loss / d student logits
            if need_h:
                grad_h[start:stop] = g @ w_s
            if need_w:
                grad_w += g.T @ h
            if need_b:
                grad_b += g.sum(0)
            del g  # before the next chunk allocates its buffers
        if need_w:
            grad_w = grad_w.to(w_s.dtype)
        if need_b:
            grad_b = grad_b.to(b_s.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None, None, None, None, None, None


def chunked_distill_loss(student_hidden: torch.Tensor, student_head: nn.Module | torch.Tensor,
                         teacher_hidden: torch.Tensor, teacher_head: nn.Module | torch.Tensor,
                         labels: torch.Tensor, alpha: float, temperature: float,
                         divergence: str = "forward_kl", beta: float = 0.5, chunk_size: int = 1024,
                         *, student_bias: torch.Tensor | None = None,
                         teacher_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """distill_loss computed from final hidden states, ``chunk_size`` trained tokens at a time.

    student_hidden: (batch, seq, H_s); student_head: nn.Linear or weight (vocab, H_s) [+ student_bias
    (vocab,)]; teacher_hidden: (batch, seq, H_t); teacher_head: nn.Linear or weight (vocab, H_t)
    [+ teacher_bias]; labels: (batch, seq) with IGNORE on untrained positions.

    Trained positions are selected first (shift + mask), then logits are formed per chunk of rows
    and recomputed in backward, so peak extra memory is O(chunk_size * vocab), not
    O(tokens * vocab). Gradients flow to student_hidden and to the student head weight/bias when
    they require grad (a frozen head gets none, and none is computed); the teacher gets none.
    A tied lm_head is the caller's business: pass the tied weight. Returns (loss sum: scalar
    fp32, trained token count: scalar int64), equal to distill_loss on the full logits.
    """
    _check_args(alpha, temperature, divergence, beta)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    w_s, b_s = _head_params(student_head, student_bias, "student_head")
    w_t, b_t = _head_params(teacher_head, teacher_bias, "teacher_head")
    if w_s.shape[0] != w_t.shape[0]:
        raise ValueError(f"teacher vocab size {w_t.shape[0]} != student vocab size {w_s.shape[0]}; "
                         "distillation needs a shared vocabulary")
    if student_hidden.shape[-1] != w_s.shape[1] or teacher_hidden.shape[-1] != w_t.shape[1]:
        raise ValueError(f"hidden size mismatch: student hidden {student_hidden.shape[-1]} vs head "
                         f"{w_s.shape[1]}, teacher hidden {teacher_hidden.shape[-1]} vs head {w_t.shape[1]}")
    if student_hidden.shape[:2] != labels.shape or teacher_hidden.shape[:2] != labels.shape:
        raise ValueError(f"shape mismatch: student hidden {tuple(student_hidden.shape)}, teacher hidden "
                         f"{tuple(teacher_hidden.shape)}, labels {tuple(labels.shape)}")
    mask, shift_labels = _trained_mask(labels)
    h_s = student_hidden[:, :-1, :][mask]  # (tokens, H_s); autograd scatters the grad back
    h_t = teacher_hidden[:, :-1, :][mask].detach()
    loss_sum = _ChunkedDistill.apply(h_s, w_s, b_s, h_t, w_t.detach(),
                                     b_t.detach() if b_t is not None else None, shift_labels[mask],
                                     alpha, temperature, divergence, beta, chunk_size)
    return loss_sum, mask.sum()
