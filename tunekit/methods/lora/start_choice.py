"""method.init=auto, the qlora recipe's default: a LoftQ start where its cost is small against the run.

LoftQ (method.init=loftq) fits B A to what 4-bit rounding lost from each target weight, one thin SVD
per target and alternation, before the first step. Measured on the embedded default model, 3 seeds
each (benchmarks/task/): +5.7 points on tweet sentiment (69.3% against 63.6%), level on the
generative city-country task (36.9 against 35.8 exact match, within the seeds' spread), for about
8% of the run's time on a 2-core CPU. Its SVDs grow with the cube of a
layer's width where training grows with the square, so on a large model with few steps it can cost
more than the training it improves. `auto` therefore estimates both before anything loads:

  LoftQ:    per target (out, in) and alternation, a thin SVD of ~10 out in min(out, in) operations
            (LAPACK's bidiagonalisation and its back-transformations, counted in one unit), over
            SVD_UNITS_PER_S of the device
  training: the planner's FLOPs of one optimizer step x the run's steps, over TRAIN_FLOPS_PER_S

and takes LoftQ when it costs at most MAX_SHARE of the training, the plain start otherwise, saying
which and why in one line. Both rates are per device type:

  cpu   measured on a 2-core AMD EPYC (AVX512-BF16): the default model's LoftQ start (iters=1,
        r=16, 210 targets) took 14.5-16.7 s, 80 steps of 8 x 160 tokens 192-205 s
        (benchmarks/task/loftq-2026-11-26.md); other CPU kinds differ by up to ~2x
  cuda  conservative for the largest GPUs: on an H200 at Llama-3-8B's widths (the GPU check,
        benchmarks/gpu/) both the SVDs and QLoRA training ran about 2.9x faster than these rates,
        so the share that decides was as estimated and only the seconds shown are long there. A
        slower GPU loses on both together (fp32 SVD and bf16 matmul throughput), so the share holds
        better than either rate; the run logs the LoftQ start's real time

A resumed run keeps the start its first run chose (its config.yaml). Where LoftQ cannot apply or
would cost more than its SVDs (a bf16 base; DoRA; a preference loss whose reference is the base with
the adapter switched off; FSDP over several ranks, whose base streams from rank 0 only for a plain
start) `auto` is the plain start.
"""

from __future__ import annotations

from typing import Optional

from tunekit.plan.shape import ModelShape

SVD_UNITS_PER_S = {"cpu": 3.7e10, "cuda": 5.0e11}
TRAIN_FLOPS_PER_S = {"cpu": 3.0e11, "cuda": 1.0e14}
MAX_SHARE = 0.10


def svd_units(shape: ModelShape, targets: tuple, iters: int) -> int:
    """LoftQ's work over every target projection of every block: one thin SVD per alternation."""
    per_block = sum(10 * i * o * min(i, o) for p in targets for i, o in [shape.projection(p)])
    return iters * shape.num_layers * per_block


def loftq_seconds(shape: ModelShape, targets: tuple, iters: int, device_type: str) -> float:
    return svd_units(shape, targets, iters) / SVD_UNITS_PER_S.get(device_type, SVD_UNITS_PER_S["cpu"])


def training_seconds(flops_per_step: float, steps: int, device_type: str) -> float:
    return flops_per_step * steps / TRAIN_FLOPS_PER_S.get(device_type, TRAIN_FLOPS_PER_S["cpu"])


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def choose_init(shape: Optional[ModelShape], targets: tuple, iters: int, device_type: str,
                flops_per_step: Optional[float], steps: int, quantize: str,
                reference_is_base: bool) -> tuple[str, str]:
    """('loftq' or 'default', the reason in words) for method.init=auto."""
    if quantize != "nf4":
        return "default", "LoftQ fits what 4-bit rounding loses, and this base is not 4-bit"
    if reference_is_base:
        return "default", ("the preference loss's reference is the base with the adapter off, which a LoftQ start "
                           "would move")
    if shape is None or flops_per_step is None:
        return "default", "the planner cannot estimate this run, so LoftQ's cost against it is unknown"
    loftq = loftq_seconds(shape, targets, iters, device_type)
    train = training_seconds(flops_per_step, steps, device_type)
    share = loftq / max(train, 1e-9)
    estimate = (f"LoftQ's SVDs ~{_duration(loftq)} on {device_type}, {share:.0%} of the {steps} steps' "
                f"~{_duration(train)} at full-length rows (estimates: tunekit.methods.lora.start_choice)")
    if share <= MAX_SHARE:
        return "loftq", estimate
    return "default", f"{estimate}: over {MAX_SHARE:.0%}; method.init=loftq forces it"
