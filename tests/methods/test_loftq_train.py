"""method.init=loftq on the tiny model: the start, its adapter folder, the merges and a resume.

tests/methods/test_loftq.py checks the LoftQ computation itself (quantization as bitsandbytes does it,
the alternation, the keep rule, the start file). Here it is a LoRA start a user trains from:

* the started model is closer to the original (unquantized) model than plain QLoRA's start;
* the saved folder reloads exactly into tunekit, standalone too; with 1 iteration peft's own
  loader gives the same model over the standard 4-bit base (with 2 the base is rebuilt, which peft
  alone cannot do, and that is shown);
* the merge into the dequantized base is the trained model; the merge into the original weights
  subtracts the start (W + s (B A - B_T A_T)) instead of counting it twice;
* the CLI trains it, a killed run resumes bit for bit (its rebuilt base included), export ships
  the merge above, and the plan counts the start.
"""

from __future__ import annotations

import json

import pytest
import torch

from test_methods import CPU, DTYPE, TOL, eval_logits, make_base, make_batch, train_steps
from tunekit import TunekitError
from tunekit.methods import MethodConfig
from tunekit.methods import get_method
from tunekit.methods.lora.loftq_io import LOFTQ_INIT_FILE, load_loftq_init
from tunekit.model import load_base_model

LORA = {"r": 8, "alpha": 16.0, "dropout": 0.0}
S = LORA["alpha"] / LORA["r"]
U32 = 2.0 ** -24  # fp32 unit roundoff
TARGETS = 2 * 7  # the tiny model's blocks x projections


def loftq_cfg(iters: int = 1) -> MethodConfig:
    return MethodConfig(name="lora", **LORA, init="loftq", loftq_iters=iters)


def started(model_dir, iters: int = 1, log=None):
    method, cfg = get_method("lora"), loftq_cfg(iters)
    model = method.apply(make_base(model_dir, "nf4"), cfg)
    method.start(model, cfg, str(model_dir), None, log)
    return model


def kl(reference: torch.Tensor, logits: torch.Tensor) -> float:
    """KL(reference || model), summed over the real positions."""
    p = torch.log_softmax(reference.double(), -1)
    return float((p.exp() * (p - torch.log_softmax(logits.double(), -1))).sum())


def test_the_start_is_closer_to_the_original_than_qlora_s(tiny_model_dir):
    batch = make_batch()
    original = eval_logits(load_base_model(str(tiny_model_dir), "none", torch.float32, CPU), batch)
    plain = get_method("lora").apply(make_base(tiny_model_dir, "nf4"), MethodConfig(name="lora", **LORA))
    lines = []
    model = started(tiny_model_dir, log=lines.append)
    assert f"kept in {TARGETS}/{TARGETS} layers" in lines[-1], lines
    # Each layer, recomputed here from the original weight and the layer's own tensors: the 4-bit
    # base plus s B A is nearer W than the base alone (the keep rule, and what makes the start
    # worth having). The base is the loader's quant(W) with 1 iteration: its codes did not change.
    from tunekit.methods.lora.loftq import lora_targets, read_original_weight, tensor_key

    import bitsandbytes.functional as bnbf

    plain_targets = lora_targets(plain)
    for name, t in lora_targets(model).items():
        w = read_original_weight(tiny_model_dir, tensor_key(name)).float()
        deq = bnbf.dequantize_4bit(t.base.weight.data, t.base.weight.quant_state).float()
        assert torch.equal(t.base.weight.data, plain_targets[name].base.weight.data)
        lora = S * (t.lora_B.weight.float() @ t.lora_A.weight.float())
        assert torch.linalg.norm(w - deq - lora) < torch.linalg.norm(w - deq), name
    # ... and so is the model's function.
    assert kl(original, eval_logits(model, batch)) < kl(original, eval_logits(plain, batch))


