"""Rows for tokens a run adds (tunekit.model.vocab): growing the embeddings, their start, and LoRA
training, saving, reloading and merging exactly those rows (peft's trainable tokens), with a tied
and an untied head. In-memory Llamas of 256 tokens, fp32: each test takes well under a second."""

from __future__ import annotations

import pytest
import torch

from tunekit.methods import MethodConfig, get_method
from tunekit.model.vocab import (NEW_TOKENS_ATTR, adapter_token_ids, grow_embeddings, grow_for_adapter,
                                 new_token_ids, peft_token_indices)

VOCAB, NEW = 256, (256, 257)


def _llama(tied: bool, vocab: int = VOCAB, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).requires_grad_(False)


def _lora():
    return get_method("lora"), MethodConfig(name="lora", r=4, alpha=8.0, dropout=0.0, target_modules=["q_proj"])


@pytest.mark.parametrize("tied", [True, False])
def test_new_rows_start_at_the_mean_and_the_rest_stay(tied):
    model = _llama(tied)
    before_in = model.get_input_embeddings().weight.clone()
    before_out = model.get_output_embeddings().weight.clone()
    line = grow_embeddings(model, VOCAB + 2, NEW, VOCAB)
    w_in, w_out = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    assert w_in.shape == w_out.shape == (VOCAB + 2, 32)  # exactly the tokenizer's length: no padding rows
    assert (w_in is w_out) == tied
    assert torch.equal(w_in[:VOCAB], before_in) and torch.equal(w_out[:VOCAB], before_out)
    for w, before in ((w_in, before_in), (w_out, before_out)):
        assert torch.equal(w[VOCAB:], before.mean(dim=0).expand(2, -1))  # fp32 mean of fp32 rows: exact
    assert new_token_ids(model) == NEW and "256 -> 258 rows" in line
    assert peft_token_indices(model) == (list(NEW) if tied else {"embed_tokens": list(NEW), "lm_head": list(NEW)})


def test_spare_rows_take_the_new_ids_without_growing():
    """A vocabulary its authors padded (more rows than tokens): the new ids use the spare rows."""
    model = _llama(tied=True, vocab=VOCAB + 8)
    before = model.get_input_embeddings().weight.clone()
    line = grow_embeddings(model, VOCAB + 2, NEW, VOCAB)
    w = model.get_input_embeddings().weight
    assert w.shape[0] == VOCAB + 8 and "spare" in line
    assert torch.equal(w[:VOCAB], before[:VOCAB]) and torch.equal(w[VOCAB + 2:], before[VOCAB + 2:])
    assert torch.equal(w[VOCAB:VOCAB + 2], before[:VOCAB].mean(dim=0).expand(2, -1))


@pytest.mark.parametrize("tied", [True, False])
def test_lora_trains_saves_reloads_and_merges_only_the_new_rows(tied, tmp_path):
    method, cfg = _lora()
    model = _llama(tied)
    grow_embeddings(model, VOCAB + 2, NEW, VOCAB)
    start_in = model.get_input_embeddings().weight.detach().clone()
    start_out = model.get_output_embeddings().weight.detach().clone()
    peft_model = method.apply(model, cfg)
    trained = {n: p for n, p in peft_model.named_parameters() if p.requires_grad}
    rows = [n for n in trained if "trainable_tokens_delta" in n]
    assert len(rows) == (1 if tied else 2) and all(trained[n].shape == (2, 32) for n in rows)
    assert all(trained[n].dtype == torch.float32 for n in rows) and all(method.owns(n) for n in trained)
    # the loss reads the head's weight (tunekit.losses.sft): through the wrapper it holds the trained rows
    ids = torch.tensor([[1, 256, 7, 257, 3]])
    base = peft_model.get_base_model()
    hidden = base.get_decoder()(input_ids=ids).last_hidden_state
    loss = torch.nn.functional.cross_entropy((hidden[0] @ base.get_output_embeddings().weight.T), ids[0].roll(-1))
    loss.backward()
    assert all(trained[n].grad is not None and trained[n].grad.abs().sum() > 0 for n in rows)
    with torch.no_grad():
        for n in rows:
            trained[n].add_(1.0)  # a "trained" step, the same for every new row
    method.save(peft_model, tmp_path / "adapter")
    assert adapter_token_ids(tmp_path / "adapter") == NEW

    fresh = _llama(tied)  # a base as evaluation loads it: the adapter's ids grow it first
    grow_for_adapter(fresh, tmp_path / "adapter")
    assert getattr(fresh, NEW_TOKENS_ATTR) == NEW
    reloaded = method.apply(fresh, cfg)
    method.load(reloaded, tmp_path / "adapter")
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, peft_model(input_ids=ids).logits)
        merged = method.merge(reloaded)
    w_in, w_out = merged.get_input_embeddings().weight, merged.get_output_embeddings().weight
    assert type(merged.get_input_embeddings()).__name__ == "Embedding"  # no peft wrapper left
    assert torch.equal(w_in[:VOCAB], start_in[:VOCAB]) and torch.equal(w_out[:VOCAB], start_out[:VOCAB])
    assert torch.equal(w_in[VOCAB:], start_in[VOCAB:] + 1.0) and torch.equal(w_out[VOCAB:], start_out[VOCAB:] + 1.0)


