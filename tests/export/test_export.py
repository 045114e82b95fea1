"""`tunekit export`: adapter, merged and GGUF exports of real (tiny) runs, checked and atomic.

Two tiny runs are trained once per module through the real CLI (qlora: LoRA over a 4-bit NF4
base; lora: LoRA over a bf16 base). Most exports are called in-process (`export()`, the function
behind the CLI) to keep the file fast; the CLI itself is exercised for the printed summary, the
refusal exit code and one-line errors. GGUF files are checked by llama.cpp itself
(llama-cpp-python, built by scripts/setup.sh): those tests fail in CI when it cannot be imported,
and skip elsewhere. One test runs qlora -> merged on the real default model.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from _helpers import need_llama_cpp, run_cli, tiny_args
from tunekit import TunekitError
from tunekit.commands.export import export as tunekit_export
from tunekit.export.task import DEFAULT_TASK_ROWS
from tunekit.export.gate import KL_FALLBACK, MIN_GAIN_KEPT, MIN_GAIN_KEPT_LOSSY


def export(*args, task_rows: int = 0, **kwargs) -> dict:
    """tunekit's export, by default without its task check: its greedy answers to every held-out row,
    for the base, the trained model and each candidate, took a fifth of this module's CPU time in
    tests that read none of it. The tests of the task check ask for it (task_rows=DEFAULT_TASK_ROWS)."""
    return tunekit_export(*args, task_rows=task_rows, **kwargs)


def _train(recipe: str, model_dir: Path, data: Path, out: Path, *extra: str) -> Path:
    r = run_cli(["train", f"recipe={recipe}", *tiny_args(model_dir, data, out, "trainer.max_steps=2", *extra)], out.parent)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tiny_data, tmp_path_factory) -> dict[str, Path]:
    """Plain QLoRA (B = 0 at the start: the merge formulas below) and LoRA; LoftQ's: test_export_stream.py."""
    root = tmp_path_factory.mktemp("export-runs")
    return {"qlora": _train("qlora", tiny_model_dir, tiny_data, root / "qlora", "method.init=default"),
            "lora": _train("lora", tiny_model_dir, tiny_data, root / "lora")}


def tree_digest(path: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(p for p in Path(path).rglob("*") if p.is_file()) if Path(path).is_dir() else [Path(path)]:
        h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()


def leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if ".tmp-" in p.name or p.name.endswith(".old")]


# ---------------------------------------------------------------- adapter
@pytest.mark.parametrize("recipe", ["qlora", "lora"])
def test_adapter_export_loads_with_peft(runs, recipe, tmp_path):
    out = tmp_path / "adapter"
    report = export(runs[recipe], "adapter", out, eval_batches=1)
    for name in ("adapter_model.safetensors", "adapter_config.json", "tokenizer.json", "fidelity.json"):
        assert (out / name).is_file(), name
    assert report["accepted"] and report["fidelity"]["kl_mean"] < 1e-6  # same weights, same base: exact
    assert report["fidelity"]["top1_agreement"] == 1.0 and report["fidelity"]["tokenizer_agreement"] == 1.0
    assert json.loads((out / "fidelity.json").read_text())["format"] == "adapter"
    assert json.loads((out / "adapter_config.json").read_text())["peft_type"] == "LORA"
    saved, trained = load_file(str(out / "adapter_model.safetensors")), load_file(str(runs[recipe] / "adapter" / "adapter_model.safetensors"))
    assert saved.keys() == trained.keys() and all(torch.equal(saved[k], trained[k]) for k in saved)


# ---------------------------------------------------------------- merged
LOAD_WITHOUT_TUNEKIT = """
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()
tok = AutoTokenizer.from_pretrained(sys.argv[1])
ids = tok.apply_chat_template([{"role": "user", "content": "What is 3 plus 3?"}], add_generation_prompt=True,
                              return_tensors="pt", return_dict=True)["input_ids"]
with torch.no_grad():
    logits = model(input_ids=ids).logits.float()
assert not any(m == "tunekit" or m.startswith("tunekit.") for m in sys.modules), "tunekit was imported"
assert str(model.dtype) == "torch.bfloat16", model.dtype
torch.save({"ids": ids, "logits": logits}, sys.argv[2])
"""


