"""`tunekit doctor`: check this build on this machine, end to end, and write a report to paste into a bug.

On a GPU it is what CI cannot do (no CI machine has one):

1. environment: library versions, the device's facts, the compute dtype, whether the fused
   kernel may run here and why;
2. kernels: tunekit's fused LoRA-over-NF4 op against its pure-torch twin on every layer shape of
   the model, in the run's compute dtype (forward and backward), timed against peft + bitsandbytes
   (a correct kernel that is slower passes, with a note: training keeps peft under `auto`);
3. training: the same short qlora run with `kernels.fused_lora=on` and `off`; their losses must
   agree, and each one's tokens/s is reported;
4. resume: a fused run killed (SIGKILL) after its first checkpoint and resumed must end where the
   uninterrupted run ended (bit for bit on the CPU; within a tolerance on CUDA, whose kernels are
   not deterministic);
5. export: `tunekit export --format merged` of the resumed run must pass its fidelity check;
6. two ranks, where two GPUs are visible: `accelerate launch` with 2 processes must match one
   process with twice the gradient accumulation.

On a CPU the same flow runs under Triton's interpreter (TRITON_INTERPRET=1): a functional check of
every step (the test suite runs it on a tiny model), with no meaning for speed.

Each command of a check runs in a child process of its own (tunekit.commands.forkserver): a fresh interpreter
where a GPU is visible; on a CPU-only machine a fork of one server process that imported the stack once.

    tunekit doctor                          # default model and data, 20 steps
    tunekit doctor --model DIR --data F.jsonl --steps 10 --out doctor-report trainer.micro_batch_size=4
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tunekit import TunekitError, __version__
from tunekit.checks import path_fits
from tunekit.commands.forkserver import Launcher, start_method
from tunekit.commands.parse import Parser

# Two runs of the same data differ only by the LoRA layers' arithmetic (fused tiles vs cuBLAS /
# MKL); Adam turns tiny gradient differences into tiny weight differences. Relative loss
# differences allowed per step: fp32 sums in another order (~1e-6 per op) -> 1e-3 leaves room for
# a few steps of Adam; bf16 rounds the LoRA branch differently (peft keeps it in fp32, the kernel
# in bf16: ~2^-8 per op) -> 5e-2. A broken kernel or a lost adapter moves the loss by O(1).
# fp16 rounds 8x finer than bf16 (2^-11 against 2^-8): 1e-2; its runs also scale the loss, and a
# step one run skips on overflow and the other applies shows as a larger gap, which is a finding.
LOSS_TOL = {"float32": 1e-3, "bfloat16": 5e-2, "float16": 1e-2}
# Resumed vs uninterrupted adapter on CUDA (atomics, autotuned tile orders): relative to the
# adapter's largest entry; identical on the CPU.
RESUME_TOL_CUDA = 1e-2


def _versions() -> dict:
    out = {"tunekit": __version__, "python": platform.python_version()}
    for pkg in ("torch", "triton", "bitsandbytes", "peft", "transformers", "accelerate"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = None
    return out


class Doctor:
    def __init__(self, model: str | None, data: str | None, steps: int, out: Path, env: dict,
                 overrides: list[str] | None = None, start: str = "fresh", from_here: bool = False):
        self.model, self.data, self.steps, self.out = model, data, steps, out
        self.overrides = list(overrides or [])
        self.env = env
        self.children = Launcher(env, start, from_here=from_here)
        self.report: dict = {"checks": {}}
        self.log_dir = out / "logs"

    # -------------------------------------------------------------- helpers
    def _train_args(self, run: Path, fused: str, *extra: str) -> list[str]:
        args = ["train", f"output_dir={run}", *settings(self.steps, fused, self.overrides), *extra]
        if self.model:
            args.append(f"model.path={self.model}")
        if self.data:
            args.append(f"data.path={self.data}")
        return args

    def _run(self, name: str, args: list[str], timeout: int = 3600) -> subprocess.CompletedProcess:
        """`tunekit <args>` in a child process; its output also goes to logs/<name>.log."""
        out, err = self.log_dir / f"{name}.stdout", self.log_dir / f"{name}.stderr"
        code = self.children.run(args, out, err, timeout)
        r = subprocess.CompletedProcess(args, code, out.read_text(errors="replace"), err.read_text(errors="replace"))
        out.unlink()
        err.unlink()
        (self.log_dir / f"{name}.log").write_text(
            f"$ {' '.join(self.children.command(args))}\n\n{r.stdout}\n{r.stderr}")
        return r

    def _record(self, name: str, ok: bool, **figures) -> bool:
        self.report["checks"][name] = {"ok": bool(ok), **figures}
        mark = "ok  " if ok else "FAIL"
        detail = ", ".join(f"{k} {v}" for k, v in figures.items() if k != "error" and v is not None)
        print(f"[doctor] {mark} {name}: {detail}{'; ' + figures['error'] if figures.get('error') else ''}", flush=True)
        return ok

    @staticmethod
    def _losses(run: Path) -> list[float]:
        from tunekit.train.tracking import read_metrics

        return [row["loss"] for row in read_metrics(run / "metrics.jsonl") if "loss" in row]

    @staticmethod
    def _tokens_per_s(run: Path) -> float | None:
        from tunekit.train.tracking import read_metrics

        rates = [row["tokens_per_s"] for row in read_metrics(run / "metrics.jsonl") if "tokens_per_s" in row]
        return round(statistics.median(rates[1:] or rates), 1) if rates else None

    # -------------------------------------------------------------- checks
    def environment(self) -> None:
        import torch

        from tunekit.device import facts as dev
        from tunekit.model import resolve_model_path

        device = dev.default_device()
        facts = dev.probe(device)
        dtype = dev.compute_dtype("auto", facts)
        from tunekit_kernels._runtime import triton_importable

        interp = os.environ.get("TRITON_INTERPRET") == "1" or self.env.get("TRITON_INTERPRET") == "1"
        ok, why = dev.fused_kernel_support(facts, dtype, triton_importable(), interp)
        self.facts, self.dtype, self.device = facts, dtype, device
        self.model_path = resolve_model_path(self.model)
        self.report["environment"] = {
            "versions": _versions(), "device": facts.describe(), "cuda_devices": dev.cuda_device_count(),
            "compute_dtype": str(dtype).removeprefix("torch."), "fused_kernel": {"supported": ok, "why": why},
            "model": self.model_path, "interpreter": interp, "torch_cuda": torch.version.cuda,
        }
        print(f"[doctor] {facts.describe()}, compute {dtype}, fused kernel: {why}", flush=True)
        self.fused_ok = ok

    def kernels(self) -> None:
        """The kernel's proof on every layer shape of the real model (what auto runs before step 1).

        Fails on what makes the kernel unusable: a difference from its reference beyond the dtype's
        tolerance, a crash or compile error, or an adapter the proof lost or changed (peft no longer
        collecting the same LoRA tensors with the same values). A correct kernel that is merely
        slower than peft + bitsandbytes passes, with its times and a note: `auto` trains with peft
        there, `on` with the kernel."""
        from tunekit.methods import MethodConfig
        from tunekit.methods.lora.backend import adapter_change, adapter_state, lora_4bit_layers, prove_kernel
        from tunekit.methods import get_method
        from tunekit.model import load_base_model
        from tunekit.device import facts as dev

        if not self.fused_ok:
            self._record("kernels", False, error=self.report["environment"]["fused_kernel"]["why"])
            return
        base = load_base_model(self.model_path, "nf4", self.dtype, self.device)
        model = get_method("lora").apply(base, MethodConfig())
        before = adapter_state(model)
        fused_ms = peft_ms = note = None
        try:
            proof = prove_kernel(lora_4bit_layers(model), self.dtype, self.facts)
            ok, reason, checks = proof.correct, proof.reason, proof.checks
            fused_ms, peft_ms = proof.fused_ms, proof.peft_ms
            if proof.slower:
                note = f"slower than peft ({fused_ms:.2f} ms vs {peft_ms:.2f} ms): training keeps peft under auto"
        except Exception as e:  # noqa: BLE001 - the report must say what broke, whatever it was
            ok, reason, checks = False, f"{type(e).__name__}: {e}", []
        lost = adapter_change(before, model)
        error = f"the proof lost or changed the adapter: {lost}" if lost else None
        ok = ok and not lost
        # the training checks run in child processes on the same GPU: this model must not hold it meanwhile
        del model, base, before
        dev.release_cached_memory(self.device)
        self._record("kernels", ok, detail=reason, fused_ms=fused_ms, peft_ms=peft_ms, note=note,
                     shapes=[{"shape": list(c.shape), "max_rel_err": c.max_rel_err, "fused_ms": c.fused_ms,
                              "peft_ms": c.peft_ms} for c in checks] or None, error=error)

    def training(self) -> None:
        runs = {}
        for fused in ("on", "off"):
            run = self.out / f"run-fused-{fused}"
            start = time.time()
            r = self._run(f"train-fused-{fused}", self._train_args(run, fused))
            runs[fused] = run
            summary = json.loads((run / "summary.json").read_text()) if r.returncode == 0 else {}
            self._record(f"train fused={fused}", r.returncode == 0, wall_s=round(time.time() - start, 1),
                         tokens_per_s=self._tokens_per_s(run), path=summary.get("kernels", {}).get("path"),
                         error=_last_line(r.stderr) if r.returncode else None)
        self.runs = runs
        self.precision_and_memory(runs["off"])
        on, off = (self._losses(runs[k]) for k in ("on", "off"))
        if not on or len(on) != len(off):
            self._record("losses agree", False, error="a run is missing")
            return
        worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(on, off))
        tol = LOSS_TOL.get(self.report["environment"]["compute_dtype"], 5e-2)
        self._record("losses agree", worst <= tol, max_rel_diff=f"{worst:.2e}", tolerance=tol,
                     first_losses=[round(x, 4) for x in on[:3]])

    def precision_and_memory(self, run: Path) -> None:
        """What a training run's tensors and attention actually had, and its peak memory against the plan.

        Facts the CPU cannot show for a GPU: the SDPA kernel torch picks for the run's q/k/v (flash
        needs half-precision inputs and no explicit mask; padded batches carry one, so they take the
        memory-efficient kernel), and CUDA's caching allocator's peak against the plan's step peak."""
        path = run / "summary.json"
        if not path.is_file():
            self._record("precision and memory", False, error="the training run wrote no summary.json")
            return
        summary = json.loads(path.read_text())
        ok, figures = precision_figures(summary)
        self._record("precision and memory", ok, **figures)

    def resume(self) -> None:
        """Kill a fused run after its first checkpoint (SIGKILL), resume it, compare with the full run."""
        full = self.runs["on"]
        run = self.out / "run-resumed"
        args = self._train_args(run, "on")
        first = run / "checkpoints" / f"step-{max(1, self.steps // 2):06d}"
        log = self.log_dir / "resume-killed.log"
        log.write_text(f"$ {' '.join(self.children.command(args))}\n\n")
        proc = self.children.start(args, log, log)
        while not first.exists() and proc.poll() is None:
            time.sleep(0.02)
        killed = proc.poll() is None
        if killed:
            proc.kill()
        proc.wait()
        r = self._run("resume", [*args, "trainer.resume=true"])
        if r.returncode != 0 or not (full / "adapter").is_dir():
            self._record("resume", False, error=_last_line(r.stderr))
            return
        from safetensors.torch import load_file

        a = load_file(str(full / "adapter" / "adapter_model.safetensors"))
        b = load_file(str(run / "adapter" / "adapter_model.safetensors"))
        worst = max(((a[k] - b[k]).abs().max() / a[k].abs().max().clamp_min(1e-12)).item() for k in a)
        tol = 0.0 if self.facts.type == "cpu" else RESUME_TOL_CUDA
        self._record("resume", a.keys() == b.keys() and worst <= tol, killed_mid_run=killed,
                     max_rel_diff=f"{worst:.2e}", tolerance=tol, tensors=len(b))
        self.resumed = run

    def export(self) -> None:
        if not getattr(self, "resumed", None):
            self._record("export", False, error="no resumed run to export")
            return
        out = self.out / "export-merged"
        shutil.rmtree(out, ignore_errors=True)
        r = self._run("export", ["export", str(self.resumed), "--format", "merged", "--out", str(out)])
        report = json.loads((out / "fidelity.json").read_text()) if r.returncode == 0 else {}
        self._record("export", r.returncode == 0, kl_mean=report.get("fidelity", {}).get("kl_mean"),
                     error=_last_line(r.stderr) if r.returncode else None)

    def two_ranks(self) -> None:
        from tunekit.device import facts as dev

        if dev.cuda_device_count() < 2:
            self.report["checks"]["two ranks"] = {"ok": None, "skipped": "fewer than 2 GPUs visible"}
            print("[doctor] skip two ranks: fewer than 2 GPUs visible", flush=True)
            return
        run = self.out / "run-two-ranks"
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "tunekit.commands.main",
               *self._train_args(run, "auto", "trainer.grad_accum=1")]
        one = self.out / "run-one-rank"
        # the launcher starts its ranks as fresh processes itself (only ever on a GPU machine)
        r2 = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=3600)
        (self.log_dir / "two-ranks.log").write_text(f"$ {' '.join(cmd)}\n\n{r2.stdout}\n{r2.stderr}")
        r1 = self._run("one-rank", self._train_args(one, "auto", "trainer.grad_accum=2"))
        if r2.returncode or r1.returncode:
            self._record("two ranks", False, error=_last_line((r2.stderr if r2.returncode else r1.stderr)))
            return
        two, single = self._losses(run), self._losses(one)
        worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(two, single))
        tol = LOSS_TOL.get(self.report["environment"]["compute_dtype"], 5e-2)
        self._record("two ranks", worst <= tol, max_rel_diff=f"{worst:.2e}", tolerance=tol,
                     tokens_per_s=self._tokens_per_s(run))

    # -------------------------------------------------------------- report
    def write(self) -> bool:
        checks = self.report["checks"]
        ok = all(c["ok"] is not False for c in checks.values())
        self.report["ok"] = ok
        (self.out / "report.json").write_text(json.dumps(self.report, indent=2, default=str) + "\n")
        env = self.report["environment"]
        lines = [f"# tunekit doctor: {'all checks passed' if ok else 'SOME CHECKS FAILED'}", "",
                 f"- device: {env['device']}, compute {env['compute_dtype']}, CUDA {env['torch_cuda']}",
                 f"- fused kernel: {env['fused_kernel']['why']}",
                 "- versions: " + ", ".join(f"{k} {v}" for k, v in env["versions"].items()), "",
                 "| check | result | figures |", "|---|---|---|"]
        for name, c in checks.items():
            result = "skipped" if c["ok"] is None else ("ok" if c["ok"] else "FAIL")
            figures = "; ".join(f"{k}: {v}" for k, v in c.items() if k not in ("ok", "shapes"))
            lines.append(f"| {name} | {result} | {figures} |")
        (self.out / "report.md").write_text("\n".join(lines) + "\n")
        print(f"[doctor] report: {self.out / 'report.md'} (and report.json, logs/)", flush=True)
        return ok


