"""Adapter folders on disk: writing tunekit's own format, and checking any method's folder.

A tunekit adapter folder (bottleneck adapters, BitFit) is adapter_model.safetensors (fp32) plus
adapter_config.json; LoRA and prompt tuning use PEFT's folders, full fine-tunes a transformers
model folder. The checks below read whatever *.safetensors the folder holds.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from tunekit import TunekitError


def save_tensors(out_dir: Path, tensors: dict[str, torch.Tensor], config: dict) -> None:
    """A tunekit adapter folder: adapter_model.safetensors (fp32) + adapter_config.json."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().float().contiguous().cpu() for k, v in tensors.items()},
              str(out_dir / "adapter_model.safetensors"))
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")


def load_tensors_into(in_dir: Path, params: dict[str, torch.Tensor]) -> None:
    """Copy a folder written by `save_tensors` into `params` (same names; fit checked by Method.load)."""
    saved = read_tensors(Path(in_dir))
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(saved[name])


def _weight_files(folder: Path) -> list[Path]:
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise TunekitError(f"{folder}: no *.safetensors file (not a saved adapter or model folder)")
    return files


def read_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """{key: shape} of every tensor in the folder's safetensors files, without reading the data."""
    shapes = {}
    for f in _weight_files(folder):
        try:
            with safe_open(str(f), framework="pt") as handle:
                for key in handle.keys():
                    shapes[key] = tuple(handle.get_slice(key).get_shape())
        except (SafetensorError, OSError, ValueError) as e:
            raise TunekitError(f"{f}: unreadable or truncated safetensors file ({str(e).splitlines()[0][:120]})") from None
    return shapes


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in _weight_files(folder):
        try:
            out.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError) as e:
            raise TunekitError(f"{f}: unreadable or truncated safetensors file ({str(e).splitlines()[0][:120]})") from None
    return out


def check_loadable(folder: Path, expected: dict[str, torch.Tensor]) -> None:
    """The folder must hold every expected key in the expected shape; one error naming the first misfit."""
    shapes = read_shapes(folder)
    missing = [k for k in expected if k not in shapes]
    if missing:
        raise TunekitError(f"{folder}: lacks {len(missing)} of the {len(expected)} tensors this model trains "
                           f"(first missing: {missing[0]}); it was saved by another method or configuration")
    for key, p in expected.items():
        if shapes[key] != tuple(p.shape):
            raise TunekitError(f"{folder}: {key} has shape {shapes[key]}, this model has {tuple(p.shape)} "
                               "(saved with another size setting, e.g. method.r, or for another base model?)")


def verify_saved(folder: Path, expected: dict[str, torch.Tensor]) -> None:
    """Read a just-written folder back: every expected tensor must be there and equal the model's."""
    if not expected:
        raise TunekitError(f"{folder}: the model has no trainable tensors to save")
    saved = read_tensors(folder)
    missing = [k for k in expected if k not in saved]
    if missing:
        raise TunekitError(f"saving {folder} failed its check: it holds {len(expected) - len(missing)} of "
                           f"{len(expected)} trainable tensors (first missing: {missing[0]})")
    for key, p in expected.items():
        value = p.detach().to(device="cpu", dtype=saved[key].dtype)
        if saved[key].shape != value.shape or not torch.equal(saved[key], value):
            raise TunekitError(f"saving {folder} failed its check: {key} on disk differs from the model's tensor")
