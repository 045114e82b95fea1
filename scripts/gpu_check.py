#!/usr/bin/env python
"""The GPU check: what no CI machine can show, in one command on a bare GPU machine.

No network and no model download: every model is a random-init Llama built from a config (speed
and memory do not depend on the values; the doctor's and the export's checks compare tunekit with
itself and with peft, which holds for any weights). Stages, each a child process of its own with a
time cap, so that a crash or a hang costs that stage and not the report:

  env      device, driver and library versions
  models   random-init folders: a SmolLM2-135M-shaped model (the doctor's), a ~1B Llama (the
           benchmark's and the export's), Llama-3-8B's widths with 4 blocks (the planner's)
  doctor   `tunekit doctor` on the 135M shape: fused kernel vs twin, fused vs peft training,
           kill + resume, export fidelity
  bench    scripts/bench_train.py on the 1B at 2048 tokens, packed: tunekit against TRL + peft +
           bitsandbytes on the same batches (tokens/s, peak memory, first losses)
  plan     four short `tunekit train` runs; each run's summary holds the measured peak beside the
           plan's figure for the same settings; the last starts from LoftQ (its SVDs' rate on the GPU)
  export   `tunekit export --format merged` of the 1B qlora run (fidelity report, peak memory)
  variants the 135M shape, one short run per training path a GPU alone can time (last: it gets
           the time the stages before it leave): packed rows attending per example or through the
           dense mask, fp16 with loss scaling and the fused kernel, cuDNN attention allowed, padded
           rows of varied length, checkpointing with and without activation offloading on a side
           stream: step times, peaks, first losses, skipped steps

Writes gpu_check.json, gpu_check.md and logs.tar.gz (every stage's log and report) to --out.

    bash scripts/gpu_check.sh --prepare          # here, with network: .carry/ (packages + tokenizer)
    bash scripts/gpu_check.sh --out DIR          # there: the whole check, at most --budget seconds
    bash scripts/gpu_check.sh --tiny --out DIR   # the same flow on a tiny model, on a CPU (the suite runs it)
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

from gpu_check_data import long_rows, pairs_rows  # scripts/ is on the path: this script's own folder
from gpu_check_report import loftq_figures, markdown

CLI = "tunekit.commands.main"  # the module a `tunekit` command runs

REPO = Path(__file__).resolve().parents[1]
STAGES = ("env", "models", "doctor", "bench", "plan", "export", "variants")

# Model shapes (LlamaConfig keyword arguments). "vocab": None takes the tokenizer's size.
SHAPES = {
    "small": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                  num_key_value_heads=3, tie_word_embeddings=True, vocab=None),  # SmolLM2-135M
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, tie_word_embeddings=True, vocab=None),  # bench_train's gpu-1b
    "8b-4blocks": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=4, num_attention_heads=32,
                       num_key_value_heads=8, tie_word_embeddings=False, vocab=128256, rope_theta=500000.0),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, tie_word_embeddings=True, vocab=None),
}
QUIET = ["trainer.eval_every=1000000", "trainer.save_every=1000000", "trainer.eval_samples=0"]
# The variants stage: (label, overrides on top of settings()["variants_base"]). The first is the
# reference the others' losses are compared with.
VARIANTS = [
    ("packed, per-example attention", "data.packing=true"),
    ("packed, dense block-diagonal mask", "data.packing=true kernels.packed_attention=false"),
    ("packed, fp16 + loss scaling, fused kernel", "data.packing=true model.dtype=fp16 kernels.fused_lora=on"),
    ("packed, cuDNN attention allowed", "data.packing=true kernels.cudnn_attention=true"),
    ("padded, varied lengths", "data.packing=false"),
    ("packed, checkpointing", "data.packing=true model.gradient_checkpointing=true model.offload_activations=false"),
    ("packed, checkpointing + offload", "data.packing=true model.gradient_checkpointing=true "
                                        "model.offload_activations=true"),
    # preference tuning over the 4-bit base: chosen and rejected in one forward pass, the reference
    # from the same base with the adapter switched off, log-probabilities from the head in chunks.
    # {pairs} is the check's generated pairs file; its loss is not comparable with the SFT rows'.
    ("DPO over qlora, generated pairs", "objective=preference data.path={pairs}"),
]


def settings(tiny: bool) -> dict:
    """What each stage runs: the GPU sizes, or the same flow shrunk for a CPU dry run."""
    if tiny:
        return {
            "models": {"small": "tiny", "1b": "tiny", "8b-4blocks": "tiny"},
            # small batches and no recomputation: every LoRA layer runs in Triton's (slow) interpreter;
            # one 2-token sample per evaluation (each token is 14 interpreted kernel calls)
            "doctor": ["--steps", "4", "trainer.micro_batch_size=2", "trainer.grad_accum=1", "data.max_seq_len=64",
                       "data.val_fraction=0.1", "data.max_val_examples=2", "model.gradient_checkpointing=false",
                       "trainer.lr=1e-3", "trainer.eval_samples=1", "trainer.eval_max_new_tokens=2"],
            # the suite's benchmark check reads this run (tests/kernels/test_doctor.py)
            "bench": ["--config", "cpu", "--steps", "2", "--warmup", "1", "--reps", "1", "--packing", "on",
                      "--seq-len", "64", "--micro-batch-size", "4", "--grad-accum", "2", "--peak-reps", "2"],
            # one row: the flow of the GPU's three (each row is a process start here)
            "plan": [("qlora ckpt, LoftQ start, 2x128", "1b", "recipe=qlora model.gradient_checkpointing=true "
                      "trainer.micro_batch_size=2 data.max_seq_len=128 kernels.fused_lora=off method.init=loftq")],
            "plan_steps": 2,
            # the GPU's variants cut to the two the comparison needs (offloading and cuDNN are GPU-only;
            # fp16 with loss scaling trains on the CPU in tests/train/test_loss_scale.py, and every
            # variant costs a process start here)
            "variants_base": ["recipe=qlora", "trainer.micro_batch_size=2", "data.max_seq_len=64", "trainer.max_steps=3",
                              "kernels.fused_lora=off", "model.gradient_checkpointing=false"],
            "variants": VARIANTS[:2],
        }
    return {
        "models": {"small": "small", "1b": "1b", "8b-4blocks": "8b-4blocks"},
        "doctor": ["--steps", "6", "trainer.micro_batch_size=8", "data.max_seq_len=512"],
        "bench": ["--config", "gpu-1b", "--steps", "8", "--warmup", "3", "--reps", "1"],
        "plan": [("1b qlora ckpt, 4x2048", "1b", "recipe=qlora model.gradient_checkpointing=true "
                  "trainer.micro_batch_size=4 data.max_seq_len=2048"),
                 # offloading forced on: the side-stream copies run on a GPU, and their plan is checked
                 ("8b widths 4 blocks qlora ckpt offload, 2x2048", "8b-4blocks", "recipe=qlora "
                  "model.gradient_checkpointing=true model.offload_activations=true trainer.micro_batch_size=2 "
                  "data.max_seq_len=2048"),
                 ("1b lora bf16 no ckpt, 2x2048", "1b", "recipe=lora model.gradient_checkpointing=false "
                  "trainer.micro_batch_size=2 data.max_seq_len=2048"),
                 # a full fine-tune's stochastic bf16 weight copies drawn on the GPU, and their planned bytes
                 ("small full bf16, 2x512", "small", "recipe=full trainer.micro_batch_size=2 data.max_seq_len=512"),
                 # last (skipped when the budget runs out): LoftQ's SVDs on the GPU at Llama-3-8B's widths,
                 # the rate method.init=auto assumes for cuda, and the start's memory in the setup peak
                 ("8b widths 4 blocks qlora LoftQ start, 2x2048", "8b-4blocks", "recipe=qlora method.init=loftq "
                  "model.gradient_checkpointing=true trainer.micro_batch_size=2 data.max_seq_len=2048")],
        "plan_steps": 3,
        "variants_base": ["recipe=qlora", "trainer.micro_batch_size=8", "data.max_seq_len=512", "trainer.max_steps=6",
                          "kernels.fused_lora=off", "model.gradient_checkpointing=false"],
        "variants": VARIANTS,
    }


def read_metrics(path: Path) -> list[dict]:
    """A run's metrics.jsonl, as tunekit reads it (imported here, not at the top: the script parses
    its arguments, and --prepare runs, before tunekit need be importable)."""
    from tunekit.train.tracking import read_metrics as read

    return read(path)


# ---------------------------------------------------------------------------- children
class GpuSampler:
    """Polls nvidia-smi for the device's used memory while a stage runs (context and every process
    included: what a user sees), when nvidia-smi is there."""

    def __init__(self):
        self.peak_mib, self._stop, self._thread = None, threading.Event(), None
        self.exe = shutil.which("nvidia-smi")

    def __enter__(self):
        if self.exe:
            self._thread = threading.Thread(target=self._poll, daemon=True)
            self._thread.start()
        return self

    def _poll(self):
        while not self._stop.wait(0.5):
            try:
                out = subprocess.run([self.exe, "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                     capture_output=True, text=True, timeout=5).stdout.split()
                used = max(int(v) for v in out)
                self.peak_mib = used if self.peak_mib is None else max(self.peak_mib, used)
            except (OSError, ValueError, subprocess.SubprocessError):
                pass

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=6)


def run(cmd: list[str], log: Path, timeout: float, cwd: Path) -> dict:
    """Run one child in a session of its own; kill the whole group at the deadline. Returns its exit
    code, wall time, its own peak RSS (wait4) and the device's peak used memory while it ran."""
    t0 = time.monotonic()
    with open(log, "w") as fh, GpuSampler() as gpu:
        fh.write("$ " + " ".join(cmd) + "\n")
        fh.flush()
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=cwd, start_new_session=True)
        timed_out, rusage = False, None
        while True:
            pid, status, rusage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                rc = os.waitstatus_to_exitcode(status)
                break
            if time.monotonic() - t0 > timeout:
                timed_out = True
                os.killpg(proc.pid, signal.SIGKILL)
                _, status, rusage = os.wait4(proc.pid, 0)
                rc = os.waitstatus_to_exitcode(status)
                break
            time.sleep(0.2)
        proc.returncode = rc
    out = {"rc": rc, "wall_s": round(time.monotonic() - t0, 1), "timed_out": timed_out,
           "peak_rss_mib": round(rusage.ru_maxrss / 1024, 1), "log": log.name}
    if gpu.peak_mib is not None:
        out["gpu_used_peak_mib"] = gpu.peak_mib
    return out


