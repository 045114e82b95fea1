"""Fused LoRA linear over a frozen NF4 base weight (LoRA: Hu et al. 2021; QLoRA: Dettmers et al. 2023).

    y = x @ W^T + bias + scaling * (dropout(x) @ A^T) @ B^T

x (tokens, in) or (batch, seq, in); A (r, in); B (out, r); W = dequant(quant), (out, in).

What is fused (weight_mode="tiles", the default):

* forward: one Triton matmul computes ``x @ W^T`` while dequantizing W tile by tile in
  registers, and adds ``scaling * xa @ B^T`` and ``bias`` in its epilogue.  Neither a
  dense W nor an (tokens, out) LoRA intermediate is ever written.
* backward ``dx``: the same kernel with W untransposed computes ``dy @ W`` and adds
  ``(dxa @ A) * dropout_noise`` in the epilogue.

What is not fused (plain torch/cuBLAS, all tensors with a rank-r side):
``xa = dropout(x) @ A^T`` (tokens, r), ``dxa = scaling * dy @ B``, ``dB``, ``dA``, and
drawing the dropout mask.  Saved for backward: x, A, B, xa and (only if dropout_p > 0)
a bool keep-mask; W is re-dequantized in backward, never saved.

weight_mode="buffer" instead dequantizes W with the Triton kernel into one shared,
reusable workspace per (device, dtype) and lets cuBLAS do the matmuls; it trades the
per-tile dequantization (repeated for every block of tokens) for one weight-sized
buffer.  Which wins depends on the GPU and the token count: measure with
scripts/bench_kernels.py.
"""

import torch
import triton
import triton.language as tl

from ._runtime import check_device, interpreting
from .tiles import matmul_configs, prune_for_device
from .nf4 import nf4_block_scale, nf4_code, nf4_dequantize, nf4_pointer_args
from .quant import NF4Weight
from .reference import apply_dropout, dropout_noise

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _configs() -> list[triton.Config]:
    if interpreting():
        # The interpreter cannot autotune over several configs and its cost is per
        # program: one config with big tiles.
        return [triton.Config({"BLOCK_M": 256, "BLOCK_P": 128, "BLOCK_Q": 128, "GROUP_M": 8}, num_warps=4)]
    # Every dtype's tiles; prune_for_device keeps those of the call's dtype that fit its device.
    return matmul_configs()


def m_bucket(m: int) -> int:
    """The autotuner's stand-in for the token count M: the next power of two, clamped to [16, 65536].

    Keying the autotuner on M itself re-benchmarks every config for every new padded or packed
    batch length (seconds per new M, per shape). Tiles that suit M suit any M of the same
    power-of-two size class, so at most 13 tunings per weight shape ever happen.
    """
    return min(max(16, triton.next_power_of_2(max(int(m), 1))), 65536)


def lora_rank_chunk(r: int) -> int:
    """Ranks per step of the epilogue's LoRA product (tl.dot needs >= 16; 32 bounds its operands)."""
    return 16 if r <= 16 else 32


def rows_start_blocks(quant: NF4Weight) -> bool:
    """Whether every row of W starts a quantization block (in_features a multiple of a power-of-two
    blocksize: every real model's layers). The matmul then meets fewer scale blocks per tile."""
    bs = quant.blocksize
    return bs & (bs - 1) == 0 and quant.shape[1] % bs == 0


def needs_int64(M: int, P: int, Q: int, *strides: int) -> bool:
    """Whether an element offset of any operand can reach 2**31 (int32 pointer math would wrap).

    Each operand's largest offset is sum((size - 1) * stride); the operands are (M, Q) inputs,
    (M, P) outputs and keep-masks, (M, R) LoRA left factors. A caller passes the strides of the
    row dimension (tokens) of each; the column offsets are below max(P, Q) anyway.
    """
    largest_row_stride = max([max(P, Q), *[abs(s) for s in strides]])
    return (M - 1) * largest_row_stride + max(P, Q) >= 2**31


