"""The bad-input catalogue: every malformed input a careful user can give, through the real CLI.

Each row is one command line and the culprit its error must name. Every case must end with exit
code 2, stderr exactly one `tunekit: error: <culprit>: ...` line (no traceback, no log lines),
and nothing written: not the run's output_dir, not the working directory.

Speed: every `tunekit` process start pays the import of torch, transformers, peft and hydra, so
the catalogue runs in forks of one server that imported tunekit once (tests/_cli_forker.py over
tunekit.commands.forkserver): each child runs `tunekit.commands.main.main(argv)` with its own
stdout/stderr, cwd and exit status, which is the real CLI path. `test_forker_matches_the_console_script`
checks a few rows through the installed `tunekit` script too.

The rows live in tests/_bad_input_cases.py (adding a case is one line there), the files they name
in tests/_bad_input_world.py. Placeholders: {tiny} the tiny model folder, {data} a good data file,
{w} the folder of fixture files, {out} the case's own output_dir, {cwd} its working directory.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from _cli_forker import CliServer
from _helpers import fork_server, run_cli, snapshot
from tunekit.train.runlock import RunLock

from _bad_input_cases import CASES, TRAIN_BASE, Case
from _bad_input_world import build_world


def _fill(text: str, places: dict) -> str:
    return re.sub(r"\{(tiny|data|w|out|cwd)\}", lambda mt: str(places[mt.group(1)]), text).replace("{{", "{").replace("}}", "}")


def _can_run_as(user: str) -> bool:
    if os.getuid() != 0:
        return True  # permissions already apply to us
    try:
        import pwd

        pwd.getpwnam(user)
        return True
    except KeyError:
        return False


@pytest.fixture(scope="module")
def world(tiny_model_dir, tiny_data):
    # Outside pytest's 0700 temp root: the permission cases run as `nobody` when we are root.
    w = Path(tempfile.mkdtemp(prefix="tunekit-bad-input-"))
    w.chmod(0o755)
    for sub in ("outs", "cwds"):
        (w / sub).mkdir()
        (w / sub).chmod(0o777)
    build_world(w, Path(tiny_model_dir), _train_fingerprint({"tiny": tiny_model_dir, "data": tiny_data, "w": w}))
    lock = RunLock.acquire(w / "locked")
    untouched = {name: snapshot(w / name) for name in UNTOUCHED}
    yield {"w": w, "tiny": Path(tiny_model_dir), "data": Path(tiny_data), "untouched": untouched}
    lock.release()
    (w / "ro").chmod(0o755)
    shutil.rmtree(w, ignore_errors=True)


def _train_fingerprint(places: dict) -> dict:
    """What the catalogue's train rows (TRAIN_BASE) train, as a checkpoint records it."""
    from tunekit.commands.compose import compose_configs
    from tunekit.train.resume import fingerprint

    (cfg,) = compose_configs(shlex.split(_fill(TRAIN_BASE, {**places, "out": places["w"] / "outs" / "x"})))
    return fingerprint(cfg, 1)


def places_of(world: dict, case: Case) -> dict:
    return {**world, "out": world["w"] / "outs" / case.id, "cwd": world["w"] / "cwds" / case.id}


# Rows that tests other than test_bad_input read from `results`.
READ_ELSEWHERE = ("eval-config-python-tag", "lr-inf", "model-bert")


def _selected(session) -> set[str]:
    """The rows this session runs: all of them, or those `-k` selects (and the ones read elsewhere)."""
    ids = {item.callspec.params["case"].id for item in session.items  # every module's (xdist): this one's rows
           if getattr(item, "callspec", None) is not None and isinstance(item.callspec.params.get("case"), Case)}
    return ids | set(READ_ELSEWHERE)


def _output_dir(argv: list[str]) -> str | None:
    """The output_dir a case's command line names: rows that share one of the world's folders run one
    after the other, as two runs on one folder meet at its lock."""
    return next((a.split("=", 1)[1] for a in argv if a.startswith("output_dir=")), None)


