"""Safetensors files written one tensor at a time, sharded as Hugging Face shards a checkpoint.

`safetensors.torch.save_file` takes every tensor of a file at once: a merged 8B model would be
16 GB in memory (bf16) before the first byte is written. The format does not need that: a file
is an 8-byte little-endian header length, a JSON header (each tensor's dtype, shape and byte range
within the data), then the tensors' bytes back to back in that order. Every shape and dtype is
known before any tensor is computed, so the header goes first and each tensor's bytes are
appended as it is produced, then freed. The files are what save_file writes up to the order of
the JSON keys (read back by safetensors itself in the tests).

Above `max_bytes` the checkpoint is split as transformers' save_pretrained splits it:
model-00001-of-0000N.safetensors ... plus model.safetensors.index.json ({"metadata":
{"total_size": bytes}, "weight_map": {name: file}}); below it, one model.safetensors.
"""

from __future__ import annotations

import json
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

# 5 GB: the shard size of most checkpoints on the hub (transformers' own default until v5, which
# moved to 50 GB); an 8B model in bf16 is 4 shards, each small enough for any download tool.
MAX_SHARD_BYTES = 5 * 10**9
INDEX = "model.safetensors.index.json"
DTYPE_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
               torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
               torch.bool: "BOOL"}


@dataclass(frozen=True)
class Entry:
    """One tensor of the checkpoint to write: its name, shape and stored dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


def split(entries: list[Entry], max_bytes: int) -> list[list[Entry]]:
    """Consecutive groups of at most max_bytes each (a larger tensor alone in its own), in order."""
    shards: list[list[Entry]] = [[]]
    size = 0
    for e in entries:
        if shards[-1] and size + e.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e.nbytes
    return shards


def shard_names(n: int) -> list[str]:
    return ["model.safetensors"] if n == 1 else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]


def write_checkpoint(folder: Path, entries: list[Entry], produce: Callable[[Entry], torch.Tensor],
                     max_bytes: int = MAX_SHARD_BYTES) -> list[str]:
    """Write `entries` into folder as one file or shards + index, calling produce(entry) for each
    tensor in order (it must return that shape and dtype, on any device); returns the file names."""
    groups = split(entries, max_bytes)
    names = shard_names(len(groups))
    for name, group in zip(names, groups):
        write_file(folder / name, group, produce)
    if len(names) > 1:
        index = {"metadata": {"total_size": sum(e.nbytes for e in entries)},
                 "weight_map": {e.name: name for name, group in zip(names, groups) for e in group}}
        (folder / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return names


def header_bytes(entries: list[Entry]) -> bytes:
    """The length-prefixed JSON header of a file holding `entries` in order (padded with spaces
    to a multiple of 8 bytes, as safetensors pads it, so that the data starts aligned)."""
    header: dict = {"__metadata__": {"format": "pt"}}  # transformers refuses a file without it
    offset = 0
    for e in entries:
        header[e.name] = {"dtype": DTYPE_NAMES[e.dtype], "shape": list(e.shape),
                          "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def write_file(path: Path, entries: list[Entry], produce: Callable[[Entry], torch.Tensor]) -> None:
    """One safetensors file, its tensors produced and written one at a time."""
    if sys.byteorder != "little":  # safetensors stores little-endian; torch's bytes are the machine's
        raise RuntimeError("writing safetensors on a big-endian machine is not supported")
    with open(path, "wb") as f:
        f.write(header_bytes(entries))
        for e in entries:
            t = produce(e)
            if tuple(t.shape) != e.shape or t.dtype != e.dtype:
                raise RuntimeError(f"{e.name}: produced {tuple(t.shape)} {t.dtype}, planned {e.shape} {e.dtype}")
            if e.nbytes:
                f.write(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().data)
            del t
