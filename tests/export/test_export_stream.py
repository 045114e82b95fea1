"""The streamed merged export (tunekit.export.stream, .shards), the compact fidelity reference
(tunekit.export.fidelity.kl_topk, UpcastHalfWeights) and the export's memory plan (tunekit.export.memory).

The merged weights are checked against an independent reference: the base loaded afresh by
transformers in 4-bit (bitsandbytes' own quantization of each weight as it loads, never run
forward, so no CPU repack), dequantized with bitsandbytes, plus peft's own delta (its scaling,
rsLoRA included) from the adapter folder: no tunekit code computes the reference.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from _helpers import run_cli, tiny_args
from tunekit import TunekitError
from tunekit.export import stream
from tunekit.export.fidelity import UpcastHalfWeights, kl_topk, summarize
from tunekit.runs.load import load_tokenizer_for

GiB = 2**30


@pytest.fixture(scope="module")
def qlora_run(tiny_model_dir, tiny_data, tmp_path_factory) -> Path:
    """Plain QLoRA (B = 0 at the start): the merge paths' own formulas."""
    out = tmp_path_factory.mktemp("stream") / "qlora"
    r = run_cli(["train", "recipe=qlora", *tiny_args(tiny_model_dir, tiny_data, out, "trainer.max_steps=2",
                                                     "method.init=default")], out.parent)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def loftq_run(tiny_model_dir, tiny_data, tmp_path_factory) -> Path:
    """The qlora recipe's own start on a small run (method.init=auto resolves to LoftQ, one alternation)."""
    out = tmp_path_factory.mktemp("stream") / "loftq"
    r = run_cli(["train", "recipe=qlora", *tiny_args(tiny_model_dir, tiny_data, out, "trainer.max_steps=2")], out.parent)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "method.init=auto -> loftq" in r.stderr and (out / "adapter" / "loftq_init.safetensors").is_file()
    return out


def _source(run: Path, **changes):
    from tunekit.runs.open import open_source

    return replace(open_source(run, what="RUN_DIR", runs_only=True), dtype=torch.float32, **changes)


def _copy_run(run: Path, dest: Path, **adapter_config) -> Path:
    """The run's config and adapter folder, with adapter_config.json keys changed."""
    shutil.copytree(run, dest, ignore=shutil.ignore_patterns("checkpoints"))
    cfg_file = dest / "adapter" / "adapter_config.json"
    cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()), **adapter_config}))
    return dest


def _independent_reference(model_dir: Path, adapter_dir: Path, nf4: bool) -> dict[str, tuple]:
    """{weight name: (base weight W, peft's delta s B @ A, |W| + s |B| @ |A|, rank)}, (out, in) fp32,
    for every LoRA layer: W from transformers' own 4-bit load dequantized by bitsandbytes (nf4) or
    from the file; the third is the magnitude the fp32 sum's rounding errors scale with."""
    import bitsandbytes.functional as bnbf
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    kwargs = {"dtype": torch.float32}
    if nf4:
        kwargs.update(device_map={"": "cpu"}, quantization_config=BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.float32, llm_int8_skip_modules=["lm_head"]))
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, **kwargs), adapter_dir)
    out = {}
    for name, layer in model.named_modules():
        if isinstance(layer, LoraLayer):
            w = layer.get_base_layer().weight
            w = bnbf.dequantize_4bit(w.data, w.quant_state).float() if nf4 else w.detach().float()
            a, b = layer.lora_A["default"].weight.float(), layer.lora_B["default"].weight.float()
            size = w.abs() + layer.scaling["default"] * (b.abs() @ a.abs())
            out[name.removeprefix("base_model.model.") + ".weight"] = (
                w, layer.get_delta_weight("default").float(), size, a.shape[0])
    return out


