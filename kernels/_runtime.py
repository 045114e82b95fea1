"""Where the Triton kernels can run, and small launch helpers shared by the ops."""

from __future__ import annotations

import importlib.util
import os

import torch


def interpreting() -> bool:
    """True when Triton runs its numpy interpreter (TRITON_INTERPRET=1, e.g. CPU tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def is_available(device: torch.device | str | None = None) -> bool:
    """Whether the fused kernels can run for tensors on ``device``.

    True for a CUDA device when Triton is installed, and for the CPU when Triton's
    interpreter is switched on (TRITON_INTERPRET=1 must be set before triton is
    imported; it is far too slow for training, only for tests).
    """
    if not triton_importable():
        return False
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and not interpreting()
    return device.type == "cpu" and interpreting()


def check_device(t: torch.Tensor, name: str) -> None:
    if not is_available(t.device):
        raise RuntimeError(
            f"{name} is on {t.device}, where the Triton kernels cannot run "
            "(need CUDA + triton, or TRITON_INTERPRET=1 on CPU); use tunekit_kernels.reference"
        )
