"""Fused LoRA-over-NF4 linear vs its torch twin and vs peft's LoRA layer on bnb Linear4bit."""

from __future__ import annotations

import bitsandbytes as bnb
import bitsandbytes.functional as bnbF
import peft
import pytest
import torch
from peft.tuners.lora.bnb import Linear4bit as PeftLoraLinear4bit

import tunekit_kernels as tk
from tunekit_kernels.reference import lora_linear_reference

IN, OUT, R = 200, 137, 8  # deliberately not multiples of the tile or NF4 block sizes


def _quant(n_in, n_out, device="cpu", seed=0):
    torch.manual_seed(seed)
    w = torch.randn(n_out, n_in, device=device)
    packed, state = bnbF.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
    return tk.from_quant_state(packed, state)


def _peft_layer(n_in, n_out, r, dropout, seed=0):
    """fp32 peft LoRA layer over a bnb Linear4bit, and the NF4Weight of its *fresh* quantization."""
    torch.manual_seed(seed)
    base = bnb.nn.Linear4bit(n_in, n_out, bias=True, compute_dtype=torch.float32, quant_type="nf4",
                             compress_statistics=True).to("cpu")  # .to() quantizes
    base.weight.requires_grad_(False)
    base.bias.requires_grad_(False)
    cfg = peft.LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=dropout)
    layer = PeftLoraLinear4bit(base, "default", config=cfg, r=r, lora_alpha=2 * r, lora_dropout=dropout)
    # peft zero-initialises B; random B makes dA and dx's LoRA term non-trivial.
    torch.nn.init.normal_(layer.lora_B["default"].weight, std=0.5)
    layer.train()
    w = base.weight
    quant = tk.from_quant_state(w.data, w.quant_state)
    fresh = bnbF.dequantize_4bit(w.data, w.quant_state).clone()
    return layer, quant, fresh


def _peft_run(layer, x, grad):
    x = x.detach().clone().requires_grad_()
    y = layer(x)
    y.backward(grad)
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    out = y.detach(), x.grad, a.grad.clone(), b.grad.clone()
    a.grad = b.grad = None
    return out


def _fused_run(x, quant, A, B, scaling, bias, p, grad, mode="tiles"):
    x = x.detach().clone().requires_grad_()
    A = A.detach().clone().requires_grad_()
    B = B.detach().clone().requires_grad_()
    y = tk.fused_lora_linear(x, quant, A, B, scaling, bias, dropout_p=p, weight_mode=mode)
    y.backward(grad)
    return y.detach(), x.grad, A.grad, B.grad


@pytest.mark.parametrize(
    "x_shape,dropout,mode",
    [((37, IN), 0.0, "tiles"), ((3, 7, IN), 0.25, "tiles"), ((37, IN), 0.25, "buffer")],
)
def test_matches_peft_bnb_layer(x_shape, dropout, mode, assert_close):
    layer, quant, fresh = _peft_layer(IN, OUT, R, dropout)
    torch.manual_seed(1)
    x = torch.randn(x_shape)
    grad = torch.randn(*x_shape[:-1], OUT)
    A, B = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    scaling = layer.scaling["default"]

    torch.manual_seed(2)  # same seed -> same dropout mask (both draw bernoulli_ on CPU)
    ref = _peft_run(layer, x, grad)
    torch.manual_seed(2)
    got = _fused_run(x, quant, A, B, scaling, layer.base_layer.bias, dropout, grad, mode)

    # bnb repacks the weight on some CPU forwards (eval + no grad); make sure the
    # reference ran on the layout we quantized.
    w = layer.base_layer.weight
    assert not getattr(w.quant_state, "packing_format_for_cpu", False)
    assert torch.equal(bnbF.dequantize_4bit(w.data, w.quant_state), fresh)
    for name, g, r in zip(("y", "dx", "dA", "dB"), got, ref):
        assert_close(g, r, torch.float32, name)


@pytest.mark.parametrize("mode", ["tiles", "buffer"])
def test_matches_torch_twin_with_bias_grad(mode, assert_close):
    quant = _quant(IN, OUT)
    torch.manual_seed(3)
    x = torch.randn(37, IN, requires_grad=True)
    A = (torch.randn(R, IN) * 0.1).requires_grad_()
    B = torch.randn(OUT, R).requires_grad_()
    bias = torch.randn(OUT, requires_grad=True)
    leaves = (x, A, B, bias)
    grad = torch.randn(37, OUT)

    y = tk.fused_lora_linear(x, quant, A, B, 0.5, bias, weight_mode=mode)
    got = (y, *torch.autograd.grad(y, leaves, grad))
    y_ref = lora_linear_reference(x, quant, A, B, 0.5, bias)
    ref = (y_ref, *torch.autograd.grad(y_ref, leaves, grad))
    for name, g, r in zip(("y", "dx", "dA", "dB", "dbias"), got, ref):
        assert_close(g, r, torch.float32, name)


