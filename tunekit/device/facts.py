"""Device facts and the decisions made from them, in one place.

Every question the trainer asks about its hardware is answered here: which device a rank uses,
the device map of a 4-bit load, the compute dtype, whether the fused Triton kernels may run,
memory figures, and the random-number state to checkpoint. The decisions are plain functions of
facts (device, CUDA capability, dtype, rank) so that tests can ask them about `cuda`, `cuda:1`,
sm_75 or sm_90 on a machine without a GPU. Only `probe`, the memory readers, the RNG helpers and
`Streams` touch torch.cuda; nothing else in tunekit does.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import resource
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from tunekit import TunekitError

log = logging.getLogger(__name__)

# Native bf16 tensor cores (and Triton's bf16 tl.dot) need Ampere or newer. torch's
# is_bf16_supported() also counts emulation, which says True on T4 (sm_75) and V100 (sm_70).
BF16_MIN_CAPABILITY = (8, 0)
# fp16 tensor cores: Volta (V100, sm_70) and Turing (T4, RTX 20xx, sm_75). Training there computes in
# fp16 with dynamic loss scaling (tunekit.train.loss_scale) rather than in fp32, 4-8x slower.
FP16_MIN_CAPABILITY = (7, 0)


@dataclass(frozen=True)
class DeviceFacts:
    """What the decisions below need to know about one device."""

    type: str  # "cpu" | "cuda"
    index: Optional[int] = None  # CUDA ordinal; None on the CPU
    capability: Optional[tuple[int, int]] = None  # CUDA compute capability, e.g. (9, 0) for H100
    name: str = "cpu"
    total_memory: Optional[int] = None  # bytes (CUDA: the card; CPU: physical RAM)
    cpu_bf16: bool = False  # CPU with native bf16 (AVX512-BF16 or AMX)

    @property
    def device(self) -> torch.device:
        return torch.device(self.type, self.index) if self.type == "cuda" else torch.device("cpu")

    def describe(self) -> str:
        if self.type == "cuda":
            major, minor = self.capability or (0, 0)
            mem = f", {self.total_memory / 2**30:.0f} GiB" if self.total_memory else ""
            return f"cuda:{self.index} ({self.name}, sm_{major}{minor}{mem})"
        return "cpu" + (" (native bf16)" if self.cpu_bf16 else "")


def cpuinfo_text() -> str:
    """/proc/cpuinfo ("" where there is none): the CPU flags the decisions here are functions of."""
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpu_has_bf16(cpuinfo: Optional[str] = None) -> bool:
    """Native bf16 on this CPU (AVX512-BF16 or AMX); elsewhere bf16 is emulated and slow."""
    cpuinfo = cpuinfo_text() if cpuinfo is None else cpuinfo
    return "avx512_bf16" in cpuinfo or "amx_bf16" in cpuinfo


def cpu_has_fp16(cpuinfo: Optional[str] = None) -> bool:
    """Native fp16 matmul on this CPU (AVX512-FP16 or AMX-FP16); elsewhere torch emulates it."""
    cpuinfo = cpuinfo_text() if cpuinfo is None else cpuinfo
    return "avx512_fp16" in cpuinfo or "amx_fp16" in cpuinfo


def cpu_emulated_dtypes(cpuinfo: Optional[str] = None) -> tuple[torch.dtype, ...]:
    """The half dtypes whose matmuls torch emulates on this CPU: there a half-precision linear runs
    several times slower than the same operands upcast to fp32 (benchmarks/history/training-speed.md)."""
    cpuinfo = cpuinfo_text() if cpuinfo is None else cpuinfo
    return tuple(d for d, native in ((torch.bfloat16, cpu_has_bf16(cpuinfo)), (torch.float16, cpu_has_fp16(cpuinfo)))
                 if not native)


def _physical_memory() -> Optional[int]:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def probe(device: torch.device) -> DeviceFacts:
    """The facts of a real device (the one place that asks torch.cuda for them)."""
    device = torch.device(device)
    if device.type != "cuda":
        return DeviceFacts("cpu", total_memory=_physical_memory(), cpu_bf16=cpu_has_bf16())
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    return DeviceFacts("cuda", index, (props.major, props.minor), props.name, props.total_memory)


def planning_facts(kind: str, memory_bytes: Optional[int] = None, cuda_available: Optional[bool] = None) -> DeviceFacts:
    """Facts to plan a run for: this machine's device of that kind, or an assumed one.

    `tunekit plan --device cuda --memory 24` on a machine without a GPU plans for an assumed
    Ampere-or-newer card (bf16 native) of that memory; with a GPU, its real facts are used and
    `memory_bytes`, when given, replaces its size.
    """
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"unknown device kind {kind!r}")
    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    if kind == "cuda" and not cuda_available:
        facts = DeviceFacts("cuda", 0, BF16_MIN_CAPABILITY, "GPU (assumed: sm_80+)", memory_bytes)
    else:
        facts = probe(torch.device(kind))
    if memory_bytes is not None:
        facts = replace(facts, total_memory=memory_bytes)
    return facts


# ------------------------------------------------------------------ which device
def rank_device(device: torch.device, local_rank: int = 0, current_index: Optional[int] = None) -> torch.device:
    """The device a process trains on, always with an explicit CUDA index.

    A single-process `Accelerator().device` is `cuda` with no index (accelerate 1.x); under
    `accelerate launch` it is `cuda:LOCAL_RANK`. Downstream code (a 4-bit load's device map,
    memory counters) needs the index, so `cuda` becomes `cuda:<current device>` (by default
    the local rank: accelerate sets the current device to it).
    """
    device = torch.device(device)
    if device.type != "cuda" or device.index is not None:
        return device
    return torch.device("cuda", local_rank if current_index is None else current_index)


def device_map(device: torch.device) -> dict:
    """`device_map` for a bitsandbytes 4-bit `from_pretrained`: everything on this one device.

    transformers wants an int (or "cpu"); `device.index` is None for a bare `cuda`, which
    from_pretrained turns into a TypeError deep inside accelerate. Index 0 is what torch means
    by a bare `cuda` when no other device was made current; `rank_device` resolves it first.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return {"": device.index if device.index is not None else 0}
    if device.type == "cpu":
        return {"": "cpu"}
    return {"": str(device)}


