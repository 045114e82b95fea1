"""PEFT methods: each one decides which small part of a frozen base trains.

A method is one file here that registers a `Method` under its name; the recipe looks it up with
`get_method(cfg.method.name)` and never branches on the name. Adding a method means: one file
here, one yaml in recipes/recipe/, one row in the shared method test table.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Dict, Protocol

import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

from tunekit import TunekitError


class Method(Protocol):
    name: str
    can_merge: bool

    @staticmethod
    def check_config(cfg, model: nn.Module | None = None, quantize: str = "none") -> None:
        """Raise TunekitError naming the method.* key of a bad value. Without `model`: what needs
        no model (ranges, names). With the base (loaded, or a skeleton on the meta device) and its
        `quantize`: also that what the config names exists in it. Config validation calls this
        before anything loads (through `check_method_config`), and `apply` calls it again."""

    def apply(self, model: nn.Module, cfg) -> nn.Module:
        """Freeze the base, add the method's trainable parameters; return the model to train."""

    def save(self, model: nn.Module, out_dir: Path) -> None:
        """Write the trained part in its standard (PEFT) format."""

    def load(self, model: nn.Module, in_dir: Path) -> None:
        """Load weights written by `save` into a model that went through `apply`."""

    def merge(self, model: nn.Module) -> nn.Module:
        """Fold the trained part into the base: a plain transformers model (no peft wrappers, no
        bitsandbytes layers, no hooks) whose logits equal the trained model's. A 4-bit base comes
        out dequantized in fp32. May reuse `model`'s storage: do not train `model` afterwards.
        Methods with can_merge False raise TunekitError."""


_REGISTRY: Dict[str, Callable[[], Method]] = {}


def register(name: str):
    def deco(cls):
        _REGISTRY[name] = cls
        cls.name = name
        return cls

    return deco


def get_method(name: str) -> Method:
    if name not in _REGISTRY:
        raise TunekitError(f"method.name: unknown method {name!r}; available: {sorted(_REGISTRY)}")
    return _REGISTRY[name]()


def check_method_config(cfg, model: nn.Module | None = None, quantize: str = "none") -> None:
    """cfg: the method config (name, r, ...). The method's own checks, without a branch on its name."""
    get_method(cfg.name).check_config(cfg, model, quantize)


def available_methods() -> list[str]:
    return sorted(_REGISTRY)


def trainable_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts; 4-bit params count their logical size."""
    trainable = total = 0
    for p in model.parameters():
        n = p.numel()
        # bitsandbytes packs two 4-bit values per uint8 element
        if getattr(p, "quant_state", None) is not None:
            n = p.quant_state.shape.numel() if hasattr(p.quant_state, "shape") else n * 2
        total += n
        if p.requires_grad:
            trainable += n
    return trainable, total


def cannot_merge(name: str) -> TunekitError:
    """The error of a method whose trained part has no equivalent inside the base's weights."""
    return TunekitError(
        f"method {name!r} cannot be merged into the base model (its trained part is not a change to "
        "existing weights); export the adapter instead (--format adapter)"
    )


def save_tensors(out_dir: Path, tensors: dict[str, torch.Tensor], config: dict) -> None:
    """A tunekit adapter folder: adapter_model.safetensors (fp32) + adapter_config.json."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().float().contiguous().cpu() for k, v in tensors.items()},
              str(out_dir / "adapter_model.safetensors"))
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")


def load_tensors_into(in_dir: Path, params: dict[str, torch.Tensor], what: str) -> None:
    """Copy a folder written by `save_tensors` into `params` (same names), checking the fit."""
    in_dir = Path(in_dir)
    path = in_dir / "adapter_model.safetensors"
    if not path.is_file():
        raise TunekitError(f"{in_dir}: no adapter_model.safetensors (not a saved adapter folder)")
    saved = load_file(str(path))
    if saved.keys() != params.keys():
        extra, missing = sorted(saved.keys() - params.keys()), sorted(params.keys() - saved.keys())
        raise TunekitError(f"{in_dir}: {what} do not fit this model (unexpected {extra[:2]}, missing {missing[:2]})")
    with torch.no_grad():
        for name, p in params.items():
            if saved[name].shape != p.shape:
                raise TunekitError(f"{in_dir}: {name} has shape {tuple(saved[name].shape)}, the model wants "
                                   f"{tuple(p.shape)} (another size or base model?)")
            p.copy_(saved[name])


# Each module registers itself on import.
from tunekit.methods import adapter, bitfit, full, lora, prompt_tuning  # noqa: E402,F401
