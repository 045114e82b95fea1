"""`tunekit eval RUN [--data FILE] [--base]`: score what a run learned on held-out rows.

RUN is a run folder, an adapter folder, a model folder or a GGUF file (tunekit.runs.open; a GGUF is
scored by llama.cpp on the CPU with the same figures, tunekit.infer.gguf). The rows are the
run's own held-out split unless --data names a file (any format `tunekit train` reads; chat and
alpaca rows are scored on their final reply). Figures: response loss and perplexity, exact match
of greedy answers (normalised: case, surrounding whitespace and punctuation), and, when the
references form a small closed set, accuracy by log-likelihood of each class's answer with
per-class counts. --base scores the untuned base the same way, side by side. A run on a list of
sources gets each source's figures beside the whole's. A preference run's pairs (its split, or --data
of preference rows) are scored by its own loss instead: preference accuracy, reward margin, loss
(tunekit.infer.preference). The table goes to stdout, eval.json into the evaluated folder (beside a
GGUF file: FILE.eval.json; or --out).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import sys
import time
from pathlib import Path

from tunekit import TunekitError
from tunekit.checks import path_fits
from tunekit.runs.heldout import heldout_split
from tunekit.commands.parse import Parser, add_device_argument

log = logging.getLogger("tunekit")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="tunekit eval",
        description="Score a run (or an adapter / merged folder) on held-out rows: response loss, exact match "
                    "of greedy answers and, for a closed answer set, accuracy by likelihood; --base adds the "
                    "untuned base side by side.",
        epilog="example: tunekit eval runs/x --base   |   tunekit eval runs/x --data test.jsonl --max-rows 200",
    )
    p.add_argument("source", metavar="RUN", help="a run folder, an adapter folder, a model folder or a .gguf file "
                                                  "(scored by llama.cpp)")
    p.add_argument("--data", metavar="FILE", help="held-out rows (.jsonl/.json/.csv/.parquet; default: the run's "
                                                  "held-out split, or the default data's for a folder)")
    p.add_argument("--base", action="store_true", help="also score the untuned base, side by side")
    p.add_argument("--base-model", metavar="DIR", help="the untuned base of a model folder or GGUF file (for --base)")
    p.add_argument("--model", metavar="DIR", help="base model for an adapter folder outside a run; for a GGUF file, "
                                                  "the folder whose tokenizer to use instead of the file's own")
    p.add_argument("--quantize", choices=["none", "nf4"], help="load an adapter folder's base in 4-bit NF4")
    p.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto",
                   help="compute dtype for a folder outside a run (a run keeps its own)")
    p.add_argument("--max-rows", type=int, help="score only the first N rows")
    p.add_argument("--batch-size", type=int, default=32, help="rows per batch (default 32)")
    p.add_argument("--max-new-tokens", type=int, help="greedy budget (default: longest reference + 4 tokens)")
    p.add_argument("--no-generate", action="store_true", help="skip greedy answers and exact match (loss and "
                                                             "accuracy only)")
    p.add_argument("--samples", type=int, default=5, help="answers to print (default 5)")
    p.add_argument("--out", metavar="FILE", help="where eval.json goes (default: RUN/eval.json)")
    p.add_argument("--json", action="store_true", help="print eval.json instead of the table")
    add_device_argument(p)
    return p




def eval_workload(rows, classes, batch_size: int, max_new_tokens: int | None):
    """What one batch of score_rows holds at once (tunekit.infer.score): the prompts' cache,
    its copy repeated for the reference and every class answer, the greedy answers' tokens."""
    from tunekit.plan.inference import Workload

    r = min(batch_size, len(rows))
    prompt = max(len(x.prompt) for x in rows)
    answer = max(len(x.answer) for x in rows)
    if classes is not None:
        answer = max([answer, *(len(a) for a in classes.answers)])
    n_cont = 1 + (len(classes.answers) if classes is not None else 0)
    budget = max_new_tokens or answer + 4
    kv = max(r * prompt + r * n_cont * (prompt + answer), r * (prompt + budget))
    return Workload(kv_tokens=kv, forward_tokens=max(r * prompt, r * n_cont * answer),
                    logit_rows=max(r * n_cont * answer, prompt, r))


