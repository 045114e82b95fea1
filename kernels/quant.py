"""Plain-tensor description of a bitsandbytes NF4 weight (no bitsandbytes import).

QLoRA (Dettmers et al. 2023) stores a frozen weight W of shape (out, in) as 4-bit
NormalFloat codes with *double quantization* of the per-block scales.  bitsandbytes
(checked against 0.50.2) lays it out like this:

* ``packed``: uint8, ``ceil(out*in / 2)`` bytes (bnb shapes it ``(n, 1)``).  W is
  flattened row-major; element ``i`` lives in byte ``i // 2``, the **high** nibble for
  even ``i`` and the low nibble for odd ``i``.  An odd element count pads the last byte.
* ``code``: fp32 (16,), the NF4 value table; a nibble indexes into it.
* ``absmax``: one scale per ``blocksize`` (64) consecutive *flat* elements, so blocks
  straddle rows when ``in`` is not a multiple of 64; the last block may be partial.
  With double quantization these scales are uint8 codes, themselves quantized in
  blocks of ``blocksize2`` (256) with the 8-bit dynamic code ``code2`` (fp32, 256) and
  per-block fp32 ``absmax2``; their mean ``offset`` was subtracted before quantizing.

Dequantization, bit-exact with ``bitsandbytes.functional.dequantize_4bit``::

    scale[b] = code2[absmax[b]] * absmax2[b // blocksize2] + offset   # fp32, mul then add
    W_flat[i] = (code[nibble(i)] * scale[i // blocksize]).to(dtype)   # one fp32 rounding

Without double quantization ``absmax`` is already the fp32 ``scale``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class NF4Weight:
    """The tensors and sizes needed to dequantize one NF4 weight of ``shape`` (out, in).

    All tensors must live on one device.  ``absmax2``/``code2``/``offset`` are ``None``
    when the scales are not double-quantized (``nested`` is then False).
    """

    packed: torch.Tensor
    absmax: torch.Tensor
    code: torch.Tensor
    shape: tuple[int, int]
    blocksize: int = 64
    absmax2: torch.Tensor | None = None
    code2: torch.Tensor | None = None
    offset: torch.Tensor | None = None
    blocksize2: int = 256
    dtype: torch.dtype = torch.float32  # dtype the weight had before quantization

    @property
    def nested(self) -> bool:
        return self.absmax2 is not None

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def device(self) -> torch.device:
        return self.packed.device

    def validate(self) -> None:
        """Raise ValueError, naming the field, when the tensors cannot describe ``shape``."""
        if len(self.shape) != 2 or min(self.shape) <= 0:
            raise ValueError(f"quant.shape must be (out, in) with positive sizes, got {self.shape}")
        n = self.numel
        if n >= 2**31:
            raise ValueError(f"quant.shape {self.shape} has >= 2**31 elements; kernels index with int32")
        _expect(self.packed, "quant.packed", torch.uint8, (n + 1) // 2)
        _expect(self.code, "quant.code", torch.float32, 16)
        if self.blocksize <= 0 or self.blocksize % 2:
            raise ValueError(f"quant.blocksize must be a positive even number, got {self.blocksize}")
        n_blocks = -(-n // self.blocksize)
        if self.nested:
            _expect(self.absmax, "quant.absmax", torch.uint8, n_blocks)
            _expect(self.absmax2, "quant.absmax2", torch.float32, -(-n_blocks // self.blocksize2))
            _expect(self.code2, "quant.code2", torch.float32, 256)
            _expect(self.offset, "quant.offset", torch.float32, 1)
        else:
            _expect(self.absmax, "quant.absmax", torch.float32, n_blocks)
        for name in ("absmax", "code", "absmax2", "code2", "offset"):
            t = getattr(self, name)
            if t is not None and t.device != self.packed.device:
                raise ValueError(f"quant.{name} is on {t.device} but quant.packed is on {self.packed.device}")


def _expect(t: Any, name: str, dtype: torch.dtype, numel: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise ValueError(f"{name} must have dtype {dtype}, got {t.dtype}")
    if t.numel() != numel:
        raise ValueError(f"{name} must have {numel} elements, got {t.numel()}")


def from_quant_state(packed: torch.Tensor, quant_state: Any) -> NF4Weight:
    """Build an :class:`NF4Weight` from a bnb ``Params4bit`` payload and its ``QuantState``.

    Duck-typed (``getattr``) so this module never imports bitsandbytes.  Typical use::

        w = linear4bit.weight
        quant = from_quant_state(w.data, w.quant_state)

    Raises ValueError for FP4 weights and for weights that bitsandbytes has repacked into
    its CPU-only layout (``packing_format_for_cpu``, done by an eval-mode no-grad forward
    on AVX512-BF16 CPUs): their bytes no longer follow the layout described above.
    """
    qs = quant_state
    if getattr(qs, "quant_type", "nf4") != "nf4":
        raise ValueError(f"quant_state.quant_type must be 'nf4', got {qs.quant_type!r}")
    if getattr(qs, "packing_format_for_cpu", False):
        raise ValueError(
            "quant_state uses bitsandbytes' CPU-repacked layout (packing_format_for_cpu=True); "
            "re-quantize the weight or run bnb's inverse conversion first"
        )
    shape = tuple(int(s) for s in qs.shape)
    if len(shape) != 2:
        raise ValueError(f"quant_state.shape must be 2-D (out, in), got {shape}")
    if packed.dtype != torch.uint8:
        packed = packed.view(torch.uint8)  # bnb allows other quant_storage dtypes
    state2 = getattr(qs, "state2", None)
    nested = bool(getattr(qs, "nested", False)) and state2 is not None
    quant = NF4Weight(
        packed=packed.reshape(-1),
        absmax=qs.absmax.reshape(-1),
        code=qs.code.to(device=packed.device, dtype=torch.float32),
        shape=shape,  # type: ignore[arg-type]
        blocksize=int(qs.blocksize),
        absmax2=state2.absmax.reshape(-1).float() if nested else None,
        code2=state2.code.to(packed.device).float() if nested else None,
        offset=torch.as_tensor(qs.offset, dtype=torch.float32, device=packed.device).reshape(1)
        if nested
        else None,
        blocksize2=int(state2.blocksize) if nested else 256,
        dtype=getattr(qs, "dtype", torch.float32),
    )
    if not nested and quant.absmax.dtype != torch.float32:
        quant = NF4Weight(**{**quant.__dict__, "absmax": quant.absmax.float()})
    quant.validate()
    return quant
