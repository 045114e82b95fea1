"""The GPU check (scripts/gpu_check.sh) and its `tunekit doctor` stage on the CPU, end to end under
Triton's interpreter, on a tiny model: the script a GPU machine runs cannot rot unnoticed.

This is also the fused path's end-to-end test: train with kernels.fused_lora=on, checkpoint,
SIGKILL, resume, finish; the adapter must hold every LoRA tensor, load with PEFT, track the
losses of a fused_lora=off run of the same data, and pass `tunekit export`'s fidelity check.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from _helpers import read_jsonl


SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.sh"


@pytest.fixture(scope="module")
def gpu_check(tiny_data, tmp_path_factory):
    """scripts/gpu_check.sh --tiny: the GPU check's whole flow on a tiny model, on this CPU. Its
    doctor stage is the doctor run the tests below read."""
    root = tmp_path_factory.mktemp("gpu-check")
    out, work = root / "out", root / "work"
    # as from a shell: TRITON_INTERPRET unset (the suite sets it for itself); the dry run must set it
    # where the fused kernel is checked, or the doctor's kernel check fails
    env = {**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}, "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(SCRIPT), "--tiny", "--data", str(tiny_data), "--out", str(out),
                           "--work", str(work)], capture_output=True, text=True, env=env, timeout=900)
    return proc, out, work


def test_gpu_check_dry_run_writes_every_stage(gpu_check):
    proc, out, _ = gpu_check
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    result = json.loads((out / "gpu_check.json").read_text())
    stages = result["stages"]
    assert list(stages) == ["env", "models", "doctor", "bench", "plan", "export", "variants"]
    assert all(s["ok"] for s in stages.values()), {k: s for k, s in stages.items() if not s["ok"]}
    # the benchmark ran both systems on the same batches: same first loss up to summation order
    ratio = stages["bench"]["results"]["on"]["ratios"]["tunekit/trl"]
    assert ratio["first_loss_rel_diff"] < 1e-3 and ratio["tokens_per_s"] > 0
    # every planner row has a measured peak and the plan's figure beside it
    rows = stages["plan"]["rows"]
    assert len(rows) == 1 and all(r["measured_mib"] > 0 and r["planned_over_measured"] > 0 for r in rows)
    # its LoftQ start read back from the run's log: the seconds, and the SVD rate against auto's for the device
    assert rows[0]["loftq_s"] >= 0 and rows[0]["loftq_svd_units"] > 0 and rows[0]["loftq_units_per_s_assumed"] == 3.7e10
    assert stages["export"]["tail"][-1].startswith("exported merged to")
    # the same rows through per-example attention and through the dense mask
    var = stages["variants"]["rows"]
    assert [r["variant"] for r in var] == ["packed, per-example attention", "packed, dense block-diagonal mask"]
    from tunekit.device.facts import cpu_has_bf16

    auto = "bfloat16" if cpu_has_bf16() else "float32"  # model.dtype=auto on this CPU
    assert [r["compute_dtype"] for r in var] == [auto, auto]
    # per-example attention against the mask in bf16: the first loss within the bound derived in
    # tests/speed/test_packed_attention.py (1e-3); the next two steps' updates differ by the gradients'
    # like relative amount times a loss change per step of a few percent at this lr: far below it
    assert var[1]["max_loss_rel_diff"] < 1e-3
    md = (out / "gpu_check.md").read_text()
    assert "| doctor | ok |" in md and "| packed, dense block-diagonal mask |" in md and "tunekit/trl: tokens/s" in md and "planned/measured" in md and "## LoftQ start" in md
    with tarfile.open(out / "logs.tar.gz") as tar:
        names = tar.getnames()
    assert "doctor/report.json" in names and "bench.json" in names
    assert not any(n.startswith("models/") or Path(n).name.startswith("tokenizer") for n in names)


def test_doctor_runs_the_fused_path_end_to_end(gpu_check):
    proc, _, work = gpu_check
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    out = work / "doctor"
    tiny_model_dir = work / "models" / "tiny"
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


def test_bench_train_systems_run_and_agree(gpu_check):
    """scripts/bench_train.py as the GPU check's bench stage ran it on the tiny model: tunekit and TRL
    + peft + bitsandbytes on the same batches, 2 steps of 4 x 64 packed (TRL's padding-free collator
    against tunekit's packed rows, the subtler of the two matches), 1 rep."""
    proc, _, work = gpu_check
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    out = work / "bench"
    result = json.loads(out.with_suffix(".json").read_text())
    assert out.with_suffix(".md").read_text().startswith("# Training benchmark")
    assert set(result["versions"]) >= {"torch", "transformers", "peft", "bitsandbytes", "trl", "tunekit"}
    assert result["device"] and result["settings"]["steps"] == 2
    # the CPU's own matmul peak, measured before and after the runs (bf16 only where it is native):
    # MFU's denominator is the figure of the dtype the base computed in
    from tunekit.device.facts import cpu_has_bf16

    peaks = result["matmul_peak_gflops"]
    dtypes = {"bfloat16", "float32"} if cpu_has_bf16() else {"float32"}
    assert all(set(peaks[when]) == dtypes for when in ("before", "after")), peaks
    assert all(p["gflops"] > 0 for when in ("before", "after") for p in peaks[when].values())
    block = result["results"]["on"]
    computed = block["runs"]["tunekit"][0]["compute_dtype"]
    assert computed == ("bfloat16" if cpu_has_bf16() else "float32")  # the tiny model's model.dtype=auto
    assert block["mfu_peak"]["tflops"] == pytest.approx(peaks["before"][computed]["gflops"] / 1e3)
    for system in ("tunekit", "trl"):
        s = block["systems"][system]
        for key in ("tokens_per_s", "trained_tokens_per_s", "median_step_s", "peak_rss_mib", "first_losses", "mfu"):
            assert key in s, (system, key)
        (run,) = block["runs"][system]
        assert len(run["step_times_s"]) == 2 and len(run["losses"]) == 2
    tk, trl = block["runs"]["tunekit"][0], block["runs"]["trl"][0]
    # the same examples in the same micro-batches: identical input and trained token counts per step
    assert tk["tokens"] == trl["tokens"]
    assert trl["loss_normalised_per_step"]  # TRL divides by the trained tokens of the whole step, as tunekit
    # Step 0: same bf16 checkpoint quantized by the same deterministic NF4 code, same tokens, LoRA B = 0
    # (the adapters add nothing yet), and the same precision on both sides: TRL's default setup under
    # bf16 autocast keeps the base's bf16 embeddings, norms and head, so its residual stream is bf16 as
    # tunekit's is, the projections compute in bf16 and the loss in fp32 (on a CPU without native bf16
    # both compute in fp32). What may differ: the order of the fp32 sums in the cross-entropy
    # (~2^-24 relative), and the head's bf16 logits where the two split its matmul over different rows
    # (tunekit: the trained rows in chunks; TRL: every position), which can round a logit z to the
    # neighbouring bf16 value, |dz| <= 2^-8 |z|, independently from logit to logit. Each token's loss
    # moves by sum_v (p_v - y_v) dz_v, whose rms is at most sqrt(2) * 2^-8 * max|z|; the mean over
    # n tokens by that / sqrt(n). The tiny model is initialised with std 0.02 (its initializer_range)
    # over 64 hidden units after an RMSNorm, so its logits are ~N(0, 0.16^2), max|z| < 1 over 49k; with
    # n >= 30 trained tokens a step: rms <= 1e-3 absolute, 1e-4 of its loss (~10.8). 1e-3 relative is
    # 10 such standard deviations, and a real mismatch (a shifted mask, a lost EOS label, a mean of
    # micro-batch means, the residual stream in fp32) moves the loss by more than that.
    assert tk["losses"][0] == pytest.approx(trl["losses"][0], rel=1e-3)
    # Step 1 follows one optimizer step (TRL's LoRA weights are bf16, tunekit's fp32 masters) from
    # gradients equal up to that rounding: a step of lr 2e-4 moves the loss by ~1e-3, and the bf16
    # rounding of TRL's weights perturbs that move by 2^-8 of itself: within the same 1e-3.
    assert tk["losses"][1] == pytest.approx(trl["losses"][1], rel=1e-3)
    assert "tunekit/trl" in block["ratios"]
