"""Peak memory of one tunekit training step, term by term, from the model's shape alone.

Every term is a plain function of (ModelShape, TrainSetup, element sizes) and models what
tunekit's trainer actually allocates, not a generic transformer:

* weights: bf16/fp32 base, or NF4 + double quantization (bitsandbytes: 4-bit codes, one 8-bit
  absmax per 64 weights, one fp32 absmax per 256 of those, small per-layer code tables); every
  weight that is not quantized (embeddings, head, norms) stays in the compute dtype (the precision
  policy, tunekit.device.precision), and the head is never quantized.
* trainable parameters, their gradients (fp32, kept across gradient accumulation; with none, not
  yet there in the step's forward phases) and the
  optimizer state: AdamW 2 x fp32; bitsandbytes 8-bit: 2 x uint8 plus an fp32 absmax per 256
  elements for tensors of >= 4096 elements, 32-bit state below that (paged variants allocate the
  same bytes, which CUDA may evict to the host under pressure; on a CPU they are unpaged).
* activations: what autograd keeps for backward, counted per saved tensor in `layer_saved`
  (a walk through one Llama block with the dtypes the trainer produces; the test suite checks
  it against `torch.autograd.graph.saved_tensors_hooks` on real models), or, with gradient
  checkpointing, each block's input plus one block recomputed during backward.
* loss and head: the head runs only on trained positions, a chunk of rows at a time
  (tunekit.losses.sft): one chunk's logits in the head's dtype and in fp32, the gradient of the
  rows kept for backward; nothing of size (trained tokens, vocab). Distillation computes both
  heads `chunk_size` rows at a time (about five (chunk, vocab) fp32 buffers, measured in
  benchmarks/training/distill-memory-cpu.json) and keeps the teacher's last hidden states.

What the method adds (its trainable tensors, what its layers keep at each site of the block walk,
which activations it makes need gradients) comes from the method itself through
`Method.plan_terms` (tunekit.plan.terms); nothing here branches on a method's name.

The plan is for the worst micro-batch: `micro_batch_size` rows of `data.max_seq_len` tokens,
every position trained, padding present (so attention gets an explicit mask, as it does for
every batch with rows of unequal length). Shorter data uses less.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Optional

from tunekit import TunekitError
from tunekit.plan.shape import PROJECTIONS, ModelShape
from tunekit.plan.terms import PlanTerms, Site

ATTN = ("q_proj", "k_proj", "v_proj")
# bitsandbytes: NF4 blocks of 64 weights, their absmax 8-bit quantized in blocks of 256.
NF4_BLOCK, NF4_ABSMAX_BLOCK = 64, 256
# bitsandbytes 8-bit optimizers: tensors smaller than this keep 32-bit state; blockwise absmax per 256.
BNB_MIN_8BIT_SIZE, BNB_STATE_BLOCK = 4096, 256
# Terms that live across steps (the rest of a step's peak is allocated and freed within it).
# FSDP's gathered blocks are not among them: every step gathers them and frees them again (the root
# unit too, once its backward ends), so they are part of what a step adds, as measured on two gloo
# ranks (benchmarks/plan/plan-cpu-fsdp.md).
STATIC_TERMS = ("base weights", "trainable parameters", "optimizer state", "teacher weights",
                "weight copies (compute dtype)")
# Terms FSDP splits over the ranks (the rest: activations, the loss, the gathered weights, is whole
# on every rank; a 4-bit base's quantization state, inside "base weights", too).
SHARDED_TERMS = ("base weights", "trainable parameters", "gradients", "optimizer state", "teacher weights")
# The phases of a step that run before its backward: with trainer.grad_accum=1 no gradient exists in them.
FORWARD_PHASES = ("loss forward", "teacher forward", "reference forward", "KL forwards")
# The distillation chunk's working set in (chunk, vocab) fp32 buffers (5.1-5.2 measured).
DISTILL_CHUNK_BUFFERS = 5.25


@dataclass(frozen=True, init=False)
class TrainSetup:
    """What a training configuration decides about memory, as plain values (see plan.inputs).

    `options` are the method's own planner inputs (its `Method.plan_options_type`, e.g. a LoRA
    rank and targets; a dict of them, or None for the method's defaults). The keywords of each
    method's `plan_aliases` (lora_r=8, adapter_sublayers=("mlp",), num_virtual_tokens=5, ...) set
    the option they name when the setup's method is theirs, and are ignored for another method.
    """

    method: str = "lora"  # a registered method (tunekit.methods)
    options: Any = None
    quantize: str = "none"  # none | nf4
    compute_bytes: int = 2  # 2 = bf16 or fp16, 4 = fp32 (model.dtype resolved for the device)
    gradient_checkpointing: bool = False
    micro_batch_size: int = 8
    grad_accum: int = 2
    seq_len: int = 512
    packing: bool = False
    # packed rows attend per example with no (T x T) mask (tunekit.speed.packed_attention); False
    # where the run keeps transformers' block-diagonal mask (kernels.compile, prompt tuning)
    packed_attention: bool = False
    optimizer: str = "adamw"
    # distillation (objective=distill): the frozen teacher and the chunked loss
    teacher: Optional[ModelShape] = None
    teacher_quantize: str = "none"
    distill_chunk: int = 1024
    # preference tuning (objective=preference): rows the model runs per example of the micro-batch
    # (2: a pair's chosen and rejected sides go through one forward; 1: SFT, KTO's unpaired rows),
    # and whether each step also runs the reference, a no-grad forward of the same rows with the
    # trained part switched off (losses with a reference, unless computed once before training)
    rows_per_example: int = 1
    reference_forward: bool = False
    # KTO's KL estimate (preference.kto_kl=batch): no-grad forwards over the micro-batch's mismatched
    # rows (2: the trained model's and the reference's), at the same point as the reference's
    kl_forwards: int = 0
    dropout_mask_bytes: int = 4  # torch's dropout keeps a bool mask on CUDA, fp32 noise on a CPU
    # What the method's layers decide on the device (Method.plan_setup; LoRA's rules in
    # tunekit.methods.lora.backend): a copy of the 4-bit base's wrapped weights kept dequantized in the
    # compute dtype (tunekit.methods.lora.compute_dtype.cache_dense, where tunekit.device.facts.dense_cache_fits
    # allows it) ...
    dense_cache_bytes: int = 0
    # ... LoRA over a 4-bit base computed in the compute dtype (tunekit.methods.lora.compute_dtype or the fused
    # kernel) rather than peft's fp32 branch, which keeps an fp32 copy of every input ...
    lora_compute: bool = False
    # ... through the fused Triton kernel (CUDA): it dequantizes the base weight tile by tile in
    # registers, forward and backward, so no dequantized weight exists
    fused_kernel: bool = False
    # with gradient checkpointing on a GPU: the blocks' saved inputs live in pinned host memory
    # (tunekit.device.facts.offload_activations), not on the device
    offload_activations: bool = False
    # FSDP on a CPU: every frozen projection of a block is a unit of its own, gathered alone
    # (tunekit.device.facts.fsdp_projection_units), not the whole block
    fsdp_projection_units: bool = False

    def __init__(self, method: str = "lora", options: Any = None, **values):
        planner = method_of_name(method)
        kind = getattr(planner, "plan_options_type", NoPlanOptions)
        if isinstance(options, dict):
            options = kind(**options)
        elif not isinstance(options, kind):  # None, or another method's (replace(setup, method=...))
            options = kind()
        aliases, own = getattr(planner, "plan_aliases", {}), {}
        for key in [k for k in values if k not in _SETUP_FIELDS]:
            if not any(key in cls.plan_aliases for cls in _PLANNERS.values()):
                raise TypeError(f"TrainSetup() got an unexpected keyword argument {key!r}")
            value = values.pop(key)
            if key in aliases:
                own[aliases[key]] = value
        options = dataclasses.replace(options, **own) if own else options
        # lists as tuples: a setup is hashable and compares by value
        listed = {f.name: tuple(getattr(options, f.name)) for f in dataclasses.fields(options)
                  if isinstance(getattr(options, f.name), list)}
        options = dataclasses.replace(options, **listed) if listed else options
        object.__setattr__(self, "method", method)
        object.__setattr__(self, "options", options)
        for f in dataclasses.fields(self):
            if f.name not in ("method", "options"):
                object.__setattr__(self, f.name, values.pop(f.name, f.default))
        if values:
            raise TypeError(f"TrainSetup() got an unexpected keyword argument {next(iter(values))!r}")


_SETUP_FIELDS = {f.name for f in dataclasses.fields(TrainSetup)}


# The methods the planner knows, by name: each method registers its planning hooks here when it
# registers itself (tunekit.methods.registry.register), so that the planner takes what it needs
# from the methods without importing them.
_PLANNERS: dict = {}


@dataclass(frozen=True)
class NoPlanOptions:
    """The planner options of a method that declares none."""


def register_planner(name: str, cls) -> None:
    """`cls`: a method class with `plan_terms(shape, setup)`, `plan_options_type`, `plan_aliases`,
    `trains_base` and `plan_label(options)` (tunekit.methods.registry.Method)."""
    _PLANNERS[name] = cls


def method_of_name(name: str):
    if name not in _PLANNERS:
        raise TunekitError(f"method.name: the planner knows no method {name!r} (known: {sorted(_PLANNERS)}); "
                           "methods register with the planner when tunekit.methods is imported")
    return _PLANNERS[name]()


def method_of(st: TrainSetup):
    return method_of_name(st.method)


def plan_terms(shape: ModelShape, st: TrainSetup) -> PlanTerms:
    """What the setup's method adds to the plan (tunekit.plan.terms). A method without planning
    hooks of its own still trains: its plan is the frozen base's, with nothing for what the method
    adds (`estimated_terms`), and `tunekit plan` and the run's log say so."""
    method = method_of(st)
    try:
        return method.plan_terms(shape, st)
    except NotImplementedError:
        return ESTIMATED_TERMS


