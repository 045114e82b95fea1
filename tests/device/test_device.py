"""tunekit.device.facts: every device decision, fed with the facts of devices this machine lacks."""

from __future__ import annotations

import random
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch

from tunekit.device import facts as dev

CPU = dev.DeviceFacts("cpu", cpu_bf16=False)
CPU_BF16 = dev.DeviceFacts("cpu", cpu_bf16=True)
T4 = dev.DeviceFacts("cuda", 0, (7, 5), "Tesla T4", 16 * 2**30)
V100 = dev.DeviceFacts("cuda", 0, (7, 0), "Tesla V100", 32 * 2**30)
A100 = dev.DeviceFacts("cuda", 0, (8, 0), "A100", 80 * 2**30)
H100_1 = dev.DeviceFacts("cuda", 1, (9, 0), "H100", 80 * 2**30)
P100 = dev.DeviceFacts("cuda", 0, (6, 0), "P100", 16 * 2**30)


@pytest.mark.parametrize("given, local_rank, current, expected", [
    ("cuda", 0, None, "cuda:0"),      # single process: Accelerator().device has no index
    ("cuda", 3, None, "cuda:3"),      # a launcher without an index: the local rank's GPU
    ("cuda", 0, 2, "cuda:2"),         # CUDA_VISIBLE_DEVICES / set_device made another current
    ("cuda:1", 0, None, "cuda:1"),    # accelerate launch: already indexed, kept
    ("cpu", 1, None, "cpu"),
])
def test_rank_device_always_has_an_index(given, local_rank, current, expected):
    assert dev.rank_device(torch.device(given), local_rank, current) == torch.device(expected)


@pytest.mark.parametrize("given, expected", [
    ("cuda", {"": 0}), ("cuda:0", {"": 0}), ("cuda:1", {"": 1}), ("cpu", {"": "cpu"}),
])
def test_device_map_never_holds_none(given, expected):
    assert dev.device_map(torch.device(given)) == expected


@pytest.mark.parametrize("facts, name, expected", [
    (A100, "auto", torch.bfloat16), (H100_1, "auto", torch.bfloat16),
    (T4, "auto", torch.float16),      # is_bf16_supported() says True on a T4: emulation; fp16 tensor cores
    (V100, "auto", torch.float16),
    (CPU_BF16, "auto", torch.bfloat16), (CPU, "auto", torch.float32),
    (T4, "bf16", torch.bfloat16),     # explicit: obeyed (emulated, slow, correct)
    (A100, "fp32", torch.float32),
])
def test_compute_dtype(facts, name, expected):
    assert dev.compute_dtype(name, facts) == expected


@pytest.mark.parametrize("facts, dtype, triton, interp, ok, why", [
    (H100_1, torch.bfloat16, True, False, True, "sm_90"),
    (A100, torch.bfloat16, True, False, True, "sm_80"),
    (T4, torch.bfloat16, True, False, False, "no native bf16"),
    (T4, torch.float32, True, False, True, "sm_75"),
    (V100, torch.float16, True, False, True, "sm_70"),
    (P100, torch.float32, True, False, False, "older than sm_70"),
    (H100_1, torch.bfloat16, False, False, False, "triton is not installed"),
    (H100_1, torch.bfloat16, True, True, False, "TRITON_INTERPRET"),
    (CPU_BF16, torch.bfloat16, True, False, False, "CUDA only"),
    (CPU, torch.float32, True, True, True, "interpreter"),
])
def test_fused_kernel_support(facts, dtype, triton, interp, ok, why):
    allowed, reason = dev.fused_kernel_support(facts, dtype, triton, interp)
    assert allowed is ok and why in reason


def test_cpu_bf16_from_cpuinfo():
    assert dev.cpu_has_bf16("flags: fpu avx512f avx512_bf16") and dev.cpu_has_bf16("flags: amx_bf16")
    assert not dev.cpu_has_bf16("flags: fpu avx2")


def test_probe_cpu():
    facts = dev.probe(torch.device("cpu"))
    assert facts.type == "cpu" and facts.device == torch.device("cpu") and facts.total_memory > 0