@pytest.fixture(scope="module")
def results(world, request):
    """Run the catalogue (the rows selected) in one forking interpreter; {id: result}."""
    cases = []
    selected = _selected(request.session)
    for case in (c for c in CASES if c.id in selected):
        places = places_of(world, case)
        places["cwd"].mkdir()
        places["cwd"].chmod(0o777)
        argv = shlex.split(_fill(case.argv, places))
        cases.append({"id": case.id, "argv": argv, "cwd": str(places["cwd"]), "env": case.env,
                      "user": case.user if _can_run_as(case.user or "") and case.user else None,
                      "apart": _output_dir(argv)})
    warmup = shlex.split(_fill(TRAIN_BASE, {**world, "out": world["w"] / "outs" / "warmup", "cwd": world["w"]}))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    # Two single-threaded children at a time: CI machines have 2 cores (TUNEKIT_CATALOGUE_JOBS overrides).
    jobs = int(os.environ.get("TUNEKIT_CATALOGUE_JOBS", min(2, len(os.sched_getaffinity(0)))))
    server = fork_server()  # this worker's, where it has one that serves this environment: no import of its own
    own = None if server is not None and server.serves(env) else CliServer(env)
    try:
        rows = (own or server).batch(cases, jobs, timeout=180, warmup=warmup)
    finally:
        if own is not None:
            own.close()
    print(f"{len(rows)} cases in {rows[0]['batch_seconds']} s ({jobs} at a time)")  # shown with -s
    if os.environ.get("TUNEKIT_CATALOGUE_DUMP"):  # for reading every message at once
        Path(os.environ["TUNEKIT_CATALOGUE_DUMP"]).write_text(json.dumps(rows))
    return {r["id"]: r for r in rows}


def test_catalogue_is_large_and_unique():
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids)), sorted({i for i in ids if ids.count(i) > 1})
    assert len(CASES) >= 100


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case, results, world):
    if case.user and not _can_run_as(case.user):
        pytest.skip(f"needs user {case.user!r} to drop root's permissions")
    places = places_of(world, case)
    r = results[case.id]
    lines = r["stderr"].strip().splitlines()
    assert r["code"] == case.code, r["stderr"][-3000:]
    assert len(lines) == 1 and lines[0].startswith("tunekit: error: "), r["stderr"][-3000:]
    assert _fill(case.culprit, places) in lines[0]
    assert not places["out"].exists(), "output_dir was created"
    assert not any(places["cwd"].iterdir()), f"wrote into the working directory: {list(places['cwd'].iterdir())}"


# Folders of build_world that refused runs were pointed at: they must come out exactly as they went in.
UNTOUCHED = ("userfiles", "handmade", "locked", "finished", "stepfive", "finished_bare", "metrics_latin1",
             "metrics_list", "ckpt_file", "step_text", "no_rng", "distill_no_student")


def test_refused_output_dirs_are_untouched(results, world):
    for name in UNTOUCHED:
        assert snapshot(world["w"] / name) == world["untouched"][name], name


def test_forker_matches_the_console_script(results, world):
    """Two rows through the installed `tunekit` script (a config error found before torch is
    imported, a model-folder error after): same exit code, same stderr as the forked child."""
    for case_id in ("lr-inf", "model-bert"):
        case = next(c for c in CASES if c.id == case_id)
        places = {**places_of(world, case), "cwd": world["w"] / "cwds" / case.id}
        r = run_cli(shlex.split(_fill(case.argv, places)), places["cwd"], env={"OMP_NUM_THREADS": "1"}, fresh=True)
        assert (r.returncode, r.stderr.strip()) == (results[case.id]["code"], results[case.id]["stderr"].strip())


def test_nan_weights_stop_before_training(world):
    """NaN weights show only in the loaded values (one pass over them, after the load): the run stops
    there, before any step, naming the folder and the first tensor. Not a catalogue row: the run's
    own progress lines (data, memory plan, precision) come before it on stderr."""
    out = world["w"] / "outs" / "nan-weights"
    args = shlex.split(_fill(TRAIN_BASE, {**world, "out": out})) + [f"model.path={world['w']}/models/nan"]
    r = run_cli(["train", *args], world["w"] / "cwds")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert lines[-1].startswith(f"tunekit: error: model.path: the weights in {world['w']}/models/nan hold NaN or "
                                "infinite values, in 20 tensor(s), first model.embed_tokens.weight"), lines[-1]
    assert not out.exists()


