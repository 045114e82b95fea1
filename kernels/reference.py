"""Pure-torch twins of the Triton ops: the oracles the tests compare against.

They run anywhere (CPU, any GPU, no Triton) and are written for reading, not speed:
``lora_linear_reference`` materialises the full dequantized weight.
"""

from __future__ import annotations

import torch

from .quant import NF4Weight


# Elements dequantized at a time. The index arithmetic below holds ~44 bytes per element at once
# (four int64 index tensors, three fp32 lookups): in one pass over a 14336 x 4096 weight that is
# ~2.4 GiB beside the result, and training runs this twin on the device, in its kernel checks, on
# top of the loaded model (benchmarks/gpu/ has the measured setup peak). 2^20 elements hold ~44 MiB.
# Even, so that the two nibbles of a byte fall in one chunk.
DEQUANT_CHUNK = 1 << 20


def dequant_nf4_reference(quant: NF4Weight, dtype: torch.dtype = torch.float32,
                          chunk: int = DEQUANT_CHUNK) -> torch.Tensor:
    """Dense (out, in) weight from an NF4 weight using plain indexing ops.

    Same operation order as bitsandbytes (fp32 scale = code2[q] * absmax2 + offset,
    value = code[nibble] * scale, one cast at the end), so it is bit-exact with
    ``bitsandbytes.functional.dequantize_4bit``. Works `chunk` elements at a time into the
    result (an even count: the two nibbles of a byte fall in one chunk).
    """
    quant.validate()
    if chunk <= 0 or chunk % 2:
        raise ValueError(f"chunk must be a positive even number of elements, not {chunk}")
    n = quant.numel
    if quant.nested:
        n_blocks = quant.absmax.numel()
        blocks = torch.arange(n_blocks, device=quant.device)
        scale = quant.code2[quant.absmax.long()] * quant.absmax2[blocks // quant.blocksize2]
        scale = scale + quant.offset
    else:
        scale = quant.absmax
    out = torch.empty(n, dtype=dtype, device=quant.device)
    for start in range(0, n, chunk):
        idx = torch.arange(start, min(start + chunk, n), device=quant.device)
        byte = quant.packed[idx // 2].long()
        nibble = torch.where(idx % 2 == 0, byte >> 4, byte & 0xF)
        out[start:start + idx.numel()] = quant.code[nibble] * scale[idx // quant.blocksize]
    return out.reshape(quant.shape)


def dropout_noise(x: torch.Tensor, p: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """Dropout keep-mask (bool, shape of x) drawn as ATen's CPU dropout draws it.

    ``torch.nn.functional.dropout`` on CPU calls ``bernoulli_(1 - p)`` on a tensor like
    ``x``; doing the same here means that, with the same seed, the fused op drops the
    same elements as peft's ``nn.Dropout`` (CUDA dropout uses another RNG stream).
    """
    return torch.empty_like(x).bernoulli_(1.0 - p, generator=generator).bool()


def apply_dropout(x: torch.Tensor, keep: torch.Tensor, p: float) -> torch.Tensor:
    """x * keep / (1 - p) with ATen's rounding order (noise scaled first, then multiplied)."""
    return x * keep.to(x.dtype).div_(1.0 - p)


def lora_linear_reference(
    x: torch.Tensor,
    quant: NF4Weight,
    A: torch.Tensor,
    B: torch.Tensor,
    scaling: float,
    bias: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """LoRA (Hu et al. 2021) over a frozen NF4 base, with peft's semantics.

    ``y = x @ W^T + bias + scaling * (dropout(x) @ A^T) @ B^T`` with x (tokens, in) or
    (batch, seq, in), A (r, in), B (out, r), W = dequant(quant) of shape (out, in).
    Differentiable in x, A and B by ordinary autograd.  ``keep`` (bool, shape of x)
    fixes the dropout mask; otherwise one is drawn with :func:`dropout_noise`.
    """
    w = dequant_nf4_reference(quant, x.dtype)
    y = torch.nn.functional.linear(x, w, None if bias is None else bias.to(x.dtype))
    x_lora = x
    if dropout_p > 0.0:
        keep = dropout_noise(x, dropout_p) if keep is None else keep
        x_lora = apply_dropout(x, keep, dropout_p)
    return y + (x_lora @ A.t() @ B.t()) * scaling
