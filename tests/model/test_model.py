"""Base model loading: NF4 + double quant via bitsandbytes, bits/param, path errors."""

from __future__ import annotations

import json
from pathlib import Path

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


# ---------------------------------------------------------------- weights that do not fit, or are not finite
def _variant(tiny: Path, out: Path, tensors: dict | None = None, config: dict | None = None,
             pickle: bool = False) -> Path:
    """A copy of the tiny model folder with other tensors and/or another config.json (the rest linked)."""
    from safetensors.torch import save_file

    out.mkdir()
    for p in tiny.iterdir():
        if p.name not in ("config.json", "model.safetensors"):
            (out / p.name).symlink_to(p)
    (out / "config.json").write_text(json.dumps({**json.loads((tiny / "config.json").read_text()), **(config or {})}))
    if tensors is None:
        (out / "model.safetensors").symlink_to(tiny / "model.safetensors")
    elif pickle:  # no header to read before the load: only the loading info and the loaded model tell
        torch.save(tensors, out / "pytorch_model.bin")
    else:
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def tiny_tensors(tiny_model_dir):
    from safetensors.torch import load_file

    return load_file(tiny_model_dir / "model.safetensors")


def test_tied_head_and_old_buffers_are_not_misfits(tiny_model_dir, tiny_tensors, tmp_path):
    """A tied pair is present under either name (here only the head's), and a per-layer rotary inv_freq
    of an older checkpoint is a buffer the model computes: neither is a missing or surplus weight."""
    from tunekit.model.folder import check_weights_match, model_skeleton

    tensors = {k: v for k, v in tiny_tensors.items() if k != "model.embed_tokens.weight"}
    tensors["lm_head.weight"] = tiny_tensors["model.embed_tokens.weight"]
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    folder = _variant(tiny_model_dir, tmp_path / "head-only", tensors)
    check_weights_match(folder, model_skeleton(str(folder)), "model.path")
    model = load_base_model(str(folder), "none", torch.bfloat16, CPU)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.model.embed_tokens.weight, tiny_tensors["model.embed_tokens.weight"])


def test_nonfinite_4bit_weight_is_found_in_its_block_scales(tiny_model_dir, tiny_tensors, tmp_path):
    """A 4-bit weight is packed codes; one NaN weight makes its block's scale NaN, and that is checked."""
    name = "model.layers.1.mlp.up_proj.weight"
    bad = tiny_tensors[name].clone()
    bad[5, 7] = float("nan")
    folder = _variant(tiny_model_dir, tmp_path / "nan-one", {**tiny_tensors, name: bad})
    with pytest.raises(TunekitError, match=rf"^model.path: the weights in {folder} hold NaN or infinite values, "
                                           rf"in 1 tensor\(s\), first {name}:"):
        load_base_model(str(folder), "nf4", torch.bfloat16, CPU)


def test_loading_info_catches_what_no_header_shows(tiny_model_dir, tiny_tensors, tmp_path):
    """Pickle checkpoints have no header to read: the loading info (config with one layer fewer than the
    weights) and, for a 4-bit load that quantizes a wrong-shaped tensor without a word, the quantization
    state's shape against the layer's."""
    fewer = _variant(tiny_model_dir, tmp_path / "fewer", dict(tiny_tensors), {"num_hidden_layers": 1}, pickle=True)
    with pytest.raises(TunekitError, match=r"do not fit its config.json: 9 tensor\(s\) in the files fit no weight of "
                                           r"the config \(model.layers.1.input_layernorm.weight, "):
        load_base_model(str(fewer), "none", torch.bfloat16, CPU)
    q = "model.layers.1.self_attn.q_proj.weight"
    narrow = _variant(tiny_model_dir, tmp_path / "narrow", {**tiny_tensors, q: tiny_tensors[q][:32].clone()},
                      pickle=True)
    with pytest.raises(TunekitError, match=rf"1 tensor\(s\) have another shape than the config gives them \({q} is "
                                           r"\[32, 64\] in the files, \[64, 64\] in the config\)"):
        load_base_model(str(narrow), "nf4", torch.bfloat16, CPU)


def test_a_preloaded_tokenizer_is_handed_out_once_and_only_for_unchanged_files(tiny_model_dir, tmp_path):
    """What a fork server preloads (tunekit.model.loader.preload_tokenizer) is a process's first
    load_tokenizer of that folder; the next load is a fresh object (a run adds tokens to its own), and
    a folder whose files changed since is read again."""
    import shutil

    from tunekit.model import loader

    folder = tmp_path / "m"
    shutil.copytree(tiny_model_dir, folder)
    loader.preload_tokenizer(str(folder))
    preloaded = loader._PRELOADED[str(folder.resolve())][1]
    first, second = loader.load_tokenizer(str(folder)), loader.load_tokenizer(str(folder))
    assert first is preloaded and second is not preloaded
    assert second("hello world").input_ids == first("hello world").input_ids

    loader.preload_tokenizer(str(folder))
    stale = loader._PRELOADED[str(folder.resolve())][1]
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["model_max_length"] = 77
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    fresh = loader.load_tokenizer(str(folder))
    assert fresh is not stale and fresh.model_max_length == 77
    assert not loader._PRELOADED  # the stale one was dropped, not kept for a later load