def _check_merged(merged: dict, reference: dict, dtype: torch.dtype) -> None:
    """Each merged weight is W + s B @ A rounded once to `dtype`. Error analysis: the two fp32 sums
    (peft rounds B @ A, its scaled copy, then the sum; the merge adds s B @ A in one addmm) each lie
    within (r + 2) u (|W| + s |B| @ |A|) of the exact value (r products summed, a scaling, an
    addition; u = 2^-24), so they differ by at most twice that. Rounding to bf16 (8 significant bits)
    then adds at most half a bf16 ulp, 2^-8 |W + delta|; to fp32, nothing more."""
    unit = {torch.bfloat16: 2.0**-8, torch.float32: 0.0}[dtype]
    for name, (w, delta, size, r) in reference.items():
        got, want = merged[name], w + delta
        assert got.dtype == dtype, name
        assert delta.abs().max() > 0, name  # the run's steps moved B off zero: the update is there to check
        bound = unit * want.abs() + 2 * (r + 2) * 2.0**-24 * size
        assert ((got.float() - want).abs() <= bound).all(), (name, (got.float() - want).abs().max())


# ---------------------------------------------------------------- the merged weights
@pytest.mark.parametrize("run_name,dtype", [("qlora_run", torch.bfloat16), ("qlora_run", torch.float32),
                                            ("loftq_run", torch.bfloat16)])
