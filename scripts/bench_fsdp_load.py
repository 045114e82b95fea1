"""Host memory of FSDP's base load: the sum of the ranks' peak RSS against one process alone.

    python scripts/bench_fsdp_load.py --model /tmp/bench-1b [--build] [--code DIR --label after] [--recipes lora qlora]

--build writes a random-init Llama-shape model folder first (--shape 1b: hidden 2048, 16 layers,
intermediate 5632, untied head, the default model's 49152-token vocabulary and tokenizer, bf16
safetensors: 1.02B parameters, 2.0 GiB; --shape 3b: Llama-3.2-3B's widths, 3.1B, 6.2 GB; never
commit it). Then, per recipe, `tunekit train` runs a few steps
with short sequences (a) in one process and (b) on two gloo ranks with trainer.strategy=fsdp
(`accelerate launch --multi_gpu`, ACCELERATE_USE_CPU=true), each rank with one OpenMP thread. The
peak of each process is its VmHWM, polled every 20 ms from /proc (tunekit resets VmHWM once, after
setup, so the largest reading over the run is the lifetime peak up to the last 20 ms before that
reset). --code runs another checkout's tunekit (PYTHONPATH), to measure before and after a change
with the same script: every command runs in that checkout's folder, because `python -m` puts the
working directory before PYTHONPATH on sys.path (run from this checkout, --code was ignored).

The one process runs twice: as it is, and with glibc's mmap threshold fixed at 128 KiB
(MALLOC_MMAP_THRESHOLD_=131072, what tunekit.device.allocator sets on FSDP ranks). As it is, its
peak has two modes, about 2.9 and 3.8 GB on the 1.02B model, from run to run: transformers' loader
copies tensors in worker threads, and in most runs about 1 GB of freed copies stays resident
(glibc's adaptive threshold). With the threshold fixed it is the lower mode every time. `ratio` divides
the ranks' sum by the lower of the two, the one process's own need; `ratio_to_plain_one_process`
by the first. Appends one row per (label, recipe) to --out (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

STEPS = ["trainer.max_steps=2", "trainer.micro_batch_size=1", "trainer.grad_accum=1", "data.max_seq_len=64",
         "trainer.eval_every=100", "trainer.save_every=100", "trainer.eval_samples=0", "data.max_val_examples=1",
         "trainer.warmup_steps=0", "method.dropout=0", "model.gradient_checkpointing=false"]


# --shape: the widths of the model --build writes (untied head, the default tokenizer's vocabulary)
SHAPES = {
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=16,
               num_key_value_heads=16),
    # Llama-3.2-3B's widths and depth (3.1B parameters with this vocabulary, 6.2 GB in bf16)
    "3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
               num_key_value_heads=8),
}


def build(out: Path, shape: str = "1b") -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from tunekit.model import default_model_dir

    tok = AutoTokenizer.from_pretrained(default_model_dir())
    cfg = LlamaConfig(vocab_size=len(tok), **SHAPES[shape], max_position_embeddings=2048,
                      tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    print(f"built {out}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters")


def _hwm(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        pass
    return 0.0


def _children(pid: int) -> list[int]:
    """The launcher's rank processes (not a helper it may start for a moment)."""
    try:
        kids = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []
    ranks = []
    for kid in kids:
        try:
            if b"tunekit.commands.main" in Path(f"/proc/{kid}/cmdline").read_bytes():
                ranks.append(kid)
        except OSError:
            pass
    return ranks


def run(cmd: list[str], env: dict, ranks: bool, cwd: str) -> tuple[list[float], float, str]:
    """(peak MiB of each training process, wall seconds, stderr tail)."""
    start = time.time()
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=cwd)
    peaks: dict[int, float] = {}
    import threading

    err: list[str] = []
    t = threading.Thread(target=lambda: err.append(p.stderr.read()), daemon=True)
    t.start()
    while p.poll() is None:
        pids = _children(p.pid) if ranks else [p.pid]
        for pid in pids:
            peaks[pid] = max(peaks.get(pid, 0.0), _hwm(pid))
        time.sleep(0.02)
    t.join()
    if p.returncode != 0:
        sys.exit(f"failed ({p.returncode}): {' '.join(cmd)}\n{err[0][-3000:]}")
    return [peaks[k] for k in sorted(peaks)], time.time() - start, err[0][-2000:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--build", action="store_true")
    ap.add_argument("--shape", choices=list(SHAPES), default="1b", help="the widths --build writes")
    ap.add_argument("--data", required=True, help="a JSONL file of alpaca rows")
    ap.add_argument("--code", default=str(Path(__file__).resolve().parents[1]), help="the checkout whose tunekit runs")
    ap.add_argument("--label", default="after")
    ap.add_argument("--recipes", nargs="*", default=["lora", "qlora"])
    ap.add_argument("--out", default="benchmarks/training/fsdp-load.json")
    ap.add_argument("--work", default="/tmp/bench-fsdp-load")
    args = ap.parse_args()
    model, data, work = Path(args.model).resolve(), Path(args.data).resolve(), Path(args.work).resolve()
    if args.build:
        build(model, args.shape)
    env = {**os.environ, "PYTHONPATH": args.code, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true"}
    py = sys.executable
    accelerate = str(Path(py).with_name("accelerate"))
    code = str(Path(args.code).resolve())
    out = Path(args.out).resolve()
    kept = json.loads(out.read_text()) if out.is_file() else []
    rows = kept["rows"] if isinstance(kept, dict) else kept  # a benchmarks/ file: {"meta": ..., "rows": [...]}
    for recipe in args.recipes:
        common = [f"model.path={model}", f"data.path={data}", f"recipe={recipe}", "model.dtype=bf16", *STEPS]
        one_dir, two_dir = work / f"{args.label}-{recipe}-one", work / f"{args.label}-{recipe}-two"
        ones = []
        for i, extra in enumerate([{}, {"MALLOC_MMAP_THRESHOLD_": "131072"}]):
            shutil.rmtree(one_dir, ignore_errors=True)
            one, one_s, _ = run([py, "-m", "tunekit.commands.main", "train", *common, f"output_dir={one_dir}"],
                                {**env, **extra}, False, code)
            ones.append(one[0])
        shutil.rmtree(two_dir, ignore_errors=True)
        two, two_s, tail = run([accelerate, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
                                "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "29731",
                                "-m", "tunekit.commands.main", "train", *common, f"output_dir={two_dir}",
                                "trainer.strategy=fsdp"], env, True, code)
        streamed = "rank 0 alone reads the base" in tail or "rank 0 alone reads the base" in (
            (two_dir / "summary.json").read_text() if (two_dir / "summary.json").is_file() else "")
        summary = json.loads((two_dir / "summary.json").read_text()) if (two_dir / "summary.json").is_file() else {}
        row = {"label": args.label, "recipe": recipe, "one_process_peak_mib": round(ones[0], 1),
               "one_process_peak_fixed_threshold_mib": round(ones[1], 1),
               "rank_peaks_mib": [round(x, 1) for x in two], "sum_of_rank_peaks_mib": round(sum(two), 1),
               "ratio": round(sum(two) / min(ones), 3), "ratio_to_plain_one_process": round(sum(two) / ones[0], 3),
               "wall_s_one": round(one_s, 1), "wall_s_two": round(two_s, 1),
               "fsdp_summary": summary.get("fsdp"), "streamed": streamed or bool((summary.get("fsdp") or {}).get(
                   "base_streamed_from_rank_0"))}
        print(json.dumps(row))
        rows.append(row)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({**kept, "rows": rows} if isinstance(kept, dict) else rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
