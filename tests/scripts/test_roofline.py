"""scripts/roofline.py: the counting behind the CPU roofline (FLOPs, layouts, bytes), on a profile of
a few ops whose answers are known by hand."""

from __future__ import annotations

import sys

import torch
from torch.profiler import ProfilerActivity, profile

from _helpers import REPO

sys.path.insert(0, str(REPO / "scripts"))
import roofline  # noqa: E402


def _events(fn):
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    return prof.events()


def test_matmul_keys_flops_and_layouts():
    a = torch.randn(24, 16, dtype=torch.bfloat16)
    w = torch.randn(8, 16, dtype=torch.bfloat16)  # a linear's weight: used transposed
    bias = torch.randn(8)
    x = torch.randn(24, 16)
    events = _events(lambda: (torch.nn.functional.linear(a, w), a.t() @ a, torch.addmm(bias, x, w.float().t())))
    keys = [roofline.matmul_key(e) for e in events if e.name in roofline.MATMULS]
    by_shape = {(k[0], k[2], k[3]): k for k in keys}
    # x @ w^T: b is w's transpose, a column-major view; 2*M*K*N FLOPs
    lin = by_shape[("aten::mm", (24, 16), (16, 8))]
    assert lin[4:6] == (False, True) and roofline.matmul_flops(lin) == 2 * 24 * 16 * 8
    gram = by_shape[("aten::mm", (16, 24), (24, 16))]
    assert gram[4:6] == (True, False) and roofline.matmul_flops(gram) == 2 * 16 * 24 * 16
    addmm = by_shape[("aten::addmm", (24, 16), (16, 8))]
    assert addmm[1] == "float" and addmm[6] is True
    for key in (lin, gram, addmm):  # the isolated re-run builds operands of the recorded layout
        assert roofline.time_matmul(key, budget_s=0.01) > 0


def test_own_bytes_counts_inputs_and_one_output_once_and_no_views():
    x = torch.randn(32, 64)
    y = torch.randn(32, 64)
    xb = x.bfloat16()

    def work():
        x * y  # reads 2 fp32, writes 1
        xb.float()  # aten::to -> _to_copy -> copy_: the copy_ writes fp32 and reads bf16, the rest nothing
        y * 3.0  # a scalar operand is wrapped by a child op; the multiply still moves 2 fp32 tensors
        x.view(64, 32)  # a view moves nothing
        x.t()
        x.to(torch.float32)  # nothing to do: returns x
        torch.nn.functional.embedding(torch.tensor([3, 5]), y)  # reads 2 rows of 64, writes 2

    got = {}
    for e in _events(work):
        got.setdefault(e.name, []).append(roofline.own_bytes(e))
    n = 32 * 64
    assert sorted(got["aten::mul"]) == [2 * 4 * n, 3 * 4 * n]
    assert got["aten::copy_"] == [(4 + 2) * n, 0]  # the second: the wrapped scalar (no shape)
    assert got["aten::_to_copy"] == [0, 0]
    assert got["aten::view"] == [0] and got["aten::t"] == [0]
    assert set(got["aten::to"]) == {0}
    assert sum(got["aten::embedding"] + got.get("aten::index_select", [])) == 2 * 2 * 64 * 4


def test_analyze_floors_and_ceilings_are_consistent():
    a = torch.randn(64, 32, dtype=torch.bfloat16)
    b = torch.randn(32, 48, dtype=torch.bfloat16)
    events = _events(lambda: ((a @ b).float() * 2.0))
    flops = 2 * 64 * 32 * 48
    summary, lines = roofline.analyze(events, lambda name: "elementwise", step_wall_s=1.0, useful_flops=flops,
                                      peak_gflops=100.0, model_dims={32, 48}, peak_dtype="fp32")
    assert summary["matmul_gflop"] == flops / 1e9
    assert summary["mfu"] == flops / 1.0 / 100e9
    # the cast and the multiply: 64x48 bf16 -> fp32 (6 bytes each), then fp32 * scalar (8 bytes each)
    assert summary["rest_gb"] == 64 * 48 * (6 + 8) / 1e9
    for f in summary["floors"].values():  # each floor is at least the matmul time, so its MFU is bounded by it
        assert f["floor_s"] >= summary["matmul_isolated_s"]
        assert f["mfu_ceiling"] <= summary["mfu_matmuls_only"]
    assert any("`mm` bf16 Mx32 @ 32x48" in line for line in lines)
    # MFU is taken against the peak of the dtype the base computes in, and the report names it
    assert summary["peak_dtype"] == "fp32"
    assert any(line.startswith("- fp32 matmul peak measured in this run") for line in lines)


def test_compiled_regions_count_at_their_profiled_time():
    """kernels.compile=true: an inductor graph's call is one named region whose own time is its fused
    kernels (the profiler records no shapes for it). The floor keeps that time as profiled, as for
    attention; before, the region fell out of the analysis and the ceiling was too high."""
    import time

    from torch.profiler import record_function

    from profile_train import family  # scripts/ is on the path (above)

    a = torch.randn(64, 32)
    b = torch.randn(32, 48)

    def step():
        a @ b
        # a hash that holds other families' keys ("4bit", "adam", "sdpa"): the region still counts as compiled
        with record_function("## Call CompiledFxGraph f4bitadamsdpa ##"):
            time.sleep(0.05)  # stands in for the fused kernels' work

    events = _events(step)
    summary, lines = roofline.analyze(events, family, step_wall_s=1.0, useful_flops=2 * 64 * 32 * 48,
                                      peak_gflops=100.0, model_dims={32, 48}, peak_dtype="fp32")
    assert 0.05 <= summary["compiled_profiled_s"] < 1.0
    for f in summary["floors"].values():
        assert f["floor_s"] >= summary["matmul_isolated_s"] + summary["compiled_profiled_s"]
    assert any("compiled regions (inductor's fused kernels, profiled)" in line for line in lines)
    assert family("## Call CompiledFxGraph f4bitadamsdpa ##") == "compiled regions (inductor's fused kernels)"
    assert family("TorchDynamo Cache Lookup") == family("CompiledFunctionBackward") == \
        "torch.compile guards and wrappers"
    # an eager profile has no region, and its report says nothing of one
    summary, lines = roofline.analyze(_events(lambda: a @ b), family, 1.0, 2 * 64 * 32 * 48, 100.0, {32, 48})
    assert summary["compiled_profiled_s"] == 0 and not any("compiled regions" in line for line in lines)
