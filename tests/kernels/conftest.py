"""Test setup for tunekit_kernels: an import fallback, the GPU-only skips, the relative-error check.

Without CUDA the kernels run in Triton's numpy interpreter, switched on in tests/conftest.py: it
must be on before triton is imported, and tests collected before this folder import it.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch


def _import_tunekit_kernels():
    try:
        import tunekit_kernels  # installed by `pip install -e .` (pyproject maps it to kernels/)

        return tunekit_kernels
    except ImportError:
        pass
    # Not installed yet: load kernels/ under its installed name.  Never put the repo root
    # on sys.path for this, or `kernels` would shadow Hugging Face's package of that name.
    pkg_dir = Path(__file__).resolve().parents[2] / "kernels"
    spec = importlib.util.spec_from_file_location(
        "tunekit_kernels", pkg_dir / "__init__.py", submodule_search_locations=[str(pkg_dir)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["tunekit_kernels"] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules["tunekit_kernels"]
        raise
    return module


_import_tunekit_kernels()


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)


# Max |actual - expected| / max |expected| allowed, by the dtype the op computed in.
# fp32: only the summation order differs (Triton tiles vs MKL/cuBLAS), ~K * 2**-24
#       relative for K ~ 200, so 1e-5.
# fp16: 11-bit significand; operands and the output are rounded once each, so 2e-3.
# bf16: 8-bit significand (2**-8 ~ 4e-3 per rounding) and peft rounds the LoRA
#       intermediates too, so 2e-2.
REL_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def assert_close_rel(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str = "") -> None:
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a, e = actual.double(), expected.double()
    err = ((a - e).abs().max() / e.abs().max().clamp_min(1e-30)).item()
    assert err <= REL_TOL[dtype], f"{what}: relative error {err:.3g} > {REL_TOL[dtype]:.1g} ({dtype})"


@pytest.fixture
def assert_close():
    """The relative-error check above, as a fixture so test modules need no conftest import."""
    return assert_close_rel