def evaluate(args) -> dict:
    from tunekit.runs.open import is_gguf_file, open_source

    for key in ("batch_size", "max_rows", "max_new_tokens"):
        value = getattr(args, key)
        if value is not None and value <= 0:
            raise TunekitError(f"--{key.replace('_', '-')}: must be > 0, got {value}")
    start = time.perf_counter()
    from tunekit.device.facts import command_facts

    gguf_file = is_gguf_file(args.source)
    # A GGUF file runs in llama.cpp's CPU build whatever --device says; only a --base model loads there.
    src = open_source(args.source, args.model, args.quantize, args.dtype, args.base_model,
                      facts=None if gguf_file and not args.base else command_facts(args.device))
    if src.kind == "run" and args.data is None:  # its held-out split is re-made from the run's data files
        from tunekit.runs.heldout import check_data_unchanged

        check_data_unchanged(src.run)
    if args.base and src.kind in ("model", "gguf") and args.base_model is None:
        raise TunekitError(f"--base: the base of the {'model folder' if src.kind == 'model' else 'GGUF file'} "
                           f"{src.path} is unknown; name it with --base-model DIR")
    if src.kind == "gguf" and args.device != "auto":
        log.info("--device %s: the GGUF file is scored by llama.cpp on the CPU; --device %s", args.device,
                 "applies to the --base model" if args.base else "is not used")
    gguf = None
    if src.kind == "gguf":
        from tunekit.infer.gguf import load_gguf

        t0 = time.perf_counter()
        # before the tokenizer is read from the file: a damaged file is llama.cpp's one line, at once
        gguf = load_gguf(src.path)
        gguf_load_s = time.perf_counter() - t0
    try:
        return _evaluate(args, src, gguf, gguf_load_s if gguf is not None else 0.0, start)
    finally:
        if gguf is not None:
            gguf.close()


