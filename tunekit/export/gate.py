"""When an export is refused, and the short table that says why.

The gate is on the figure a user cares about: the fraction of the fine-tune's held-out gain that
the export keeps (tunekit.export.fidelity.gain_kept). An export is refused when it keeps less
than MIN_GAIN_KEPT of it. Why this figure and not KL(trained || exported): KL mixes two things,
the format's own rounding of the *whole* model (which the user chose and which a base model
exported the same way pays too) and the loss of the fine-tune. Measured on the default run
(SmolLM2-135M, QLoRA, 60 steps, benchmarks/export/export-cpu.md): a bf16 merge moves the distribution by
KL 9e-3 nats/token, mostly bf16 arithmetic in place of the trained weights' exact (fp32) function,
yet keeps 98% of the gain (perplexity 9.65 vs 9.53 trained, 21.7 base); a merge that rounds the
adapter away keeps ~0% whatever its KL. 90% is the line between "the export is the fine-tune,
slightly rounded" and "part of the fine-tune is gone": a bf16/fp16/fp32 export of a healthy run
keeps 97-100%, and below 90% a wider dtype is there to keep it.

The fraction decides only where the held-out tokens can tell which side of the bound it is on:
the run gained at least MEASURABLE_GAIN nats/token (1% perplexity) and the fraction lies at least
SE_MARGIN standard errors (fidelity.gain_kept) from the bound. Otherwise (a run that gained
nothing, or a few steps judged on a few tokens: a 2-step run of the default model gains 0.04
nats on 57 tokens, and an exact fp32 merge then reads 116% +- 15%) the gate falls back to
KL(trained || exported) <= KL_FALLBACK; for a merge into the original weights, KL against the
exact fp32 merge. Adapters reload onto the same base with the same weights: they must be exact
(KL_ADAPTER).

The loss cannot see every change a user cares about: on a task with short answers most of the
loss gain is the answer's format, which an export can keep while its answers change. So an
export the loss rule accepts must also keep the trained model's *task* result where the run has
held-out rows with answers (tunekit.export.task: accuracy over a closed answer set, else exact
match, scored as `tunekit eval` scores): at least TASK_MIN_GAIN_KEPT of the task gain over the
base, refused only when the rows lost outnumber the rows won beyond chance.
"""

from __future__ import annotations

import math

from typing import Optional

MIN_GAIN_KEPT = 0.90
# Lossy quantized types (GGUF Q4_K_M / Q5_K_M, re-quantized NF4) round every weight of the base
# too: the user chose that loss. What must survive is the bulk of the fine-tune, so the bound is
# lower; an adapter erased by the rounding (NF4 re-quantization snaps a young delta back onto the
# base's NF4 grid) still keeps ~0% and is refused.
MIN_GAIN_KEPT_LOSSY = 0.50
# Merged into the original high-precision weights, the export is not the trained model (KL 0.5
# on the default run: NF4 rounding of a 135M model is far from small) and can beat it (default
# run: ppl 8.4 vs 9.5 trained, because the original base is itself 14.8 vs 19.8 for NF4). What must
# hold there too is that the fine-tune still does most of its work on those weights: below half,
# the export is mostly a better base that happens to score well.
MIN_ADAPTER_EFFECT = 0.50
MEASURABLE_GAIN = 0.01
SE_MARGIN = 2.0
# Before a measurable gain: 3e-3 sits far above what an exact fp32 merge reads against the trained
# model, which the check computes in fp32 (summation order only), and below a rounded-away adapter
# (5.4e-3 on SmolLM2 QLoRA).
KL_FALLBACK = 3e-3
KL_ADAPTER = 1e-5
# Both bounds apply to the top-k estimate of KL (tunekit.export.fidelity.kl_topk), unchanged. Its
# error is R (KL_tail - KL_top) with R the trained model's mass beyond its top 64 tokens: for rounding
# noise spread over the vocabulary the two divergences agree (the estimate is the KL up to how
# concentrated the top tokens' weights are), and where an export moves the top tokens most, as a
# rounded-away adapter does (it loses the update that raised them), KL_top is the larger and the
# estimate reads high: what the exact KL would refuse, it refuses. It under-reads only a change
# confined to the tail, by at most R times the tail's divergence. Identical logits give exactly 0,
# so KL_ADAPTER still means "reloads exactly". The report carries R (kl_tail_mass).
# The task check (tunekit.export.task): the share of the trained model's task gain (accuracy or
# exact match over base) an export must keep, when the rows can tell (McNemar's statistic over the
# rows lost and won >= TASK_Z, about 2% one-sided). Exports that only round the trained model
# (bf16/fp16/f16 of the dequantized merge, the adapter itself) flip a row or two either way and
# keep ~100%; a merge into other weights that changes answers keeps less (see
# benchmarks/export/deploy-*.md for the figures behind these bounds).
TASK_MIN_GAIN_KEPT = 0.95
TASK_MIN_GAIN_KEPT_LOSSY = 0.80
TASK_Z = 2.0
# The task metrics' names in the verdicts and the table (a preference run's: tunekit.export.task.PreferenceCheck)
METRIC_NAMES = {"accuracy": "accuracy", "exact_match": "exact match", "preference_accuracy": "preference accuracy"}


