"""NF4 dequantization: Triton kernel and torch twin vs bitsandbytes, bit for bit."""

from __future__ import annotations

import copy

import bitsandbytes.functional as bnbF
import pytest
import torch

import tunekit_kernels as tk
from tunekit_kernels.reference import dequant_nf4_reference

# (out, in): 136*200 is a multiple of 64; 137*200 ends in a partial absmax block;
# 137*201 is odd (last byte half padding), and blocks straddle rows in all three.
SHAPES = [(136, 200), (137, 200), (137, 201)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _quantize(shape, compress_statistics=True, seed=0, device="cpu"):
    torch.manual_seed(seed)
    w = torch.randn(shape, device=device)
    packed, state = bnbF.quantize_4bit(w, blocksize=64, compress_statistics=compress_statistics, quant_type="nf4")
    return packed, state


def _bnb_dequant(packed, state, dtype):
    # dequantize_4bit returns quant_state.dtype; set it on a shallow copy.
    state = copy.copy(state)
    state.dtype = dtype
    return bnbF.dequantize_4bit(packed, state)


def test_layout_facts():
    packed, st = _quantize((137, 201))
    n = 137 * 201
    assert packed.dtype == torch.uint8 and packed.numel() == (n + 1) // 2
    assert st.nested and st.blocksize == 64 and st.state2.blocksize == 256
    assert st.absmax.dtype == torch.uint8 and st.absmax.numel() == -(-n // 64)
    assert st.state2.absmax.numel() == -(-st.absmax.numel() // 256)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_dequant_bitwise_equals_bnb(shape, dtype):
    packed, st = _quantize(shape)
    expected = _bnb_dequant(packed, st, dtype)
    quant = tk.from_quant_state(packed, st)
    got = tk.nf4_dequantize(quant, dtype)
    assert got.dtype == dtype and got.shape == shape
    assert torch.equal(got, expected)
    assert torch.equal(dequant_nf4_reference(quant, dtype), expected)


def test_not_double_quantized():
    packed, st = _quantize((136, 200), compress_statistics=False)
    quant = tk.from_quant_state(packed, st)
    assert not quant.nested
    expected = bnbF.dequantize_4bit(packed, st)
    assert torch.equal(tk.nf4_dequantize(quant), expected)
    assert torch.equal(dequant_nf4_reference(quant), expected)


def test_out_buffer_is_reused():
    packed, st = _quantize((136, 200))
    quant = tk.from_quant_state(packed, st)
    buf = torch.empty(quant.shape)
    assert tk.nf4_dequantize(quant, out=buf) is buf
    with pytest.raises(ValueError, match="out must be"):
        tk.nf4_dequantize(quant, out=torch.empty(quant.shape, dtype=torch.bfloat16))


def test_rejects_cpu_repacked_and_fp4_states():
    packed, st = _quantize((136, 200))
    st.packing_format_for_cpu = True
    with pytest.raises(ValueError, match="packing_format_for_cpu"):
        tk.from_quant_state(packed, st)
    w = torch.randn(8, 64)
    packed4, st4 = bnbF.quantize_4bit(w, quant_type="fp4")
    with pytest.raises(ValueError, match="quant_type"):
        tk.from_quant_state(packed4, st4)


def test_validate_names_the_bad_field():
    packed, st = _quantize((136, 200))
    quant = tk.from_quant_state(packed, st)
    bad = tk.NF4Weight(**{**quant.__dict__, "absmax": quant.absmax.float()})
    with pytest.raises(ValueError, match="quant.absmax must have dtype"):
        tk.nf4_dequantize(bad)
    bad = tk.NF4Weight(**{**quant.__dict__, "packed": quant.packed[:-1]})
    with pytest.raises(ValueError, match="quant.packed must have"):
        tk.nf4_dequantize(bad)


def test_is_available_on_this_machine():
    assert tk.is_available("cuda") == torch.cuda.is_available()
    assert tk.is_available("cpu") == (not torch.cuda.is_available())  # interpreter set by conftest
    assert not tk.is_available("meta")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_dequant_bitwise_equals_bnb(dtype):
    packed, st = _quantize((4096, 1000), device="cuda")
    quant = tk.from_quant_state(packed, st)
    assert torch.equal(tk.nf4_dequantize(quant, dtype), _bnb_dequant(packed, st, dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_works_a_chunk_at_a_time(monkeypatch, dtype):
    """The twin runs on the device inside training's kernel check, beside the loaded model: its index
    tensors must stay one chunk long whatever the weight's size, and the chunks must join into the
    same bits as bitsandbytes (chunk edges inside a block and inside a row; odd element count)."""
    from tunekit_kernels import reference

    packed, st = _quantize((137, 201))
    quant = tk.from_quant_state(packed, st)
    expected = _bnb_dequant(packed, st, dtype)
    lengths = []
    real_arange = torch.arange

    def arange(*args, **kwargs):
        t = real_arange(*args, **kwargs)
        lengths.append(t.numel())
        return t

    monkeypatch.setattr(reference.torch, "arange", arange)
    for chunk in (2, 70, 1000, 137 * 201 + 1):  # 70: not a multiple of the 64-element block
        lengths.clear()
        assert torch.equal(reference.dequant_nf4_reference(quant, dtype, chunk=chunk), expected)
        n_blocks = st.absmax.numel()
        assert max(length for length in lengths if length != n_blocks) <= chunk
    with pytest.raises(ValueError, match="even"):
        reference.dequant_nf4_reference(quant, dtype, chunk=3)
