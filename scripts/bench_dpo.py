#!/usr/bin/env python
"""DPO over QLoRA: tunekit (`recipe=dpo`) vs TRL's DPOTrainer + peft + bitsandbytes, on the same batches.

Both systems train the same DPO run: same base and NF4 double-quant config (bnb compute dtype = the
run's compute dtype), LoRA r/alpha/dropout/targets (peft LoraConfig from tunekit's method node), beta,
optimizer, lr and schedule (tunekit's warmup + cosine, handed to TRL), gradient checkpointing (`auto`
resolved once, as `tunekit train` would), and reference: the base with the adapter switched off (TRL
does this itself for a peft model without ref_model; tunekit never loads a second base either). The
pairs are tokenized and cut to --seq-len once, by tunekit (tunekit.data.preference), and batched by
tunekit's BatchSchedule; TRL gets the same pairs in the same order and micro-batches (a sequential
sampler, `per_device_train_batch_size` = pairs per micro-batch, the same accumulation), collated in
its own layout (2N rows, chosen first, right-padded, `completion_mask` = the tokens tunekit trains).
Each side records what its model actually received (per micro-batch: its non-padding tokens, its
padded shape and a hash of every row's ids and trained mask); a ratio is only reported where the two
agree on every step. Step 1 must give ln 2 on both: the adapter starts at B = 0, so the policy is
the reference (checked and reported; see LN2_TOL for the GPU's fused kernel).

Every system x repetition runs in a fresh interpreter (order A B A B ...), so peak memory is per
system. Per system: tokens/s (chosen + rejected non-padding tokens of the timed steps, after --warmup,
over their time), median s/step, peak memory (GPU: CUDA max allocated; CPU: process peak RSS and the
training phase's VmHWM, also as growth over the RSS at its start), the first step's loss; and the
tunekit/trl ratios.

Pairs: the tweet-sentiment pairs of scripts/bench_preference.py (built the same way: benchlib's
pairs_from over scripts/build_task_data.py's rows), or --data (any file of preference pairs).

    python scripts/bench_dpo.py                          # CPU: SmolLM2-135M, 2 pairs x 2 accumulation, 128 tokens
    python scripts/bench_dpo.py --config gpu             # random-init Llama ~1B on a GPU
    python scripts/bench_dpo.py --steps 2 --warmup 1 --reps 1 --model TINY --data pairs.jsonl --out /tmp/x

Writes benchmarks/preference/dpo-vs-trl-<device>-<date>.md and .json (or --out).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

from benchlib import (LLAMA_1B, TRL_OPTIM, build_cfg, hf_base, memory, ordered_trainer, pairs_from, peft_lora,
                      random_llama, rss_kib, run_device, run_isolated, step_clock, step_examples, timed_steps,
                      versions, write_result)

REPO = Path(__file__).resolve().parents[1]
SYSTEMS = ("tunekit", "trl")
LN2 = math.log(2)
# Step 1: where policy and reference run the same ops (B = 0 adds exactly 0.0 to every projection),
# each pair's d = (c - c_ref) - (r - r_ref) is 0 and its loss -log sigmoid(0) = ln 2, rounded once
# to fp32 (ulp 6e-8 at 0.69), then averaged over <= 64 pairs (each add rounds once more: < 64 ulp =
# 4e-6). A reference that is not the policy moves each summed log-probability by at least ~1e-2 (a
# few tokens' bf16 rounding of logits ~10), and the loss by beta * |d| / 2 >= 5e-4 at beta 0.1.
# On a GPU, tunekit's fused kernel (kernels.fused_lora) computes the policy's projections while the
# reference, adapter off, runs peft's bitsandbytes path: bf16 rounding then differs between the two
# passes and can move the loss past this bound, so the check is reported, not a reason to refuse
# the ratios (--set kernels.fused_lora=off runs the same ops in both passes).
LN2_TOL = 1e-4
CONFIGS = {
    "cpu": dict(pairs=2, grad_accum=2, seq_len=128, steps=6, warmup=2, reps=2, llama=None),
    "gpu": dict(pairs=16, grad_accum=2, seq_len=512, steps=20, warmup=3, reps=3, llama=LLAMA_1B),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", choices=list(CONFIGS), default="cpu")
    p.add_argument("--steps", type=int, help="optimizer steps per run, warm-up included (default per config)")
    p.add_argument("--warmup", type=int, help="first steps left out of the timing (default per config)")
    p.add_argument("--reps", type=int, help="repetitions per system, alternating (default per config)")
    p.add_argument("--pairs", type=int, help="pairs per micro-batch (trainer.micro_batch_size; 2N rows)")
    p.add_argument("--grad-accum", type=int)
    p.add_argument("--seq-len", type=int, help="data.max_seq_len: both sides of a pair are cut to it, once")
    p.add_argument("--model", help="model folder (default: the embedded default model; --config gpu: a random 1B)")
    p.add_argument("--data", help="a file of preference pairs (default: tweet-sentiment pairs, built in --work)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra tunekit override")
    p.add_argument("--work", type=Path, default=REPO / "runs" / "bench-dpo", help="where the default pairs go")
    p.add_argument("--out", type=Path, help="output path without suffix")
    p.add_argument("--note", default="Times are disturbed by whatever else ran (above); memory is per process.",
                   help="what the result's page says about the machine's state")
    p.add_argument("--in-process", action="store_true", help=argparse.SUPPRESS)  # the test: no memory figures
    p.add_argument("--child", help=argparse.SUPPRESS)  # one run, as JSON
    args = p.parse_args(argv)
    for key, value in CONFIGS[args.config].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if not 0 <= args.warmup < args.steps:
        p.error(f"--warmup {args.warmup} must be >= 0 and < --steps {args.steps}")
    return args


# ---------------------------------------------------------------------------- what a model received
def batch_digest(input_ids, attention_mask, trained) -> dict:
    """One micro-batch as its model receives it: non-padding tokens, padded shape, and a hash of each
    row's tokens and which of them the loss counts (rows in order, chosen sides first)."""
    h = hashlib.sha256()
    for ids, keep, mask in zip(input_ids.tolist(), attention_mask.tolist(), trained.tolist()):
        h.update(json.dumps([[i for i, k in zip(ids, keep) if k], [int(m) for m, k in zip(mask, keep) if k]]).encode())
    return {"tokens": int(attention_mask.sum()), "shape": list(input_ids.shape), "sha256": h.hexdigest()[:16]}