def test_merged_export_via_cli_loads_without_tunekit(runs, tmp_path):
    """qlora -> merged bf16 (into the dequantized NF4 weights: the trained model itself) through
    the real CLI; a python that never imports tunekit loads it."""
    out = tmp_path / "merged"
    r = run_cli(["export", str(runs["qlora"]), "--format", "merged", "--merge-into", "dequantized", "--out", str(out),
                 "--eval-batches", "2"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "fidelity of merged bf16 (into the dequantized NF4 weights)" in r.stdout, r.stdout
    assert "gain kept" in r.stdout and "KL(trained||exported)" in r.stdout and "-> OK" in r.stdout
    for name in ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "fidelity.json"):
        assert (out / name).is_file(), name
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    assert not leftovers(tmp_path)
    # merged as it was written, from the base's files (tunekit.export.stream); KL from the top-k summary
    report = json.loads((out / "fidelity.json").read_text())
    assert report["merged_by"] == "streamed" and report["fidelity"]["kl_estimate"].startswith("top-64")
    # where this CPU emulates bf16, the check computed the export's linears in fp32 and says so
    from tunekit.device.facts import cpu_emulated_dtypes

    note = json.loads((out / "fidelity.json").read_text())["fidelity"].get("half_linears")
    if torch.bfloat16 in cpu_emulated_dtypes():
        assert note == "bfloat16 linears computed as fp32 matmuls, rounded once to bfloat16 (emulated on this CPU)"
        assert note in r.stdout
    else:
        assert note is None and "linears computed as fp32" not in r.stdout

    res = subprocess.run([sys.executable, "-c", LOAD_WITHOUT_TUNEKIT, str(out), str(tmp_path / "logits.pt")],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    got = torch.load(tmp_path / "logits.pt")
    from tunekit.runs.load import load_trained
    from tunekit.runs.open import open_source

    with torch.no_grad():
        want = load_trained(open_source(runs["qlora"]))(input_ids=got["ids"]).logits.float()
    # bf16 storage of the merged weights vs fp32-dequantized NF4 + LoRA at train time
    assert (got["logits"] - want).abs().max() < 0.05


def test_adapter_of_a_bf16_run_reloads_exactly(tiny_model_dir, tiny_data, tmp_path):
    """model.dtype=bf16 (emulated on a CPU without native bf16, where the check computes half linears
    in fp32): the trained reference and the reloaded adapter run the same kernels, so the same
    adapter compares exactly. A mismatch of kernels shows as whole bf16 ulps of the logits (measured
    0.008 here when only the candidate ran in fp32); 1e-4 is far below one."""
    run = _train("lora", tiny_model_dir, tiny_data, tmp_path / "run", "model.dtype=bf16")
    report = export(run, "adapter", tmp_path / "adapter", eval_batches=2)
    assert report["accepted"] and report["fidelity"]["max_abs_logit_diff"] < 1e-4, report["fidelity"]


def test_merged_nf4_weights_are_fresh_dequantized_base_plus_delta(runs, tiny_model_dir, tmp_path):
    """W_merged == dequant(NF4 codes, read afresh) + (alpha/r) B A, i.e. merged into the base the
    adapter trained against, in fp32, never into a re-quantized or CPU-repacked weight."""
    import bitsandbytes.functional as bnbf

    from tunekit.model import load_base_model

    out = tmp_path / "merged"
    export(runs["qlora"], "merged", out, dtype="fp32", merge_into="dequantized", eval_batches=1)
    merged = load_file(str(out / "model.safetensors"))
    from tunekit.runs.open import open_source

    # the export measures and merges in fp32 whatever the run computed in: dequantize_4bit's fp32 values
    assert open_source(runs["qlora"]).dtype in (torch.bfloat16, torch.float32)
    base = load_base_model(str(tiny_model_dir), "nf4", torch.float32, torch.device("cpu"))
    adapter = load_file(str(runs["qlora"] / "adapter" / "adapter_model.safetensors"))
    cfg = json.loads((runs["qlora"] / "adapter" / "adapter_config.json").read_text())
    scale = cfg["lora_alpha"] / cfg["r"]
    for layer in range(2):
        for proj in ("self_attn.q_proj", "mlp.down_proj"):
            name = f"model.layers.{layer}.{proj}"
            q = base.get_submodule(name).weight
            w = bnbf.dequantize_4bit(q.data, q.quant_state).float()  # (out, in)
            a, b = adapter[f"base_model.model.{name}.lora_A.weight"], adapter[f"base_model.model.{name}.lora_B.weight"]
            delta = scale * b.float() @ a.float()
            assert delta.abs().max() > 0  # two steps at lr 1e-3 moved B off zero
            torch.testing.assert_close(merged[f"{name}.weight"], w + delta, rtol=0, atol=1e-6)


def test_merged_export_over_bf16_base(runs, tmp_path):
    out = tmp_path / "merged"
    report = export(runs["lora"], "merged", out, eval_batches=1)
    assert report["accepted"] and report["dtype"] == "bf16" and report["merge_into"] == "original"
    assert report["gate"]["rule"] == "gain_kept" and report["gate"]["bound"] == MIN_GAIN_KEPT
    # streamed, and the trained model measured over the bf16 base as stored, computing in fp32
    assert report["merged_by"] == "streamed"
    f = report["fidelity"]
    assert f["gain"] > 0.01  # two steps at lr 1e-3 on the tiny model: measurable
    assert abs(f["gain_kept"] - 1) < 0.05 and f["ppl_exported"] < f["ppl_base"]
    assert "quantization_config" not in json.loads((out / "config.json").read_text())


def test_requantized_nf4_that_erases_a_young_adapter_is_refused(runs, tmp_path):
    """QLoRA merged into the dequantized NF4 weights, then re-quantized to NF4: a 2-step delta is
    smaller than the grid step, so most weights snap back to the very NF4 codes the run started
    from. The export keeps little of the fine-tune and the gate refuses it (written only with
    --force). (Over a bf16 base the same re-quantization keeps ~98%: there is no grid to snap to.)"""
    nf4 = tmp_path / "nf4"
    with pytest.raises(TunekitError, match=r"export refused: merged nf4 .* keeps -?\d+\.\d% of the fine-tune's held-out gain"):
        export(runs["qlora"], "merged", nf4, requantize="nf4", merge_into="dequantized", eval_batches=1)
    assert not nf4.exists() and not leftovers(tmp_path)
    report = export(runs["qlora"], "merged", nf4, requantize="nf4", merge_into="dequantized", eval_batches=1, force=True)
    assert report["forced"] and report["gate"]["bound"] == MIN_GAIN_KEPT_LOSSY
    assert report["fidelity"]["gain_kept"] < MIN_GAIN_KEPT_LOSSY
    q = json.loads((nf4 / "config.json").read_text())["quantization_config"]
    assert q["load_in_4bit"] and q["bnb_4bit_quant_type"] == "nf4" and q["bnb_4bit_use_double_quant"]
    assert (nf4 / "fidelity.json").is_file() and not (nf4 / ".merged-scratch").exists()


def test_merge_into_original_weights(runs, tiny_model_dir, tmp_path):
    """--merge-into original: W_merged == W_original (bf16 on disk, read in fp32) + (alpha/r) B A,
    and the report measures the gain from the base it merged into."""
    out = tmp_path / "orig"
    report = export(runs["qlora"], "merged", out, dtype="fp32", merge_into="original", eval_batches=1)
    assert report["accepted"] and report["merge_into"] == "original"
    assert report["merged_by"] == "in memory"  # checked against the exact fp32 merge, which only it holds
    f = report["fidelity"]
    assert "loss_merge_base" in f and f["loss_merge_base"] != f["loss_base"]  # NF4 base != original base
    merged = load_file(str(out / "model.safetensors"))
    original = load_file(str(tiny_model_dir / "model.safetensors"))
    adapter = load_file(str(runs["qlora"] / "adapter" / "adapter_model.safetensors"))
    cfg = json.loads((runs["qlora"] / "adapter" / "adapter_config.json").read_text())
    name = "model.layers.1.mlp.up_proj"
    a, b = adapter[f"base_model.model.{name}.lora_A.weight"], adapter[f"base_model.model.{name}.lora_B.weight"]
    want = original[f"{name}.weight"].float() + cfg["lora_alpha"] / cfg["r"] * b.float() @ a.float()
    torch.testing.assert_close(merged[f"{name}.weight"], want, rtol=0, atol=1e-6)


def test_auto_dtype_widens_when_the_narrow_one_loses_the_gain(runs, tmp_path, monkeypatch):
    """Without --dtype, bf16 is tried first; when the gate refuses it, fp16, then fp32. The report
    and the printed line say which dtype was kept and why. (The bf16 refusal is simulated: on the
    tiny model bf16 keeps the gain; the real rounding loss is in test_default_model_qlora_merged.)"""
    import tunekit.export.job as job

    written, real_compare, real_write = [], job.compare, job.stream.write_merged

    def write_merged(plan, tokenizer, out_dir, dtype, device):  # the qlora run's merge streams
        written.append({torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype])
        return real_write(plan, tokenizer, out_dir, dtype, device)

    monkeypatch.setattr(job.stream, "write_merged", write_merged)

    def compare(ref, exported, nll_merge_base=None):
        f = real_compare(ref, exported, nll_merge_base)
        if written[-1] == "bf16":
            f["gain_kept"] = 0.5
        return f

    monkeypatch.setattr(job, "compare", compare)
    out = tmp_path / "auto"
    report = export(runs["qlora"], "merged", out, eval_batches=1)
    assert written == ["bf16", "fp16"] and report["dtype"] == "fp16" and report["dtype_asked"] == "auto"
    assert report["merge_into"] == "dequantized"  # the default over a 4-bit base: the model eval scored
    assert [t["accepted"] for t in report["dtype_tried"]] == [False, True]
    assert "fp16: the narrowest of bf16, fp16, fp32" in report["dtype_why"]
    assert json.loads((out / "config.json").read_text())["dtype"] == "float16"
    # an explicit --dtype is obeyed: refused with the reason, nothing written
    with pytest.raises(TunekitError, match=r"merged bf16 .*keeps 50.0%.*A wider --dtype"):
        export(runs["qlora"], "merged", tmp_path / "bf16", dtype="bf16", eval_batches=1)
    assert not (tmp_path / "bf16").exists()


# ---------------------------------------------------------------- gguf
def read_gguf(path: Path):
    """gguf's own reader (the reference parser) over an in-memory copy of the file instead of its
    np.memmap. The reader takes two numpy views per vocabulary entry, and every view of a memmap
    runs Python (memmap.__array_finalize__): one parse of a tiny-model GGUF with SmolLM2's 49k-token
    vocabulary took 5.2-5.4 s over the memmap and 1.6 s over an array on the 2-core AVX2 VM, with
    equal tensors (names, types, bytes) and equal fields. Only numpy.memmap is replaced, and only
    while the reader is built; the copy is as large as the file (a few MB here)."""
    from unittest import mock

    import gguf
    import numpy as np

    data = np.fromfile(path, dtype=np.uint8)
    with mock.patch.object(np, "memmap", lambda _path, mode="r": data):
        return gguf.GGUFReader(path)


@pytest.mark.parametrize("recipe", ["qlora", "lora"])
def test_gguf_export_checked_by_llama_cpp(runs, recipe, tmp_path):
    need_llama_cpp()
    out = tmp_path / "model.gguf"
    # into the dequantized NF4 weights: the GGUF is then the trained model itself, up to f16
    report = export(runs[recipe], "gguf", out, merge_into="dequantized", eval_batches=1)
    assert report["accepted"] and report["checked_by"].startswith("llama.cpp") and report["dtype"] == "f16"
    f = report["fidelity"]
    # llama.cpp's own tokenizer (vocabulary, merges, pre-split read from the GGUF) encodes the held-out texts alike
    assert f["tokenizer_agreement"] == 1.0
    # llama.cpp's logits against the trained model: f16 weights, f16 activations in ggml's matmuls
    # (~3 significant digits) vs bf16 compute: far inside what a wrong tensor layout costs (a
    # mis-permuted rope or a missing tensor moves the random model's KL above 1e-2)
    assert f["kl_mean"] < 1e-4 and f["top1_agreement"] > 0.9 and abs(f["gain_kept"] - 1) < 0.05
    assert json.loads(Path(f"{out}.fidelity.json").read_text())["format"] == "gguf"
    reader = read_gguf(out)
    field = lambda key: reader.fields[key].contents()  # noqa: E731
    assert field("general.architecture") == "llama" and field("llama.block_count") == 2
    assert field("llama.attention.head_count") == 4 and field("llama.attention.head_count_kv") == 2
    # the default model's HF tokenizer (converted from its GGUF by transformers) is plain byte-level
    assert field("tokenizer.ggml.model") == "gpt2" and field("tokenizer.ggml.pre") == "gpt-2"
    assert field("tokenizer.ggml.eos_token_id") == 2 and "im_start" in field("tokenizer.chat_template")
    assert len(field("tokenizer.ggml.merges")) > 40000
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert "output.weight" not in types  # tied to token_embd
    assert types["blk.1.attn_q.weight"] == "F16" and types["blk.1.ffn_norm.weight"] == "F32"
    assert {"token_embd.weight", "output_norm.weight", "blk.0.attn_output.weight", "blk.0.ffn_gate.weight"} <= set(types)
    assert not leftovers(tmp_path)


@pytest.fixture(scope="module")
def wide_run(tiny_data, default_model_dir, tmp_path_factory) -> Path:
    """A 2-layer Llama 256 wide (K-quants work on rows of 256: the 64-wide tiny model would only
    get llama.cpp's fallback types), trained 3 steps with LoRA over its bf16 base."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    need_llama_cpp()  # before training a run that only the llama.cpp tests use
    root = tmp_path_factory.mktemp("wide")
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    return _train("lora", root / "model", tiny_data, root / "run", "trainer.max_steps=3")


@pytest.mark.parametrize("qtype, ggml_type, bits", [("Q8_0", "Q8_0", 8.5), ("Q4_K_M", "Q4_K", 4.5)])
def test_gguf_quantized_by_llama_cpp(wide_run, qtype, ggml_type, bits, tmp_path):
    """llama.cpp's quantizer writes the type asked for; llama.cpp loads it and the report measures it."""
    need_llama_cpp()
    out = tmp_path / f"model-{qtype}.gguf"
    report = export(wide_run, "gguf", out, dtype=qtype, eval_batches=1, force=True)
    assert report["dtype"] == qtype and report["checked_by"].startswith("llama.cpp")
    assert report["gate"]["bound"] == (MIN_GAIN_KEPT_LOSSY if qtype == "Q4_K_M" else MIN_GAIN_KEPT)
    f = report["fidelity"]
    assert f["tokenizer_agreement"] == 1.0 and f["top1_agreement"] > 0.5
    tensors = {t.name: t for t in read_gguf(out).tensors}
    assert tensors["blk.0.attn_q.weight"].tensor_type.name == ggml_type
    assert tensors["blk.0.attn_norm.weight"].tensor_type.name == "F32"
    # stored size of the quantized matrices: bits per weight of the type (Q8_0: 34 bytes per 32;
    # Q4_K: 144 bytes per 256), never the f16 the quantizer read
    t = tensors["blk.0.attn_q.weight"]
    assert abs(8 * t.n_bytes / t.n_elements - bits) < 1e-6
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".f16")] and not leftovers(tmp_path)
    # on a CPU with AMX the check loaded the file with llama.cpp's weight repacking off (its AMX
    # matmul segfaulted on these files there), and the report says so
    from tunekit.device.facts import cpuinfo_text

    assert ("repacking off" in report["checked_by"]) == ("amx_int8" in cpuinfo_text().split())
    # the load takes the setting asked for, whatever the CPU, and leaves the binding's defaults as they were
    import llama_cpp.llama_cpp as C

    from tunekit.infer.llamacpp import LlamaCppModel

    model = LlamaCppModel(out, 16, 1, repack=False)
    try:
        assert model.llm.model_params.use_extra_bufts is False
        ids = torch.tensor([[1, 2, 3, 4]])
        assert torch.isfinite(model.logits({"input_ids": ids, "attention_mask": torch.ones_like(ids)})).all()
    finally:
        model.close()
    assert C.llama_model_default_params().use_extra_bufts is True


