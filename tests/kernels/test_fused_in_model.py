"""kernels.fused_lora: the fused kernel inside a real (tiny) QLoRA model equals peft's path."""

from __future__ import annotations

import pytest
import torch

from tunekit import TunekitError
from tunekit.methods import MethodConfig
from tunekit.methods import get_method
from tunekit.device import facts as dev
from tunekit.methods.lora.backend import PATHS, FusedLoRALinear4bit, choose_lora_backend
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


def _bf16_qlora_tiny(tiny_model_dir):
    """The tiny model in NF4 with bf16 compute and fresh LoRA (B = 0), as auto sees it on a bf16 CPU."""
    return get_method("lora").apply(load_base_model(str(tiny_model_dir), "nf4", torch.bfloat16, CPU),
                                    MethodConfig(r=4, alpha=8, dropout=0.0))


def _logits_and_grads(model, x):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=x).logits.float()
    logits.square().mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def _copy_lora(src, dst):
    with torch.no_grad():
        theirs = dict(src.named_parameters())
        for name, p in dst.named_parameters():
            if p.requires_grad:
                p.copy_(theirs[name])


def _rel_l2(got, want) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_model_matches_peft(tiny_model_dir, dtype):
    torch.manual_seed(1)
    model = _qlora_tiny(tiny_model_dir, dtype)
    x = torch.randint(0, 2000, (2, 9))
    keys_before = list(model.state_dict())
    ref_logits, ref_grads = _logits_and_grads(model, x)

    decision = choose_lora_backend(model, "on", CPU_FACTS, dtype)
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
        # (One op's typical error, ~1e-5, is no bound here: the 28 add up.)
        for name, got, want in [("logits", logits, ref_logits), *((n, grads[n], ref_grads[n]) for n in grads)]:
            err = ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()
            assert err <= 2e-4, f"{name}: relative error {err:.3g}"
        return
    assert_as_accurate_as_peft(tiny_model_dir, model, x, (ref_logits, ref_grads), (logits, grads))


def assert_as_accurate_as_peft(tiny_model_dir, model, x, peft_out, path_out):
    """bf16: peft and tunekit's path round differently (peft keeps the LoRA branch in fp32), and on
    a tiny random model gradients that are sums of cancelling terms amplify any rounding: two bf16
    paths can disagree by several % per entry while both are fine. So measure each against the
    same model computed in fp32 (same NF4 codes, same LoRA weights) and require tunekit's error
    to stay within 2x peft's plus the LoRA branch's own extra roundings (its input, A, B and
    output rounded to bf16: 4 x 2^-8 = 2^-6 relative). A wrong gradient (a missed term, a
    transposed operand) is off by O(1) and fails."""
    truth_model = _qlora_tiny(tiny_model_dir, torch.float32)
    _copy_lora(model, truth_model)
    truth_logits, truth_grads = _logits_and_grads(truth_model, x)
    (p_logits, p_grads), (t_logits, t_grads) = peft_out, path_out
    pairs = [("logits", t_logits, p_logits, truth_logits)] + [(n, t_grads[n], p_grads[n], truth_grads[n]) for n in p_grads]
    for name, mine, theirs, truth in pairs:
        e_mine, e_peft = _rel_l2(mine, truth), _rel_l2(theirs, truth)
        assert e_mine <= 2 * e_peft + 2**-6, f"{name}: error vs fp32 {e_mine:.3g}, peft's {e_peft:.3g}"


