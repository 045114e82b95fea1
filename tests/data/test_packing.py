"""Sequence packing: a packed row gives every example exactly the loss it has alone."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tunekit.data import IGNORE, collate, collate_packed, load_splits
from tunekit.model import load_base_model, load_tokenizer


def _per_token_ce(model, batch, use_cache=False):
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch}
    logits = model(**inputs, use_cache=use_cache).logits
    ce = F.cross_entropy(logits[:, :-1].transpose(1, 2), batch["labels"][:, 1:], reduction="none",
                         ignore_index=IGNORE)
    return ce  # (rows, seq - 1): position t scores token t + 1


def test_packed_row_gives_the_same_per_example_losses(tiny_model_dir, tiny_data):
    tok = load_tokenizer(str(tiny_model_dir))
    train, _ = load_splits(str(tiny_data), None, "auto", tok, 64, 0.2, None, 0)
    examples = train[:6]
    # float64: packed rows go through a masked attention kernel, single rows through the causal
    # one; in fp64 their different summation orders vanish and a tight tolerance can catch leaks
    model = load_base_model(str(tiny_model_dir), "none", torch.float64, torch.device("cpu"))
    torch.manual_seed(0)
    with torch.no_grad():  # random weights of a larger scale: a leak across examples would show
        for p in model.parameters():
            p.normal_(0, 0.2)

    alone = [_per_token_ce(model, collate([e], tok.pad_token_id))[0].sum() for e in examples]
    packed = collate_packed(examples, tok.pad_token_id)
    assert packed["input_ids"].shape == (1, sum(len(e["input_ids"]) for e in examples))  # no padding
    ce = _per_token_ce(model, packed)[0]
    start, together = 0, []
    for e in examples:
        n = len(e["input_ids"])
        together.append(ce[start : start + n - 1].sum())  # this example's predictions
        if start + n - 1 < ce.numel():
            assert ce[start + n - 1] == 0  # boundary: last token -> next example's first is masked
        start += n
    for a, b in zip(alone, together):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-9)

    # A leak would be visible: with a KV cache transformers skips packed-sequence detection and
    # attention crosses examples (same positions): the first example agrees, the others do not.
    leaky = _per_token_ce(model, packed, use_cache=True)[0]
    first = len(examples[0]["input_ids"]) - 1
    assert torch.equal(leaky[:first], ce[:first]) and not torch.allclose(leaky[first:], ce[first:], atol=1e-3)


def test_packing_option_gives_the_same_step(tiny_model_dir, tiny_data, tmp_path):
    from tunekit.config import DataConfig, ModelConfig, TrainConfig, TrainerConfig
    from tunekit.methods import MethodConfig
    from tunekit.train.loop import TrainRecipe

    results = []
    for packing in (False, True):
        cfg = TrainConfig(output_dir=str(tmp_path / str(packing)),
                          model=ModelConfig(path=str(tiny_model_dir), dtype="fp32"),
                          data=DataConfig(path=str(tiny_data), max_seq_len=64, packing=packing),
                          method=MethodConfig(r=4, dropout=0.0),
                          trainer=TrainerConfig(max_steps=1, micro_batch_size=4, grad_accum=2))
        r = TrainRecipe(cfg, tmp_path / str(packing))
        r.setup()
        loss, n_trained, n_input = r._train_step(0)
        results.append((loss, n_trained, n_input, [p.grad.clone() for p in r.params]))
        r.tracker.close()
    (l0, t0, i0, g0), (l1, t1, i1, g1) = results
    assert t0 == t1 and i0 == i1
    assert abs(l0 - l1) < 1e-5 * abs(l0)
    for a, b in zip(g0, g1):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
