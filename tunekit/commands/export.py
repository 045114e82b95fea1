"""`tunekit export RUN_DIR --format adapter|merged|gguf|gguf-adapter --out PATH`: ship a trained run, checked.

Every export is rebuilt fresh from RUN_DIR (config.yaml + adapter/), written into a hidden temp
folder beside PATH, reloaded from there by the program that will consume it (peft, transformers,
llama.cpp) and measured against the trained model on the run's held-out batches: how much of
the fine-tune's held-out gain it keeps (tunekit.export.fidelity, .gate). Only an export that keeps
enough of it (or --force) is renamed into place, with its fidelity report beside it:

    adapter   PATH/ : method.save() output + tokenizer + fidelity.json (peft loads LoRA / prompt tuning)
    merged    PATH/ : standalone HF folder (safetensors, config, generation config, tokenizer) + fidelity.json
              with --requantize nf4: the merged weights in NF4 + double quant (bitsandbytes); a LoRA run
              is merged tensor by tensor from the base's files as it is written (tunekit.export.stream)
    gguf      PATH  : one GGUF file (Llama architecture) + PATH.fidelity.json; f16/bf16/f32 written by
              tunekit, Q8_0 / Q6_K / Q5_K_M / Q4_K_M by llama.cpp's quantizer; checked by llama.cpp
    gguf-adapter PATH : a LoRA as llama.cpp's LoRA adapter GGUF (applied over the base's own GGUF, unmerged)
              + PATH.fidelity.json; f32 (or f16); checked by llama.cpp over an f16 GGUF of the base it trained on

Without --dtype, the narrowest dtype that keeps the gain is chosen (merged: bf16, fp16, fp32;
gguf: f16, f32; gguf-adapter: f32) and the report says which and why. Existing PATH: a previous tunekit export
there (recognised by its fidelity report) is replaced only once the new export has passed;
anything else at PATH is never touched (error).
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path
from typing import Optional

from tunekit import TunekitError
from tunekit.checks import number
from tunekit.commands.parse import Parser, add_device_argument
from tunekit.export import gguf_adapter
from tunekit.export.gate import KL_ADAPTER, MIN_GAIN_KEPT, MIN_GAIN_KEPT_LOSSY, TASK_MIN_GAIN_KEPT, TASK_MIN_GAIN_KEPT_LOSSY
from tunekit.export.job import Export, gguf_name
from tunekit.export.task import DEFAULT_TASK_ROWS
from tunekit.export.writing import check_out, report_path
from tunekit.infer import llamacpp
from tunekit.runs.open import open_source
from tunekit.device.facts import command_facts, cpuinfo_text

log = logging.getLogger("tunekit")
FORMATS = ("adapter", "merged", "gguf", "gguf-adapter")
FLOAT_DTYPES = ("bf16", "fp16", "fp32")
ALIASES = {"f16": "fp16", "f32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}
# Narrowest first. merged: bf16 is the base's own dtype; gguf: f16 is llama.cpp's usual float
# type (every backend runs it) and keeps 3 more significand bits than bf16.
AUTO_ORDER = {"merged": ("bf16", "fp16", "fp32"), "gguf": ("fp16", "fp32"), "gguf-adapter": ("fp32",)}
# gguf-adapter: f32 by default, f16 on request, nothing narrower. The LoRA tensors are r * (in + out)
# per adapted matrix (~1% of SmolLM2-135M at r=16), so halving them saves little, while ggml multiplies
# an f16 tensor by activations rounded to f16: x for lora_a, then A x for lora_b, two more roundings
# of the fine-tune's update than an f32 file gets. bf16 (8 significand bits) would round far more.
ADAPTER_GGUF_DTYPES = ("fp32", "fp16")
MERGE_TARGETS = ("dequantized", "original")
# Over a 4-bit base the default merge is into the dequantized NF4 weights the adapter trained
# against: that reproduces the model `tunekit eval` scored (KL 7e-4 in f16 on the default run).
# Merged into the original high-precision weights instead, the default run's held-out perplexity
# even improves (8.37 vs 9.51 trained: SmolLM2-135M loses much to NF4), but it is another model:
# on the tweet-sentiment task 23 of 150 answers changed (benchmarks/export/deploy-tweet-sentiment-*.md).
# A user who evaluated one model must get that model unless they ask for the other; the task
# check reports what `--merge-into original` trades.
DEFAULT_MERGE_INTO = "dequantized"


def _dtypes(fmt: str, dtype: Optional[str], requantize: Optional[str]) -> tuple[str, ...]:
    """The dtypes to try, in order (one unless --dtype is auto / left out)."""
    if dtype is None or dtype.lower() == "auto":
        if fmt == "adapter":
            return (None,)
        return ("bf16",) if requantize else AUTO_ORDER[fmt]
    if fmt == "adapter":
        raise TunekitError("--dtype applies to --format merged and gguf (an adapter is saved as trained)")
    d = ALIASES.get(dtype.lower(), dtype.lower())
    allowed = FLOAT_DTYPES + (tuple(llamacpp.QUANT_TYPES) if fmt == "gguf" and not requantize else ())
    if fmt == "gguf-adapter":
        allowed = ADAPTER_GGUF_DTYPES
    if d not in allowed:
        names = ", ".join(["auto", *FLOAT_DTYPES] + ([llamacpp.QUANT_TYPES[q][1] for q in llamacpp.QUANT_TYPES]
                                                       if fmt == "gguf" else []))
        if fmt == "gguf-adapter":
            names = "auto (f32), f32, f16"
        raise TunekitError(f"--dtype: {dtype!r} is not a dtype of --format {fmt}; choose one of {names}")
    return (d,)


def merge_target(src, merge_into: Optional[str]) -> str:
    if merge_into is not None and merge_into not in MERGE_TARGETS:
        raise TunekitError(f"--merge-into: unknown {merge_into!r}; choose dequantized or original")
    if src.quantize != "nf4":
        return "original"  # the run trained over the high-precision weights: there is only one target
    return merge_into or DEFAULT_MERGE_INTO


def _check_arguments(fmt: str, requantize: Optional[str], merge_into: Optional[str], eval_batches: int,
                     min_gain: Optional[float], min_task_gain: Optional[float], task_rows: int, data: Optional[str],
                     kl_threshold: Optional[float] = None) -> None:
    """One TunekitError for the first argument that cannot work, before anything is read."""
    if fmt not in FORMATS:
        raise TunekitError(f"--format: unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if requantize not in (None, "nf4"):
        raise TunekitError(f"--requantize: unknown {requantize!r}; only nf4")
    if requantize and fmt != "merged":
        raise TunekitError("--requantize nf4 applies to --format merged only")
    if merge_into is not None and fmt in ("adapter", "gguf-adapter"):
        raise TunekitError("--merge-into applies to --format merged and gguf (an adapter is not merged)")
    if eval_batches < 1:
        raise TunekitError(f"--eval-batches: must be >= 1, got {eval_batches}")
    # fractions of a gain (0.9 keeps 90%; above 1, an export that must beat the trained model); a KL in
    # nats per token. NaN or inf would pass or refuse every export whatever it kept.
    for option, value, bounds in (("--min-gain", min_gain, dict(ge=0, le=1.5)),
                                  ("--min-task-gain", min_task_gain, dict(ge=0, le=1.5)),
                                  ("--kl-threshold", kl_threshold, dict(ge=0, unit="nats/token"))):
        if value is not None:
            number(option, value, **bounds)
    if task_rows < 0:
        raise TunekitError(f"--task-rows: must be >= 0, got {task_rows}")
    if data is not None and not Path(data).expanduser().is_file():
        raise TunekitError(f"--data: file not found: {data}")


def _refuse_early(src, fmt: str, candidates: tuple) -> tuple[Optional[str], bool]:
    """What this run cannot export in this format, refused before anything loads; else (the program
    that checks the export, whether llama.cpp may repack its weights)."""
    if fmt in ("adapter", "gguf-adapter") and src.start is not None:
        raise TunekitError(f"--format {fmt}: {src.run.run_dir} trained a new adapter over the frozen start adapter "
                           f"{src.start.given} (model.adapter), and its adapter alone is not the trained model; use "
                           "--format merged or gguf (both adapters merged into the base)")
    if fmt == "gguf-adapter":  # what llama.cpp cannot apply, and llama.cpp itself
        gguf_adapter.refuse_early(src)
        why = llamacpp.unavailable()
        if why:  # no other program applies a LoRA GGUF as llama.cpp does: there would be no check
            raise TunekitError(f"--format gguf-adapter is checked by llama.cpp, which is not available: {why}; "
                               "bash scripts/setup.sh builds it")
    if fmt != "adapter" and not src.method_impl.can_merge:
        from tunekit.methods import cannot_merge

        raise cannot_merge(src.method)
    if fmt == "adapter" and not (src.adapter_dir / "adapter_config.json").is_file():
        # a full fine-tune saved a whole model folder: there is no adapter to ship apart from it
        raise TunekitError(f"--format adapter: {src.run.run_dir} trained every weight (method {src.method!r}), so its "
                           "trained part is a whole model; use --format merged or gguf")
    if fmt == "gguf":
        why = llamacpp.unavailable()
        if why and candidates[0] in llamacpp.QUANT_TYPES:
            raise TunekitError(f"--dtype {gguf_name(candidates[0])} needs llama.cpp's quantizer: {why}; "
                               "bash scripts/setup.sh builds it")
        if why:
            log.warning("%s: checking the GGUF with transformers' reader instead of llama.cpp", why)
        repack, repack_why = llamacpp.weight_repacking(cpuinfo_text())
        if why:
            return "transformers' GGUF reader (llama.cpp not available)", repack
        return llamacpp.version() + ("" if repack else f" ({repack_why})"), repack
    if fmt == "gguf-adapter":
        repack, repack_why = llamacpp.weight_repacking(cpuinfo_text())
        return llamacpp.version() + ", adapter applied over an f16 GGUF of its base" + (
            "" if repack else f" ({repack_why})"), repack
    return {"adapter": "peft / tunekit", "merged": "transformers"}[fmt], False


def export(run_dir: str | Path, fmt: str, out: str | Path, dtype: Optional[str] = None, requantize: Optional[str] = None,
           force: bool = False, kl_threshold: Optional[float] = None, eval_batches: int = 4,
           merge_into: Optional[str] = None, min_gain: Optional[float] = None, device: Optional[str] = None,
           data: Optional[str] = None, task_rows: int = DEFAULT_TASK_ROWS, min_task_gain: Optional[float] = None) -> dict:
    """Export a finished run; returns the fidelity report (also written beside the export).
    device: where the models load and the check computes (tunekit.device.facts.command_device; None:
    the first GPU, else the CPU). llama.cpp's check runs on the CPU either way. data / task_rows:
    the held-out rows of the task check (tunekit.export.task; default the run's held-out split,
    task_rows=0 skips it)."""
    started = time.time()
    _check_arguments(fmt, requantize, merge_into, eval_batches, min_gain, min_task_gain, task_rows, data, kl_threshold)
    candidates = _dtypes(fmt, dtype, requantize)
    facts = command_facts(device)
    src = open_source(run_dir, what="RUN_DIR", facts=facts, runs_only=True)
    out = Path(out).expanduser().absolute()
    check_out(fmt, out, src.run.run_dir.absolute())
    checked_by, repack = _refuse_early(src, fmt, candidates)
    target = merge_target(src, merge_into) if fmt not in ("adapter", "gguf-adapter") else None
    job = Export(src, fmt, out, candidates, target, checked_by, repack, started,
                  dict(dtype=dtype, requantize=requantize, merge_into=merge_into, force=force, kl_threshold=kl_threshold,
                       min_gain=min_gain, min_task_gain=min_task_gain))
    job.open(eval_batches, data, task_rows)
    job.reference_figures()

    def build(tmp: Path) -> dict:  # in the temp folder that place renames into --out
        for candidate in job.candidates_in(tmp):  # in turn, until one passes the gate
            job.write(tmp, candidate)
            with job.reload(tmp) as exported:
                job.gate(candidate, job.check(exported), exported)
        return job.conclude(tmp)

    return job.place(build)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="tunekit export", description=__doc__.split("\n\n")[1],
                formatter_class=argparse.RawDescriptionHelpFormatter,
                epilog="examples:\n"
                       "  tunekit export runs/x --format adapter --out exports/x-adapter\n"
                       "  tunekit export runs/x --format merged --out exports/x-merged            # bf16 unless it loses the gain\n"
                       "  tunekit export runs/x --format merged --merge-into original --out exports/x-orig\n"
                       "  tunekit export runs/x --format merged --requantize nf4 --out exports/x-nf4\n"
                       "  tunekit export runs/x --format gguf --out exports/x.gguf                # f16, checked by llama.cpp\n"
                       "  tunekit export runs/x --format gguf --dtype Q4_K_M --out exports/x-q4km.gguf\n"
                       "  tunekit export runs/x --format gguf-adapter --out exports/x-lora.gguf   # llama-cli -m base.gguf --lora x-lora.gguf")
    p.add_argument("run_dir", metavar="RUN_DIR", help="output_dir of a finished `tunekit train` run")
    p.add_argument("--format", required=True, choices=FORMATS, help="what to write")
    p.add_argument("--out", required=True, metavar="PATH", help="folder (adapter, merged) or .gguf file to write")
    p.add_argument("--dtype", metavar="D",
                   help="stored dtype. merged: auto (default: bf16, else fp16, else fp32, the narrowest that keeps "
                        "the gain), bf16, fp16, fp32. gguf: auto (f16, else f32), bf16, f16, f32, or a llama.cpp "
                        "quantized type: Q8_0, Q6_K, Q5_K_M, Q4_K_M. gguf-adapter: f32 (default), f16")
    p.add_argument("--merge-into", choices=MERGE_TARGETS,
                   help="over a 4-bit base: add the fine-tune to the dequantized NF4 weights it trained against, or "
                        f"to the base's original high-precision weights (default {DEFAULT_MERGE_INTO})")
    p.add_argument("--requantize", choices=("nf4",), help="merged only: re-quantize the merged weights to NF4 + double quant")
    p.add_argument("--min-gain", type=float, metavar="F",
                   help=f"refuse an export that keeps less than this fraction of the fine-tune's held-out gain "
                        f"(default {MIN_GAIN_KEPT}; {MIN_GAIN_KEPT_LOSSY} for Q5_K_M, Q4_K_M and --requantize nf4)")
    p.add_argument("--kl-threshold", type=float, metavar="X",
                   help="also refuse above this mean KL(trained||exported), nats/token (adapters: default "
                        f"{KL_ADAPTER:g}, they reload exactly)")
    p.add_argument("--min-task-gain", type=float, metavar="F",
                   help=f"refuse an export that keeps less than this fraction of the trained model's task gain "
                        f"(accuracy or exact match over the base, on held-out rows with answers; default "
                        f"{TASK_MIN_GAIN_KEPT}, {TASK_MIN_GAIN_KEPT_LOSSY} for the lossy types)")
    p.add_argument("--data", metavar="FILE", help="held-out rows for the task check (any file `tunekit train` reads; "
                                                  "default: the run's held-out split)")
    p.add_argument("--task-rows", type=int, default=DEFAULT_TASK_ROWS, metavar="N",
                   help=f"held-out rows the task check scores (default {DEFAULT_TASK_ROWS}; 0 skips it)")
    p.add_argument("--force", action="store_true", help="write the export even when the gate refuses it")
    p.add_argument("--eval-batches", type=int, default=4, metavar="N",
                   help="held-out batches (of trainer.micro_batch_size) to measure fidelity on (default 4)")
    add_device_argument(p)
    return p


def main(argv: list[str]) -> None:
    args = build_parser().parse_args(argv)
    logging.getLogger("gguf").setLevel(logging.WARNING)  # its per-file "Writing the following files" lines
    report = export(args.run_dir, args.format, args.out, args.dtype, args.requantize, args.force,
                    args.kl_threshold, args.eval_batches, args.merge_into, args.min_gain, args.device,
                    args.data, args.task_rows, args.min_task_gain)
    out = Path(args.out).expanduser().absolute()
    print(f"exported {args.format} to {out} (fidelity report: {report_path(args.format, out)})", flush=True)
    if args.format == "gguf-adapter":  # the adapter is only the model the run evaluated over that base
        print(f"checked over {report['base_gguf']['checked_over']}; apply it over {report['base_gguf']['apply_over']}",
              flush=True)
    if report["forced"]:
        log.warning("the export is refused by its fidelity gate and was written because of --force")