def per_step(seen: list[dict], grad_accum: int, steps: int) -> list[list[dict]]:
    return [seen[s * grad_accum:(s + 1) * grad_accum] for s in range(steps)]


# ---------------------------------------------------------------------------- system: tunekit
def run_tunekit(cfg, out_dir: str) -> dict:
    from tunekit.train.loop import TrainRecipe

    r = TrainRecipe(cfg, Path(out_dir))
    r.setup()
    seen, collate = [], r.collate

    def recording(examples, pad_id):  # the micro-batches train_step collates, as they go to the model
        batch = collate(examples, pad_id)
        seen.append(batch_digest(batch["input_ids"], batch["attention_mask"], batch["labels"] != -100))
        return batch

    r.collate = recording
    t = cfg.trainer
    timed = timed_steps(r, t.max_steps)
    r.tracker.close()
    rows = timed["rows"]
    return {"step_times_s": timed["step_times_s"], "losses": [row["loss"] for row in rows],
            "seen": per_step(seen, t.grad_accum, t.max_steps), "own_token_counts": [row["input_tokens"] for row in rows],
            "start_rss_mib": timed["start_rss_mib"], "adapter_dtype": str(r.params[0].dtype),
            "compute_dtype": str(r.dtype).removeprefix("torch."), "optimizer": type(r.optimizer).__name__,
            "trainable_params": r.trainable_params}


