"""The fused-path decision: slower is not wrong, and every rank takes rank 0's decision.

On the CPU: the CUDA branch runs with fake sm_90 facts (the kernel itself under Triton's
interpreter) and faked timings; the ranks' broadcast is a plain function.
"""

from __future__ import annotations

import json
import logging
import pickle

import pytest
import torch

from tunekit import TunekitError
from tunekit.device import facts as dev
from tunekit.methods import MethodConfig
from tunekit.methods.lora.backend import (
    FusedDecision,
    FusedLoRALinear4bit,
    KernelCheck,
    agree_on_backend,
    apply_path,
    broadcast_from_rank0,
    choose_lora_backend,
    lora_4bit_layers,
)
from tunekit.methods import get_method
from tunekit.model import load_base_model

H100 = dev.DeviceFacts("cuda", 0, (9, 0), "H100")


def _qlora_tiny(tiny_model_dir, dtype=torch.float32):
    base = load_base_model(str(tiny_model_dir), "nf4", dtype, torch.device("cpu"))
    model = get_method("lora").apply(base, MethodConfig(r=4, alpha=8, dropout=0.0))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.1)
    return model


def _paths(model) -> set[str]:
    return {type(m).__name__ for _, m in lora_4bit_layers(model)}


@pytest.fixture
def fake_h100(monkeypatch):
    monkeypatch.setattr(dev, "fused_kernel_support", lambda *a, **k: (True, "fake sm_90"))


def test_correct_but_slower_falls_back_under_auto_and_is_kept_under_on(tiny_model_dir, fake_h100, monkeypatch,
                                                                        caplog):
    model = _qlora_tiny(tiny_model_dir)
    monkeypatch.setattr("tunekit.methods.lora.backend.time_layer", lambda layer, dtype, **kw: (3.0, 2.0))
    auto = choose_lora_backend(model, "auto", H100, torch.float32)
    assert auto.path == "peft" and "correct but slower than peft + bitsandbytes" in auto.reason
    assert "12.00 ms vs 8.00 ms" in auto.reason  # 4 weight shapes x (3.0 vs 2.0)
    assert not any(isinstance(m, FusedLoRALinear4bit) for m in model.modules())

    with caplog.at_level(logging.WARNING, logger="tunekit.methods.lora.backend"):
        on = choose_lora_backend(model, "on", H100, torch.float32)  # no TunekitError: the user asked for it
    assert on.path == "fused" and on.layers == 14 and "correct but slower" in on.reason
    assert _paths(model) == {"FusedLoRALinear4bit"}
    assert any("correct but slower" in r.getMessage() and "as asked" in r.getMessage() for r in caplog.records)
    assert [c["fused_ms"] for c in on.as_dict()["checks"]] == [3.0] * 4  # the figures go to summary.json


def test_a_wrong_kernel_still_fails_under_on_even_when_fast(tiny_model_dir, fake_h100, monkeypatch):
    import tunekit_kernels
    from tunekit_kernels.reference import lora_linear_reference

    model = _qlora_tiny(tiny_model_dir)
    monkeypatch.setattr("tunekit.methods.lora.backend.time_layer", lambda layer, dtype, **kw: (1.0, 2.0))
    monkeypatch.setattr(tunekit_kernels, "fused_lora_linear",
                        lambda x, quant, A, B, scaling, **kw: lora_linear_reference(x, quant, A, B, scaling * 1.01))
    with pytest.raises(TunekitError, match="differs from its reference"):
        choose_lora_backend(model, "on", H100, torch.float32)


# The kernel's proof in fp32 (the doctor below checks in fp32): each compared tensor (y, dx, dA, dB)
# is at most two chained fp32 reductions over K <= 128 terms (in/out features <= 128, 64 tokens, rank
# 16) of random-sign products, computed in another order than the twin's. Each reduction's error grows
# as sqrt(K) * 2^-24 ~ 6.7e-7 of the result's scale; 1e-5 leaves 7x over two of them. A wrong kernel
# (the 1% fault below, a dropped term) is off by >= 1e-2.
FP32_PROOF_TOL = 1e-5


