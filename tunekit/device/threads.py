"""How torch's CPU threads wait: set by the `tunekit` command before torch loads.

torch's CPU wheels run their intra-op parallelism (one thread per core) on GNU OpenMP (libgomp,
`torch/lib/libgomp.so.1`). When a parallel region ends, libgomp's worker threads spin on the CPU
for GOMP_SPINCOUNT rounds of a `pause` instruction before they sleep: 300,000 rounds by default,
roughly 7-15 ms at ~70-140 cycles a pause. That is free on an idle machine and ruinous on a busy
one: libgomp only shortens the spin when its own process has more threads than cores, so a second
busy process (another run, `tunekit eval` beside training, a compiler, a browser) is invisible to
it, and a thread that has work waits for a core that the other process's spinning threads hold.

10,000 rounds (~0.2-0.5 ms) still cover the gap between one op and the next, so a run alone keeps
its speed, while beside another busy process the working threads get their cores back. Spinning much
less costs speed alone: a thread that sleeps at once (OMP_WAIT_POLICY=PASSIVE, or ~1,000 rounds) pays
a wake-up at each of a step's thousands of parallel regions. The wait changes no arithmetic: the
losses are the same bit for bit. `scripts/bench_threads.py` measures it (alone, beside a second run,
beside a CPU burner; benchmarks/training/threads-cpu-icelake.md).

So the CLI sets GOMP_SPINCOUNT=10000 unless the user chose a wait behaviour themselves
(OMP_WAIT_POLICY or GOMP_SPINCOUNT in the environment: theirs is kept, GOMP_SPINCOUNT=300000
restores libgomp's default). libgomp reads its environment once, when torch is imported, so this
must run before that import; in a process that has already imported torch it changes nothing.
Processes tunekit starts (distributed ranks, inductor's compile workers) inherit it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

SPINCOUNT = "10000"
USER_CHOICES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")  # either one means the user decided


def openmp_env(environ: Mapping[str, str], torch_loaded: bool) -> dict[str, str]:
    """The variables to add to the environment before torch loads (empty: leave it as it is)."""
    if torch_loaded or any(name in environ for name in USER_CHOICES):
        return {}
    return {"GOMP_SPINCOUNT": SPINCOUNT}


def cores() -> int:
    """The cores this process may run on (its affinity mask, as a container or taskset limits it)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def summary(environ: Mapping[str, str], intra_op: int, n_cores: int) -> dict:
    """What summary.json records of the CPU threads of a run."""
    return {"intra_op": intra_op, "cores": n_cores,
            **{name.lower(): environ[name] for name in USER_CHOICES if name in environ}}


def on_device(device_type: str, environ: Mapping[str, str], intra_op: int, n_cores: int) -> dict | None:
    """What a run on `device_type` ("cpu", "cuda", ...) reports of its CPU threads: {"line": the
    start-of-run log line, "summary": summary.json's entry} where the model computes on the CPU,
    None elsewhere (on a GPU the intra-op threads only feed it, and their count says nothing about
    the run's speed)."""
    if device_type != "cpu":
        return None
    return {"line": describe(environ, intra_op, n_cores), "summary": summary(environ, intra_op, n_cores)}


def describe(environ: Mapping[str, str], intra_op: int, n_cores: int) -> str:
    """The start-of-run log line on a CPU."""
    wait = environ.get("GOMP_SPINCOUNT")
    if "OMP_WAIT_POLICY" in environ:
        how = f"OMP_WAIT_POLICY={environ['OMP_WAIT_POLICY']}" + (f", GOMP_SPINCOUNT={wait}" if wait else "")
    elif wait is not None:
        how = f"idle threads spin {wait} rounds before sleeping (GOMP_SPINCOUNT)"
    else:
        how = "idle threads spin libgomp's default 300000 rounds"
    return f"threads: {intra_op} intra-op on {n_cores} cores; {how}"
