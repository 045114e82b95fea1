"""The memory planner's terms, counted against the real objects on the tiny random Llama.

Activations: every tensor autograd saves during the forward pass and the SFT loss is recorded
with `torch.autograd.graph.saved_tensors_hooks` (deduplicated by storage, model parameters and
quantization state left out) and attributed to the decoder block that saved it. The planner's
per-block walk must give the same bytes exactly: it counts the same tensors, so any difference
is a tensor it misses or invents. Static terms (4-bit weights, trainable tensors, optimizer
state) are compared with the bytes of the tensors themselves.
"""

from __future__ import annotations

import collections
from dataclasses import replace

import pytest
import torch

from tunekit.methods import MethodConfig
from tunekit.data import collate, collate_packed
from tunekit.device.facts import DeviceFacts
from tunekit.methods import get_method
from tunekit.model import decoder_and_head, load_base_model, prepare_for_training
from tunekit.train.objective import SFTObjective, model_inputs
from tunekit.plan import GiB, predict
from tunekit.plan.compute import step_flops
from tunekit.plan.memory import (TrainSetup, activation_bytes, base_weight_bytes, head_dtype_bytes,
                                 optimizer_state_bytes, quant_state_bytes, sft_loss_bytes, step_memory,
                                 trainable_tensors)
from tunekit.plan.shape import PROJECTIONS, model_shape, preset_shape
from tunekit.speed import packed_attention

CPU = DeviceFacts("cpu", cpu_bf16=True)


def build(model_dir, st: TrainSetup, method_cfg: MethodConfig):
    dtype = torch.bfloat16 if st.compute_bytes == 2 else torch.float32
    model = load_base_model(str(model_dir), st.quantize, dtype, torch.device("cpu"))
    prepare_for_training(model, st.quantize, st.gradient_checkpointing)
    model = get_method(method_cfg.name).apply(model, method_cfg)
    if st.packed_attention:  # the trainer's per-example attention for packed rows
        packed_attention.use(model)
    if st.lora_compute:  # the trainer's compute-dtype LoRA path (tunekit.methods.lora.compute_dtype)
        from tunekit.methods.lora.backend import lora_4bit_layers, set_path

        set_path([m for _, m in lora_4bit_layers(model)], "torch")
    return model.train()