def test_streamed_nf4_merge_equals_fresh_4bit_load_plus_peft_delta(run_name, tiny_model_dir, tmp_path, dtype, request):
    """A LoftQ start of one alternation trained over the loader's own 4-bit base, quant(W): its merge
    into the dequantized weights streams as a plain run's does, and peft's fresh load is its reference."""
    qlora_run = request.getfixturevalue(run_name)
    src = _source(qlora_run)
    plan, why = stream.plan_stream(src, "dequantized")
    assert plan is not None, why
    stream.write_merged(plan, load_tokenizer_for(src), tmp_path, dtype, torch.device("cpu"))
    merged = load_file(str(tmp_path / "model.safetensors"))
    reference = _independent_reference(tiny_model_dir, qlora_run / "adapter", nf4=True)
    assert set(reference) == set(plan.updates) and len(reference) == 14  # 7 projections x 2 layers
    _check_merged(merged, reference, dtype)
    # what is not a LoRA target keeps its stored bf16 values (exact in either dtype); the tied head is not written
    base = load_file(str(tiny_model_dir / "model.safetensors"))
    assert "lm_head.weight" not in merged and set(merged) == set(base) - {"lm_head.weight"}
    for name in ("model.embed_tokens.weight", "model.norm.weight", "model.layers.1.post_attention_layernorm.weight"):
        assert torch.equal(merged[name], base[name].to(dtype)), name
    config = json.loads((tmp_path / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == str(dtype).removeprefix("torch.")


def test_streamed_merge_over_the_original_weights_and_rslora_scale(qlora_run, tiny_model_dir, tmp_path):
    """The same adapter streamed as if trained over the bf16 base (W read as stored, no NF4), with
    adapter_config.json saying rsLoRA: the scale is alpha / sqrt(r), as peft computes it."""
    run = _copy_run(qlora_run, tmp_path / "run", use_rslora=True)
    src = _source(run, quantize="none")
    plan, why = stream.plan_stream(src, "original")
    assert plan is not None and not plan.nf4 and plan.scale == 32 / 16**0.5, why
    out = tmp_path / "merged"
    out.mkdir()
    stream.write_merged(plan, load_tokenizer_for(src), out, torch.bfloat16, torch.device("cpu"))
    _check_merged(load_file(str(out / "model.safetensors")), _independent_reference(tiny_model_dir, run / "adapter", nf4=False),
                  torch.bfloat16)


def test_nf4_weights_are_what_a_4bit_load_quantizes(tiny_model_dir):
    from tunekit.model import load_base_model
    from tunekit.model.folder import model_skeleton
    from tunekit.model.layers import is_4bit

    model = load_base_model(str(tiny_model_dir), "nf4", torch.float32, torch.device("cpu"))
    assert stream.nf4_weights(model_skeleton(str(tiny_model_dir))) == {
        f"{n}.weight" for n, m in model.named_modules() if is_4bit(m)}


def test_sharded_output_loads_as_one_model(qlora_run, tmp_path):
    """Above the shard size: model-0000i-of-0000N.safetensors + the index, as transformers writes them;
    each shard is a valid safetensors file (safetensors' own reader checks the byte ranges)."""
    from transformers import AutoModelForCausalLM

    src = _source(qlora_run)
    plan, _ = stream.plan_stream(src, "dequantized")
    one, many = tmp_path / "one", tmp_path / "many"
    for folder, size in ((one, stream.MAX_SHARD_BYTES), (many, 2_000_000)):  # the embedding alone is 6.3 MB
        folder.mkdir()
        stream.write_merged(plan, load_tokenizer_for(src), folder, torch.bfloat16, torch.device("cpu"), size)
    index = json.loads((many / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    shards = {}
    for f in files:
        shards.update(load_file(str(many / f)))
    single = load_file(str(one / "model.safetensors"))
    assert shards.keys() == single.keys() and all(torch.equal(shards[k], single[k]) for k in single)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in single.values())
    model = AutoModelForCausalLM.from_pretrained(many, dtype="auto")
    assert model.dtype == torch.bfloat16 and torch.equal(model.model.layers[0].mlp.up_proj.weight,
                                                         single["model.layers.0.mlp.up_proj.weight"])
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # still tied


def test_pissa_run_streams_its_saved_rank_2r_lora(tiny_model_dir, tiny_data, tmp_path):
    """PiSSA over the bf16 base: training computes over W - s B0 A0, and the folder holds the rank-2r
    LoRA [B, -B0] [A; A0] over W with peft's rescaled alpha (the training-time start B0 A0, exactly).
    The streamed merge adds that to W: what peft computes for the folder over the original base, and
    the export passes its check."""
    from tunekit.commands.export import export

    run = tmp_path / "pissa"
    r = run_cli(["train", "recipe=lora", *tiny_args(tiny_model_dir, tiny_data, run, "trainer.max_steps=2",
                                                    "method.init=pissa", "method.r=4")], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((run / "adapter" / "adapter_config.json").read_text())["r"] == 8  # converted: rank 2r
    out = tmp_path / "merged"
    report = export(run, "merged", out, dtype="fp32", eval_batches=1, task_rows=0)
    assert report["merged_by"] == "streamed" and report["accepted"]
    _check_merged(load_file(str(out / "model.safetensors")),
                  _independent_reference(tiny_model_dir, run / "adapter", nf4=False), torch.float32)


@pytest.mark.parametrize("change, reason", [
    ({"use_dora": True}, "the adapter uses DoRA"),
    ({"modules_to_save": ["lm_head"]}, "the adapter uses modules_to_save"),
    ({"rank_pattern": {"q_proj": 4}}, "per-module ranks"),
])
def test_what_does_not_stream_falls_back_with_the_reason(qlora_run, tmp_path, change, reason):
    run = _copy_run(qlora_run, tmp_path / "run", **change)
    plan, why = stream.plan_stream(_source(run), "dequantized")
    assert plan is None and reason in why


def test_other_fallbacks_and_a_foreign_adapter(qlora_run, tmp_path):
    from safetensors.torch import save_file

    src = _source(qlora_run)
    assert stream.plan_stream(src, "original")[1].startswith("--merge-into original over a 4-bit base")
    assert "method ia3" in stream.plan_stream(replace(src, method="ia3"), None)[1]
    loftq = _copy_run(qlora_run, tmp_path / "loftq")
    (loftq / "adapter" / "loftq_init.safetensors").write_bytes(b"")
    assert "LoftQ start" in stream.plan_stream(_source(loftq), "dequantized")[1]
    # an adapter of a module the base does not have: one line naming the file
    foreign = _copy_run(qlora_run, tmp_path / "foreign")
    file = foreign / "adapter" / "adapter_model.safetensors"
    tensors = {k.replace("layers.1.", "layers.7."): v for k, v in load_file(str(file)).items()}
    save_file(tensors, str(file))
    with pytest.raises(TunekitError, match=r"adapter_model.safetensors: adapts model.layers.7.* not trained on this base"):
        stream.plan_stream(_source(foreign), "dequantized")
    (foreign / "adapter" / "adapter_config.json").write_text("{not json")
    with pytest.raises(TunekitError, match=r"RUN_DIR: .*adapter_config.json is not valid JSON"):
        stream.plan_stream(_source(foreign), "dequantized")


# ---------------------------------------------------------------- the compact reference
def _exact_kl(zp: torch.Tensor, zq: torch.Tensor) -> torch.Tensor:
    lp, lq = F.log_softmax(zp, -1), F.log_softmax(zq, -1)
    return (lp.exp() * (lp - lq)).sum(-1)


@pytest.mark.parametrize("spread", [0.02, 3.0])  # a near-uniform distribution (a random model) and a peaked one
def test_topk_kl_estimate_against_the_exact_kl(spread):
    """Noise spread evenly over the vocabulary, as rounding weights spreads it (kl_topk's assumption):
    KL ~ Var_p(d) / 2, and the estimate replaces the tail's variance by the top-k tokens'. Its error
    then is the difference of two weighted sample variances of iid noise: their expectations differ
    by the weights' concentration (E[weighted variance] = (1 - sum w^2) sigma^2, sum w^2 < 0.05 for
    64 tokens of either distribution here) and each mean over 256 positions has a relative standard
    error of about sqrt(2 / (64 * 256)) ~ 1.1%. 10% covers both with room; the lower bound (top-k +
    one tail bucket) holds exactly."""
    torch.manual_seed(0)
    zp = spread * torch.randn(256, 8192)
    ids, vals, lse = summarize(zp)
    for sigma in (0.01, 0.1):
        zq = zp + sigma * torch.randn_like(zp)
        est, tail = kl_topk(ids, vals, lse, zq)
        exact = _exact_kl(zp, zq)
        assert abs(est.mean() / exact.mean() - 1) < 0.10, (spread, sigma, est.mean(), exact.mean())
        assert (tail > 0).all() and (tail < 1).all()
    assert torch.equal(kl_topk(ids, vals, lse, zp.clone())[0], torch.zeros(256))  # identical logits: exactly 0


def test_topk_kl_reads_high_when_only_the_top_tokens_move():
    """An export that loses what the fine-tune raised moves the top tokens: the estimate reads at least
    the exact KL there (the side on which a gate may refuse), and it never reads below the lower bound."""
    torch.manual_seed(0)
    zp = 3.0 * torch.randn(128, 8192)
    ids, vals, lse = summarize(zp)
    zq = zp.clone()
    zq.scatter_add_(1, ids[:, :8], torch.full((128, 8), -0.5))
    est, _ = kl_topk(ids, vals, lse, zq)
    assert est.mean() >= _exact_kl(zp, zq).mean()


def test_upcast_half_weights_computes_the_fp32_function(tiny_model_dir):
    """A bf16-stored model under UpcastHalfWeights against the same weights loaded in fp32: every
    weight is exact in fp32, so the two differ only in the order of fp32 sums. Per matmul that is
    at most K u sum|x w| (K <= 128 here, u = 2^-24: < 1e-5 of the magnitudes); over 2 blocks and
    the head, logits of magnitude < 1 stay within 1e-4."""
    from tunekit.model import load_base_model

    ids = torch.randint(0, 49000, (2, 24), generator=torch.Generator().manual_seed(0))
    fp32 = load_base_model(str(tiny_model_dir), "none", torch.float32, torch.device("cpu")).eval()
    bf16 = load_base_model(str(tiny_model_dir), "none", torch.bfloat16, torch.device("cpu")).eval()
    with torch.no_grad():
        want = fp32(input_ids=ids).logits
        with UpcastHalfWeights():
            got = bf16(input_ids=ids).logits
    assert got.dtype == torch.float32 and (got - want).abs().max() < 1e-4


# ---------------------------------------------------------------- the memory plan
LLAMA_3_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
              "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False,
              "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "torch_dtype": "bfloat16"}


def test_llama3_8b_qlora_merged_export_fits_a_24gib_gpu(tmp_path):
    """Llama-3-8B's config.json alone, QLoRA r=16 on every projection, the default check (4 held-out
    batches of trainer.micro_batch_size 8 x data.max_seq_len 512), an assumed 24 GiB GPU: the streamed
    export fits, its peak is the candidate's phase (one bf16 copy); the in-memory merge did not."""
    from tunekit.export.memory import in_memory_terms, peak, streamed_phases
    from tunekit.plan.inference import Workload, check_fits, with_margin
    from tunekit.plan.shape import PROJECTIONS, model_shape
    from tunekit.device.facts import planning_facts

    (tmp_path / "config.json").write_text(json.dumps(LLAMA_3_8B))
    shape = model_shape(str(tmp_path), None)
    assert shape.total_params == 8_030_261_248  # Llama-3-8B's published count
    facts = planning_facts("cuda", 24 * GiB, cuda_available=False)
    work = Workload(kv_tokens=0, forward_tokens=8 * 512, logit_rows=8 * 512)
    positions = 4 * 8 * 512
    adapter = 2 * 4 * 16 * shape.num_layers * sum(i + o for p in PROJECTIONS for i, o in [shape.projection(p)])
    phase, terms = peak(streamed_phases(shape, "nf4", adapter, "bf16", work, positions, held=4, stored=2))
    assert phase == "compare" and terms["candidate (bf16)"] == 2 * shape.total_params
    line = check_fits(terms, facts, facts.total_memory, "tunekit export")
    need = sum(with_margin(terms, facts).values())
    assert f"{need / GiB:.2f} GiB of 24.00 GiB free" in line and need < 23 * GiB
    with pytest.raises(TunekitError, match=r"needs about 63.05 GiB .*merged model \(fp32\) 29.92 GiB"):
        check_fits(in_memory_terms(shape, "nf4", adapter, "merged", "dequantized", 2, work, positions),
                   facts, facts.total_memory, "tunekit export")


def test_llama3_8b_qlora_gguf_adapter_export_fits_24gib(tmp_path, monkeypatch):
    """The same run exported --format gguf-adapter (an f32 adapter GGUF, checked by llama.cpp over an
    f16 GGUF of the dequantized NF4 base): on a 24 GiB GPU its phases there (the reference, the base's
    tensors rounded one at a time) fit it, and the phases on the CPU (the adapter's read, llama.cpp's
    check, which holds the one 16-bit copy of the model) fit 24 GiB of host memory. Before, the base
    GGUF was f32 and written from the whole base dequantized in memory, kept until llama.cpp (which
    reads the file whole) had loaded it: two fp32 copies, 59.83 GiB, on the host alone."""
    from tunekit.export.memory import HOST_PHASES, gguf_adapter_phases, peak
    from tunekit.plan.inference import Workload, check_fits, with_margin
    from tunekit.plan.shape import PROJECTIONS, model_shape
    from tunekit.device.facts import DeviceFacts, planning_facts

    (tmp_path / "config.json").write_text(json.dumps(LLAMA_3_8B))
    shape = model_shape(str(tmp_path), None)
    gpu, host = planning_facts("cuda", 24 * GiB, cuda_available=False), DeviceFacts("cpu", total_memory=24 * GiB)
    work = Workload(kv_tokens=0, forward_tokens=8 * 512, logit_rows=8 * 512)
    lora = 16 * shape.num_layers * sum(i + o for p in PROJECTIONS for i, o in [shape.projection(p)])
    phases = gguf_adapter_phases(shape, "nf4", 2 * 4 * lora, lora, 4, work, 4 * 8 * 512, n_ctx=512, held=4, stored=2)
    on_gpu, terms = peak({k: v for k, v in phases.items() if k not in HOST_PHASES})
    assert on_gpu == "reference" and sum(with_margin(terms, gpu).values()) < 23 * GiB
    check_fits(terms, gpu, gpu.total_memory, "tunekit export")
    on_host, terms = peak({k: v for k, v in phases.items() if k in HOST_PHASES})
    assert on_host == "check: llama.cpp"
    # one 16-bit copy: matrices in f16, the 65 norm vectors (4096 each) in f32
    assert terms["base GGUF (f16)"] == 2 * shape.total_params + 2 * 65 * 4096
    need = sum(with_margin(terms, host).values())
    assert need < 21 * GiB and f"{need / GiB:.2f} GiB of 24.00 GiB free" in check_fits(terms, host, 24 * GiB, "x")
    assert 2 * 4 * shape.total_params / GiB == pytest.approx(59.83, abs=0.01)  # the old f32 path's two copies
    # the export's check on that GPU: its phases there against it, llama.cpp's against the host's memory
    from tunekit.export import memory

    monkeypatch.setattr("tunekit.device.facts.available_memory_bytes", lambda device: 24 * GiB)
    line = memory._check_gguf_adapter(phases, gpu, 24 * GiB)
    assert "GiB of 24.00 GiB free on cuda:0" in line and "its reference phase" in line
    assert "GiB of 24.00 GiB free on cpu" in line and "its check: llama.cpp phase" in line
    monkeypatch.setattr("tunekit.device.facts.available_memory_bytes", lambda device: 16 * GiB)
    with pytest.raises(TunekitError, match=r"needs about 19.95 GiB on cpu \(base GGUF \(f16\) 14.96 GiB, .* but 16.00 "
                                           r"GiB is free: --eval-batches 1 .* \(gguf-adapter: its check: llama.cpp phase\)"):
        memory._check_gguf_adapter(phases, gpu, 24 * GiB)


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_streamed_gguf_holds_the_streamed_merge(qlora_run, tmp_path, dtype):
    """--format gguf of a LoRA run merges tensor by tensor as the file is written: every tensor of
    the GGUF is the streamed merge's (checked above against an independent reference), under its
    llama.cpp name, with q and k rows in llama.cpp's rotary order; the tied head is not written."""
    import gguf

    from tunekit.export.gguf import gguf_tensor_name, interleave_rotary_rows

    src = _source(qlora_run)
    plan, why = stream.plan_stream(src, "dequantized")
    assert plan is not None, why
    tok = load_tokenizer_for(src)
    torch_dtype = {"fp32": torch.float32, "fp16": torch.float16}[dtype]
    (tmp_path / "hf").mkdir()
    stream.write_merged(plan, tok, tmp_path / "hf", torch_dtype, torch.device("cpu"))
    stream.write_merged_gguf(plan, tok, tmp_path / "x.gguf", dtype, torch.device("cpu"), "test")
    merged = load_file(str(tmp_path / "hf" / "model.safetensors"))
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    tensors = {t.name: t for t in gguf.GGUFReader(str(tmp_path / "x.gguf")).tensors}
    assert "output.weight" not in tensors and len(tensors) == len(merged)
    for name, want in merged.items():
        t = tensors[gguf_tensor_name(name)]
        if ".q_proj." in name:
            want = interleave_rotary_rows(want, cfg["num_attention_heads"])
        elif ".k_proj." in name:
            want = interleave_rotary_rows(want, cfg["num_key_value_heads"])
        got = torch.from_numpy(t.data.copy()).reshape(want.shape)
        # the same rounded values: 1-D tensors are stored as f32, from the same fp16/fp32 numbers
        assert torch.equal(got.to(want.dtype), want) if want.dim() > 1 else torch.equal(got, want.float()), name


def test_gguf_export_reports_the_streamed_merge(qlora_run, tmp_path):
    from tunekit.commands.export import export

    report = export(qlora_run, "gguf", tmp_path / "x.gguf", dtype="fp16", eval_batches=1, task_rows=0)
    assert report["accepted"] and report["merged_by"] == "streamed"
