"""kernels.fused_lora: the fused kernel inside a real (tiny) QLoRA model equals peft's path."""

from __future__ import annotations

import pytest
import torch

from tunekit import TunekitError
from tunekit.config import MethodConfig
from tunekit.methods import get_method
from tunekit import device as dev
from tunekit.fused import FusedLoRALinear4bit, choose_lora_path
from tunekit.model import load_base_model

CPU = torch.device("cpu")
CPU_FACTS = dev.DeviceFacts("cpu")


def _qlora_tiny(tiny_model_dir, dtype):
    base = load_base_model(str(tiny_model_dir), "nf4", dtype, CPU)
    model = get_method("lora").apply(base, MethodConfig(r=4, alpha=8, dropout=0.0))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # non-zero so the LoRA branch and lora_A's gradient are exercised
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def _logits_and_grads(model, x):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=x).logits.float()
    logits.square().mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_model_matches_peft(tiny_model_dir, dtype, assert_close):
    model = _qlora_tiny(tiny_model_dir, dtype)
    x = torch.randint(0, 2000, (2, 9))
    keys_before = list(model.state_dict())
    ref_logits, ref_grads = _logits_and_grads(model, x)

    decision = choose_lora_path(model, "on", CPU_FACTS, dtype)
    assert decision.path == "fused" and decision.layers == 2 * 7
    assert sum(isinstance(m, FusedLoRALinear4bit) for m in model.modules()) == 14
    assert list(model.state_dict()) == keys_before  # adapters save under the same PEFT names
    logits, grads = _logits_and_grads(model, x)

    assert grads.keys() == ref_grads.keys()
    if dtype == torch.float32:
        # fp32: the two paths differ only in the summation order inside each of the 14 LoRA linears
        # (Triton tiles vs MKL). One reduction of length K errs by at most K * 2^-24 relative
        # (K <= 128 here: 7.6e-6), and a lora_B gradient in block 0 carries the errors of every
        # later forward layer and backward dx product (2 x 14 of them): 28 * 7.6e-6 ~ 2e-4 in the
        # worst case. A wrong kernel (a missed term, a transposed operand) is off by O(1).
        # (A 1e-5 bound, one op's typical error, failed on a CI machine at 1.18e-5.)
        for name, got, want in [("logits", logits, ref_logits), *((n, grads[n], ref_grads[n]) for n in grads)]:
            err = ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()
            assert err <= 2e-4, f"{name}: relative error {err:.3g}"
        return
    assert_close(logits, ref_logits, dtype, "logits")
    for name in grads:
        # bf16: peft runs the LoRA branch in the adapter's fp32 while the fused kernel runs it in
        # the compute dtype; that rounding compounds through two blocks, and per entry it reaches
        # several % of the largest gradient entry. Compare what an optimizer uses instead: the
        # direction and size of each gradient. A wrong gradient (a missed term, a transposed
        # operand) fails both by far. Measured here: cosine >= 0.9956, norms within 5.1%.
        a, b = grads[name].double().flatten(), ref_grads[name].double().flatten()
        cosine = torch.nn.functional.cosine_similarity(a, b, dim=0).item()
        ratio = (a.norm() / b.norm()).item()
        assert cosine >= 0.99 and abs(ratio - 1) <= 0.10, f"{name}: cosine {cosine:.4f}, norm ratio {ratio:.4f}"


def test_modes(tiny_model_dir, monkeypatch):
    model = _qlora_tiny(tiny_model_dir, torch.float32)
    off = choose_lora_path(model, "off", CPU_FACTS, torch.float32)
    assert off.path == "peft" and not any(isinstance(m, FusedLoRALinear4bit) for m in model.modules())
    auto = choose_lora_path(model, "auto", CPU_FACTS, torch.float32)  # CUDA only: never the slow interpreter
    assert auto.path == "peft" and "CUDA only" in auto.reason
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(TunekitError, match="kernels.fused_lora=on: the fused kernel cannot run here"):
        choose_lora_path(model, "on", CPU_FACTS, torch.float32)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    bf16_base = get_method("lora").apply(load_base_model(str(tiny_model_dir), "none", torch.float32, CPU),
                                         MethodConfig(r=4))
    with pytest.raises(TunekitError, match="no LoRA layer over a 4-bit base"):
        choose_lora_path(bf16_base, "on", CPU_FACTS, torch.float32)