# ---------------------------------------------------------------------------- system: TRL
def trl_collator(pad_id: int, seen: list):
    """TRL's DataCollatorForPreference layout (2N rows, chosen first, right-padded; input_ids,
    attention_mask, completion_mask) from tunekit's tokenized pairs, the completion mask being the
    tokens tunekit trains (a chat template's text after the end-of-turn token is not trained)."""
    import torch

    def collate(examples: list[dict]) -> dict:
        sides = [(e["input_ids"], e["labels"]) for e in examples]
        sides += [(e["rejected_input_ids"], e["rejected_labels"]) for e in examples]
        width = max(len(ids) for ids, _ in sides)
        out = {"input_ids": torch.full((len(sides), width), pad_id, dtype=torch.long),
               "attention_mask": torch.zeros((len(sides), width), dtype=torch.long),
               "completion_mask": torch.zeros((len(sides), width), dtype=torch.long)}
        for row, (ids, labels) in enumerate(sides):
            out["input_ids"][row, :len(ids)] = torch.tensor(ids)
            out["attention_mask"][row, :len(ids)] = 1
            out["completion_mask"][row, :len(ids)] = torch.tensor([int(x != -100) for x in labels])
        seen.append(batch_digest(out["input_ids"], out["attention_mask"], out["completion_mask"]))
        return out

    return collate


def run_trl(cfg, out_dir: str) -> dict:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import DPOConfig, DPOTrainer

    from tunekit.config import plain
    from tunekit.data import BatchSchedule
    from tunekit.data.preference import example_length, load_preference_splits
    from tunekit.model import load_tokenizer, resolve_model_path

    t, d = cfg.trainer, cfg.data
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    path = resolve_model_path(cfg.model.path)
    tok = load_tokenizer(path)
    train, _, kind, _ = load_preference_splits(d.path, d.val_path, tok, d.max_seq_len, d.val_fraction,
                                               d.max_val_examples, cfg.seed)
    if kind != "pairs":
        raise SystemExit(f"bench_dpo: {d.path} holds {kind} rows; DPO needs preference pairs")
    schedule = BatchSchedule([example_length(e) for e in train], t.micro_batch_size, t.grad_accum, 1, 0, cfg.seed,
                             min_padding=True)  # as tunekit's trainer builds it for unpacked rows
    keys = ("input_ids", "labels", "rejected_input_ids", "rejected_labels")
    rows = [{k: e[k] for k in keys} for s in range(t.max_steps) for mb in step_examples(train, schedule, s) for e in mb]
    model, dtype, _ = hf_base(cfg, path, device)
    gc = bool(cfg.model.gradient_checkpointing)
    args = DPOConfig(
        output_dir=out_dir, max_steps=t.max_steps, per_device_train_batch_size=t.micro_batch_size,
        gradient_accumulation_steps=t.grad_accum, learning_rate=t.lr, weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm, optim=TRL_OPTIM[plain(t.optimizer)], seed=cfg.seed, data_seed=cfg.seed,
        gradient_checkpointing=gc, gradient_checkpointing_kwargs={"use_reentrant": False},
        bf16=dtype == torch.bfloat16, fp16=False, use_cpu=device.type == "cpu",  # bf16 autocast where bf16
        beta=cfg.preference.beta, loss_type=["sigmoid"], label_smoothing=0.0, precompute_ref_log_probs=False,
        max_length=None, remove_unused_columns=False, disable_dropout=False,  # tunekit keeps method.dropout
        logging_strategy="no", save_strategy="no", eval_strategy="no", report_to="none", disable_tqdm=True)
    record, seen = {"times": [], "losses": [], "micro": []}, []

    class Tokenized(ordered_trainer(DPOTrainer, t.warmup_steps, t.max_steps, record)):
        def _prepare_dataset(self, dataset, *a, **kw):  # tokenized and cut by tunekit already
            return dataset

    class StartRss(TrainerCallback):
        def on_train_begin(self, *a, **kw):  # after step_clock's peak reset
            record["start_rss_mib"] = rss_kib() / 1024

    trainer = Tokenized(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok,
                        data_collator=trl_collator(tok.pad_token_id, seen), peft_config=peft_lora(cfg.method),
                        callbacks=[step_clock(record), StartRss()])
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    trainer.train()
    return {"step_times_s": record["times"], "losses": record["losses"],
            "seen": per_step(seen, t.grad_accum, t.max_steps), "start_rss_mib": record["start_rss_mib"],
            "adapter_dtype": str(params[0].dtype), "compute_dtype": str(dtype).removeprefix("torch."),
            "optimizer": type(getattr(trainer.optimizer, "optimizer", trainer.optimizer)).__name__,
            "trainable_params": sum(p.numel() for p in params)}


