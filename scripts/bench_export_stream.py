#!/usr/bin/env python
"""Peak memory of the streamed merged export against model size, on the CPU.

For each size, a random-init Llama built from a config (bf16 on disk, SmolLM2's tokenizer and
vocabulary, tied head; nothing downloaded):

1. `tunekit train recipe=qlora` for 1 step with tiny settings, so that a QLoRA adapter exists;
2. `tunekit export RUN --format merged --dtype bf16 --device cpu` in a fresh process: its peak
   RSS (os.wait4's ru_maxrss, the process and everything it waited for) and wall time; with
   --in-memory, the same export again with the streamed merge switched off (the in-memory merge
   that export used before), for the same figures;
3. the merged weights checked against dequant(quant_nf4(W)) + s B @ A computed here, with
   bitsandbytes' functional API on the base's safetensors and the adapter's own tensors (never
   through tunekit's merge code): every element within one bf16 rounding of that fp32 sum.

A process importing the same stack (torch, transformers, peft, bitsandbytes, tunekit's export)
gives the baseline RSS that every export pays before it loads anything. Run it alone on the
machine: another job's memory does not count in RSS, but its CPU time stretches the wall times.

    python scripts/bench_export_stream.py [--sizes 135m 0.4b 1b] [--in-memory] [--work DIR]

writes benchmarks/export/stream-<date>.md and .json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GiB = 2**30
# Llama shapes over SmolLM2's 49152-token vocabulary (its tokenizer), tied head, bf16 on disk.
SIZES = {
    "135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                 num_key_value_heads=3),  # SmolLM2-135M's own shape
    "0.4b": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                 num_key_value_heads=4),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8),  # Llama-3.2-1B's block, 49k vocabulary
}
TRAIN = ["recipe=qlora", "trainer.max_steps=1", "trainer.micro_batch_size=1", "trainer.grad_accum=1",
         "trainer.eval_every=1", "trainer.save_every=1", "trainer.warmup_steps=0", "trainer.lr=1e-3",
         "trainer.eval_samples=0", "data.max_seq_len=64", "data.max_val_examples=4"]
EXPORT = ["--format", "merged", "--dtype", "bf16", "--device", "cpu", "--eval-batches", "1", "--task-rows", "0",
          "--force"]
BASELINE = "import torch, transformers, peft, bitsandbytes, safetensors; import tunekit.commands.export"
# The export's command, with each phase's memory printed as it ends: the high-water mark of RSS so far
# (VmHWM) and the anonymous RSS then (no sampling thread in the process: it would cost the export's
# threads time). "in-memory" first refuses the streamed plan: the in-memory merge every merged export
# took before.
DRIVER = """
import json, os, sys
from tunekit.device.threads import openmp_env
os.environ.update(openmp_env(os.environ, torch_loaded=False))  # as tunekit's main does, before torch loads
def status():
    d = {}
    for line in open("/proc/self/status"):
        k, _, v = line.partition(":")
        if k in ("VmHWM", "RssAnon"): d[k] = int(v.split()[0]) * 1024
    return d
import tunekit.export.artifacts as art, tunekit.export.job as job, tunekit.export.stream as stream
if sys.argv[1] == "in-memory":
    stream.plan_stream = lambda src, target: (None, "benchmark: in memory")
def hooked(owner, name, phase):
    real = getattr(owner, name)
    def run(*a, **k):
        out = real(*a, **k)
        d = status()
        print("PHASE " + json.dumps({"phase": phase, "hwm": d["VmHWM"], "anon": d["RssAnon"]}), flush=True)
        return out
    setattr(owner, name, run)