def test_describe():
    assert H100_1.describe() == "cuda:1 (H100, sm_90, 80 GiB)"
    assert H100_1.device == torch.device("cuda", 1)


def test_rng_state_round_trips_through_json():
    import json

    cpu = torch.device("cpu")
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    state = json.loads(json.dumps(dev.rng_state(cpu)))  # must be plain JSON: nothing pickled
    expected = (random.random(), np.random.rand(), torch.rand(3))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    dev.set_rng_state(state, cpu)
    got = (random.random(), np.random.rand(), torch.rand(3))
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])


def test_memory_figures_on_cpu():
    cpu = torch.device("cpu")
    assert dev.peak_memory_mb(cpu) > 10
    assert dev.available_memory_bytes(cpu) > 2**20


@pytest.mark.parametrize("given, expected", [("cuda", 0), ("cuda:1", 1), ("cpu", "cpu")])
def test_a_4bit_load_gets_a_device_index(given, expected):
    """A regression: load_base_model(dir, 'nf4', bf16, torch.device('cuda')) died on device_map={'': None}."""
    from tunekit.model.loader import load_kwargs

    kwargs = load_kwargs("nf4", torch.bfloat16, torch.device(given))
    assert kwargs["device_map"] == {"": expected}
    assert kwargs["quantization_config"].bnb_4bit_use_double_quant
    assert "device_map" not in load_kwargs("none", torch.bfloat16, torch.device(given))


def test_planning_facts_assume_a_modern_gpu_where_there_is_none():
    facts = dev.planning_facts("cuda", 24 * 2**30, cuda_available=False)
    assert facts.type == "cuda" and facts.total_memory == 24 * 2**30
    assert dev.compute_dtype("auto", facts) == torch.bfloat16  # sm_80+: bf16 native
    cpu = dev.planning_facts("cpu", 16 * 2**30, cuda_available=False)
    assert cpu.type == "cpu" and cpu.total_memory == 16 * 2**30
    with pytest.raises(ValueError):
        dev.planning_facts("tpu")


def test_dist_timeout_covers_the_largest_checkpoint():
    assert dev.dist_timeout_s(900, 10**12) == 900  # explicit: as given
    assert dev.dist_timeout_s("auto", None) == dev.DIST_TIMEOUT_BASE_S
    # a 100 GB full fine-tune checkpoint, written and read back at 50 MB/s: 4000 s on top
    assert dev.dist_timeout_s("auto", 100 * 10**9) == dev.DIST_TIMEOUT_BASE_S + 4000