@triton.jit
def _nf4_weight_tile(
    offs_q, offs_p, q_ok, p_ok, q0, p0, n_blocks, stride_wq, stride_wp,
    packed_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset,
    c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15,
    BLOCKSIZE: tl.constexpr, BLOCKSIZE2: tl.constexpr, NESTED: tl.constexpr,
    W_CONTIG_Q: tl.constexpr, W_ALIGNED: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """fp32 tile Wop[offs_q, offs_p] of the NF4 weight (0 outside the masks).

    Only the packed bytes are loaded per element. The code book lookup is a select tree on 16
    values in registers, and the scales are loaded once per (W row, quantization block) the tile
    touches, as short vectors, then broadcast: a W row crosses the tile along its contiguous
    axis (q when W_CONTIG_Q, the forward's W^T; else p), so each tile line meets at most
    NP consecutive blocks, NP = ceil(tile length / BLOCKSIZE) where rows start on a block
    boundary (W_ALIGNED) and one more where they may not.
    """
    idx = offs_q[:, None] * stride_wq + offs_p[None, :] * stride_wp
    mask = q_ok[:, None] & p_ok[None, :]
    byte = tl.load(packed_ptr + idx // 2, mask=mask, other=0).to(tl.int32)
    # Even flat index -> high nibble (bnb packs q[2j] << 4 | q[2j+1]).
    nibble = tl.where(idx % 2 == 0, byte >> 4, byte & 0xF)
    value = nf4_code(nibble, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15)
    # Lines: one per W row met by the tile; `first` is the flat index where the tile enters it.
    if W_CONTIG_Q:
        first = offs_p * stride_wp + q0
        line_ok = p_ok
        ALONG: tl.constexpr = BLOCK_Q
    else:
        first = offs_q * stride_wq + p0
        line_ok = q_ok
        ALONG: tl.constexpr = BLOCK_P
    block0 = first // BLOCKSIZE
    if W_ALIGNED:
        NP: tl.constexpr = (ALONG + BLOCKSIZE - 1) // BLOCKSIZE
    else:
        NP: tl.constexpr = (BLOCKSIZE + ALONG - 2) // BLOCKSIZE + 1
    if NP == 1:
        scale = nf4_block_scale(block0, line_ok & (block0 < n_blocks), absmax_ptr, absmax2_ptr, code2_ptr,
                                offset, BLOCKSIZE2, NESTED)
        if W_CONTIG_Q:
            w = value * scale[None, :]
        else:
            w = value * scale[:, None]
    else:
        # which of the line's blocks each element is in, counted from the line's first
        along = tl.arange(0, ALONG)
        if W_ALIGNED:  # lines enter on a block boundary: the same for every line
            rel = (along // BLOCKSIZE)[:, None] if W_CONTIG_Q else (along // BLOCKSIZE)[None, :]
        elif W_CONTIG_Q:
            rel = ((first % BLOCKSIZE)[None, :] + along[:, None]) // BLOCKSIZE
        else:
            rel = ((first % BLOCKSIZE)[:, None] + along[None, :]) // BLOCKSIZE
        scale = tl.zeros((BLOCK_Q, BLOCK_P), dtype=tl.float32)
        for j in tl.static_range(NP):
            s = nf4_block_scale(block0 + j, line_ok & (block0 + j < n_blocks), absmax_ptr, absmax2_ptr,
                                code2_ptr, offset, BLOCKSIZE2, NESTED)
            if W_CONTIG_Q:
                scale = tl.where(rel == j, s[None, :], scale)
            else:
                scale = tl.where(rel == j, s[:, None], scale)
        w = value * scale
    return tl.where(mask, w, 0.0)


# W_CONTIG_Q in the key: the forward (W^T, contiguous along q) and dx (W, contiguous along p) of a
# square layer have the same M, P, Q and R but read the weight along different axes; sharing one
# tuned tile between them gives the second whatever suited the first.
@triton.autotune(configs=_configs(), key=["M_BUCKET", "P", "Q", "R", "W_CONTIG_Q"],
                 prune_configs_by={"early_config_prune": prune_for_device})
@triton.jit
def _nf4_lora_matmul_kernel(
    inp_ptr, out_ptr,
    packed_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, code_ptr,
    left_ptr, right_ptr, keep_ptr, bias_ptr,
    M, P, Q, R, M_BUCKET,
    stride_im, stride_iq, stride_om, stride_op, stride_wq, stride_wp,
    stride_lm, stride_lr, stride_rr, stride_rp, stride_km, stride_kp,
    lora_scale, keep_scale,
    BLOCKSIZE: tl.constexpr, BLOCKSIZE2: tl.constexpr, NESTED: tl.constexpr,
    W_CONTIG_Q: tl.constexpr, W_ALIGNED: tl.constexpr,
    HAS_LORA: tl.constexpr, HAS_KEEP: tl.constexpr, HAS_BIAS: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, BLOCK_R: tl.constexpr, INDEX_64: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr, GROUP_M: tl.constexpr,
):
    """out[M, P] = inp[M, Q] @ Wop[Q, P] + lora_scale * (left @ right) * keep * keep_scale + bias.

    Wop[q, p] is W's flat element ``q * stride_wq + p * stride_wp``, so one kernel
    serves the forward (Wop = W^T, W_CONTIG_Q) and dx (Wop = W).  left (M, R), right (R, P) and
    keep (M, P) are optional epilogue operands.
    """
    # Grouped launch order: GROUP_M row-blocks share each W column tile while it is
    # still in L2, so it is fetched from HBM fewer times.
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_p = tl.cdiv(P, BLOCK_P)
    per_group = GROUP_M * num_p
    first_m = (pid // per_group) * GROUP_M
    group_rows = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_p = (pid % per_group) // group_rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if INDEX_64:
        # tokens x features >= 2**31: row offsets in int64, or the pointers would wrap around
        offs_m = offs_m.to(tl.int64)
    p0 = pid_p * BLOCK_P
    offs_p = p0 + tl.arange(0, BLOCK_P)
    m_ok = offs_m < M
    p_ok = offs_p < P
    # Loop invariants, loaded once: the 16-entry code book and the scales' offset.
    c0 = tl.load(code_ptr + 0)
    c1 = tl.load(code_ptr + 1)
    c2 = tl.load(code_ptr + 2)
    c3 = tl.load(code_ptr + 3)
    c4 = tl.load(code_ptr + 4)
    c5 = tl.load(code_ptr + 5)
    c6 = tl.load(code_ptr + 6)
    c7 = tl.load(code_ptr + 7)
    c8 = tl.load(code_ptr + 8)
    c9 = tl.load(code_ptr + 9)
    c10 = tl.load(code_ptr + 10)
    c11 = tl.load(code_ptr + 11)
    c12 = tl.load(code_ptr + 12)
    c13 = tl.load(code_ptr + 13)
    c14 = tl.load(code_ptr + 14)
    c15 = tl.load(code_ptr + 15)
    offset = tl.load(offset_ptr) if NESTED else 0.0
    n_blocks = (P * Q - 1) // BLOCKSIZE + 1
    acc = tl.zeros((BLOCK_M, BLOCK_P), dtype=tl.float32)
    for q0 in range(0, Q, BLOCK_Q):
        offs_q = q0 + tl.arange(0, BLOCK_Q)
        q_ok = offs_q < Q
        a = tl.load(inp_ptr + offs_m[:, None] * stride_im + offs_q[None, :] * stride_iq,
                    mask=m_ok[:, None] & q_ok[None, :], other=0.0)
        w = _nf4_weight_tile(offs_q, offs_p, q_ok, p_ok, q0, p0, n_blocks, stride_wq, stride_wp,
                             packed_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset,
                             c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15,
                             BLOCKSIZE, BLOCKSIZE2, NESTED, W_CONTIG_Q, W_ALIGNED, BLOCK_Q, BLOCK_P)
        if DOT_FP32:
            acc = tl.dot(a.to(tl.float32), w, acc, input_precision=PRECISION)
        else:
            # Round W to the activation dtype first, as bnb does before its matmul.
            acc = tl.dot(a, w.to(a.dtype), acc, input_precision=PRECISION)

    if HAS_LORA:
        # left @ right in chunks of BLOCK_R ranks, not pipelined: one dot over all R ranks would put
        # a (BLOCK_M x R) and an (R x BLOCK_P) operand in shared memory, 256 KB in fp32 at r = 256.
        lora = tl.zeros((BLOCK_M, BLOCK_P), dtype=tl.float32)
        for r0 in tl.range(0, R, BLOCK_R, num_stages=1):
            offs_r = r0 + tl.arange(0, BLOCK_R)
            r_ok = offs_r < R
            left = tl.load(left_ptr + offs_m[:, None] * stride_lm + offs_r[None, :] * stride_lr,
                           mask=m_ok[:, None] & r_ok[None, :], other=0.0)
            right = tl.load(right_ptr + offs_r[:, None] * stride_rr + offs_p[None, :] * stride_rp,
                            mask=r_ok[:, None] & p_ok[None, :], other=0.0)
            if DOT_FP32:
                lora = tl.dot(left.to(tl.float32), right.to(tl.float32), lora, input_precision=PRECISION)
            else:
                lora = tl.dot(left, right.to(left.dtype), lora, input_precision=PRECISION)
        lora = lora * lora_scale
        if HAS_KEEP:
            keep = tl.load(keep_ptr + offs_m[:, None] * stride_km + offs_p[None, :] * stride_kp,
                           mask=m_ok[:, None] & p_ok[None, :], other=0)
            lora = lora * (keep.to(tl.float32) * keep_scale)
        acc += lora
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_p, mask=p_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_p[None, :] * stride_op,
             acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & p_ok[None, :])


def matmul_launch(
    inp: torch.Tensor,
    quant: NF4Weight,
    transpose_w: bool,
    left: torch.Tensor | None = None,
    right: torch.Tensor | None = None,
    lora_scale: float = 1.0,
    keep: torch.Tensor | None = None,
    keep_scale: float = 1.0,
    bias: torch.Tensor | None = None,
    force_int64: bool = False,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, tuple, dict]:
    """(out, args, constexprs) of the kernel launch ``nf4_lora_matmul`` makes, without launching.

    The autotuned meta-parameters (BLOCK_M, BLOCK_P, BLOCK_Q, GROUP_M, warps, stages) come on top.
    Runs on meta tensors too: kernels/tiles.py builds the exact launch it cross-compiles with it.
    """
    n_out, n_in = quant.shape
    Q, P = (n_in, n_out) if transpose_w else (n_out, n_in)
    M = inp.shape[0]
    out = torch.empty((M, P), dtype=out_dtype or inp.dtype, device=inp.device)
    index_64 = force_int64 or needs_int64(M, P, Q, inp.stride(0), out.stride(0),
                                          *(t.stride(0) for t in (left, keep) if t is not None))
    R = left.shape[1] if left is not None else 1
    dummy = out  # any valid pointer for absent optional operands
    lo = left if left is not None else dummy
    ri = right if right is not None else dummy
    ke = keep if keep is not None else dummy
    fp32 = inp.dtype == torch.float32
    args = (
        inp, out, *nf4_pointer_args(quant),
        lo, ri, ke, bias if bias is not None else dummy,
        M, P, Q, R, m_bucket(M),
        inp.stride(0), inp.stride(1), out.stride(0), out.stride(1),
        1 if transpose_w else n_in, n_in if transpose_w else 1,
        lo.stride(0), lo.stride(1), ri.stride(0), ri.stride(1), ke.stride(0), ke.stride(1),
        float(lora_scale), float(keep_scale),
    )
    constexprs = dict(
        BLOCKSIZE=quant.blocksize, BLOCKSIZE2=quant.blocksize2, NESTED=quant.nested,
        W_CONTIG_Q=transpose_w, W_ALIGNED=rows_start_blocks(quant),
        HAS_LORA=left is not None, HAS_KEEP=keep is not None, HAS_BIAS=bias is not None,
        # The interpreter's tl.dot is wrong on bf16 inputs; fp32 on GPU must not use TF32.
        DOT_FP32=interpreting() or fp32,
        PRECISION="ieee" if (interpreting() or fp32) else "tf32",
        BLOCK_R=lora_rank_chunk(R),
        INDEX_64=index_64,
    )
    return out, args, constexprs


# Compile options of every launch: without FMA contraction the dequantized tiles match bnb bit for bit.
OPTIONS = {"enable_fp_fusion": False}


def nf4_lora_matmul(
    inp: torch.Tensor,
    quant: NF4Weight,
    transpose_w: bool,
    left: torch.Tensor | None = None,
    right: torch.Tensor | None = None,
    lora_scale: float = 1.0,
    keep: torch.Tensor | None = None,
    keep_scale: float = 1.0,
    bias: torch.Tensor | None = None,
    force_int64: bool = False,
    out_dtype: torch.dtype | None = None,
    config: triton.Config | None = None,
) -> torch.Tensor:
    """Host side of the kernel: ``inp @ (W^T if transpose_w else W)`` plus epilogue terms.

    inp (tokens, Q); left (tokens, r); right (r, P), any strides (e.g. ``B.t()``);
    keep bool (tokens, P); bias (P,).  Returns a new (tokens, P) tensor of ``out_dtype``
    (default inp's dtype); the fp32 accumulator is rounded only there.
    Offsets are int32 unless an operand is large enough to need int64 (or ``force_int64``).
    ``config`` launches that one tile config instead of the autotuner's choice (tests).
    """
    out, args, constexprs = matmul_launch(inp, quant, transpose_w, left, right, lora_scale, keep, keep_scale,
                                          bias, force_int64, out_dtype)
    M, P = out.shape
    if M == 0:
        return out
    grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(P, meta["BLOCK_P"]),)  # noqa: E731
    if config is None:
        _nf4_lora_matmul_kernel[grid](*args, **constexprs, **OPTIONS)
    else:
        kw = config.all_kwargs()
        _nf4_lora_matmul_kernel.fn[grid](*args, **constexprs, **OPTIONS, **kw)
    return out


_WORKSPACE: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _dequant_workspace(quant: NF4Weight, dtype: torch.dtype) -> torch.Tensor:
    """Dequantize into a buffer shared by all layers (grown to the largest weight seen).

    Safe because each use is finished (in stream order) before the next layer
    overwrites it, and it is never saved for backward.
    """
    key = (quant.device, dtype)
    buf = _WORKSPACE.get(key)
    if buf is None or buf.numel() < quant.numel:
        buf = _WORKSPACE[key] = torch.empty(quant.numel, dtype=dtype, device=quant.device)
    return nf4_dequantize(quant, dtype, out=buf[: quant.numel].view(quant.shape))


def _keep_scale(p: float, dtype: torch.dtype) -> float:
    # 1/(1-p) rounded to the activation dtype, the value ATen's dropout multiplies by.
    return float(torch.ones((), dtype=dtype).div_(1.0 - p)) if p > 0 else 1.0


class FusedLoRANF4Function(torch.autograd.Function):
    """autograd wrapper; inputs x (tokens, in), A (r, in), B (out, r), bias (out,) or None."""

    @staticmethod
    def forward(ctx, x, A, B, bias, quant, scaling, dropout_p, weight_mode, out_dtype):
        keep = dropout_noise(x, dropout_p) if dropout_p > 0 else None
        x_lora = x if keep is None else apply_dropout(x, keep, dropout_p)
        xa = x_lora @ A.t()
        if weight_mode == "tiles":
            y = nf4_lora_matmul(x, quant, True, left=xa, right=B.t(), lora_scale=scaling, bias=bias,
                                out_dtype=out_dtype)
        else:
            w = _dequant_workspace(quant, x.dtype)
            y = torch.addmm(bias.to(x.dtype), x, w.t()) if bias is not None else x @ w.t()
            if out_dtype == x.dtype:
                y.addmm_(xa, B.t(), alpha=scaling)
            else:  # the LoRA term is added in the wider dtype, not lost in the base's rounding
                y = y.to(out_dtype).add_(xa @ B.t(), alpha=scaling)
        ctx.save_for_backward(x, A, B, xa, keep)
        ctx.quant, ctx.scaling, ctx.dropout_p, ctx.weight_mode = quant, scaling, dropout_p, weight_mode
        return y

    @staticmethod
    def backward(ctx, dy):
        x, A, B, xa, keep = ctx.saved_tensors
        dy = dy.to(x.dtype)  # an output widened by out_dtype: the gradient computes in x's dtype
        need_x, need_A, need_B, need_bias = ctx.needs_input_grad[:4]
        s, p = ctx.scaling, ctx.dropout_p
        dx = dA = dB = dbias = None
        if need_B:
            dB = dy.t() @ (xa * s)
        if need_x or need_A:
            dxa = (dy @ B) * s
            if need_A:
                dA = dxa.t() @ (x if keep is None else apply_dropout(x, keep, p))
            if need_x and ctx.weight_mode == "tiles":
                dx = nf4_lora_matmul(dy, ctx.quant, False, left=dxa, right=A,
                                     keep=keep, keep_scale=_keep_scale(p, dy.dtype))
            elif need_x:
                dx = dy @ _dequant_workspace(ctx.quant, dy.dtype)
                if keep is None:
                    dx.addmm_(dxa, A)
                else:
                    dx += apply_dropout(dxa @ A, keep, p)
        if need_bias:
            dbias = dy.sum(0)
        return dx, dA, dB, dbias, None, None, None, None, None


def _check_inputs(x, quant, A, B, bias, dropout_p, weight_mode) -> None:
    if not isinstance(quant, NF4Weight):
        raise ValueError(f"quant must be an NF4Weight (see from_quant_state), got {type(quant).__name__}")
    quant.validate()
    n_out, n_in = quant.shape
    if x.dtype not in _DTYPES:
        raise ValueError(f"x must be float32/bfloat16/float16, got {x.dtype}")
    if x.dim() < 2 or x.shape[-1] != n_in:
        raise ValueError(f"x must have shape (..., {n_in}) to match quant.shape {quant.shape}, got {tuple(x.shape)}")
    if A.dim() != 2 or A.shape[1] != n_in or A.shape[0] == 0:
        raise ValueError(f"A must have shape (r, {n_in}), got {tuple(A.shape)}")
    if B.dim() != 2 or B.shape != (n_out, A.shape[0]):
        raise ValueError(f"B must have shape ({n_out}, {A.shape[0]}) for r={A.shape[0]}, got {tuple(B.shape)}")
    for name, t in (("A", A), ("B", B)):
        if t.dtype != x.dtype:
            raise ValueError(f"{name} must have x's dtype {x.dtype}, got {t.dtype} (cast it with .to())")
    if bias is not None and (bias.shape != (n_out,) or bias.dtype != x.dtype):
        raise ValueError(f"bias must be a ({n_out},) tensor of {x.dtype}, got {tuple(bias.shape)} {bias.dtype}")
    for name, t in (("A", A), ("B", B), ("bias", bias), ("quant.packed", quant.packed)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if weight_mode not in ("tiles", "buffer"):
        raise ValueError(f"weight_mode must be 'tiles' or 'buffer', got {weight_mode!r}")


def fused_lora_linear(
    x: torch.Tensor,
    quant: NF4Weight,
    A: torch.Tensor,
    B: torch.Tensor,
    scaling: float,
    bias: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    weight_mode: str = "tiles",
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``x @ W^T + bias + scaling * (dropout(x) @ A^T) @ B^T``, W frozen NF4.

    Same result as peft's LoRA layer over ``bnb.nn.Linear4bit`` (``scaling = alpha / r``).
    x: (tokens, in) or (batch, seq, in); A: (r, in); B: (out, r); bias: (out,).
    A, B and bias must have x's dtype.  Dropout is applied whenever ``dropout_p > 0``,
    so pass ``p if module.training else 0.0``.  Returns (..., out) in ``out_dtype``, x's dtype
    by default. A wider ``out_dtype`` (fp32 for a bf16 x) keeps a LoRA term smaller than the base
    output's rounding step, as peft does by adding its fp32 LoRA output to an fp32 residual: early
    in training the delta is ~1e-4 of the output, below bf16's 2^-8.
    """
    _check_inputs(x, quant, A, B, bias, dropout_p, weight_mode)
    out_dtype = out_dtype or x.dtype
    if out_dtype not in _DTYPES:
        raise ValueError(f"out_dtype must be float32/bfloat16/float16, got {out_dtype}")
    check_device(x, "x")
    lead = x.shape[:-1]
    y = FusedLoRANF4Function.apply(
        x.reshape(-1, x.shape[-1]), A, B, bias, quant, float(scaling), float(dropout_p), weight_mode, out_dtype
    )
    return y.reshape(*lead, quant.shape[0])