def worst_batch(st: TrainSetup, vocab: int) -> dict:
    """st.micro_batch_size fully trained rows: the first seq tokens long, the others one shorter
    (so the batch is padded and attention gets a mask, as the planner assumes)."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(st.micro_batch_size):  # packed rows have no padding: all full length
        n = st.seq_len if i == 0 or st.packing else st.seq_len - 1
        ids = torch.randint(3, vocab, (n,), generator=g).tolist()
        rows.append({"input_ids": ids, "labels": list(ids)})
    return (collate_packed if st.packing else collate)(rows, 0)


def saved_bytes(model, batch) -> tuple[dict, int]:
    """Bytes autograd saves per decoder block ('L0', 'L1', ...) and after the last ('post').
    A full fine-tune's bf16 weight copies (tunekit.device.rounding) are drawn during the forward and
    kept on their weights: a term of their own in the plan, like the weights, so not counted here."""
    from tunekit.device.rounding import COPY

    params = list(model.parameters())
    known = {p.untyped_storage().data_ptr() for p in params}
    for module in model.modules():
        known |= {b.untyped_storage().data_ptr() for b in module.buffers(recurse=False)}
        state = getattr(getattr(module, "weight", None), "quant_state", None)
        if state is not None:
            known.add(state.absmax.untyped_storage().data_ptr())
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    where, counts = ["pre"], collections.Counter()
    handles = []
    for i, layer in enumerate(base.get_decoder().layers):
        handles.append(layer.register_forward_pre_hook(lambda m, a, i=i: where.__setitem__(0, f"L{i}")))
        handles.append(layer.register_forward_hook(lambda m, a, o: where.__setitem__(0, "post")))

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in known:  # a weight copy drawn during this forward is known from here on
            known.update(getattr(p, COPY)[1].untyped_storage().data_ptr() for p in params if hasattr(p, COPY))
        if key not in known:
            known.add(key)
            counts[where[0]] += t.untyped_storage().nbytes()
        return t

    decoder, head = decoder_and_head(model)
    packed = {}
    if base.config._attn_implementation == packed_attention.NAME:  # per-example attention: lengths go along
        packed = {"packed_lengths": packed_attention.lengths_of(batch["position_ids"][0].tolist())}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        hidden = decoder(**model_inputs(batch), **packed, use_cache=False).last_hidden_state
        _, n = SFTObjective().loss(hidden, head, batch)
    for h in handles:
        h.remove()
    return counts, int(n)


CASES = {
    # name: (TrainSetup fields, MethodConfig fields)
    "lora bf16 padded": (dict(micro_batch_size=3, seq_len=24), dict(name="lora", dropout=0.0)),
    "lora bf16 one row": (dict(micro_batch_size=1, seq_len=32), dict(name="lora", dropout=0.0)),
    "lora bf16 packed": (dict(micro_batch_size=3, seq_len=16, packing=True), dict(name="lora", dropout=0.0)),
    "lora bf16 packed per example": (dict(micro_batch_size=3, seq_len=16, packing=True, packed_attention=True),
                                     dict(name="lora", dropout=0.0)),
    "lora fp32": (dict(micro_batch_size=2, seq_len=24, compute_bytes=4), dict(name="lora", dropout=0.0)),
    "lora bf16 dropout": (dict(micro_batch_size=2, seq_len=24, lora_dropout=0.1), dict(name="lora", dropout=0.1)),
    "lora two targets": (dict(micro_batch_size=2, seq_len=24, lora_targets=("v_proj", "down_proj")),
                         dict(name="lora", dropout=0.0, target_modules=["v_proj", "down_proj"])),
    "qlora": (dict(micro_batch_size=2, seq_len=24, quantize="nf4"), dict(name="lora", dropout=0.0)),
    "qlora dropout": (dict(micro_batch_size=3, seq_len=16, quantize="nf4", lora_dropout=0.1),
                      dict(name="lora", dropout=0.1)),
    "qlora bf16 LoRA path": (dict(micro_batch_size=2, seq_len=24, quantize="nf4", lora_compute=True),
                             dict(name="lora", dropout=0.0)),
    "qlora bf16 LoRA path packed": (dict(micro_batch_size=3, seq_len=16, quantize="nf4", lora_compute=True,
                                         packing=True), dict(name="lora", dropout=0.0)),
    "qlora bf16 LoRA path dropout": (dict(micro_batch_size=2, seq_len=24, quantize="nf4", lora_compute=True,
                                          lora_dropout=0.1), dict(name="lora", dropout=0.1)),
    "adapter": (dict(method="adapter", micro_batch_size=2, seq_len=24), dict(name="adapter")),
    "adapter nf4 mlp only": (dict(method="adapter", quantize="nf4", adapter_sublayers=("mlp",), micro_batch_size=2,
                                  seq_len=24), dict(name="adapter", sublayers=["mlp"])),
    "bitfit": (dict(method="bitfit", micro_batch_size=2, seq_len=24), dict(name="bitfit")),
    "bitfit nf4 down only": (dict(method="bitfit", quantize="nf4", bitfit_targets=("down_proj",), micro_batch_size=2,
                                  seq_len=24), dict(name="bitfit", target_modules=["down_proj"])),
    "prompt tuning": (dict(method="prompt_tuning", num_virtual_tokens=5, micro_batch_size=2, seq_len=24),
                      dict(name="prompt_tuning", num_virtual_tokens=5)),
    "full fp32": (dict(method="full", micro_batch_size=2, seq_len=24, compute_bytes=4), dict(name="full")),
    # fp32 weights and residual stream, matmuls on stochastic bf16 copies under autocast, as it trains
    "full bf16 autocast": (dict(method="full", micro_batch_size=2, seq_len=24), dict(name="full")),
    "ia3": (dict(method="ia3", micro_batch_size=2, seq_len=24), dict(name="ia3")),
    "ia3 nf4 packed": (dict(method="ia3", quantize="nf4", packing=True, micro_batch_size=3, seq_len=16),
                       dict(name="ia3")),
    # every site: queries, o_proj's input (sdpa's output, kept already), gate and up sharing an input
    "ia3 all-linear": (dict(method="ia3", micro_batch_size=2, seq_len=24,
                            options=dict(targets=PROJECTIONS, feedforward=("o_proj", "gate_proj", "up_proj"))),
                       dict(name="ia3", target_modules=["all-linear"],
                            feedforward_modules=["o_proj", "gate_proj", "up_proj"])),
    "ia3 fp32 queries scaled in": (dict(method="ia3", micro_batch_size=2, seq_len=24, compute_bytes=4,
                                        options=dict(targets=("q_proj", "down_proj"), feedforward=("q_proj",))),
                                   dict(name="ia3", target_modules=["q_proj", "down_proj"],
                                        feedforward_modules=["q_proj"])),
}


@pytest.mark.parametrize("case", list(CASES))
def test_saved_activations_are_counted_exactly(tiny_model_dir, case):
    fields, method_fields = CASES[case]
    st = TrainSetup(**fields)
    shape = model_shape(str(tiny_model_dir), None)
    torch.manual_seed(0)
    model = build(tiny_model_dir, st, MethodConfig(**method_fields))
    autocast = get_method(method_fields["name"]).autocast and st.compute_bytes < 4  # as the trainer decides
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        counts, n = saved_bytes(model, worst_batch(st, shape.vocab_size))
    act = activation_bytes(shape, st)
    blocks = sum(v for k, v in counts.items() if k.startswith("L")) + counts["pre"]
    assert blocks == act["blocks"] + act["rope"] + act["embedding"], dict(counts)
    # after the decoder: final norm + trained-position mask, then the chunked loss keeps the gradient
    # of the trained rows, linear in the trained positions (padding leaves a few untrained)
    planned = st.micro_batch_size * (st.seq_len - 1)
    assert planned - st.micro_batch_size < n <= planned
    # the rows' gradient shrinks with the untrained positions; a trained head's gradient does not
    kept = sft_loss_bytes(shape, st)["kept"] - (planned - n) * shape.hidden_size * head_dtype_bytes(st)
    assert counts["post"] == act["final_norm"] + kept, dict(counts)


def test_checkpointing_keeps_block_inputs_only(tiny_model_dir):
    st = TrainSetup(micro_batch_size=2, seq_len=24, gradient_checkpointing=True)
    shape = model_shape(str(tiny_model_dir), None)
    model = build(tiny_model_dir, st, MethodConfig(name="lora", dropout=0.0))
    counts, _ = saved_bytes(model, worst_batch(st, shape.vocab_size))
    # one (rows, seq, dim) bf16 input per block; what the block computes is recomputed in backward
    assert sum(v for k, v in counts.items() if k.startswith("L")) == activation_bytes(shape, st)["blocks"]


@pytest.mark.parametrize("quantize, method", [("nf4", "lora"), ("none", "lora"), ("nf4", "adapter"), ("nf4", "ia3")])
def test_weights_and_trainable_tensors_match_the_loaded_model(tiny_model_dir, quantize, method):
    st = TrainSetup(quantize=quantize, method=method)
    shape = model_shape(str(tiny_model_dir), None)
    model = build(tiny_model_dir, st, MethodConfig(name=method))
    frozen, quant, seen = 0, 0, set()
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if not p.requires_grad and p.untyped_storage().data_ptr() not in seen:  # a tied head once
                seen.add(p.untyped_storage().data_ptr())
                frozen += p.untyped_storage().nbytes()
        weight = getattr(module, "weight", None)  # peft's LoRA wrapper shows its base layer's weight too
        state = getattr(weight, "quant_state", None)
        if state is not None and id(state) not in seen:  # absmax (8-bit), its fp32 absmax, code tables, offset
            seen.add(id(state))
            quant += sum(t.untyped_storage().nbytes() for t in
                         (state.absmax, state.code, state.state2.absmax, state.state2.code, state.offset))
    assert frozen + quant == base_weight_bytes(shape, quantize, 2)
    assert quant == quant_state_bytes(shape, quantize)  # what FSDP leaves whole on every rank
    trainable = sorted(p.numel() for p in model.parameters() if p.requires_grad)
    assert trainable == sorted(trainable_tensors(shape, st))
    assert all(p.dtype == torch.float32 for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("optimizer", ["adamw", "adamw_8bit", "paged_adamw_32bit"])
def test_optimizer_state_matches_the_optimizer(tiny_model_dir, optimizer):
    from tunekit.train.optim import build_optimizer

    st = TrainSetup(optimizer=optimizer)
    shape = model_shape(str(tiny_model_dir), None)
    model = build(tiny_model_dir, st, MethodConfig(name="lora"))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = build_optimizer(optimizer, params, 1e-3, 0.0, torch.device("cpu"))
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    seen, state = set(), 0
    for p in params:
        for k, v in opt.state[p].items():
            if torch.is_tensor(v) and v.numel() > 1 and not k.startswith("qmap"):  # qmaps: 2 KiB, shared
                if v.untyped_storage().data_ptr() not in seen:
                    seen.add(v.untyped_storage().data_ptr())
                    state += v.untyped_storage().nbytes()
    assert state == optimizer_state_bytes(trainable_tensors(shape, st), optimizer)


def test_gradients_are_planned_where_they_are_alive():
    """With accumulation the earlier micro-batches' gradients wait through the next one's forward;
    without it, none exists before the backward (the trainer drops them after each optimizer step).
    Only a full fine-tune's gradients are large enough for this to move the plan."""
    shape = preset_shape("smollm2-135m")
    setup = dict(method="full", micro_batch_size=2, seq_len=512)
    G = 4 * sum(trainable_tensors(shape, TrainSetup(**setup)))
    accum = step_memory(shape, TrainSetup(**setup, grad_accum=2))
    single = step_memory(shape, TrainSetup(**setup, grad_accum=1))
    assert (accum.phase, accum.terms["gradients"]) == ("loss forward", G)
    assert (single.phase, single.terms["gradients"]) == ("loss forward", 0)
    assert accum.total - single.total == G
    # checkpointed, the activations are small: the peak moves to the optimizer step, which holds every
    # gradient and the update's temporaries of the largest tensor (the embedding)
    ckpt = step_memory(shape, TrainSetup(**setup, grad_accum=1, gradient_checkpointing=True))
    assert (ckpt.phase, ckpt.terms["gradients"]) == ("optimizer step", G)
    assert ckpt.terms["working set (optimizer step)"] == 8 * shape.embedding_params