def run_forked(forks, module: str, args: list[str], log: Path, timeout: float, cwd: Path) -> dict:
    """run() for `python -m module args` forked from the dry run's server: the same record (its
    peak RSS from the server's wait4), in `cwd` as a fresh child would be."""
    t0 = time.monotonic()
    with open(log, "w") as fh:
        fh.write("$ " + " ".join([sys.executable, "-m", module, *args]) + "\n")
    child = forks.server.start(module, args, log, log, cwd=cwd)
    rc = child.wait(timeout)
    maxrss = getattr(child, "maxrss_kib", None)
    return {"rc": rc, "wall_s": round(time.monotonic() - t0, 1), "timed_out": rc == -9,
            "peak_rss_mib": None if maxrss is None else round(maxrss / 1024, 1), "log": log.name}


def tail(log: Path, n: int = 12) -> list[str]:
    return log.read_text(errors="replace").splitlines()[-n:]


# ---------------------------------------------------------------------------- stages
class Check:
    def __init__(self, args):
        self.args, self.out = args, args.out
        self.work = args.work
        self.s = settings(args.tiny)
        self.deadline = time.monotonic() + args.budget
        self.result: dict = {"started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                             "mode": "tiny (CPU dry run)" if args.tiny else "gpu", "stages": {}}
        self.model_dirs: dict[str, Path] = {}
        self.runs: dict[str, Path] = {}
        # The dry run's `tunekit` commands fork from one process that imported the stack once
        # (tunekit.commands.forkserver, as the test suite does): each fresh start costs seconds of
        # imports on a small CPU. On a GPU every command starts fresh (CUDA does not survive a fork).
        self.forks = None
        if args.tiny:
            from tunekit.commands.forkserver import Launcher, start_method

            env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "scripts"),
                                                                              os.environ.get("PYTHONPATH")]))}
            # On a CPU the fused kernel runs only under Triton's interpreter, which triton reads when it is
            # imported: the server imports it (through bitsandbytes) for every child it forks, the doctor
            # included, whose kernel check runs in its own process
            env["TRITON_INTERPRET"] = "1"
            self.forks = Launcher(env, start_method(0))

    def left(self, cap: float) -> float:
        return min(cap, self.deadline - time.monotonic())

    def child(self, name: str, cmd: list[str], cap: float) -> dict:
        log = self.work / f"{name}.log"
        if self.forks is not None and cmd[:3] == self.cli():
            return run_forked(self.forks, CLI, cmd[3:], log, self.left(cap), self.work)
        if self.forks is not None and cmd[:2] == [sys.executable, "-c"]:  # a snippet stage
            return run_forked(self.forks, "gpu_check_code", cmd[2:], log, self.left(cap), self.work)
        return run(cmd, log, self.left(cap), self.work)

    def cli(self, *args: str) -> list[str]:
        return [sys.executable, "-m", CLI, *args]

    # env ------------------------------------------------------------------------------------
    def env(self) -> dict:
        code = ("import json, platform, torch, importlib.metadata as m\n"
                "v = {}\n"
                "for p in ('torch','triton','transformers','peft','bitsandbytes','accelerate','trl','datasets'):\n"
                "    try: v[p] = m.version(p)\n"
                "    except Exception: v[p] = None\n"
                "d = {'python': platform.python_version(), 'versions': v, 'cuda': torch.version.cuda}\n"
                "if torch.cuda.is_available():\n"
                "    p = torch.cuda.get_device_properties(0)\n"
                "    d['gpu'] = {'name': p.name, 'capability': list(torch.cuda.get_device_capability(0)),\n"
                "                'memory_gib': round(p.total_memory / 2**30, 1), 'count': torch.cuda.device_count()}\n"
                "from tunekit.device.facts import probe\n"
                "dev = torch.device('cuda' if torch.cuda.is_available() else 'cpu')\n"
                "d['tunekit_facts'] = probe(dev).describe()\n"
                "print('ENV ' + json.dumps(d))\n")
        r = self.child("env", [sys.executable, "-c", code], 120)
        line = next((ln for ln in (self.work / "env.log").read_text().splitlines() if ln.startswith("ENV ")), None)
        if line:
            r.update(json.loads(line[4:]))
        smi = shutil.which("nvidia-smi")
        if smi:
            q = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                               capture_output=True, text=True)
            r["nvidia_smi"] = q.stdout.strip()
        r["host"] = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()}
        r["ok"] = r["rc"] == 0 and line is not None
        return r

    # models ---------------------------------------------------------------------------------
    def models(self) -> dict:
        wanted = dict.fromkeys(self.s["models"].values())
        specs = {name: SHAPES[name] for name in wanted}
        code = ("import json, sys, torch\n"
                "from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM\n"
                "tok_dir, root, specs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])\n"
                "tok = AutoTokenizer.from_pretrained(tok_dir)\n"
                "dev = 'cuda' if torch.cuda.is_available() else 'cpu'\n"
                "for name, spec in specs.items():\n"
                "    spec = dict(spec); vocab = spec.pop('vocab') or len(tok)\n"
                "    cfg = LlamaConfig(vocab_size=vocab, max_position_embeddings=4096, bos_token_id=tok.bos_token_id,\n"
                "                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **spec)\n"
                "    torch.manual_seed(0)\n"
                "    with torch.device(dev):\n"
                "        model = LlamaForCausalLM(cfg).to(torch.bfloat16)\n"
                "    out = f'{root}/{name}'\n"
                "    model.save_pretrained(out); tok.save_pretrained(out)\n"
                "    n = sum(p.numel() for p in model.parameters())\n"
                "    print('MODEL ' + json.dumps({'name': name, 'params': n}), flush=True)\n"
                "    del model\n")
        root = self.work / "models"
        r = self.child("models", [sys.executable, "-c", code, str(self.args.tokenizer), str(root), json.dumps(specs)],
                       180)
        params = {}
        for ln in (self.work / "models.log").read_text().splitlines():
            if ln.startswith("MODEL "):
                m = json.loads(ln[6:])
                params[m["name"]] = m["params"]
        for role, name in self.s["models"].items():
            if name in params:
                self.model_dirs[role] = root / name
        r["params"] = params
        r["ok"] = r["rc"] == 0 and len(params) == len(specs)
        return r

    # doctor ---------------------------------------------------------------------------------
    def doctor(self) -> dict:
        report = self.work / "doctor"
        data = ["--data", str(self.args.data)] if self.args.data else []
        # 360 s: on an H200 (2026-11-27) 280 s ended before the resume and export checks
        r = self.child("doctor", self.cli("doctor", "--model", str(self.model_dirs["small"]), "--out", str(report),
                                          *data, *self.s["doctor"]), 360)
        rep = report / "report.json"
        if rep.is_file():
            data = json.loads(rep.read_text())
            r["checks"] = {k: {"ok": c.get("ok"), **({"skipped": c["skipped"]} if "skipped" in c else {}),
                               **({"error": str(c["error"])[:300]} if "error" in c else {})}
                           for k, c in data.get("checks", {}).items()}
            r["ok"] = bool(data.get("ok"))
        else:
            r["ok"] = False
        return r

    # variants -------------------------------------------------------------------------------
    def variants(self) -> dict:
        """One short run per training path on the same rows. On the first H200 run, rows of varied
        length stepped ~10x slower per token than fixed-length ones (cuDNN attention suspected); the
        fp16, offloading and per-example attention paths had never run on a GPU."""
        rows = []
        data = [f"data.path={self.args.data}"] if self.args.data else []
        chosen = list(enumerate(self.s["variants"])) if self.args.variants is None else \
            [(i, v) for i, v in enumerate(VARIANTS) if i in self.args.variants]
        for i, (label, overrides) in chosen:
            preference = "objective=preference" in overrides
            overrides = overrides.replace("{pairs}", str(pairs_rows(self.work)))
            run_dir = self.work / f"run-variant-{i}"
            r = self.child(f"variant-{i}", self.cli("train", *self.s["variants_base"], *([] if preference else data),
                                                    *overrides.split(),
                                                    *QUIET, f"model.path={self.model_dirs['small']}",
                                                    f"output_dir={run_dir}"),
                           100 if "fp16" in overrides else 60)  # fp16's first step compiles the kernel's fp16 configs
            steps = [m for m in read_metrics(run_dir / "metrics.jsonl") if "step_time_s" in m]
            timed = sorted(m["step_time_s"] for m in steps[2:]) or [None]
            row = {"variant": label, "overrides": overrides, **r, "median_step_s": timed[len(timed) // 2],
                   "tokens": sum(m["input_tokens"] for m in steps), "losses": [m["loss"] for m in steps]}
            summary = run_dir / "summary.json"
            if summary.is_file():
                sm = json.loads(summary.read_text())
                mem = sm.get("memory", {})
                row.update(kernel=sm["precision"]["observed"]["attention"].get("kernel"),
                           compute_dtype=sm.get("compute_dtype"), lora_path=sm.get("kernels", {}).get("path"),
                           peak_mib=mem.get("peak_mib"), setup_peak_mib=mem.get("setup_peak_mib"),
                           offloaded=mem.get("offloaded_activations"),
                           skipped_steps=sm.get("loss_scaling", {}).get("skipped_steps"),
                           loss_scale=sm.get("loss_scaling", {}).get("scale"))
            if steps and steps[2:]:
                row["tokens_per_s"] = round(sum(m["input_tokens"] for m in steps[2:])
                                            / sum(m["step_time_s"] for m in steps[2:]), 1)
            if steps and "rewards/margins" in steps[-1]:
                row["reward_margins"] = [m.get("rewards/margins") for m in steps]
            if rows and rows[0]["losses"] and row["losses"] and not preference:
                ref = rows[0]["losses"]
                row["first_loss_rel_diff"] = abs(row["losses"][0] - ref[0]) / abs(ref[0])
                n = min(len(ref), len(row["losses"]))
                row["max_loss_rel_diff"] = max(abs(a - b) / abs(b) for a, b in zip(row["losses"][:n], ref[:n]))
            row["ok"] = r["rc"] == 0 and summary.is_file()
            rows.append(row)
            if self.deadline - time.monotonic() < 10:
                break
        return {"ok": all(r["ok"] for r in rows) and len(rows) == len(chosen), "rows": rows}

    # bench ----------------------------------------------------------------------------------
    def bench(self) -> dict:
        out = self.work / "bench"
        data = ["--data", str(self.args.data)] if self.args.data else []
        args = [*self.s["bench"], *data, "--model", str(self.model_dirs["1b"]), "--systems", "tunekit,trl", "--out",
                str(out)]
        if self.forks is not None:  # the dry run: bench_train forked from the server, its runs forked from it
            r = run_forked(self.forks, "bench_train", [*args, "--fork-runs"], self.work / "bench.log", self.left(170),
                           self.work)
        else:
            r = self.child("bench", [sys.executable, str(REPO / "scripts" / "bench_train.py"), *args], 170)
        res = Path(f"{out}.json")
        if res.is_file():
            data = json.loads(res.read_text())
            r["settings"] = data["settings"]
            r["results"] = {mode: {"systems": {s: {k: v[k] for k in v if k != "runs"}
                                               for s, v in block["systems"].items()},
                                   "ratios": block.get("ratios")} for mode, block in data["results"].items()}
        r["ok"] = r["rc"] == 0 and res.is_file()
        return r

    # plan -----------------------------------------------------------------------------------
    def plan(self) -> dict:
        rows = []
        for i, (label, model, overrides) in enumerate(self.s["plan"]):
            run_dir = self.work / f"run-plan-{i}"
            args = ["train", *overrides.split(), f"model.path={self.model_dirs[model]}", "data.packing=false",
                    f"data.path={long_rows(self.work)}",
                    "trainer.grad_accum=1", f"trainer.max_steps={self.s['plan_steps']}", f"output_dir={run_dir}",
                    *QUIET]
            r = self.child(f"plan-{i}", self.cli(*args), 120)
            row = {"config": label, **r}
            summary = run_dir / "summary.json"
            if summary.is_file():
                s = json.loads(summary.read_text())
                mem = s.get("memory", {})
                row.update(measured_mib=mem.get("peak_mib"), setup_mib=mem.get("setup_peak_mib"),
                           setup_phases_mib=mem.get("setup_phases_mib"),
                           measured_as=mem.get("measured_as"),
                           planned_step_mib=mem.get("planned_step_peak_mib"),
                           planned_device_mib=mem.get("planned_device_total_mib"),
                           compute_dtype=s.get("compute_dtype"), kernels=s.get("kernels", {}).get("path"),
                           offloaded=mem.get("offloaded_activations"),
                           kernel_checks=s.get("kernels", {}).get("checks"),
                           rejected_checks=s.get("kernels", {}).get("rejected_checks"),
                           losses=[m["loss"] for m in read_metrics(run_dir / "metrics.jsonl") if "loss" in m])
                # on a GPU the peak is torch's max allocation, the plan's step peak; on a CPU it is
                # the process's RSS, runtime included: the plan's device total
                planned = row["planned_step_mib"] if mem.get("measured_as", "").startswith("torch") else \
                    row["planned_device_mib"]
                if row["measured_mib"] and planned:
                    row["planned_over_measured"] = round(planned / row["measured_mib"], 3)
                row.update(loftq_figures(self.work / f"plan-{i}.log", run_dir, self.model_dirs[model],
                                         "cpu" if self.args.tiny else "cuda"))
                if i == 0:
                    self.runs["export"] = run_dir
            row["ok"] = r["rc"] == 0 and summary.is_file()
            rows.append(row)
            if self.deadline - time.monotonic() < 10:
                break
        return {"ok": all(r["ok"] for r in rows) and len(rows) == len(self.s["plan"]), "rows": rows}

    # export ---------------------------------------------------------------------------------
    def export(self) -> dict:
        if "export" not in self.runs:
            return {"ok": False, "skipped": "no finished qlora run from the plan stage"}
        dest = self.work / "export-merged"
        r = self.child("export", self.cli("export", str(self.runs["export"]), "--format", "merged",
                                          "--out", str(dest)), 150)
        r["ok"] = r["rc"] == 0 and (dest / "config.json").is_file()
        r["tail"] = tail(self.work / "export.log", 15)
        return r

    # ----------------------------------------------------------------------------------------
    def needs(self, stage: str) -> str | None:
        deps = {"doctor": ["small"], "variants": ["small"], "bench": ["1b"], "plan": ["1b", "8b-4blocks"]}.get(stage, [])
        missing = [m for m in deps if m not in self.model_dirs]
        return f"no model {missing} (the models stage failed)" if missing else None

    def go(self, stages: list[str]) -> dict:
        for stage in STAGES:
            if stage not in stages:
                continue
            left = self.deadline - time.monotonic()
            why = self.needs(stage)
            if why or left < 5:
                self.result["stages"][stage] = {"ok": None, "skipped": why or "out of time budget"}
            else:
                t0 = time.monotonic()
                try:
                    self.result["stages"][stage] = getattr(self, stage)()
                except Exception as e:  # a bug in this script costs its stage, not the report
                    self.result["stages"][stage] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
                self.result["stages"][stage].setdefault("wall_s", round(time.monotonic() - t0, 1))
            st = self.result["stages"][stage]
            print(f"gpu_check: {stage}: {'ok' if st.get('ok') else st.get('skipped') or 'FAILED'} "
                  f"({st.get('wall_s', 0)} s)", flush=True)
            if st.get("ok") is False and "log" in st:
                print("\n".join("    " + ln for ln in tail(self.work / st["log"], 6)), flush=True)
            self.write()
        self.result["ok"] = all(s.get("ok") is not False for s in self.result["stages"].values())
        self.write()
        return self.result

    def write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "gpu_check.json").write_text(json.dumps(self.result, indent=2, default=str) + "\n")
        (self.out / "gpu_check.md").write_text(markdown(self.result))

    def pack_logs(self) -> None:
        """Every log, report, summary and metrics file (not weights) in one archive."""
        keep = {".log", ".json", ".jsonl", ".md", ".yaml", ".txt"}
        with tarfile.open(self.out / "logs.tar.gz", "w:gz") as tar:
            for p in sorted(self.work.rglob("*")):
                rel = p.relative_to(self.work)
                # the models, their tokenizer copies and the generated rows are inputs, not results
                if p.is_file() and p.suffix in keep and rel.parts[0] != "models" and rel.name != "long-rows.jsonl" \
                        and not rel.name.startswith("tokenizer") and p.stat().st_size < 4 * 2**20:
                    tar.add(p, arcname=str(p.relative_to(self.work)))


