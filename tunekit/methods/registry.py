"""What a PEFT method is, and the registry the recipe looks methods up in.

A method decides which small part of a frozen base trains. It is one file in this package with a
`Method` subclass registered under its name; the recipe calls `get_method(cfg.method.name)` and
never branches on the name. Subclasses implement `apply`, `write`, `read` (and `merge` where the
trained part folds into the base); the `save` and `load` that everything else calls are defined
once here, around them, so that no method can save an incomplete adapter or load one silently:

* save: write, then read the folder back; every trainable tensor must be there, equal to the
  model's (peft 0.21 once saved 0 tensors for layers it did not recognise).
* load: before touching the model, the folder must hold every tensor the model expects, in the
  expected shapes; the first missing or misfit key is named in one error.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Dict

import torch
import torch.nn as nn

from tunekit import TunekitError


class Method:
    name: str = "?"
    can_merge: bool = False
    # Whether the trained parameters are the model's own weights, kept in fp32 as master copies, so
    # that the forward computes under the precision policy's autocast (tunekit.speed.precision). The other
    # methods add small parts that compute in fp32 and hand back the frozen base's dtype.
    autocast: bool = False

    @staticmethod
    def check_config(cfg, model: nn.Module | None = None, quantize: str = "none") -> None:
        """Raise TunekitError naming the method.* key of a bad value. Without `model`: what needs
        no model (ranges, names). With the base (loaded, or a skeleton on the meta device) and its
        `quantize`: also that what the config names exists in it. Config validation calls this
        before anything loads (through `check_method_config`), and `apply` calls it again."""

    def apply(self, model: nn.Module, cfg) -> nn.Module:
        """Freeze the base, add the method's trainable parameters; return the model to train."""
        raise NotImplementedError

    def write(self, model: nn.Module, out_dir: Path) -> None:
        """Write the trained part in its standard (PEFT, or tunekit adapter) format."""
        raise NotImplementedError

    def read(self, model: nn.Module, in_dir: Path) -> None:
        """Load weights written by `write` into a model that went through `apply`."""
        raise NotImplementedError

    def owns(self, param_name: str) -> bool:
        """Whether `param_name` is one of the parameters this method added (and trains)."""
        raise NotImplementedError

    def saved_key(self, param_name: str) -> str:
        """The key under which `write` stores the method's parameter `param_name`."""
        return param_name

    def merge(self, model: nn.Module) -> nn.Module:
        """Fold the trained part into the base: a plain transformers model (no peft wrappers, no
        bitsandbytes layers, no hooks) whose logits equal the trained model's. A 4-bit base comes
        out dequantized in fp32. May reuse `model`'s storage: do not train `model` afterwards."""
        raise cannot_merge(self.name)

    # ------------------------------------------------------------ defined once, for every method
    def expected_tensors(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """{saved key: parameter} for every parameter the method owns (trainable while training;
        export and evaluation freeze them, and must still save and load all of them)."""
        return {self.saved_key(name): p for name, p in model.named_parameters() if self.owns(name)}

    def save(self, model: nn.Module, out_dir: Path) -> None:
        """write(), then prove the folder holds every trainable tensor, equal to the model's."""
        from tunekit.methods.saving import verify_saved

        self.write(model, Path(out_dir))
        verify_saved(Path(out_dir), self.expected_tensors(model))

    def load(self, model: nn.Module, in_dir: Path) -> None:
        """Refuse a folder that lacks any expected tensor (or holds one of another shape), then read()."""
        from tunekit.methods.saving import check_loadable

        check_loadable(Path(in_dir), self.expected_tensors(model))
        self.read(model, Path(in_dir))


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
