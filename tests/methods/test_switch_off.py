"""A method's `switched_off` (the reference model of objective=preference): with the trained part moved
away from its identity start, the model computes exactly the frozen base inside the context, and the
trained model again after it. Exact: inside the context the same base ops run on the same weights
(peft's disable_adapter skips the LoRA branch; the hooks return before touching the output)."""

from __future__ import annotations

import pytest
import torch

from tunekit import TunekitError
from tunekit.methods import MethodConfig, get_method
from tunekit.model import load_base_model

SWITCHABLE = {"lora": {"r": 4, "alpha": 8, "dropout": 0.0}, "ia3": {}, "bitfit": {}, "adapter": {"bottleneck": 8}}


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


@pytest.mark.parametrize("name", sorted(SWITCHABLE))
def test_switched_off_is_the_base(name, tiny_model_dir):
    ids = torch.randint(10, 1000, (2, 6), generator=torch.Generator().manual_seed(0))
    base = load_base_model(str(tiny_model_dir), "none", torch.float32, torch.device("cpu"))
    want = _logits(base, ids)
    method = get_method(name)
    model = method.apply(base, MethodConfig(name=name, **SWITCHABLE[name]))
    with torch.no_grad():  # move the trained part off its identity start
        g = torch.Generator().manual_seed(1)
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.5 * torch.randn(p.shape, generator=g))
    trained = _logits(model, ids)
    assert (trained - want).abs().max() > 1e-2  # the trained part does change the outputs
    with method.switched_off(model):
        torch.testing.assert_close(_logits(model, ids), want, atol=0, rtol=0)
    torch.testing.assert_close(_logits(model, ids), trained, atol=0, rtol=0)


@pytest.mark.parametrize("name", ["full", "prompt_tuning"])
def test_methods_without_a_separate_part_cannot_switch_off(name):
    method = get_method(name)
    assert not method.can_switch_off
    with pytest.raises(TunekitError, match=f"method {name}: its trained part cannot be switched off"):
        method.switched_off(None)