def test_torch_path_on_cpu(tiny_model_dir):
    """auto on a CPU with a bf16 base: the compute-dtype LoRA path; at init (B = 0) bit-identical to
    peft, and as accurate as peft afterwards."""
    from tunekit.methods.lora.backend import TorchLoRALinear4bit

    torch.manual_seed(2)
    model = _bf16_qlora_tiny(tiny_model_dir)
    x = torch.randint(0, 2000, (2, 9))
    with torch.no_grad():
        at_init = model(input_ids=x).logits
    decision = choose_lora_backend(model, "auto", dev.DeviceFacts("cpu", cpu_bf16=True), torch.bfloat16)
    assert decision.path == "torch" and decision.layers == 14 and len(decision.checks) == 4
    assert sum(isinstance(m, TorchLoRALinear4bit) for m in model.modules()) == 14
    with torch.no_grad():
        assert torch.equal(model(input_ids=x).logits, at_init)

    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    mine = _logits_and_grads(model, x)
    choose_lora_backend(model, "off", CPU_FACTS, torch.bfloat16)
    theirs = _logits_and_grads(model, x)
    assert_as_accurate_as_peft(tiny_model_dir, model, x, theirs, mine)
    # an fp32 base gains nothing from it: peft stays
    assert choose_lora_backend(model, "auto", CPU_FACTS, torch.float32).path == "peft"
    assert not any(hasattr(m, "_tunekit_dense") for m in model.modules())


def test_torch_path_keeps_a_dense_copy_where_memory_allows(tiny_model_dir, tmp_path):
    """With memory to spare the dequantized base is kept: same logits as bitsandbytes bit for bit,
    nothing of it in the saved adapter; on a machine 8x too small for it, no copy."""
    from tunekit.methods.lora.compute_dtype import CACHE_ATTR

    torch.manual_seed(3)
    model = _bf16_qlora_tiny(tiny_model_dir)
    x = torch.randint(0, 2000, (2, 9))
    with torch.no_grad():
        at_init = model(input_ids=x).logits
    from tunekit.methods.lora.backend import lora_4bit_layers

    dense = sum(m.base_layer.in_features * m.base_layer.out_features * 2 for _, m in lora_4bit_layers(model))
    small = dev.DeviceFacts("cpu", cpu_bf16=True, total_memory=8 * dense - 1)
    decision = choose_lora_backend(model, "auto", small, torch.bfloat16)
    assert decision.path == "torch" and "dequantized" not in decision.reason
    roomy = dev.DeviceFacts("cpu", cpu_bf16=True, total_memory=2**34)
    decision = choose_lora_backend(model, "auto", roomy, torch.bfloat16)
    assert "kept dequantized in bf16" in decision.reason
    assert sum(hasattr(m, CACHE_ATTR) for m in model.modules()) == 14
    with torch.no_grad():
        assert torch.equal(model(input_ids=x).logits, at_init)
    get_method("lora").save(model, tmp_path / "a")
    assert not any(CACHE_ATTR in k for k in model.state_dict())
    choose_lora_backend(model, "off", roomy, torch.bfloat16)  # back to peft: the copy goes
    assert not any(hasattr(m, CACHE_ATTR) for m in model.modules())


