"""The command line: help, config printing, one-line errors for bad input."""

from __future__ import annotations

import pytest

from _helpers import REPO, run_cli
from tunekit.commands.main import main

# Every recipe of the config tree, as the folder holds them (not as tunekit lists them)
RECIPES = ", ".join(sorted(p.stem for p in (REPO / "recipes" / "recipe").glob("*.yaml")))


def run_main(args, capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    return exit_info.value.code, capsys.readouterr().err.strip()


@pytest.mark.parametrize(
    "args, culprit",
    [
        (["recipe=nope"], f"Could not find 'recipe/nope'; available: {RECIPES}"),
        (["trainer.max_steps=abc"], "trainer.max_steps: must be a positive integer or auto, got 'abc'"),
        (["trainer.nope=1"], "trainer.nope: unknown config key"),
        (["trainer.optimizer=sgd"], "trainer.optimizer: Invalid value 'sgd'"),
        (["model.quantize=int3"], "model.quantize: Invalid value 'int3'"),
        (["data.path=/no/such/file.jsonl"], "data.path: file not found: /no/such/file.jsonl"),
        (["trainer.max_steps=0"], "trainer.max_steps: must be >= 1, got 0"),
        (["tracker=nope"], "Could not find 'tracker/nope'"),
        (["-m", "recipe=qlora,nope"], "Could not find 'recipe/nope'"),
    ],
)
def test_bad_config_is_one_line_naming_the_culprit(args, culprit, capsys):
    code, err = run_main(["train", *args], capsys)
    assert code == 2
    assert err.startswith("tunekit: error: ") and culprit in err
    assert len(err.splitlines()) == 1 and "Traceback" not in err


def test_unknown_command_and_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["fly"])
    assert e.value.code == 2 and "tunekit: error: fly: unknown command" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0 and "tunekit train recipe=qlora" in capsys.readouterr().out


def test_cfg_job_prints_resolved_config_and_trains_nothing(tmp_path):
    out = tmp_path / "never"
    r = run_cli(["train", "recipe=lora", "trainer.max_steps=7", "seed=3", f"output_dir={out}", "--cfg", "job"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert "recipe: lora" in r.stdout and "max_steps: 7" in r.stdout and "seed: 3" in r.stdout
    assert "quantize: none" in r.stdout and not out.exists()


def test_missing_model_folder_fails_before_training(tmp_path):
    r = run_cli(["train", "recipe=lora", f"model.path={tmp_path / 'nope'}", f"output_dir={tmp_path / 'o'}"], tmp_path)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == f"tunekit: error: model.path: no model folder at {tmp_path / 'nope'}"
    assert "Traceback" not in r.stderr


def test_a_sweep_keeps_hydras_record_in_its_output_dir():
    from types import SimpleNamespace as Cfg

    from tunekit.commands.compose import sweep_dir_override

    one = [Cfg(output_dir="runs/s"), Cfg(output_dir="runs/s")]
    assert sweep_dir_override(["-m", "recipe=qlora,lora", "output_dir=runs/s"], one) == ["hydra.sweep.dir=runs/s"]
    # the default runs/<time>: pinned, so every job of the sweep lands in the same folder
    assert sweep_dir_override(["-m", "recipe=qlora,lora"], one) == ["hydra.sweep.dir=runs/s", "output_dir=runs/s"]
    assert sweep_dir_override(["recipe=qlora", "output_dir=runs/s"], one[:1]) == []  # not a sweep
    assert sweep_dir_override(["-m", "output_dir=a,b"], [Cfg(output_dir="a"), Cfg(output_dir="b")]) == []
    assert sweep_dir_override(["-m", "hydra.sweep.dir=x"], one) == []  # the user's choice stands
    assert sweep_dir_override(["-m"], [Cfg(output_dir="runs/a b")]) == []  # would need quoting: left alone


def test_a_single_run_trains_the_config_it_checked_and_sweeps_go_through_hydra(tiny_model_dir, tiny_data,
                                                                                tmp_path, monkeypatch):
    import hydra

    import tunekit.commands.train as train_command

    trained, hydra_runs = [], []
    monkeypatch.setattr(train_command, "_train", lambda cfg, out: trained.append((cfg, out)))
    monkeypatch.setattr(hydra, "main", lambda **kw: lambda job: lambda: hydra_runs.append(kw))
    base = ["recipe=lora", f"model.path={tiny_model_dir}", f"data.path={tiny_data}", "trainer.max_steps=7"]
    main(["train", *base, f"output_dir={tmp_path / 'one'}"])
    ((cfg, out),) = trained
    assert out == tmp_path / "one" and cfg.trainer.max_steps == 7 and not hydra_runs
    for extra in (["-m", "seed=1,2"], ["hydra.job.chdir=true"], ["--cfg", "job"]):
        main(["train", *base, *extra])
        assert len(hydra_runs) == 1 and len(trained) == 1, extra  # Hydra's entry point runs these
        hydra_runs.clear()
