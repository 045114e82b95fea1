"""When an export is refused, and the short table that says why.

The gate is on the figure a user cares about: the fraction of the fine-tune's held-out gain that
the export keeps (tunekit.export.fidelity.gain_kept). An export is refused when it keeps less
than MIN_GAIN_KEPT of it. Why this figure and not KL(trained || exported): KL mixes two things,
the format's own rounding of the *whole* model (which the user chose and which a base model
exported the same way pays too) and the loss of the fine-tune. Measured on the default run
(SmolLM2-135M, QLoRA, 60 steps, benchmarks/export-cpu.md): a bf16 merge moves the distribution by
KL 9e-3 nats/token, mostly bf16 arithmetic in place of the trained model's fp32 residual stream,
yet keeps 98% of the gain (perplexity 9.65 vs 9.53 trained, 21.7 base); a merge that rounds the
adapter away keeps ~0% whatever its KL. 90% is the line between "the export is the fine-tune,
slightly rounded" and "part of the fine-tune is gone": a bf16/fp16/fp32 export of a healthy run
keeps 97-100%, and below 90% a wider dtype is there to keep it.

Where the held-out data cannot measure the fraction (the run gained less than MEASURABLE_GAIN
nats/token, i.e. under 1% perplexity, or got worse; or the fraction's standard error exceeds
MAX_KEPT_SE, as after a few steps on a few held-out tokens: a 2-step run of the default model
gains 0.04 nats on 57 tokens, and an exact fp32 merge then reads 116% +- 15%), the gate falls
back to KL(trained || exported) <= KL_FALLBACK. Adapters reload onto the same base with the same
weights: they must be exact (KL_ADAPTER).
"""

from __future__ import annotations

from typing import Optional

MIN_GAIN_KEPT = 0.90
# Lossy quantized types (GGUF Q4_K_M / Q5_K_M, re-quantized NF4) round every weight of the base
# too: the user chose that loss. What must survive is the bulk of the fine-tune, so the bound is
# lower; an adapter erased by the rounding (NF4 re-quantization snaps a young delta back onto the
# base's NF4 grid) still keeps ~0% and is refused.
MIN_GAIN_KEPT_LOSSY = 0.50
MEASURABLE_GAIN = 0.01
MAX_KEPT_SE = 0.05
# Before a measurable gain: 3e-3 sits above the compute noise of an exact fp32 merge against the
# bf16-computing trained model (1.0e-3, SmolLM2 QLoRA) and below a rounded-away adapter (5.4e-3).
KL_FALLBACK = 3e-3
KL_ADAPTER = 1e-5


def decide(fid: dict, *, adapter: bool, lossy: bool, min_gain: Optional[float] = None,
           kl_threshold: Optional[float] = None) -> dict:
    """The gate's verdict: {"accepted", "rule", "bound", "why"} (why: the one-line reason to refuse)."""
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
    se = fid.get("gain_kept_se")
    if fid["gain"] < MEASURABLE_GAIN or se is None or se > MAX_KEPT_SE:
        bound = KL_FALLBACK if kl_threshold is None else kl_threshold
        ok = fid["kl_mean"] <= bound
        what = (f"the run gained only {fid['gain']:.4f} nats/token on held-out data" if fid["gain"] < MEASURABLE_GAIN
                else f"the fraction kept is measured only to +-{100 * se:.0f}% on these held-out tokens")
        return {"accepted": ok, "rule": "kl (gain not measurable)", "bound": bound,
                "why": None if ok else f"{what}, so KL decides, and KL {fid['kl_mean']:.3e} > {bound:.0e}"}
    bound = min_gain if min_gain is not None else (MIN_GAIN_KEPT_LOSSY if lossy else MIN_GAIN_KEPT)
    ok = fid["gain_kept"] >= bound
    return {"accepted": ok, "rule": "gain_kept", "bound": bound,
            "why": None if ok else f"it keeps {100 * fid['gain_kept']:.1f}% of the fine-tune's held-out gain "
                                   f"(refused below {100 * bound:.0f}%)"}


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
    lines = [f"fidelity of {label}: {f['sequences']} held-out sequences, {f['positions']} tokens "
             f"({f['response_tokens']} response), {report.get('checked_by', '')}".rstrip(", "),
             f"  {'':<11}{'loss':>9}{'ppl':>11}"]
    lines += [f"  {name:<11}{loss:>9.4f}{ppl:>11.4g}  {note}".rstrip() for name, loss, ppl, note in rows]
    lines.append(f"  gain kept {kept} of {f['gain']:.4f} nats/token   KL(trained||exported) {f['kl_mean']:.2e}   "
                 f"max |logit diff| {f['max_abs_logit_diff']:.3f}   top-1 {100 * f['top1_agreement']:.2f}%")
    if report["accepted"]:
        verdict = "OK"
    else:
        verdict = ("REFUSED, written anyway (--force): " if report["forced"] else "REFUSED: ") + g["why"]
    bound = f"{100 * g['bound']:.0f}% of the gain" if g["rule"] == "gain_kept" else f"KL {g['bound']:.0e}"
    lines.append(f"  -> {verdict}  [gate: {bound}]")
    return "\n".join(lines)