def test_presets_and_the_default_model_config():
    default = model_shape(None, None)
    assert default == preset_shape("smollm2-135m")
    assert default.total_params == 134_515_008  # SmolLM2-135M, tied head
    assert preset_shape("llama-3-8b").total_params == 8_030_261_248  # Meta's published count
    assert preset_shape("llama-3-70b").total_params == 70_553_706_496
    lora = TrainSetup(method="lora", lora_r=16, lora_targets=PROJECTIONS)
    assert sum(trainable_tensors(default, lora)) == 4_884_480  # README's recipe table


def test_fsdp_shards_the_state_and_ddp_does_not():
    shape, st = preset_shape("llama-3-70b"), TrainSetup(quantize="nf4", micro_batch_size=1, seq_len=2048,
                                                          gradient_checkpointing=True)
    one = step_memory(shape, st)
    ddp = step_memory(shape, st, ranks=2)
    fsdp = step_memory(shape, st, ranks=2, sharded=True)
    assert ddp.terms["base weights"] == one.terms["base weights"]
    # the 4-bit codes and the bf16 rest are split; the quantization state (a module attribute) is not
    state = quant_state_bytes(shape, "nf4")
    assert 0 < state < one.terms["base weights"] / 10
    assert fsdp.terms["base weights"] == (one.terms["base weights"] - state) // 2 + state
    assert fsdp.terms["optimizer state"] == one.terms["optimizer state"] // 2
    assert fsdp.terms["activations"] == one.terms["activations"]  # each rank runs its own micro-batch
    # one gathered block (without its quantization state, which each rank holds) and, beside it,
    # the larger of the prefetched block and one rank's slice of the frozen untied bf16 head or
    # embeddings (128256 x 8192 x 2 bytes, halved on two ranks): those are never gathered whole
    block = (base_weight_bytes(shape.with_layers(1), "nf4", 2) - base_weight_bytes(shape.with_layers(0), "nf4", 2)
             - quant_state_bytes(shape.with_layers(1), "nf4"))
    assert fsdp.terms["gathered blocks (FSDP)"] == block + 128256 * 8192 < one.terms["base weights"] / 8
    eight = step_memory(shape, st, ranks=8, sharded=True)  # a slice of an eighth: smaller than a block
    assert eight.terms["gathered blocks (FSDP)"] == 2 * block
    # on a CPU each frozen projection is a unit of its own: the block's norms and the projection
    # computing (the largest: gate, up and down, 8192 x 28672 in 4-bit codes), and beside them the
    # larger of a second such projection (its all-gather's buffer, or the one prefetched) and one
    # received slice of the head: the slice on 8 ranks, the projection on 32
    norms, proj = 2 * 8192 * 2, 8192 * 28672 // 2
    cpu = replace(st, fsdp_projection_units=True)
    assert step_memory(shape, cpu, ranks=8, sharded=True).terms["gathered blocks (FSDP)"] == norms + proj + 128256 * 8192 // 4
    assert step_memory(shape, cpu, ranks=32, sharded=True).terms["gathered blocks (FSDP)"] == norms + 2 * proj < block
    # 70B in 4 bits does not fit a 24 GB card, and does, sharded, on four
    gpu = DeviceFacts("cuda", 0, (8, 0), "GPU", 24 * GiB)
    plan = predict(shape, replace(st, seq_len=512), gpu, ranks=4)
    assert plan.device_total() > 24 * GiB > plan.device_total(plan.fsdp)