# ------------------------------------------------------------------ dtypes and kernels
def native_bf16(facts: DeviceFacts) -> bool:
    if facts.type == "cuda":
        return facts.capability is not None and tuple(facts.capability) >= BF16_MIN_CAPABILITY
    return facts.cpu_bf16


def fp16_tensor_cores(facts: DeviceFacts) -> bool:
    """A GPU with fp16 tensor cores but no bf16 ones: sm_70 up to sm_80 (V100, T4, RTX 20xx)."""
    cap = tuple(facts.capability or (0, 0))
    return facts.type == "cuda" and FP16_MIN_CAPABILITY <= cap < BF16_MIN_CAPABILITY


def compute_dtype(name: str, where) -> torch.dtype:
    """model.dtype -> the dtype the frozen base computes in, on `where`: a device's facts
    (tunekit.device.facts.DeviceFacts) or a torch.device, whose facts are probed.

    auto: bf16 where the device computes it natively (CUDA sm_80+, CPUs with AVX512-BF16/AMX);
    fp16 on GPUs with fp16 tensor cores only (sm_70, sm_75: training adds dynamic loss scaling);
    else fp32. An explicit bf16 or fp16 is obeyed even where it is emulated (slow but correct).
    """
    fixed = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    if name in fixed:
        return fixed[name]
    if name != "auto":
        raise ValueError(f"unknown dtype name {name!r}")
    facts = probe(torch.device(where)) if isinstance(where, (torch.device, str)) else where
    if native_bf16(facts):
        return torch.bfloat16
    return torch.float16 if fp16_tensor_cores(facts) else torch.float32


