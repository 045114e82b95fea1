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
import json
import math
from pathlib import Path

import pytest
import torch

from _helpers import need_llama_cpp, run_cli
from tunekit import TunekitError
from tunekit.commands.export import export
from tunekit.runs.load import load_tokenizer_for

# Tolerance on max |logit diff| between llama.cpp (f16 base GGUF + f32 adapter) and the trained model
# (torch, fp32), from where llama.cpp rounds, each time to f16, within u = 2^-11 of the value:
#  * stored tensors. The f32 adapter holds the fp32 LoRA matrices exactly. The f16 base GGUF holds the
#    bf16 base exactly (f16 holds every bf16 value in [2^-17, 65504]; the few weights of N(0, 0.02^2)
#    below 2^-17 move by <= 2^-25 = 3e-8, under 1% of one rounding of a typical weight, 0.02 u = 1e-5).
#    It rounds each dequantized NF4 weight (an fp32 product) once: all are f16 normals (the smallest
#    nonzero NF4 level is 0.08 of its block's absmax, ~0.05 here: 4e-3, far above f16's smallest
#    normal, 2^-14 = 6e-5). 7 matrices per layer (NF4 only).
#  * arithmetic. f32 except attention, where llama.cpp's default KV cache keeps K and V in f16 and ggml
#    converts Q and the softmax weights to f16 for the two matmuls with them (4 per layer), and every
#    base matmul, whose input ggml converts to the f16 weight's type: one for q, k and v (the same
#    input), o, one for gate and up, down (4 per layer), and the output head (1). f32 summation order,
#    rope and exp differ by ~1e-7 relative: nothing beside these.
#  * count n: bf16 base 2 * (4 + 4) + 1 = 17, NF4 base 2 * (4 + 4 + 7) + 1 = 31.
#  * through the network, to first order: the gated MLP multiplies two projections of its input, so
#    their relative errors add (x2); linear maps and the final RMSNorm keep relative error. The final
#    hidden state h is then off by at most eta = 2 n u of its norm.
#  * logits: z_v = e_v . h with ||h|| = sqrt(64) = 8 (RMSNorm output; its weight is 1, never trained)
#    and ||e_v|| <= 0.022 (embeddings drawn N(0, 0.02^2) in 64 dimensions: the largest of 49k rows is
#    ~0.02 * sqrt(64 + 5 sqrt(128))). So |dz| <= 0.022 * 8 * 2 n u, all errors aligned (worst case):
#    2.9e-3 over the bf16 base, 5.3e-3 over NF4.
# Measured against it: a q/k row order left in transformers' layout (0.25 on the runs below) and a
# dropped alpha/r (1.1) lie far outside, which test_peft_scaling_comes_out_the_same_in_llama_cpp checks.
U_F16 = 2.0**-11
ROUNDINGS = {"none": 2 * (4 + 4) + 1, "nf4": 2 * (4 + 4 + 7) + 1}
# An f16 adapter adds, on every adapted matrix, 4 roundings of its LoRA branch (A and B stored in f16;
# ggml rounds x, then A x, to f16 to multiply them): 7 matrices per layer, 56 more in all.
F16_ADAPTER_ROUNDINGS = 2 * 7 * 4


def tolerance(quantize: str, adapter_f16: bool = False) -> float:
    return 0.022 * 8 * 2 * (ROUNDINGS[quantize] + (F16_ADAPTER_ROUNDINGS if adapter_f16 else 0)) * U_F16


TOL_F32 = tolerance("none")  # the bf16 base, f32 adapter
R, ALPHA, SIGMA = 8, 24.0, 0.1  # alpha / r = 3: a file without it is off by 3x