def test_checkpointing_costs_a_third_more_compute_on_a_frozen_base():
    shape = model_shape(None, None)
    off = step_flops(shape, TrainSetup(quantize="nf4", gradient_checkpointing=False))
    on = step_flops(shape, TrainSetup(quantize="nf4", gradient_checkpointing=True))
    assert on["recompute"] == off["forward"] and off["recompute"] == 0
    # decoder alone: forward + input-grad pass (+ small LoRA weight grads) = ~4N per token without
    # checkpointing, ~6N with: the run without it computes a third less
    decoder_off = off["forward"] + off["backward"]
    assert 0.3 < 1 - decoder_off / (decoder_off + on["recompute"]) < 1 / 3
    full = step_flops(shape, TrainSetup(method="full", compute_bytes=4))
    assert full["backward"] == pytest.approx(2 * full["forward"], rel=0.01)  # weight grads too


def test_a_bigger_batch_or_sequence_never_needs_less():
    shape = preset_shape("llama-3-8b")
    base = TrainSetup(quantize="nf4", gradient_checkpointing=True)
    peaks = [step_memory(shape, replace(base, micro_batch_size=b, seq_len=s)).total
             for b, s in [(1, 512), (2, 512), (2, 1024), (4, 1024), (4, 4096)]]
    assert peaks == sorted(peaks) and len(set(peaks)) == len(peaks)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_inference_check_counts_the_cache_prefill_keeps(tiny_model_dir, dtype):
    """The KV-cache term of the eval/generate/chat memory check is the cache transformers holds
    after a padded prompt pass: every position of the padded width, keys and values, every layer."""
    from tunekit.infer.decode import prefill
    from tunekit.model import load_base_model
    from tunekit.plan.inference import Workload, activation_terms

    shape = model_shape(str(tiny_model_dir), None)
    model = load_base_model(str(tiny_model_dir), "none", dtype, torch.device("cpu")).eval()
    rows = [[5] * 7, [6] * 4, [7] * 9]  # left-padded to 9 positions
    with torch.no_grad():
        prefix = prefill(model, rows, share_prefix=False)
    held = sum(t.untyped_storage().nbytes() for layer in prefix.cache.layers for t in (layer.keys, layer.values))
    e = torch.empty((), dtype=dtype).element_size()
    assert held == activation_terms(shape, e, Workload(kv_tokens=3 * 9, forward_tokens=0, logit_rows=0))["KV cache"]
