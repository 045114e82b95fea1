"""Helpers shared by the test modules (plain functions; fixtures live in conftest.py).

Kept out of conftest.py: tests/kernels has a conftest.py of its own, and pytest imports both
under the module name `conftest`, so `from _helpers import ...` would find whichever came last.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from _cli_forker import CliServer

REPO = Path(__file__).resolve().parents[1]


def tiny_args(model_dir: Path, data: Path, out: Path, *extra: str) -> list[str]:
    """Overrides for a fast run of any recipe on the tiny model. Every evaluation still answers its
    held-out samples through the cached decoding loop, 8 tokens each: the random tiny model never
    stops early, so the default 48 tokens would only cost Python time, to test nothing more."""
    return [
        f"model.path={model_dir}", f"data.path={data}", f"output_dir={out}",
        "trainer.max_steps=3", "trainer.micro_batch_size=4", "trainer.grad_accum=2",
        "trainer.eval_every=2", "trainer.save_every=2", "trainer.warmup_steps=1", "trainer.lr=1e-3",
        "trainer.eval_max_new_tokens=8", "data.val_fraction=0.2", "data.max_seq_len=64", *extra,
    ]


_server: CliServer | None = None
# Model folders whose tokenizer each fork server loads once, before its children: a child's first
# load of that folder takes it (tunekit.model.loader.preload_tokenizer). conftest.py adds the tiny model.
TOKENIZER_FOLDERS: list[Path] = []


def fork_server() -> CliServer | None:
    """This process's fork server (tests/_cli_forker.py over tunekit.commands.forkserver); None where
    TUNEKIT_TEST_FRESH_CLI=1 asks for real processes, or where a GPU is visible (the product's rule:
    CUDA state does not survive a fork, so children start fresh)."""
    global _server
    if os.environ.get("TUNEKIT_TEST_FRESH_CLI") == "1":
        return None
    from tunekit.commands.forkserver import start_method
    from tunekit.device.facts import cuda_device_count

    if start_method(cuda_device_count()) != "forkserver":
        return None
    # A new server where this process's own environment moved since the server started (a test that
    # sets an import-time variable for itself): otherwise every later command would miss the server
    # and pay a fresh import.
    if _server is None or not _server.serves(dict(os.environ)):
        if _server is not None:
            _server.close()
        _server = CliServer(dict(os.environ))
        atexit.register(_server.close)  # its folder of output files goes with it
    for folder in TOKENIZER_FOLDERS:
        if folder not in _server.tokenizers:
            _server.server.call("tunekit.model.loader:preload_tokenizer", str(folder))
            _server.tokenizers.add(folder)
    return _server


def run_cli(args: list[str], cwd: Path, env: dict | None = None, timeout: int = 600,
            fresh: bool = False, whole_env: bool = False, input: str | None = None,
            signal_when: tuple[Path, int] | None = None) -> subprocess.CompletedProcess:
    """Run `tunekit ARGS` as a user does: its own process, cwd, environment, stdout and stderr.

    `env` adds to this process's environment, or with whole_env=True is the whole of it (to run
    without a variable); `input` is the command's stdin (none by default); `signal_when=(path,
    signum)` sends the command that signal once `path` exists (a scheduler stopping a job, as soon
    as it has a checkpoint), and not at all if it ends first. By default the process
    is a fork of one that imported tunekit already (fork_server()); fresh=True, or
    TUNEKIT_TEST_FRESH_CLI=1 for the whole suite, starts the installed console script.
    """
    full_env = dict(env or {}) if whole_env else {**os.environ, **(env or {})}
    server = None if fresh else fork_server()
    if server is not None and server.serves(full_env):
        return server.run(args, cwd, full_env, timeout, input, signal_when=signal_when)
    exe = Path(sys.executable).with_name("tunekit")
    if signal_when is None:
        return subprocess.run([str(exe), *args], cwd=cwd, env=full_env, capture_output=True, text=True,
                              timeout=timeout, input=input, stdin=None if input is not None else subprocess.DEVNULL)
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:  # no pipe to fill while waiting
        proc = subprocess.Popen([str(exe), *args], cwd=cwd, env=full_env, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=err, text=True)
        deadline = time.time() + timeout
        while not Path(signal_when[0]).exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.02)
        if proc.poll() is None:
            proc.send_signal(signal_when[1])
        try:
            proc.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            proc.kill()  # as subprocess.run does on a timeout
            proc.wait()
            raise
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out.read(), err.read())


# ---------------------------------------------------------------- two ranks
# `accelerate launch` on the CPU (`--cpu` alone runs one process; ACCELERATE_USE_CPU with
# --multi_gpu runs gloo ranks).
LAUNCH_FLAGS = ["--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
                "--dynamo_backend", "no"]
# PYTHONFAULTHANDLER: a rank that dies on a signal prints every thread's Python stack (a rank that
# aborts, exit -6, would otherwise leave only "terminate called without an active exception").
LAUNCH_ENV = {"ACCELERATE_USE_CPU": "true", "PYTHONFAULTHANDLER": "1"}
DUMP_ENV = "import json, os, sys; json.dump(dict(os.environ), open(sys.argv[1] + os.environ['RANK'], 'w'))"
_rank_env: list[dict] | None = None


def launcher_rank_env() -> list[dict]:
    """What `accelerate launch LAUNCH_FLAGS` adds to or changes in each rank's environment.

    Read from a real launch of a script that only writes its environment (once per process),
    so that a forked rank gets exactly what this accelerate and torch give a launched one: RANK,
    LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT, ACCELERATE_* (mixed precision, dynamo), TORCHELASTIC_*.
    """
    global _rank_env
    if _rank_env is None:
        env = {**os.environ, **LAUNCH_ENV}
        with tempfile.TemporaryDirectory() as workdir:
            script, dump = Path(workdir) / "dump_env.py", Path(workdir) / "rank-env-"
            script.write_text(DUMP_ENV)
            proc = subprocess.run([str(Path(sys.executable).with_name("accelerate")), "launch", *LAUNCH_FLAGS,
                                   "--main_process_port", str(_free_port()), str(script), str(dump)],
                                  cwd=workdir, env=env, capture_output=True, text=True, timeout=120)
            assert proc.returncode == 0, proc.stderr[-3000:]
            ranks = [json.loads(Path(f"{dump}{rank}").read_text()) for rank in range(2)]
        _rank_env = [{k: v for k, v in r.items() if env.get(k) != v and k not in ("_", "PATH")} for r in ranks]
        assert [r["RANK"] for r in _rank_env] == ["0", "1"] and all(r["WORLD_SIZE"] == "2" for r in _rank_env)
    return _rank_env


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_two_ranks(args: list[str], cwd: Path, port: int, timeout: int = 300,
                     real: bool = False, env: dict | None = None) -> subprocess.CompletedProcess:
    """`accelerate launch LAUNCH_FLAGS -m tunekit.commands.main train ARGS`: two gloo ranks on the CPU.

    By default each rank is a fork of the fork server (as run_cli's commands are) with the
    environment the real launcher gives that rank (launcher_rank_env), both writing to one stdout
    and stderr: the same two `tunekit.commands.main.main` processes without two fresh imports of torch,
    transformers, peft and bitsandbytes. One difference, on purpose: no launcher process, so rank 0
    hosts the rendezvous store itself (TORCHELASTIC_USE_AGENT_STORE dropped), as in any launch
    without torchrun's agent. real=True (one test does), or TUNEKIT_TEST_FRESH_CLI=1, runs the
    real launcher. `env`: added to both ranks' environment. Forked, the result's `rank_codes` holds
    each rank's own exit status (None: still running when the grace after a failed rank ran out).
    """
    env = {**os.environ, **LAUNCH_ENV, **(env or {})}
    cmd = [str(Path(sys.executable).with_name("accelerate")), "launch", *LAUNCH_FLAGS,
           "--main_process_port", str(port), "-m", "tunekit.commands.main", "train", *args]
    # PYTHONFAULTHANDLER is read at interpreter start: the forked child turns it on itself
    server = None if real else fork_server()
    if server is not None and server.serves({k: v for k, v in env.items() if k != "PYTHONFAULTHANDLER"}):
        ranks = []
        for added in launcher_rank_env():
            rank = {**env, **added, "MASTER_PORT": str(port)}
            for key in ("TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE"):
                rank.pop(key, None)
            ranks.append(rank)
        return server.run(["train", *args], cwd, env, timeout, ranks=ranks, cmd=cmd)
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def fork_ranks(fn, args: tuple, nprocs: int = 2, timeout: float = 300) -> None:
    """torch.multiprocessing.start_processes(fn, args, nprocs) for gloo ranks on the CPU, each rank a
    fork of this worker's fork server (fork_server(): the stack imported once) instead of a spawned
    interpreter that imports torch, transformers and peft again, seconds each. fn(rank, *args) is a
    module-level function of a test module in tests/train (beside _rank_main.py, the ranks' `main`).
    The ranks run as a distributed command does (CliServer.run with `ranks`): a rank left waiting in
    a collective for one that failed is stopped after a grace period. Fails the test with the ranks'
    output unless each exits 0."""
    import pickle

    server = fork_server()
    if server is None:  # fresh processes asked for (TUNEKIT_TEST_FRESH_CLI=1), or a GPU is visible
        import torch.multiprocessing as mp

        mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="spawn")
        return
    folder = Path(sys.modules[fn.__module__].__file__).parent
    assert (folder / "_rank_main.py").is_file(), f"{fn.__module__}: fork_ranks runs functions of tests/train"
    if folder not in server.paths:  # the test module and _rank_main importable in the server's children
        server.server.call("site:addsitedir", str(folder))
        server.paths.add(folder)
    env = dict(os.environ)
    ranks = [{**env, "TUNEKIT_TEST_RANK": str(rank)} for rank in range(nprocs)]
    done = server.run([pickle.dumps((fn, args)).hex()], Path.cwd(), env, timeout, ranks=ranks, module="_rank_main")
    assert done.rank_codes == [0] * nprocs, (done.rank_codes, (done.stdout + done.stderr)[-6000:])


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def scaled_tiny_model(tiny_model_dir: Path, out: Path, seed: int) -> Path:
    """The tiny model with std-0.25 projections and unit embeddings, saved in fp32 at `out`.

    At its save-time init (std 0.02) the tiny model's greedy output is one token (a newline) over
    and over whatever the context, which would make "batched equals alone" trivially true; with
    these scales every context gives a different sequence. fp32: batched and solo matmuls round
    differently, and fp32 keeps that ~1e-6, far below logit gaps.
    """
    import torch
    from transformers import AutoTokenizer

    from tunekit.model import load_base_model

    model = load_base_model(str(tiny_model_dir), "none", torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * (1.0 if "embed" in name else 0.25))
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(out)
    return out


def need_llama_cpp() -> None:
    """llama.cpp is the GGUF check: CI must run these tests (setup.sh builds llama-cpp-python),
    so there a missing binding fails; elsewhere (a quick local setup) it skips."""
    from tunekit.infer.llamacpp import unavailable

    why = unavailable()
    if why and os.environ.get("CI"):
        pytest.fail(f"{why}: scripts/setup.sh should have built it (scripts/llama_cpp_wheel.sh)")
    if why:
        pytest.skip(why)


# ---------------------------------------------------------------- what a killed run leaves
_LEAN = None


def _lean_server():
    """Where the kill tests' children fork from: a small fork server (tunekit.commands.forkserver)
    that imported this module and tunekit's file handling once, not the pytest worker. A fork copies
    the forking process's page tables, and a worker late in the suite holds gigabytes: measured on
    the 2-core EPYC, 8 ms a fork from a fresh interpreter with torch imported, 100 ms from one
    holding 1.5 GB of Python objects, over the 40-odd kills of one test."""
    global _LEAN
    if _LEAN is None or not _LEAN.alive():
        from tunekit.commands.forkserver import Server

        here = str(Path(__file__).resolve().parent)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, str(REPO), os.environ.get("PYTHONPATH", "")])}
        _LEAN = Server(env, ["_helpers", "_run_pickled", "tunekit.owned", "tunekit.train.runlock"])
        atexit.register(_LEAN.close)
    return _LEAN


def _in_a_child(act) -> tuple[int, bool]:
    """Run act() (picklable: a module-level function or a functools.partial of one) in a child
    process that ends with os._exit: with status 9 as a SIGKILL would end it (no finally block, no
    exit handler, no cleanup of its own), unless act() ends it with another. Returns (the child's
    pid, dead and reaped; whether it died that way)."""
    import pickle

    log = Path(tempfile.gettempdir()) / f"tunekit-kill-child-{os.getpid()}.log"
    child = _lean_server().start("_run_pickled", [pickle.dumps(act).hex()], log, log)
    code = child.wait(120)
    assert code in (0, 9), (code, log.read_text(errors="replace")[-2000:])
    return child.pid, code == 9


def _in_a_child_that_dies(act) -> int:
    pid, died = _in_a_child(act)
    assert died
    return pid


# The calls that create, write, rename or remove a file or folder: a kill can land after any of them.
FS_CALLS = (("os", "open"), ("os", "mkdir"), ("os", "rename"), ("os", "replace"), ("os", "rmdir"), ("os", "unlink"),
            ("os", "pwrite"), ("os", "write"), ("io", "open"), ("builtins", "open"))


def _die_after_call(n: int) -> None:
    """In a child process: end it (as a SIGKILL would, no cleanup) right after its n-th FS_CALLS call."""
    import builtins
    import io

    modules, calls = {"os": os, "io": io, "builtins": builtins}, [0]

    def counted(real):
        def call(*args, **kwargs):
            result = real(*args, **kwargs)
            calls[0] += 1
            if calls[0] == n:
                os._exit(9)
            return result
        return call

    for module, name in FS_CALLS:
        setattr(modules[module], name, counted(getattr(modules[module], name)))


def die_mid_save(target: Path, at: str | int = "write", save=None) -> int | None:
    """What a run killed while saving `target` through tunekit.owned leaves behind: the save runs in a
    child process that dies at `at`: "write" (a file half written into the new folder), "rename"
    (the old target already moved aside, the new one not yet in its place), "renamed" (the new one in
    place, the old one not yet removed) or "file" (atomic_write of a file, half written). Returns the
    dead child's pid.

    `at` a number n: the child runs save() (picklable; by default an atomic_dir of a small folder at
    `target`) and dies right after its n-th call that creates, writes, renames or removes
    (FS_CALLS): every point of a save, one per n. Returns None where save() made fewer calls (it
    finished)."""
    if isinstance(at, int):
        pid, died = _in_a_child(functools.partial(_save_to_the_kill, at, target, save))
        return pid if died else None
    return _in_a_child_that_dies(functools.partial(_die_in_a_save, at, target))


def _small_save(target: Path) -> None:
    from tunekit import owned

    owned.atomic_dir(target, lambda d: (d / "new.txt").write_text("new"))


def _save_to_the_kill(n: int, target: Path, save) -> None:
    _die_after_call(n)
    try:
        (save or functools.partial(_small_save, target))()
    except BaseException:  # a save that fails is not a kill: status 3, the test fails
        import traceback

        traceback.print_exc()
        os._exit(3)
    os._exit(0)


def _die_in_a_save(at: str, target: Path) -> None:
    from tunekit import owned

    if at == "file":
        def half(tmp):
            tmp.write_text("half")
            os._exit(9)

        owned.atomic_write(target, half)
    elif at == "write":
        def half(folder):
            (folder / "adapter").mkdir()
            (folder / "adapter" / "adapter_model.safetensors").write_bytes(b"half")
            os._exit(9)

        owned.atomic_dir(target, half)
    else:
        real, renames = os.rename, []

        def rename_then_die(a, b):
            real(a, b)
            renames.append(b)
            if at == "rename" or len(renames) == 2:
                os._exit(9)

        os.rename = rename_then_die
        owned.atomic_dir(target, lambda folder: (folder / "new.txt").write_text("new"))


def _acquire_lock(output_dir: Path) -> None:
    from tunekit.train.runlock import RunLock

    RunLock.acquire(output_dir)


def open_scratch_in(output_dir: Path) -> None:
    """What a run does first in its output_dir: take the lock, open its scratch home (a `save` for
    die_mid_save)."""
    from tunekit.train.runlock import RunLock

    RunLock.acquire(output_dir).open_scratch()


def save_like_a_run(run: Path, pristine: Path, config: str) -> None:
    """What a run does in its folder, in that order (a `save` for die_mid_save): the lock and its
    scratch home, step-000002 replaced (the old one moves aside first), step-000003 written then
    pruned, config.yaml rewritten, the lock released."""
    from tunekit.owned import atomic_dir, atomic_write_text, discard
    from tunekit.train.runlock import RunLock

    ck = run / "checkpoints"
    copy = lambda d: shutil.copytree(pristine, d, dirs_exist_ok=True)  # noqa: E731
    lock = RunLock.acquire(run)
    lock.open_scratch()
    atomic_dir(ck / "step-000002", copy)
    atomic_dir(ck / "step-000003", copy)
    discard(ck / "step-000003")
    atomic_write_text(run / "config.yaml", config)
    lock.release()


def die_holding_lock(output_dir: Path) -> int:
    """A stale lock: a child takes tunekit's lock on output_dir and dies holding it (its lock file stays)."""
    return _in_a_child_that_dies(functools.partial(_acquire_lock, output_dir))


def snapshot(folder: Path) -> dict[str, bytes | None]:
    """Every path under folder (hidden ones included) with its bytes (None for a folder)."""
    return {str(p.relative_to(folder)): (None if p.is_dir() else p.read_bytes())
            for p in sorted(Path(folder).rglob("*"))}


def plant_lookalikes(folder: Path, tag: str = "mine") -> dict[str, bytes | None]:
    """Files of a user's that look like what atomic writes leave (hidden *.tmp*, *.old), and plain
    ones; returns their snapshot (relative to folder), to compare after tunekit has run."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / ".draft.tmp").write_text(f"{tag}: a draft")
    (folder / ".photos.old").mkdir()
    (folder / ".photos.old" / "cat.jpg").write_bytes(b"\xff\xd8 a cat")
    (folder / "x.tmp-123").write_text(f"{tag}: x")
    (folder / ".tunekit.tmp-notes").mkdir()  # tunekit's prefix, but no marker: still the user's
    (folder / ".tunekit.tmp-notes" / "todo.txt").write_text(f"{tag}: todo")
    (folder / "notes.txt").write_text(f"{tag}: notes")
    names = (".draft.tmp", ".photos.old", ".photos.old/cat.jpg", "x.tmp-123", ".tunekit.tmp-notes",
             ".tunekit.tmp-notes/todo.txt", "notes.txt")
    return {n: (None if (folder / n).is_dir() else (folder / n).read_bytes()) for n in names}


def lost_or_changed(folder: Path, planted: dict[str, bytes | None]) -> list[str]:
    """The planted paths that are gone or changed (empty when every one survived)."""
    now = snapshot(folder)
    return [n for n, data in planted.items() if n not in now or now[n] != data]


def resume_is_bit_identical(model_dir: Path, data: Path, tmp: Path, args: tuple, weights: str) -> tuple[Path, Path]:
    """Train `args` on the tiny model to the end; train it again from a copy killed after its step-2
    checkpoint, resumed; assert the two runs' adapter/`weights` files hold identical tensors.
    Returns (the whole run, the resumed run)."""
    import torch
    from safetensors.torch import load_file

    whole = tmp / "whole"
    r = run_cli(["train", *tiny_args(model_dir, data, whole, *args)], tmp)
    assert r.returncode == 0, r.stderr[-3000:]
    run = crashed_copy(whole, tmp / "run")
    r = run_cli(["train", *tiny_args(model_dir, data, run, *args, "trainer.resume=true")], tmp)
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = (load_file(str(d / "adapter" / weights)) for d in (whole, run))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return whole, run


def crashed_copy(full_run: Path, dest: Path) -> Path:
    """The folder as a run killed right after its step-2 checkpoint would have left it."""
    shutil.copytree(full_run, dest)
    shutil.rmtree(dest / "checkpoints" / "step-000004")
    shutil.rmtree(dest / "adapter")
    (dest / "summary.json").unlink()
    return dest


def trl_dpo_loss(per_token, ref_sums, completion_mask, beta: float, loss_type: str = "sigmoid"):
    """TRL 1.16's own DPO loss (DPOTrainer._compute_loss, called on a stand-in trainer whose model returns
    `per_token` as its per-token log-probs, with `ref_sums` as TRL's precomputed reference log-probs).
    per_token: (2P, W-1) in TRL's [chosen; rejected] order, zero off the completions; ref_sums: (2P,);
    completion_mask: (2P, W). Returns (loss, TRL's logged metrics {name: [value]})."""
    from collections import defaultdict
    from types import SimpleNamespace

    import torch
    from trl import DPOTrainer

    class Acc:
        device = torch.device("cpu")

        def gather(self, x):
            return x

        gather_for_metrics = gather

    def model(**kwargs):
        z = torch.zeros_like(per_token)
        return SimpleNamespace(log_probs=per_token, entropy=z, mean_logits=z, is_top1=z.bool())

    pairs = per_token.shape[0] // 2
    trainer = SimpleNamespace(
        model=SimpleNamespace(training=True), accelerator=Acc(), aux_loss_enabled=False, ld_alpha=None,
        precompute_ref_logps=True, f_divergence_type="reverse_kl", loss_types=[loss_type], loss_weights=[1.0],
        beta=beta, label_smoothing=0.0, use_weighting=False, _metrics=defaultdict(lambda: defaultdict(list)),
        _total_train_tokens=0, _tp_size=1, args=SimpleNamespace())
    inputs = {"input_ids": torch.ones_like(completion_mask), "attention_mask": torch.ones_like(completion_mask),
              "completion_mask": completion_mask, "ref_chosen_logps": ref_sums[:pairs],
              "ref_rejected_logps": ref_sums[pairs:]}
    loss = DPOTrainer._compute_loss(trainer, model, inputs, False)
    return float(loss), {k: v for k, v in trainer._metrics["train"].items()}


def template_less_base(tiny_model_dir: Path, out: Path) -> Path:
    """The tiny model (weights linked, not copied) with a base model's tokenizer: no chat template,
    and no ChatML tokens (SmolLM2's <|im_start|> and <|im_end|>, ids 1 and 2, renamed to reserved
    tokens that no text spells); BOS, EOS and pad are <|endoftext|>, as in SmolLM2's base model."""
    out.mkdir(parents=True, exist_ok=True)
    for f in Path(tiny_model_dir).iterdir():
        if f.suffix == ".safetensors" or f.name in ("config.json", "generation_config.json"):
            (out / f.name).symlink_to(f)
    renamed = {"<|im_start|>": "<|reserved_1|>", "<|im_end|>": "<|reserved_2|>"}
    tok = json.loads((Path(tiny_model_dir) / "tokenizer.json").read_text())
    for added in tok["added_tokens"]:
        added["content"] = renamed.get(added["content"], added["content"])
    vocab = tok["model"]["vocab"]
    for old, new in renamed.items():
        vocab[new] = vocab.pop(old)
    (out / "tokenizer.json").write_text(json.dumps(tok))
    config = json.loads((Path(tiny_model_dir) / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    config.update(bos_token="<|endoftext|>", eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    for added in (config.get("added_tokens_decoder") or {}).values():
        added["content"] = renamed.get(added["content"], added["content"])
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out