def test_generate_refuses_a_misfit_model_folder(world):
    """Every command that loads a base checks it as training does: `generate --model` on a folder whose
    config.json has one layer fewer than its weights. (Its memory line comes first: not a catalogue row.)"""
    cwd = world["w"] / "cwds"
    r = run_cli(["generate", "--model", f"{world['w']}/models/onelayer", "--prompt", "hi"], cwd)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert lines[-1].startswith(f"tunekit: error: --model: the weights in {world['w']}/models/onelayer do not "
                                "fit its config.json: 9 tensor(s) in the files fit no weight of the config "
                                "(model.layers.1.input_layernorm.weight, "), lines[-1]
    assert not r.stdout.strip()  # nothing generated


def test_missing_optional_library_is_one_line(monkeypatch):
    """A choice that needs bitsandbytes or wandb fails at validation, not as an ImportError mid-setup."""
    import importlib.util

    from tunekit import TunekitError
    from tunekit.config import ModelConfig, TrackerConfig, TrainConfig, TrainerConfig
    from tunekit.train.checks import check_libraries

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("bitsandbytes", "wandb") else real(name, *a))
    with pytest.raises(TunekitError, match=r"^model.quantize: nf4 needs bitsandbytes, which is not installed"):
        check_libraries(TrainConfig(model=ModelConfig(quantize="nf4")))
    with pytest.raises(TunekitError, match=r"^trainer.optimizer: paged_adamw_8bit needs bitsandbytes"):
        check_libraries(TrainConfig(trainer=TrainerConfig(optimizer="paged_adamw_8bit")))
    with pytest.raises(TunekitError, match=r"^tracker.name: wandb needs the wandb package"):
        check_libraries(TrainConfig(tracker=TrackerConfig(name="wandb")))
    check_libraries(TrainConfig())  # adamw on a bf16 base needs neither


# Refusals that come after a model loaded (its memory line is on stderr first): the last line is checked.
LOADED = [
    ("generate-prompt-too-long", ["generate", "--model", "{tiny}", "--prompt", "word " * 600], None,
     "--prompt 1: the prompt is "),
    ("chat-system-refused", ["chat", "--model", "{w}/models/strict_template", "--system", "Be brief."], "Hi\n",
     "--system: the tokenizer's chat template refuses a system turn (no system turns here)"),
    ("chat-stdin-not-utf8", ["chat", "--model", "{tiny}", "--max-new-tokens", "2"], "caf\udce9\n",
     "stdin: not UTF-8 text (byte 0xe9)"),
    # a name the template builds while it renders: no parse sees it, jinja's sandbox stops it there
    ("generate-template-escape-at-render", ["generate", "--model", "{w}/models/sneaky_template", "--prompt", "hi"], None,
     "{w}/models/sneaky_template/chat_template.jinja: the chat template tried to reach what jinja's sandbox refuses"),
]


@pytest.mark.parametrize("argv,stdin,culprit", [c[1:] for c in LOADED], ids=[c[0] for c in LOADED])
def test_refused_after_the_model_loads(world, argv, stdin, culprit):
    cwd = world["w"] / "cwds"
    args = [_fill(a, {**world, "out": cwd, "cwd": cwd}) for a in argv]
    if stdin is not None and "\udce9" in stdin:  # bytes that are not UTF-8, through a file the child reads
        r = _run_with_stdin_bytes(args, cwd, stdin.encode("utf-8", "surrogateescape"))
    else:
        r = run_cli(args, cwd, input=stdin)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert lines[-1].startswith(f"tunekit: error: {_fill(culprit, {**world, 'out': cwd, 'cwd': cwd})}"), lines[-1]
    assert "prompt is" not in culprit or "with --max-new-tokens 64 that is more than the model's context of 512" in lines[-1]
    assert not r.stdout.strip()