def test_fused_layers_save_every_tensor(tiny_model_dir, tmp_path):
    """The regression of issue 10: with fused layers, peft saved 0 tensors and loading accepted it."""
    model = _qlora_tiny(tiny_model_dir, torch.float32)
    choose_lora_path(model, "on", CPU_FACTS, torch.float32)
    get_method("lora").save(model, tmp_path / "a")  # verifies by reading back, or raises
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "a" / "adapter_model.safetensors"))
    assert len(saved) == 2 * 7 * 2
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert torch.equal(saved[name.replace(".default", "")], p.detach())


def _broken(kind):
    def fused(x, quant, A, B, scaling, **kw):
        if kind == "compile":
            raise RuntimeError("CompilationError: at 1:2: bf16 dot needs sm_80")
        from tunekit_kernels.reference import lora_linear_reference

        return lora_linear_reference(x, quant, A, B, scaling * 1.01)  # 1% off: a wrong kernel
    return fused


@pytest.mark.parametrize("kind, why", [("compile", "failed on a"), ("mismatch", "differs from its reference")])
def test_auto_proves_the_kernel_and_falls_back(tiny_model_dir, monkeypatch, kind, why):
    """On CUDA, auto checks the kernel on real layers first; a failing kernel means peft, `on` means an error.
    The CUDA branch runs here with fake sm_90 facts (the kernel itself runs under the interpreter)."""
    import tunekit_kernels

    h100 = dev.DeviceFacts("cuda", 0, (9, 0), "H100")
    model = _qlora_tiny(tiny_model_dir, torch.float32)
    monkeypatch.setattr(dev, "fused_kernel_support", lambda *a, **k: (True, "fake sm_90"))
    monkeypatch.setattr("tunekit.fused.time_layer", lambda layer, dtype: (1.0, 2.0))
    ok = choose_lora_path(model, "auto", h100, torch.float32)
    assert ok.path == "fused" and ok.layers == 14 and len(ok.checks) == 4  # 4 distinct weight shapes
    assert "0.50" not in ok.reason and "2.00x peft's speed" in ok.reason
    assert all(c.max_rel_err <= 1e-4 for c in ok.checks)

    monkeypatch.setattr(tunekit_kernels, "fused_lora_linear", _broken(kind))
    fallback = choose_lora_path(model, "auto", h100, torch.float32)
    assert fallback.path == "peft" and why in fallback.reason
    assert not any(isinstance(m, FusedLoRALinear4bit) for m in model.modules())
    with pytest.raises(TunekitError, match=f"kernels.fused_lora=on: .*{why}"):
        choose_lora_path(model, "on", h100, torch.float32)


def test_auto_refuses_a_slower_kernel(tiny_model_dir, monkeypatch):
    h100 = dev.DeviceFacts("cuda", 0, (9, 0), "H100")
    model = _qlora_tiny(tiny_model_dir, torch.float32)
    monkeypatch.setattr(dev, "fused_kernel_support", lambda *a, **k: (True, "fake sm_90"))
    monkeypatch.setattr("tunekit.fused.time_layer", lambda layer, dtype: (3.0, 2.0))
    slow = choose_lora_path(model, "auto", h100, torch.float32)
    assert slow.path == "peft" and "slower than peft" in slow.reason
    assert slow.as_dict()["checks"][0]["fused_ms"] == 3.0  # the figures go to summary.json
    with pytest.raises(TunekitError, match="slower than peft"):
        choose_lora_path(model, "on", h100, torch.float32)


def test_pre_ampere_gpu_never_gets_bf16_kernels(tiny_model_dir):
    t4 = dev.DeviceFacts("cuda", 0, (7, 5), "Tesla T4")
    model = _qlora_tiny(tiny_model_dir, torch.float32)
    decision = choose_lora_path(model, "auto", t4, torch.bfloat16)
    assert decision.path == "peft" and "no native bf16" in decision.reason
    with pytest.raises(TunekitError, match="no native bf16"):
        choose_lora_path(model, "on", t4, torch.bfloat16)