def decide(fid: dict, *, adapter: bool, lossy: bool, min_gain: Optional[float] = None,
           kl_threshold: Optional[float] = None, min_task_gain: Optional[float] = None) -> dict:
    """The gate's verdict: {"accepted", "rule", "bound", "why"} (why: the one-line reason to refuse).
    The loss (or KL) rule first; an export it accepts must then keep the task (task_verdict)."""
    verdict = _decide_loss(fid, adapter=adapter, lossy=lossy, min_gain=min_gain, kl_threshold=kl_threshold)
    if verdict["accepted"] and fid.get("task"):
        verdict = task_verdict(fid["task"], lossy, min_task_gain) or verdict
    return verdict


def task_verdict(task: dict, lossy: bool, min_task_gain: Optional[float] = None) -> Optional[dict]:
    """A refusal when the export keeps less than the bound of the trained model's task gain and
    the rows lost against the rows won say it is not chance; else None."""
    if task.get("gain_kept") is None:  # the run gained nothing on the task: nothing to keep
        return None
    bound = min_task_gain if min_task_gain is not None else (TASK_MIN_GAIN_KEPT_LOSSY if lossy else TASK_MIN_GAIN_KEPT)
    if task["gain_kept"] >= bound or task["z"] < TASK_Z:
        return None
    name = METRIC_NAMES.get(task["metric"], task["metric"])
    return {"accepted": False, "rule": "task", "bound": bound,
            "why": f"its {name} on {task['rows']} held-out rows is {100 * task['exported']:.1f}% where the trained "
                   f"model's is {100 * task['trained']:.1f}% (base {100 * task['base']:.1f}%): it keeps "
                   f"{100 * task['gain_kept']:.1f}% of the task gain (refused below {100 * bound:.0f}%; "
                   f"{task['lost_rows']} rows lost, {task['won_rows']} won)"}


def _decide_loss(fid: dict, *, adapter: bool, lossy: bool, min_gain: Optional[float] = None,
                 kl_threshold: Optional[float] = None) -> dict:
    broken = [k for k in ("loss_exported", "kl_mean", "gain_kept") if isinstance(fid.get(k), float)
              and not math.isfinite(fid[k])]
    if broken:  # every comparison below is False for a NaN: say what it is rather than which rule it fell to
        return {"accepted": False, "rule": "finite", "bound": None,
                "why": f"the exported model's {broken[0]} is {fid[broken[0]]} (logits not finite: a weight beyond the "
                       "dtype's range, e.g. over 65504 in f16?)"}
    if fid.get("tokenizer_agreement", 1.0) < 1.0:
        return {"accepted": False, "rule": "tokenizer", "bound": 1.0,
                "why": f"the exported tokenizer encodes only {100 * fid['tokenizer_agreement']:.1f}% of held-out texts alike"}
    if adapter:
        bound = KL_ADAPTER if kl_threshold is None else kl_threshold
        ok = fid["kl_mean"] <= bound
        return {"accepted": ok, "rule": "kl", "bound": bound,
                "why": None if ok else f"KL {fid['kl_mean']:.3e} nats/token > {bound:.0e} (an adapter reloads exactly)"}
    if kl_threshold is not None and fid["kl_mean"] > kl_threshold:
        return {"accepted": False, "rule": "kl", "bound": kl_threshold,
                "why": f"KL {fid['kl_mean']:.3e} nats/token > --kl-threshold {kl_threshold:g}"}
    bound = min_gain if min_gain is not None else (MIN_GAIN_KEPT_LOSSY if lossy else MIN_GAIN_KEPT)
    kept, se = fid.get("gain_kept"), fid.get("gain_kept_se")
    if fid["gain"] < MEASURABLE_GAIN or kept is None or se is None or abs(kept - bound) < SE_MARGIN * se:
        kl_bound = KL_FALLBACK if kl_threshold is None else kl_threshold
        ok = fid["kl_mean"] <= kl_bound
        what = (f"the run gained only {fid['gain']:.4f} nats/token on held-out data" if fid["gain"] < MEASURABLE_GAIN
                else f"the fraction kept ({100 * kept:.0f}% +- {100 * se:.0f}%) is too close to {100 * bound:.0f}% "
                     "for these held-out tokens to tell")
        return {"accepted": ok, "rule": "kl (gain not measurable)", "bound": kl_bound,
                "why": None if ok else f"{what}, so KL decides, and KL {fid['kl_mean']:.3e} > {kl_bound:.0e}"}
    ok = kept >= bound
    verdict = {"accepted": ok, "rule": "gain_kept", "bound": bound,
               "why": None if ok else f"it keeps {100 * kept:.1f}% of the fine-tune's held-out gain "
                                      f"(refused below {100 * bound:.0f}%)"}
    effect = fid.get("adapter_effect")
    effect_se = fid.get("adapter_effect_se") or 0.0
    if ok and effect is not None and effect < MIN_ADAPTER_EFFECT - SE_MARGIN * effect_se:
        verdict.update(accepted=False, rule="adapter_effect", bound=MIN_ADAPTER_EFFECT,
                       why=f"on the original weights the fine-tune does only {100 * effect:.1f}% of what it did on "
                           f"the base it trained over (refused below {100 * MIN_ADAPTER_EFFECT:.0f}%): the export is "
                           "mostly a different base")
    return verdict


