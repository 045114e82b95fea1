"""`tunekit export RUN_DIR --format adapter|merged|gguf|gguf-adapter --out PATH`: ship a trained run, checked.

Every export is rebuilt fresh from RUN_DIR (config.yaml + adapter/), written into a hidden temp
folder beside PATH, reloaded from there by the program that will consume it (peft, transformers,
llama.cpp) and measured against the trained model on the run's held-out batches: how much of
the fine-tune's held-out gain it keeps (tunekit.export.fidelity, .gate). Only an export that keeps
enough of it (or --force) is renamed into place, with its fidelity report beside it:

    adapter   PATH/ : method.save() output + tokenizer + fidelity.json (peft loads LoRA / prompt tuning)
    merged    PATH/ : standalone HF folder (safetensors, config, generation config, tokenizer) + fidelity.json
              with --requantize nf4: the merged weights in NF4 + double quant (bitsandbytes)
    gguf      PATH  : one GGUF file (Llama architecture) + PATH.fidelity.json; f16/bf16/f32 written by
              tunekit, Q8_0 / Q6_K / Q5_K_M / Q4_K_M by llama.cpp's quantizer; checked by llama.cpp
    gguf-adapter PATH : a LoRA as llama.cpp's LoRA adapter GGUF (applied over the base's own GGUF, unmerged)
              + PATH.fidelity.json; f32 (or f16); checked by llama.cpp over an f32 GGUF of the base it trained on

Without --dtype, the narrowest dtype that keeps the gain is chosen (merged: bf16, fp16, fp32;
gguf: f16, f32; gguf-adapter: f32) and the report says which and why. Existing PATH: a previous tunekit export
there (recognised by its fidelity report) is replaced only once the new export has passed;
anything else at PATH is never touched (error).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import shutil
import time
from pathlib import Path
from typing import Optional

import torch

from tunekit import TunekitError, __version__
from tunekit.train.checkpoint import atomic_dir
from tunekit.commands.parse import Parser, add_device_argument
from tunekit.export import artifacts, gguf_adapter
from tunekit.infer import llamacpp
from tunekit.speed.device import command_facts, cpu_emulated_dtypes, cpuinfo_text
from tunekit.export.fidelity import HalfLinearsInFp32, compare, measure_reference, token_nll
from tunekit.export.gate import (KL_ADAPTER, MIN_GAIN_KEPT, MIN_GAIN_KEPT_LOSSY, TASK_MIN_GAIN_KEPT,
                                 TASK_MIN_GAIN_KEPT_LOSSY, decide, table)
from tunekit.export.task import DEFAULT_TASK_ROWS, compare_task, scorer_for, task_check
from tunekit.runs.heldout import heldout_batches
from tunekit.runs.load import apply_and_load, load_base, load_original_base, load_tokenizer_for
from tunekit.runs.open import open_source
from tunekit.export.writing import atomic_file, check_out, report_path

log = logging.getLogger("tunekit")
FORMATS = ("adapter", "merged", "gguf", "gguf-adapter")
REPORT = "fidelity.json"
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
LOSSY = ("q4_k_m", "q5_k_m")
MERGE_TARGETS = ("dequantized", "original")
# Over a 4-bit base the default merge is into the dequantized NF4 weights the adapter trained
# against: that reproduces the model `tunekit eval` scored (KL 7e-4 in f16 on the default run).
# Merged into the original high-precision weights instead, the default run's held-out perplexity
# even improves (8.37 vs 9.51 trained: SmolLM2-135M loses much to NF4), but it is another model:
# on the tweet-sentiment task 23 of 150 answers changed (benchmarks/export/deploy-tweet-sentiment-*.md).
# A user who evaluated one model must get that model unless they ask for the other; the task
# check reports what `--merge-into original` trades.
DEFAULT_MERGE_INTO = "dequantized"


def gguf_name(dtype: str) -> str:
    return llamacpp.QUANT_TYPES[dtype][1] if dtype in llamacpp.QUANT_TYPES else {"fp16": "f16", "fp32": "f32"}.get(dtype, dtype)


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


def export(run_dir: str | Path, fmt: str, out: str | Path, dtype: Optional[str] = None, requantize: Optional[str] = None,
           force: bool = False, kl_threshold: Optional[float] = None, eval_batches: int = 4,
           merge_into: Optional[str] = None, min_gain: Optional[float] = None, device: Optional[str] = None,
           data: Optional[str] = None, task_rows: int = DEFAULT_TASK_ROWS, min_task_gain: Optional[float] = None) -> dict:
    """Export a finished run; returns the fidelity report (also written beside the export).
    device: where the models load and the check computes (tunekit.speed.device.command_device; None:
    the first GPU, else the CPU). llama.cpp's check runs on the CPU either way. data / task_rows:
    the held-out rows of the task check (tunekit.export.task; default the run's held-out split,
    task_rows=0 skips it)."""
    started = time.time()
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
    if min_gain is not None and not 0 <= min_gain <= 1.5:
        raise TunekitError(f"--min-gain: a fraction of the fine-tune's gain (e.g. 0.9), got {min_gain}")
    if min_task_gain is not None and not 0 <= min_task_gain <= 1.5:
        raise TunekitError(f"--min-task-gain: a fraction of the fine-tune's task gain (e.g. 0.95), got {min_task_gain}")
    if task_rows < 0:
        raise TunekitError(f"--task-rows: must be >= 0, got {task_rows}")
    if data is not None and not Path(data).expanduser().is_file():
        raise TunekitError(f"--data: file not found: {data}")
    candidates = _dtypes(fmt, dtype, requantize)
    facts = command_facts(device)
    src = open_source(run_dir, what="RUN_DIR", facts=facts, runs_only=True)
    # The check measures the trained weights' own function: base, adapter and every candidate computed
    # in fp32 (the trainer's bf16 arithmetic is a rounding of that function, as a bf16 export's is, and
    # against an exact fp32 merge it alone reads KL ~4e-3 on the default model, the size of what the
    # KL fallback of the gate must tell apart). What the run computed in goes into a re-quantized
    # export's config.
    policy_dtype = src.dtype
    src = dataclasses.replace(src, dtype=torch.float32)
    out = Path(out).expanduser().absolute()
    check_out(fmt, out, src.run.run_dir.absolute())
    if fmt == "gguf-adapter":  # before anything loads: what llama.cpp cannot apply, and llama.cpp itself
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
    target = merge_target(src, merge_into) if fmt not in ("adapter", "gguf-adapter") else None
    checked_by = {"adapter": "peft / tunekit", "merged": "transformers"}.get(fmt)
    if fmt == "gguf":
        why = llamacpp.unavailable()
        if why and candidates[0] in llamacpp.QUANT_TYPES:
            raise TunekitError(f"--dtype {gguf_name(candidates[0])} needs llama.cpp's quantizer: {why}; "
                               "bash scripts/setup.sh builds it")
        if why:
            log.warning("%s: checking the GGUF with transformers' reader instead of llama.cpp", why)
        checked_by = "transformers' GGUF reader (llama.cpp not available)" if why else llamacpp.version()
        repack, repack_why = llamacpp.weight_repacking(cpuinfo_text())
        if not why and not repack:
            checked_by += f" ({repack_why})"
    if fmt == "gguf-adapter":
        repack, repack_why = llamacpp.weight_repacking(cpuinfo_text())
        checked_by = llamacpp.version() + ", adapter applied over an f32 GGUF of its base" + (
            "" if repack else f" ({repack_why})")

    timings: dict[str, float] = {}
    clock = [started]

    def lap(name: str) -> None:
        now = time.time()
        timings[name] = round(timings.get(name, 0.0) + now - clock[0], 2)
        clock[0] = now

    tokenizer = load_tokenizer_for(src)
    batches = heldout_batches(src.run, tokenizer, eval_batches)
    log.info("%s", export_memory_check(src, facts, fmt, target, candidates, batches))
    batches = [{k: v.to(src.device) for k, v in b.items()} for b in batches]
    task, task_note = task_check(src.run.cfg, tokenizer, data, task_rows)
    lap("held_out_data")
    log.info("exporting %s (method %s, base %s%s) as %s to %s", src.run.run_dir, src.method, src.base_path,
             ", 4-bit NF4" if src.quantize == "nf4" else "", fmt, out)
    # Where this CPU emulates a half dtype, every forward of the export (reference and candidates
    # alike) computes its half linears in fp32: one kernel on both sides of each comparison, so an
    # identical adapter still reloads exactly (bf16 kernels alone differ by KL ~4e-3 on SmolLM2).
    emulated = cpu_emulated_dtypes()
    # One load of the base: its loss, then (same storage) the trained model's logits and loss.
    with HalfLinearsInFp32(emulated):
        base = load_base(src)
        if task is not None:
            task.base = task.score(base, tokenizer)
        ref, trained = measure_reference(base, lambda b: apply_and_load(src, b), batches)
        del base  # its storage is the trained model's now
        if task is not None:
            task.trained = task.score(trained, tokenizer)
    lap("load_and_measure_trained")
    merged, nll_merge_base = None, None
    if fmt == "gguf-adapter":  # the LoRA's tensors, and the base it trained over as a plain fp32 model
        prepared = gguf_adapter.prepare(src, trained)
        trained = None
        lap("read_adapter")
    elif fmt != "adapter":
        if src.quantize == "nf4" and target == "dequantized":
            merged = src.method_impl.merge(trained)  # fp32: dequantized NF4 codes + delta, exact
        else:
            trained = None  # the 4-bit model goes before the fp32 original comes
            artifacts.free()
            base = load_original_base(src)
            if src.quantize == "nf4":
                with HalfLinearsInFp32(emulated):
                    nll_merge_base = token_nll(base, batches)
            merged = src.method_impl.merge(apply_and_load(src, base))
        trained = None
        lap("merge")

    def label(d: Optional[str]) -> str:
        if fmt == "adapter":
            return "adapter"
        if fmt == "gguf-adapter":
            return f"gguf-adapter {gguf_name(d)} (over the {'dequantized NF4 ' if src.quantize == 'nf4' else ''}base)"
        into = {"dequantized": "into the dequantized NF4 weights", "original": "into the original weights"}[target]
        if requantize:
            return f"merged nf4 (re-quantized from {d}, {into})"
        return f"{fmt} {gguf_name(d) if fmt == 'gguf' else d} ({into})"

    def attempt(tmp: Path, d: Optional[str]) -> dict:
        """Write one candidate into tmp, reload it as its consumer does, measure it."""
        if fmt == "adapter":
            artifacts.write_adapter(src, trained, tokenizer, tmp)
            lap("write")
            exported, exported_tok = artifacts.reload_adapter(src, tmp), artifacts.reload_tokenizer(tmp)
        elif fmt == "merged":
            if requantize:
                artifacts.write_requantized_nf4(src, merged, tokenizer, tmp, d, policy_dtype)
            else:
                artifacts.write_merged(merged, tokenizer, tmp, d)
            lap("write")
            exported, exported_tok = artifacts.reload_merged(tmp, src.device), artifacts.reload_tokenizer(tmp)
        elif fmt == "gguf-adapter":
            n_ctx = max(int(b["attention_mask"].sum(1).max()) for b in batches)
            model = gguf_adapter.write_and_load(prepared, tokenizer, tmp, out.name, d, n_ctx, _threads(), repack)
            lap("write")
            exported, exported_tok = model.logits, llamacpp.LlamaCppTokenizer(model)
        else:
            artifacts.write_gguf_file(src, merged, tokenizer, tmp / out.name, d)
            lap("write")
            if checked_by.startswith("llama.cpp"):
                n_ctx = max(int(b["attention_mask"].sum(1).max()) for b in batches)
                model = llamacpp.LlamaCppModel(tmp / out.name, n_ctx, _threads(), repack)
                exported, exported_tok = model.logits, llamacpp.LlamaCppTokenizer(model)
            else:
                with artifacts.gguf_parsed_once():
                    exported = artifacts.reload_gguf_transformers(tmp / out.name, src.device)
                    exported_tok = artifacts.reload_tokenizer(tmp, gguf_file=out.name)
        lap("reload")
        with HalfLinearsInFp32(emulated) as half:  # the same numbers up to summation order, ~7x faster
            fid = compare(ref, exported, nll_merge_base)
        if half.seen:
            fid["half_linears"] = half.describe()
        if task is None:
            fid["task_skipped"] = task_note
        elif (scorer := scorer_for(exported)) is None:
            fid["task_skipped"] = f"{checked_by} gives logits only here, no task scorer"
        else:
            with HalfLinearsInFp32(emulated):
                fid["task"] = compare_task(task, task.score(scorer, tokenizer))
        fid["tokenizer_agreement"] = artifacts.tokenizer_agreement(tokenizer, exported_tok, batches)
        lossy = bool(requantize) or d in LOSSY
        gate = decide(fid, adapter=fmt == "adapter", lossy=lossy, min_gain=min_gain, kl_threshold=kl_threshold,
                      min_task_gain=min_task_gain)
        if gate["rule"] == "kl (gain not measurable)" and nll_merge_base is not None and kl_threshold is None:
            # Merged into the original weights, the export is not meant to match the trained
            # model (NF4 rounding apart): where KL decides, it is KL against the exact fp32 merge.
            fid["kl_vs_exact_merge"] = compare(exact_merge_reference(), exported)["kl_mean"]
            gate = decide(dict(fid, kl_mean=fid["kl_vs_exact_merge"]), adapter=False, lossy=lossy, min_gain=min_gain,
                          min_task_gain=min_task_gain)
            gate["against"] = "the exact fp32 merge"
        if fmt in ("gguf", "gguf-adapter") and checked_by.startswith("llama.cpp"):
            exported_tok.model.close()
        del exported, exported_tok
        lap("compare")
        return {"dtype": d, "fidelity": fid, "gate": gate, "accepted": gate["accepted"]}

    exact = []

    def exact_merge_reference():
        """The merged fp32 model's own logits (measured once, on demand)."""
        if not exact:
            with HalfLinearsInFp32(emulated):
                exact.append(measure_reference(merged, lambda m: m, batches)[0])
        return exact[0]

    def build(tmp: Path) -> dict:
        tried = []
        for i, d in enumerate(candidates):
            for p in tmp.iterdir():  # a refused candidate's files
                shutil.rmtree(p) if p.is_dir() else p.unlink()
            result = attempt(tmp, d)
            tried.append(result)
            if result["accepted"]:
                break
            if i + 1 < len(candidates):
                print(f"{label(d)}: {result['gate']['why']}; trying {gguf_name(candidates[i + 1]) if fmt == 'gguf' else candidates[i + 1]}",
                      flush=True)
        result = tried[-1]
        report = {
            "format": fmt, "dtype": None if fmt == "adapter" else (gguf_name(result["dtype"]) if fmt.startswith("gguf") else result["dtype"]),
            "dtype_asked": "auto" if len(candidates) > 1 or dtype in (None, "auto") else dtype,
            "dtype_tried": [{"dtype": t["dtype"], "gain_kept": t["fidelity"]["gain_kept"],
                             "kl_mean": t["fidelity"]["kl_mean"], "accepted": t["accepted"]} for t in tried],
            "requantize": requantize, "merge_into": target,
            "path": str(out), "run_dir": str(src.run.run_dir.absolute()), "method": src.method,
            "base_model": src.base_path, "base_quantize": src.quantize, "checked_by": checked_by,
            "device": facts.describe(),
            "gate": result["gate"], "accepted": result["accepted"], "forced": bool(force and not result["accepted"]),
            "fidelity": result["fidelity"],
            "tokens_compared": "KL, logit diff, top-1: every non-padding position of the held-out batches; "
                               "loss, perplexity, gain kept: response tokens",
            "tunekit_version": __version__,
        }
        if len(candidates) > 1 and result["accepted"]:
            report["dtype_why"] = (f"{report['dtype']}: the narrowest of {', '.join(gguf_name(c) if fmt == 'gguf' else c for c in candidates)} "
                                   f"that passes the gate ({result['gate']['rule']} >= {result['gate']['bound']:g})"
                                   if result["gate"]["rule"] == "gain_kept" else
                                   f"{report['dtype']}: the narrowest of {', '.join(candidates)} that passes the gate")
        if fmt == "gguf-adapter":  # which base the check applied it over, and which one the user must
            report["base_gguf"] = prepared.about_base
        report["timings_s"] = dict(timings, total=round(time.time() - started, 2))
        report["export_s"] = report["timings_s"]["total"]
        print(table(label(result["dtype"]), report), flush=True)
        if not result["accepted"] and not force:
            raise TunekitError(f"export refused: {label(result['dtype'])}: {result['gate']['why']}; nothing written at {out}."
                               f"{_hint(fmt, candidates, requantize)} --force writes it anyway; --min-gain F changes the bound")
        if report.get("dtype_why") and result["dtype"] != candidates[0]:
            print(f"dtype: {report['dtype_why']}", flush=True)
        (tmp / REPORT).write_text(json.dumps(report, indent=2) + "\n")
        return report

    if fmt in ("gguf", "gguf-adapter"):
        return atomic_file(out, build, REPORT)
    result = {}
    atomic_dir(out, lambda tmp: result.update(build(tmp)))
    return result


