"""One export of a finished run, its steps in the order they happen (`tunekit export`; the command,
tunekit.commands.export.export, calls them in this order):

    open               the held-out batches and task rows; the memory check (tunekit.export.memory)
    reference_figures  one load of the base: its loss, then the trained model's loss and logit summary
                       (tunekit.export.fidelity.Reference); then the trained model becomes what the
                       candidates are written from: itself (adapter), the merged fp32 model (in
                       memory), or nothing at all: a streamed merge (tunekit.export.stream) and a
                       gguf-adapter (tunekit.export.gguf_adapter) read the base's and the adapter's
                       files as they write, so it is freed before any candidate is written
    for each candidate dtype in turn (candidates), in the temp folder:
      write            the candidate written
      reload           read back as its consumer reads it (peft, transformers, llama.cpp)
      check            measured against the reference figures (tunekit.export.fidelity, .task)
      gate             kept or refused (tunekit.export.gate)
    conclude           the report of the one kept beside it, or the refusal
    place              the temp folder (or file) renamed into place (tunekit.export.writing)
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import shutil
import time
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch

from tunekit import TunekitError, __version__
from tunekit.export import artifacts, gguf_adapter, stream
from tunekit.export.gguf import write_gguf
from tunekit.export.fidelity import HalfLinearsInFp32, UpcastHalfWeights, compare, measure_reference, token_nll
from tunekit.export.gate import decide, table
from tunekit.export.memory import export_memory_check
from tunekit.export.task import compare_task, scorer_for, task_check
from tunekit.export.writing import atomic_file
from tunekit.infer import llamacpp
from tunekit.owned import atomic_dir
from tunekit.runs.heldout import heldout_batches
from tunekit.runs.load import apply_and_load, load_base, load_original_base, load_tokenizer_for
from tunekit.device.facts import cpu_emulated_dtypes

log = logging.getLogger("tunekit")
REPORT = "fidelity.json"
LOSSY = ("q4_k_m", "q5_k_m")


def gguf_name(dtype: str) -> str:
    return llamacpp.QUANT_TYPES[dtype][1] if dtype in llamacpp.QUANT_TYPES else {"fp16": "f16", "fp32": "f32"}.get(dtype, dtype)


@dataclasses.dataclass
class Candidate:
    """A candidate as its consumer reloaded it: what gives its logits (a model, or llama.cpp's logits
    function) and its tokenizer; released when its check is done, before the next one is written."""

    logits: object
    tokenizer: object
    llama: Optional[llamacpp.LlamaCppModel] = None  # closed on release

    def release(self) -> None:
        if self.llama is not None:
            self.llama.close()
        self.logits = self.tokenizer = self.llama = None


class Export:
    """One export; its steps in order: open, reference_figures, then for each of candidates(tmp):
    write, reload, check, gate; then conclude, inside place (the module docstring says what each does)."""

    def __init__(self, src, fmt: str, out: Path, candidates: tuple, target: Optional[str], checked_by: str,
                 repack: bool, started: float, options: dict):
        self.fmt, self.out, self.candidates, self.checked_by, self.repack = fmt, out, candidates, checked_by, repack
        self.opt = options
        # The check measures the trained weights' own function: base, adapter and every candidate computed
        # in fp32 (the trainer's bf16 arithmetic is a rounding of that function, as a bf16 export's is, and
        # against an exact fp32 merge it alone reads KL ~4e-3 on the default model, the size of what the
        # KL fallback of the gate must tell apart). What the run computed in goes into a re-quantized
        # export's config.
        self.policy_dtype = src.dtype
        self.src = dataclasses.replace(src, dtype=torch.float32)
        self.target = target  # dequantized | original (tunekit.commands.export.merge_target); None: not merged
        # What is written from the files, tensor by tensor (tunekit.export.stream): a streamed merge's
        # plan, or a gguf-adapter's base; None: merged in memory (or an adapter, saved from the model)
        self.plan = None
        if fmt in ("merged", "gguf"):
            self.plan, why = stream.plan_stream(self.src, self.target)
            if self.plan is None:
                log.info("merging in memory, not streamed: %s", why)
        elif fmt == "gguf-adapter":
            self.plan = gguf_adapter.base_plan(self.src)
        self.timings: dict[str, float] = {}
        self.started = self.clock = started
        # Where this CPU emulates a half dtype, every forward of the export (reference and candidates
        # alike) computes its half linears in fp32: one kernel on both sides of each comparison, so an
        # identical adapter still reloads exactly (bf16 kernels alone differ by KL ~4e-3 on SmolLM2).
        self.emulated = cpu_emulated_dtypes()
        self.trained = self.merged = self.nll_merge_base = self.exact = None
        self.about_base: Optional[dict] = None  # gguf-adapter: the base its check applied it over
        self.base_gguf: Optional[Path] = None  # gguf-adapter: written beside the adapter, until llama.cpp loads it
        self.tried: list[dict] = []

    def lap(self, name: str) -> None:
        now = time.time()
        self.timings[name] = round(self.timings.get(name, 0.0) + now - self.clock, 2)
        self.clock = now

    def memory_check(self, candidates: tuple) -> str:
        return export_memory_check(self.src, self.src.facts, self.fmt, self.target, candidates, self.batches,
                                   self.plan is not None, self.reference_source().dtype)

    # ------------------------------------------------------------ open
    def open(self, eval_batches: int, data: Optional[str], task_rows: int) -> None:
        """The tokenizer, the held-out batches and task rows; the memory check before anything loads."""
        src = self.src
        self.tokenizer = load_tokenizer_for(src)
        self.batches = heldout_batches(src.run, self.tokenizer, eval_batches)
        log.info("%s", self.memory_check(self.candidates))
        self.batches = [{k: v.to(src.device) for k, v in b.items()} for b in self.batches]
        self.task, self.task_note = task_check(src.run.cfg, self.tokenizer, data, task_rows)
        self.lap("held_out_data")
        log.info("exporting %s (method %s, base %s%s) as %s to %s", src.run.run_dir, src.method, src.base_path,
                 ", 4-bit NF4" if src.quantize == "nf4" else "", self.fmt, self.out)

    # ------------------------------------------------------------ reference figures
    def reference_source(self):
        """The source the trained model is measured from: fp32, except a 16-bit base written from its
        files (a streamed merge, a gguf-adapter), which stays in its stored dtype and computes in fp32
        (UpcastHalfWeights: the same function in one 16-bit copy's memory)."""
        if self.plan is None or self.src.quantize == "nf4" or not stream.reference_in_storage(self.src):
            return self.src
        return dataclasses.replace(self.src, dtype=stream.stored_dtype(self.src))

    def reference_figures(self) -> None:
        """The trained model measured (the base's loss first, from the same load), then turned into
        what the candidates are written from, or freed."""
        src, task, tok = self.reference_source(), self.task, self.tokenizer
        with HalfLinearsInFp32(self.emulated), UpcastHalfWeights():
            base = load_base(src)
            if task is not None and src.start is None:
                task.base = task.score_base(base, tok)
            self.ref, self.trained = measure_reference(base, lambda b: apply_and_load(src, b), self.batches)
            del base  # its storage is the trained model's now
            if task is not None:
                if src.start is not None:  # over a frozen start (model.adapter): the task's base, and a preference
                    with src.method_impl.switched_off(self.trained):  # loss's reference, is base + start
                        task.base = task.score_base(self.trained, tok)
                task.trained = task.score(self.trained, tok)
        self.lap("load_and_measure_trained")
        self._hand_over()

    def _hand_over(self) -> None:
        """The trained model becomes what the candidates are written from: itself (an adapter), the
        merged fp32 model (in memory), or nothing (written from the files: it goes now)."""
        src = self.src
        if self.fmt == "adapter":
            return
        if self.plan is not None:  # nothing may stay loaded beside what is written and reloaded
            self.trained = None
            artifacts.free()
            return
        if src.quantize == "nf4" and self.target == "dequantized":
            self.merged = src.method_impl.merge(self.trained)  # fp32: dequantized NF4 codes + delta, exact
        else:
            self.trained = None  # the 4-bit model goes before the fp32 original comes
            artifacts.free()
            base = load_original_base(src)
            if src.quantize == "nf4":
                with HalfLinearsInFp32(self.emulated):
                    self.nll_merge_base = token_nll(base, self.batches)
            self.merged = src.method_impl.merge(apply_and_load(src, base))
        self.trained = None
        self.lap("merge")

    def label(self, d: Optional[str]) -> str:
        fmt = self.fmt
        if fmt == "adapter":
            return "adapter"
        if fmt == "gguf-adapter":
            return f"gguf-adapter {gguf_name(d)} (over the {'dequantized NF4 ' if self.src.quantize == 'nf4' else ''}base)"
        into = {"dequantized": "into the dequantized NF4 weights", "original": "into the original weights"}[self.target]
        if self.opt["requantize"]:
            return f"merged nf4 (re-quantized from {d}, {into})"
        return f"{fmt} {gguf_name(d) if fmt == 'gguf' else d} ({into})"

    # ------------------------------------------------------------ each candidate
    def candidates_in(self, tmp: Path) -> Iterator[Optional[str]]:
        """The candidate dtypes in order, each into an emptied tmp, until one passes the gate (each
        must go through gate before the next is asked for)."""
        name = gguf_name if self.fmt == "gguf" else str
        for i, d in enumerate(self.candidates):
            for p in tmp.iterdir():  # a refused candidate's files
                shutil.rmtree(p) if p.is_dir() else p.unlink()
            if i and self.plan is not None:  # a wider candidate than the one checked before the export began
                log.info("%s", self.memory_check((d,)))
            yield d
            if self.tried[-1]["accepted"]:
                return
            if i + 1 < len(self.candidates):
                print(f"{self.label(d)}: {self.tried[-1]['gate']['why']}; trying {name(self.candidates[i + 1])}",
                      flush=True)

    def write(self, tmp: Path, d: Optional[str]) -> None:
        """The candidate written into tmp (a GGUF as tmp/out.name; a gguf-adapter's base GGUF beside it)."""
        src, fmt, tok, out = self.src, self.fmt, self.tokenizer, self.out
        if fmt == "adapter":
            artifacts.write_adapter(src, self.trained, tok, tmp)
        elif fmt == "merged":
            write_plain = self._plain_writer(d)
            if self.opt["requantize"]:
                artifacts.write_requantized_nf4(src, write_plain, tok, tmp, d, self.policy_dtype)
            else:
                write_plain(tmp)
        elif fmt == "gguf-adapter":
            self.about_base, self.base_gguf = gguf_adapter.write(src, self.plan, tok, tmp, out.name, d)
            if self.about_base["base_dtype"] != "f16":  # f16 could not hold a weight: the report says why
                self.checked_by = self.checked_by.replace("an f16 GGUF", f"a {self.about_base['base_dtype']} GGUF")
        elif self.plan is not None:  # merged tensor by tensor as the file is written
            artifacts.write_gguf_file(src, lambda path, dtype, name: stream.write_merged_gguf(
                self.plan, tok, path, dtype, src.device, name), tmp / out.name, d)
        else:
            artifacts.write_gguf_file(src, lambda path, dtype, name: write_gguf(self.merged, tok, path, dtype,
                                                                                 name=name), tmp / out.name, d)
        self.lap("write")

    def _plain_writer(self, d: str) -> Callable[[Path], None]:
        """Writes the merged model in dtype d into a folder: streamed from the files, or from memory."""
        if self.plan is not None:
            return lambda folder: stream.write_merged(self.plan, self.tokenizer, folder, artifacts.TORCH_DTYPES[d],
                                                      self.src.device)
        return lambda folder: artifacts.write_merged(self.merged, self.tokenizer, folder, d)

    @contextlib.contextmanager
    def reload(self, tmp: Path) -> Iterator[Candidate]:
        """The candidate in tmp read back as its consumer reads it; released when the block ends."""
        candidate = self._reloaded(tmp)
        self.lap("reload")
        try:
            yield candidate
        finally:
            candidate.release()

    def _reloaded(self, tmp: Path) -> Candidate:
        src, fmt, out = self.src, self.fmt, self.out
        if fmt == "adapter":
            return Candidate(artifacts.reload_adapter(src, tmp), artifacts.reload_tokenizer(tmp))
        if fmt == "merged":
            return Candidate(artifacts.reload_merged(tmp, src.device), artifacts.reload_tokenizer(tmp))
        n_ctx = max(int(b["attention_mask"].sum(1).max()) for b in self.batches)
        if fmt == "gguf-adapter":
            model = gguf_adapter.load(self.base_gguf, tmp / out.name, n_ctx, _threads(), self.repack)
            return Candidate(model.logits, llamacpp.LlamaCppTokenizer(model), model)
        if self.checked_by.startswith("llama.cpp"):
            model = llamacpp.LlamaCppModel(tmp / out.name, n_ctx, _threads(), self.repack)
            return Candidate(model.logits, llamacpp.LlamaCppTokenizer(model), model)
        with artifacts.gguf_parsed_once():
            return Candidate(artifacts.reload_gguf_transformers(tmp / out.name, src.device),
                             artifacts.reload_tokenizer(tmp, gguf_file=out.name))

    def check(self, exported: Candidate) -> dict:
        """The candidate measured against the reference figures: fidelity, task, tokenizer agreement."""
        with HalfLinearsInFp32(self.emulated) as half:  # the same numbers up to summation order, ~7x faster
            fid = compare(self.ref, exported.logits, self.nll_merge_base)
        if half.seen:
            fid["half_linears"] = half.describe()
        if self.task is None:
            fid["task_skipped"] = self.task_note
        elif (scorer := scorer_for(exported.logits)) is None:
            fid["task_skipped"] = f"{self.checked_by} gives logits only here, no task scorer"
        elif (why := self.task.cannot_score(scorer)) is not None:
            fid["task_skipped"] = f"{self.checked_by}: {why}"
        else:
            with HalfLinearsInFp32(self.emulated):
                fid["task"] = compare_task(self.task, self.task.score(scorer, self.tokenizer))
        fid["tokenizer_agreement"] = artifacts.tokenizer_agreement(self.tokenizer, exported.tokenizer, self.batches)
        return fid

    def gate(self, d: Optional[str], fid: dict, exported: Candidate) -> bool:
        """Kept or refused (tunekit.export.gate.decide); recorded among the candidates tried."""
        opt = self.opt
        lossy = bool(opt["requantize"]) or d in LOSSY
        gate = decide(fid, adapter=self.fmt == "adapter", lossy=lossy, min_gain=opt["min_gain"],
                      kl_threshold=opt["kl_threshold"], min_task_gain=opt["min_task_gain"])
        if gate["rule"] == "kl (gain not measurable)" and self.nll_merge_base is not None and opt["kl_threshold"] is None:
            # Merged into the original weights, the export is not meant to match the trained
            # model (NF4 rounding apart): where KL decides, it is KL against the exact fp32 merge.
            fid["kl_vs_exact_merge"] = compare(self.exact_merge_reference(), exported.logits)["kl_mean"]
            gate = decide(dict(fid, kl_mean=fid["kl_vs_exact_merge"]), adapter=False, lossy=lossy,
                          min_gain=opt["min_gain"], min_task_gain=opt["min_task_gain"])
            gate["against"] = "the exact fp32 merge"
        self.lap("compare")
        self.tried.append({"dtype": d, "fidelity": fid, "gate": gate, "accepted": gate["accepted"]})
        return gate["accepted"]

    def exact_merge_reference(self):
        """The merged fp32 model's own figures (measured once, on demand)."""
        if self.exact is None:
            with HalfLinearsInFp32(self.emulated):
                self.exact = measure_reference(self.merged, lambda m: m, self.batches)[0]
        return self.exact

    # ------------------------------------------------------------ conclude, place
    def conclude(self, tmp: Path) -> dict:
        """The report of the last candidate tried (accepted, or refused and --force), written into tmp
        beside it; a refusal without --force raises."""
        result, candidates = self.tried[-1], self.candidates
        report = self.report(self.tried)
        print(table(self.label(result["dtype"]), report), flush=True)
        if not result["accepted"] and not self.opt["force"]:
            raise TunekitError(f"export refused: {self.label(result['dtype'])}: {result['gate']['why']}; nothing written "
                               f"at {self.out}.{_hint(self.fmt, candidates, self.opt['requantize'])} --force writes it "
                               "anyway; --min-gain F changes the bound")
        if report.get("dtype_why") and result["dtype"] != candidates[0]:
            print(f"dtype: {report['dtype_why']}", flush=True)
        (tmp / REPORT).write_text(json.dumps(report, indent=2) + "\n")
        return report

    def place(self, build: Callable[[Path], dict]) -> dict:
        """build(tmp) in a temp folder beside --out; what it leaves (and only if it returns) renamed into
        place: one file and its report beside it (GGUF formats), or the folder."""
        if self.fmt in ("gguf", "gguf-adapter"):
            return atomic_file(self.out, build, REPORT)
        result = {}
        atomic_dir(self.out, lambda tmp: result.update(build(tmp)))
        return result

    def report(self, tried: list[dict]) -> dict:
        """The fidelity report of the last candidate tried (what fidelity.json holds)."""
        src, fmt, opt, candidates, result = self.src, self.fmt, self.opt, self.candidates, tried[-1]
        name = gguf_name if fmt.startswith("gguf") else str
        report = {
            "format": fmt, "dtype": None if fmt == "adapter" else name(result["dtype"]),
            "dtype_asked": "auto" if len(candidates) > 1 or opt["dtype"] in (None, "auto") else opt["dtype"],
            "dtype_tried": [{"dtype": t["dtype"], "gain_kept": t["fidelity"]["gain_kept"],
                             "kl_mean": t["fidelity"]["kl_mean"], "accepted": t["accepted"]} for t in tried],
            "requantize": opt["requantize"], "merge_into": self.target,
            "merged_by": None if self.fmt not in ("merged", "gguf") else "streamed" if self.plan is not None
            else "in memory",
            "path": str(self.out), "run_dir": str(src.run.run_dir.absolute()), "method": src.method,
            "base_model": src.base_path, "base_quantize": src.quantize, "checked_by": self.checked_by,
            "device": src.facts.describe(),
            "gate": result["gate"], "accepted": result["accepted"], "forced": bool(opt["force"] and not result["accepted"]),
            "fidelity": result["fidelity"],
            "tokens_compared": "KL (estimated from the trained model's top-k tokens), logit diff (over them), top-1: "
                               "every non-padding position of the held-out batches; loss, perplexity, gain kept: "
                               "response tokens",
            "tunekit_version": __version__,
        }
        if len(candidates) > 1 and result["accepted"]:
            names = ", ".join(gguf_name(c) if fmt == "gguf" else c for c in candidates)
            report["dtype_why"] = (f"{report['dtype']}: the narrowest of {names} that passes the gate "
                                   f"({result['gate']['rule']} >= {result['gate']['bound']:g})"
                                   if result["gate"]["rule"] == "gain_kept" else
                                   f"{report['dtype']}: the narrowest of {', '.join(candidates)} that passes the gate")
        if fmt == "gguf-adapter":  # which base the check applied it over, and which one the user must
            report["base_gguf"] = self.about_base
        report["timings_s"] = dict(self.timings, total=round(time.time() - self.started, 2))
        report["export_s"] = report["timings_s"]["total"]
        return report


def _threads() -> int:
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