def test_an_adapter_without_token_rows_grows_nothing(tmp_path):
    (tmp_path / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4}')
    model = _llama(tied=True)
    assert grow_for_adapter(model, tmp_path) is None and model.get_input_embeddings().weight.shape[0] == VOCAB
    assert new_token_ids(model) == ()


@pytest.mark.parametrize("tied", [True, False])
def test_training_reads_the_rows_apart_and_computes_what_peft_computes(tied):
    """The embeddings' lookup (lean_embeddings) and the loss's head (token_rows) without peft's copy
    of the matrix: the same loss and gradients as peft's merged matrix gives.

    Tolerance: fp32 throughout; a logit is a 32-term dot product, computed in another matmul (its own
    block for the added rows) and so summed in another order: ~32 x 2^-24 relative, summed over 5
    positions of CE ~5.6 each; rtol 1e-5 leaves ~10x room. The lookup is a copy: bit-equal."""
    from tunekit.losses.sft import linear_cross_entropy, select_trained, sft_loss_from_hidden
    from tunekit.model.vocab import token_rows

    method, cfg = _lora()
    model = _llama(tied)
    grow_embeddings(model, VOCAB + 2, NEW, VOCAB)
    peft_model = method.apply(model, cfg)
    with torch.no_grad():  # trained rows away from their start, so that a wrong row would show
        for n, p in peft_model.named_parameters():
            if "trainable_tokens_delta" in n:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    base = peft_model.get_base_model()
    layer = base.get_input_embeddings().token_adapter
    ids = torch.tensor([[1, 256, 7, 257, 3, 256]])
    assert torch.equal(layer(ids), type(layer).forward_adapters(layer, ids, layer.active_adapters))
    labels = ids.clone()

    def loss_and_grads(lean: bool):
        peft_model.zero_grad()
        embeds = layer if lean else (lambda x: type(layer).forward_adapters(layer, x, layer.active_adapters))
        hidden = base.get_decoder()(inputs_embeds=embeds(ids)).last_hidden_state
        head = base.get_output_embeddings()
        if lean:
            assert token_rows(head) is not None
            loss, _ = sft_loss_from_hidden(hidden, head, labels)
        else:  # peft's merged head: the whole matrix with the trained rows written in
            rows, targets = select_trained(hidden, labels)
            loss = linear_cross_entropy(rows, head.weight, None, targets)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in peft_model.named_parameters() if p.requires_grad}
        return loss.detach(), grads

    lean_loss, lean_grads = loss_and_grads(True)
    peft_loss, peft_grads = loss_and_grads(False)
    torch.testing.assert_close(lean_loss, peft_loss, rtol=1e-5, atol=0)
    assert lean_grads.keys() == peft_grads.keys()
    for name in lean_grads:
        torch.testing.assert_close(lean_grads[name], peft_grads[name], rtol=1e-5, atol=1e-7, msg=name)
    assert all(lean_grads[n].abs().sum() > 0 for n in lean_grads if "trainable_tokens_delta" in n)
