"""Which autotune configs of the kernels fit a GPU's shared memory, and how to check it without one.

A Triton config that needs more shared memory per block than the device allows compiles, but
Triton refuses to load it there (OutOfResources). The autotuner scores such a config as
infinitely slow; when *every* config fails, it still launches the first one and the user sees
the OutOfResources. So the
configs are pruned per device before the autotuner sees them (``prune_for_device``, its
``early_config_prune`` hook), from an estimate that depends only on (capability, dtype, config):
the same answer on the GPU and in a test that feeds it a made-up capability.

Why shared memory grows with stages: Triton's software pipeliner copies each load of the K loop
that feeds a ``tl.dot`` (and is at least 32 bits wide) into shared memory ``num_stages - 1``
iterations ahead, one buffer per stage. A per-element gather in the loop (a code book lookup, a
per-element scale) therefore costs ``tile elements x 4 bytes x stages``; the fused NF4 matmul keeps
such gathers out of its loop (see ``_nf4_weight_tile`` in lora.py).

``shared_memory(...)`` compiles one launch for an NVIDIA target on any machine (Triton's wheel
ships ptxas) and returns the bytes one block needs, as ``metadata.shared`` reports at launch;
tests/kernels/test_tiles.py checks every offered config with it (``check_targets``), and
``scripts/kernel_tiles.py`` prints the table of every config. It needs the kernels compiled, not
interpreted: import them with TRITON_INTERPRET unset.

Imports only torch and triton.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch
import triton

# Shared memory one block may use (the opt-in maximum, bytes), per compute capability: CUDA C
# Programming Guide, "Technical Specifications per Compute Capability".
SMEM_LIMIT: dict[tuple[int, int], int] = {
    (7, 5): 65_536,  # Turing: T4, RTX 20xx
    (8, 0): 166_912,  # A100, A800
    (8, 6): 101_376,  # A10, A40, RTX 30xx, RTX A6000
    (8, 9): 101_376,  # L4, L40S, RTX 40xx
    (9, 0): 232_448,  # H100, H200
}
# The targets the kernels are checked for (tests/kernels/test_tiles.py), oldest first.
TARGETS: tuple[tuple[int, int], ...] = tuple(SMEM_LIMIT)
BF16_MIN_CAPABILITY = (8, 0)  # bf16 tl.dot needs Ampere; Volta and Turing train in fp16


def smem_limit(capability: Sequence[int]) -> int | None:
    """The per-block shared memory limit of ``capability`` from the table, None if not in it."""
    return SMEM_LIMIT.get((int(capability[0]), int(capability[1])))


def dtypes_for(capability: Sequence[int]) -> tuple[torch.dtype, ...]:
    """The compute dtypes the kernels are offered in on ``capability``: fp32 everywhere, fp16 from
    sm_70 (tunekit computes in fp16 on Volta and Turing, which have no bf16), bf16 from sm_80."""
    if tuple(capability) >= BF16_MIN_CAPABILITY:
        return (torch.float32, torch.bfloat16, torch.float16)
    if tuple(capability) >= (7, 0):
        return (torch.float32, torch.float16)
    return (torch.float32,)


# ------------------------------------------------------------------ the fused matmul's configs
# Tiles of the fused NF4 LoRA matmul (kernels/lora.py), (BLOCK_M, BLOCK_P, BLOCK_Q, warps, stages),
# per compute dtype, before pruning per device. Untuned guesses: no GPU has timed them yet. fp32
# (tl.dot in IEEE fp32 runs on the FMA units, not tensor cores; Turing trains in it) gets smaller
# tiles. (128, 256, 64) with 4 stages is for sm_80 / sm_90 only: pruned on sm_86 / sm_89. Few
# tiles: tests/kernels/test_tiles.py compiles each one offered, per target and dtype.
MATMUL_TILES: dict[str, tuple[tuple[int, int, int, int, int], ...]] = {
    "half": ((128, 256, 64, 8, 4), (128, 128, 64, 8, 3), (64, 64, 32, 4, 5)),
    "fp32": ((128, 128, 32, 8, 3), (64, 64, 32, 4, 4)),
}
GROUP_M = 8
MIN_BLOCKSIZE = 32  # the smallest NF4 blocksize bitsandbytes makes: the most scale blocks per tile


def _tiles(dtype: torch.dtype | None) -> tuple[tuple[int, int, int, int, int], ...]:
    if dtype is None:
        return MATMUL_TILES["half"] + MATMUL_TILES["fp32"]
    return MATMUL_TILES["fp32" if dtype == torch.float32 else "half"]


def matmul_configs(dtype: torch.dtype | None = None) -> list[triton.Config]:
    """The matmul's autotune configs for ``dtype`` (every dtype's when None), unpruned."""
    return [triton.Config({"BLOCK_M": m, "BLOCK_P": p, "BLOCK_Q": q, "GROUP_M": GROUP_M}, num_warps=w, num_stages=s)
            for m, p, q, w, s in _tiles(dtype)]


def config_key(config: triton.Config) -> tuple:
    kw = config.kwargs
    return (kw["BLOCK_M"], kw["BLOCK_P"], kw["BLOCK_Q"], kw["GROUP_M"], config.num_warps, config.num_stages)


def config_name(config: triton.Config) -> str:
    kw = config.kwargs
    return f"{kw['BLOCK_M']}x{kw['BLOCK_P']}x{kw['BLOCK_Q']} w{config.num_warps} s{config.num_stages}"


def matmul_shared_estimate(config: triton.Config, dtype: torch.dtype, capability: Sequence[int]) -> int:
    """Upper bound of the shared memory (bytes) one block of the fused matmul needs in ``config``.

    What the compiler puts there (measured with ``shared_memory`` for Triton 3.9, then rounded up):
    sm_80 and later stage, per pipeline stage, the activation tile (BLOCK_M x BLOCK_Q) and the scale
    vectors (two fp32 loads per W row and scale block the tile meets: up to ceil(tile / blocksize)
    + 1 blocks per row); once, the dequantized weight tile (BLOCK_Q x BLOCK_P) on its way into the
    dot. Counted here: ``num_stages`` stages (the compiler uses one fewer before sm_90) at the
    smallest blocksize, rows not starting on a block. Volta and Turing (no asynchronous copies) only
    stage the two dot operands, once; in fp16 the store then converts the (BLOCK_M x BLOCK_P) output
    tile's layout through shared memory (2 bytes an element, reusing that space). Hopper's warpgroup MMA writes a half-precision accumulator back
    through shared memory for the store (BLOCK_M x BLOCK_P x 4 bytes, reusing the loop's space).
    tests/kernels/test_tiles.py compiles every offered config and checks this bound.
    """
    kw = config.kwargs
    bm, bp, bq = kw["BLOCK_M"], kw["BLOCK_P"], kw["BLOCK_Q"]
    size = 4 if dtype == torch.float32 else 2  # activation and (rounded) weight tile
    act, weight = bm * bq * size, bq * bp * size
    pieces = lambda tile: -(-tile // MIN_BLOCKSIZE) + 1  # noqa: E731 - scale blocks a row meets
    scales = 2 * 4 * max(pieces(bq) * bp, pieces(bp) * bq)  # forward (rows along p) or dx (along q)
    cap = (int(capability[0]), int(capability[1]))
    if cap < (8, 0):
        return max(act + weight + scales, bm * bp * 2 if dtype == torch.float16 else 0)
    loop = max(1, config.num_stages) * (act + scales) + weight
    if cap >= (9, 0) and dtype != torch.float32:
        return max(loop, bm * bp * 4)
    return loop


def configs_for(capability: Sequence[int], dtype: torch.dtype, limit: int | None = None) -> list[triton.Config]:
    """The configs the autotuner is offered on ``capability`` in ``dtype``: the dtype's tiles whose
    estimate fits ``limit`` (default: the table's limit for ``capability``). A plain function of
    its arguments, so tests feed it any capability.

    Raises RuntimeError when none fits, rather than let the autotuner launch one that cannot.
    """
    limit = limit if limit is not None else smem_limit(capability)
    if limit is None:
        raise ValueError(f"no shared-memory limit known for sm_{capability[0]}{capability[1]}; pass limit=")
    configs = matmul_configs(dtype)
    kept = [c for c in configs if matmul_shared_estimate(c, dtype, capability) <= limit]
    if not kept:
        need = min(matmul_shared_estimate(c, dtype, capability) for c in configs)
        raise RuntimeError(f"no config of the fused NF4 matmul fits sm_{capability[0]}{capability[1]}'s shared "
                           f"memory in {dtype}: the smallest needs up to {need} bytes, the limit is {limit}")
    return kept


def device_smem_limit(device: torch.device) -> tuple[tuple[int, int], int]:
    """(capability, per-block shared memory limit) of a CUDA device: the table's figure, or the
    device's own opt-in maximum for a capability the table does not list."""
    cap = tuple(torch.cuda.get_device_capability(device))
    limit = smem_limit(cap)
    if limit is None:
        props = torch.cuda.get_device_properties(device)
        limit = int(getattr(props, "shared_memory_per_block_optin", 0) or 49_152)
    return cap, limit


def prune_for_device(configs: list[triton.Config], named_args: dict, **kwargs: Any) -> list[triton.Config]:
    """The matmul autotuner's ``early_config_prune``: of its configs, those ``configs_for`` offers on
    the input tensor's device in its dtype."""
    inp = named_args["inp_ptr"]
    if inp.device.type != "cuda":  # the interpreter (CPU tensors): its one config, nothing to fit
        return configs
    cap, limit = device_smem_limit(inp.device)
    offered = {config_key(c) for c in configs_for(cap, inp.dtype, limit)}
    return [c for c in configs if config_key(c) in offered]


# ------------------------------------------------------------------ cross-compiling for a target
_TRITON_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64",
                 torch.uint8: "u8", torch.int8: "i8", torch.int16: "i16", torch.int32: "i32",
                 torch.int64: "i64", torch.bool: "u1"}


def specialize(fn: Any, args: Sequence, constexprs: dict) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) for ``triton.compiler.ASTSource``, as the JIT builds them for
    a launch with these arguments: ints equal to 1 become constants, pointers (assumed aligned,
    as torch allocations are) and ints divisible by 16 get ``tt.divisibility`` 16, other ints are
    i32 (i64 beyond its range), floats fp32. ``fn`` is the @triton.jit function. Equal to what the
    JIT builds (same compiler cache key): ``jit_specialization`` computes that to compare."""
    names = list(fn.arg_names)
    params = {p.name: p for p in fn.params}
    runtime = [n for n in names if not params[n].is_constexpr]
    if len(args) != len(runtime):
        raise TypeError(f"{fn.__name__}: {len(args)} arguments for {len(runtime)} runtime parameters")
    values = {**dict(zip(runtime, args)), **constexprs}
    missing = [n for n in names if n not in values]
    if missing:
        raise TypeError(f"{fn.__name__}: no value for {missing}")
    signature, consts, attrs = {}, {}, {}
    for i, name in enumerate(names):
        v = values[name]
        divisible = []
        if params[name].is_constexpr:
            signature[name], consts[name] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            signature[name] = "*" + _TRITON_TYPES[v.dtype]
            divisible = [["tt.divisibility", 16]]
        elif isinstance(v, bool):
            signature[name] = "i1"
        elif isinstance(v, int):
            if v == 1:
                signature[name], consts[name] = "constexpr", 1
            else:
                signature[name] = "i32" if -(2**31) <= v < 2**31 else ("i64" if -(2**63) <= v < 2**63 else "u64")
                divisible = [["tt.divisibility", 16]] if v % 16 == 0 else []
        elif isinstance(v, float):
            signature[name] = "fp32"
            continue  # the JIT gives floats no attribute entry
        else:
            raise TypeError(f"{fn.__name__}: cannot specialize {name}={v!r}")
        attrs[(i,)] = divisible
    return signature, consts, attrs


def jit_specialization(kernel: Any, args: Sequence, constexprs: dict, capability: Sequence[int] = (8, 6),
                       **options: Any) -> tuple[dict, dict, dict] | None:
    """(signature, constexprs by name, attrs) as Triton's own JIT binder specializes this launch, or
    None where this Triton's internals differ from 3.9's (the binder is not public API)."""
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend
        from triton.runtime.jit import create_function_from_signature

        fn = jit_function(kernel)
        backend = make_backend(GPUTarget("cuda", int(capability[0]) * 10 + int(capability[1]), 32))
        binder = create_function_from_signature(fn.signature, fn.params, backend)
        kw = {**constexprs, **options}
        bound, spec, opts = binder(*args, **kw)
        _, signature, consts, attrs = fn._pack_args(backend, kw, bound, spec, opts)
    except (AttributeError, ImportError, TypeError, ValueError):
        return None
    names = list(fn.arg_names)
    return signature, {names[k[0]]: v for k, v in consts.items()}, attrs


def jit_function(kernel: Any) -> Any:
    """The @triton.jit function under an autotuner (or the function itself)."""
    from triton.runtime.jit import JITFunction

    fn = kernel
    while not isinstance(fn, JITFunction):
        if not hasattr(fn, "fn"):
            raise TypeError(f"{kernel!r} is not a compiled Triton kernel: TRITON_INTERPRET=1 was set when it "
                            "was defined (cross-compiling needs it unset before the kernels are imported)")
        fn = fn.fn
    return fn


def cross_compile(kernel: Any, args: Sequence, constexprs: dict, capability: Sequence[int],
                  num_warps: int = 4, num_stages: int = 3, **options: Any):
    """Compile one launch of ``kernel`` for NVIDIA ``capability`` (no GPU needed); the compiled kernel."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = jit_function(kernel)
    signature, consts, attrs = specialize(fn, args, constexprs)
    target = GPUTarget("cuda", int(capability[0]) * 10 + int(capability[1]), 32)
    src = ASTSource(fn=fn, signature=signature, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=target, options={"num_warps": num_warps, "num_stages": num_stages, **options})