def test_a_kernel_with_the_right_output_and_wrong_gradients_fails_its_proof(tiny_model_dir, fake_h100, monkeypatch):
    """The proof compares dx, dA and dB too, in fp32 as in bf16 (in fp32 the fused run and the twin's
    inputs must be separate leaves, or both runs' gradients land in the same tensors): a kernel whose
    output is exact and whose every gradient is half what it should be differs by exactly 5e-1."""
    import tunekit_kernels
    from tunekit_kernels.reference import lora_linear_reference

    def half_gradients(x, quant, A, B, scaling, **kw):
        y = lora_linear_reference(x, quant, A, B, scaling)
        return y.detach() + 0.5 * (y - y.detach())  # y's values, half its gradient

    model = _qlora_tiny(tiny_model_dir)
    monkeypatch.setattr("tunekit.methods.lora.backend.time_layer", lambda layer, dtype, **kw: (1.0, 2.0))
    monkeypatch.setattr(tunekit_kernels, "fused_lora_linear", half_gradients)
    with pytest.raises(TunekitError, match=r"differs from its reference by 5\.00e-01"):
        choose_lora_backend(model, "on", H100, torch.float32)


def _doctor(tmp_path, tiny_model_dir):
    from tunekit.commands.doctor import Doctor

    d = Doctor(None, None, 2, tmp_path, {}, start="fresh")
    d.fused_ok, d.model_path, d.dtype, d.device, d.facts = True, str(tiny_model_dir), torch.float32, \
        torch.device("cpu"), H100
    d.report["environment"] = {"fused_kernel": {"why": "fake sm_90"}}
    return d


def test_in_bf16_a_gpu_that_does_not_take_the_kernel_computes_lora_in_bf16(tiny_model_dir, fake_h100, monkeypatch):
    """Not peft's fp32 branch (an fp32 copy of every LoRA input, which the planner does not plan for
    under the bf16 policy) but the torch path, checked against the twin like the kernel."""
    model = _qlora_tiny(tiny_model_dir, torch.bfloat16)
    monkeypatch.setattr("tunekit.methods.lora.backend.time_layer", lambda layer, dtype, **kw: (3.0, 2.0))
    slower = choose_lora_backend(model, "auto", H100, torch.bfloat16)
    assert slower.path == "torch" and "correct but slower" in slower.reason and "LoRA matmuls in bf16" in slower.reason
    assert _paths(model) == {"TorchLoRALinear4bit"} and slower.dense_dtype is None  # no dense copy on a GPU
    monkeypatch.setattr(dev, "fused_kernel_support", lambda *a, **k: (False, "triton is not installed"))
    missing = choose_lora_backend(model, "auto", H100, torch.bfloat16)
    assert missing.path == "torch" and missing.reason.startswith("triton is not installed; instead: ")
    assert choose_lora_backend(model, "off", H100, torch.bfloat16).path == "peft"  # off is off


