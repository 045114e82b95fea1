"""Packed rows attend per example (tunekit.speed.packed_attention): the same attention as the
block-diagonal causal mask transformers builds from position restarts, without the mask."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tunekit.data.batching import collate, collate_packed
from tunekit.speed import packed_attention as pa


def _block_causal(lengths: list[int]) -> torch.Tensor:
    T = sum(lengths)
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    return causal & (doc[:, None] == doc[None, :])


@pytest.mark.parametrize("kv_heads", [4, 2])  # plain and grouped-query attention
def test_per_example_attention_is_the_masked_attention(kv_heads):
    torch.manual_seed(0)
    lengths = [5, 17, 1, 9]
    q = torch.randn(1, 4, sum(lengths), 16, dtype=torch.float64)
    k, v = (torch.randn(1, kv_heads, sum(lengths), 16, dtype=torch.float64) for _ in range(2))
    module = torch.nn.Module().eval()
    got, _ = pa.per_example_attention(module, q, k, v, None, scaling=0.25, packed_lengths=lengths)
    rep = 4 // kv_heads
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                          attn_mask=_block_causal(lengths), scale=0.25)
    # fp64 on both sides: the same softmax over the same keys, summed in another order (~1e-16)
    torch.testing.assert_close(got, want.transpose(1, 2), rtol=1e-12, atol=1e-12)
    assert pa.lengths_of([0, 1, 2, 0, 0, 1]) == [3, 1, 2]
    # a caller without the lengths (another model sharing the config) is cut at the position restarts
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    again, _ = pa.per_example_attention(module, q, k, v, None, scaling=0.25, position_ids=positions)
    assert torch.equal(again, got)


def test_a_mask_or_lengths_that_do_not_tile_the_row_are_refused():
    q = torch.zeros(1, 2, 6, 4)
    module = torch.nn.Module()
    with pytest.raises(RuntimeError, match="got a mask"):
        pa.per_example_attention(module, q, q, q, torch.ones(1, 1, 6, 6, dtype=torch.bool))
    with pytest.raises(RuntimeError, match="do not tile"):
        pa.per_example_attention(module, q, q, q, None, packed_lengths=[2, 3])


def _loss_and_grads(model, batch, lengths=None):
    model.zero_grad(set_to_none=True)
    extra = {"packed_lengths": lengths} if lengths else {}
    out = model(**{k: v for k, v in batch.items() if k != "labels"}, **extra, use_cache=False)
    logits = out.logits.float()[:, :-1]
    labels = batch["labels"][:, 1:]
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100,
                           reduction="sum")
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_packed_row_trains_as_the_mask_and_as_its_examples(tiny_model_dir, dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=dtype, attn_implementation="sdpa")
    torch.manual_seed(0)
    examples = [{"input_ids": torch.randint(5, 1000, (n,)).tolist()} for n in (7, 30, 2, 19)]
    for e in examples:
        e["labels"] = list(e["input_ids"])
    packed = collate_packed(examples, 0)
    lengths = pa.lengths_of(packed["position_ids"][0].tolist())
    assert lengths == [7, 30, 2, 19]
    masked, g_masked = _loss_and_grads(model, packed)  # transformers' block-diagonal mask
    before = pa.use(model)
    per_example, g_per = _loss_and_grads(model, packed, lengths)
    with pa.plain(model, before):
        assert model.config._attn_implementation == "sdpa"
    assert model.config._attn_implementation == pa.NAME
    alone = sum(_loss_and_grads(model, collate_packed([e], 0), [len(e["input_ids"])])[0] for e in examples)
    # fp32: the same sums in another order, ~1e-7 relative per op over a 2-layer model.
    # bf16: the two paths round attention's output to bf16 in different kernels (2^-8 relative per
    # element, once per layer); through 2 layers' residual stream and a head over 64 dims with
    # weights of std 0.02, a logit moves by ~0.16 * sqrt(2) * 2^-8 ~ 1e-3, and the summed loss over
    # ~54 tokens, errors of random sign, by ~1e-3 * sqrt(54) ~ 7e-3 of a ~590 total: 2e-5 relative.
    # 1e-3 relative leaves 50x. What separates right from wrong attention is the fp32 case: on this
    # random model an example seeing the others moves the loss by ~4e-4 relative (below), 40x fp32's bound.
    tol = 1e-5 if dtype == torch.float32 else 1e-3
    assert abs(per_example - masked) / masked <= tol and abs(alone - masked) / masked <= tol
    if dtype == torch.float32:
        for a, b in zip(g_per, g_masked):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
        # and it differs from attention across the whole row, the failure the bound must catch
        model.config._attn_implementation = "sdpa"
        crossed, _ = _loss_and_grads(model, {k: v for k, v in packed.items() if k != "position_ids"})
        assert abs(crossed - masked) / masked > 10 * tol


@pytest.mark.parametrize("per_example", [True, False])
def test_the_switch_reaches_the_run_and_its_plan(tiny_model_dir, tiny_data, tmp_path, per_example):
    """kernels.packed_attention=false keeps transformers' block-diagonal mask for packed rows (the
    older path, kept to compare against), and the planner then counts the mask."""
    from tunekit.commands.compose import compose_configs
    from tunekit.plan.inputs import planner_inputs
    from tunekit.device.facts import DeviceFacts
    from tunekit.train.loop import TrainRecipe

    (cfg,) = compose_configs([f"model.path={tiny_model_dir}", f"data.path={tiny_data}", "model.quantize=none",
                              "data.packing=true", f"kernels.packed_attention={str(per_example).lower()}",
                              "data.max_seq_len=64", "trainer.max_steps=1", "trainer.micro_batch_size=2",
                              "trainer.grad_accum=1", "trainer.eval_samples=0", f"output_dir={tmp_path / 'run'}"])
    assert planner_inputs(cfg, DeviceFacts("cpu", cpu_bf16=True))[1].packed_attention is per_example
    r = TrainRecipe(cfg, tmp_path / "run")
    try:
        r.setup()
        r.train_step(0)
        assert (r.model.config._attn_implementation == pa.NAME) is per_example
    finally:
        r.cleanup()
