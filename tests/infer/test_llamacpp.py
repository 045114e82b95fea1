"""tunekit/infer/llamacpp.py's own parts: the weight-repacking decision and the scoped model
parameters (the GGUF export through llama.cpp itself is tested in test_export.py)."""

from __future__ import annotations

import pytest

from _helpers import need_llama_cpp
from tunekit import TunekitError


@pytest.mark.parametrize("flags, repack", [
    ("fpu sse avx2 fma avx512f avx512bw avx512_vnni avx512_bf16", True),  # AVX512 without AMX (AMD EPYC Zen 4)
    ("fpu avx2 fma avx512f avx512_bf16 amx_bf16 avx512_fp16 amx_tile amx_int8", False),  # Intel Xeon with AMX (2026-11-25 VM)
    ("", True),  # no /proc/cpuinfo: llama.cpp's default
])
def test_weight_repacking_is_off_where_the_cpu_has_amx(flags, repack):
    from tunekit.infer.llamacpp import weight_repacking

    ok, why = weight_repacking(f"processor\t: 0\nflags\t\t: {flags}\n")
    assert ok is repack and ("repacking off" in why) is (not repack)


def test_a_binding_without_the_model_parameter_is_one_clear_error():
    need_llama_cpp()
    import llama_cpp.llama_cpp as C

    from tunekit.infer.llamacpp import _model_params

    real = C.llama_model_default_params
    with pytest.raises(TunekitError, match=r"model parameters have no no_such_field .*llama_cpp_wheel.sh"):
        with _model_params(no_such_field=True):
            pass
    with pytest.raises(RuntimeError, match="boom"):  # the defaults come back after an error inside
        with _model_params(use_extra_bufts=False):
            assert C.llama_model_default_params().use_extra_bufts is False
            raise RuntimeError("boom")
    assert C.llama_model_default_params is real