def run_child(spec: dict) -> dict:
    import logging
    import warnings

    out_dir = tempfile.mkdtemp(prefix="bench-dpo-")
    logging.disable(logging.WARNING)  # restored after: --in-process runs inside a test's process
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cfg = build_cfg(spec, out_dir)
            result = (run_tunekit if spec["system"] == "tunekit" else run_trl)(cfg, out_dir)
    finally:
        logging.disable(logging.NOTSET)
        shutil.rmtree(out_dir, ignore_errors=True)
    return {**result, **memory(), "auto_resolved": cfg.auto_resolved}


# ---------------------------------------------------------------------------- parent
def tweet_pairs(work: Path) -> str:
    """bench_preference's tweet-sentiment training pairs (its defaults: 200 tweets per class, seed 0)."""
    from build_task_data import build

    path = work / "pairs" / "train.jsonl"
    if not path.is_file():
        src = build(work / "task", 200, 50, seed=0)
        rows = [json.loads(x) for x in Path(src["train_path"]).read_text().splitlines()]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in pairs_from(rows, 0)))
    return str(path)


def busy_processes() -> list[str]:
    """What else was running: the processes using the most CPU (name and %CPU, not their arguments)."""
    try:
        out = subprocess.run(["ps", "-eo", "pcpu,comm", "--sort=-pcpu", "--no-headers"], capture_output=True,
                             text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [" ".join(line.split()) for line in out.splitlines()[:6]]


def machine_load() -> dict:
    return {"loadavg_1_5_15": list(os.getloadavg()), "cpus": os.cpu_count(), "busiest": busy_processes()}


def summarize(runs: list[dict], warmup: int) -> dict:
    times = [x for r in runs for x in r["step_times_s"][warmup:]]
    tokens = sum(mb["tokens"] for r in runs for step in r["seen"][warmup:] for mb in step)
    s = {"tokens_per_s": tokens / sum(times), "median_step_s": statistics.median(times),
         "timed_tokens": tokens, "tokens_per_run": sum(mb["tokens"] for step in runs[0]["seen"] for mb in step),
         "first_loss": runs[0]["losses"][0], "first_losses_each_rep": [r["losses"][0] for r in runs],
         "losses": runs[0]["losses"], "adapter_dtype": runs[0]["adapter_dtype"],
         "compute_dtype": runs[0]["compute_dtype"], "optimizer": runs[0]["optimizer"],
         "trainable_params": runs[0]["trainable_params"]}
    for key in ("peak_rss_mib", "train_peak_rss_mib", "cuda_max_allocated_mib", "cuda_max_reserved_mib"):
        if key in runs[0]:
            s[key] = max(r[key] for r in runs)
    if "train_peak_rss_mib" in runs[0]:
        s["train_rss_growth_mib"] = max(r["train_peak_rss_mib"] - r["start_rss_mib"] for r in runs)
    return s


def same_tokens(runs: dict[str, list[dict]]) -> str | None:
    """None where every run of every system received the same micro-batches; else what differs."""
    (first, ref), *_ = ((s, rs[0]) for s, rs in runs.items())
    for system, rs in runs.items():
        for rep, run in enumerate(rs):
            if len(run["seen"]) != len(ref["seen"]):
                return f"{system} rep {rep} ran {len(run['seen'])} steps, {first} rep 0 {len(ref['seen'])}"
            for step, (a, b) in enumerate(zip(run["seen"], ref["seen"])):
                if a != b:
                    return (f"step {step + 1}: {system} rep {rep} received {sum(m['tokens'] for m in a)} tokens "
                            f"({[m['sha256'] for m in a]}), {first} rep 0 {sum(m['tokens'] for m in b)} "
                            f"({[m['sha256'] for m in b]})")
    return None


def compare(runs: dict[str, list[dict]], warmup: int) -> dict:
    """Per-system figures, the checks, and the tunekit/trl ratios where both checks pass."""
    systems = {s: summarize(r, warmup) for s, r in runs.items()}
    for own in runs.get("tunekit", []):  # tunekit's own count agrees with what its model received
        if own["own_token_counts"] != [sum(m["tokens"] for m in step) for step in own["seen"]]:
            raise SystemExit("bench_dpo: tunekit's input_tokens differ from the micro-batches it collated")
    checks = {"tokens": same_tokens(runs),
              "first_loss_ln2": next((f"{s}: first loss {x:.6f} is not ln 2 = {LN2:.6f} (tolerance {LN2_TOL})"
                                      for s, v in systems.items() for x in v["first_losses_each_rep"]
                                      if abs(x - LN2) > LN2_TOL), None)}
    block = {"systems": systems, "checks": {k: v or "ok" for k, v in checks.items()}}
    if "tunekit" in systems and "trl" in systems:
        tk, b = systems["tunekit"], systems["trl"]
        diff = {"first_loss_rel_diff": abs(tk["first_loss"] - b["first_loss"]) / abs(b["first_loss"])}
        if checks["tokens"]:  # the two did not run the same work: no ratio
            block["ratios"] = {"refused": checks["tokens"], **diff}
        else:
            mem = "cuda_max_allocated_mib" if "cuda_max_allocated_mib" in tk else "peak_rss_mib"
            block["ratios"] = {"tokens_per_s": tk["tokens_per_s"] / b["tokens_per_s"],
                               "s_per_step": tk["median_step_s"] / b["median_step_s"],
                               "memory": tk[mem] / b[mem], "memory_metric": mem, **diff}
            if mem == "peak_rss_mib":
                block["ratios"]["train_rss_growth"] = tk["train_rss_growth_mib"] / b["train_rss_growth_mib"]
    return block


def markdown(result: dict) -> str:
    st, block = result["settings"], result["results"]
    lines = [f"# DPO over QLoRA: tunekit vs TRL DPOTrainer ({result['date']}, {result['device']})", "",
             f"Command: `{result['command']}`", "",
             "Versions: " + ", ".join(f"{k} {v}" for k, v in result["versions"].items() if v), "",
             f"Model: {st['model']}. Pairs: {st['data']}. {st['pairs']} pairs (= {2 * st['pairs']} rows) per "
             f"micro-batch x {st['grad_accum']} accumulation, data.max_seq_len {st['seq_len']}, {st['steps']} steps "
             f"the first {st['warmup']} not timed, {st['reps']} repetition(s) alternating the systems, "
             f"each in a fresh process. Overrides: {st['set'] or 'none'}.", "",
             "Machine while it ran (load average over 1/5/15 min; the busiest processes by ps's %CPU, their CPU "
             "time over their lifetime): "
             + "; ".join(f"{when}: {', '.join(f'{x:.1f}' for x in v['loadavg_1_5_15'])} on {v['cpus']} CPUs, "
                         f"{', '.join(v['busiest'])}" for when, v in result["machine_load"].items())
             + f". {result['note']}", "",
             "| system | tokens/s | median s/step | peak memory (MiB) | training-phase growth (MiB) | first loss | "
             "adapter / compute dtype |", "|---|---|---|---|---|---|---|"]
    for system, s in block["systems"].items():
        mem = s.get("cuda_max_allocated_mib", s.get("peak_rss_mib"))
        growth = s.get("train_rss_growth_mib")
        lines.append(f"| {system} | {s['tokens_per_s']:.1f} | {s['median_step_s']:.3f} | {mem:.0f} | "
                     f"{'-' if growth is None else f'{growth:.0f}'} | {s['first_loss']:.6f} | "
                     f"{s['adapter_dtype'].removeprefix('torch.')} / {s['compute_dtype']} |")
    lines += ["", "Tokens each system ran (chosen + rejected, no padding): " + ", ".join(
        f"{s}: {v['tokens_per_run']} per run, {v['timed_tokens']} timed" for s, v in block["systems"].items())
        + f". Same micro-batches on both: {block['checks']['tokens']}. "
        f"First loss ln 2 = {LN2:.6f} on both within {LN2_TOL}: {block['checks']['first_loss_ln2']}.", ""]
    r = block.get("ratios")
    if r and "refused" in r:
        lines.append(f"No ratio: {r['refused']}.")
    elif r:
        lines.append(f"tunekit/trl: tokens/s x{r['tokens_per_s']:.2f}, s/step x{r['s_per_step']:.2f}, peak memory "
                     f"x{r['memory']:.2f} ({r['memory_metric']})" + (f", training-phase growth x{r['train_rss_growth']:.2f}"
                     if "train_rss_growth" in r else "") + f"; first-loss relative difference {r['first_loss_rel_diff']:.1e}.")
    return "\n".join(lines + [""])


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        print("BENCH_RESULT " + json.dumps(run_child(json.loads(args.child))), flush=True)
        return 0
    import torch

    gpu = CONFIGS[args.config]["llama"] is not None
    if gpu and not torch.cuda.is_available():
        print(f"bench_dpo: --config {args.config} needs a CUDA GPU and torch sees none (use --config cpu here)",
              file=sys.stderr)
        return 2
    model = args.model or (random_llama("gpu-1b", LLAMA_1B) if gpu else None)
    data = args.data or tweet_pairs(args.work)
    sets = [*args.set] if any(s.startswith("method.init=") for s in args.set) else [*args.set, "method.init=default"]
    load = {"before": machine_load()}
    runs: dict[str, list[dict]] = {s: [] for s in SYSTEMS}
    for rep in range(args.reps):
        for system in SYSTEMS:
            spec = {"system": system, "recipe": "dpo", "steps": args.steps, "seq_len": args.seq_len,
                    "micro_batch_size": args.pairs, "grad_accum": args.grad_accum, "packing": False,
                    "model": model, "data": data, "set": sets}
            t0 = time.perf_counter()
            run = run_child(spec) if args.in_process else run_isolated(__file__, run_child, spec, fork=False)
            if run is None:
                print(f"bench_dpo: {system} (rep {rep}) failed", file=sys.stderr)
                return 1
            runs[system].append(run)
            print(f"rep {rep} {system}: median step {statistics.median(run['step_times_s'][args.warmup:]):.3f} s, "
                  f"losses {[round(x, 6) for x in run['losses'][:3]]} ({time.perf_counter() - t0:.0f} s)", flush=True)
    load["after"] = machine_load()
    today = date.today().isoformat()
    dev = re.sub(r"[^a-z0-9]+", "-", run_device().lower().removeprefix("nvidia ")).strip("-") if gpu else "cpu"
    result = {"date": today, "device": run_device(), "command": " ".join(["python", "scripts/bench_dpo.py", *(
        sys.argv[1:] if argv is None else argv)]), "versions": versions(("torch", "transformers", "peft",
                                                                           "bitsandbytes", "trl", "tunekit")),
              "machine_load": load, "note": "in-process (a test): memory figures mean nothing" if args.in_process
              else args.note,
              "settings": {k: getattr(args, k) for k in ("config", "steps", "warmup", "reps", "pairs", "grad_accum",
                                                         "seq_len")}
              | {"set": sets, "model": model or "default (SmolLM2-135M-Instruct)",
                 "data": data if args.data else "tweet-sentiment pairs (bench_preference's 600 training pairs, data.val_fraction held out)"},
              "results": compare(runs, args.warmup), "runs": runs}
    out = args.out or REPO / "benchmarks" / "preference" / f"dpo-vs-trl-{dev}-{today}"
    write_result(out, result, markdown)
    return 0 if "refused" not in result["results"].get("ratios", {}) else 3


if __name__ == "__main__":
    sys.exit(main())