@pytest.mark.parametrize("mode", ["tiles", "buffer"])
def test_wider_out_dtype_keeps_a_small_lora_term(mode):
    """bf16 x, out_dtype=fp32 (as FusedLoRALinear4bit calls it under k-bit training): a LoRA term of
    ~1e-4 of the output, below bf16's 2^-8 step, survives in y(B) - y(0); its error is the bf16
    roundings of x A^T and of the product (2 x 2^-9 of the term), inside 2^-6. The backward casts
    dy to bf16 first, so the gradients equal those of the bf16 call fed dy in bf16, bit for bit."""
    quant = _quant(IN, OUT)
    torch.manual_seed(4)
    x = torch.randn(37, IN).bfloat16().requires_grad_()
    A = (torch.randn(R, IN) * 0.1).bfloat16().requires_grad_()
    B0 = torch.zeros(OUT, R, dtype=torch.bfloat16)
    with torch.no_grad():
        y0 = tk.fused_lora_linear(x, quant, A, B0, 1.0, weight_mode=mode, out_dtype=torch.float32)
        term_unit = (x.float() @ A.float().t()).bfloat16().float()  # (tokens, r)
        B = torch.randn(OUT, R).bfloat16()
        scale = (1e-4 * y0.norm() / (term_unit @ B.float().t()).norm()).item()
        want = scale * (term_unit @ B.float().t())
        y = tk.fused_lora_linear(x, quant, A, B, scale, weight_mode=mode, out_dtype=torch.float32)
    assert y.dtype == torch.float32
    err = ((y - y0) - want).norm() / want.norm()
    assert err <= 2**-6, f"LoRA term off by {err:.3g} of itself"

    B.requires_grad_()
    dy = torch.randn(37, OUT)
    wide = tk.fused_lora_linear(x, quant, A, B, scale, weight_mode=mode, out_dtype=torch.float32)
    got = torch.autograd.grad(wide, (x, A, B), dy)
    narrow = tk.fused_lora_linear(x, quant, A, B, scale, weight_mode=mode)
    ref = torch.autograd.grad(narrow, (x, A, B), dy.bfloat16())
    for name, g, r in zip(("dx", "dA", "dB"), got, ref):
        assert g.dtype == torch.bfloat16 and torch.equal(g, r), name


def test_frozen_input_needs_only_lora_grads(assert_close):
    quant = _quant(IN, OUT)
    x = torch.randn(5, IN)  # no grad: dx (the Triton backward matmul) is skipped
    A = torch.randn(R, IN, requires_grad=True)
    B = torch.randn(OUT, R, requires_grad=True)
    dA, dB = torch.autograd.grad(tk.fused_lora_linear(x, quant, A, B, 2.0).sum(), (A, B))
    rA, rB = torch.autograd.grad(lora_linear_reference(x, quant, A, B, 2.0).sum(), (A, B))
    assert_close(dA, rA, torch.float32, "dA")
    assert_close(dB, rB, torch.float32, "dB")


_X, _A, _B = torch.randn(4, IN), torch.randn(R, IN), torch.randn(OUT, R)
_GOOD = dict(x=_X, A=_A, B=_B, bias=torch.randn(OUT), scaling=2.0)
_BAD = {
    "x must have shape": dict(x=torch.randn(4, IN + 1)),
    "x must be float32": dict(x=_X.double()),
    "A must have shape": dict(A=torch.randn(R, IN - 1)),
    "B must have shape": dict(B=torch.randn(OUT, R + 1)),
    "A must have x's dtype": dict(A=_A.bfloat16()),
    "B must have x's dtype": dict(B=_B.half()),
    "bias must be": dict(bias=torch.randn(OUT + 1)),
    "dropout_p must be": dict(dropout_p=1.0),
    "weight_mode must be": dict(weight_mode="dense"),
    "quant must be an NF4Weight": dict(quant=object()),
}


@pytest.mark.parametrize("message", list(_BAD))
def test_bad_arguments_raise_value_error_naming_them(message):
    kwargs = {**_GOOD, "quant": _quant(IN, OUT), **_BAD[message]}
    with pytest.raises(ValueError, match=message):
        tk.fused_lora_linear(**kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["tiles", "buffer"])
def test_gpu_bf16_matches_twin(mode, assert_close):
    dtype, n_in, n_out, r = torch.bfloat16, 1000, 776, 16
    quant = _quant(n_in, n_out, device="cuda")
    torch.manual_seed(4)
    x = torch.randn(2, 300, n_in, device="cuda", dtype=dtype, requires_grad=True)
    A = (torch.randn(r, n_in, device="cuda", dtype=dtype) * 0.05).requires_grad_()
    B = (torch.randn(n_out, r, device="cuda", dtype=dtype) * 0.05).requires_grad_()
    grad = torch.randn(2, 300, n_out, device="cuda", dtype=dtype)
    y = tk.fused_lora_linear(x, quant, A, B, 2.0, weight_mode=mode)
    got = (y, *torch.autograd.grad(y, (x, A, B), grad))
    y_ref = lora_linear_reference(x, quant, A, B, 2.0)
    ref = (y_ref, *torch.autograd.grad(y_ref, (x, A, B), grad))
    for name, g, r_ in zip(("y", "dx", "dA", "dB"), got, ref):
        assert_close(g, r_, dtype, name)