def test_fp32_base_keeps_a_dense_copy_where_memory_allows(tiny_model_dir):
    """A CPU without native bf16 computes the base in fp32 (model.dtype=auto). There the torch path
    is peft's own fp32 math; what it adds is the base dequantized once instead of twice per layer
    per micro-batch. So: with room for the fp32 copy, the torch path with that copy, the base's
    output equal to bitsandbytes' bit for bit (the same fp32 dequantization, then the same linear:
    checked with B = 0), and logits and gradients within fp32 rounding of peft's; without room, peft."""
    from tunekit.methods.lora.backend import lora_4bit_layers
    from tunekit.methods.lora.compute_dtype import CACHE_ATTR

    torch.manual_seed(4)
    model = _qlora_tiny(tiny_model_dir, torch.float32)  # non-zero B: the LoRA branch counts
    x = torch.randint(0, 2000, (2, 9))
    ref_logits, ref_grads = _logits_and_grads(model, x)
    dense = sum(m.base_layer.in_features * m.base_layer.out_features * 4 for _, m in lora_4bit_layers(model))
    no_bf16 = dict(cpu_bf16=False)
    small = dev.DeviceFacts("cpu", total_memory=8 * dense - 1, **no_bf16)
    decision = choose_lora_backend(model, "auto", small, torch.float32)
    assert decision.path == "peft" and "peft's fp32 LoRA is as fast" in decision.reason

    roomy = dev.DeviceFacts("cpu", total_memory=8 * dense, **no_bf16)
    decision = choose_lora_backend(model, "auto", roomy, torch.float32)
    assert decision.path == "torch" and "kept dequantized in fp32" in decision.reason
    kept = [getattr(m, CACHE_ATTR) for m in model.modules() if hasattr(m, CACHE_ATTR)]
    assert len(kept) == 14 and all(t.dtype == torch.float32 for t in kept)
    logits, grads = _logits_and_grads(model, x)
    assert grads.keys() == ref_grads.keys()
    # Same products as peft; the LoRA sum is taken as y + s * (xa B^T) in one op where peft scales
    # first, and dx's two terms are added in another order: each may differ by an fp32 rounding
    # (2^-24 relative) per op, carried through at most 2 x 14 layers (the bound of
    # test_fused_model_matches_peft: 2e-4). A lost or transposed term is off by O(1).
    for name, got, want in [("logits", logits, ref_logits), *((n, grads[n], ref_grads[n]) for n in grads)]:
        err = ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()
        assert err <= 2e-4, f"{name}: relative error {err:.3g}"

    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.zero_()
        dense_out = model(input_ids=x).logits
        choose_lora_backend(model, "off", roomy, torch.float32)  # back to peft: the copy goes
        assert not any(hasattr(m, CACHE_ATTR) for m in model.modules())
        assert torch.equal(dense_out, model(input_ids=x).logits)


def test_modes(tiny_model_dir, monkeypatch):
    model = _qlora_tiny(tiny_model_dir, torch.float32)
    off = choose_lora_backend(model, "off", CPU_FACTS, torch.float32)
    assert off.path == "peft" and not any(isinstance(m, FusedLoRALinear4bit) for m in model.modules())
    auto = choose_lora_backend(model, "auto", CPU_FACTS, torch.float32)  # never the slow interpreter off CUDA
    assert auto.path == "peft" and "peft's fp32 LoRA is as fast" in auto.reason
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(TunekitError, match="kernels.fused_lora=on: the fused kernel cannot run here"):
        choose_lora_backend(model, "on", CPU_FACTS, torch.float32)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    bf16_base = get_method("lora").apply(load_base_model(str(tiny_model_dir), "none", torch.float32, CPU),
                                         MethodConfig(r=4))
    with pytest.raises(TunekitError, match="no LoRA layer over a 4-bit base"):
        choose_lora_backend(bf16_base, "on", CPU_FACTS, torch.float32)


def test_fused_layers_save_every_tensor(tiny_model_dir, tmp_path):
    """A regression: with fused layers, peft saved 0 tensors and loading accepted it."""
    model = _qlora_tiny(tiny_model_dir, torch.float32)
    choose_lora_backend(model, "on", CPU_FACTS, torch.float32)
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
    monkeypatch.setattr("tunekit.methods.lora.backend.time_layer", lambda layer, dtype, **kw: (1.0, 2.0))
    ok = choose_lora_backend(model, "auto", h100, torch.float32)
    assert ok.path == "fused" and ok.layers == 14 and len(ok.checks) == 4  # 4 distinct weight shapes
    assert "0.50" not in ok.reason and "2.00x peft's speed" in ok.reason
    # each check: y, dx, dA, dB of one layer, each at most two chained fp32 reductions over K <= 128
    # random-sign terms in another order than the twin's, ~sqrt(K) * 2^-24 ~ 6.7e-7 of their scale
    # each: 1e-5 leaves 7x, and the 1% fault below is 1e3 times that
    assert all(0 <= c.max_rel_err <= 1e-5 for c in ok.checks), [c.max_rel_err for c in ok.checks]

    monkeypatch.setattr(tunekit_kernels, "fused_lora_linear", _broken(kind))
    fallback = choose_lora_backend(model, "auto", h100, torch.float32)
    assert fallback.path == "peft" and why in fallback.reason
    assert not any(isinstance(m, FusedLoRALinear4bit) for m in model.modules())
    with pytest.raises(TunekitError, match=f"kernels.fused_lora=on: .*{why}"):
        choose_lora_backend(model, "on", h100, torch.float32)