def make_run(out: Path, model_dir: Path, data: Path, quantize: str, *, target_modules=("all-linear",),
             method: str = "lora", seed: int = 0, init: str = "default") -> Path:
    """A finished run folder as `tunekit train` leaves it, with lora_B drawn N(0, SIGMA^2) (init: how
    the LoRA started, method.init)."""
    from omegaconf import OmegaConf

    from tunekit.config import Quantize
    from tunekit.methods import get_method, train_schema
    from tunekit.model import load_base_model, load_tokenizer, prepare_for_training

    cfg = train_schema()(recipe="qlora" if quantize == "nf4" else "lora", output_dir=str(out))
    cfg.model.path, cfg.model.quantize = str(model_dir), Quantize(quantize)
    cfg.data.path, cfg.data.val_fraction, cfg.data.max_seq_len = str(data), 0.2, 64
    cfg.trainer.micro_batch_size = 4
    cfg.method.r, cfg.method.alpha, cfg.method.dropout = R, ALPHA, 0.0
    cfg.method.target_modules = list(target_modules)
    cfg.method.init = init
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
    assert f["max_abs_logit_diff"] <= tolerance(quantize, adapter_f16=dtype == "f16"), f
    assert f["top1_agreement"] > 0.99  # a near tie between two of 49k tiny logits may flip
    # the report names the base the check used and the one the user must apply the adapter over
    base = report["base_gguf"]
    assert ("dequantized NF4" in base["checked_over"]) == (quantize == "nf4") and "f16 GGUF" in base["checked_over"]
    assert base["base_dtype"] == "f16" and "adapter applied over an f16 GGUF of its base" in report["checked_by"]
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


def test_a_pissa_run_ships_the_lora_it_saved_over_the_original_weights(tiny_model_dir, tiny_data, tmp_path):
    """PiSSA trains over W - s B0 A0, and its adapter folder holds the rank-2r LoRA [B, -B0] [A; A0]
    over W itself, the weights a user's base GGUF holds: that is the adapter to ship (the loaded
    model's own rank-r LoRA belongs to the rewritten base, which no GGUF of the base holds). Checked
    over the f16 base GGUF of W, it reproduces the trained model within the bf16 base's tolerance."""
    need_llama_cpp()
    run = make_run(tmp_path / "run", tiny_model_dir, tiny_data, "none", init="pissa")
    report = export(run, "gguf-adapter", tmp_path / "a.gguf", eval_batches=1, task_rows=0)
    assert report["accepted"] and report["base_gguf"]["lora_ranks"] == [2 * R], report["base_gguf"]
    assert report["fidelity"]["max_abs_logit_diff"] <= tolerance("none"), report["fidelity"]


@pytest.mark.parametrize("rslora", [False, True])
def test_peft_scaling_comes_out_the_same_in_llama_cpp(tiny_model_dir, tmp_path, rslora):
    """alpha / r (alpha / sqrt(r) with rsLoRA) must reach llama.cpp, which multiplies by the file's
    adapter.lora.alpha over each tensor's rank: the check sees a file that drops it, or that takes
    lora_alpha as it is under rsLoRA, and the q/k rows left in transformers' order."""
    need_llama_cpp()
    from peft import LoraConfig, get_peft_model
    from transformers import AutoTokenizer, LlamaForCausalLM

    from tunekit.export import gguf_adapter as ga
    from tunekit.export.stream import plan_base
    from tunekit.infer.llamacpp import LlamaCppModel, weight_repacking
    from tunekit.device.facts import cpuinfo_text

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

    folder = tmp_path / "adapter"
    model.save_pretrained(folder)  # the files export reads, as peft writes them
    base_config = json.loads((tiny_model_dir / "config.json").read_text())
    lora = ga.adapter_tensors(folder, base_config)
    assert lora.alpha == pytest.approx(scaling * r) and lora.ranks == [r]
    real = ga.interleave_rotary_rows
    ga.interleave_rotary_rows = lambda w, n: w
    try:
        unpermuted = ga.adapter_tensors(folder, base_config)
    finally:
        ga.interleave_rotary_rows = real
    files = {"right": lora, "alpha/r dropped": dataclasses.replace(lora, alpha=float(r)),
             "q/k rows unpermuted": unpermuted}
    if rslora:
        files["lora_alpha as it is"] = dataclasses.replace(lora, alpha=alpha)
    for i, (what, tensors) in enumerate(files.items()):
        ga.write_adapter_gguf(tensors, tmp_path / f"{i}.gguf", "fp32", what)
    plan, why = plan_base(tiny_model_dir, "model.path", nf4=False)
    assert plan is not None, why
    assert ga.write_base_gguf(plan, tok, tmp_path / "base.gguf", "tiny", torch.device("cpu")) == "fp16"
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


