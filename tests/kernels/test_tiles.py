"""Every Triton kernel fits the shared memory of every NVIDIA target it may run on.

No GPU needed: Triton's wheel ships ptxas, so the kernels are cross-compiled for each target
(in a child process, since this one interprets them) and the compiler's ``metadata.shared``
is checked against the target's per-block limit, for every config the autotuner is offered there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tunekit_kernels import tiles

HALF = (torch.bfloat16, torch.float16)


def test_targets_limits_and_dtypes():
    assert tiles.TARGETS == ((7, 5), (8, 0), (8, 6), (8, 9), (9, 0))
    assert [tiles.smem_limit(c) for c in tiles.TARGETS] == [65_536, 166_912, 101_376, 101_376, 232_448]
    assert tiles.smem_limit((12, 0)) is None
    assert tiles.dtypes_for((7, 5)) == (torch.float32, torch.float16)  # Turing: no bf16, trains in fp16
    assert all(tiles.dtypes_for(c) == (torch.float32, *HALF) for c in tiles.TARGETS[1:])


def test_offered_configs_are_a_plain_function_of_capability_and_dtype():
    names = lambda cap, dtype, **kw: [tiles.config_name(c) for c in tiles.configs_for(cap, dtype, **kw)]  # noqa: E731
    for cap in tiles.TARGETS:
        for dtype in tiles.dtypes_for(cap):
            assert names(cap, dtype), (cap, dtype)  # never nothing to offer
    deep = "128x256x64 w8 s4"  # the deepest pipeline: A100 and H100 only
    assert deep in names((8, 0), torch.bfloat16) and deep in names((9, 0), torch.bfloat16)
    assert deep not in names((8, 6), torch.bfloat16) and deep not in names((8, 9), torch.float16)
    assert names((8, 6), torch.float32) == [tiles.config_name(c) for c in tiles.matmul_configs(torch.float32)]
    # a capability the table does not list needs the device's limit, and a tiny one fits nothing
    with pytest.raises(ValueError, match="no shared-memory limit known for sm_120"):
        tiles.configs_for((12, 0), torch.bfloat16)
    assert names((12, 0), torch.bfloat16, limit=32_768) == ["64x64x32 w4 s5"]
    with pytest.raises(RuntimeError, match="no config of the fused NF4 matmul fits sm_86"):
        tiles.configs_for((8, 6), torch.bfloat16, limit=4096)


class _FakeCudaTensor:
    def __init__(self, dtype):
        self.device, self.dtype = torch.device("cuda", 0), dtype


def test_the_autotuner_prunes_for_the_input_device(monkeypatch):
    from tunekit_kernels.lora import _nf4_lora_matmul_kernel

    assert _nf4_lora_matmul_kernel.early_config_prune is tiles.prune_for_device
    every = tiles.matmul_configs()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 6))
    kept = tiles.prune_for_device(every, {"inp_ptr": _FakeCudaTensor(torch.bfloat16)})
    assert all(any(k is c for c in every) for k in kept)  # the autotuner's own config objects
    assert [tiles.config_key(c) for c in kept] == [tiles.config_key(c) for c in tiles.configs_for((8, 6), torch.bfloat16)]
    kept = tiles.prune_for_device(every, {"inp_ptr": _FakeCudaTensor(torch.float32)})
    assert [tiles.config_key(c) for c in kept] == [tiles.config_key(c) for c in tiles.matmul_configs(torch.float32)]
    # a capability not in the table: the device's own opt-in limit
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (12, 0))
    props = type("Props", (), {"shared_memory_per_block_optin": 32_768})()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    kept = tiles.prune_for_device(every, {"inp_ptr": _FakeCudaTensor(torch.bfloat16)})
    assert [tiles.config_name(c) for c in kept] == ["64x64x32 w4 s5"]
    # CPU tensors run the interpreter's single config: nothing to prune
    assert tiles.prune_for_device(every, {"inp_ptr": torch.empty(1)}) is every


_CHILD = """
import json, sys, torch
from tunekit_kernels import tiles
from tunekit_kernels.lora import OPTIONS, _nf4_lora_matmul_kernel
from tunekit_kernels.nf4 import _nf4_dequant_kernel

