"""`tunekit doctor` on the CPU: the GPU user's check, run end to end under Triton's interpreter.

This is also the fused path's end-to-end test: train with kernels.fused_lora=on, checkpoint,
SIGKILL, resume, finish; the adapter must hold every LoRA tensor, load with PEFT, track the
losses of a fused_lora=off run of the same data, and pass `tunekit export`'s fidelity check.
"""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from _helpers import read_jsonl, run_cli


def test_doctor_runs_the_fused_path_end_to_end(tiny_model_dir, tiny_data, tmp_path):
    out = tmp_path / "report"
    # small batches and no recomputation: every LoRA layer runs in Triton's (slow) interpreter. One
    # 2-token sample per evaluation: greedy answers still run through the fused layers, but the
    # default 3 x 48 tokens took 36 of a fused run's 42 s here (each token: 14 kernel calls). Two
    # held-out rows, one evaluation batch: every batch is 14 interpreted launches of ~70 ms, and the
    # doctor evaluates 6 times across its three fused runs (the fused=on run: 418 -> 376 launches).
    r = run_cli(["doctor", "--model", str(tiny_model_dir), "--data", str(tiny_data), "--steps", "4",
                 "--out", str(out), "trainer.micro_batch_size=2", "trainer.grad_accum=2", "data.max_seq_len=64",
                 "data.val_fraction=0.1", "data.max_val_examples=2", "model.gradient_checkpointing=false",
                 "trainer.lr=1e-3", "trainer.eval_samples=1", "trainer.eval_max_new_tokens=2"],
                tmp_path, env={"TRITON_INTERPRET": "1"})
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    report = json.loads((out / "report.json").read_text())
    checks = report["checks"]
    assert report["ok"] and {k for k, c in checks.items() if c["ok"]} == {
        "kernels", "train fused=on", "train fused=off", "precision and memory", "losses agree", "resume", "export"}
    assert checks["precision and memory"]["measured_as"] == "process peak RSS"
    assert checks["two ranks"]["ok"] is None and "fewer than 2 GPUs" in checks["two ranks"]["skipped"]
    assert checks["resume"]["killed_mid_run"] is True  # the kill came before the run finished
    assert "| resume | ok |" in (out / "report.md").read_text()

    fused, plain = out / "run-fused-on", out / "run-fused-off"
    assert json.loads((fused / "summary.json").read_text())["kernels"]["path"] == "fused"
    assert json.loads((plain / "summary.json").read_text())["kernels"]["path"] == "peft"
    # every LoRA tensor of every projection of both blocks, in the resumed run's adapter
    saved = load_file(str(out / "run-resumed" / "adapter" / "adapter_model.safetensors"))
    assert len(saved) == 2 * 7 * 2 and all("lora_" in k for k in saved)
    assert any(v.abs().sum() > 0 for k, v in saved.items() if "lora_B" in k)  # it trained

    from peft import PeftModel

    from tunekit.model import load_base_model

    base = load_base_model(str(tiny_model_dir), "nf4", torch.bfloat16, torch.device("cpu"))
    model = PeftModel.from_pretrained(base, out / "run-resumed" / "adapter")
    loaded = {k.replace(".default", ""): v for k, v in model.state_dict().items() if "lora_" in k}
    assert all(torch.equal(loaded[k].float(), saved[k]) for k in saved)

    on = [row["loss"] for row in read_jsonl(fused / "metrics.jsonl") if "loss" in row]
    off = [row["loss"] for row in read_jsonl(plain / "metrics.jsonl") if "loss" in row]
    assert len(on) == len(off) == 4
    assert json.loads((out / "export-merged" / "fidelity.json").read_text())["accepted"]
