"""The loss and the optimisation step: token normalisation, accumulation, schedule."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tunekit.config import DataConfig, ModelConfig, TrainConfig, TrainerConfig
from tunekit.methods import MethodConfig
from tunekit.losses import sft_loss
from tunekit.train.optim import build_optimizer, warmup_cosine
from tunekit.train.loop import TrainRecipe


def test_sft_loss_is_shifted_masked_sum():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11, dtype=torch.bfloat16)
    labels = torch.tensor([[-100, 3, 4, -100, 1], [-100, -100, 2, 9, -100]])
    total, n = sft_loss(logits, labels)
    ref = F.cross_entropy(logits[:, :-1].float().reshape(-1, 11), labels[:, 1:].reshape(-1), reduction="sum")
    assert n.item() == 5
    assert total.dtype == torch.float32
    torch.testing.assert_close(total, ref)


def _recipe(tiny_model_dir, tiny_data, tmp_path, micro: int, accum: int, quantize: str = "none") -> TrainRecipe:
    cfg = TrainConfig(
        output_dir=str(tmp_path), seed=0,
        model=ModelConfig(path=str(tiny_model_dir), quantize=quantize, dtype="fp32"),
        data=DataConfig(path=str(tiny_data), max_seq_len=64, val_fraction=0.2),
        method=MethodConfig(r=4, alpha=8, dropout=0.0),
        trainer=TrainerConfig(max_steps=2, micro_batch_size=micro, grad_accum=accum),
    )
    r = TrainRecipe(cfg, tmp_path)
    r.setup()
    # lora_B starts at zero, which makes lora_A's gradient zero: give it values so both matter
    with torch.no_grad():
        for name, p in r.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(1))
    return r


def test_accumulation_equals_one_big_batch(tiny_model_dir, tiny_data, tmp_path):
    """8 examples as 4 micro-batches of 2 must give the gradient of the 8-example batch: the
    mean over all trained tokens, not the mean of 4 per-micro-batch means."""
    grads = {}
    for micro, accum in ((8, 1), (2, 4)):
        r = _recipe(tiny_model_dir, tiny_data, tmp_path / f"{micro}x{accum}", micro, accum)
        loss_sum, n_trained, _ = r._train_step(0)
        loss = loss_sum.item() / n_trained
        grads[(micro, accum)] = (loss, [p.grad.clone() for p in r.params])
        r.tracker.close()
    (l1, g1), (l2, g2) = grads.values()
    assert l1 == pytest.approx(l2, rel=1e-5)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)  # fp32: summation order only


def test_held_out_loss_does_not_depend_on_how_rows_are_grouped(tiny_model_dir, tiny_data, tmp_path, monkeypatch):
    """evaluate() groups the held-out rows by length (tunekit.data.eval_micro_batches); the loss is a
    sum over rows with padding masked, so it must equal the fixed order's up to fp32 summation order:
    each row's token losses are the same ops on the same values (a different M may re-block a matmul:
    a few 2^-24 relative per value), then summed in another order over the 160 held-out trained tokens
    (at most 160 * 2^-24 ~ 1e-5 relative, ~sqrt(160) * 2^-24 ~ 8e-7 typically; 2e-5 bounds both). The
    partition itself (every row once, no padding counted) is test_data's; a dropped row moved this
    loss by 2.6e-5 on the random tiny model, whose tokens all cost about ln(vocab)."""
    import tunekit.train.loop as recipe_module
    from tunekit.data import eval_batches, eval_micro_batches

    r = _recipe(tiny_model_dir, tiny_data, tmp_path, 4, 1)
    r.probe = None  # the sample answers are not what this compares
    lengths = [len(e["input_ids"]) for e in r.val_data]
    fixed = eval_batches(len(lengths), 4, 1, 0)
    grouped = eval_micro_batches(lengths, 4, 1, 0)
    padded = lambda batches: sum(len(b) * max(lengths[i] for i in b) for b in batches)  # noqa: E731
    assert padded(grouped) < padded(fixed)  # the two orders really batch differently here
    loss_grouped = r.evaluate(0)["val_loss"]
    def fixed_order(lengths, size, world, rank, min_padding=True):
        return eval_batches(len(lengths), size, world, rank)

    monkeypatch.setattr(recipe_module, "eval_micro_batches", fixed_order)
    loss_fixed = r.evaluate(0)["val_loss"]
    assert loss_grouped == pytest.approx(loss_fixed, rel=2e-5)
    r.tracker.close()


def test_mean_of_means_would_differ(tiny_model_dir, tiny_data, tmp_path):
    """Guard that the test above can fail: per-micro-batch means weight tokens unequally."""
    r = _recipe(tiny_model_dir, tiny_data, tmp_path, 2, 4)
    from tunekit.data import collate

    micro = [collate([r.train_data[i] for i in mb], r.tokenizer.pad_token_id) for mb in r.schedule.micro_batches(0)]
    sums = [sft_loss(r.model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits, b["labels"])
            for b in micro]
    token_mean = sum(s for s, _ in sums) / sum(n for _, n in sums)
    mean_of_means = sum(s / n for s, n in sums) / len(sums)
    assert abs(token_mean.item() - mean_of_means.item()) > 1e-4
    r.tracker.close()


def test_warmup_then_cosine_to_zero():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    sched = warmup_cosine(opt, warmup_steps=4, max_steps=20)
    lrs = []
    for _ in range(20):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert lrs[:4] == pytest.approx([0.2, 0.4, 0.6, 0.8])
    assert lrs[4] == pytest.approx(1.0) and lrs[12] == pytest.approx(0.5)
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:])) and lrs[-1] < 0.02


@pytest.mark.parametrize("name", ["adamw", "adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit"])
def test_every_optimizer_steps_on_cpu(name, caplog):
    # 8-bit state needs >= 4096 elements, paging >= 1e5 (bitsandbytes thresholds)
    caplog.set_level("INFO")
    p = torch.nn.Parameter(torch.randn(512, 256))
    opt = build_optimizer(name, [p], lr=1e-2, weight_decay=0.0, device=torch.device("cpu"))
    before = p.detach().clone()
    (p ** 2).sum().backward()
    opt.step()
    assert not torch.equal(before, p.detach()) and (p.detach().abs().sum() < before.abs().sum())
    if name.startswith("paged"):
        assert any("no paging on cpu" in r.message for r in caplog.records)


@pytest.mark.parametrize("device, fused", [("cuda", True), ("cuda:1", True), ("cpu", None)])
def test_adamw_is_fused_on_a_gpu(device, fused):
    """torch's fused AdamW on CUDA (one kernel per step, counters on the device); the default on a
    CPU. Built here over a CPU tensor, which torch's fused AdamW also accepts: the choice is what is tested."""
    p = torch.nn.Parameter(torch.randn(8))
    opt = build_optimizer("adamw", [p], lr=1e-2, weight_decay=0.0, device=torch.device(device))
    assert opt.defaults["fused"] is fused
