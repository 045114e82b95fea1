"""A roofline of one profiled training step: how fast could this sequence of ops go on this machine?

`scripts/profile_train.py --roofline` hands the profiler's events (recorded with shapes) here. The
step is split into what bounds each part:

- matmuls (aten::mm / addmm / bmm): every distinct (shape, dtype, layout) is re-run alone, on fresh
  tensors of the same strides, and timed; the sum over the step's calls of those isolated times is
  the least time the step's matmuls take in this torch build (its GEMM library, this core count).
  Isolated runs are the favourable case (warm caches, no neighbours), so this is a floor.
- attention (the CPU flash kernels, forward and backward): kept at its profiled self time.
- compiled regions (`kernels.compile=true`: inductor's graphs, whose own time is their fused
  elementwise kernels; the matmuls inside them are recorded as aten ops of their own and counted
  above): kept at their profiled self time too, since the profiler records no shapes for them, so
  their traffic cannot be bounded. torch.compile's guards and wrappers (dynamo's cache lookup,
  CompiledFunction) are overhead, counted as zero like dispatch.
- everything else (elementwise, norms, casts, copies, the loss, the optimizer): bounded by memory
  traffic. Each op's bytes are counted from its recorded inputs (plus one output the size of its
  largest input, except copy_ whose destination is an input), less its child ops' (a composite
  such as aten::to moves nothing itself), and divided by this machine's
  copy bandwidth, measured here twice: on a tensor that stays in cache (the optimistic bound) and
  on one that streams from RAM (what activations saved for the backward pass do once they outgrow
  the last-level cache). Dispatch and Python overhead count as zero.

The floor's MFU is then an upper bound for the step as written (the same ops, each at its own
ceiling, nothing in between): if it is below a goal, no tuning of this op sequence reaches the goal;
only doing different work (fusing ops, other dtypes, larger matmuls) can.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict

import torch

DTYPES = {"float": torch.float32, "c10::BFloat16": torch.bfloat16, "c10::Half": torch.float16,
          "double": torch.float64, "long int": torch.int64, "int": torch.int32, "bool": torch.bool,
          "unsigned char": torch.uint8, "signed char": torch.int8}
MATMULS = ("aten::mm", "aten::addmm", "aten::bmm")
# ops that only make a view or allocate: no memory traffic, whatever their operands' sizes
NO_TRAFFIC = {f"aten::{n}" for n in (
    "view", "as_strided", "reshape", "_reshape_alias", "_unsafe_view", "view_as", "transpose", "t", "permute",
    "expand", "expand_as", "slice", "select", "squeeze", "unsqueeze", "detach", "alias", "narrow", "split",
    "split_with_sizes", "unbind", "chunk", "unfold", "diagonal", "empty", "empty_strided", "empty_like",
    "resolve_conj", "resolve_neg", "lift_fresh", "set_", "item", "_local_scalar_dense", "is_nonzero", "result_type")}
# ops that return their input unchanged when there is nothing to do (then they have no child op)
MAYBE_NOOP = {"aten::to", "aten::contiguous", "aten::type_as", "aten::clone"}
# gathers: read only the selected rows of their first operand, not all of it
GATHERS = {"aten::index_select", "aten::embedding"}
ATTENTION = "scaled_dot_product"
COMPILED_REGION = "## Call CompiledFxGraph"  # one call of an inductor graph (its name ends in a hash)


def _operands(e) -> tuple[list, list, str] | None:
    """(shape of a, shape of b) with strides, and the dtype, of a recorded matmul event."""
    shapes, strides, dtypes = e.input_shapes, getattr(e, "structured_input_strides", None), e.input_dtypes
    first = 1 if e.name == "aten::addmm" else 0  # addmm(bias, a, b)
    if len(shapes) < first + 2 or not strides:
        return None
    a, b = shapes[first], shapes[first + 1]
    sa, sb = strides[first], strides[first + 1]
    return (tuple(a), tuple(sa)), (tuple(b), tuple(sb)), dtypes[first]


def matmul_key(e) -> tuple | None:
    ops = _operands(e)
    if ops is None:
        return None
    (a, sa), (b, sb), dtype = ops
    return e.name, dtype, a, b, _col_major(a, sa), _col_major(b, sb), e.name == "aten::addmm"


def _col_major(shape: tuple, stride: tuple) -> bool:
    return len(shape) >= 2 and stride[-1] != 1 and stride[-2] == 1


def matmul_flops(key: tuple) -> float:
    _, _, a, b, *_ = key
    batch = a[0] if len(a) == 3 else 1
    return 2.0 * batch * a[-2] * a[-1] * b[-1]


def _tensor(shape: tuple, col_major: bool, dtype: torch.dtype) -> torch.Tensor:
    if col_major:
        lead, (r, c) = shape[:-2], shape[-2:]
        return torch.randn(*lead, c, r, dtype=dtype).transpose(-1, -2)
    return torch.randn(*shape, dtype=dtype)


def time_matmul(key: tuple, budget_s: float = 0.15) -> float:
    """Median seconds of one call of this matmul alone (after warm-up; as many reps as fit the budget)."""
    name, dtype_name, a_shape, b_shape, ta, tb, has_bias = key
    dtype = DTYPES[dtype_name]
    a, b = _tensor(a_shape, ta, dtype), _tensor(b_shape, tb, dtype)
    if has_bias:
        bias = torch.randn(b_shape[-1], dtype=dtype)
        call = lambda: torch.addmm(bias, a, b)  # noqa: E731
    elif name == "aten::bmm":
        call = lambda: torch.bmm(a, b)  # noqa: E731
    else:
        call = lambda: torch.mm(a, b)  # noqa: E731
    for _ in range(2):
        call()
    t = time.perf_counter()
    call()
    once = time.perf_counter() - t
    times = []
    for _ in range(max(3, min(50, int(budget_s / max(once, 1e-6))))):
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def op_bytes(e) -> int:
    """Memory traffic of one op (children included), from its recorded tensor inputs: the inputs read, plus one
    output the size of the largest input (copy_'s destination is already an input). Views and
    allocations move nothing."""
    if e.name in NO_TRAFFIC or (e.name in MAYBE_NOOP and not e.cpu_children):
        return 0
    if e.name in GATHERS:  # (table, index) for embedding, (table, dim, index) for index_select
        table, index = e.input_shapes[0], e.input_shapes[-1]
        rows = 1
        for s in index:
            rows *= s
        width = 1
        for s in table[1:]:
            width *= s
        return 2 * rows * width * torch.empty((), dtype=DTYPES.get(e.input_dtypes[0], torch.float32)).element_size()
    sizes = []
    for shape, dtype in zip(e.input_shapes, e.input_dtypes):
        if dtype not in DTYPES or not isinstance(shape, list) or not shape:
            continue  # scalars, lists, None
        n = 1
        for s in shape:
            n *= s
        sizes.append(n * torch.empty((), dtype=DTYPES[dtype]).element_size())
    if not sizes:
        return 0
    return sum(sizes) + (0 if e.name == "aten::copy_" else max(sizes))


def own_bytes(e) -> int:
    """The traffic an op makes itself: none when an op below it moves data (aten::to moves nothing,
    its copy_ does; this can only undercount, which lowers the floor), else its op_bytes (aten::mul
    by a Python scalar does its own work below a child that merely wraps the scalar)."""
    return 0 if any(_moves(c) for c in e.cpu_children) else op_bytes(e)


def _moves(e) -> bool:
    return op_bytes(e) > 0 or any(_moves(c) for c in e.cpu_children)


def copy_bandwidth() -> dict:
    """Best GB/s (read + write) of `dst.copy_(src)` on fp32 tensors of an activation's size (fits in
    cache) and of 256 MiB (RAM)."""
    out = {}
    for label, n in (("4 MiB (in cache)", 1 << 20), ("256 MiB (from RAM)", 1 << 26)):
        src, dst = torch.randn(n), torch.empty(n)
        dst.copy_(src)
        best = float("inf")
        for _ in range(10):
            t = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - t)
        out[label] = 2 * n * 4 / best / 1e9
    return out


def tiny_op_seconds(calls: int = 20000) -> float:
    """Seconds of one eager op on an 8-element tensor, called from Python: dispatch, not work."""
    a, b, c = torch.ones(8), torch.ones(8), torch.empty(8)
    for _ in range(1000):
        torch.mul(a, b, out=c)
    t = time.perf_counter()
    for _ in range(calls):
        torch.mul(a, b, out=c)
    return (time.perf_counter() - t) / calls


def analyze(events, family, step_wall_s: float, useful_flops: float, peak_gflops: float,
            model_dims: set[int], peak_dtype: str = "bf16") -> tuple[dict, list[str]]:
    """events: the profiler's FunctionEvents (record_shapes=True) over the profiled steps;
    family(name) -> the profile's op family; step_wall_s: the same steps' wall time unprofiled;
    useful_flops: their useful FLOPs (bench_train.useful_flops); peak_gflops: the matmul peak of
    peak_dtype, the dtype the base computes in (bf16 on a CPU with native bf16, else fp32);
    model_dims: the model's widths (hidden, MLP, k/v, rank, vocab, heads): in the shape table every
    other dimension is a token count, shown as M."""
    mm_calls, mm_prof = defaultdict(int), defaultdict(float)
    attn_s, compiled_s, rest_bytes, rest_prof = 0.0, 0.0, defaultdict(float), defaultdict(float)
    by_op = defaultdict(lambda: [0, 0, 0.0])  # name -> calls, bytes, profiled s
    kernels = 0  # ops that move data themselves: each is one dispatch in eager mode
    for e in events:
        if e.name in MATMULS:
            key = matmul_key(e)
            if key is not None:
                mm_calls[key] += 1
                mm_prof[key] += e.self_cpu_time_total / 1e6
        elif ATTENTION in e.name:
            attn_s += e.self_cpu_time_total / 1e6
        elif e.name.startswith(COMPILED_REGION):
            compiled_s += e.self_cpu_time_total / 1e6
        elif e.name.startswith(("aten::", "bitsandbytes::")):
            fam = family(e.name)
            rest_prof[fam] += e.self_cpu_time_total / 1e6
            own = own_bytes(e)
            rest_bytes[fam] += own
            kernels += own > 0
            by_op[e.name][0] += 1
            by_op[e.name][1] += own
            by_op[e.name][2] += e.self_cpu_time_total / 1e6
    bw = copy_bandwidth()
    rows = []
    for key, calls in mm_calls.items():
        t = time_matmul(key)
        rows.append({"key": key, "calls": calls, "flops": matmul_flops(key) * calls, "iso_s": t * calls,
                     "prof_s": mm_prof[key]})
    mm_iso = sum(r["iso_s"] for r in rows)
    mm_flops = sum(r["flops"] for r in rows)
    rest = sum(rest_bytes.values())
    peak = peak_gflops * 1e9
    summary = {"step_wall_s": step_wall_s, "useful_gflop": useful_flops / 1e9, "mfu": useful_flops / step_wall_s / peak,
               "matmul_gflop": mm_flops / 1e9, "matmul_isolated_s": mm_iso,
               "matmul_isolated_gflops": mm_flops / mm_iso / 1e9, "attention_profiled_s": attn_s,
               "compiled_profiled_s": compiled_s,
               "rest_gb": rest / 1e9, "copy_gbps": bw, "mfu_matmuls_only": useful_flops / mm_iso / peak,
               "peak_gflops": peak_gflops, "peak_dtype": peak_dtype, "kernels": kernels,
               "dispatch_s": kernels * tiny_op_seconds(),
               "floors": {}}
    for where, gbps in bw.items():  # the rest's traffic all in cache, or all from RAM
        floor = mm_iso + attn_s + compiled_s + rest / (gbps * 1e9)
        summary["floors"][where] = {"rest_s": rest / (gbps * 1e9), "floor_s": floor,
                                    "mfu_ceiling": useful_flops / floor / peak}
    return summary, _lines(summary, rows, rest_bytes, rest_prof, model_dims) + _op_lines(by_op)


def _shape(key: tuple, model_dims: set[int]) -> str:
    name, dtype, a, b, ta, tb, _ = key
    a, b = ([d if d in model_dims else "M" for d in t] for t in (a, b))
    dims = f"{'x'.join(map(str, a))}{'ᵀ' if ta else ''} @ {'x'.join(map(str, b))}{'ᵀ' if tb else ''}"
    return f"`{name.removeprefix('aten::')}` {'bf16' if 'BFloat16' in dtype else dtype} {dims}"


def _lines(s: dict, rows: list[dict], rest_bytes: dict, rest_prof: dict, model_dims: set[int]) -> list[str]:
    pk = s["peak_gflops"]
    lines = ["## Roofline (`scripts/roofline.py`): the least time these ops take here", "",
             f"- {s['peak_dtype']} matmul peak measured in this run (the dtype the base computes in): "
             f"{pk:.0f} GFLOP/s; copy bandwidth: "
             + ", ".join(f"{k} {v:.1f} GB/s" for k, v in s["copy_gbps"].items()),
             f"- the profiled steps, re-run unprofiled: {s['step_wall_s']:.2f} s for {s['useful_gflop']:.0f} "
             f"useful GFLOP: **MFU {100 * s['mfu']:.1f}%**",
             f"- their matmuls, each shape re-run alone: {s['matmul_gflop']:.0f} GFLOP in "
             f"{s['matmul_isolated_s']:.2f} s ({s['matmul_isolated_gflops']:.0f} GFLOP/s, "
             f"{100 * s['matmul_isolated_gflops'] / pk:.0f}% of peak): with nothing else in the step, "
             f"MFU {100 * s['mfu_matmuls_only']:.1f}%",
             f"- attention kernels (profiled): {s['attention_profiled_s']:.2f} s; "
             + (f"compiled regions (inductor's fused kernels, profiled): {s['compiled_profiled_s']:.2f} s; "
                if s["compiled_profiled_s"] else "")
             + f"everything else (elementwise, norms, casts, the loss, the optimizer) moves {s['rest_gb']:.1f} GB",
             f"- eager dispatch: {s['kernels']} working ops at the cost of a tiny op called from Python here "
             f"({1e6 * s['dispatch_s'] / max(s['kernels'], 1):.1f} us each): {s['dispatch_s']:.2f} s, "
             "not counted below",
             "", "| the rest's traffic moved at | its time | floor: matmuls alone + attention "
             + ("+ compiled regions " if s["compiled_profiled_s"] else "") + "+ the rest | "
             "MFU ceiling of this op sequence |", "|---|---:|---:|---:|"]
    for where, f in s["floors"].items():
        lines.append(f"| {where} copy bandwidth ({s['copy_gbps'][where]:.1f} GB/s) | {f['rest_s']:.2f} s | "
                     f"{f['floor_s']:.2f} s | **{100 * f['mfu_ceiling']:.1f}%** |")
    lines += ["",
              "Matmul shapes by isolated time (M: a token count, which varies by micro-batch; ᵀ: a column-major "
              "operand):", "",
              "| matmul | calls | GFLOP | isolated s | isolated GFLOP/s | % of peak | profiled s |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    merged = defaultdict(lambda: {"calls": 0, "flops": 0.0, "iso_s": 0.0, "prof_s": 0.0})
    for r in rows:  # one row per shape up to the token count, which varies by micro-batch
        label = _shape(r["key"], model_dims)
        for k in ("calls", "flops", "iso_s", "prof_s"):
            merged[label][k] += r[k]
    for label, r in sorted(merged.items(), key=lambda kv: -kv[1]["iso_s"])[:20]:
        rate = r["flops"] / r["iso_s"] / 1e9
        lines.append(f"| {label} | {r['calls']} | {r['flops'] / 1e9:.1f} | {r['iso_s']:.3f} | {rate:.0f} | "
                     f"{100 * rate / pk:.0f}% | {r['prof_s']:.3f} |")
    lines += ["", "Non-matmul, non-attention ops by family (bytes from recorded shapes):", "",
              "| family | GB moved | profiled s | achieved GB/s |", "|---|---:|---:|---:|"]
    for fam, b in sorted(rest_bytes.items(), key=lambda kv: -rest_prof[kv[0]]):
        t = rest_prof[fam]
        lines.append(f"| {fam} | {b / 1e9:.2f} | {t:.2f} | {b / t / 1e9 if t else 0:.1f} |")
    return lines


def _op_lines(by_op: dict) -> list[str]:
    lines = ["", "The same ops by name, the 15 that move the most bytes:", "",
             "| op | calls | GB moved | profiled s | achieved GB/s |", "|---|---:|---:|---:|---:|"]
    for name, (calls, b, t) in sorted(by_op.items(), key=lambda kv: -kv[1][1])[:15]:
        lines.append(f"| `{name}` | {calls} | {b / 1e9:.2f} | {t:.2f} | {b / t / 1e9 if t else 0:.1f} |")
    return lines
