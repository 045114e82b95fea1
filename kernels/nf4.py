"""NF4 dequantization in Triton (QLoRA, Dettmers et al. 2023).

Three layers:

* ``nf4_values`` - a ``@triton.jit`` helper that turns any block of *flat* weight
  indices into fp32 weight values.  The fused LoRA matmul (``lora.py``) calls it on
  (K, N) tiles, so W is never materialised there.
* ``_nf4_dequant_kernel`` - a 1-D elementwise kernel writing the whole weight.
* ``nf4_dequantize`` - the host function (plain tensors in, dense weight out).

See ``quant.py`` for the byte layout and the exact formula.  The result is bit-exact
with ``bitsandbytes.functional.dequantize_4bit`` in fp32, bf16 and fp16 because we
compute in fp32 with the same operation order and round once at the end; on GPU that
needs ``enable_fp_fusion=False`` so the compiler does not turn ``mul``+``add`` of the
scale into an FMA (which rounds once instead of twice).
"""

import torch
import triton
import triton.language as tl

from ._runtime import check_device, interpreting
from .quant import NF4Weight

_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def nf4_values(
    idx,
    mask,
    packed_ptr,
    absmax_ptr,
    absmax2_ptr,
    code2_ptr,
    offset_ptr,
    code_ptr,
    BLOCKSIZE: tl.constexpr,
    BLOCKSIZE2: tl.constexpr,
    NESTED: tl.constexpr,
):
    """fp32 values of flat weight elements ``idx`` (any shape, int32); 0 where ~mask."""
    byte = tl.load(packed_ptr + idx // 2, mask=mask, other=0).to(tl.int32)
    # Even flat index -> high nibble (bnb packs q[2j] << 4 | q[2j+1]).
    nibble = tl.where(idx % 2 == 0, byte >> 4, byte & 0xF)
    # Gathers from tiny tables (16 / 256 floats) stay in L1, so no shared-memory staging.
    value = tl.load(code_ptr + nibble, mask=mask, other=0.0)
    block = idx // BLOCKSIZE
    if NESTED:
        scale_code = tl.load(absmax_ptr + block, mask=mask, other=0).to(tl.int32)
        scale = tl.load(code2_ptr + scale_code, mask=mask, other=0.0)
        scale = scale * tl.load(absmax2_ptr + block // BLOCKSIZE2, mask=mask, other=0.0)
        scale = scale + tl.load(offset_ptr)
    else:
        scale = tl.load(absmax_ptr + block, mask=mask, other=0.0)
    return value * scale


@triton.jit
def nf4_code(nibble, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15):
    """``code[nibble]`` for a tile of nibbles, from the 16 code book values held in registers.

    A binary tree of 15 selects on the nibble's bits. The matmul calls this inside its K loop
    instead of gathering ``code_ptr + nibble``: Triton's software pipeliner copies every 32-bit
    load of the loop into shared memory ahead of use, once per pipeline stage, so a gather per
    weight element costs (tile elements x 4 bytes x stages) of shared memory.
    """
    b = (nibble & 1) != 0
    t0 = tl.where(b, c1, c0)
    t1 = tl.where(b, c3, c2)
    t2 = tl.where(b, c5, c4)
    t3 = tl.where(b, c7, c6)
    t4 = tl.where(b, c9, c8)
    t5 = tl.where(b, c11, c10)
    t6 = tl.where(b, c13, c12)
    t7 = tl.where(b, c15, c14)
    b = (nibble & 2) != 0
    u0 = tl.where(b, t1, t0)
    u1 = tl.where(b, t3, t2)
    u2 = tl.where(b, t5, t4)
    u3 = tl.where(b, t7, t6)
    b = (nibble & 4) != 0
    v0 = tl.where(b, u1, u0)
    v1 = tl.where(b, u3, u2)
    return tl.where((nibble & 8) != 0, v1, v0)


@triton.jit
def nf4_block_scale(block, mask, absmax_ptr, absmax2_ptr, code2_ptr, offset,
                    BLOCKSIZE2: tl.constexpr, NESTED: tl.constexpr):
    """fp32 scales of quantization blocks ``block`` (any shape); 0 where ~mask. ``offset`` is the
    double quantization's scalar (loaded once by the caller; unused without NESTED)."""
    if NESTED:
        scale_code = tl.load(absmax_ptr + block, mask=mask, other=0).to(tl.int32)
        scale = tl.load(code2_ptr + scale_code, mask=mask, other=0.0)
        scale = scale * tl.load(absmax2_ptr + block // BLOCKSIZE2, mask=mask, other=0.0)
        scale = scale + offset
    else:
        scale = tl.load(absmax_ptr + block, mask=mask, other=0.0)
    return scale


@triton.jit
def _bf16_round_nearest_even(x):
    """fp32 -> bf16 with round-to-nearest-even done on the bits (finite inputs).

    Only used under the interpreter, whose fp32->bf16 cast truncates; GPUs round to
    nearest even natively, like torch's ``.to(torch.bfloat16)``.
    """
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _nf4_dequant_kernel(
    packed_ptr,
    absmax_ptr,
    absmax2_ptr,
    code2_ptr,
    offset_ptr,
    code_ptr,
    out_ptr,
    numel,
    BLOCKSIZE: tl.constexpr,
    BLOCKSIZE2: tl.constexpr,
    NESTED: tl.constexpr,
    BLOCK: tl.constexpr,
    EMULATE_BF16_RNE: tl.constexpr,
):
    # One program per BLOCK flat outputs; each byte is loaded by two neighbouring lanes,
    # which the cache absorbs, and keeps the store fully coalesced.
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < numel
    w = nf4_values(
        idx, mask, packed_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, code_ptr,
        BLOCKSIZE, BLOCKSIZE2, NESTED,
    )
    if EMULATE_BF16_RNE:
        tl.store(out_ptr + idx, _bf16_round_nearest_even(w), mask=mask)
    else:
        tl.store(out_ptr + idx, w.to(out_ptr.dtype.element_ty), mask=mask)


def nf4_pointer_args(quant: NF4Weight) -> tuple[torch.Tensor, ...]:
    """The six tensor arguments of ``nf4_values``; unused ones get a valid dummy pointer."""
    dummy = quant.code
    return (
        quant.packed,
        quant.absmax,
        quant.absmax2 if quant.nested else dummy,
        quant.code2 if quant.nested else dummy,
        quant.offset if quant.nested else dummy,
        quant.code,
    )


def nf4_dequantize(
    quant: NF4Weight,
    dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dequantize an NF4 weight to a dense (out, in) tensor of ``dtype``.

    ``out`` (optional, contiguous, shape (out, in), dtype ``dtype``) lets callers reuse
    one buffer across layers instead of allocating a weight-sized tensor each call.
    """
    quant.validate()
    check_device(quant.packed, "quant.packed")
    if dtype not in _OUT_DTYPES:
        raise ValueError(f"dtype must be one of {_OUT_DTYPES}, got {dtype}")
    if out is None:
        out = torch.empty(quant.shape, dtype=dtype, device=quant.device)
    elif out.shape != quant.shape or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous {tuple(quant.shape)} tensor of {dtype}, "
            f"got {tuple(out.shape)} {out.dtype}"
        )
    args, constexprs, options = dequant_launch(quant, out)
    grid = (triton.cdiv(quant.numel, constexprs["BLOCK"]),)
    _nf4_dequant_kernel[grid](*args, **constexprs, **options)
    return out


def dequant_launch(quant: NF4Weight, out: torch.Tensor) -> tuple[tuple, dict, dict]:
    """(args, constexprs, options) of the launch ``nf4_dequantize`` makes (meta tensors work too:
    kernels/tiles.py cross-compiles it)."""
    # Interpreter cost is per program, so use few large programs there.
    block = 16384 if interpreting() else 1024
    constexprs = dict(
        BLOCKSIZE=quant.blocksize,
        BLOCKSIZE2=quant.blocksize2,
        NESTED=quant.nested,
        BLOCK=block,
        EMULATE_BF16_RNE=interpreting() and out.dtype == torch.bfloat16,
    )
    return (*nf4_pointer_args(quant), out, quant.numel), constexprs, {"num_warps": 4, "enable_fp_fusion": False}