# ---------------------------------------------------------------- the base GGUF, streamed from the files
def _independent_base(model_dir: Path, nf4: bool) -> dict[str, torch.Tensor]:
    """{name: fp32 tensor} the run computed with, found without tunekit: the bf16 file read by
    safetensors; for a 4-bit run every Linear but the head replaced by transformers' own 4-bit load
    of it (bitsandbytes quantizing each weight as it loads), dequantized by bitsandbytes."""
    from safetensors.torch import load_file

    weights = {k: v.float() for k, v in load_file(str(model_dir / "model.safetensors")).items()}
    if nf4:
        import bitsandbytes as bnb
        import bitsandbytes.functional as bnbf
        from transformers import AutoModelForCausalLM, BitsAndBytesConfig

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, device_map={"": "cpu"},
                                                     quantization_config=BitsAndBytesConfig(
                                                         load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                         bnb_4bit_use_double_quant=True,
                                                         bnb_4bit_compute_dtype=torch.float32,
                                                         llm_int8_skip_modules=["lm_head"]))
        for name, m in model.named_modules():
            if isinstance(m, bnb.nn.Linear4bit):
                weights[f"{name}.weight"] = bnbf.dequantize_4bit(m.weight.data, m.weight.quant_state).float()
    return weights


@pytest.mark.parametrize("quantize", ["none", "nf4"])
def test_base_gguf_holds_the_weights_the_run_computed_with(runs, tiny_model_dir, quantize, tmp_path):
    """Every tensor of the streamed base GGUF against the base computed independently. f16 rounds to
    nearest: a value x of magnitude >= 2^-14 (a normal f16) moves by at most half an ulp, 2^-11 |x|;
    below, the spacing is 2^-24 (subnormals) and x moves by at most 2^-25. Over the bf16 base that is
    no move at all for |x| >= 2^-17 (8 significant bits fit f16's 11), so those must be equal; the
    dequantized NF4 values (fp32 products) are each within the bound, and off the plain bf16 weights
    by more than it (what an f16 GGUF of the original weights would hold instead)."""
    import gguf

    from tunekit.export import gguf_adapter as ga
    from tunekit.export.gguf import gguf_tensor_name, interleave_rotary_rows
    from tunekit.runs.open import open_source

    src = open_source(runs[quantize], what="RUN_DIR", runs_only=True)
    path = tmp_path / "base.gguf"
    assert ga.write_base_gguf(ga.base_plan(src), load_tokenizer_for(src), path, "tiny", torch.device("cpu")) == "fp16"
    want = _independent_base(tiny_model_dir, quantize == "nf4")
    stored = {k: v for k, v in _independent_base(tiny_model_dir, False).items()}
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    names = {gguf_tensor_name(k): k for k in want if k != "lm_head.weight"}  # tied: stored once, as token_embd
    assert set(tensors) == set(names) and "output.weight" not in tensors
    moved = 0
    for out_name, name in names.items():
        w, t = want[name], tensors[out_name]
        if ".q_proj." in name or ".k_proj." in name:
            heads = cfg["num_attention_heads"] if ".q_proj." in name else cfg["num_key_value_heads"]
            w, stored[name] = interleave_rotary_rows(w, heads), interleave_rotary_rows(stored[name], heads)
        got = torch.from_numpy(t.data.astype("float32")).reshape(w.shape)
        if w.dim() == 1:  # norms: f32 in the file, as stored
            assert t.tensor_type.name == "F32" and torch.equal(got, w), name
            continue
        assert t.tensor_type.name == "F16", name
        bound = torch.maximum(2.0**-11 * w.abs(), torch.tensor(2.0**-25))
        assert ((got - w).abs() <= bound).all(), (name, ((got - w).abs() / bound).max())
        if quantize == "none" or name.endswith("embed_tokens.weight"):  # bf16 values as stored
            big = w.abs() >= 2.0**-17
            assert torch.equal(got[big], w[big]), name
        else:
            moved += bool(((got - stored[name]).abs() > bound).any())
    assert moved == (14 if quantize == "nf4" else 0)  # every NF4 projection holds the dequantized weights


def test_a_weight_beyond_f16_makes_the_base_gguf_bf16(tiny_model_dir, tmp_path, caplog):
    """A base weight of 99840 (a bf16 value; f16's largest finite is 65504, and from 65520 on it rounds
    to infinity) cannot go into an f16 file: the base GGUF is bf16 instead, every bf16 weight exact."""
    import gguf
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    from tunekit.export import gguf_adapter as ga
    from tunekit.export.stream import plan_base

    base = tmp_path / "base"
    base.mkdir()
    for f in tiny_model_dir.iterdir():
        if f.name != "model.safetensors":
            (base / f.name).write_bytes(f.read_bytes())
    weights = load_file(str(tiny_model_dir / "model.safetensors"))
    weights["model.layers.1.mlp.down_proj.weight"][3, 5] = 99840.0
    save_file(weights, str(base / "model.safetensors"), metadata={"format": "pt"})
    plan, why = plan_base(base, "model.path", nf4=False)
    assert plan is not None, why
    path = tmp_path / "base.gguf"
    assert ga.write_base_gguf(plan, AutoTokenizer.from_pretrained(base), path, "tiny", torch.device("cpu")) == "bf16"
    assert "model.layers.1.mlp.down_proj.weight holds a weight beyond f16's range" in caplog.text
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    down = tensors["blk.1.ffn_down.weight"]
    assert {t.tensor_type.name for t in tensors.values() if len(t.shape) > 1} == {"BF16"}
    got = torch.from_numpy(down.data.copy()).view(torch.bfloat16).reshape(64, 128)
    assert torch.equal(got, weights["model.layers.1.mlp.down_proj.weight"])


