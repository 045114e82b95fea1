#!/usr/bin/env python
"""Training throughput: tunekit vs the standard stack (transformers + peft + bitsandbytes + TRL SFTTrainer).

Both systems run the same fine-tune: same model, data, examples in the same order and grouping
per optimizer step (taken from tunekit's BatchSchedule and fed to TRL pre-tokenized through a
sequential sampler), same micro-batch size, gradient accumulation, LoRA r/alpha/dropout/targets,
NF4 double-quant config, compute dtype, gradient checkpointing, optimizer, lr schedule, packing
(tunekit's data.packing vs TRL's padding_free) and loss (response tokens only, normalised by the
trained tokens of the whole accumulated batch). Every system x repetition runs in a fresh
subprocess (order A B A B ...), so peak memory is per system. Per system it reports input
(non-padding) tokens/s and median step time over the steps after --warmup, peak memory (CPU: peak
RSS; GPU: torch.cuda max allocated/reserved), the first steps' losses (same math -> same numbers)
and tunekit/baseline ratios; on GPU also MFU (formula in benchlib's `useful_flops`).

    python scripts/bench_train.py                                  # CPU, SmolLM2-135M, packing on and off
    python scripts/bench_train.py --config gpu-1b                  # random-init Llama ~1B, seq 2048, packed
    python scripts/bench_train.py --config gpu-8b --systems tunekit,trl,trl-liger

The baseline computes under bf16 autocast wherever the compute dtype is bf16 (`bf16=True`), in one of
two setups (--baseline):

* trl (default): TRL 1.16's own choices for a PEFT model: no kbit preparation, so the frozen base
  keeps its bf16 embeddings, norms and head and the residual stream is bf16, as under tunekit's
  precision policy (tunekit.device.precision); TRL casts the LoRA weights of a 4-bit base to bf16.
* kbit: the QLoRA recipe of peft's docs: prepare_model_for_kbit_training (embeddings, norms and head
  widened to fp32, so the residual stream is fp32 and only the matmuls run in bf16) and fp32 LoRA
  weights.

Writes benchmarks/training/train-<device>-<config>.json and .md (or --out).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchlib import (LLAMA_1B, TRL_OPTIM, build_cfg, hf_base, in_fork, lengths, matmul_peak, memory, ordered_trainer,
                      peft_lora, random_llama, run_device, run_isolated, step_clock, step_examples, timed_steps,
                      useful_flops, write_result)
from benchlib import versions as installed

REPO = Path(__file__).resolve().parents[1]
SYSTEMS = ("tunekit", "trl", "trl-liger")
# micro-batch 32 x ~55-token default examples packs ~1.8k tokens per row at sequence 2048
CONFIGS = {
    "cpu": dict(seq_len=256, packing="both", micro_batch_size=8, grad_accum=2, steps=12, reps=3, llama=None),
    "gpu-1b": dict(seq_len=2048, packing="on", micro_batch_size=32, grad_accum=2, steps=30, reps=3, llama=LLAMA_1B),
    "gpu-8b": dict(seq_len=2048, packing="on", micro_batch_size=32, grad_accum=2, steps=20, reps=3,
                   llama=dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                              num_key_value_heads=8, tie_word_embeddings=False)),
}
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0}  # dense bf16, SXM


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", choices=list(CONFIGS), default="cpu")
    p.add_argument("--steps", type=int, help="optimizer steps per run (default per config)")
    p.add_argument("--reps", type=int, help="repetitions per system (default per config)")
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the timing")
    p.add_argument("--micro-batch-size", type=int)
    p.add_argument("--grad-accum", type=int)
    p.add_argument("--seq-len", type=int, help="data.max_seq_len")
    p.add_argument("--packing", choices=["off", "on", "both"])
    p.add_argument("--systems", default="tunekit,trl", help=f"comma-separated, of {','.join(SYSTEMS)}")
    p.add_argument("--recipe", default="qlora", help="tunekit recipe (qlora: 4-bit base, lora: bf16 base)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra tunekit config override")
    p.add_argument("--model", help="model folder (default: the config's model)")
    p.add_argument("--data", help="training data file (default: tunekit's default data)")
    p.add_argument("--baseline", choices=["trl", "kbit"], default="trl",
                   help="the TRL setup to compare with (see top): TRL's own (default) or peft's kbit preparation")
    p.add_argument("--peak-tflops", type=float, help="device peak for MFU (default: GPU: H100/H200 dense bf16 989; "
                   "CPU: measured in this run, in the dtype the base computes in)")
    p.add_argument("--peak-reps", type=int, default=10,
                   help="timed products per shape and dtype when measuring the CPU's matmul peak")
    p.add_argument("--out", type=Path, help="output path without suffix (default benchmarks/training/train-<device>-<config>)")
    p.add_argument("--fork-runs", action="store_true",
                   help="run each system and each matmul-peak measurement in a fork of this process, which imports "
                        "the stack once, instead of a fresh interpreter per run (CPU only: the GPU check's dry run; "
                        "peak memory then counts this process's imports too, the same for every system)")
    p.add_argument("--child", help=argparse.SUPPRESS)  # one run, as JSON
    args = p.parse_args(argv)
    for key, value in CONFIGS[args.config].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    bad = [s for s in args.systems if s not in SYSTEMS]
    if bad:
        p.error(f"--systems: unknown {bad}; choose from {SYSTEMS}")
    if args.warmup >= args.steps:
        p.error(f"--warmup {args.warmup} must be < --steps {args.steps}")
    return args


# ---------------------------------------------------------------------------- shared child setup
def token_counts(micro: list[list[dict]]) -> tuple[int, int]:
    """(input tokens, trained tokens) of one step, as tunekit counts them: no padding; an example's
    first label is never trained (nothing predicts it alone; packed, it is masked)."""
    n_input = sum(len(e["input_ids"]) for mb in micro for e in mb)
    n_trained = sum(sum(lab != -100 for lab in e["labels"][1:]) for mb in micro for e in mb)
    return n_input, n_trained


# ---------------------------------------------------------------------------- system: tunekit
def run_tunekit(spec: dict, cfg, out_dir: str) -> dict:
    from tunekit.train.loop import TrainRecipe

    r = TrainRecipe(cfg, Path(out_dir))
    r.setup()
    t = cfg.trainer
    timed = timed_steps(r, t.max_steps)
    r.tracker.close()
    rows = timed["rows"]
    return {"step_times_s": timed["step_times_s"], "losses": [row["loss"] for row in rows],
            "tokens": [(row["input_tokens"], row["trained_tokens"]) for row in rows], "trainable_params": r.trainable_params,
            "lengths": [lengths(step_examples(r.train_data, r.schedule, s)) for s in range(t.max_steps)],
            "adapter_dtype": str(r.params[0].dtype), "compute_dtype": str(r.dtype).removeprefix("torch."),
            "optimizer": type(r.optimizer).__name__}


# ---------------------------------------------------------------------------- system: TRL (+ Liger)
def run_trl(spec: dict, cfg, out_dir: str, liger: bool) -> dict:
    import torch
    from datasets import Dataset
    from peft import prepare_model_for_kbit_training
    from trl import SFTConfig, SFTTrainer

    from tunekit.config import plain
    from tunekit.data import BatchSchedule, load_splits
    from tunekit.model import load_tokenizer, resolve_model_path

    if liger:
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        # TRL computes the loss with its own fused LM head, so only the layer kernels are patched
        apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=False)
    t, m = cfg.trainer, cfg.model
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    path = resolve_model_path(m.path)
    tok = load_tokenizer(path)
    train, _ = load_splits(cfg.data.path, cfg.data.val_path, plain(cfg.data.format), tok, cfg.data.max_seq_len,
                           cfg.data.val_fraction, cfg.data.max_val_examples, cfg.seed)
    schedule = BatchSchedule([len(e["input_ids"]) for e in train], t.micro_batch_size, t.grad_accum, 1, 0, cfg.seed)
    steps = [step_examples(train, schedule, s) for s in range(t.max_steps)]
    rows = [{"input_ids": e["input_ids"], "labels": e["labels"]} for micro in steps for mb in micro for e in mb]

    model, dtype, quantized = hf_base(cfg, path, device)
    gc_kwargs = {"use_reentrant": False}
    kbit = quantized and spec.get("baseline", "trl") == "kbit"
    if kbit:
        prepare_model_for_kbit_training(model, use_gradient_checkpointing=m.gradient_checkpointing,
                                        gradient_checkpointing_kwargs=gc_kwargs)
    lora = peft_lora(cfg.method)
    optim = TRL_OPTIM[plain(t.optimizer)]
    args = SFTConfig(
        output_dir=out_dir, max_steps=t.max_steps, per_device_train_batch_size=t.micro_batch_size,
        gradient_accumulation_steps=t.grad_accum, learning_rate=t.lr, weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm, optim=optim, seed=cfg.seed, data_seed=cfg.seed,
        gradient_checkpointing=m.gradient_checkpointing, gradient_checkpointing_kwargs=gc_kwargs,
        # bf16 autocast where the compute dtype is bf16: the standard stack's mixed precision
        bf16=dtype == torch.bfloat16, fp16=False, use_cpu=device.type == "cpu",
        padding_free=cfg.data.packing, packing=False, max_length=None,  # examples are already truncated
        dataset_kwargs={"skip_prepare_dataset": True}, shuffle_dataset=False,
        logging_strategy="no", save_strategy="no", eval_strategy="no", report_to="none", disable_tqdm=True,
    )
    record = {"times": [], "losses": [], "micro": []}

    # each micro-batch's loss: its token-summed loss / trained tokens of the step
    OrderedSFTTrainer = ordered_trainer(SFTTrainer, t.warmup_steps, t.max_steps, record)
    trainer = OrderedSFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok,
                                peft_config=lora, callbacks=[step_clock(record)])
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    if kbit:  # peft's QLoRA recipe keeps fp32 LoRA weights: undo TRL's bf16 cast of them on a 4-bit base
        for p in params:
            p.data = p.data.float()
    trainer.train()
    if spec.get("save_adapter"):  # scripts/bench_task.py scores the trained adapter with `tunekit eval`
        trainer.model.save_pretrained(spec["save_adapter"], safe_serialization=True)
        tok.save_pretrained(spec["save_adapter"])
    return {"step_times_s": record["times"], "losses": record["losses"],
            "tokens": [token_counts(s) for s in steps], "lengths": [lengths(s) for s in steps],
            "trainable_params": sum(p.numel() for p in params), "adapter_dtype": str(params[0].dtype),
            "compute_dtype": str(dtype).removeprefix("torch."),
            "optimizer": type(getattr(trainer.optimizer, "optimizer", trainer.optimizer)).__name__,
            "loss_normalised_per_step": bool(trainer.model_accepts_loss_kwargs)}


def run_child(spec: dict) -> dict:
    import logging
    import warnings

    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    out_dir = tempfile.mkdtemp(prefix="bench-train-")
    cfg = build_cfg(spec, out_dir)
    if spec["system"] == "tunekit":
        result = run_tunekit(spec, cfg, out_dir)
    else:
        result = run_trl(spec, cfg, out_dir, liger=spec["system"] == "trl-liger")
    shutil.rmtree(out_dir, ignore_errors=True)
    return {**result, **memory(), "auto_resolved": cfg.auto_resolved}


# ---------------------------------------------------------------------------- parent
def prepare_forks(systems: list[str]) -> None:
    """--fork-runs: import what every run needs once, here, so that each fork starts with it."""
    import tunekit.train.loop  # noqa: F401

    if any(s.startswith("trl") for s in systems):
        import trl  # noqa: F401


def forced_dtype(sets: list[str]) -> str | None:
    """The compute dtype a `--set model.dtype=bf16|fp32` forces on the runs (None: auto decides)."""
    names = {"bf16": "bfloat16", "fp32": "float32"}
    forced = [names.get(v) for k, _, v in (s.partition("=") for s in sets) if k.strip() == "model.dtype"]
    return forced[-1] if forced else None  # the last one wins, as in tunekit's own overrides


def peak_dtypes(gpu: bool) -> tuple[str, ...]:
    """The dtypes whose matmul peak a CPU run measures: fp32, and bf16 where the CPU has it natively."""
    if gpu:
        return ("bfloat16", "float32")
    from tunekit.device.facts import cpu_has_bf16

    return ("bfloat16", "float32") if cpu_has_bf16() else ("float32",)


def summarize(runs: list[dict], warmup: int, peak: float | None) -> dict:
    times = [t for r in runs for t in r["step_times_s"][warmup:]]
    tokens = [c for r in runs for c in r["tokens"][warmup:]]
    s = {"median_step_s": statistics.median(times), "tokens_per_s": sum(c[0] for c in tokens) / sum(times),
         "trained_tokens_per_s": sum(c[1] for c in tokens) / sum(times),
         "first_losses": runs[0]["losses"][:5], "adapter_dtype": runs[0]["adapter_dtype"],
         "optimizer": runs[0]["optimizer"]}
    for key in ("peak_rss_mib", "train_peak_rss_mib", "cuda_max_allocated_mib", "cuda_max_reserved_mib"):
        if key in runs[0]:
            s[key] = max(r[key] for r in runs)
    if peak and "flops" in runs[0]:
        s["mfu"] = sum(f for r in runs for f in r["flops"][warmup:]) / sum(times) / (peak * 1e12)
    return s


def default_model() -> str:
    from tunekit.model import resolve_model_path

    return resolve_model_path(None)


def markdown(result: dict) -> str:
    lines = [f"# Training benchmark: {result['config']} on {result['device']}", "",
             "Settings: " + ", ".join(f"{k}={v}" for k, v in result["settings"].items()), "",
             "Versions: " + ", ".join(f"{k} {v}" for k, v in result["versions"].items() if v), ""]
    peaks = result.get("matmul_peak_gflops")
    if peaks:
        short = {"bfloat16": "bf16", "float32": "fp32"}
        lines += ["Matmul peak measured in this run (GFLOP/s, best of 2048^3 and 4096x576x1536; MFU is "
                  "against the figure before the runs, in the dtype the base computes in; bf16 is measured "
                  "only where the CPU has it natively): " + "; ".join(
                      f"{when}: " + ", ".join(f"{short.get(d, d)} {v['gflops']:.0f}" for d, v in p.items())
                      for when, p in peaks.items()), ""]
    for mode, block in result["results"].items():
        source = block.get("mfu_peak", {})
        lines += [f"## packing {mode}", "",
                  *([f"MFU against {source['tflops'] * 1e3:.0f} GFLOP/s ({source['source']}).", ""]
                    if source.get("tflops") else []),
                  "| system | tokens/s | trained tokens/s | median step (s) | peak memory (MiB) | MFU | first losses |",
                  "|---|---|---|---|---|---|---|"]
        for system, s in block["systems"].items():
            mem = s.get("cuda_max_allocated_mib", s.get("peak_rss_mib"))
            mfu = f"{100 * s['mfu']:.1f}%" if "mfu" in s else "-"
            losses = ", ".join(f"{x:.4f}" for x in s["first_losses"])
            lines.append(f"| {system} | {s['tokens_per_s']:.1f} | {s['trained_tokens_per_s']:.1f} | "
                         f"{s['median_step_s']:.3f} | {mem:.0f} | {mfu} | {losses} |")
        for name, ratio in block.get("ratios", {}).items():
            lines.append(f"\n{name}: tokens/s x{ratio['tokens_per_s']:.2f}, peak memory x{ratio['memory']:.2f}, "
                         f"first-step loss difference {ratio['first_loss_abs_diff']:.2e}")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not any(o.startswith("method.init=") for o in args.set):
        # both systems from the same start: the baseline's LoRA starts at B = 0, and the qlora recipe's
        # method.init=auto would pick LoftQ for a small run (tunekit.methods.lora.start_choice)
        args.set = [*args.set, "method.init=default"]
    if args.child:
        print("BENCH_RESULT " + json.dumps(run_child(json.loads(args.child))), flush=True)
        return 0
    import torch

    gpu = CONFIGS[args.config]["llama"] is not None
    if gpu and not torch.cuda.is_available():
        print(f"bench_train: --config {args.config} needs a CUDA GPU and torch sees none "
              "(use --config cpu here)", file=sys.stderr)
        return 2
    if args.fork_runs and torch.cuda.is_available():
        print("bench_train: --fork-runs is for a CPU machine (CUDA does not survive a fork)", file=sys.stderr)
        return 2
    if "trl-liger" in args.systems:
        try:
            import liger_kernel.transformers  # noqa: F401
        except Exception as e:  # missing, or triton missing
            print(f"bench_train: skipping trl-liger: liger_kernel not importable ({type(e).__name__}: {e})")
            args.systems.remove("trl-liger")
    model = args.model or (random_llama(args.config, CONFIGS[args.config]["llama"]) if gpu else None)
    # The CPU's ceiling is measured here, before the runs and again after them (a drift between the
    # two means the machine was not quiet); a GPU's is its datasheet's dense bf16 figure. bf16 only
    # where the CPU has it natively: emulated, it runs orders of magnitude slower than fp32, takes
    # minutes per measurement and is no ceiling any run computes at.
    # and the dtype a --set model.dtype=... forces, so that its figure too comes from before the runs
    dtypes = tuple(dict.fromkeys([*peak_dtypes(gpu), *filter(None, [forced_dtype(args.set)])]))
    if args.fork_runs:
        prepare_forks(args.systems)

    def measure_peak(d: str) -> dict:
        return in_fork(matmul_peak, d, args.peak_reps) if args.fork_runs else matmul_peak(d, args.peak_reps)
    measured = {"before": {d: measure_peak(d) for d in dtypes}}
    print("matmul peak (GFLOP/s): " + ", ".join(f"{d} {v['gflops']:.0f}" for d, v in measured["before"].items()),
          flush=True)
    datasheet = args.peak_tflops or (next((v for k, v in PEAK_TFLOPS.items() if k in run_device()), None)
                                     if gpu else None)

    def peak_for(run: dict) -> tuple[float | None, str]:
        """MFU's denominator (TFLOP/s) for a run, and where it comes from."""
        if datasheet:
            return datasheet, "given" if args.peak_tflops else "datasheet dense bf16"
        d = run["compute_dtype"]
        if d in measured["before"]:
            return measured["before"][d]["gflops"] / 1e3, f"measured {d} matmul peak"
        # a dtype nothing above foresaw (a recipe's own default): measured now, between the runs, and filed so
        during = measured.setdefault("between runs", {})
        if d not in during:
            during[d] = measure_peak(d)
        return during[d]["gflops"] / 1e3, f"measured {d} matmul peak, between the runs"
    modes = ["off", "on"] if args.packing == "both" else [args.packing]
    result = {"config": args.config, "device": run_device(), "versions": installed(("torch", "transformers", "peft", "bitsandbytes", "trl", "tunekit", "liger-kernel")), "metric_notes": {
        "tokens_per_s": "non-padding input tokens per second over the steps after warmup, all reps",
        "peak_rss_mib": "process peak RSS (ru_maxrss) incl. model load; train_peak_rss_mib: VmHWM after setup",
        "loss": "mean token loss of each optimizer step over its response tokens"},
        "settings": {k: getattr(args, k) for k in ("steps", "reps", "warmup", "micro_batch_size", "grad_accum",
                                                    "seq_len", "recipe", "set", "baseline", "systems")}
        | {"model": model or "default (SmolLM2-135M-Instruct)", "data": args.data or "default"},
        "results": {}}
    for mode in modes:
        runs: dict[str, list[dict]] = {s: [] for s in args.systems}
        for rep in range(args.reps):
            for system in args.systems:
                spec = {"system": system, "recipe": args.recipe, "steps": args.steps, "seq_len": args.seq_len,
                        "micro_batch_size": args.micro_batch_size, "grad_accum": args.grad_accum,
                        "packing": mode == "on", "model": model, "data": args.data, "set": args.set,
                        "baseline": args.baseline}
                t0 = time.perf_counter()
                run = run_isolated(__file__, run_child, spec, args.fork_runs)
                if run is None:
                    print(f"bench_train: {system} (packing {mode}, rep {rep}) failed", file=sys.stderr)
                    return 1
                run["flops"] = [useful_flops(model or default_model(), run["trainable_params"], ls, c[1])
                                for ls, c in zip(run["lengths"], run["tokens"])]
                runs[system].append(run)
                med = statistics.median(run["step_times_s"][args.warmup:])
                print(f"packing {mode} rep {rep} {system}: median step {med:.3f} s, losses "
                      f"{[round(x, 4) for x in run['losses'][:3]]} ({time.perf_counter() - t0:.0f} s)", flush=True)
        peak, source = peak_for(next(iter(runs.values()))[0])
        block = {"runs": runs, "mfu_peak": {"tflops": peak, "source": source},
                 "systems": {s: summarize(r, args.warmup, peak) for s, r in runs.items()}}
        if "tunekit" in runs:
            tk = block["systems"]["tunekit"]
            mem_key = "cuda_max_allocated_mib" if "cuda_max_allocated_mib" in tk else "peak_rss_mib"
            block["ratios"] = {f"tunekit/{s}": {
                "tokens_per_s": tk["tokens_per_s"] / b["tokens_per_s"], "memory": tk[mem_key] / b[mem_key],
                "first_loss_abs_diff": abs(tk["first_losses"][0] - b["first_losses"][0]),
                "first_loss_rel_diff": abs(tk["first_losses"][0] - b["first_losses"][0]) / abs(b["first_losses"][0])}
                for s, b in block["systems"].items() if s != "tunekit"}
        result["results"][mode] = block
    every = {**measured["before"], **measured.get("between runs", {})}
    measured["after"] = {d: measure_peak(d) for d in every}
    result["matmul_peak_gflops"] = measured
    dev = re.sub(r"[^a-z0-9]+", "-", result["device"].lower().removeprefix("nvidia ")).strip("-") if gpu else "cpu"
    out = args.out or REPO / "benchmarks" / "training" / f"train-{dev}-{args.config}"
    write_result(out, result, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
