"""HalfLinearsInFp32 (tunekit.export.fidelity): a bf16/fp16 CPU linear as an fp32 matmul rounded
once, against torch's own half-precision linear, and the CPU facts that switch it on."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tunekit.export.fidelity as fidelity
from tunekit.device.facts import cpu_emulated_dtypes, cpu_has_fp16
from tunekit.export.fidelity import HalfLinearsInFp32

SIGNIFICANT_BITS = {torch.bfloat16: 8, torch.float16: 11}


def ulp(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of `dtype` at |y| (normal range), as fp32."""
    exponent = torch.floor(torch.log2(y.abs().float().clamp_min(1e-30)))
    return torch.exp2(exponent - (SIGNIFICANT_BITS[dtype] - 1))


def operands(dtype, bias: bool, out_features: int = 80):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 17, 96, generator=g).to(dtype)  # (batch, seq, in)
    w = (torch.randn(out_features, 96, generator=g) / 96 ** 0.5).to(dtype)  # (out, in)
    b = torch.randn(out_features, generator=g).to(dtype) if bias else None
    return x, w, b


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_linear_matches_torch_within_one_ulp(dtype, bias):
    # Products of two bf16 (8 significant bits) or fp16 (11) values are exact in fp32 (24): both
    # paths sum the same products in fp32 in another order (error ~K 2^-24 sum|x w|, K = 96), then
    # round to the half dtype: equal, or adjacent values where the sum sits at a rounding boundary.
    # torch's path may round x @ w.T to the half dtype before adding the bias: half an ulp of that
    # product's magnitude more, which is larger than the output's where the bias cancels it.
    x, w, b = operands(dtype, bias)
    want = F.linear(x, w, b)
    mode = HalfLinearsInFp32((dtype,))
    with mode:
        got = F.linear(x, w, b)
        by_name = torch.nn.functional.linear(input=x, weight=w, bias=b)
    assert got.dtype == dtype and got.shape == want.shape and mode.seen == {dtype}
    assert torch.equal(got, by_name)
    diff = (got.float() - want.float()).abs()
    magnitude = torch.stack([got.float().abs(), want.float().abs(), F.linear(x.float(), w.float()).abs()]).amax(0)
    assert (diff <= ulp(magnitude, dtype)).all(), diff.max()
    assert (got == want).float().mean() > 0.9  # mostly identical: a wrong rounding would move half of them


def test_other_dtypes_and_ops_are_left_alone():
    x, w, b = operands(torch.float32, True)
    mode = HalfLinearsInFp32((torch.bfloat16,))
    with mode:
        got32 = F.linear(x, w, b)
        x16, w16 = x.half(), w.half()
        got16 = F.linear(x16, w16)  # fp16 is not in the mode's dtypes
        gelu = F.gelu(x.bfloat16())
    assert torch.equal(got32, F.linear(x, w, b)) and torch.equal(got16, F.linear(x16, w16))
    assert torch.equal(gelu, F.gelu(x.bfloat16())) and mode.seen == set()


def test_a_large_weight_is_upcast_in_blocks(monkeypatch):
    x, w, b = operands(torch.bfloat16, True, out_features=200)
    whole = fidelity._linear_in_fp32(x, w, b)
    monkeypatch.setattr(fidelity, "_FP32_BLOCK_BYTES", 4 * 96 * 64)  # 64 rows of w at a time: 4 blocks
    blocked = fidelity._linear_in_fp32(x, w, b)
    # the same per-output sums; a gemm may order a sum by the matrix's width, so adjacent at most
    assert blocked.shape == whole.shape
    assert ((blocked.float() - whole.float()).abs() <= ulp(whole, torch.bfloat16)).all()


def test_which_half_dtypes_a_cpu_emulates():
    assert cpu_emulated_dtypes("flags: fpu avx2 fma") == (torch.bfloat16, torch.float16)
    assert cpu_emulated_dtypes("flags: avx512f avx512_bf16") == (torch.float16,)
    assert cpu_emulated_dtypes("flags: avx512_bf16 avx512_fp16") == ()
    assert cpu_emulated_dtypes("flags: amx_bf16 amx_fp16 amx_tile") == ()
    assert cpu_has_fp16("flags: amx_fp16") and not cpu_has_fp16("flags: avx512_bf16")
