"""FLOPs of one optimizer step (per rank), counted the way tunekit computes it.

Matmuls cost 2 FLOPs per multiply-add. The frozen base needs gradients with respect to its
inputs only (one more pass of its matmuls) and never with respect to its weights; trainable
weights cost one more pass for their own gradients. Gradient checkpointing recomputes the
decoder's forward once more during backward: 4N -> 6N per token for a frozen base (N = matmul
parameters), which is why a run that fits without it computes a third less.

Attention counts the full (seq x seq) score and value products (4 * seq * q_dim per position
and block, forward); a causal kernel may skip up to half of them. The head runs only on trained
positions (forward, and the input-gradient pass); distillation recomputes both heads' logits in
its backward pass, chunk by chunk. A preference loss with a reference runs one more forward of the
frozen decoder and head per micro-batch (no backward).
"""

from __future__ import annotations

from tunekit.plan.memory import TrainSetup, method_of, plan_terms, positions, trained_positions
from tunekit.plan.shape import PROJECTIONS, ModelShape


def _decoder_forward(shape: ModelShape, rows: int, seq: int) -> int:
    """Forward FLOPs of the frozen decoder for (rows, seq) positions."""
    T = rows * seq
    linear = 2 * T * shape.num_layers * sum(i * o for p in PROJECTIONS for i, o in [shape.projection(p)])
    attention = 4 * T * seq * shape.q_dim * shape.num_layers
    return linear + attention


def step_flops(shape: ModelShape, st: TrainSetup) -> dict:
    """FLOPs of one optimizer step on one rank: grad_accum worst-case micro-batches."""
    terms = plan_terms(shape, st)
    rows, seq = positions(st, terms)
    T, n, V, d = rows * seq, trained_positions(st), shape.vocab_size, shape.hidden_size
    base = _decoder_forward(shape, rows, seq)
    # what the method's layers add (LoRA's branches, adapters' bottlenecks): their forward, and in
    # backward the input gradients through them and their weights' gradients
    forward = base + terms.forward_flops_per_token * T
    backward = base + terms.backward_flops_per_token * T  # input grads through the frozen decoder
    if method_of(st).trains_base:
        backward += base  # every weight trains
    recompute = forward if st.gradient_checkpointing else 0
    if st.teacher is None:
        head = 2 * n * d * V * 2  # logits forward + grad w.r.t. the hidden rows
    else:
        t = st.teacher
        t_base = _decoder_forward(t, rows, seq)
        heads = 2 * n * V * (d + t.hidden_size)
        head = t_base + heads + heads + 2 * n * d * V  # teacher, both heads fwd, recomputed in bwd, grad
    # a preference loss's reference: the same rows through the frozen decoder and head, no backward
    scored = _decoder_forward(shape, rows, seq) + 2 * n * d * V
    reference = scored if st.reference_forward else 0
    kl = st.kl_forwards * scored  # KTO's mismatched rows, through the trained model and the reference
    per_micro = forward + backward + recompute + head + reference + kl
    total = per_micro * st.grad_accum
    return {"forward": forward * st.grad_accum, "backward": backward * st.grad_accum,
            "recompute": recompute * st.grad_accum, "head and loss": head * st.grad_accum,
            **({"reference": reference * st.grad_accum} if reference else {}),
            **({"KTO KL": kl * st.grad_accum} if kl else {}), "total": total,
            "tokens": T * st.grad_accum, "trainable_params": sum(terms.trainable)}