@pytest.mark.parametrize("iters", [1, 2])
def test_the_adapter_reloads_exactly_and_merges(iters, tiny_model_dir, tmp_path):
    from peft import PeftModel

    torch.manual_seed(0)
    method, cfg, batch = get_method("lora"), loftq_cfg(iters), make_batch()
    model = started(tiny_model_dir, iters)
    train_steps(model, batch)
    trained = eval_logits(model, batch)
    method.save(model, tmp_path / "a")
    assert (tmp_path / "a" / LOFTQ_INIT_FILE).is_file()
    assert json.loads((tmp_path / "a" / "adapter_config.json").read_text())["r"] == LORA["r"]

    # tunekit's load (evaluating, exporting, resuming) and a standalone folder: the trained model exactly
    fresh = method.apply(make_base(tiny_model_dir, "nf4"), cfg)
    method.load(fresh, tmp_path / "a")
    torch.testing.assert_close(eval_logits(fresh, batch), trained, atol=0, rtol=0)
    alone = method.open_adapter(make_base(tiny_model_dir, "nf4"), tmp_path / "a")
    torch.testing.assert_close(eval_logits(alone, batch), trained, atol=0, rtol=0)
    method.save(fresh, tmp_path / "again")  # the start goes on with the model
    assert load_loftq_init(tmp_path / "again").layers.keys() == load_loftq_init(tmp_path / "a").layers.keys()

    if iters == 2:  # an export computes in fp32: its rebuilt base has the codes the run trained over
        from tunekit.methods.lora.loftq import lora_targets

        wide = method.apply(load_base_model(str(tiny_model_dir), "nf4", torch.float32, CPU), cfg)
        method.load(wide, tmp_path / "a")
        ours = lora_targets(fresh)
        for name, t in lora_targets(wide).items():
            assert torch.equal(t.base.weight.data, ours[name].base.weight.data), name
            assert torch.equal(t.base.weight.quant_state.absmax, ours[name].base.weight.quant_state.absmax), name

    # peft alone, over the standard 4-bit base: the same model with 1 iteration (the base is the
    # loader's quant(W)); with 2 its base is not the one the run trained over.
    theirs = PeftModel.from_pretrained(make_base(tiny_model_dir, "nf4"), str(tmp_path / "a"))
    if iters == 1:
        torch.testing.assert_close(eval_logits(theirs, batch), trained, atol=0, rtol=0)
    else:
        assert (eval_logits(theirs, batch) - trained).abs().max() > 1e-3

    # The merge into the dequantized base: the trained function, in fp32 weights (merged vs unmerged
    # arithmetic: test_methods.TOL's bf16 steps, as for plain QLoRA).
    merged = method.merge(fresh)
    mask = batch["attention_mask"].bool()
    with torch.no_grad():
        out = merged(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()[mask]
    torch.testing.assert_close(out, trained, **TOL[DTYPE])


def test_the_merge_into_the_original_weights_counts_the_start_once(tiny_model_dir, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file

    method, cfg, batch = get_method("lora"), loftq_cfg(1), make_batch()
    model = started(tiny_model_dir)
    train_steps(model, batch)
    method.save(model, tmp_path / "a")
    name = "model.layers.1.mlp.down_proj"
    adapter = load_file(str(tmp_path / "a" / "adapter_model.safetensors"))
    A = adapter[f"base_model.model.{name}.lora_A.weight"].double()
    B = adapter[f"base_model.model.{name}.lora_B.weight"].double()
    start = load_loftq_init(tmp_path / "a").layers[name]
    A0, B0 = start.A.double(), start.B.double()

    def original():
        return load_base_model(str(tiny_model_dir), "none", torch.float32, CPU)

    W = original().get_submodule(name).weight.detach().double()
    expected = W + S * (B @ A - B0 @ A0)  # fp64: exact to ~1e-16 relative, the reference
    ours = method.merge(_applied(method, original(), cfg, tmp_path / "a"))
    got = ours.get_submodule(name).weight.detach().double()
    # fp32 arithmetic: W - s B0 A0 (r products summed, then one subtraction) and + s B A likewise:
    # each of the ~2r + 2 roundings is <= u32 times the magnitudes it adds up.
    bound = (2 * LORA["r"] + 4) * U32 * (W.abs() + S * (B.abs() @ A.abs()) + S * (B0.abs() @ A0.abs()))
    assert ((got - expected).abs() <= bound).all()
    # peft's own merge over the original weights adds s B A to W: the start once too often.
    naive = PeftModel.from_pretrained(original(), str(tmp_path / "a")).merge_and_unload()
    double = naive.get_submodule(name).weight.detach().double() - expected
    torch.testing.assert_close(double, S * (B0 @ A0), atol=float(bound.max()), rtol=0)
    assert float(S * (B0 @ A0).abs().max()) > 100 * float(bound.max())  # the double count is no rounding


def _applied(method, base, cfg, folder):
    model = method.apply(base, cfg)  # LoftQ's structure over the original weights: allowed for merging
    method.load(model, folder)
    return model


def test_refusals(tiny_model_dir):
    method = get_method("lora")
    with pytest.raises(TunekitError, match=r"^method.init=loftq: fits the LoRA start .*model.quantize=none"):
        method.check_config(loftq_cfg(), None, "none")
    with pytest.raises(TunekitError, match=r"^method.use_dora: not with method.init=loftq"):
        method.check_config(MethodConfig(name="lora", init="loftq", use_dora=True), None, "nf4")
    with pytest.raises(TunekitError, match=r"^method.loftq_iters=2: applies to method.init=loftq \(or auto\) only"):
        method.check_config(MethodConfig(name="lora", loftq_iters=2), None, "nf4")
    with pytest.raises(TunekitError, match=r"^method.loftq_iters: must be in \[1, 10\]"):
        method.check_config(MethodConfig(name="lora", init="loftq", loftq_iters=0), None, "nf4")


def test_trains_resumes_and_exports_from_the_cli(tiny_model_dir, tiny_data, tmp_path):
    """2 iterations (the base is rebuilt): the log names the start; a run killed after its step-2
    checkpoint and resumed ends with the uninterrupted run's adapter bit for bit (its base rebuilt
    again before the checkpoint loads, not twice); the merged export into the original weights is
    W + s (B A - B_T A_T) in the export's dtype."""
    from safetensors.torch import load_file

    from _helpers import run_cli, tiny_args
    from _helpers import crashed_copy

    common = ("recipe=qlora", "method.r=8", "method.alpha=16", "method.init=loftq", "method.loftq_iters=2",
              "trainer.max_steps=4")
    full = tmp_path / "full"
    r = run_cli(["train", *tiny_args(tiny_model_dir, tiny_data, full, *common)], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"LoftQ (iters=2, r=8): kept in {TARGETS}/{TARGETS} layers" in r.stderr, r.stderr[-3000:]
    run = crashed_copy(full, tmp_path / "run")
    r = run_cli(["train", *tiny_args(tiny_model_dir, tiny_data, run, *common, "trainer.resume=true")], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "LoftQ (iters" not in r.stderr  # restored from the checkpoint, not recomputed
    a, b = (load_file(str(d / "adapter" / "adapter_model.safetensors")) for d in (full, run))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    out = tmp_path / "merged"
    r = run_cli(["export", str(full), "--format", "merged", "--merge-into", "original", "--out", str(out),
                 "--force"], tmp_path)  # the gate's verdict on 4 tiny steps is not what is tested
    assert r.returncode == 0, r.stderr[-3000:]
    name = "model.layers.0.self_attn.q_proj"
    start = load_loftq_init(full / "adapter").layers[name]
    A, B = (a[f"base_model.model.{name}.lora_{x}.weight"].double() for x in "AB")
    W = load_base_model(str(tiny_model_dir), "none", torch.float32, CPU).get_submodule(name).weight.double()
    B0, A0 = start.B.double(), start.A.double()
    expected = W + S * (B @ A - B0 @ A0)
    shipped = load_file(str(out / "model.safetensors"))[f"{name}.weight"].double()
    # the fp32 sum (as in the merge test above), then one rounding to the shipped dtype: at most
    # half its spacing: eps / 2 relative (eps = 2^-mantissa bits)
    summed = (2 * 8 + 4) * U32 * (W.abs() + S * (B.abs() @ A.abs()) + S * (B0.abs() @ A0.abs()))
    dtype = load_file(str(out / "model.safetensors"))[f"{name}.weight"].dtype
    rounding = torch.finfo(dtype).eps / 2 * (expected.abs() + summed)
    assert ((shipped - expected).abs() <= summed + rounding).all()


def test_the_plan_counts_the_start():
    from tunekit.methods.lora import LoRAPlan
    from tunekit.plan.memory import TrainSetup, plan_terms, step_memory
    from tunekit.plan.shape import preset_shape

    shape = preset_shape("llama-3-8b")
    small = dict(quantize="nf4", micro_batch_size=1, seq_len=16, grad_accum=1, gradient_checkpointing=True)
    plain = TrainSetup(method="lora", options=LoRAPlan(), **small)
    loftq = TrainSetup(method="lora", options=LoRAPlan(loftq_iters=1), **small)
    assert plan_terms(shape, plain).start_bytes == 0
    start = plan_terms(shape, loftq).start_bytes
    inter, hidden = shape.intermediate_size, shape.hidden_size
    assert start >= 4 * inter * hidden * 6  # several fp32 copies of the largest projection (~1.4 GB)
    memory = step_memory(shape, loftq)
    assert memory.phase == "method start (LoftQ)" and memory.total > step_memory(shape, plain).total
    # two or more iterations also hold W - s B A in fp64
    assert plan_terms(shape, TrainSetup(method="lora", options=LoRAPlan(loftq_iters=2), **small)).start_bytes > start


_MEASURE = r"""
import json, sys, torch
from pathlib import Path
from safetensors.torch import save_file
from tunekit.methods.lora.loftq import QuantSettings, loftq_layer, read_original_weight

cases, folder = json.loads(sys.argv[1]), Path(sys.argv[2])
loftq_layer(torch.randn(64, 64), 4, 2.0, 2)  # bitsandbytes' and LAPACK's one-time set-up, outside the measure


def status(key):
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key + ":"))


peaks = []
for out_dim, in_dim, r, iters in cases:
    torch.manual_seed(0)
    save_file({"w.weight": (0.02 * torch.randn(out_dim, in_dim)).to(torch.bfloat16)}, str(folder / "model.safetensors"))
    before = status("VmRSS")
    open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS
    result = loftq_layer(read_original_weight(folder, "w.weight"), r, 2.0, iters, QuantSettings())
    peaks.append(status("VmHWM") - before)
    del result
print(json.dumps(peaks))
"""


def test_the_planned_start_covers_the_measured_one(tmp_path):
    """One layer's LoftQ start on the CPU: the two orientations of a Llama MLP projection of a
    small size (n = 1.6 M weights: 40-60 MiB, far above the allocator's noise) and a square one,
    with 1 or 2 iterations:
    the growth of the resident set over the start (VmHWM reset, glibc's mmap threshold fixed so that
    a freed tensor leaves the process at once, MKL's buffer cache off) is at most the planned bytes, and the plan is no more
    than 1.5x it: an upper bound that still says how much memory it takes."""
    import os
    import subprocess
    import sys

    from tunekit.methods.lora.variants import loftq_start_bytes

    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs Linux's /proc/self/clear_refs")
    cases = [(2048, 768, 16, 1), (768, 2048, 16, 2), (1024, 1024, 16, 1)]  # tall, wide, square
    proc = subprocess.run([sys.executable, "-c", _MEASURE, json.dumps(cases), str(tmp_path)],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1",
                               "MKL_DISABLE_FAST_MM": "1"})  # MKL frees its buffers: no case feeds another
    assert proc.returncode == 0, proc.stderr[-3000:]
    measured = json.loads(proc.stdout.strip().splitlines()[-1])
    for (out_dim, in_dim, r, iters), peak in zip(cases, measured):
        planned = loftq_start_bytes(in_dim, out_dim, r, iters)
        assert peak <= planned <= 1.5 * peak, (out_dim, in_dim, iters, peak / 2**20, planned / 2**20)