def shared_memory(kernel: Any, args: Sequence, constexprs: dict, capability: Sequence[int],
                  config: triton.Config | None = None, **options: Any) -> int:
    """Bytes of shared memory one block of this launch needs on ``capability`` (``metadata.shared``).

    ``config``'s meta-parameters, warps and stages are added to ``constexprs`` and ``options``.
    """
    if config is not None:
        constexprs = {**constexprs, **config.kwargs}
        options = {"num_warps": config.num_warps, "num_stages": config.num_stages, **options}
    return int(cross_compile(kernel, args, constexprs, capability, **options).metadata.shared)


# ------------------------------------------------------------------ the launches of this package
def meta_quant(n_out: int, n_in: int, blocksize: int = 64, nested: bool = True):
    """An NF4Weight of meta tensors (shapes and dtypes only) for building launches to compile."""
    from .quant import NF4Weight

    n = n_out * n_in
    blocks = -(-n // blocksize)
    meta = dict(device="meta")
    return NF4Weight(
        packed=torch.empty((n + 1) // 2, dtype=torch.uint8, **meta),
        absmax=torch.empty(blocks, dtype=torch.uint8 if nested else torch.float32, **meta),
        code=torch.empty(16, dtype=torch.float32, **meta), shape=(n_out, n_in), blocksize=blocksize,
        absmax2=torch.empty(-(-blocks // 256), dtype=torch.float32, **meta) if nested else None,
        code2=torch.empty(256, dtype=torch.float32, **meta) if nested else None,
        offset=torch.empty(1, dtype=torch.float32, **meta) if nested else None,
    )


def matmul_launches(dtype: torch.dtype, tokens: int = 4096, n_in: int = 4096, n_out: int = 4096,
                    r: int = 16, blocksize: int = 64) -> dict[str, tuple[tuple, dict]]:
    """The fused matmul's launches in training, as (args, constexprs) on meta tensors, by name:
    the forward (W^T, LoRA term and bias in the epilogue, written in fp32 for a half-precision x
    as under k-bit training) and dx (W, LoRA term and dropout mask)."""
    from .lora import _keep_scale, matmul_launch

    quant = meta_quant(n_out, n_in, blocksize)
    t = lambda *shape, dt=dtype: torch.empty(*shape, dtype=dt, device="meta")  # noqa: E731
    A, B = t(r, n_in), t(n_out, r)
    _, fwd_args, fwd_const = matmul_launch(t(tokens, n_in), quant, True, left=t(tokens, r), right=B.t(),
                                           lora_scale=2.0, bias=t(n_out), out_dtype=torch.float32)
    _, bwd_args, bwd_const = matmul_launch(t(tokens, n_out), quant, False, left=t(tokens, r), right=A,
                                           keep=t(tokens, n_in, dt=torch.bool), keep_scale=_keep_scale(0.1, dtype))
    return {"forward": (fwd_args, fwd_const), "dx": (bwd_args, bwd_const)}


def dequant_launch(dtype: torch.dtype, n_out: int = 4096, n_in: int = 4096,
                   blocksize: int = 64) -> tuple[tuple, dict, dict]:
    """The NF4 dequantization kernel's launch as (args, constexprs, options) on meta tensors."""
    from .nf4 import dequant_launch as launch

    return launch(meta_quant(n_out, n_in, blocksize), torch.empty((n_out, n_in), dtype=dtype, device="meta"))


# ------------------------------------------------------------------ checking every target
# The launch shape the check compiles: in_features a multiple of 16 (as in real models, so the
# compiler specializes the strides alike) but not of the blocksize, and the smallest blocksize,
# so the tiles meet the most scale blocks there can be. MODEL_SHAPE: a real model's layer (rows
# start on a block), the kernel's other branch.
CHECK_SHAPE = {"n_out": 4096, "n_in": 4080, "blocksize": 32}
MODEL_SHAPE = {"n_out": 4096, "n_in": 4096, "blocksize": 64}


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


def _dtype(name: str) -> torch.dtype:
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def _compile_job(job: tuple) -> dict:
    kernel_name, launch, cap, dname, key, shape_name = job
    dtype = _dtype(dname)
    shape = MODEL_SHAPE if shape_name == "model" else CHECK_SHAPE
    row = {"kernel": kernel_name, "launch": launch, "capability": list(cap), "dtype": dname, "shape": shape_name,
           "limit": smem_limit(cap)}
    if kernel_name == "nf4_dequantize":
        from .nf4 import _nf4_dequant_kernel

        args, constexprs, options = dequant_launch(dtype, **shape)
        row.update(config=f"BLOCK {constexprs['BLOCK']} w{options['num_warps']}", estimate=None)
        row["shared"] = shared_memory(_nf4_dequant_kernel, args, constexprs, cap, **options)
        return row
    from .lora import OPTIONS, _nf4_lora_matmul_kernel

    config = next(c for c in matmul_configs(dtype) if config_key(c) == key)
    args, constexprs = matmul_launches(dtype, **shape)[launch]
    row.update(config=config_name(config), estimate=matmul_shared_estimate(config, dtype, cap))
    row["shared"] = shared_memory(_nf4_lora_matmul_kernel, args, constexprs, cap, config, **OPTIONS)
    return row


def check_jobs(targets: Iterable[Sequence[int]] = TARGETS, dx_on: Iterable[tuple] | None = (((8, 6), "bf16"),),
               every_dx: bool = False) -> list[tuple]:
    """What ``check_targets`` compiles: for every target and dtype, the dequantization kernel and the
    matmul's forward launch (its larger one: fp32 output, scale vectors along the output) in every
    config offered there, at CHECK_SHAPE; and for each (capability, dtype name) in ``dx_on``
    (None: all), in the largest offered config (every offered one with ``every_dx``), its dx
    launch at CHECK_SHAPE and both launches at MODEL_SHAPE (the kernel's branch for rows that
    start on a block). By default those only on sm_86 in bf16, the tightest limit a
    half-precision run meets: a dx compile takes ~3x a forward one, and the CI test keeps to
    about a minute of CPU."""
    dx_set = None if dx_on is None else {((int(c[0]), int(c[1])), d) for c, d in dx_on}
    jobs = []
    for cap in targets:
        cap = (int(cap[0]), int(cap[1]))
        for dtype in dtypes_for(cap):
            name = dtype_name(dtype)
            offered = configs_for(cap, dtype)
            jobs.append(("nf4_dequantize", "dequant", cap, name, None, "worst"))
            jobs += [("nf4_lora_matmul", "forward", cap, name, config_key(c), "worst") for c in offered]
            if dx_set is None or (cap, name) in dx_set:
                largest = max(offered, key=lambda c: matmul_shared_estimate(c, dtype, cap))
                for c in (offered if every_dx else [largest]):
                    jobs += [("nf4_lora_matmul", "dx", cap, name, config_key(c), "worst"),
                             ("nf4_lora_matmul", "forward", cap, name, config_key(c), "model"),
                             ("nf4_lora_matmul", "dx", cap, name, config_key(c), "model")]
    return jobs


def check_targets(targets: Iterable[Sequence[int]] = TARGETS, workers: int | None = None, **which: Any) -> list[dict]:
    """Cross-compile ``check_jobs(targets, **which)``; one dict per compile: kernel, launch, capability, dtype,
    shape ("worst": CHECK_SHAPE, "model": MODEL_SHAPE), config, shared (bytes, the compiler's),
    estimate (the pruning's bound) and limit.

    ``workers`` processes (default: up to 2 CPUs) compile in parallel, forked from this one.
    Needs the kernels imported with TRITON_INTERPRET unset; compiled kernels go to Triton's cache
    (TRITON_CACHE_DIR), so a fresh one measures the full cost.
    """
    import os

    jobs = check_jobs(targets, **which)
    workers = workers or min(2, os.cpu_count() or 1)
    if workers > 1 and "fork" in _start_methods():
        import multiprocessing

        with multiprocessing.get_context("fork").Pool(workers) as pool:
            return pool.map(_compile_job, jobs, chunksize=1)
    return [_compile_job(job) for job in jobs]


def _start_methods() -> list[str]:
    import multiprocessing

    return multiprocessing.get_all_start_methods()