def precision_figures(summary: dict) -> tuple[bool, dict]:
    """(ok, figures) of a run's summary.json for the report: the policy, the dtypes the run had, the
    attention kernel, and the measured peak beside the planned one. Not ok where a frozen part or the
    attention inputs are wider than the policy's compute dtype, or a trained part narrower than fp32."""
    p, mem = summary.get("precision", {}), summary.get("memory", {})
    seen = p.get("observed", {})
    attn = seen.get("attention", {})
    compute = p.get("compute")
    wrong = [f"{name} {got}" for name, got in (("embeddings", seen.get("embeddings")), ("head", seen.get("head")),
                                                 ("attention q", attn.get("q"))) if got not in (None, compute)]
    wrong += [f"trained {d}" for d in seen.get("trained", []) if d != "fp32"]
    planned = mem.get("planned_step_peak_mib") if mem.get("measured_as") == "torch max allocated" \
        else mem.get("planned_device_total_mib")
    figures = {"policy": compute, "tf32": p.get("tf32"), "attention": f"{attn.get('q')} q/k/v, "
               f"{'masked, ' if attn.get('mask') else ''}{attn.get('kernel')}",
               "frozen": f"embeddings {seen.get('embeddings')}, head {seen.get('head')}",
               "peak_mib": mem.get("peak_mib"), "planned_mib": planned, "measured_as": mem.get("measured_as"),
               "error": f"wider or narrower than the policy: {', '.join(wrong)}" if wrong else None}
    return not wrong, figures


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="tunekit doctor", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="base model folder (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--data", help="training data file (default: the embedded default data)")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps per training run (default 20)")
    p.add_argument("--out", default="doctor-report", help="report folder (default ./doctor-report)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="config overrides for every training run, as for tunekit train (e.g. trainer.micro_batch_size=4)")
    return p


def settings(steps: int, fused: str, overrides: list[str]) -> list[str]:
    """The config of every training run of the report (with its output_dir, --model and --data)."""
    save = max(1, steps // 2)
    return ["recipe=qlora", f"trainer.max_steps={steps}", f"trainer.save_every={save}", f"trainer.eval_every={save}",
            f"kernels.fused_lora={fused}", "method.dropout=0", *overrides]


def check_overrides(steps: int, overrides: list[str]) -> None:
    """A wrong key or value among the overrides (trainer.lr=nan) stops the doctor now, in the line
    `tunekit train` would print, not in every run's log after the kernel checks. Values only: the
    runs themselves check --model, --data and the targets against that model."""
    from tunekit.commands.compose import compose_configs
    from tunekit.train.checks import check_settings

    compose_configs(settings(steps, "auto", overrides), check=check_settings)


MARKER = ".tunekit-doctor"  # written first into --out: what lets a later doctor replace the folder


def _doctor_output(out: Path) -> bool:
    """Whether `out` is a doctor's own output: its report, or (a doctor that stopped early, e.g. at
    a wrong --model) the marker every doctor writes into --out before anything else. A user's
    folder that merely looks like one (a logs/ of .log files) is not: it is never deleted."""
    if not out.is_dir() or out.is_symlink():
        return False
    return (out / "report.json").is_file() or (out / MARKER).is_file()


def main(argv: list[str]) -> None:
    args = build_parser().parse_args(argv)
    if args.steps < 2:
        raise TunekitError(f"--steps: need at least 2 (a checkpoint halfway, then a resume), got {args.steps}")
    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        raise TunekitError(f"doctor: {bad[0]!r} is not a KEY=VALUE config override")
    check_overrides(args.steps, args.overrides)
    path_fits("--out", args.out)  # a name too long for the file system fails every stat() below
    out = Path(args.out).expanduser().absolute()
    # A doctor that stopped before its report (a wrong --model, an interrupt) leaves only its logs/
    # folder: that is still its own output, which a new run may replace.
    if out.exists() and not _doctor_output(out):
        raise TunekitError(f"--out: {out} exists and is not a doctor report; choose another folder")
    shutil.rmtree(out, ignore_errors=True)
    (out / "logs").mkdir(parents=True)
    (out / MARKER).write_text(json.dumps({"pid": os.getpid(), "started": time.strftime("%Y-%m-%dT%H:%M:%S")}) + "\n")
    env = {**os.environ, "WANDB_MODE": "disabled"}
    interpret_at_start = os.environ.get("TRITON_INTERPRET")
    from tunekit.device import facts as dev

    if dev.cuda_device_count() == 0:
        os.environ["TRITON_INTERPRET"] = env["TRITON_INTERPRET"] = "1"  # the only way the fused path runs on a CPU: functional, not fast
        print("[doctor] no GPU: the fused kernel runs under Triton's interpreter (a functional check; "
              "speed figures mean nothing)", flush=True)
    # The fork server forks from this process, which has computed nothing yet, where triton (read at its
    # import) was not imported under another interpreter setting than the children get
    from_here = "triton" not in sys.modules or interpret_at_start == env.get("TRITON_INTERPRET")
    doctor = Doctor(args.model, args.data, args.steps, out, env, args.overrides,
                    start=start_method(dev.cuda_device_count()), from_here=from_here)
    try:
        doctor.environment()
        doctor.kernels()
        doctor.training()
        doctor.resume()
        doctor.export()
        doctor.two_ranks()
    finally:
        doctor.children.close()  # the fork server, where there is one
    if not doctor.write():
        sys.exit(1)