# A method without plan_terms: no trained tensors, nothing saved, no extra FLOPs. The base, the
# activations and the loss are the planner's own and stay exact; what the method adds is missing,
# and is usually small (a PEFT method trains under 1% of the weights).
ESTIMATED_TERMS = PlanTerms(estimated=True)


def estimated(shape: ModelShape, st: TrainSetup) -> bool:
    """Whether the plan of `st` leaves out what its method adds (no planning hooks of its own)."""
    return plan_terms(shape, st).estimated


@dataclass
class Memory:
    """The terms of one rank's peak, in bytes, and the phase of the step where the peak falls."""

    terms: dict = field(default_factory=dict)
    phase: str = ""
    host: dict = field(default_factory=dict)  # bytes kept in host memory instead (offloaded activations)
    # FSDP: the terms that are this rank's share, split over the ranks (the others are whole on every rank)
    sharded: tuple = ()

    @property
    def total(self) -> int:
        return int(sum(self.terms.values()))


# ------------------------------------------------------------------ parameters
def nf4_bytes(numel: int) -> int:
    """Storage of one NF4 + double-quant weight: packed codes, 8-bit absmax, their fp32 absmax,
    plus the per-layer constants (16-entry NF4 table, 256-entry absmax code table, offset)."""
    blocks = math.ceil(numel / NF4_BLOCK)
    return numel // 2 + numel % 2 + blocks + 4 * math.ceil(blocks / NF4_ABSMAX_BLOCK) + 4 * (16 + 256 + 1)