def prepare(tokenizer_out: Path) -> int:
    """On a machine with the network: the GPU machine's missing packages (.carry/site) and the
    tokenizer every random-init model there uses (.carry/tokenizer)."""
    subprocess.run(["bash", str(REPO.parent / "shared" / "gpu" / "make-carry.sh"), "trl==1.16.0"], cwd=REPO,
                   check=True)
    from transformers import AutoTokenizer

    from tunekit.model import default_model_dir

    AutoTokenizer.from_pretrained(default_model_dir()).save_pretrained(tokenizer_out)
    print(f"gpu_check: prepared {REPO / '.carry'} (name .carry in the run's carry)")
    return 0


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="where gpu_check.json/.md and logs.tar.gz go (default: $OUT, else "
                   "benchmarks/gpu/check-<date>)")
    p.add_argument("--work", type=Path, help="scratch folder for models and runs (default: a new temp folder)")
    p.add_argument("--tokenizer", type=Path, help="tokenizer folder (default: .carry/tokenizer, else the "
                   "embedded default model's)")
    p.add_argument("--data", type=Path, help="training rows for the doctor and the benchmark (default: tunekit's "
                   "default data; the planner's runs use long generated rows)")
    p.add_argument("--tiny", action="store_true", help="dry run on a tiny model (CPU; the test suite runs it)")
    p.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated, of {','.join(STAGES)}")
    p.add_argument("--budget", type=float, default=480.0, help="seconds for all stages together")
    p.add_argument("--variants", help="the variants stage's rows to run, as comma-separated indices into "
                   "VARIANTS (default: all of the mode's)")
    p.add_argument("--prepare", action="store_true", help="build .carry/ here (network needed) and exit")
    args = p.parse_args(argv)
    try:
        args.variants = None if args.variants is None else {int(v) for v in args.variants.split(",") if v.strip()}
    except ValueError:
        p.error(f"--variants: comma-separated indices into VARIANTS (0-{len(VARIANTS) - 1}), not {args.variants!r}")
    args.stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    bad = [s for s in args.stages if s not in STAGES]
    if bad:
        p.error(f"--stages: unknown {bad}; choose from {','.join(STAGES)}")
    if set(args.stages) & {"doctor", "variants", "bench", "plan", "export"} and "models" not in args.stages:
        args.stages.append("models")  # they run on its random-init models (stages run in STAGES' order)
    if "export" in args.stages and "plan" not in args.stages:
        args.stages.append("plan")  # the export is of the plan stage's first run
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    carry_tok = REPO / ".carry" / "tokenizer"
    if args.prepare:
        return prepare(carry_tok)
    if args.tokenizer is None:
        if carry_tok.is_dir():
            args.tokenizer = carry_tok
        else:
            from tunekit.model import default_model_dir

            args.tokenizer = default_model_dir()
    if args.out is None:
        args.out = Path(os.environ["OUT"]) if os.environ.get("OUT") else \
            REPO / "benchmarks" / "gpu" / f"check-{dt.date.today().isoformat()}"
    if args.work is None:
        import tempfile

        args.work = Path(tempfile.mkdtemp(prefix="tunekit-gpu-check-"))
    args.work.mkdir(parents=True, exist_ok=True)
    check = Check(args)
    try:
        result = check.go(args.stages)
    finally:
        if check.forks is not None:
            check.forks.close()
    check.pack_logs()
    print(markdown(result))
    print(f"gpu_check: wrote {args.out}/gpu_check.json, gpu_check.md, logs.tar.gz")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