def table(label: str, report: dict) -> str:
    """The short table printed after each measured export (also the fidelity.json figures)."""
    f, g = report["fidelity"], report["gate"]
    rows = [("base", f["loss_base"], f["ppl_base"], "the model the run trained over")]
    if "loss_merge_base" in f:
        rows.append(("merge base", f["loss_merge_base"], f["ppl_merge_base"], "the weights the export merged into"))
    rows += [("trained", f["loss_trained"], f["ppl_trained"], ""), ("exported", f["loss_exported"], f["ppl_exported"], "")]
    kept = "n/a" if f["gain_kept"] is None else f"{100 * f['gain_kept']:.1f}%"
    if f.get("gain_kept_se") is not None:
        kept += f" +- {100 * f['gain_kept_se']:.1f}%"
    if f.get("adapter_effect") is not None:
        kept += f" (from the merge base: {100 * f['adapter_effect']:.1f}%)"
    lines = [f"fidelity of {label}: {f['sequences']} held-out sequences, {f['positions']} tokens "
             f"({f['response_tokens']} response), {report.get('checked_by', '')}".rstrip(", "),
             f"  {'':<11}{'loss':>9}{'ppl':>11}"]
    lines += [f"  {name:<11}{loss:>9.4f}{ppl:>11.4g}  {note}".rstrip() for name, loss, ppl, note in rows]
    est = f" ({f['kl_estimate'].split()[0]} est.)" if f.get("kl_estimate") else ""
    lines.append(f"  gain kept {kept} of {f['gain']:.4f} nats/token   KL(trained||exported) {f['kl_mean']:.2e}{est}   "
                 f"max |logit diff| {f['max_abs_logit_diff']:.3f}   top-1 {100 * f['top1_agreement']:.2f}%")
    if f.get("task"):
        t = f["task"]
        kept = "n/a (no task gain)" if t["gain_kept"] is None else f"{100 * t['gain_kept']:.1f}%"
        lines.append(f"  task ({METRIC_NAMES.get(t['metric'], t['metric'])}, {t['rows']} rows): "
                     f"base {100 * t['base']:.1f}%  trained {100 * t['trained']:.1f}%  exported "
                     f"{100 * t['exported']:.1f}%  task gain kept {kept} ({t['lost_rows']} rows lost, "
                     f"{t['won_rows']} won)")
    elif f.get("task_skipped"):
        lines.append(f"  task: not scored ({f['task_skipped']})")
    if "half_linears" in f:
        lines.append(f"  {f['half_linears']}")
    if "kl_vs_exact_merge" in f:
        lines.append(f"  KL(exact fp32 merge||exported) {f['kl_vs_exact_merge']:.2e}")
    if report["accepted"]:
        verdict = "OK"
    else:
        verdict = ("REFUSED, written anyway (--force): " if report["forced"] else "REFUSED: ") + g["why"]
    bound = (f"KL {g['bound']:.0e}" if g["rule"].startswith("kl") else "identical tokenization"
             if g["rule"] == "tokenizer" else f"{100 * g['bound']:.0f}% of the task gain" if g["rule"] == "task"
             else f"{100 * g['bound']:.0f}% of the gain")
    if g.get("against"):
        bound += f" vs {g['against']}"
    lines.append(f"  -> {verdict}  [gate: {bound}]")
    return "\n".join(lines)
