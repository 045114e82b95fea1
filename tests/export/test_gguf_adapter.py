"""`tunekit export --format gguf-adapter`: a LoRA as llama.cpp's LoRA adapter GGUF, applied by
llama.cpp itself over a GGUF of the base the adapter trained against, measured against the trained
model through the export's usual comparison and gate.

The two runs here (LoRA over the tiny bf16 base, LoRA over its NF4 quantization) are built, not
trained: config.yaml and adapter/ as `tunekit train` writes them (the resolved config; method.save()
and the tokenizer), with every lora_B drawn at random where training would have learnt it. Two
optimizer steps leave B at ~1e-3: such an adapter barely moves the q and k projections of the random
tiny model (its attention stays near uniform), so a q/k row order wrong in the file changed its
logits by 2e-3 only, inside the tolerance below. Drawn B make every adapted matrix matter (a wrong
q/k order moved these runs' logits by 0.25, a dropped alpha/r by 1.1; the gate, on KL alone here,
accepted the first) and cost no training time.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from _helpers import need_llama_cpp, run_cli
from tunekit import TunekitError
from tunekit.commands.export import export

# Tolerance on max |logit diff| between llama.cpp (f32 base GGUF + f32 adapter) and the trained model
# (torch, fp32), from where llama.cpp rounds:
#  * stored tensors: nothing. f32 holds the bf16 base, the dequantized NF4 values and the fp32 LoRA
#    matrices exactly.
#  * arithmetic: f32 except attention, where llama.cpp's default KV cache keeps K and V in f16 and
#    ggml converts Q and the softmax weights to f16 for the two matmuls with them: 4 roundings per
#    layer of relative size <= u = 2^-11, 8 in this 2-layer model. f32 summation order, rope and exp
#    differ by ~1e-7 relative: nothing beside these.
#  * through the network, to first order: the gated MLP multiplies two projections of its input, so
#    their relative errors add (x2); linear maps and the final RMSNorm keep relative error. The final
#    hidden state h is then off by at most eta = 2 * 8 * u = 7.8e-3 of its norm.
#  * logits: z_v = e_v . h with ||h|| = sqrt(64) = 8 (RMSNorm output; its weight is 1, never trained)
#    and ||e_v|| <= 0.022 (embeddings drawn N(0, 0.02^2) in 64 dimensions: the largest of 49k rows is
#    ~0.02 * sqrt(64 + 5 sqrt(128))). So |dz| <= 0.022 * 8 * eta = 1.4e-2, all errors aligned (worst case).
# Measured against it: a q/k row order left in transformers' layout (0.25 on the runs below) and a
# dropped alpha/r (1.1) lie far outside, which test_peft_scaling_comes_out_the_same_in_llama_cpp checks.
TOL_F32 = 1.4e-2
# An f16 adapter adds, on every adapted matrix, 4 roundings of its LoRA branch (A and B stored in f16;
# ggml rounds x, then A x, to f16 to multiply them): 7 matrices per layer, ~28 more per layer on top
# of attention's 4, so eta <= 2 * (8 + 56) * u and the bound grows 8x. Checked for the dtype's wiring.
TOL_F16 = 8 * TOL_F32
R, ALPHA, SIGMA = 8, 24.0, 0.1  # alpha / r = 3: a file without it is off by 3x


def make_run(out: Path, model_dir: Path, data: Path, quantize: str, *, target_modules=("all-linear",),
             method: str = "lora", seed: int = 0) -> Path:
    """A finished run folder as `tunekit train` leaves it, with lora_B drawn N(0, SIGMA^2)."""
    from omegaconf import OmegaConf

    from tunekit.config import Quantize, TrainConfig
    from tunekit.methods import get_method
    from tunekit.model import load_base_model, load_tokenizer, prepare_for_training

    cfg = TrainConfig(recipe="qlora" if quantize == "nf4" else "lora", output_dir=str(out))
    cfg.model.path, cfg.model.quantize = str(model_dir), Quantize(quantize)
    cfg.data.path, cfg.data.val_fraction, cfg.data.max_seq_len = str(data), 0.2, 64
    cfg.trainer.micro_batch_size = 4
    cfg.method.r, cfg.method.alpha, cfg.method.dropout = R, ALPHA, 0.0
    cfg.method.target_modules = list(target_modules)
    torch.manual_seed(seed)  # lora_A's initialisation
    model = load_base_model(str(model_dir), quantize, torch.float32, torch.device("cpu"))
    prepare_for_training(model, quantize, gradient_checkpointing=False)
    lora = get_method("lora")
    model = lora.apply(model, cfg.method)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0.0, SIGMA)
    lora.save(model, out / "adapter")
    load_tokenizer(str(model_dir)).save_pretrained(out / "adapter")
    cfg.method.name = method  # a run of another method, for the refusals (nothing of it is loaded)
    (out / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    return out


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tiny_data, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf-adapter-runs")
    return {q: make_run(root / q, tiny_model_dir, tiny_data, q) for q in ("nf4", "none")}


def _saved_b(run: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for k, v in load_file(str(run / "adapter" / "adapter_model.safetensors")).items() if ".lora_B." in k}


@pytest.mark.parametrize("quantize, dtype", [("none", None), ("nf4", None), ("none", "f16")])
def test_adapter_gguf_over_the_base_reproduces_the_trained_model(runs, quantize, dtype, tmp_path):
    need_llama_cpp()
    import gguf

    from tunekit.export.gguf import interleave_rotary_rows

    out = tmp_path / "adapter.gguf"
    report = export(runs[quantize], "gguf-adapter", out, dtype=dtype, eval_batches=1, task_rows=0)
    f = report["fidelity"]
    assert report["accepted"] and report["checked_by"].startswith("llama.cpp"), report["gate"]
    assert report["dtype"] == (dtype or "f32") and f["tokenizer_agreement"] == 1.0
    assert f["max_abs_logit_diff"] <= (TOL_F16 if dtype else TOL_F32), f
    assert f["top1_agreement"] > 0.99  # a near tie between two of 49k tiny logits may flip
    # the report names the base the check used and the one the user must apply the adapter over
    base = report["base_gguf"]
    assert ("dequantized NF4" in base["checked_over"]) == (quantize == "nf4") and "f32 GGUF" in base["checked_over"]
    assert base["lora_alpha"] == ALPHA and base["lora_ranks"] == [R] and base["adapted_tensors"] == 14
    # only the adapter and its report ship: the base GGUF stayed in the temp folder
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter.gguf", "adapter.gguf.fidelity.json"]

    reader = gguf.GGUFReader(out)
    field = lambda key: reader.fields[key].contents()  # noqa: E731
    assert field("general.type") == "adapter" and field("general.architecture") == "llama"
    assert field("adapter.type") == "lora" and field("adapter.lora.alpha") == ALPHA
    tensors = {t.name: t for t in reader.tensors}
    kinds = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    assert set(tensors) == {f"blk.{i}.{k}.weight.lora_{ab}" for i in (0, 1) for k in kinds for ab in "ab"}
    assert {t.tensor_type.name for t in tensors.values()} == {"F16" if dtype else "F32"}
    # ggml's order of dimensions: lora_a (in, r), lora_b (r, out); attn_k of 2 kv heads of 16 is 32 rows
    assert list(tensors["blk.0.attn_k.weight.lora_a"].shape) == [64, R]
    assert list(tensors["blk.0.attn_k.weight.lora_b"].shape) == [R, 32]
    assert list(tensors["blk.1.ffn_down.weight.lora_a"].shape) == [128, R]
    # B as trained; q and k rows in the base GGUF's interleaved rotary order
    saved = _saved_b(runs[quantize])
    prefix = "base_model.model.model.layers.1"
    for kind, module, heads in (("attn_k", "self_attn.k_proj", 2), ("attn_q", "self_attn.q_proj", 4),
                                ("attn_v", "self_attn.v_proj", None)):
        b = saved[f"{prefix}.{module}.lora_B.weight"]
        want = interleave_rotary_rows(b, heads) if heads else b
        got = torch.from_numpy(tensors[f"blk.1.{kind}.weight.lora_b"].data.astype("float32").copy())
        assert torch.allclose(got, want, atol=0 if not dtype else 1e-3, rtol=0 if not dtype else 1e-3), kind


@pytest.mark.parametrize("rslora", [False, True])
def test_peft_scaling_comes_out_the_same_in_llama_cpp(tiny_model_dir, tmp_path, rslora):
    """alpha / r (alpha / sqrt(r) with rsLoRA) must reach llama.cpp, which multiplies by the file's
    adapter.lora.alpha over each tensor's rank: the check sees a file that drops it, or that takes
    lora_alpha as it is under rsLoRA, and the q/k rows left in transformers' order."""
    need_llama_cpp()
    from peft import LoraConfig, get_peft_model
    from transformers import AutoTokenizer, LlamaForCausalLM

    from tunekit.device.facts import cpuinfo_text
    from tunekit.export import gguf_adapter as ga
    from tunekit.infer.llamacpp import LlamaCppModel, weight_repacking

    r, alpha = 4, (6.0 if rslora else 12.0)
    scaling = alpha / (r ** 0.5 if rslora else r)  # peft's: 3 either way (lora_alpha / r would be 1.5 under rsLoRA)
    torch.manual_seed(0)
    base = LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=r, lora_alpha=alpha, use_rslora=rslora, lora_dropout=0.0,
                                            target_modules="all-linear")).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0.0, 2 * SIGMA)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = torch.tensor([tok("What is 12 plus 12? 12 plus 12 is 24. Adding is easy. Adding is easy.")["input_ids"]])
    with torch.no_grad():
        z_ref = model(input_ids=ids).logits[0].float()

    lora = ga.lora_tensors(model)
    assert lora.alpha == pytest.approx(scaling * r) and lora.ranks == [r]
    real = ga.interleave_rotary_rows
    ga.interleave_rotary_rows = lambda w, n: w
    try:
        unpermuted = ga.lora_tensors(model)
    finally:
        ga.interleave_rotary_rows = real
    files = {"right": lora, "alpha/r dropped": dataclasses.replace(lora, alpha=float(r)),
             "q/k rows unpermuted": unpermuted}
    if rslora:
        files["lora_alpha as it is"] = dataclasses.replace(lora, alpha=alpha)
    for i, (what, tensors) in enumerate(files.items()):
        ga.write_adapter_gguf(tensors, tmp_path / f"{i}.gguf", "fp32", what)
    ga.write_base_gguf(ga.unloaded_base(model), tok, tmp_path / "base.gguf", "tiny")
    repack = weight_repacking(cpuinfo_text())[0]
    diffs = {}
    for i, what in enumerate(files):
        llm = LlamaCppModel(tmp_path / "base.gguf", ids.shape[1], 1, repack, lora=tmp_path / f"{i}.gguf")
        try:
            z = llm.logits({"input_ids": ids, "attention_mask": torch.ones_like(ids)})[0]
        finally:
            llm.close()
        diffs[what] = (z - z_ref).abs().max().item()
    assert diffs["right"] <= TOL_F32, diffs
    assert all(d > 10 * TOL_F32 for what, d in diffs.items() if what != "right"), diffs


