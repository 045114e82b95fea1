#!/usr/bin/env python
"""Peak memory of the distillation loss (forward + backward), with and without chunking.

Geometry defaults to tunekit's default pair: vocabulary 49152, student hidden 576
(SmolLM2-135M), teacher hidden 576, sequence 512 with every token trained, fp32 hidden states,
heads and logits.  For each batch size it measures

* ``unchunked``: both heads applied to the full hidden states, then ``distill_loss`` on the
  (batch, seq, vocab) logits (what a trainer does with ``model(...).logits``);
* ``chunked``: ``chunked_distill_loss`` on the hidden states, for each ``--chunk-sizes``.

Only the loss computation is measured: inputs (hidden states, head weights) are allocated before
the baseline is taken.  Every configuration runs in a fresh subprocess.  On CPU the figure is
the increase of the process's peak RSS (getrusage ru_maxrss) over its RSS just before the loss;
on CUDA it is torch.cuda.max_memory_allocated over memory_allocated just before.

    python scripts/bench_distill_memory.py                      # CPU, batch 1 and 4
    python scripts/bench_distill_memory.py --device cuda --out benchmarks/training/distill-memory-h100.json
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None,
                   help="JSON output (default: benchmarks/training/distill-memory-<device>.json)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--student-hidden", type=int, default=576)
    p.add_argument("--teacher-hidden", type=int, default=576)
    p.add_argument("--chunk-sizes", type=int, nargs="+", default=[1024, 256])
    p.add_argument("--divergence", default="forward_kl", choices=["forward_kl", "reverse_kl", "jsd"])
    p.add_argument("--alpha", type=float, default=0.5)
    p.add_argument("--temperature", type=float, default=2.0)
    p.add_argument("--train-head", action="store_true",
                   help="student head weight requires grad (full fine-tune); default frozen, as in LoRA")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # one configuration, as JSON
    return p.parse_args(argv)


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc/self/status")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return f"CPU {platform.machine()}"


def run_child(cfg: dict) -> dict:
    """One measurement in this (fresh) process; returns the figures as a dict."""
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(REPO))  # for an uninstalled checkout; tunekit/ has no name clash
    from tunekit.losses.distill import chunked_distill_loss, distill_loss

    device = torch.device(cfg["device"])
    torch.manual_seed(0)
    b, s, v = cfg["batch"], cfg["seq"], cfg["vocab"]
    h_s = torch.randn(b, s, cfg["student_hidden"], device=device, requires_grad=True)
    w_s = (torch.randn(v, cfg["student_hidden"], device=device) * 0.02).requires_grad_(cfg["train_head"])
    h_t = torch.randn(b, s, cfg["teacher_hidden"], device=device)
    w_t = torch.randn(v, cfg["teacher_hidden"], device=device) * 0.02
    labels = torch.randint(0, v, (b, s), device=device)  # all trained
    args = (cfg["alpha"], cfg["temperature"], cfg["divergence"])

    def step():
        if cfg["chunk_size"] is None:
            student_logits = F.linear(h_s, w_s)
            with torch.no_grad():
                teacher_logits = F.linear(h_t, w_t)
            loss, n = distill_loss(student_logits, teacher_logits, labels, *args)
        else:
            loss, n = chunked_distill_loss(h_s, w_s, h_t, w_t, labels, *args, chunk_size=cfg["chunk_size"])
        loss.backward()
        return loss.item(), n.item()

    # Tiny warm-up of the same code path, so one-off allocations (thread pools, kernel selection)
    # land in the baseline rather than in the figure.
    tiny = [t[:, :8].detach().clone().requires_grad_(t.requires_grad) for t in (h_s, h_t)]
    tiny_w = [w[:64].detach().clone().requires_grad_(w.requires_grad) for w in (w_s, w_t)]
    tiny_labels = labels[:, :8] % 64
    if cfg["chunk_size"] is None:
        distill_loss(F.linear(tiny[0], tiny_w[0]), F.linear(tiny[1], tiny_w[1]).detach(), tiny_labels,
                     *args)[0].backward()
    else:
        chunked_distill_loss(tiny[0], tiny_w[0], tiny[1], tiny_w[1], tiny_labels, *args,
                             chunk_size=4)[0].backward()
    del tiny, tiny_w

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        loss, n = step()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        peak_mib = (torch.cuda.max_memory_allocated() - base) / 2**20
    else:
        base_kib = _rss_kib()
        t0 = time.perf_counter()
        loss, n = step()
        seconds = time.perf_counter() - t0
        peak_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base_kib) / 1024
    return {"peak_extra_mib": round(peak_mib, 1), "seconds": round(seconds, 2), "loss_sum": loss,
            "tokens": n}


def main(argv=None):
    args = parse_args(argv)
    if args.child is not None:
        print(json.dumps(run_child(json.loads(args.child))))
        return
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: CUDA is not available")
    device_name = (torch.cuda.get_device_name() if args.device == "cuda"
                   else f"{_cpu_name()}, {torch.get_num_threads()} threads")
    out = args.out or REPO / "benchmarks" / "training" / f"distill-memory-{args.device}.json"
    settings = {k: getattr(args, k) for k in ("device", "seq", "vocab", "student_hidden", "teacher_hidden",
                                              "divergence", "alpha", "temperature", "train_head")}
    rows = []
    for batch in args.batch:
        for chunk in [None, *args.chunk_sizes]:
            cfg = dict(settings, batch=batch, chunk_size=chunk)
            proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(cfg)],
                                  capture_output=True, text=True, cwd=REPO)
            if proc.returncode != 0:
                sys.exit(f"configuration {cfg} failed:\n{proc.stderr}")
            res = json.loads(proc.stdout.strip().splitlines()[-1])
            tokens = batch * (args.seq - 1)
            rows.append({"batch": batch, "tokens": tokens, "chunk_size": chunk,
                         # one (tokens, vocab) fp32 buffer, for scale
                         "logits_fp32_mib": round(tokens * args.vocab * 4 / 2**20, 1), **res})
            print(f"batch {batch} chunk {chunk}: {res}", file=sys.stderr)

    print(f"\nDistillation loss fwd+bwd peak extra memory, {device_name}, torch {torch.__version__}")
    print(f"seq {args.seq}, vocab {args.vocab}, hidden {args.student_hidden}/{args.teacher_hidden}, "
          f"{args.divergence}, alpha {args.alpha}, T {args.temperature}, "
          f"student head {'trainable' if args.train_head else 'frozen'}\n")
    print("| batch | trained tokens | chunk size | one logits buffer (MiB) | peak extra (MiB) | time (s) |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        chunk = "none (unchunked)" if r["chunk_size"] is None else r["chunk_size"]
        print(f"| {r['batch']} | {r['tokens']} | {chunk} | {r['logits_fp32_mib']} | "
              f"{r['peak_extra_mib']} | {r['seconds']} |")

    out.parent.mkdir(parents=True, exist_ok=True)
    metric = ("ru_maxrss increase over RSS before the loss" if args.device == "cpu"
              else "torch.cuda.max_memory_allocated increase over memory_allocated before the loss")
    out.write_text(json.dumps({"device": device_name, "torch": torch.__version__,
                               "python": platform.python_version(), "metric": metric,
                               "settings": settings, "results": rows}, indent=2) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
