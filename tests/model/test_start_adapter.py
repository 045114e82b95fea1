"""model.adapter's checks on hand-made folders (small files only, no training): what a start adapter
must be, and the base it must match, before any model loads (tunekit.model.start_adapter)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tunekit import TunekitError
from tunekit.model.folder import model_skeleton
from tunekit.model.start_adapter import check_start_base, open_start
from tunekit.owned import sha256_file

PROJ = "base_model.model.model.layers.0.self_attn.q_proj"  # the tiny Llama: hidden 64, q_proj 64 -> 64


def _adapter(folder: Path, base, kind="LORA", shapes=((4, 64), (64, 4)), module=PROJ, **extra) -> Path:
    folder.mkdir(parents=True)
    cfg = {"peft_type": kind, "base_model_name_or_path": base, "r": 4, "lora_alpha": 8,
           "target_modules": ["q_proj"], **extra}
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    save_file({f"{module}.lora_A.weight": torch.zeros(shapes[0]), f"{module}.lora_B.weight": torch.zeros(shapes[1])},
              str(folder / "adapter_model.safetensors"))
    return folder


def _run(folder: Path, base, adapter=None) -> Path:
    _adapter(folder / "adapter", str(base))
    model = {"path": str(base) if base else None, **({"adapter": adapter} if adapter else {})}
    (folder / "config.yaml").write_text(json.dumps({"recipe": "lora", "model": model}))  # YAML reads JSON
    return folder


def _rename(folder: Path, old: str, new: str) -> Path:
    from safetensors.torch import load_file

    tensors = load_file(str(folder / "adapter_model.safetensors"))
    save_file({k.replace(old, new): v for k, v in tensors.items()}, str(folder / "adapter_model.safetensors"))
    return folder


@pytest.fixture(scope="module")
def skeleton(tiny_model_dir):
    return model_skeleton(str(tiny_model_dir), "model.path")


def test_a_run_and_a_peft_folder_that_fit_are_accepted(tiny_model_dir, skeleton, tmp_path):
    run = open_start(str(_run(tmp_path / "sft", tiny_model_dir)))
    assert run.folder == tmp_path / "sft" / "adapter" and run.run_dir == tmp_path / "sft"
    assert run.sha256 == sha256_file(run.folder / "adapter_model.safetensors")
    check_start_base(run, str(tiny_model_dir), skeleton)
    peft = open_start(str(_adapter(tmp_path / "peft", str(tiny_model_dir))))
    check_start_base(peft, str(tiny_model_dir), skeleton)
    unrecorded = open_start(str(_adapter(tmp_path / "bare", None)))  # no base recorded: its shapes decide
    assert check_start_base(unrecorded, str(tiny_model_dir), skeleton) is None
    assert unrecorded.record()["base"] == "(not recorded)"
    far = open_start(str(_adapter(tmp_path / "far", "org/tiny-llama")))  # a hub id: its shapes decide, and a note says so
    assert "org/tiny-llama, which is not a folder on this machine" in check_start_base(far, str(tiny_model_dir), skeleton)


@pytest.mark.parametrize("make, message", [
    (lambda t, m: t / "nope", "model.adapter: no such folder: {t}/nope"),
    (lambda t, m: (t / "empty").mkdir() or t / "empty", "model.adapter: {t}/empty holds no adapter"),
    (lambda t, m: _adapter(t / "ia3", str(m), kind="IA3"), "model.adapter: {t}/ia3 holds a IA3 adapter; model.adapter takes a LoRA"),
    (lambda t, m: _adapter(t / "dora", str(m), use_dora=True), "model.adapter: {t}/dora uses DoRA"),
    (lambda t, m: _run(t / "chain", m, adapter="runs/sft"), "model.adapter: the run {t}/chain itself started from the adapter runs/sft"),
    (lambda t, m: (_run(t / "cut", m) / "adapter" / "adapter_model.safetensors").unlink() or t / "cut",
     "model.adapter: the run {t}/cut has no finished adapter"),
])
def test_what_is_not_a_start_adapter_is_refused_in_one_line(make, message, tiny_model_dir, tmp_path):
    path = make(tmp_path, tiny_model_dir)
    with pytest.raises(TunekitError) as e:
        open_start(str(path))
    assert message.format(t=tmp_path) in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("make, message", [
    (lambda t: _run(t / "other", t),  # another folder on this machine
     "model.adapter: the run {t}/other trained over {t}, but model.path is {m}"),
    (lambda t: _adapter(t / "peft", str(t)),
     "model.adapter: {t}/peft was trained over {t}, but model.path is {m}"),
    (lambda t: _run(t / "default", None), "model.adapter: the run {t}/default trained over the default model"),
    (lambda t: _adapter(t / "wide", None, shapes=((4, 96), (96, 4))),
     "tensor base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight has shape [4, 96], but "
     "model.layers.0.self_attn.q_proj of model.path is Linear(64 -> 64)"),
    (lambda t: _adapter(t / "gpt2", None, module="base_model.model.transformer.h.0.attn.c_attn"),
     "names no Linear layer 'transformer.h.0.attn.c_attn' in LlamaForCausalLM"),
    (lambda t: _adapter(t / "head", None, shapes=((4, 64), (49152, 4)), module="base_model.model.lm_head"),
     "has a LoRA on the output head (lm_head)"),
    (lambda t: _adapter(t / "embed", None, module="base_model.model.model.embed_tokens", shapes=((4, 64), (64, 4)))
     and _rename(t / "embed", ".lora_", ".lora_embedding_"), "is not a Linear layer's lora_A/lora_B"),
])
def test_an_adapter_of_another_base_is_refused_naming_both(make, message, skeleton, tiny_model_dir, tmp_path):
    start = open_start(str(make(tmp_path)))
    with pytest.raises(TunekitError) as e:
        check_start_base(start, str(tiny_model_dir), skeleton)
    assert message.format(t=tmp_path, m=tiny_model_dir) in str(e.value) and "\n" not in str(e.value)
