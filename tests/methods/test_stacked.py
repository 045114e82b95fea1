"""A new LoRA over a frozen start LoRA (model.adapter; tunekit.methods.lora.stacked), in process on the tiny
model in fp32: only the new adapter trains and receives gradients, the start stays bit for bit, the
reference (the new adapter switched off) is exactly base + start, and what is saved is the new adapter
alone with a record of the start.

Exact comparisons: inside `switched_off` every LoRA layer runs the same ops as a model holding the start
alone, plus the new adapter's output scaled by 0, and x + 0 == x in floating point; at the start the new
adapter's B is 0, so its output is an exact zero in the trained model too."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tunekit.methods import MethodConfig, get_method
from tunekit.model import load_base_model
from tunekit.owned import sha256_file

NEW = MethodConfig(name="lora", r=4, alpha=8, dropout=0.0, target_modules=["all-linear"])


def _base(tiny_model_dir):
    return load_base_model(str(tiny_model_dir), "none", torch.float32, torch.device("cpu"))


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


@pytest.fixture(scope="module")
def start_dir(tiny_model_dir, tmp_path_factory):
    """A peft LoRA on q_proj and v_proj whose B is far from 0 (a trained start), saved with a dropout."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=2, lora_alpha=4, lora_dropout=0.5, target_modules=["q_proj", "v_proj"])  # a dropout to drop
    model = get_peft_model(_base(tiny_model_dir), config)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
    out = tmp_path_factory.mktemp("start") / "peft"
    model.save_pretrained(out)
    return out


def test_only_the_new_adapter_trains_and_the_start_stays_exact(start_dir, tiny_model_dir, tmp_path):
    from peft import PeftModel

    ids = torch.randint(10, 1000, (2, 6), generator=torch.Generator().manual_seed(0))
    want = _logits(PeftModel.from_pretrained(_base(tiny_model_dir), str(start_dir)), ids)  # base + start
    assert (want - _logits(_base(tiny_model_dir), ids)).abs().max() > 1e-2  # the start matters
    lora = get_method("lora")
    model = lora.apply_over_start(_base(tiny_model_dir), NEW, start_dir)
    start = {n: p.detach().clone() for n, p in model.named_parameters() if ".start." in n}
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(start) == 2 * 2 * 2 and trained and all(".default." in n for n in trained)
    assert {n for n in trained} == {n for n, _ in model.named_parameters() if lora.owns(n)}
    torch.testing.assert_close(_logits(model, ids), want, atol=0, rtol=0)  # B = 0: the model starts at base + start

    model.train()  # the start's own dropout is not applied: it is part of the model, as in evaluation
    torch.testing.assert_close(_logits(model, ids), want, atol=0, rtol=0)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(2):
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        assert all(p.grad is None for n, p in model.named_parameters() if ".start." in n)
        assert any(p.grad.abs().max() > 0 for n, p in model.named_parameters() if ".lora_B.default." in n)
        opt.step()
        opt.zero_grad()
    model.eval()
    assert all(torch.equal(p, start[n]) for n, p in model.named_parameters() if ".start." in n)
    moved = _logits(model, ids)
    assert (moved - want).abs().max() > 1e-3  # the new adapter learned something
    with lora.switched_off(model):  # the reference: base + start, the new adapter scaled by 0
        torch.testing.assert_close(_logits(model, ids), want, atol=0, rtol=0)
    torch.testing.assert_close(_logits(model, ids), moved, atol=0, rtol=0)  # and back

    lora.save(model, tmp_path / "adapter")
    saved = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert saved and not any("start" in k for k in saved)  # the new adapter alone ...
    record = json.loads((tmp_path / "adapter" / "start_adapter.json").read_text())  # ... and which start
    assert record["sha256"] == sha256_file(start_dir / "adapter_model.safetensors")
    again = lora.apply_over_start(_base(tiny_model_dir), NEW, start_dir)
    lora.load(again, tmp_path / "adapter")
    torch.testing.assert_close(_logits(again.eval(), ids), moved, atol=0, rtol=0)