def test_gguf_without_llama_cpp_falls_back_to_transformers(runs, tmp_path, monkeypatch, caplog):
    """Where llama.cpp cannot be imported: one line says so, transformers' reader checks f16/f32;
    a quantized type (which needs llama.cpp's quantizer) is one clear error, nothing written."""
    import gguf

    import tunekit.infer.llamacpp as lc

    monkeypatch.setattr(lc, "unavailable", lambda: "llama-cpp-python is not usable here (ImportError: test)")
    parses, real = [], gguf.GGUFReader
    monkeypatch.setattr(gguf, "GGUFReader", lambda path, mode="r": parses.append(path) or real(path, mode))
    out = tmp_path / "model.gguf"
    with caplog.at_level("WARNING", logger="tunekit"):
        report = export(runs["lora"], "gguf", out, eval_batches=1)
    assert report["accepted"] and report["checked_by"].startswith("transformers")
    assert len(parses) == 1  # transformers' loads of the config, weights and tokenizer share one parse
    assert report["fidelity"]["tokenizer_agreement"] == 1.0
    warned = [r.getMessage() for r in caplog.records if "llama" in r.getMessage()]
    assert len(warned) == 1 and "transformers' reader" in warned[0]
    with pytest.raises(TunekitError, match=r"--dtype Q4_K_M needs llama.cpp's quantizer"):
        export(runs["lora"], "gguf", tmp_path / "q.gguf", dtype="q4_k_m", eval_batches=1)
    assert not (tmp_path / "q.gguf").exists()