def test_the_export_holds_no_model_copy_beside_llama_cpp(runs, tiny_model_dir, tmp_path, monkeypatch):
    """The export's budget is one 16-bit copy of the model, and llama.cpp holds it (the base GGUF, which
    it reads whole). So when the base GGUF is about to be written, and when llama.cpp loads it, the
    tensors alive in this process beyond those alive before the export began must hold less than one
    more 16-bit copy, 2 bytes a weight (7.0 MB for the tiny model). What they legitimately are then:
    the reference figures (the 64 largest logits, fp32, and their int64 ids, of each of the <= 256
    positions of the held-out batch: 0.2 MB) and the batch itself (4 KB); nothing of the model. An
    fp32 copy of the base, what the export used to write the base GGUF from and kept until llama.cpp
    had loaded it, is 14 MB: twice the bound."""
    import gc

    from safetensors import safe_open

    from tunekit.export import gguf as gguf_writer
    from tunekit.infer import llamacpp

    def live_bytes() -> int:  # tensors Python reaches (parameters, buffers, anything held), each storage once
        storages = {}
        for o in gc.get_objects():
            if isinstance(o, torch.Tensor) and not o.is_meta:
                storages[o.untyped_storage().data_ptr()] = o.untyped_storage().nbytes()
        return sum(storages.values())

    seen = {}
    write, load = gguf_writer.write_gguf_tensors, llamacpp.LlamaCppModel.__init__

    def writing(*args, **kwargs):
        seen.setdefault("writing the base GGUF", live_bytes())
        return write(*args, **kwargs)

    def loading(*args, **kwargs):
        seen["llama.cpp loading it"] = live_bytes()
        return load(*args, **kwargs)

    monkeypatch.setattr(gguf_writer, "write_gguf_tensors", writing)
    monkeypatch.setattr(llamacpp.LlamaCppModel, "__init__", loading)
    with safe_open(str(tiny_model_dir / "model.safetensors"), "pt") as f:  # the tied head is stored once
        params = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    gc.collect()
    before = live_bytes()
    report = export(runs["nf4"], "gguf-adapter", tmp_path / "a.gguf", eval_batches=1, task_rows=0)
    assert report["accepted"] and set(seen) == {"writing the base GGUF", "llama.cpp loading it"}, seen
    for moment, live in seen.items():
        assert live - before < 2 * params, (moment, live - before, 2 * params)


def test_a_base_it_cannot_stream_is_one_line_before_loading(runs, tiny_model_dir, tmp_path, monkeypatch):
    """The base GGUF is written from the base's safetensors files: a base without them is refused
    with the reason before any model loads (there is no other way to write it)."""
    base = tmp_path / "base"
    base.mkdir()
    for f in tiny_model_dir.iterdir():
        if f.name != "model.safetensors":
            (base / f.name).write_bytes(f.read_bytes())
    (base / "pytorch_model.bin").write_bytes(b"")
    run = tmp_path / "run"
    (run / "adapter").mkdir(parents=True)
    for f in (runs["none"] / "adapter").iterdir():
        (run / "adapter" / f.name).write_bytes(f.read_bytes())
    (run / "config.yaml").write_text((runs["none"] / "config.yaml").read_text().replace(str(tiny_model_dir), str(base)))

    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("tunekit.model.load_base_model", no_load)
    with pytest.raises(TunekitError, match=rf"^--format gguf-adapter: llama.cpp's check applies the adapter over a GGUF "
                                           rf"of the base written from its safetensors files, and {base} holds no "
                                           rf"safetensors weights to stream from; use --format adapter, or gguf"):
        export(run, "gguf-adapter", tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()