def test_auto_refuses_a_slower_kernel(tiny_model_dir, monkeypatch):
    h100 = dev.DeviceFacts("cuda", 0, (9, 0), "H100")
    model = _qlora_tiny(tiny_model_dir, torch.float32)
    monkeypatch.setattr(dev, "fused_kernel_support", lambda *a, **k: (True, "fake sm_90"))
    monkeypatch.setattr("tunekit.methods.lora.backend.time_layer", lambda layer, dtype, **kw: (3.0, 2.0))
    slow = choose_lora_backend(model, "auto", h100, torch.float32)
    assert slow.path == "peft" and "slower than peft" in slow.reason
    assert slow.as_dict()["checks"][0]["fused_ms"] == 3.0  # the figures go to summary.json
    asked = choose_lora_backend(model, "on", h100, torch.float32)  # correct but slower: `on` keeps it
    assert asked.path == "fused" and "correct but slower" in asked.reason


def test_pre_ampere_gpu_never_gets_bf16_kernels(tiny_model_dir):
    t4 = dev.DeviceFacts("cuda", 0, (7, 5), "Tesla T4")
    model = _qlora_tiny(tiny_model_dir, torch.float32)
    decision = choose_lora_backend(model, "auto", t4, torch.bfloat16)  # bf16 asked for: the torch path, not peft's fp32
    assert decision.path == "torch" and "no native bf16" in decision.reason
    with pytest.raises(TunekitError, match="no native bf16"):
        choose_lora_backend(model, "on", t4, torch.bfloat16)


@pytest.mark.parametrize("path", ["torch", "fused"])
def test_a_lora_term_below_bf16_resolution_survives(tiny_model_dir, path):
    """Early in training the LoRA term is ~1e-4 of a layer's output, below bf16's rounding step
    (2^-8 relative). With an fp32 input (an fp32 residual stream) peft adds its fp32 LoRA output to
    the base's in fp32, so the term survives; a path that rounds the sum to bf16 anyway drops it and
    evaluates the base instead of the trained model (seen: a val ppl 3% off the exported one).

    Measured as path(B) - path(B = 0) against peft's same difference. Both paths round x, A, B,
    x A^T and the product to bf16 (5 roundings of 2^-9, relative to the term): 2^-6 allows them;
    a bf16 sum is off by ~|y| 2^-9, ~20x the term here, and fails by orders of magnitude."""
    torch.manual_seed(3)
    model = _bf16_qlora_tiny(tiny_model_dir)
    name, layer = next((n, m) for n, m in model.named_modules() if n.endswith("q_proj") and hasattr(m, "lora_A"))
    x = torch.randn(16, layer.in_features)  # an fp32 residual stream
    B = layer.lora_B["default"].weight
    with torch.no_grad():
        y0 = layer(x)
        B.copy_(torch.randn(B.shape))
        unit = layer(x) - y0
        B.mul_(1e-4 * y0.norm() / unit.norm())  # the term is 1e-4 of the output
        want = layer(x) - y0
        assert want.norm() / y0.norm() < 2e-4
        mode, facts = ("on", CPU_FACTS) if path == "fused" else ("auto", dev.DeviceFacts("cpu", cpu_bf16=True))
        decision = choose_lora_backend(model, mode, facts, torch.bfloat16)
        assert decision.path == path, decision.reason
        assert isinstance(layer, PATHS[path]), name
        got = layer(x)
        assert got.dtype == torch.float32
        saved = B.clone()
        B.zero_()
        got = got - layer(x)
        B.copy_(saved)
    assert _rel_l2(got, want) <= 2**-6, f"LoRA term off by {_rel_l2(got, want):.3g} of itself"