def test_autotune_key_is_not_the_token_count():
    """Padded and packed batches change the token count M nearly every step; keyed on M, the
    autotuner re-benchmarked every config for each new M. It keys on M's power-of-two class."""
    from tunekit_kernels.lora import _nf4_lora_matmul_kernel, m_bucket

    assert "M" not in _nf4_lora_matmul_kernel.keys and "M_BUCKET" in _nf4_lora_matmul_kernel.keys
    # ... and on the weight's layout: a square layer's forward and dx must not share one tuned tile
    assert "W_CONTIG_Q" in _nf4_lora_matmul_kernel.keys
    buckets = {m_bucket(m) for m in range(1, 70_000, 7)}
    assert buckets == {2**k for k in range(4, 17)}  # 13 classes for any token count
    assert m_bucket(1000) == m_bucket(1024) == 1024 and m_bucket(1025) == 2048


def test_int64_offsets_when_tokens_times_features_reach_2_31():
    from tunekit_kernels.lora import needs_int64

    # an (M, 4096) activation at 2^31 elements: M = 524288 tokens (e.g. 64 x 8192)
    assert not needs_int64(2**19 - 1, 4096, 4096, 4096, 4096)
    assert needs_int64(2**19, 4096, 4096, 4096, 4096)
    assert needs_int64(2**19, 4096, 1024, 4096)  # the larger side decides
    assert needs_int64(600_000, 14336, 4096, 14336)  # Llama-8B MLP width, long packed batch
    assert not needs_int64(4096, 14336, 4096, 14336)


def test_int64_path_gives_the_same_result():
    """The int64 pointer path (used past 2^31 elements) computes exactly what the int32 path does."""
    from tunekit_kernels.lora import nf4_lora_matmul

    quant = _quant(IN, OUT)
    torch.manual_seed(1)
    x, xa, B = torch.randn(70, IN), torch.randn(70, R), torch.randn(OUT, R)
    y32 = nf4_lora_matmul(x, quant, True, left=xa, right=B.t(), lora_scale=0.5)
    y64 = nf4_lora_matmul(x, quant, True, left=xa, right=B.t(), lora_scale=0.5, force_int64=True)
    assert torch.equal(y32, y64)


def _quant_layout(n_in, n_out, blocksize, nested, seed=0):
    torch.manual_seed(seed)
    w = torch.randn(n_out, n_in)
    packed, state = bnbF.quantize_4bit(w, blocksize=blocksize, compress_statistics=nested, quant_type="nf4")
    return tk.from_quant_state(packed, state)


@pytest.mark.parametrize("tile", [(64, 64, 32), (32, 128, 64), (256, 128, 128)], ids=lambda t: "x".join(map(str, t)))
@pytest.mark.parametrize("n_in, blocksize, nested", [
    (256, 64, True),  # rows start on a block (every real model); the tile meets 1 or 2 blocks per row
    (256, 128, True),  # blocks longer than some tiles
    (200, 64, True),  # rows straddle blocks
    (232, 32, True),  # the smallest blocksize, rows straddling: the most blocks per tile row
    (256, 64, False),  # fp32 scales (no double quantization)
])
def test_weight_tiles_for_every_block_layout(tile, n_in, blocksize, nested):
    """The matmul dequantizes W per tile with the scales loaded per (row, block) and broadcast: every
    case of tile length against blocksize, aligned or not, in both orientations (forward W^T and
    dx W), with a rank above one LoRA chunk (40 = 32 + 8) and a dropout mask, vs the torch twin."""
    import triton

    from tunekit_kernels.lora import _keep_scale, nf4_lora_matmul, rows_start_blocks
    from tunekit_kernels.reference import dequant_nf4_reference

    n_out, r, m = 72, 40, 37
    quant = _quant_layout(n_in, n_out, blocksize, nested)
    assert rows_start_blocks(quant) == (n_in % blocksize == 0)
    config = triton.Config({"BLOCK_M": tile[0], "BLOCK_P": tile[1], "BLOCK_Q": tile[2], "GROUP_M": 8}, num_warps=4)
    w = dequant_nf4_reference(quant).double()
    torch.manual_seed(1)
    x, xa, B = torch.randn(m, n_in), torch.randn(m, r), torch.randn(n_out, r)
    y = nf4_lora_matmul(x, quant, True, left=xa, right=B.t(), lora_scale=0.5, config=config)
    want = x.double() @ w.t() + 0.5 * (xa.double() @ B.double().t())
    assert ((y.double() - want).abs().max() / want.abs().max()).item() <= 1e-5

    dy, dxa, A = torch.randn(m, n_out), torch.randn(m, r), torch.randn(r, n_in)
    keep = torch.rand(m, n_in) > 0.25
    ks = _keep_scale(0.25, torch.float32)
    dx = nf4_lora_matmul(dy, quant, False, left=dxa, right=A, keep=keep, keep_scale=ks, config=config)
    want = dy.double() @ w + (dxa.double() @ A.double()) * keep.double() * ks
    assert ((dx.double() - want).abs().max() / want.abs().max()).item() <= 1e-5
