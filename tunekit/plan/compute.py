"""FLOPs of one optimizer step (per rank), counted the way tunekit computes it.

Matmuls cost 2 FLOPs per multiply-add. The frozen base needs gradients with respect to its
inputs only (one more pass of its matmuls) and never with respect to its weights; trainable
weights cost one more pass for their own gradients. Gradient checkpointing recomputes the
decoder's forward once more during backward: 4N -> 6N per token for a frozen base (N = matmul
parameters), which is why a run that fits without it computes a third less.

Attention counts the full (seq x seq) score and value products (4 * seq * q_dim per position
and block, forward); a causal kernel may skip up to half of them. The head runs only on trained
positions (forward, and the input-gradient pass); distillation recomputes both heads' logits in
its backward pass, chunk by chunk.
"""

from __future__ import annotations

from tunekit.plan.memory import TrainSetup, positions, trained_positions, trainable_tensors
from tunekit.plan.shape import PROJECTIONS, ModelShape


def _decoder_forward(shape: ModelShape, rows: int, seq: int, lora_r: int = 0, lora_targets=()) -> tuple[float, float]:
    """(forward FLOPs of the frozen decoder, of the LoRA branches) for (rows, seq) positions."""
    T = rows * seq
    linear = 2 * T * shape.num_layers * sum(i * o for p in PROJECTIONS for i, o in [shape.projection(p)])
    attention = 4 * T * seq * shape.q_dim * shape.num_layers
    lora = 2 * T * shape.num_layers * sum(lora_r * (i + o) for p in lora_targets for i, o in [shape.projection(p)])
    return linear + attention, lora


def step_flops(shape: ModelShape, st: TrainSetup) -> dict:
    """FLOPs of one optimizer step on one rank: grad_accum worst-case micro-batches."""
    rows, seq = positions(st)
    T, n, V, d = rows * seq, trained_positions(st), shape.vocab_size, shape.hidden_size
    lora_targets = st.lora_targets if st.method == "lora" else ()
    base, lora = _decoder_forward(shape, rows, seq, st.lora_r, lora_targets)
    forward = base + lora
    backward = base + 2 * lora  # input grads through everything, weight grads of the LoRA branches
    if st.method == "full":
        backward += base  # every weight trains
    elif st.method == "adapter":
        per = 2 * T * 2 * d * st.adapter_bottleneck * len(st.adapter_sublayers) * shape.num_layers
        forward, backward = forward + per, backward + 2 * per
    recompute = forward if st.gradient_checkpointing else 0
    if st.teacher is None:
        head = 2 * n * d * V * 2  # logits forward + grad w.r.t. the hidden rows
    else:
        t = st.teacher
        t_base, _ = _decoder_forward(t, rows, seq)
        heads = 2 * n * V * (d + t.hidden_size)
        head = t_base + heads + heads + 2 * n * d * V  # teacher, both heads fwd, recomputed in bwd, grad
    per_micro = forward + backward + recompute + head
    total = per_micro * st.grad_accum
    return {"forward": forward * st.grad_accum, "backward": backward * st.grad_accum,
            "recompute": recompute * st.grad_accum, "head and loss": head * st.grad_accum, "total": total,
            "tokens": T * st.grad_accum, "trainable_params": sum(trainable_tensors(shape, st))}
