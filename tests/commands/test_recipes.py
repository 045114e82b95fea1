"""Recipes end to end through the real `tunekit` console script, on the tiny model."""

from __future__ import annotations

import json
import math
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from _helpers import read_jsonl, run_cli, tiny_args


def adapter_tensors(run_dir):
    return load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))


@pytest.fixture(scope="module")
def qlora_run(tiny_model_dir, tiny_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("qlora") / "run"
    r = run_cli(["train", "recipe=qlora", *tiny_args(tiny_model_dir, tiny_data, out, "trainer.max_steps=4")],
                out.parent)
    assert r.returncode == 0, r.stderr[-3000:]
    return out, r


def test_qlora_writes_every_output(qlora_run):
    out, r = qlora_run
    for name in ("config.yaml", "metrics.jsonl", "loss_curve.png", "summary.json",
                 "adapter/adapter_model.safetensors", "adapter/adapter_config.json", "adapter/tokenizer.json"):
        assert (out / name).is_file(), name
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000002", "step-000004"]
    assert "4-bit NF4 + double quant" in r.stderr and "bits/param" in r.stderr
    assert "no paging on cpu" in r.stderr  # qlora's default paged_adamw_32bit falls back, said once
    assert "trainable of" in r.stderr

    rows = read_jsonl(out / "metrics.jsonl")
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for row in steps:
        assert set(row) >= {"loss", "lr", "grad_norm", "tokens_per_s", "memory_mb"}
        assert math.isfinite(row["loss"]) and row["tokens_per_s"] > 0
    evals = [r for r in rows if "val_loss" in r]
    assert [r["step"] for r in evals] == [0, 2, 4]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["last_val_loss"] < summary["first_val_loss"]  # lr 1e-3 on a tiny model: visible drop
    # what data.max_seq_len cut from rows that still train, said once and kept (exact figures:
    # tests/data/test_data_sources.py); the tiny data's longest rows pass 64 tokens
    data = summary["data"]
    assert data["max_seq_len"] == 64 and data["train"]["rows"] + data["held_out"]["rows"] == 48
    assert data["train"]["truncated_rows"] > 0 and data["train"]["trained_tokens_lost"] > 0 and data["dropped_rows"] == {}
    assert r.stderr.count("data.max_seq_len=64: ") == 1
    assert f"{data['train']['truncated_rows']} of {data['train']['rows']} training rows cut" in r.stderr
    # the precision policy of this CPU, logged once, and what the run's tensors and attention had: bf16
    # compute where the CPU has native bf16 (AVX512-BF16 or AMX-BF16, read here from the kernel's own
    # flags, not through tunekit), fp32 elsewhere
    flags = {flag for line in open("/proc/cpuinfo") if line.startswith("flags")
             for flag in line.split(":", 1)[1].split()}
    want = "bf16" if flags & {"avx512_bf16", "amx_bf16"} else "fp32"
    prec = summary["precision"]
    assert prec["compute"] == want and prec["trained"] == "fp32" and prec["tf32"] is False
    seen = prec["observed"]
    assert seen["embeddings"] == seen["head"] == want and seen["trained"] == ["fp32"]  # frozen parts stay narrow
    assert seen["attention"]["q"] == seen["attention"]["k"] == seen["attention"]["v"] == want
    assert seen["attention"]["kernel"] and seen["attention"]["device"] == "cpu"
    assert r.stderr.count("precision: ") == 1
    # the measured peak beside the plan's (the tiny model: well inside the plan's device total)
    mem = summary["memory"]
    assert mem["measured_as"] == "process peak RSS" and 0 < mem["peak_mib"] <= mem["planned_device_total_mib"]
    assert mem["setup_peak_mib"] > 0  # loading and setup, measured apart from the training peak
    # and split by phase: its peak is the largest phase's
    assert list(mem["setup_phases_mib"]) == ["before the model", "loading the base", "the method and its start",
                                             "the compute path's checks", "the rest of setup"]
    assert mem["setup_peak_mib"] == max(mem["setup_phases_mib"].values())
    assert "quantize: nf4" in (out / "config.yaml").read_text()
    # the CPU threads the run had (the suite's OMP_NUM_THREADS=1), in the summary and the log
    threads = summary["threads"]
    assert threads["intra_op"] == int(os.environ["OMP_NUM_THREADS"])  # tests/conftest.py sets it (1) unless given
    assert threads["cores"] == len(os.sched_getaffinity(0))
    assert f"threads: {threads['intra_op']} intra-op on {threads['cores']} cores" in r.stderr


def test_qlora_adapter_loads_with_peft(qlora_run, tiny_model_dir):
    """The adapter is a standard PEFT folder: PeftModel.from_pretrained on the same base."""
    from peft import PeftModel

    from tunekit.model import load_base_model

    out, _ = qlora_run
    cfg = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 16
    # all-linear: every projection of every block (peft records the full module names)
    assert {name.rsplit(".", 1)[-1] for name in cfg["target_modules"]} == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert len(cfg["target_modules"]) == 2 * 7
    base = load_base_model(str(tiny_model_dir), "nf4", torch.bfloat16, torch.device("cpu"))
    x = torch.randint(0, 1000, (1, 10))
    with torch.no_grad():
        base_logits = base(input_ids=x).logits
    model = PeftModel.from_pretrained(base, out / "adapter")
    saved = adapter_tensors(out)
    loaded = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    assert len(saved) == len(loaded) == 2 * 7 * 2
    for key, value in saved.items():
        peft_key = key.replace(".weight", ".default.weight")
        assert torch.equal(loaded[peft_key].to(value.dtype), value), key
    with torch.no_grad():
        assert not torch.allclose(model(input_ids=x).logits, base_logits)  # the adapter does something


def test_resume_continues_exactly(qlora_run, tiny_model_dir, tiny_data, tmp_path):
    """Kill after the step-2 checkpoint, resume: the final adapter equals the uninterrupted one."""
    out, _ = qlora_run
    crashed = tmp_path / "crashed"
    shutil.copytree(out, crashed)
    shutil.rmtree(crashed / "checkpoints" / "step-000004")
    shutil.rmtree(crashed / "adapter")
    (crashed / "summary.json").unlink()
    r = run_cli(["train", "recipe=qlora", *tiny_args(tiny_model_dir, tiny_data, crashed, "trainer.max_steps=4",
                                                    "trainer.resume=true")], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stderr
    a, b = adapter_tensors(out), adapter_tensors(crashed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    steps = [row["step"] for row in read_jsonl(crashed / "metrics.jsonl") if "loss" in row]
    assert steps == [1, 2, 3, 4]  # rows after the checkpoint were replaced, not duplicated


def test_refuses_to_overwrite_a_finished_run(qlora_run, tiny_model_dir, tiny_data):
    out, _ = qlora_run
    before = (out / "adapter" / "adapter_model.safetensors").stat().st_mtime_ns
    r = run_cli(["train", "recipe=qlora", *tiny_args(tiny_model_dir, tiny_data, out)], out.parent)
    assert r.returncode == 2
    assert "already holds a run" in r.stderr and "trainer.resume=true" in r.stderr
    assert (out / "adapter" / "adapter_model.safetensors").stat().st_mtime_ns == before


def test_lora_recipe_with_wandb_offline(tiny_model_dir, tiny_data, tmp_path):
    out = tmp_path / "lora"
    # no API key, no ~/.netrc, WANDB_MODE unset: tunekit must pick offline by itself
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env["HOME"] = str(tmp_path)
    r = run_cli(["train", "recipe=lora", "tracker=wandb", *tiny_args(tiny_model_dir, tiny_data, out)], tmp_path,
                env=env, whole_env=True)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "wandb sync" in r.stderr
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    assert "quantize: none" in (out / "config.yaml").read_text()
    assert "bits/param" not in r.stderr  # a bf16 base has no quantized bits to report
    summary = json.loads((out / "summary.json").read_text())
    assert summary["last_val_loss"] < summary["first_val_loss"]


def test_sweep_runs_each_recipe_in_its_own_dir(tiny_model_dir, tiny_data, tmp_path):
    out = tmp_path / "sweep"
    r = run_cli(["train", "-m", "recipe=qlora,lora", *tiny_args(tiny_model_dir, tiny_data, out, "trainer.max_steps=1")],
                tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    recipes = {(out / str(i) / "config.yaml").read_text().split("\n")[0] for i in (0, 1)}
    assert recipes == {"recipe: qlora", "recipe: lora"}
    # Hydra's record of the sweep lies beside its jobs, not in the working directory
    assert (out / "multirun.yaml").is_file() and not (tmp_path / "multirun.yaml").exists()
    assert all((out / str(i) / "adapter" / "adapter_model.safetensors").is_file() for i in (0, 1))