def export_memory_check(src, facts, fmt: str, target: Optional[str], candidates: tuple, batches: list[dict]) -> str:
    """The planner's check, before any model loads, that the export fits on its device. It
    computes in fp32 and holds, at its peak, either the trained model beside a reloaded adapter
    (adapter exports) or the merged fp32 model beside one reloaded candidate (merged, gguf), plus
    the reference logits of every held-out position and one batch's forward."""
    from tunekit.speed.device import available_memory_bytes
    from tunekit.plan.inference import Workload, activation_terms, check_fits
    from tunekit.plan.memory import base_weight_bytes
    from tunekit.plan.shape import model_shape

    try:
        shape = model_shape(src.base_path, None)
    except TunekitError as e:
        return f"memory: not checked ({e})"
    tokens = max(int(b["input_ids"].numel()) for b in batches)
    kept = sum(int(b["attention_mask"].sum()) for b in batches)
    work = Workload(kv_tokens=0, forward_tokens=tokens, logit_rows=tokens, kept_logit_rows=kept)
    adapter = 2 * sum(f.stat().st_size for f in src.adapter_dir.glob("*.safetensors"))
    trained = base_weight_bytes(shape, src.quantize, 4) + adapter
    if fmt == "adapter":
        weights = {"trained model": trained, "reloaded adapter export": trained}
    else:
        widest = max(4 if c in (None, "fp32") or c in llamacpp.QUANT_TYPES else 2 for c in candidates)
        reload = 4 if fmt.startswith("gguf") else widest  # transformers' GGUF reader dequantizes to fp32
        merged = {"merged model (fp32)": shape.total_params * 4, "reloaded export": shape.total_params * reload}
        weights = merged if target == "original" or src.quantize != "nf4" else {"trained model": trained, **merged}
    return check_fits({**weights, **activation_terms(shape, 4, work)}, facts, available_memory_bytes(src.device),
                      "tunekit export", "--eval-batches 1 keeps fewer reference logits")


def _threads() -> int:
    import torch

    return max(1, torch.get_num_threads())


def _hint(fmt: str, candidates: tuple, requantize: Optional[str]) -> str:
    if fmt == "adapter" or requantize:
        return ""
    if len(candidates) > 1:
        return f" Every dtype tried ({', '.join(gguf_name(c) if fmt == 'gguf' else c for c in candidates)}) was refused."
    if candidates[0] in ("bf16", "fp16"):
        return (" A wider --dtype keeps small fine-tune updates that this one rounds away; without --dtype,"
                " export picks the narrowest that keeps the gain.")
    if candidates[0] in llamacpp.QUANT_TYPES:
        return " A wider type (Q8_0, f16) keeps more of it."
    return ""


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