@pytest.mark.parametrize("method, instead", [
    ("prompt_tuning", "use --format adapter"), ("adapter", "use --format adapter"),
    ("bitfit", "use --format gguf"), ("full", "use --format gguf"),
])
def test_methods_llama_cpp_cannot_apply_are_refused_before_loading(runs, method, instead, tmp_path, monkeypatch):
    run = tmp_path / "run"
    (run / "adapter").mkdir(parents=True)
    (run / "adapter" / "adapter_model.safetensors").write_bytes(
        (runs["none"] / "adapter" / "adapter_model.safetensors").read_bytes())
    config = (runs["none"] / "config.yaml").read_text()
    assert config.count("name: lora") == 1  # method.name
    (run / "config.yaml").write_text(config.replace("name: lora", f"name: {method}"))

    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("tunekit.model.load_base_model", no_load)
    with pytest.raises(TunekitError, match=rf"--format gguf-adapter: method '{method}' has no llama.cpp adapter "
                                           rf"form .*; {instead}"):
        export(run, "gguf-adapter", tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()


@pytest.mark.parametrize("target, culprit", [
    ("lm_head", "adapts an output head tied to the token embeddings"),  # the tiny model ties them
    # (LoRA on embed_tokens is refused by method.target_modules before any run exists)
])
def test_lora_targets_llama_cpp_cannot_map_are_one_line(tiny_model_dir, tiny_data, target, culprit, tmp_path):
    run = make_run(tmp_path / "run", tiny_model_dir, tiny_data, "none", target_modules=("q_proj", target))
    r = run_cli(["export", str(run), "--format", "gguf-adapter", "--out", str(tmp_path / "x.gguf")], tmp_path)
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(lines) == 1, r.stderr
    assert lines[0].startswith("tunekit: error: --format gguf-adapter: ") and culprit in lines[0], lines[0]
    assert "use --format gguf" in lines[0] and not (tmp_path / "x.gguf").exists()


def test_without_llama_cpp_and_with_a_wrong_dtype_it_is_refused(runs, tmp_path, monkeypatch):
    from tunekit.infer import llamacpp

    with pytest.raises(TunekitError, match=r"--dtype: 'bf16' is not a dtype of --format gguf-adapter; choose one of "
                                           r"auto \(f32\), f32, f16"):
        export(runs["none"], "gguf-adapter", tmp_path / "x.gguf", dtype="bf16")
    with pytest.raises(TunekitError, match="--merge-into applies to --format merged and gguf"):
        export(runs["nf4"], "gguf-adapter", tmp_path / "x.gguf", merge_into="dequantized")
    monkeypatch.setattr(llamacpp, "unavailable", lambda: "llama-cpp-python is not usable here (ImportError: no)")
    with pytest.raises(TunekitError, match=r"^--format gguf-adapter is checked by llama.cpp, which is not available: "
                                           r"llama-cpp-python is not usable here \(ImportError: no\); "):
        export(runs["none"], "gguf-adapter", tmp_path / "x.gguf")
    assert not list(tmp_path.iterdir())