def test_the_recipe_hands_accelerate_its_timeout(tiny_model_dir, tiny_data, tmp_path, monkeypatch):
    """What accelerate receives (it would give NCCL its 10-minute default otherwise)."""
    from datetime import timedelta

    import tunekit.train.loop
    from tunekit.config import DataConfig, ModelConfig, TrainConfig, TrainerConfig

    seen = {}

    class Stop(Exception):
        pass

    def fake_accelerator(**kwargs):
        seen.update(kwargs)
        raise Stop

    monkeypatch.setattr(tunekit.train.loop, "Accelerator", fake_accelerator)
    for setting, expected in (("auto", None), (7200, 7200)):
        cfg = TrainConfig(output_dir=str(tmp_path), model=ModelConfig(path=str(tiny_model_dir)),
                          data=DataConfig(path=str(tiny_data)), trainer=TrainerConfig(dist_timeout_s=setting))
        with pytest.raises(Stop):
            tunekit.train.loop.TrainRecipe(cfg, tmp_path).setup()
        (handler,) = seen["kwargs_handlers"]
        got = handler.timeout.total_seconds()
        assert got == (expected or got) and got >= dev.DIST_TIMEOUT_BASE_S
        assert handler.to_kwargs() == {"timeout": timedelta(seconds=got)}  # the backend stays accelerate's choice


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc/self/clear_refs")
def test_reset_peak_memory_starts_a_new_peak_on_the_cpu():
    """A run measures its training peak apart from setup's: after the reset, a freed 256 MiB buffer
    no longer counts. (256 MiB is above glibc's largest mmap threshold, 32 MiB: freed, it leaves RSS.)"""
    cpu = torch.device("cpu")
    big = torch.ones(256 * 2**20 // 4)
    big.add_(1)  # touched: resident
    del big
    before = dev.peak_memory_mb(cpu)
    dev.reset_peak_memory(cpu)
    after = dev.peak_memory_mb(cpu)
    assert after < before - 200, (before, after)


def test_release_cached_memory_empties_the_cuda_cache_only_on_a_gpu():
    with mock.patch("torch.cuda.empty_cache") as empty:
        dev.release_cached_memory(torch.device("cpu"))
        assert not empty.called
        dev.release_cached_memory(torch.device("cuda", 1))
    empty.assert_called_once_with()


def test_reset_peak_memory_asks_cuda_for_its_own_device():
    with mock.patch("torch.cuda.reset_peak_memory_stats") as reset:
        dev.reset_peak_memory(torch.device("cuda", 1))
    reset.assert_called_once_with(torch.device("cuda", 1))


def test_peak_memory_kind_names_what_is_measured():
    assert dev.peak_memory_kind(torch.device("cuda", 1)) == "torch max allocated"
    assert dev.peak_memory_kind(torch.device("cpu")) == "process peak RSS"


@pytest.mark.parametrize("requested, gpus, expected", [
    (None, 0, "cpu"), ("auto", 0, "cpu"), ("auto", 2, "cuda:0"), ("cpu", 2, "cpu"), ("cuda", 1, "cuda:0"),
    ("cuda:1", 2, "cuda:1"), (" CUDA:0 ", 1, "cuda:0"),
])
def test_a_command_runs_on_the_device_asked_for(requested, gpus, expected):
    from tunekit.device.facts import command_device

    assert command_device(requested, gpus) == torch.device(expected)


@pytest.mark.parametrize("requested, gpus, message", [
    ("cuda", 0, "--device cuda: this process sees no CUDA GPU"),
    ("cuda:1", 1, r"--device cuda:1: this process sees 1 GPU \(cuda:0\)"),
    ("cuda:2", 2, r"--device cuda:2: this process sees 2 GPUs \(cuda:0..cuda:1\)"),
    ("gpu", 1, "--device: unknown device 'gpu'"), ("cuda:x", 1, "--device: unknown device 'cuda:x'"),
])
def test_a_device_that_is_not_there_is_one_error(requested, gpus, message):
    from tunekit import TunekitError
    from tunekit.device.facts import command_device

    with pytest.raises(TunekitError, match=message):
        command_device(requested, gpus)


def test_the_inference_check_adds_the_cuda_allocator_margin_only_on_a_gpu():
    from tunekit import TunekitError
    from tunekit.device.facts import DeviceFacts
    from tunekit.plan import CUDA_ALLOCATOR_MARGIN
    from tunekit.plan.inference import check_fits

    gpu, cpu = DeviceFacts("cuda", 0, (8, 6), "NVIDIA A10", 24 * 2**30), DeviceFacts("cpu")
    terms = {"base weights": 10 * 2**30}
    need_gpu = int(10 * 2**30 * (1 + CUDA_ALLOCATOR_MARGIN))
    assert "of" in check_fits(terms, gpu, need_gpu, "x") and "of" in check_fits(terms, cpu, 10 * 2**30, "x")
    with pytest.raises(TunekitError, match=r"x needs about 11.00 GiB on cuda:0 \(NVIDIA A10.*--device cpu runs it in host memory; hint"):
        check_fits(terms, gpu, need_gpu - 1, "x", "hint")
    with pytest.raises(TunekitError) as e:
        check_fits(terms, cpu, 10 * 2**30 - 1, "x")
    assert "--device cpu" not in str(e.value)  # it is on the CPU already
    assert "not checked" in check_fits(terms, gpu, None, "x")


def test_fsdp_gathers_projection_by_projection_on_a_cpu_only():
    # a CPU rank's gathers are host memory and share its cores: the smallest units; a GPU keeps
    # FSDP2's layer units and its overlap
    assert dev.fsdp_projection_units("cpu", 2) is True
    assert dev.fsdp_projection_units("cuda", 2) is False
    assert dev.fsdp_projection_units("mps", 8) is False
    assert dev.fsdp_projection_units("cpu", 1) is False  # one rank gathers from nobody
