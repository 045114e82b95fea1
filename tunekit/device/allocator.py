"""Host memory that freed tensors keep: glibc's malloc, set on FSDP ranks that train on the CPU.

torch allocates a CPU tensor with malloc. glibc serves a block of at least M_MMAP_THRESHOLD bytes
with its own mmap, which free() unmaps at once; smaller blocks come from the heap, whose free space
goes back to the system only from its top. The threshold starts at 128 KiB, but glibc raises it to
the size of every mmap-served block that is freed, up to 32 MiB. An FSDP rank frees such blocks all
the time: each forward and backward gathers a decoder layer's weights (a 1B Llama's 2048 x 5632
projection is 22 MiB in bf16), uses them and frees them. After the first of these frees, every
later gathered weight of that size comes from the heap; a small tensor allocated meanwhile (an
activation, a gradient shard) pins the heap's top, and the freed weights stay resident. Measured
on two gloo ranks training LoRA on a 1.02B model (benchmarks/training/fsdp-load-2026-11-27.md):
rank 1 grew from 1.6 GB after sharding to 3.6 GB within two steps, while a malloc_trim(0) after
each forward brought it back to 1.5-1.6 GB every time; the weights it held were freed ones.

`return_large_frees` keeps the threshold at glibc's own starting value, 128 KiB, and stops glibc
from raising it: every block of 128 KiB or more is its own mapping and leaves the process when
freed. Measured on the same run: both ranks then stay within 0.1 GB of their RSS after sharding
between steps, and each rank's peak fell to 2.2 GB; a 1 MiB threshold left 0.2 GB more per rank
(blocks between 128 KiB and 1 MiB, e.g. 64-token activations of 256 KiB, fragmenting the heap).
The cost is one mmap and munmap per such block, and fresh pages to fault in each time a layer is
gathered again: a training step of that run took 8.2-8.5 s against 5.9-6.4 s as glibc comes
(alternating runs, each rank on one core of the shared 2-core machine). So FSDP sets it on CPU ranks
only, where the gathered weights live in host memory.
glibc only: elsewhere (musl, macOS) nothing is set and it returns False.
"""

from __future__ import annotations

import ctypes

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)
MMAP_THRESHOLD = 128 << 10  # glibc's default M_MMAP_THRESHOLD, before it adapts


def needs_returned_frees(device_type: str, world_size: int) -> bool:
    """Whether a sharded rank on `device_type` should hand freed blocks back (return_large_frees):
    on a CPU, where every step gathers and frees each layer's weights in host memory, and only in a
    process that is one rank of several (the setting lasts as long as the process). On a GPU the
    gathers never touch host memory."""
    return device_type == "cpu" and world_size > 1


def return_large_frees(threshold: int = MMAP_THRESHOLD) -> bool:
    """mallopt(M_MMAP_THRESHOLD, threshold) for this process; True where glibc took it."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # glibc's own symbol: musl has a mallopt that does nothing
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, threshold) == 1