def fused_kernel_support(facts: DeviceFacts, dtype: torch.dtype, triton_installed: bool,
                         interpreting: bool = False) -> tuple[bool, str]:
    """Whether tunekit's Triton LoRA kernels can run here, and why (not).

    CUDA: needs triton; bf16 tl.dot needs sm_80+ (Triton refuses to compile it on T4/V100);
    fp16 and fp32 (ieee precision) compile from sm_70. CPU: only Triton's numpy interpreter
    (TRITON_INTERPRET=1), which is for tests: orders of magnitude too slow to train with.
    """
    if not triton_installed:
        return False, "triton is not installed (pip install triton)"
    if facts.type == "cuda":
        cap = tuple(facts.capability or (0, 0))
        if cap < (7, 0):
            return False, f"{facts.describe()} is older than sm_70, which Triton does not support"
        if dtype == torch.bfloat16 and cap < BF16_MIN_CAPABILITY:
            return False, (f"{facts.describe()} has no native bf16 (sm_80+ needed); the Triton kernels "
                           "cannot compile bf16 there (use model.dtype=auto, which computes fp16 there, "
                           "or kernels.fused_lora=off)")
        if interpreting:
            return False, "TRITON_INTERPRET=1 is set: Triton would interpret, not compile, on the GPU"
        return True, f"{facts.describe()}, {dtype_name(dtype)}"
    if facts.type == "cpu" and interpreting:
        return True, "cpu under TRITON_INTERPRET=1 (numpy interpreter: for tests, not speed)"
    return False, f"the Triton kernels run on CUDA only (this is {facts.describe()})"


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(dtype, str(dtype))


def synchronize(device: torch.device) -> None:
    """Wait for queued work on `device` (for timing); a no-op on the CPU."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------ memory
def peak_memory_mb(device: torch.device) -> float:
    """Peak memory since the process started or `reset_peak_memory`: CUDA max allocated on a GPU,
    the process's peak RSS on the CPU (VmHWM, which the reset clears; the lifetime peak where there is none)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def release_cached_memory(device: torch.device) -> None:
    """Give back what freed tensors left behind: collect unreachable objects (a model's module graph
    may hold cycles) and, on a GPU, return torch's cached blocks to the driver, so that another
    process (a child run) can use them."""
    import gc

    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak for `peak_memory_mb`: after a run's setup, so that the training peak, which
    the plan predicts, is not the transient of loading and quantizing the base (on a GPU that
    transient can exceed the step's peak: a 4-block model of Llama-3-8B's widths, 2 x 2048 tokens,
    read 5.0 GiB measured from the start against a 3.7 GiB step plan)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        Path("/proc/self/clear_refs").write_text("5")  # Linux: resets VmHWM to the current RSS
    except OSError:
        pass


def peak_memory_kind(device: torch.device) -> str:
    """What `peak_memory_mb` measures on this device, in words."""
    return "torch max allocated" if torch.device(device).type == "cuda" else "process peak RSS"