hooked(job, "measure_reference", "reference: the trained model measured")
hooked(job.Export, "_hand_over", "merge in memory (streamed: nothing)")
hooked(stream, "write_merged", "write: the streamed merge")
hooked(art, "write_merged", "write: the merged model saved")
hooked(art, "reload_merged", "reload: the candidate loaded")
hooked(job, "compare", "compare: the candidate measured")
from tunekit.commands.main import main
main(sys.argv[2:])
"""


def cpu_name() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    name = next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "?")
    return f"{name}, {os.cpu_count()} cores"


def versions() -> str:
    import importlib.metadata as md

    return ", ".join(f"{n} {md.version(n)}" for n in ("torch", "transformers", "peft", "bitsandbytes", "safetensors"))


def measured(argv: list[str], env: dict) -> tuple[int, float, int, int, str]:
    """(return code, wall seconds, peak RSS bytes, peak anonymous RSS bytes, its output) of one fresh
    process. Peak RSS is the kernel's (ru_maxrss): it counts the pages of files the process maps
    (safetensors checkpoints), which the kernel can drop and read again; the anonymous part (RssAnon,
    sampled every 20 ms) is what the process cannot give back without freeing it."""
    import tempfile
    import threading

    anon = [0]

    def sample(pid: int, done: threading.Event) -> None:
        while not done.wait(0.02):
            try:
                text = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                return
            for line in text.splitlines():
                if line.startswith("RssAnon:"):
                    anon[0] = max(anon[0], int(line.split()[1]) * 1024)

    with tempfile.TemporaryFile("w+") as log:
        start = time.time()
        p = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        done = threading.Event()
        sampler = threading.Thread(target=sample, args=(p.pid, done), daemon=True)
        sampler.start()
        _, status, usage = os.wait4(p.pid, 0)  # reaped here, with its resource usage (Popen's wait has none)
        wall = time.time() - start
        done.set()
        sampler.join()
        p.returncode = os.waitstatus_to_exitcode(status)
        log.seek(0)
        return p.returncode, wall, usage.ru_maxrss * 1024, anon[0], log.read()


def build_model(folder: Path, shape: dict) -> int:
    """A random-init Llama of `shape` saved in bf16 with SmolLM2's tokenizer; returns its parameter count."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(REPO))
    from tunekit.model import default_model_dir

    tok = AutoTokenizer.from_pretrained(default_model_dir())
    cfg = LlamaConfig(vocab_size=len(tok), max_position_embeddings=2048, tie_word_embeddings=True,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      **shape)
    torch.manual_seed(0)
    model = LlamaForCausalLM._from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def check_merge(base: Path, adapter: Path, merged: Path) -> dict:
    """Every LoRA target of the merged folder against dequant(quant_nf4(W)) + s B @ A computed here.
    Bound per element: the two fp32 sums (the export's and this one, each r products, a scaling and
    an addition in its own order) each lie within (r + 2) u (|W| + s |B| @ |A|) of the exact value
    (u = 2^-24), so they differ by at most twice that; rounding to bf16 then adds at most half a bf16
    ulp, 2^-8 |W + delta|."""
    import bitsandbytes.functional as bnbf
    import torch
    from safetensors import safe_open

    cfg = json.loads((adapter / "adapter_config.json").read_text())
    scale = cfg["lora_alpha"] / (cfg["r"] ** 0.5 if cfg.get("use_rslora") else cfg["r"])
    worst, checked, exact = 0.0, 0, 0
    with safe_open(str(base / "model.safetensors"), "pt") as b, \
            safe_open(str(adapter / "adapter_model.safetensors"), "pt") as a, \
            safe_open(str(merged / "model.safetensors"), "pt") as m:
        loras = sorted({k.removeprefix("base_model.model.").rsplit(".lora_", 1)[0] for k in a.keys()})
        for module in loras:
            w = b.get_tensor(f"{module}.weight").float()  # (out, in)
            codes, state = bnbf.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
            w = bnbf.dequantize_4bit(codes, state)
            lb = a.get_tensor(f"base_model.model.{module}.lora_B.weight").float()  # (out, r)
            la = a.get_tensor(f"base_model.model.{module}.lora_A.weight").float()  # (r, in)
            delta = scale * (lb @ la)
            want, got = w + delta, m.get_tensor(f"{module}.weight").float()
            size = w.abs() + scale * (lb.abs() @ la.abs())
            bound = 2.0**-8 * want.abs() + 2 * (la.shape[0] + 2) * 2.0**-24 * size
            err = (got - want).abs()
            worst = max(worst, (err / bound.clamp_min(torch.finfo(torch.float32).tiny)).max().item())
            checked += 1
        for name in m.keys():  # everything else is the base's own tensor, as stored
            if name.rsplit(".", 1)[0] not in loras:
                exact += torch.equal(m.get_tensor(name), b.get_tensor(name))
        others = len([n for n in m.keys() if n.rsplit(".", 1)[0] not in loras])
    return {"lora_weights_checked": checked, "worst_error_over_bound": worst, "within_bound": worst <= 1.0,
            "other_tensors_equal": f"{exact}/{others}"}


def one_size(name: str, work: Path, env: dict, in_memory: bool) -> dict:
    folder, run = work / name / "model", work / name / "run"
    shutil.rmtree(work / name, ignore_errors=True)
    folder.mkdir(parents=True)
    params = build_model(folder, SIZES[name])
    size = (folder / "model.safetensors").stat().st_size
    print(f"{name}: {params / 1e6:.0f}M params, {size / GiB:.2f} GiB on disk; training 1 step", flush=True)
    code, wall, rss, _, tail = measured([sys.executable, "-m", "tunekit.commands.main", "train", *TRAIN,
                                         f"model.path={folder}", f"output_dir={run}"], env)
    if code != 0:
        raise SystemExit(f"{name}: training failed:\n{tail[-3000:]}")
    row = {"size": name, "params": params, "bf16_bytes": size, "shape": SIZES[name], "train_peak_rss": rss}
    ways = [("streamed", [sys.executable, "-c", DRIVER, "streamed", "export"])]
    if in_memory:
        ways.append(("in_memory", [sys.executable, "-c", DRIVER, "in-memory", "export"]))
    for way, argv in ways:
        out = work / name / f"export-{way}"
        code, wall, rss, anon, tail = measured([*argv, str(run), *EXPORT, "--out", str(out)], env)
        if code != 0:
            raise SystemExit(f"{name}: {way} export failed:\n{tail[-3000:]}")
        report = json.loads((out / "fidelity.json").read_text())
        assert report["merged_by"] == way.replace("_", " "), report["merged_by"]
        phases = [json.loads(line[6:]) for line in tail.splitlines() if line.startswith("PHASE ")]
        row[way] = {"peak_rss": rss, "peak_anon_rss": anon, "phases": phases, "wall_s": round(wall, 1), "accepted": report["accepted"],
                    "kl_mean": report["fidelity"]["kl_mean"], "gain_kept": report["fidelity"]["gain_kept"],
                    "timings_s": report["timings_s"], "check": check_merge(folder, run / "adapter", out)}
        print(f"  {way}: peak RSS {rss / GiB:.2f} GiB ({rss / size:.2f} x the bf16 model; anonymous "
              f"{anon / GiB:.2f} GiB), {wall:.0f} s, "
              f"merge check {row[way]['check']}", flush=True)
        shutil.rmtree(out)
    return row


