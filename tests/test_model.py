"""Base model loading: NF4 + double quant via bitsandbytes, bits/param, path errors."""

from __future__ import annotations

import bitsandbytes as bnb
import bitsandbytes.functional as bnbf
import pytest
import torch
from transformers import AutoModelForCausalLM

from tunekit import TunekitError
from tunekit.model import compute_dtype, load_base_model, quantized_bits_per_param, resolve_model_path

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def nf4_model(tiny_model_dir):
    return load_base_model(str(tiny_model_dir), "nf4", torch.bfloat16, CPU)


def test_linear_layers_are_nf4_with_double_quant(nf4_model, tiny_model_dir):
    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    layers = {n: m for n, m in nf4_model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    assert len(layers) == 2 * 7  # q, k, v, o, gate, up, down per block; lm_head stays high precision
    assert not isinstance(nf4_model.lm_head, bnb.nn.Linear4bit)
    for name, layer in layers.items():
        state = layer.weight.quant_state
        assert state.quant_type == "nf4" and state.nested and state.blocksize == 64
        # The stored codes dequantize (by bitsandbytes itself) to the original weight within
        # NF4's resolution: the widest gap between adjacent NF4 levels is 0.723..1.0, so rounding
        # costs at most 0.139 x the block's absmax; the 8-bit double-quantized absmax adds up to
        # ~2% and bf16 output rounding ~0.4%: 0.17 x absmax bounds it, 0.10 would not.
        w = bnbf.dequantize_4bit(layer.weight.data, state).float()
        w_ref = ref.get_submodule(name).weight.float()
        blocks = w_ref.reshape(-1, 64)
        err = (w - w_ref).reshape(-1, 64).abs().max(dim=1).values
        ratio = err / blocks.abs().max(dim=1).values
        assert ratio.max() <= 0.17 and ratio.max() > 0.10, (name, ratio.max())


def test_bits_per_param(nf4_model):
    bits = quantized_bits_per_param(nf4_model)
    # 4 (codes) + 8/64 (absmax codes) + second-level fp32 absmax and offset; tiny layers (a few
    # thousand weights) pay more for the per-layer second level than big ones (4.127 on SmolLM2)
    assert 4.12 < bits < 4.16
    assert quantized_bits_per_param(torch.nn.Linear(4, 4)) is None


def test_eval_pass_does_not_change_training_math(nf4_model):
    """bitsandbytes repacks 4-bit weights on an eval no-grad CPU forward (AVX512-BF16 CPUs);
    the loader turns that off so validation never changes what training computes."""
    x = torch.randint(0, 1000, (2, 12))
    nf4_model.train()
    before = nf4_model(input_ids=x).logits
    nf4_model.eval()
    with torch.no_grad():
        evaluated = nf4_model(input_ids=x).logits
    nf4_model.train()
    after = nf4_model(input_ids=x).logits
    assert torch.equal(before, after) and torch.equal(before, evaluated)
    for m in nf4_model.modules():
        if isinstance(m, bnb.nn.Linear4bit):
            assert not getattr(m.weight.quant_state, "packing_format_for_cpu", False)


def test_bf16_base_is_frozen(tiny_model_dir):
    m = load_base_model(str(tiny_model_dir), "none", torch.bfloat16, CPU)
    assert m.dtype == torch.bfloat16 and not any(p.requires_grad for p in m.parameters())


def test_model_path_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(TunekitError, match="no model folder at"):
        resolve_model_path(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(TunekitError, match="no config.json"):
        resolve_model_path(str(tmp_path / "empty"))
    # a hub id is looked up (config.json) before anything loads: offline and not cached, one error
    with pytest.raises(TunekitError, match="'org/name' is not a local folder, is not in the local hub cache"):
        resolve_model_path("org/name")


def test_hub_id_offline_is_one_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from tunekit.model import load_tokenizer

    with pytest.raises(TunekitError, match="could not be loaded from the Hugging Face hub"):
        load_tokenizer("tunekit-test/does-not-exist")


def test_compute_dtype_choices():
    assert compute_dtype("fp32", CPU) == torch.float32
    assert compute_dtype("bf16", CPU) == torch.bfloat16
    assert compute_dtype("auto", CPU) in (torch.bfloat16, torch.float32)


def test_default_model_converts_once_when_processes_race(tmp_path, monkeypatch):
    """Test workers (or runs) starting together on a fresh machine: one converts, the rest wait
    for it and read its folder. Threads stand in for processes: flock locks open files, not pids."""
    import threading
    import time

    from tunekit.model import default as default_module

    monkeypatch.setenv("TUNEKIT_CACHE", str(tmp_path))
    calls = []

    def slow_convert(target):
        calls.append(target)
        time.sleep(0.3)  # long enough for every other thread to find no folder yet
        target.mkdir()
        (target / "config.json").write_text("{}")
        (target / "model.safetensors").write_bytes(b"")
        return target

    monkeypatch.setattr(default_module, "_convert", slow_convert)
    got = []
    threads = [threading.Thread(target=lambda: got.append(default_module.default_model_dir())) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(got) == 3 and len(set(got)) == 1


def test_unwritable_model_cache_is_one_clear_error(tmp_path, monkeypatch):
    from tunekit.model import default as default_module

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("TUNEKIT_CACHE", str(blocker / "cache"))  # a folder under a file: cannot exist
    with pytest.raises(TunekitError, match="cannot write its cache folder .*TUNEKIT_CACHE"):
        default_module.default_model_dir()