def _evaluate(args, src, gguf, gguf_load_s: float, start: float) -> dict:
    from tunekit.infer.report import answers_json, difference, sample_lines, source_reports, sources_table, table
    from tunekit.infer.rows import closed_set, task_rows_kept
    from tunekit.infer.score import score_rows
    from tunekit.runs.load import load_base, load_tokenizer_for, load_trained
    from tunekit.runs.memory import check_memory

    tokenizer = load_tokenizer_for(src)
    if _scores_preference(args, src):
        return _evaluate_preference(args, src, tokenizer, start)
    split = heldout_split(src.run.cfg if src.kind == "run" else None, tokenizer, args.data)
    where = split.where
    rows, kept = task_rows_kept(split.examples, tokenizer)
    skipped = len(split.examples) - len(rows)
    if args.max_rows is not None:
        rows, kept = rows[:args.max_rows], kept[:args.max_rows]
    if not rows:
        raise TunekitError(f"{args.data or src.path}: no held-out row has a prompt and a reply to score "
                           "(plain-text rows, or replies cut by data.max_seq_len)")
    classes = closed_set(rows)
    kw = dict(batch_size=args.batch_size, max_new_tokens=args.max_new_tokens, generate=not args.no_generate)
    log.info("%s", check_memory(src, eval_workload(rows, classes, args.batch_size, args.max_new_tokens), "tunekit eval",
                                "a smaller --batch-size shrinks the KV cache and working set"))

    timings = {}
    if gguf is not None:
        from tunekit.infer.gguf import score_rows_gguf

        timings["load_s"] = gguf_load_s
        t0 = time.perf_counter()
        trained = score_rows_gguf(gguf, tokenizer, rows, classes, **kw)
        timings["score_s"] = time.perf_counter() - t0
        gguf.close()  # before a --base model loads (closing twice is harmless)
    else:
        t0 = time.perf_counter()
        model = load_trained(src)
        timings["load_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        trained = score_rows(model, tokenizer, rows, classes, **kw)
        timings["score_s"] = time.perf_counter() - t0
        del model
        gc.collect()
    base = None
    if args.base:
        t0 = time.perf_counter()
        base_model = load_base(src)
        base = score_rows(base_model, tokenizer, rows, classes, **kw)
        timings["base_s"] = time.perf_counter() - t0
        del base_model
        gc.collect()
    timings["wall_s"] = time.perf_counter() - start

    sources = source_reports(split.groups, kept, trained, base) if split.groups else None
    head = (f"held-out: {where}: {len(rows)} rows" + (f" ({skipped} without a reply to score skipped)" if skipped else "")
            + (f", {len(classes.names)} classes: {', '.join(classes.labels)}" if classes else ", free-form answers"))
    report = {
        "source": src.describe(), "data": where, "rows": len(rows), "skipped": skipped,
        "classes": classes.labels if classes else None,
        "settings": {"batch_size": args.batch_size, "max_new_tokens": args.max_new_tokens, "generate": not args.no_generate},
        "trained": trained.metrics, **({"base": base.metrics, "difference": difference(base.metrics, trained.metrics)}
                                       if base else {}),
        **({"sources": sources} if sources is not None else {}),
        "timings": timings, "answers": answers_json(tokenizer, rows, trained, base),
        "table": table(trained.metrics, base.metrics if base else None, head)
                 + (f"\n{sources_table(sources)}" if sources else ""),
        "samples": sample_lines(tokenizer, rows, trained, args.samples) if not args.no_generate else [],
    }
    return report


def _scores_preference(args, src) -> bool:
    """Whether the rows are preference rows, scored as the run's preference loss scores them: a
    preference run's own split, or --data holding preference rows (a preference run's only)."""
    from tunekit.runs.heldout import is_preference_data

    run_pref = src.kind == "run" and src.run.cfg.objective == "preference"
    if args.data is None or not is_preference_data(args.data):
        return run_pref and args.data is None
    if not run_pref:
        what = "run" if src.kind == "run" else {"gguf": "GGUF file", "model": "model folder"}.get(src.kind, "adapter folder")
        raise TunekitError(f"--data: {args.data} holds preference rows, which are scored with a preference run's own "
                           f"loss (preference.loss, beta); give the folder of a run trained with objective=preference, "
                           f"or SFT rows to score this {what}")
    return True


def _evaluate_preference(args, src, tokenizer, start: float) -> dict:
    """Preference figures of the held-out rows (tunekit.infer.preference), trained and, with --base, base."""
    from tunekit.infer.preference import PairScorer, completion_logps, desirable_of, preference_table
    from tunekit.losses.sft import chunk_rows
    from tunekit.plan.inference import Workload
    from tunekit.runs.heldout import heldout_preference
    from tunekit.runs.load import load_base, load_trained
    from tunekit.runs.memory import check_memory

    cfg = src.run.cfg
    scorer = PairScorer(cfg.preference)
    examples, kind, where = heldout_preference(cfg, tokenizer, args.data)
    if (kind == "pairs") != scorer.paired:
        raise TunekitError(f"--data: {where} holds {'preference pairs' if kind == 'pairs' else 'unpaired rows'}, but the "
                           f"run trained preference.loss={scorer.kind} on {'unpaired rows' if kind == 'pairs' else 'pairs'}; "
                           "give rows of the kind it trained on")
    examples = examples[:args.max_rows] if args.max_rows is not None else examples
    sides = 2 if scorer.paired else 1
    rows = sides * min(args.batch_size, len(examples))
    longest = max(len(e.get(k, ())) for e in examples for k in ("input_ids", "rejected_input_ids"))
    work = Workload(kv_tokens=0, forward_tokens=rows * longest, logit_rows=min(rows * longest, chunk_rows(len(tokenizer))))
    log.info("%s", check_memory(src, work, "tunekit eval", "a smaller --batch-size shrinks the working set"))
    timings = {}
    t0 = time.perf_counter()
    model = load_trained(src)
    timings["load_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    switch = src.method_impl.switched_off if scorer.needs_reference else None  # the reference, as in training
    policy, reference = completion_logps(model, examples, tokenizer.pad_token_id, args.batch_size, switch)
    timings["score_s"] = time.perf_counter() - t0
    del model
    gc.collect()
    desirable = desirable_of(examples)
    trained = scorer.figures(policy, reference, desirable)
    base = None
    if args.base and scorer.needs_reference:  # the base is the reference: every margin 0
        base = scorer.figures(reference, reference, desirable)
    elif args.base:
        t0 = time.perf_counter()
        base_model = load_base(src)
        base_logps, _ = completion_logps(base_model, examples, tokenizer.pad_token_id, args.batch_size)
        base = scorer.figures(base_logps, None, desirable)
        timings["base_s"] = time.perf_counter() - t0
        del base_model
        gc.collect()
    timings["wall_s"] = time.perf_counter() - start
    unit = "pairs" if scorer.paired else "unpaired rows"
    head = (f"held-out: {where}: {len(examples)} {unit}, scored by preference.loss={scorer.kind} (beta {scorer.beta:g}"
            + ((", reference: base + its start adapter)" if src.start is not None else ", reference: the base)")
               if scorer.needs_reference else ", no reference)"))
    per_row = [{"value": v, **({"correct": c} if trained.correct is not None else {})}
               for v, c in zip(trained.values, trained.correct or [None] * len(trained.values))]
    return {
        "source": src.describe(), "data": where, "rows": len(examples), "skipped": 0, "classes": None,
        "objective": "preference", "preference_loss": scorer.kind,
        "settings": {"batch_size": args.batch_size},
        "trained": trained.metrics,
        **({"base": base.metrics, "difference": {k: trained.metrics[k] - base.metrics[k] for k in trained.metrics
                                                 if isinstance(trained.metrics[k], float)}} if base else {}),
        "timings": timings, "answers": per_row,
        "table": preference_table(trained.metrics, base.metrics if base else None, head), "samples": [],
    }


def main(argv: list[str]) -> None:
    args = build_parser().parse_args(argv)
    if args.out:  # refused before the scoring, not after it when eval.json cannot be written
        path_fits("--out", args.out)
    report = evaluate(args)
    source = Path(args.source).expanduser()
    out = Path(args.out) if args.out else (source.with_name(source.name + ".eval.json") if source.is_file()
                                           else source / "eval.json")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({k: v for k, v in report.items() if k not in ("table", "samples")}, indent=2) + "\n")
    except OSError as e:
        raise TunekitError(f"--out: cannot write {out} ({e.strerror})") from None
    if args.json:
        print(out.read_text(), end="")
    else:
        print(report["table"])
        if report["samples"]:
            print("answers (trained):")
            print("\n".join(report["samples"]))
        print(f"wrote {out} ({report['timings']['wall_s']:.1f} s)")
    sys.stdout.flush()