def markdown(result: dict) -> str:
    base = result["baseline_rss"]
    lines = [f"# Streamed merged export: peak RSS against model size ({result['date']})", "",
             f"machine: {result['cpu']}, {result['memory_gib']:.0f} GiB; {result['versions']}", "",
             "Random-init Llamas (bf16 on disk, 49152-token vocabulary, tied head), 1 step of `tunekit train "
             "recipe=qlora` (LoRA r=16 on every projection of the NF4 base), then `tunekit export RUN "
             f"{' '.join(EXPORT)}` in a fresh process. Peak RSS: the process's ru_maxrss, which counts the pages "
             "of the safetensors files it maps (the kernel can drop them and read them again); peak anonymous: "
             "the largest RssAnon sampled every 20 ms (what it cannot give back). Baseline: a process importing "
             f"the same stack, {base / GiB:.2f} GiB ({result['baseline_anon_rss'] / GiB:.2f} GiB anonymous). "
             "`scripts/bench_export_stream.py --in-memory`, nothing else of ours running; load average "
             f"{result['load_average_1min']['start']:.1f} at the start, {result['load_average_1min']['end']:.1f} at "
             "the end (other users' jobs: wall times are indicative, RSS is the process's own).", "",
             "| model | params | bf16 size | export | peak RSS | peak RSS / bf16 size | (peak - baseline) / bf16 size "
             "| peak anonymous | wall s | merged weights vs dequant(W) + s B A |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        for way in ("streamed", "in_memory"):
            if way not in row:
                continue
            r, size = row[way], row["bf16_bytes"]
            c = r["check"]
            lines.append(f"| {row['size']} | {row['params'] / 1e6:.0f}M | {size / GiB:.2f} GiB | {way.replace('_', ' ')} | "
                         f"{r['peak_rss'] / GiB:.2f} GiB | {r['peak_rss'] / size:.2f} | {(r['peak_rss'] - base) / size:.2f} | "
                         f"{r['peak_anon_rss'] / GiB:.2f} GiB | {r['wall_s']} | {c['lora_weights_checked']} LoRA weights "
                         f"{'within' if c['within_bound'] else 'OUTSIDE'} one bf16 rounding (worst "
                         f"{c['worst_error_over_bound']:.2f} of the bound); other tensors equal {c['other_tensors_equal']} |")
    lines += ["", "Where the peak is, phase by phase: the high-water mark of RSS at the end of each phase (it rises "
              "within the phase that holds the peak) and the anonymous RSS then, GiB:", "",
              "| model | export | phase | RSS high-water | anonymous at its end |", "|---|---|---|---|---|"]
    for row in result["rows"]:
        for way in ("streamed", "in_memory"):
            for ph in row.get(way, {}).get("phases", []):
                lines.append(f"| {row['size']} | {way.replace('_', ' ')} | {ph['phase']} | {ph['hwm'] / GiB:.2f} | "
                             f"{ph['anon'] / GiB:.2f} |")
    lines += ["", "The bound of the merge check, per element: 2^-8 |W + delta| (one bf16 rounding) + 2 (r + 2) 2^-24 "
              "(|W| + s |B| @ |A|) (two fp32 sums of r products, a scaling and an addition, in different orders).", ""]
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    p.add_argument("--in-memory", action="store_true", help="also measure the in-memory merge, for comparison")
    p.add_argument("--work", type=Path, default=Path("/tmp/tunekit-bench-export-stream"))
    p.add_argument("--out-dir", type=Path, default=REPO / "benchmarks" / "export")
    args = p.parse_args(argv)
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    _, _, baseline, baseline_anon, _ = measured([sys.executable, "-c", BASELINE], env)
    date = datetime.date.today().isoformat()
    load_start = os.getloadavg()[0]
    result = {"date": date, "cpu": cpu_name(), "memory_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB,
              "versions": versions(), "baseline_rss": baseline, "baseline_anon_rss": baseline_anon, "train": TRAIN, "export": EXPORT,
              "rows": [one_size(name, args.work, env, args.in_memory) for name in args.sizes]}
    # other processes on the machine take no RSS from these, but their CPU time stretches the wall times
    result["load_average_1min"] = {"start": load_start, "end": os.getloadavg()[0]}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"stream-{date}.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out_dir / f"stream-{date}.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