same = []
for dtype in (torch.float32, torch.bfloat16):
    for launch, (args, constexprs) in tiles.matmul_launches(dtype, **tiles.CHECK_SHAPE).items():
        config = tiles.matmul_configs(dtype)[0]
        c = {**constexprs, **config.kwargs}
        jit = tiles.jit_specialization(_nf4_lora_matmul_kernel, args, c, num_warps=config.num_warps,
                                     num_stages=config.num_stages, **OPTIONS)
        same.append(None if jit is None else jit == tiles.specialize(tiles.jit_function(_nf4_lora_matmul_kernel), args, c))
args, constexprs, options = tiles.dequant_launch(torch.bfloat16, **tiles.CHECK_SHAPE)
jit = tiles.jit_specialization(_nf4_dequant_kernel, args, constexprs, **options)
same.append(None if jit is None else jit == tiles.specialize(tiles.jit_function(_nf4_dequant_kernel), args, constexprs))
json.dump({"rows": tiles.check_targets(), "same_as_jit": same}, sys.stdout)
"""


def test_every_offered_config_compiles_within_the_limit(tmp_path):
    """For sm_75 (fp32, fp16), sm_80, sm_86, sm_89, sm_90 (fp32, bf16, fp16): the NF4 dequantization kernel
    and the fused matmul's forward in every config offered there compile, and one block needs no
    more shared memory than the target has, nor than the pruning's estimate. In the largest config
    offered on sm_86 in bf16, also dx, and both launches for a layer whose rows start on a block
    (the kernel's other branch). A fresh Triton cache, so the cost is the real one."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    proc = subprocess.run([sys.executable, "-c", _CHILD], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert False not in result["same_as_jit"]  # the launches compiled are the ones the JIT compiles

    rows = result["rows"]
    for r in rows:
        where = f"{r['kernel']} {r['launch']} sm_{r['capability'][0]}{r['capability'][1]} {r['dtype']} {r['config']}"
        assert r["shared"] <= r["limit"], f"{where}: needs {r['shared']} bytes, the limit is {r['limit']}"
        assert r["estimate"] is None or r["shared"] <= r["estimate"], f"{where}: {r['shared']} > {r['estimate']}"
    for cap in tiles.TARGETS:
        for dtype in tiles.dtypes_for(cap):
            name = tiles.dtype_name(dtype)
            here = [r for r in rows if tuple(r["capability"]) == cap and r["dtype"] == name and r["shape"] == "worst"]
            forward = {r["config"] for r in here if r["launch"] == "forward"}
            assert forward == {tiles.config_name(c) for c in tiles.configs_for(cap, dtype)}, (cap, name)
            assert [r["kernel"] for r in here if r["launch"] == "dequant"] == ["nf4_dequantize"], (cap, name)
    extra = sorted((r["launch"], r["shape"], r["dtype"], tuple(r["capability"]), r["config"]) for r in rows
                   if r["launch"] == "dx" or r["shape"] == "model")
    largest = "128x128x64 w8 s3"  # the largest tile offered on sm_86
    assert extra == [("dx", "model", "bf16", (8, 6), largest), ("dx", "worst", "bf16", (8, 6), largest),
                     ("forward", "model", "bf16", (8, 6), largest)]


def test_the_table_script_refuses_to_interpret():
    """scripts/kernel_tiles.py (the before/after table in benchmarks/kernels/kernel-tiles.md) must compile."""
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "kernel_tiles.py"
    proc = subprocess.run([sys.executable, str(script)], env={**os.environ, "TRITON_INTERPRET": "1"},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "unset TRITON_INTERPRET" in proc.stderr