def test_rotary_interleave_matches_ggml_rope():
    """perm(HF rope(x)) == ggml rope(perm(x)): transformers rotates pairs (i, i + hd/2), ggml's
    llama rope rotates (2i, 2i + 1); interleaving q/k rows maps one onto the other."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from tunekit.export.gguf import interleave_rotary_rows

    heads, hd, pos = 3, 8, 5
    theta = 10000.0 ** (-torch.arange(0, hd, 2).double() / hd) * pos  # (hd/2,)
    x = torch.randn(heads * hd, dtype=torch.float64)
    cos, sin = torch.cat([theta.cos()] * 2), torch.cat([theta.sin()] * 2)  # HF layout (hd,)
    hf, _ = apply_rotary_pos_emb(x.view(1, heads, 1, hd), x.view(1, heads, 1, hd), cos[None, None], sin[None, None])
    g = interleave_rotary_rows(x, heads).view(heads, hd // 2, 2)
    ggml = torch.stack([g[..., 0] * theta.cos() - g[..., 1] * theta.sin(),
                        g[..., 0] * theta.sin() + g[..., 1] * theta.cos()], -1).reshape(-1)
    torch.testing.assert_close(interleave_rotary_rows(hf.reshape(-1), heads), ggml)


# ---------------------------------------------------------------- refusal, interruption, errors
def test_refusal_via_cli_leaves_previous_export_untouched(runs, tmp_path):
    out = tmp_path / "merged"
    export(runs["qlora"], "merged", out, dtype="bf16", eval_batches=1)
    before = tree_digest(out)
    # a bf16 merge rounds the trained weights, so its KL is above 0: a bound of 0 forces a refusal
    r = run_cli(["export", str(runs["qlora"]), "--format", "merged", "--dtype", "bf16", "--out", str(out),
                 "--kl-threshold", "0", "--eval-batches", "1"], tmp_path)
    assert r.returncode != 0
    assert "REFUSED" in r.stdout
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("tunekit: error: export refused: merged bf16") and "--kl-threshold 0" in last, last
    assert tree_digest(out) == before and not leftovers(tmp_path)


@pytest.mark.parametrize("fmt", ["merged", "gguf"])
def test_refusal_writes_nothing_unless_forced(runs, fmt, tmp_path):
    out = tmp_path / ("x.gguf" if fmt == "gguf" else "x")
    dtype = "bf16" if fmt == "merged" else "fp16"
    with pytest.raises(TunekitError, match="export refused"):
        export(runs["lora"], fmt, out, dtype=dtype, kl_threshold=0.0, eval_batches=1)  # any rounding exceeds 0
    assert list(tmp_path.iterdir()) == []
    report = export(runs["lora"], fmt, out, dtype=dtype, kl_threshold=0.0, force=True, eval_batches=1)
    assert not report["accepted"] and report["forced"] and out.exists()


@pytest.mark.parametrize("fmt", ["adapter", "gguf"])
@pytest.mark.parametrize("existing", [False, True])
def test_interrupted_export_leaves_path_absent_or_unchanged(runs, fmt, existing, tmp_path, monkeypatch):
    import tunekit.export.job as job

    out = tmp_path / ("x.gguf" if fmt == "gguf" else "x")
    if existing:
        export(runs["lora"], fmt, out, eval_batches=1)
        before = tree_digest(out)

    def interrupted(*args, **kwargs):  # after the artifact is fully written, before it is checked
        raise KeyboardInterrupt

    monkeypatch.setattr(job, "compare", interrupted)
    with pytest.raises(KeyboardInterrupt):
        export(runs["lora"], fmt, out, eval_batches=1)
    if existing:
        assert tree_digest(out) == before
    else:
        assert not out.exists() and not Path(f"{out}.fidelity.json").exists()
    assert not leftovers(tmp_path)


def test_cannot_merge_method_suggests_adapter(runs, tmp_path):
    """A bottleneck-adapter run (method adapter: can_merge False) cannot export merged or gguf."""
    run = tmp_path / "run"
    (run / "adapter").mkdir(parents=True)
    (run / "adapter" / "adapter_model.safetensors").write_bytes(b"")
    text = (runs["lora"] / "config.yaml").read_text()
    (run / "config.yaml").write_text(text.replace("name: lora", "name: adapter"))
    for fmt in ("merged", "gguf"):
        out = tmp_path / f"out-{fmt}"
        with pytest.raises(TunekitError, match=r"cannot be merged.*--format adapter"):
            export(run, fmt, out)
        assert not out.exists()


@pytest.mark.parametrize("args, message", [
    (["/nonexistent/run", "--format", "merged", "--out", "X"], "RUN_DIR: no such folder"),
    (["{tmp}", "--format", "merged", "--out", "X"], "is not a tunekit run (no config.yaml"),
    (["{run}", "--format", "onnx", "--out", "X"], "invalid choice: 'onnx'"),
    (["{run}", "--format", "merged", "--dtype", "Q4_K_M", "--out", "X"], "--dtype: 'Q4_K_M' is not a dtype of --format merged"),
    (["{run}", "--format", "gguf", "--dtype", "int3", "--out", "X"], "--dtype: 'int3' is not a dtype of --format gguf"),
    (["{run}", "--format", "adapter", "--merge-into", "original", "--out", "X"], "--merge-into applies to --format merged"),
    (["{run}", "--format", "merged", "--merge-into", "nf4", "--out", "X"], "invalid choice: 'nf4'"),
    (["{run}", "--format", "merged", "--min-gain", "90", "--out", "X"], "--min-gain: must be in [0, 1.5], got 90"),
    (["{run}", "--format", "merged", "--kl-threshold", "nan", "--out", "X"], "--kl-threshold: must be >= 0"),
])
def test_cli_errors_are_one_line(runs, args, message, tmp_path):
    args = [a.format(tmp=tmp_path, run=runs["lora"]) for a in args]
    r = run_cli(["export", *args], tmp_path)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tunekit: error: ") and message in lines[0], r.stderr
    assert not (tmp_path / "X").exists()


def test_run_without_adapter_and_foreign_out_path(runs, tmp_path):
    run = tmp_path / "unfinished"
    run.mkdir()
    (run / "config.yaml").write_text((runs["lora"] / "config.yaml").read_text())
    with pytest.raises(TunekitError, match="has no finished adapter"):
        export(run, "adapter", tmp_path / "a")
    foreign = tmp_path / "my-folder"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(TunekitError, match="is not a tunekit export"):
        export(runs["lora"], "adapter", foreign)
    assert (foreign / "notes.txt").read_text() == "keep me"


# ---------------------------------------------------------------- the real default model
@pytest.mark.slow
def test_default_model_qlora_to_gguf(default_model_dir, tmp_path):
    """SmolLM2-135M in NF4 + LoRA (2 steps) -> GGUF through llama.cpp.

    The GGUF export merges into the dequantized NF4 weights first (the merged export's own code), so
    one export covers the real architecture end to end: the rebuilt trained model is the one training
    evaluated, the merge keeps the gain, and llama.cpp loads the real layout (9 heads / 3 kv heads of
    64, tied head). The merged format's dtype choice (bf16 refused for a 2-step delta, widened on its
    own) is tested on the tiny model (test_auto_dtype_widens_when_the_narrow_one_loses_the_gain,
    test_refusal_writes_nothing_unless_forced); here it would be a second merge and two more
    evaluations of the same numbers (about 20 s of a 2-core CPU)."""
    need_llama_cpp()
    run = tmp_path / "run"
    # kernels.fused_lora=off: export rebuilds the trained model with peft's forward (what a consumer
    # of the adapter runs), and the val loss training logged matches it to 1e-3 only if training
    # ran that forward too. Training's default on a bf16 CPU (LoRA matmuls in bf16) lands within
    # bf16's noise instead: measured here 5.7e-3 nats apart, where scaling every lora_B by 1 + 1e-6
    # already moves the loss by 1.7e-3 (each layer rounds its input to bf16; any change flips some).
    # model.dtype=fp32: export checks every candidate against the trained weights computed in fp32, and
    # training's own evaluation then computes the same function (in bf16, a young adapter's updates sit
    # partly below the bf16 residual stream's resolution: 3.7% of perplexity after these 2 steps).
    # trainer.lr=2e-4 (qlora's default before 6e-4): the measurements above are of that delta.
    # trainer.eval_samples=0: no sample answers (nothing here reads them; on the 4-bit peft path each
    # generated token dequantizes every weight: measured on a 2-core AVX2 VM, the run's "done in" went
    # from 26 s to 8 s without them, its wall time from 40 s to 24.5 s, the val losses unchanged).
    r = run_cli(["train", "recipe=qlora", f"output_dir={run}", "trainer.max_steps=2", "trainer.micro_batch_size=2",
                 "trainer.grad_accum=1", "trainer.eval_every=2", "trainer.save_every=2", "data.max_val_examples=4",
                 "data.max_seq_len=128", "kernels.fused_lora=off", "trainer.lr=2e-4", "model.dtype=fp32",
                 "trainer.eval_samples=0"],
                tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    # task_rows=0: the task check is tested on the tiny model; here its greedy answers would double the time
    report = export(run, "gguf", tmp_path / "model.gguf", merge_into="dequantized", eval_batches=2, task_rows=0)
    f = report["fidelity"]
    val_ppl = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if "val_ppl" in line][-1]["val_ppl"]
    assert abs(f["ppl_trained"] / val_ppl - 1) < 1e-3  # the rebuilt model is the model training evaluated
    assert f["ppl_trained"] < f["ppl_base"]
    # f16 where the 2 steps' delta survives an f16 rounding, else f32: bf16 noise decides which (on the
    # Intel VM with AMX: merged fp16 kept 62.9% of the gain, GGUF f16 63.2%)
    assert report["accepted"] and report["checked_by"].startswith("llama.cpp") and report["dtype"] in ("f16", "f32")
    # llama.cpp's logits of the real model against the trained one: within the compute noise an
    # exact fp32 merge shows against the bf16-computing trained model (the gate's KL_FALLBACK);
    # a wrong rope layout or GQA mapping costs tenths of a nat
    assert f["tokenizer_agreement"] == 1.0 and f["kl_mean"] <= KL_FALLBACK


def test_export_scores_the_task_as_tunekit_eval_does(runs, tmp_path):
    """The task section of the report: the run's held-out rows (alpaca answers: exact match),
    scored for base, trained and exported as `tunekit eval` scores them."""
    from tunekit.commands.eval import build_parser, evaluate

    report = export(runs["lora"], "merged", tmp_path / "m", dtype="fp32", eval_batches=1, task_rows=DEFAULT_TASK_ROWS)
    task = report["fidelity"]["task"]
    assert task["metric"] == "exact_match" and task["rows"] > 0 and task["classes"] is None
    scored = evaluate(build_parser().parse_args([str(runs["lora"]), "--base", "--device", "cpu",
                                                 "--dtype", "fp32", "--batch-size", "16"]))
    assert scored["rows"] == task["rows"]
    assert task["trained"] == scored["trained"]["exact_match"] and task["base"] == scored["base"]["exact_match"]
    assert task["exported"] == task["trained"] and task["lost_rows"] == task["won_rows"] == 0  # an fp32 merge
    skipped = export(runs["lora"], "merged", tmp_path / "n", dtype="fp32", eval_batches=1, task_rows=0)
    assert "task" not in skipped["fidelity"] and skipped["fidelity"]["task_skipped"] == "--task-rows 0"


def test_an_export_that_changes_the_answers_is_refused(runs, tmp_path, monkeypatch):
    """Simulated: the base answers no row, the trained model every row, the export none again (on
    the tiny model two steps teach no answer). The loss check passes; the task check refuses."""
    from tunekit.export.task import TaskCheck

    calls = []

    def score(self, model, tokenizer):
        calls.append(model)
        return [len(calls) == 2] * len(self.rows)  # base, trained, then the candidates

    monkeypatch.setattr(TaskCheck, "score", score)
    out = tmp_path / "refused"
    with pytest.raises(TunekitError, match=r"export refused: .*keeps 0.0% of the task gain .*nothing written"):
        export(runs["qlora"], "merged", out, dtype="fp32", eval_batches=1, task_rows=DEFAULT_TASK_ROWS)
    assert not out.exists()
    calls.clear()
    report = export(runs["qlora"], "merged", out, dtype="fp32", eval_batches=1, min_task_gain=0.0,
                    task_rows=DEFAULT_TASK_ROWS)
    assert report["accepted"] and report["fidelity"]["task"]["gain_kept"] == 0.0


def test_long_free_text_replies_are_left_to_the_loss_check(tiny_model_dir, tmp_path):
    """Exact match is a metric for short answers: replies longer than MAX_EXACT_MATCH_TOKENS skip the
    task check with the reason, before any model loads."""
    from transformers import AutoTokenizer

    from tunekit.export.task import MAX_EXACT_MATCH_TOKENS, task_check

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    data = tmp_path / "long.jsonl"
    long = " ".join(["word"] * (2 * MAX_EXACT_MATCH_TOKENS))
    data.write_text("".join(json.dumps({"instruction": f"Say {i}", "input": "", "output": long}) + "\n" for i in range(5)))
    check, why = task_check(None, tok, str(data), 200)
    assert check is None and "free text" in why and "--data FILE with short answers" in why
    data.write_text("".join(json.dumps({"instruction": f"Say {i}", "input": "", "output": str(i)}) + "\n" for i in range(5)))
    check, _ = task_check(None, tok, str(data), 200)
    assert check is not None and check.metric == "exact_match" and len(check.rows) == 5
