"""The GPU check's report (scripts/gpu_check.py): gpu_check.json rendered as gpu_check.md, and the
figures it reads from a run's log."""

from __future__ import annotations

import re
from pathlib import Path

LOFTQ_LINE = re.compile(r"method lora: LoftQ \(iters=(\d+), r=\d+\).*\(([\d.]+) s\)")


def loftq_figures(log: Path, run_dir: Path, model_dir: Path, device_type: str) -> dict:
    """A run's LoftQ start as its log reports it: its seconds, the SVD work `method.init=auto` counts
    for it (tunekit.methods.lora.start_choice) and so the rate this device reached, against the one
    `auto` assumes for it. {} for a run without a LoftQ start."""
    found = LOFTQ_LINE.search(log.read_text(errors="replace")) if log.is_file() else None
    if not found:
        return {}
    from omegaconf import OmegaConf

    from tunekit.methods.lora.start_choice import SVD_UNITS_PER_S, svd_units
    from tunekit.plan.shape import model_shape
    from tunekit.plan.terms import planned_projections

    iters, seconds = int(found.group(1)), float(found.group(2))
    method = OmegaConf.load(run_dir / "config.yaml").method
    units = svd_units(model_shape(str(model_dir), None), planned_projections(method.target_modules), iters)
    return {"loftq_s": seconds, "loftq_svd_units": units, "loftq_units_per_s": units / max(seconds, 1e-3),
            "loftq_units_per_s_assumed": SVD_UNITS_PER_S.get(device_type, SVD_UNITS_PER_S["cpu"])}


def _fmt(v, nd=1):
    return "-" if v is None else (f"{v:.{nd}f}" if isinstance(v, float) else str(v))


def _sci(v):
    return "-" if v is None else f"{v:.1e}"


def markdown(res: dict) -> str:
    st = res["stages"]
    env = st.get("env", {})
    gpu = env.get("gpu", {})
    lines = [f"# GPU check: {gpu.get('name', 'no GPU')} ({res['mode']}), {res['started']}", ""]
    if env.get("versions"):
        lines += ["Versions: " + ", ".join(f"{k} {v}" for k, v in env["versions"].items() if v)
                  + f"; CUDA {env.get('cuda')}; driver/smi: {env.get('nvidia_smi', '-')}", ""]
    lines += ["| stage | result | wall s | child peak RSS MiB | GPU used peak MiB |", "|---|---|---:|---:|---:|"]
    for name, s in st.items():
        verdict = "ok" if s.get("ok") else ("skipped: " + s["skipped"] if s.get("skipped") else "FAILED")
        lines.append(f"| {name} | {verdict} | {_fmt(s.get('wall_s'))} | {_fmt(s.get('peak_rss_mib'))} | "
                     f"{_fmt(s.get('gpu_used_peak_mib'))} |")
    if st.get("doctor", {}).get("checks"):
        lines += ["", "## doctor", "", "| check | ok |", "|---|---|"]
        lines += [f"| {k} | {c['ok']}{' (' + c['skipped'] + ')' if c.get('skipped') else ''} |"
                  for k, c in st["doctor"]["checks"].items()]
    var = st.get("variants", {}).get("rows") or []
    if var:
        lines += ["", "## training paths (135M shape, the same rows)", "",
                  "| variant | attention kernel | dtype | LoRA path | median step s | tokens/s | peak MiB | setup peak MiB "
                  "| offloaded | skipped steps | loss rel. diff (first, max) | ok |",
                  "|---|---|---|---|---:|---:|---:|---:|---|---:|---|---|"]
        lines += [f"| {r['variant']} | {r.get('kernel') or '-'} | {r.get('compute_dtype', '-')} | {r.get('lora_path', '-')} | "
                  f"{_fmt(r.get('median_step_s'), 3)} | {_fmt(r.get('tokens_per_s'), 0)} | {_fmt(r.get('peak_mib'), 0)} | "
                  f"{_fmt(r.get('setup_peak_mib'), 0)} | {_fmt(r.get('offloaded'))} | {_fmt(r.get('skipped_steps'))} | "
                  f"{_sci(r.get('first_loss_rel_diff'))}, {_sci(r.get('max_loss_rel_diff'))} | {r['ok']} |" for r in var]
    for mode, block in (st.get("bench", {}).get("results") or {}).items():
        lines += ["", f"## bench (packing {mode})", "",
                  "| system | tokens/s | median step s | peak MiB (CUDA allocated, or RSS) | first losses |",
                  "|---|---:|---:|---:|---|"]
        for sname, s in block["systems"].items():
            mem = s.get("cuda_max_allocated_mib", s.get("peak_rss_mib"))
            lines.append(f"| {sname} | {s['tokens_per_s']:.0f} | {s['median_step_s']:.3f} | {_fmt(mem, 0)} | "
                         f"{[round(x, 4) for x in s['first_losses'][:3]]} |")
        for k, r in (block.get("ratios") or {}).items():
            lines.append(f"\n{k}: tokens/s x{r['tokens_per_s']:.2f}, memory x{r['memory']:.2f}, "
                         f"first loss rel. diff {r['first_loss_rel_diff']:.2e}")
    rows = st.get("plan", {}).get("rows") or []
    if rows:
        lines += ["", "## plan against measured (one rank's step peak)", "",
                  "| config | measured MiB | as | setup peak MiB | planned step MiB | planned device MiB | planned/measured | "
                  "dtype | LoRA path | ok |", "|---|---:|---|---:|---:|---:|---:|---|---|---|"]
        lines += [f"| {r['config']} | {_fmt(r.get('measured_mib'))} | {r.get('measured_as', '-')} | "
                  f"{_fmt(r.get('setup_mib'))} | "
                  f"{_fmt(r.get('planned_step_mib'))} | {_fmt(r.get('planned_device_mib'))} | {_fmt(r.get('planned_over_measured'), 3)} | "
                  f"{r.get('compute_dtype', '-')} | {r.get('kernels', '-')} | {r['ok']} |" for r in rows]
    starts = [r for r in rows if r.get("loftq_s") is not None]
    if starts:
        lines += ["", "## LoftQ start (method.init=auto's rate on this device)", "",
                  "| config | seconds | SVD units | units/s measured | units/s assumed |", "|---|---:|---:|---:|---:|"]
        lines += [f"| {r['config']} | {r['loftq_s']:.1f} | {_sci(float(r['loftq_svd_units']))} | "
                  f"{_sci(r['loftq_units_per_s'])} | {_sci(r['loftq_units_per_s_assumed'])} |" for r in starts]
    shapes = [(r["config"], c) for r in rows for c in (r.get("rejected_checks") or r.get("kernel_checks") or [])]
    if shapes:
        lines += ["", "## fused kernel per weight shape (one layer's forward + backward)", "",
                  "| config | shape | fused ms | peft ms | max rel. err | passed |", "|---|---|---:|---:|---:|---|"]
        lines += [f"| {cfg} | {tuple(c.get('shape') or ())} | {_fmt(c.get('fused_ms'), 2)} | {_fmt(c.get('peft_ms'), 2)} | "
                  f"{_sci(c.get('max_rel_err'))} | {c.get('passed')} |" for cfg, c in shapes]
    ex = st.get("export")
    if ex and ex.get("tail"):
        lines += ["", "## export (last lines)", "", "```", *ex["tail"], "```"]
    return "\n".join(lines) + "\n"
