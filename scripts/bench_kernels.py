#!/usr/bin/env python
"""Benchmark tunekit_kernels against the peft + bitsandbytes path on one CUDA GPU.

Measures, in bf16:

* LoRA linear over an NF4 base (square hidden x hidden layer), forward + backward:
  median time (CUDA events) and peak extra memory (torch.cuda.max_memory_allocated)
  for peft's LoRA Linear4bit, fused_lora_linear(weight_mode="tiles") and ("buffer").
* NF4 dequantization: achieved bandwidth, (bytes read + bytes written) / time, for
  our Triton kernel and bitsandbytes.functional.dequantize_4bit, vs the device peak.

Writes JSON and a markdown table (same path, .md) with the device name and library
versions.  Needs CUDA; on a machine without it, exits with a one-line message.

    python scripts/bench_kernels.py --out benchmarks/kernels/kernels-h100.json
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

from benchlib import import_kernels  # tunekit_kernels, installed or from this checkout

REPO = Path(__file__).resolve().parents[1]

# Peak DRAM bandwidth in GB/s for common GPUs (vendor datasheets); --peak-gbps overrides.
PEAK_GBPS = {"H200": 4800, "H100 SXM": 3350, "H100 80GB HBM3": 3350, "H100 PCIe": 2000,
             "H100": 3350, "A100-SXM4-80GB": 2039, "A100": 1555, "L40S": 864, "L4": 300,
             "A10G": 600, "RTX 4090": 1008}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None,
                   help="JSON output path (default: benchmarks/kernels/kernels-<device>.json); a .md table goes beside it")
    p.add_argument("--hidden", type=int, nargs="+", default=[2048, 4096])
    p.add_argument("--ranks", type=int, nargs="+", default=[16, 64])
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192, 16384])
    p.add_argument("--repeats", type=int, default=20, help="timed iterations per case (median reported)")
    p.add_argument("--warmup", type=int, default=5, help="untimed iterations (includes Triton autotuning)")
    p.add_argument("--peak-gbps", type=float, default=None, help="device peak memory bandwidth, GB/s")
    return p.parse_args(argv)


def cuda_time_ms(fn, repeats, warmup):
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def peak_extra_mib(fn):
    """Peak memory allocated during fn() above what was allocated before it, in MiB."""
    import torch

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def bench_lora(tk, hidden, rank, tokens, args):
    import bitsandbytes as bnb
    import peft
    import torch
    from peft.tuners.lora.bnb import Linear4bit as PeftLoraLinear4bit

    dtype, dev = torch.bfloat16, "cuda"
    torch.manual_seed(0)
    base = bnb.nn.Linear4bit(hidden, hidden, bias=False, compute_dtype=dtype, quant_type="nf4",
                             compress_statistics=True).to(dev)
    base.weight.requires_grad_(False)
    cfg = peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0)
    layer = PeftLoraLinear4bit(base, "default", config=cfg, r=rank, lora_alpha=2 * rank, lora_dropout=0.0)
    layer.lora_A["default"].to(dtype)
    layer.lora_B["default"].to(dtype)
    torch.nn.init.normal_(layer.lora_B["default"].weight, std=0.02)
    quant = tk.from_quant_state(base.weight.data, base.weight.quant_state)
    A = layer.lora_A["default"].weight.detach().clone().requires_grad_()
    B = layer.lora_B["default"].weight.detach().clone().requires_grad_()
    x = torch.randn(tokens, hidden, device=dev, dtype=dtype, requires_grad=True)
    grad = torch.randn(tokens, hidden, device=dev, dtype=dtype)
    scaling = layer.scaling["default"]

    def peft_step():
        layer(x).backward(grad)

    def fused_step(mode):
        return lambda: tk.fused_lora_linear(x, quant, A, B, scaling, weight_mode=mode).backward(grad)

    rows = []
    for name, step in (("peft+bnb", peft_step), ("fused-tiles", fused_step("tiles")),
                       ("fused-buffer", fused_step("buffer"))):
        ms = cuda_time_ms(step, args.repeats, args.warmup)
        mib = peak_extra_mib(step)
        rows.append(dict(op="lora_linear_fwd_bwd", impl=name, hidden=hidden, rank=rank, tokens=tokens,
                         ms=round(ms, 4), peak_extra_mib=round(mib, 1)))
        x.grad = A.grad = B.grad = None
        layer.zero_grad(set_to_none=True)
    return rows


def bench_dequant(tk, out_features, in_features, peak_gbps, args):
    import bitsandbytes.functional as bnbF
    import torch

    w = torch.randn(out_features, in_features, device="cuda", dtype=torch.bfloat16)
    packed, state = bnbF.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
    quant = tk.from_quant_state(packed, state)
    n = quant.numel
    # 4-bit codes + 1-byte scale codes per 64 + fp32 absmax2 per 64*256 read; bf16 written.
    moved = n / 2 + quant.absmax.numel() + 4 * quant.absmax2.numel() + 2 * n
    buf = torch.empty(quant.shape, dtype=torch.bfloat16, device="cuda")
    rows = []
    for name, fn in (("triton", lambda: tk.nf4_dequantize(quant, torch.bfloat16, out=buf)),
                     ("bitsandbytes", lambda: bnbF.dequantize_4bit(packed, state))):
        ms = cuda_time_ms(fn, args.repeats, args.warmup)
        gbps = moved / (ms * 1e-3) / 1e9
        rows.append(dict(op="nf4_dequantize", impl=name, shape=[out_features, in_features], ms=round(ms, 4),
                         gbps=round(gbps, 1), pct_of_peak=round(100 * gbps / peak_gbps, 1) if peak_gbps else None))
    return rows


def to_markdown(report):
    lines = [f"# tunekit_kernels benchmark: {report['device']}", "",
             "Versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()), "",
             "| hidden | rank | tokens | impl | fwd+bwd ms | peak extra MiB |", "|---|---|---|---|---|---|"]
    for r in report["results"]:
        if r["op"] == "lora_linear_fwd_bwd":
            lines.append(f"| {r['hidden']} | {r['rank']} | {r['tokens']} | {r['impl']} | {r['ms']} | {r['peak_extra_mib']} |")
    lines += ["", f"NF4 dequantize (bf16 out), device peak {report['peak_gbps']} GB/s", "",
              "| shape | impl | ms | GB/s | % of peak |", "|---|---|---|---|---|"]
    for r in report["results"]:
        if r["op"] == "nf4_dequantize":
            lines.append(f"| {r['shape'][0]}x{r['shape'][1]} | {r['impl']} | {r['ms']} | {r['gbps']} | {r['pct_of_peak']} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench_kernels: no CUDA device (torch.cuda.is_available() is False); nothing to measure.")
    import bitsandbytes
    import peft
    import triton

    tk = import_kernels()
    device = torch.cuda.get_device_name()
    peak = args.peak_gbps or next((v for k, v in PEAK_GBPS.items() if k in device), None)
    results = []
    for hidden in args.hidden:
        for rank in args.ranks:
            for tokens in args.tokens:
                results += bench_lora(tk, hidden, rank, tokens, args)
                print(results[-3:], flush=True)
    for shape in [(h, h) for h in args.hidden] + [(14336, 4096)]:
        results += bench_dequant(tk, *shape, peak, args)
    report = dict(device=device, peak_gbps=peak, results=results,
                  versions={"torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__,
                            "bitsandbytes": bitsandbytes.__version__, "peft": peft.__version__})
    slug = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")
    out = args.out or REPO / "benchmarks" / "kernels" / f"kernels-{slug}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    out.with_suffix(".md").write_text(to_markdown(report))
    print(f"wrote {out} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