def _run_with_stdin_bytes(args, cwd, data: bytes) -> subprocess.CompletedProcess:
    server = fork_server()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if server is not None and server.serves(env):
        return server.run(args, cwd, env, 300, input=data)
    exe = Path(sys.executable).with_name("tunekit")
    r = subprocess.run([str(exe), *args], input=data, capture_output=True, cwd=cwd, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    return subprocess.CompletedProcess(r.args, r.returncode, r.stdout.decode(errors="replace"),
                                       r.stderr.decode(errors="replace"))


def test_python_tag_in_a_run_config_runs_nothing(results, world):
    assert results["eval-config-python-tag"]["code"] == 2
    assert not (world["w"] / "pwned").exists()


def test_a_killed_runs_checkpoint_is_that_runs_adapter(world):
    """RUN/checkpoints/step-N/adapter of a run killed before adapter/ was written: opened as that run
    (its base, its method, its held-out split), not as a standalone adapter over the default data."""
    from tunekit.runs.open import open_source

    ckpt = world["w"] / "killed" / "checkpoints" / "step-000002" / "adapter"
    src = open_source(ckpt)
    assert src.kind == "run" and src.adapter_dir == ckpt
    assert src.run.run_dir == world["w"] / "killed"
    assert src.run.cfg.data.path == f"{world['w']}/data/alpaca.jsonl"


def test_full_disk_during_a_checkpoint_keeps_the_last_good_one(tmp_path):
    """A disk that fills while a checkpoint is written: one line naming the folder, the scratch folder
    gone, and the checkpoint before it byte for byte as it was."""
    import errno

    import torch

    from tunekit import TunekitError
    from tunekit.train.checkpoint import save_checkpoint

    param = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([param], lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    adapter = lambda d: (d.mkdir(), (d / "a.bin").write_bytes(b"ok"))  # noqa: E731
    save_checkpoint(tmp_path, 1, adapter, opt, sched, {}, [{}], keep=2)
    before = snapshot(tmp_path)

    def full(d):
        raise OSError(errno.ENOSPC, "No space left on device", str(d / "a.bin"))

    with pytest.raises(TunekitError, match=r"^no space left on .*checkpoints: saving step-000002 failed; the last "
                                           r"good checkpoint, .*step-000001, is intact"):
        save_checkpoint(tmp_path, 2, full, opt, sched, {}, [{}], keep=2)
    assert snapshot(tmp_path) == before


def test_doctor_again_into_its_own_stopped_output(tmp_path):
    """A doctor that stopped at a wrong --model left its --out behind: a second doctor may replace
    it; a user's folder that merely looks like one (logs/*.log) is refused and left as it was."""
    out = tmp_path / "doc"
    for _ in range(2):
        r = run_cli(["doctor", "--model", str(tmp_path / "missing"), "--out", str(out)], tmp_path)
        assert r.returncode != 0 and "missing" in r.stderr.strip().splitlines()[-1], r.stderr[-2000:]
        assert "is not a doctor report" not in r.stderr
    mine = tmp_path / "mine"
    (mine / "logs").mkdir(parents=True)
    (mine / "logs" / "notes.log").write_text("keep me")
    r = run_cli(["doctor", "--out", str(mine)], tmp_path)
    assert r.returncode != 0 and "is not a doctor report" in r.stderr
    assert (mine / "logs" / "notes.log").read_text() == "keep me"


def test_rows_on_one_output_dir_never_run_at_once(monkeypatch):
    """The batch keeps cases with one "apart" key (the catalogue's rows that share a world folder)
    from running together, and still runs cases with different keys side by side."""
    import _cli_forker

    live, seen_together = [], []

    class Fake:  # a case that runs for three polls
        def __init__(self, server, case, folder):
            self.case, self.left = case, 3
            live.append(case)
            seen_together.append([c["id"] for c in live])

        def poll(self, timeout):
            self.left -= 1
            if self.left:
                return None
            live.remove(self.case)
            return {"id": self.case["id"]}

    monkeypatch.setattr(_cli_forker, "Running", Fake)
    monkeypatch.setattr(_cli_forker.time, "sleep", lambda s: None)
    server = object.__new__(CliServer)
    server.env, server._n, server.folder, server.server = {}, iter(range(100)), None, None
    keys = {"a1": "A", "a2": "A", "b": "B", "a3": "A", "n1": None, "n2": None}
    rows = server.batch([{"id": i, "argv": [], "cwd": ".", "apart": k} for i, k in keys.items()], jobs=2, timeout=9)
    assert [r["id"] for r in rows] == list(keys)
    for ids in seen_together:
        held = [keys[i] for i in ids if keys[i] is not None]
        assert len(held) == len(set(held)), ids
    assert max(len(ids) for ids in seen_together) == 2  # two at a time where the keys allow it
