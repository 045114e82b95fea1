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
    # 2-token sample per evaluation: greedy answers still run through the fused layers, but each
    # token is 14 interpreted kernel calls, and the default 3 x 48 tokens would be most of a fused
    # run's time. Two held-out rows, one evaluation batch: the doctor evaluates 6 times across its
    # three fused runs, each batch 14 interpreted launches.
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

    on, off = ([row["loss"] for row in read_jsonl(run / "metrics.jsonl") if "loss" in row] for run in (fused, plain))
    val_on, val_off = ([row["val_loss"] for row in read_jsonl(run / "metrics.jsonl") if "val_loss" in row]
                       for run in (fused, plain))
    assert len(on) == len(off) == 4 and len(val_on) == len(val_off) == 3  # evaluated at steps 0, 2, 4
    # The two runs see the same rows from the same start and differ only in the LoRA layers'
    # arithmetic: the kernel's tiles in the compute dtype against bitsandbytes + peft (its LoRA branch
    # in fp32). Error analysis of one loss, a mean of per-token cross-entropies over T >= 20 tokens (a
    # step's 4 answers of ~10-40 tokens; the 2 held-out answers), in bf16 (the compute dtype of a CPU
    # with AVX512-BF16; fp32 rounds 2^16 times finer, so the bound holds there a fortiori):
    # - d CE = sum_j (p_j - [j = y]) d z_j, and p is near uniform over 49k tokens, so |d CE| ~ |d z_y|.
    #   z = E h with tied embeddings of std 0.02 over 64 dims and h RMS-normed (entries ~1): a relative
    #   error e in h moves a logit by ~0.02 * sqrt(64) * e = 0.16 e.
    # - h passes 8 linears in depth (2 layers x (q/k/v then o, gate/up then down)), whose outputs the
    #   two paths round to bf16 differently: <= 2^-8 each, random in sign, so e ~ sqrt(8) * 2^-8 ~ 1.1e-2,
    #   d z ~ 1.8e-3 per token, independent across tokens: ~1.8e-3 / sqrt(20) ~ 4e-4 per loss.
    # - Adam's first steps move each trained entry by ~lr (1e-3) whatever its gradient's size, so entries
    #   whose gradient is within rounding of 0 may end 2 lr apart; they carry next to no gradient, so over
    #   4 steps the losses drift apart by a small multiple of the above, not by lr * |grad|_1.
    # 3e-3 (7x the estimate) separates that from what this comparison exists to catch: a fused run
    # whose adapter is lost or not trained misses the held-out loss's drop over the run (asserted
    # below to exceed 5x the bound), and a wrong kernel moves every logit by O(1).
    agree = 3e-3
    assert max(abs(a - b) for a, b in zip(on + val_on, off + val_off)) <= agree, (on, off, val_on, val_off)
    assert val_off[0] - val_off[-1] > 5 * agree, val_off  # lr 1e-3 on the tiny model: the runs really trained
    assert json.loads((out / "export-merged" / "fidelity.json").read_text())["accepted"]