def test_doctor_passes_a_correct_kernel_that_is_slower(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr("tunekit.methods.lora.backend.time_layer", lambda layer, dtype, **kw: (3.0, 2.0))
    d = _doctor(tmp_path, tiny_model_dir)
    d.kernels()
    c = d.report["checks"]["kernels"]
    assert c["ok"] is True and c["error"] is None
    assert (c["fused_ms"], c["peft_ms"]) == (12.0, 8.0)
    assert c["note"] == "slower than peft (12.00 ms vs 8.00 ms): training keeps peft under auto"
    assert "correct but slower" in c["detail"] and len(c["shapes"]) == 4
    # one per weight shape: q/o, k/v, gate/up, down
    assert {tuple(sh["shape"]) for sh in c["shapes"]} == {(64, 64), (32, 64), (128, 64), (64, 128)}
    assert all(0 <= sh["max_rel_err"] <= FP32_PROOF_TOL for sh in c["shapes"]), c["shapes"]

    monkeypatch.setattr("tunekit.methods.lora.backend.time_layer", lambda layer, dtype, **kw: (1.0, 2.0))
    d.kernels()  # faster: ok, no note
    c = d.report["checks"]["kernels"]
    assert c["ok"] is True and c["note"] is None and "2.00x peft's speed" in c["detail"]


def test_doctor_fails_a_wrong_kernel_and_a_changed_adapter(tiny_model_dir, tmp_path, monkeypatch):
    import tunekit_kernels
    from tunekit_kernels.reference import lora_linear_reference

    d = _doctor(tmp_path, tiny_model_dir)

    def meddling(layer, dtype, **kw):  # a timing run that leaves the adapter changed
        with torch.no_grad():
            next(iter(layer.lora_A.values())).weight.add_(1.0)
        return 1.0, 2.0

    monkeypatch.setattr("tunekit.methods.lora.backend.time_layer", meddling)
    d.kernels()
    c = d.report["checks"]["kernels"]
    assert c["ok"] is False and "the proof lost or changed the adapter" in c["error"]

    monkeypatch.setattr("tunekit.methods.lora.backend.time_layer", lambda layer, dtype, **kw: (1.0, 2.0))
    monkeypatch.setattr(tunekit_kernels, "fused_lora_linear",
                        lambda x, quant, A, B, scaling, **kw: lora_linear_reference(x, quant, A, B, scaling * 1.01))
    d.kernels()
    c = d.report["checks"]["kernels"]
    assert c["ok"] is False and "differs from its reference" in c["detail"] and c["note"] is None
    # the first shape already fails, by the whole fault: it scales dA and dB by 1.01, a relative error
    # of 1e-2 up to fp32 rounding (FP32_PROOF_TOL: 1e-3 of it), and the maximum over y, dx, dA and dB
    # can only be larger
    (first,) = c["shapes"]
    assert first["max_rel_err"] >= 1e-2 - FP32_PROOF_TOL, first


# ------------------------------------------------------------------ several ranks
def _ranks(rank0: FusedDecision):
    """A broadcast as between two ranks: every rank receives what rank 0 sent, through pickling."""
    sent = pickle.dumps(rank0.as_dict())
    return lambda obj: pickle.loads(sent)


def test_every_rank_takes_rank_0s_decision(tiny_model_dir):
    checks = [KernelCheck((64, 64), 1e-6, 1.0, 2.0, passed=True)]
    rank0 = FusedDecision("auto", "fused", "2.00x peft's speed", layers=14, checks=checks)

    # rank 0 itself: its own decision back, marked as rank 0's
    agreed = agree_on_backend(rank0, _ranks(rank0))
    assert agreed.path == "fused" and agreed.decided_by == "rank 0"
    assert agreed.as_dict() == {**rank0.as_dict(), "decided_by": "rank 0"}
    json.dumps(agreed.as_dict())  # summary.json material

    # rank 1 timed peft faster (timings differ per GPU): it switches to rank 0's fused kernel
    model = _qlora_tiny(tiny_model_dir)
    choose_lora_backend(model, "off", dev.DeviceFacts("cpu"), torch.float32)
    assert _paths(model) == {"Linear4bit"}
    local = FusedDecision("auto", "peft", "correct but slower here", checks=[KernelCheck((64, 64), 1e-6, 3.0, 2.0,
                                                                                        passed=True)])
    agreed = agree_on_backend(local, _ranks(rank0), model)
    assert agreed.path == "fused" and agreed.decided_by == "rank 0" and agreed.reason == rank0.reason
    assert _paths(model) == {"FusedLoRALinear4bit"}

    # and the other way round: rank 0 kept peft, this rank had switched to the kernel
    peft0 = FusedDecision("auto", "peft", "correct but slower", checks=checks)
    agreed = agree_on_backend(FusedDecision("auto", "fused", "faster here", layers=14), _ranks(peft0), model)
    assert agreed.path == "peft" and _paths(model) == {"Linear4bit"}

    with pytest.raises(ValueError, match="pass the model"):
        agree_on_backend(FusedDecision("auto", "peft", "slower here"), _ranks(rank0))


def test_a_rank_whose_kernel_check_failed_refuses_rank_0s_fused(tiny_model_dir):
    rank0 = FusedDecision("auto", "fused", "2.00x peft's speed", layers=14)
    local = FusedDecision("auto", "peft", "differs", checks=[KernelCheck((64, 64), 0.3, passed=False)])
    with pytest.raises(TunekitError, match="rank 0 chose the fused kernel, but on this rank it differs by 3.00e-01"):
        agree_on_backend(local, _ranks(rank0), _qlora_tiny(tiny_model_dir))


def test_the_torch_path_with_its_dense_copy_moves_to_other_ranks(tiny_model_dir):
    from tunekit.methods.lora.compute_dtype import CACHE_ATTR

    model = _qlora_tiny(tiny_model_dir, torch.bfloat16)
    rank0 = FusedDecision("auto", "torch", "LoRA matmuls in bf16", layers=14, dense_dtype="bf16")
    agree_on_backend(FusedDecision("auto", "peft", "no room here"), _ranks(rank0), model)
    assert _paths(model) == {"TorchLoRALinear4bit"}
    assert all(getattr(m.base_layer, CACHE_ATTR).dtype == torch.bfloat16 for _, m in lora_4bit_layers(model))
    apply_path(model, FusedDecision("auto", "peft", "off"))
    assert _paths(model) == {"Linear4bit"} and not any(hasattr(m, CACHE_ATTR) for m in model.modules())


def test_one_process_broadcast_is_the_identity():
    d = {"path": "fused", "checks": []}
    assert broadcast_from_rank0(d) == d