def nf4_state_bytes(numel: int) -> int:
    """The part of `nf4_bytes` that is quantization state (absmax, their absmax, code tables): a module
    attribute, not a parameter, so FSDP leaves it whole on every rank (tunekit.train.fsdp)."""
    return nf4_bytes(numel) - (numel // 2 + numel % 2)


def quant_state_bytes(shape: ModelShape, quantize: str) -> int:
    """Quantization state of the whole base (0 unless NF4): what FSDP replicates instead of sharding."""
    if quantize != "nf4":
        return 0
    return shape.num_layers * sum(nf4_state_bytes(i * o) for n in PROJECTIONS for i, o in [shape.projection(n)])


def base_weight_bytes(shape: ModelShape, quantize: str, compute_bytes: int) -> int:
    """The frozen base as loaded. NF4: the seven projections of every block in 4 bits; the rest
    (embeddings, head, norms, biases) in the compute dtype."""
    if quantize != "nf4":
        return shape.total_params * compute_bytes
    rest = compute_bytes
    linear = sum(nf4_bytes(i * o) + (o * rest if shape.projection_bias(n) else 0)
                 for n in PROJECTIONS for i, o in [shape.projection(n)])
    other = shape.embedding_params + shape.head_params + shape.hidden_size + shape.num_layers * shape.norm_params_per_layer
    return shape.num_layers * linear + other * rest


def trainable_tensors(shape: ModelShape, st: TrainSetup) -> list[int]:
    """Element counts of the trainable tensors (what the optimizer sees, tensor by tensor)."""
    return list(plan_terms(shape, st).trainable)


def optimizer_state_bytes(tensors: list[int], optimizer: str) -> int:
    if "8bit" not in optimizer:
        return sum(8 * n for n in tensors)  # exp_avg + exp_avg_sq in fp32
    total = 0
    for n in tensors:
        if n >= BNB_MIN_8BIT_SIZE:
            total += 2 * n + 2 * 4 * math.ceil(n / BNB_STATE_BLOCK)
        else:
            total += 8 * n
    return total


# ------------------------------------------------------------------ activations
def layer_saved(shape: ModelShape, st: TrainSetup, rows: int, seq: int, input_grad: bool = True,
                terms: Optional[PlanTerms] = None) -> int:
    """Bytes one decoder block keeps for backward for a micro-batch of (rows, seq) positions.

    A walk through transformers' Llama block as tunekit trains it. `input_grad`: whether the
    block's input requires grad (every block but the first, unless something upstream trains).
    The residual stream is in the compute dtype (a 4-bit base's Linear4bit returns its input's
    dtype), or fp32 where a full fine-tune's fp32 weights carry it (`activation_dtype_bytes`); the
    projections' outputs, and what attention and the MLP keep of them, are in the compute dtype
    either way (under autocast the matmuls compute on half-precision copies).
    What the method's layers keep comes from its `PlanTerms.saves`, site by site; which
    projections' outputs need a gradient because of it, from `grad_outputs`.
    """
    terms = terms or plan_terms(shape, st)
    d, m, q, kv, h = shape.hidden_size, shape.intermediate_size, shape.q_dim, shape.kv_dim, shape.num_heads
    e = activation_dtype_bytes(st)
    mm = st.compute_bytes  # the matmuls' outputs (autocast's dtype over fp32 weights)
    T = rows * seq

    def method(site: str, grad: bool, saved: bool = False) -> int:
        return terms.saves(Site(site, T, e, grad, saved))

    trains = terms.grad_outputs.__contains__
    per_token = 0  # bytes per position of the frozen walk
    # input RMSNorm keeps its fp32 input and the (., 1) rsqrt
    if input_grad:
        per_token += 4 * d + 4
    extra = method("input_norm", input_grad) + method("qkv", input_grad)
    qkv_grad = {p: input_grad or trains(p) for p in ATTN}
    attn_grad = any(qkv_grad.values())
    # padded rows, or packed examples under transformers' block-diagonal mask: sdpa gets an explicit
    # mask; packed rows attending per example get none
    mask = rows > 1 or (st.packing and not st.packed_attention)
    if attn_grad:
        # sdpa keeps q, k, v (k and v repeated to every head when a mask is given), the output and
        # the fp32 log-sum-exp; the boolean mask is converted to a float mask per call and kept.
        kv_saved = q if (mask and kv != q) else kv
        per_token += mm * (q + 2 * kv_saved) + mm * q + 4 * h
        if mask:
            extra += mm * rows * seq * seq  # (rows, 1, seq, seq); packed: one row
    # o_proj's input is sdpa's output, which sdpa keeps when attention needs gradients
    o_grad = attn_grad or trains("o_proj")
    extra += method("o", attn_grad, saved=attn_grad) + method("attn_out", o_grad)
    res_grad = input_grad or o_grad
    if res_grad:  # post-attention RMSNorm
        per_token += 4 * d + 4
    extra += method("post_norm", res_grad) + method("gate_up", res_grad)
    gate_grad, up_grad = res_grad or trains("gate_proj"), res_grad or trains("up_proj")
    # act(gate) * up: SiLU keeps its input, the product keeps whichever factor the other needs;
    # down_proj's input, the product, is kept by nobody else
    per_token += mm * m * (2 * gate_grad + up_grad)
    down_grad = gate_grad or up_grad
    extra += method("down", down_grad) + method("mlp_out", down_grad or trains("down_proj"))
    return per_token * T + extra


def positions(st: TrainSetup, terms: PlanTerms) -> tuple[int, int]:
    """(rows, positions per row) the decoder runs on: a packed micro-batch is one row; a method may
    prepend positions to every example (prompt tuning's virtual tokens)."""
    extra = terms.extra_positions
    if st.packing:
        return 1, st.micro_batch_size * (st.seq_len + extra)
    return batch_rows(st), st.seq_len + extra


def batch_rows(st: TrainSetup) -> int:
    """Rows of the worst micro-batch: micro_batch_size examples, each a pair's two sides under a
    paired preference loss."""
    return st.micro_batch_size * st.rows_per_example


def micro_batch_words(st: TrainSetup) -> str:
    """The worst micro-batch's examples as a user counts them: '4', or '4 pairs (8 rows)'."""
    n = st.micro_batch_size
    return f"{n} pairs ({batch_rows(st)} rows)" if st.rows_per_example == 2 else str(n)


def trained_positions(st: TrainSetup) -> int:
    """Positions that predict a trained token in the worst micro-batch (all but each row's last)."""
    return batch_rows(st) * (st.seq_len - 1)


def first_block_input_grad(st: TrainSetup, terms: PlanTerms) -> bool:
    """Whether the first block's input requires grad: with gradient checkpointing the trainer
    makes the embeddings' output require grad; a method may train what feeds the first block
    (prompt tuning's soft prompt, a full fine-tune's embeddings)."""
    return st.gradient_checkpointing or terms.decoder_input_grad


def activation_bytes(shape: ModelShape, st: TrainSetup) -> dict:
    """Saved activations of the student's decoder for one micro-batch, and the working sets
    around them: {'saved', 'ckpt_layer', 'layer_backward'}."""
    terms = plan_terms(shape, st)
    rows, seq = positions(st, terms)
    T = rows * seq
    d, m = shape.hidden_size, shape.intermediate_size
    e = activation_dtype_bytes(st)
    first = layer_saved(shape, st, rows, seq, input_grad=first_block_input_grad(st, terms), terms=terms)
    steady = layer_saved(shape, st, rows, seq, input_grad=True, terms=terms)
    labels = batch_rows(st) * st.seq_len  # label positions (prompt tuning's virtual tokens have none)
    trained_mask = labels - 1 if st.packing else labels - batch_rows(st)
    # final RMSNorm (+ what the method keeps there) + the bool mask of trained positions
    final_norm = (4 * d + 4) * T + terms.saves(Site("final_norm", T, e)) + trained_mask
    # what the method keeps at the embedding (a full fine-tune: the token ids, for its weight gradient)
    embedding = terms.saves(Site("embedding", labels, e))
    rope = 2 * seq * shape.head_dim * e  # cos and sin, (1, 1, seq, head_dim), shared by all blocks
    # Gradients flowing back through one block: the hidden-state grad plus a few (T, m) grads of
    # the MLP and, over a 4-bit base, one dequantized weight; and what the method's layers add.
    dequant = max(i * o for p in PROJECTIONS for i, o in [shape.projection(p)]) * st.compute_bytes \
        if st.quantize == "nf4" and not st.fused_kernel else 0
    layer_backward = T * (3 * m * st.compute_bytes + 2 * d * 4) + dequant  # the norms' gradients in fp32
    layer_backward += T * terms.block_backward_per_token + terms.block_transient_bytes
    if st.gradient_checkpointing:
        # non-reentrant checkpointing keeps each block's input; backward recomputes one block
        blocks = shape.num_layers * T * d * e
        return {"saved": blocks + final_norm + rope + embedding, "blocks": blocks, "final_norm": final_norm,
                "rope": rope, "embedding": embedding, "ckpt_layer": steady, "layer_backward": layer_backward}
    blocks = first + (shape.num_layers - 1) * steady
    return {"saved": blocks + final_norm + rope + embedding, "blocks": blocks, "final_norm": final_norm,
            "rope": rope, "embedding": embedding, "ckpt_layer": 0, "layer_backward": layer_backward}


def activation_dtype_bytes(st: TrainSetup) -> int:
    """Bytes per element of the residual stream: the compute dtype, or fp32 where the base's own
    weights train (its embeddings and norms are fp32 weights; autocast rounds only the matmuls)."""
    return 4 if method_of(st).trains_base else st.compute_bytes


def head_dtype_bytes(st: TrainSetup) -> int:
    """The dtype the output head computes in: the compute dtype, also for a head that trains in fp32
    (a full fine-tune): under half-precision autocast the loss reads its copy (tunekit.losses.sft)."""
    return st.compute_bytes


def sft_loss_bytes(shape: ModelShape, st: TrainSetup) -> dict:
    """The chunked cross-entropy on trained positions (tunekit.losses.sft): bytes alive in the loss's
    forward and backward beside the saved activations.

    Forward: the selected rows (n, d), the gradient of the rows it fills (n, d), and one chunk's
    working set: its logits in the head's dtype and their fp32 copy (the first let go once the copy
    exists), the copy turned into the softmax gradient in place and cast back to the head's dtype
    beside it: at most 4 + 2 bytes per logit of a bf16 head, 4 of an fp32 one. A head that
    trains (a full fine-tune) also accumulates its fp32 weight gradient (V, d) beside each chunk's
    product.
    Kept for backward: the rows' gradient (and the head's). Backward: that gradient scaled once.
    """
    from tunekit.losses.sft import chunk_rows

    n, V, d = trained_positions(st), shape.vocab_size, shape.hidden_size
    eh, e = head_dtype_bytes(st), activation_dtype_bytes(st)
    c = min(chunk_rows(V), n)
    work = c * V * (4 + (eh if eh != 4 else 0)) + 16 * c
    kept = n * d * eh
    if method_of(st).trains_base:  # the fp32 accumulator, and one chunk's (V, d) product in the autocast dtype
        kept += 4 * V * d
        work += (st.compute_bytes + 4) * V * d
    # the selected rows, in the residual stream's dtype, and their cast to the head's where they differ
    selected = n * d * e + (n * d * eh if e != eh else 0)
    forward = selected + kept + work + 8 * n
    backward = kept + n * d * eh
    if st.rows_per_example > 1 or st.reference_forward:
        # preference log-probabilities (tunekit.losses.logps): the same chunked head and kept
        # gradient, but each row's gradient scale differs, applied through an fp32 copy in backward
        backward += 4 * n * d
    return {"kept": kept, "forward": forward, "backward": backward}


def reference_forward_bytes(shape: ModelShape, st: TrainSetup) -> int:
    """The preference reference's no-grad forward over the micro-batch's rows (the base with the
    trained part off), run beside the policy's saved activations: one block's working set at a time,
    its last hidden states, then its log-probabilities from the head in chunks (rows, the chunk's
    logits in the head's dtype and fp32)."""
    from tunekit.losses.sft import chunk_rows

    rows, seq = positions(st, plan_terms(shape, st))
    T, e, d, V = rows * seq, activation_dtype_bytes(st), shape.hidden_size, shape.vocab_size
    eh, n = head_dtype_bytes(st), trained_positions(st)
    dequant = max(i * o for p in PROJECTIONS for i, o in [shape.projection(p)]) * st.compute_bytes \
        if st.quantize == "nf4" and not st.fused_kernel else 0
    block = T * (3 * shape.intermediate_size + 3 * d) * e + dequant
    logps = n * d * eh + min(chunk_rows(V), n) * V * (4 + eh) + 8 * n
    return T * d * e + max(block, logps)


def distill_loss_bytes(shape: ModelShape, st: TrainSetup) -> dict:
    """Chunked distillation: saved student/teacher rows, teacher hidden states, chunk buffers."""
    t = st.teacher
    n, V = trained_positions(st), shape.vocab_size
    rows, seq = positions(st, plan_terms(shape, st))
    et, eh = st.compute_bytes, head_dtype_bytes(st)  # the teacher is not kbit-prepared
    chunk = min(st.distill_chunk, n)
    teacher_hidden = rows * seq * t.hidden_size * et
    kept = n * shape.hidden_size * eh + n * t.hidden_size * et + teacher_hidden + 8 * n
    work = int(DISTILL_CHUNK_BUFFERS * 4 * chunk * V)
    # the teacher's hidden states live until the loss's forward returns; backward has its rows only
    return {"forward": kept + work, "backward": kept - teacher_hidden + work}


def teacher_forward_bytes(shape: ModelShape, st: TrainSetup) -> int:
    """The frozen teacher's no-grad forward: one block's working set at a time, plus its output."""
    t = st.teacher
    rows, seq = positions(st, plan_terms(shape, st))
    T, e = rows * seq, st.compute_bytes
    dequant = max(i * o for p in PROJECTIONS for i, o in [t.projection(p)]) * e if st.teacher_quantize == "nf4" else 0
    return T * (3 * t.intermediate_size + 3 * t.hidden_size) * e + dequant


# ------------------------------------------------------------------ the peak
def fsdp_gathered_bytes(shape: ModelShape, st: TrainSetup, ranks: int = 1) -> int:
    """Whole weights an FSDP rank holds beside its shards (tunekit.train.fsdp): the decoder block that
    computes and the one prefetched; a head tied to the embeddings stays in the root unit, gathered
    for the whole micro-batch with the final norm. Untied embeddings and head are units of their own:
    frozen, they are never gathered, only one rank's vocabulary slice at a time is received
    (tunekit.train.fsdp.sliced_embeddings, tunekit.losses.sliced_head); trained (a method that trains
    the base), each is gathered while it computes, with one block prefetched beside it. On a CPU
    (st.fsdp_projection_units) each frozen projection is a unit of its own: a block's norms, the
    projection computing and a second of the largest projection's size (the all-gather's buffer at
    its copy-out, or the projection prefetched in backward) in place of two blocks."""
    outer = base_weight_bytes(shape.with_layers(0), st.quantize, st.compute_bytes)
    block = base_weight_bytes(shape.with_layers(1), st.quantize, st.compute_bytes) - outer
    block -= quant_state_bytes(shape.with_layers(1), st.quantize)  # never gathered: each rank holds it whole
    second = block  # the block prefetched beside it
    if st.fsdp_projection_units and not method_of(st).trains_base:
        # the projection computing and, while it is copied out of the all-gather, the all-gather's
        # buffer of the same size (or the one prefetched in backward); the norms with their block
        proj = [(i * o // 2 + i * o % 2 if st.quantize == "nf4" else i * o * st.compute_bytes)
                + (o * st.compute_bytes if shape.projection_bias(n) else 0)
                for n in PROJECTIONS for i, o in [shape.projection(n)]]
        second = max(proj)
        block = block - sum(proj) + second
    if shape.tie_word_embeddings:
        return block + second + outer
    per_param = st.compute_bytes
    largest = per_param * max(shape.embedding_params, shape.head_params)
    if not method_of(st).trains_base:
        largest = math.ceil(largest / max(ranks, 1))  # one received slice
    return block + max(second, largest)


def gradients_alive(phases: dict, gradients: int, grad_accum: int) -> dict:
    """The bytes of the trainable tensors' gradients alive in each phase of the step.

    With accumulation, all of them in every phase: the earlier micro-batches' sums wait for the
    optimizer step. Without it, every strategy has dropped them after the last step, so none exist in
    the forwards and in the loss's backward (a trained head's gradient is the loss's own kept
    buffer); in the blocks' backward they fill up as the saved activations are let go, top block
    first, so the two together stay under the larger of all of either (plus the block's working set,
    counted apart); the optimizer step and the all-reduce hold all of them. What this changes is a
    full fine-tune's 4 bytes a weight: a LoRA's gradients are a few MiB."""
    out = {k: gradients for k in phases}
    if grad_accum > 1:
        return out
    for k in FORWARD_PHASES + ("loss backward",):
        if k in out:
            out[k] = 0
    if "block backward" in out:
        saved = phases["block backward"][0]
        out["block backward"] = max(gradients - saved, 0)  # max(saved, gradients) in all
    return out


def step_memory(shape: ModelShape, st: TrainSetup, ranks: int = 1, sharded: bool = False) -> Memory:
    """One rank's peak over a training step: static state plus the largest working phase.

    ranks/sharded: under DDP every rank holds everything and all-reduces a flat copy of the
    gradients (tunekit's `_all_reduce_grads`); under FSDP (sharded) base weights, trainable
    parameters, gradients and optimizer state are split over the ranks, and each rank also
    holds the whole weights FSDP gathers (`fsdp_gathered_bytes`). A 4-bit base's quantization
    state is not split (`quant_state_bytes`); an 8-bit optimizer decides 8- or 32-bit state per
    shard, by the shard's size.

    The split is even (total // ranks). FSDP2 cuts each parameter's dim 0 into chunks of
    ceil(d0 / ranks) rows, so a rank holds ceil(d0 / ranks) rows, fewer or none: the fullest rank
    holds at most (ranks - 1) / ranks of a row more than the even split per parameter whose d0 the
    ranks do not divide (none of a Llama's on 2, 4 or 8 ranks: dims and r are multiples of 8;
    checked on two gloo ranks by tests/plan/test_fsdp_measured.py).
    """
    tensors = trainable_tensors(shape, st)
    P = sum(tensors)
    split = ranks if sharded else 1
    # a method that trains the base's own weights has no frozen copy: the model is the trainable part (fp32)
    weights = 0 if method_of(st).trains_base else base_weight_bytes(shape, st.quantize, st.compute_bytes)
    mem = Memory()
    replicated = quant_state_bytes(shape, st.quantize) if weights and split > 1 else 0
    mem.terms["base weights"] = (weights - replicated + st.dense_cache_bytes) // split + replicated
    mem.terms["trainable parameters"] = 4 * P // split
    mem.terms["gradients"] = 4 * P // split
    shards = [math.ceil(n / split) for n in tensors] if split > 1 else tensors
    mem.terms["optimizer state"] = optimizer_state_bytes(shards, st.optimizer)
    if sharded and ranks > 1:
        mem.terms["gathered blocks (FSDP)"] = fsdp_gathered_bytes(shape, st, ranks)
    copies = plan_terms(shape, st).weight_copy_bytes
    if copies:
        mem.terms["weight copies (compute dtype)"] = copies
    if st.teacher is not None:
        mem.terms["teacher weights"] = base_weight_bytes(st.teacher, st.teacher_quantize, st.compute_bytes) // split
    if split > 1:
        mem.sharded = tuple(k for k in SHARDED_TERMS if k in mem.terms)
    act = activation_bytes(shape, st)
    if st.offload_activations and st.gradient_checkpointing:  # the blocks' inputs wait in host memory
        mem.host["offloaded activations"] = act["blocks"]
        act = {**act, "saved": act["saved"] - act["blocks"]}
    loss = distill_loss_bytes(shape, st) if st.teacher is not None else sft_loss_bytes(shape, st)
    phases = {
        "loss forward": (act["saved"], loss["forward"]),  # everything saved, the loss computing
        "loss backward": (act["saved"], loss["backward"]),  # the loss's gradients on top
        # backward through a block (recomputed first when checkpointing)
        "block backward": (act["saved"] + act["ckpt_layer"], act["layer_backward"]),
        # activations are gone; the optimizer's temporaries: torch's AdamW off a GPU updates tensor by
        # tensor, with two fp32 temporaries of the tensor it updates (sqrt(v), then its scaled copy);
        # on a GPU it runs fused, and bitsandbytes' optimizers update in place, so this bounds them all
        "optimizer step": (0, 8 * math.ceil(max(tensors, default=0) / split)),
    }
    if st.teacher is not None:
        phases["teacher forward"] = (act["saved"], teacher_forward_bytes(shape, st))
    if st.reference_forward:
        # after the policy's log-probabilities: their kept row gradient waits beside it
        phases["reference forward"] = (act["saved"], loss.get("kept", 0) + reference_forward_bytes(shape, st))
    if st.kl_forwards:  # KTO's mismatched rows, each forward alone, where the reference's runs
        phases["KL forwards"] = (act["saved"], loss.get("kept", 0) + reference_forward_bytes(shape, st))
    if ranks > 1 and not sharded:
        phases["gradient all-reduce"] = (0, 8 * P)  # flat copy of the grads + the reduced result
    start = plan_terms(shape, st).start_bytes
    if start:  # before the first step: no activations (gradients and optimizer state counted, not yet there)
        phases["method start (LoftQ)"] = (0, start)
    grads = gradients_alive(phases, mem.terms["gradients"], st.grad_accum)
    phase = max(phases, key=lambda k: sum(phases[k]) + grads[k])
    mem.terms["gradients"] = grads[phase]
    mem.phase = phase
    saved, work = phases[phase]
    mem.terms["activations"] = saved
    mem.terms["loss and head" if phase.startswith("loss") else f"working set ({phase})"] = work
    return mem