def current_memory_mb(device: torch.device) -> Optional[float]:
    """Memory held now: CUDA allocated on a GPU, the process's resident set on the CPU (None if unknown)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / 2**20
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def available_memory_bytes(device: torch.device) -> Optional[int]:
    """Memory this process could still take: CUDA free memory, or the CPU's MemAvailable. None where
    it cannot be known (`tunekit plan --device cuda` on a machine without a GPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return None
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def dense_cache_fits(dense_bytes: int, facts: DeviceFacts) -> bool:
    """Whether a CPU run may keep a dequantized copy (in the compute dtype) of its 4-bit base for speed.

    A plain function of the model's size and the machine's memory, so that `tunekit plan` and
    the trainer decide alike and a resumed run decides as the first one did: at most an eighth of
    physical memory (the 135M default model: 0.2 GB in bf16, 0.4 GB in fp32; an 8B base: 16 GB in
    bf16, which stays 4-bit on a machine of less than 128 GB). Never on a GPU, where 4-bit exists
    to save that memory and the fused kernel dequantizes in registers.
    """
    return facts.type == "cpu" and facts.total_memory is not None and dense_bytes <= facts.total_memory // 8


def offload_activations(setting, facts: DeviceFacts, checkpointing: bool, sharded: bool = False) -> bool:
    """model.offload_activations (True | False | "auto") -> whether the checkpointed blocks' saved
    inputs go to pinned host memory during the forward pass and come back for the backward pass.

    Only a GPU has something to gain (on a CPU they are in host memory already), and only with
    gradient checkpointing, where those inputs are nearly all that a step keeps on the device
    (Llama-3-8B at 2 x 2048 tokens: 1 GiB of its ~8). The cost is one copy out and one back of
    each block's input per micro-batch, ~2 x 32 MiB a block there against ~30 ms of its compute.
    `auto` offloads on CUDA with checkpointing; FSDP runs keep them (not combined here). The trainer
    and `tunekit plan` resolve `auto` first, from the memory plan (tunekit.plan.choose): offloaded only
    where the step would not fit without it; an unresolved `auto` (no plan) is the safe side, on.
    """
    if sharded or not checkpointing or facts.type != "cuda":
        return False
    return setting is True or setting == "auto"


def fsdp_projection_units(device_type: str, world_size: int) -> bool:
    """Whether FSDP2 on a rank of `device_type`, one of `world_size`, makes every frozen projection
    of a decoder layer a unit of its own (gathered alone, freed after its own forward and backward)
    and frees each all-gather's buffer as soon as its weights are copied out.

    On a CPU (gloo) the gathered weights are host memory and compute and communication share the
    same cores: overlap has nothing to gain, and what a rank holds at a time is what counts. A
    decoder-layer unit costs twice the layer for a moment (the all-gather's buffer and the weights
    copied out of it, 2 x 98 MiB on a 1.02B Llama), and FSDP2 keeps each forward all-gather's buffer
    until the next unit's copy-out (to overlap them on a GPU's streams); a projection unit costs
    twice the largest projection (2 x 22 MiB there). Measured on two gloo ranks training LoRA on that
    model: each rank's backward peaked 200 MiB above what it held before, 50 MiB with these units
    (benchmarks/training/fsdp-load-2026-11-27.md). On a GPU one all-gather per layer overlapping
    the previous layer's compute is what FSDP is for: layer units, as FSDP2 comes. On one rank
    (a test's construct: one process never shards) nothing is gathered from another rank, and
    layer units stay: the one-rank run then matches one process bit for bit
    (tests/train/test_strategy.py), which projection units missed by rounding after the second
    step (21 of the 28 LoRA tensors off by at most 7.5e-9, the losses still equal)."""
    return device_type == "cpu" and world_size > 1


# Rank 0 writes a checkpoint, reads it back to check it and keeps the best adapter while the other
# ranks wait in the next collective. A slow disk (network storage) writes and reads ~50 MB/s.
DIST_TIMEOUT_BASE_S = 1800
SLOW_DISK_BYTES_PER_S = 50e6


def dist_timeout_s(setting, checkpoint_bytes: Optional[int]) -> int:
    """trainer.dist_timeout_s -> seconds: a positive number as given; auto: DIST_TIMEOUT_BASE_S plus
    writing and reading back `checkpoint_bytes` at SLOW_DISK_BYTES_PER_S (the base alone where the
    size is unknown). Sample answers and evaluations rank 0 runs alone fit in the base."""
    if setting != "auto":
        return int(setting)
    extra = 0 if checkpoint_bytes is None else 2 * checkpoint_bytes / SLOW_DISK_BYTES_PER_S
    return int(DIST_TIMEOUT_BASE_S + extra)


class Streams:
    """A side stream and the waits between it and the compute stream (tunekit.speed.offload copies
    activations on it); every method a no-op off CUDA, so the same bookkeeping runs in CPU tests."""

    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"
        self.side = torch.cuda.Stream(device) if self.cuda else None

    def on_side(self):
        return torch.cuda.stream(self.side) if self.cuda else contextlib.nullcontext()

    def side_waits_for_compute(self) -> None:
        if self.cuda:
            self.side.wait_stream(torch.cuda.current_stream())

    def compute_waits_for(self, event) -> None:
        if self.cuda and event is not None:
            torch.cuda.current_stream().wait_event(event)

    def mark(self):
        """An event on the side stream after what it was given so far (None off CUDA)."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(self.side)
        return event

    def keep_for_side(self, t: torch.Tensor) -> None:
        """`t`'s memory is not reused until the side stream's queued work on it is done."""
        if self.cuda:
            t.record_stream(self.side)

    def keep_for_compute(self, t: torch.Tensor) -> None:
        if self.cuda:
            t.record_stream(torch.cuda.current_stream())


def fused_adamw(device: torch.device) -> Optional[bool]:
    """Whether torch's AdamW runs fused (one kernel for every tensor's update, its step counters on
    the device): on a GPU, as transformers' Trainer does there; torch's default (None) elsewhere."""
    return True if torch.device(device).type == "cuda" else None


# ------------------------------------------------------------------ random state
def rng_state(device: torch.device) -> dict:
    """This process's random state as JSON-able values (no pickling, safe to share).

    python: random's (version, 625 ints, gauss_next); numpy: the MT19937 key and position;
    torch: the CPU generator's bytes; cuda: this rank's own device generator only, since on
    several ranks each process owns one GPU and must get back its own stream.
    """
    device = torch.device(device)
    version, internal, gauss = random.getstate()
    kind, key, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss},
        "numpy": {"kind": kind, "key": key.tolist(), "pos": int(pos), "has_gauss": int(has_gauss),
                  "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state().tolist(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device).tolist()
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    """Restore what `rng_state` captured (on the same kind of device)."""
    device = torch.device(device)
    p = state["python"]
    random.setstate((p["version"], tuple(p["internal"]), p["gauss_next"]))
    n = state["numpy"]
    np.random.set_state((n["kind"], np.array(n["key"], dtype=np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8), device)


def cuda_device_count() -> int:
    """GPUs this process can see (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def default_device() -> torch.device:
    """Where a single-process command (eval, generate, chat, export, doctor) runs by default: the
    first GPU, else the CPU."""
    return command_device(None, cuda_device_count())


def command_device(requested: Optional[str], cuda_count: int, key: str = "--device") -> torch.device:
    """The device a single-process command runs on: `requested` (auto | cpu | cuda | cuda:N; None
    means auto, the first GPU else the CPU) checked against the GPUs this process sees."""
    text = "auto" if requested is None else str(requested).strip().lower()
    if text == "auto":
        return torch.device("cuda", 0) if cuda_count else torch.device("cpu")
    if text == "cpu":
        return torch.device("cpu")
    kind, _, index = text.partition(":")
    if kind != "cuda" or (index and not index.isdigit()):
        raise TunekitError(f"{key}: unknown device {requested!r}; choose auto, cpu, cuda or cuda:N")
    if cuda_count == 0:
        raise TunekitError(f"{key} {requested}: this process sees no CUDA GPU (torch.cuda.is_available() is False, "
                         "or CUDA_VISIBLE_DEVICES hides them); use --device cpu")
    n = int(index or 0)
    if n >= cuda_count:
        raise TunekitError(f"{key} {requested}: this process sees {cuda_count} GPU{'s' if cuda_count > 1 else ''} "
                         f"(cuda:0{f'..cuda:{cuda_count - 1}' if cuda_count > 1 else ''})")
    return torch.device("cuda", n)


def command_facts(requested: Optional[str] = None) -> DeviceFacts:
    """The facts of the device `--device requested` names on this machine (None: auto)."""
    return probe(command_device(requested, cuda_device_count()))
