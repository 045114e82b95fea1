"""LoftQ start for QLoRA (tunekit.methods.lora.loftq, loftq_io): quantization bit-for-bit as bitsandbytes and
the loader, the alternation against its equations and peft's SVD split, the per-layer keep rule,
reading one tensor from single and sharded folders, one full-precision layer alive at a time, the
start file, and the merges (dequantized target exact; original needs the start subtracted)."""

from __future__ import annotations

import json
import weakref
from types import SimpleNamespace

import pytest
import torch

from tunekit import TunekitError
from tunekit.methods.lora import loftq
from tunekit.methods.lora.loftq import (LayerInit, LoftqResult, QuantSettings, apply_loftq, keeps_loftq, lora_scaling, lora_targets,
                                   loftq_layer, low_rank_fit, nf4_roundtrip, read_original_weight, same_codes,
                                   tensor_key)
from tunekit.methods.lora.loftq_io import (load_loftq_init, merge_target_base, original_target_base, rebuild_loftq_base,
                                      save_loftq_init)

R, ALPHA = 16, 32
U32 = 2.0 ** -24  # fp32 unit roundoff (24 significant bits)
U16 = 2.0 ** -8  # bf16 unit roundoff (8 significant bits)


def _dequant(p) -> torch.Tensor:
    import bitsandbytes.functional as bnbf

    return bnbf.dequantize_4bit(p.data, p.quant_state).float()


def _lora_model(model_dir):
    """A fresh QLoRA model as tunekit builds it: 4-bit bf16 base (the loader), LoRA on all linears."""
    from tunekit.methods import get_method
    from tunekit.model import load_base_model

    base = load_base_model(str(model_dir), "nf4", torch.bfloat16, torch.device("cpu"))
    cfg = SimpleNamespace(r=R, alpha=ALPHA, dropout=0.0, target_modules=["all-linear"])
    return get_method("lora").apply(base, cfg).eval()


@pytest.fixture(scope="module")
def started(tiny_model_dir):
    """The tiny model's LoRA started by LoftQ with 2 iterations (the base is requantized too),
    recording which full-precision tensors of earlier layers were still alive at each read."""
    model = _lora_model(tiny_model_dir)
    alive, leaked, reads = [], [], []
    real_read, real_roundtrip = loftq.read_original_weight, loftq.nf4_roundtrip

    def reading(model_dir, key):
        leaked.append(sum(ref() is not None for ref in alive))  # earlier layers' W, fp32 W, W - sBA
        reads.append(key)
        t = real_read(model_dir, key)
        alive.append(weakref.ref(t))
        return t

    def roundtrip(w, settings=QuantSettings()):
        alive.append(weakref.ref(w))
        return real_roundtrip(w, settings)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loftq, "read_original_weight", reading)
        mp.setattr(loftq, "nf4_roundtrip", roundtrip)
        report = apply_loftq(model, tiny_model_dir, r=R, scaling=lora_scaling(model), iters=2)
    after = sum(ref() is not None for ref in alive)
    return SimpleNamespace(model=model, report=report, leaked=leaked, reads=reads, left_after=after)


@pytest.mark.parametrize("dtype,storage", [(torch.bfloat16, torch.uint8), (torch.float32, torch.bfloat16)])
def test_roundtrip_is_what_linear4bit_builds(dtype, storage):
    """Packed codes, quant_state and dequantized values equal a bnb Linear4bit quantizing the same W
    on .to("cpu"), built as transformers builds it (uint8 codes; bf16 storage as FSDP loads)."""
    import bitsandbytes as bnb

    torch.manual_seed(0)
    w = torch.randn(96, 192) * 0.02
    lin = bnb.nn.Linear4bit(192, 96, bias=False, compute_dtype=dtype, compress_statistics=True, quant_type="nf4",
                            quant_storage=storage)
    lin.weight = bnb.nn.Params4bit(w.to(dtype), requires_grad=False, **lin.weight.__dict__).to("cpu")
    packed, deq = nf4_roundtrip(w, QuantSettings(dtype=dtype, quant_storage=storage))
    assert same_codes(packed, lin.weight) and packed.data.dtype == storage
    assert deq.dtype == dtype and torch.equal(deq, bnb.functional.dequantize_4bit(lin.weight.data, lin.weight.quant_state))


def test_roundtrip_is_what_the_loader_builds(tiny_model_dir):
    """Every 4-bit layer of a model loaded by tunekit's loader: the settings read off the layer equal
    those derived from the loader's BitsAndBytesConfig, and requantizing the weight on disk gives its
    codes bit for bit."""
    targets = lora_targets(_lora_model(tiny_model_dir))
    assert len(targets) == 2 * 7
    for name, t in targets.items():
        settings = QuantSettings.of_layer(t.base)
        assert settings == QuantSettings.from_loader(torch.bfloat16)
        assert same_codes(nf4_roundtrip(read_original_weight(tiny_model_dir, tensor_key(name)), settings)[0], t.base.weight)


def test_svd_split_matches_peft():
    """B, A are peft's L, R (U sqrt(S), sqrt(S) V^T): peft's U @ diag(sqrt S)[:, :r] adds exact zeros
    to the same products, so the two agree to the last bits (rtol: a few fp32 ulps for FMA)."""
    from peft.utils.loftq_utils import _low_rank_decomposition

    torch.manual_seed(1)
    res = torch.randn(80, 48)
    B, A = low_rank_fit(res, 8)
    ref = _low_rank_decomposition(res, reduced_rank=8)
    assert torch.allclose(B, ref["L"], rtol=1e-6, atol=1e-7) and torch.allclose(A, ref["R"], rtol=1e-6, atol=1e-7)


def test_iterations_follow_the_equations():
    """T = 2 from T = 1 by the paper's recurrence, recomputed independently: Q_2 = quant(W - s B_1 A_1),
    (B_2, A_2) = rank-r fit of (W - dequant Q_2) / s; the errors are the stated norms."""
    torch.manual_seed(2)
    w, s = torch.randn(64, 128) * 0.02, 2.0
    one, two = loftq_layer(w, 8, s, 1), loftq_layer(w, 8, s, 2)
    assert one.packed is one.plain and one.base_A is None
    assert torch.equal(two.base_A, one.A) and torch.equal(two.base_B, one.B)
    q2, _ = nf4_roundtrip(w.double() - s * (one.B.double() @ one.A.double()))
    assert same_codes(two.packed, q2)
    B, A = low_rank_fit((w - _dequant(q2)) / s, 8)
    assert torch.equal(B, two.B) and torch.equal(A, two.A)
    assert two.err_plain == pytest.approx(torch.linalg.vector_norm(w - _dequant(one.plain)).item(), rel=1e-5)
    assert two.err_loftq == pytest.approx(torch.linalg.vector_norm(w - _dequant(q2) - s * B @ A).item(), rel=1e-5)
    # the merge targets rebuild each base from W: quant(W) for T = 1 (and a plain start), Q_2 for T = 2
    settings = QuantSettings()
    assert torch.equal(merge_target_base(w, LayerInit(one.A, one.B), s, settings), _dequant(one.packed))
    assert torch.equal(merge_target_base(w, None, s, settings), _dequant(one.plain))
    assert torch.equal(merge_target_base(w, LayerInit(two.A, two.B, two.base_A, two.base_B), s, settings), _dequant(q2))


def test_loftq_beats_plain_on_a_real_shaped_weight():
    """576 x 1536 (the default model's MLP), r = 16. For T = 1 the start fits the quantization residual
    R best at rank r, and the top r of min(m, n) singular values hold at least r / min(m, n) of
    ||R||^2, so err_loftq <= err_plain sqrt(1 - r / 576) (slack 1e-5: fp32 norms of 0.9M terms)."""
    torch.manual_seed(3)
    w = torch.randn(576, 1536) * 0.02
    res = loftq_layer(w, 16, ALPHA / R, 1)
    assert res.A.shape == (16, 1536) and res.B.shape == (576, 16)
    assert res.err_loftq < res.err_plain * (1 - 16 / 576) ** 0.5 * (1 + 1e-5)
    assert keeps_loftq(res)


def test_keep_rule():
    torch.manual_seed(4)
    w = torch.randn(32, 64)
    plain = loftq_layer(w, 4, 2.0, 0)
    assert plain.A is None and plain.err_loftq == plain.err_plain and not keeps_loftq(plain)
    # a weight already on the NF4 grid (without double quantization the block absmax is recovered
    # exactly, code 1.0 being in the table) quantizes to itself: nothing left to fit, no gain
    exact = QuantSettings(double_quant=False, dtype=torch.float32)
    on_grid = nf4_roundtrip(w, exact)[1]
    same = loftq_layer(on_grid, 4, 2.0, 1, exact)
    assert same.err_plain == 0 and same.err_loftq == 0 and not keeps_loftq(same)
    worse = LoftqResult(same.A, same.B, same.packed, same.plain, err_plain=1.0, err_loftq=1.0, iters=3)
    assert not keeps_loftq(worse)
    assert keeps_loftq(LoftqResult(same.A, same.B, same.packed, same.plain, err_plain=1.0, err_loftq=0.9, iters=3))


def test_bad_arguments_name_the_culprit():
    w = torch.zeros(8, 16)
    with pytest.raises(TunekitError, match=r"rank r=9 must be an integer in 1..8"):
        loftq_layer(w, 9, 2.0, 1)
    with pytest.raises(TunekitError, match=r"iters must be an integer >= 0, got -1"):
        loftq_layer(w, 4, 2.0, -1)
    with pytest.raises(TunekitError, match=r"2-D"):
        loftq_layer(torch.zeros(8), 4, 2.0, 1)


def test_read_one_tensor_single_and_sharded(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    everything = load_file(str(tiny_model_dir / "model.safetensors"))
    key = tensor_key("base_model.model.model.layers.1.mlp.down_proj")
    assert key == "model.layers.1.mlp.down_proj.weight"
    got = read_original_weight(tiny_model_dir, key)
    assert got.dtype == torch.bfloat16 and torch.equal(got, everything[key])

    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).save_pretrained(sharded, max_shard_size="64KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 2
    for k in everything:
        assert torch.equal(read_original_weight(sharded, k), everything[k]), k

    bare = tmp_path / "bare"  # saved from the decoder alone: no "model." prefix
    bare.mkdir()
    save_file({"layers.0.mlp.up_proj.weight": everything["model.layers.0.mlp.up_proj.weight"]}, str(bare / "model.safetensors"))
    assert torch.equal(read_original_weight(bare, "model.layers.0.mlp.up_proj.weight"),
                       everything["model.layers.0.mlp.up_proj.weight"])

    for folder in (tiny_model_dir, sharded):
        with pytest.raises(TunekitError, match=rf"no tensor 'model.layers.7.mlp.up_proj.weight' in the safetensors files of {folder}"):
            read_original_weight(folder, "model.layers.7.mlp.up_proj.weight")
    with pytest.raises(TunekitError, match=r"holds no model.safetensors"):
        read_original_weight(tmp_path, key)


def test_apply_holds_one_layer_at_a_time_and_starts_closer(started, tiny_model_dir):
    """Every target read once; when each read began, no full-precision tensor of an earlier layer
    (as read, in fp32, or shifted) was alive; none after. The model holds what the report says."""
    targets = lora_targets(started.model)
    assert started.reads == [tensor_key(n) for n in targets]
    assert started.leaked == [0] * len(targets) and started.left_after == 0
    report = started.report
    assert report.kept == len(report.layers) == len(targets) == len(report.init.layers)
    for lay in report.layers:  # recomputed from what the layers now hold
        t = targets[lay.name]
        w = read_original_weight(tiny_model_dir, tensor_key(lay.name)).float()
        A, B = t.lora_A.weight, t.lora_B.weight
        err = torch.linalg.vector_norm(w - _dequant(t.base.weight) - (ALPHA / R) * B @ A).item()
        assert err == pytest.approx(lay.err_loftq, rel=1e-5) and lay.err_loftq < lay.err_plain
        # iters=2 requantized the base, in place: the module's quant_state is still the weight's
        assert not same_codes(nf4_roundtrip(w, QuantSettings.of_layer(t.base))[0], t.base.weight)
        assert t.base.quant_state is t.base.weight.quant_state
        assert torch.equal(report.init.layers[lay.name].A, A) and torch.equal(report.init.layers[lay.name].B, B)


def _train_a_little(model, seed: int) -> None:
    """Simulated training: move every A and B away from its start."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in lora_targets(model).values():
            for p in (t.lora_A.weight, t.lora_B.weight):
                p.add_(0.5 * p.abs().mean() * torch.randn(p.shape, generator=g))


def test_merges_after_a_loftq_start(started, tiny_model_dir):
    """Dequantized target: merge_target_base(W) is the in-memory dequantized base to the bit, and the
    merged layer reproduces the 4-bit layer's forward. Original target: W + s B A double counts the
    start; original_target_base(W) + s B A is W + s (B A - B_0 A_0)."""
    import copy

    model = copy.deepcopy(started.model)
    _train_a_little(model, seed=5)
    s = ALPHA / R
    init = started.report.init
    torch.manual_seed(6)
    for name, t in lora_targets(model).items():
        w = read_original_weight(tiny_model_dir, tensor_key(name)).float()
        A, B = t.lora_A.weight.detach(), t.lora_B.weight.detach()
        assert not torch.equal(B, init.layers[name].B)  # trained away from the start
        base = merge_target_base(w, init.layers[name], s, QuantSettings.of_layer(t.base))
        assert torch.equal(base, _dequant(t.base.weight))
        merged = base + s * B @ A

        # The 4-bit layer: x (bf16-exact, so the cast to the bf16 compute dtype is exact) @ dequant^T
        # accumulated in fp32 over K = in terms and rounded once to bf16 (<= 2^-8 |y_base|), plus the
        # LoRA path in fp32 (K + r terms) and the fp32 merged weight's own rounding (2^-24 per element).
        # Each accumulation bounded by 2 n u (|x| @ |M|^T), with 2x margin on that constant.
        x = torch.randn(5, A.shape[1]).to(torch.bfloat16).float()
        with torch.no_grad():
            y = model.get_submodule(loftq.PEFT_PREFIX + name)(x).double()
        xd, absx, K = x.double(), x.double().abs(), A.shape[1]
        y_base = xd @ base.double().T
        tol = (U16 * y_base.abs() + 4 * U32 * K * absx @ base.double().abs().T
               + 4 * U32 * (K + R) * s * (absx @ A.double().abs().T) @ B.double().abs().T
               + 4 * U32 * K * absx @ merged.double().abs().T)
        assert ((y - xd @ merged.double().T).abs() <= tol).all(), name

        # into the original W: without the start subtracted the merge differs from the trained layer
        # by W - dequant(Q) (what s B_0 A_0 stands for: closer to it than to 0), far above rounding
        s_start = s * init.layers[name].B @ init.layers[name].A
        wrong = w + s * B @ A
        gap = torch.linalg.vector_norm(xd @ wrong.double().T - y).item()
        assert gap > 10 * torch.linalg.vector_norm(tol).item(), name
        assert torch.linalg.vector_norm(w - base - s_start) < torch.linalg.vector_norm(w - base)
        right = original_target_base(w, init.layers[name], s) + s * B @ A
        assert torch.allclose(right, w + s * (B @ A - init.layers[name].B @ init.layers[name].A), rtol=0, atol=1e-6)
        assert torch.equal(original_target_base(w, None, s), w)


def test_start_file_rebuilds_the_base(started, tiny_model_dir, tmp_path):
    """loftq_init.safetensors round-trips; on a freshly loaded model it rebuilds every requantized
    base to the codes the run trained over (once: a second rebuild changes nothing), and refuses a
    layer that holds another weight's codes."""
    init = started.report.init
    assert load_loftq_init(tmp_path) is None
    path = save_loftq_init(tmp_path, init)
    back = load_loftq_init(tmp_path)
    assert (back.iters, back.r, back.scaling, back.settings) == (init.iters, init.r, init.scaling, init.settings)
    assert back.layers.keys() == init.layers.keys()
    for name, lay in init.layers.items():
        for part in ("A", "B", "base_A", "base_B"):
            assert torch.equal(getattr(back.layers[name], part), getattr(lay, part))

    fresh = lora_targets(_lora_model(tiny_model_dir))
    assert rebuild_loftq_base(tiny_model_dir, fresh, back) == len(init.layers)
    for name, t in lora_targets(started.model).items():
        assert same_codes(fresh[name].base.weight, t.base.weight), name
    # a base that holds Q_T already is left as it is (a resumed run rebuilds before its checkpoint loads) ...
    assert rebuild_loftq_base(tiny_model_dir, fresh, back) == 0
    # ... and one that holds neither quant(W) nor Q_T is another model's: refused
    name = next(iter(back.layers))
    base = fresh[name].base
    loftq.write_packed(base, nf4_roundtrip(torch.ones(base.weight.quant_state.shape), QuantSettings.of_layer(base))[0])
    with pytest.raises(TunekitError, match=r"does not quantize to the loaded layer's codes"):
        rebuild_loftq_base(tiny_model_dir, fresh, back)

    path.write_bytes(b"not safetensors")
    with pytest.raises(TunekitError, match=rf"{path}: not a LoftQ start file"):
        load_loftq_init(tmp_path)


def test_apply_refuses_a_trained_adapter(tiny_model_dir, started):
    with pytest.raises(TunekitError, match=r"lora_B is not zero"):
        apply_loftq(started.model, tiny_model_dir, r=R, scaling=ALPHA / R, iters=1)


def test_a_start_computed_elsewhere_is_checked_against_the_base_codes(tiny_model_dir, monkeypatch, caplog):
    """compute_device (FSDP: the base in host memory, the SVDs on rank 0's GPU): each layer's start
    is computed there; where that device's first quantization does not give the base's own codes
    (bitsandbytes' CPU and CUDA quantizers are meant to agree; this stands in for one that does
    not), that layer is computed again where it sits, with one warning, and the start is exactly
    the one computed there. No GPU here: "cuda" only names the other device; the computation it
    stands for is faked."""
    import dataclasses
    import logging

    calls = []
    real = loftq.loftq_layer

    def elsewhere(w, r, scaling, iters, settings=QuantSettings(), device=None):
        calls.append(str(device))
        if str(device) == "cuda":  # the other device: its plain quantization disagrees in one code
            result = real(w, r, scaling, iters, settings, device=None)
            bad = result.plain.data.clone()
            bad.view(torch.uint8).view(-1)[0] ^= 0x11
            wrong = result.plain.__class__(bad, requires_grad=False, quant_state=result.plain.quant_state)
            return dataclasses.replace(result, plain=wrong)
        return real(w, r, scaling, iters, settings, device=device)

    model = _lora_model(tiny_model_dir)
    reference = _lora_model(tiny_model_dir)
    monkeypatch.setattr(loftq, "loftq_layer", elsewhere)
    with caplog.at_level(logging.WARNING, logger="tunekit"):
        apply_loftq(model, tiny_model_dir, r=R, scaling=lora_scaling(model), iters=1, device=torch.device("cuda"))
    n = len(lora_targets(model))
    assert calls == ["cuda", "cpu"] * n  # each layer tried on the other device, then where it sits
    assert len([r for r in caplog.records if "other NF4 codes" in r.getMessage()]) == n
    monkeypatch.setattr(loftq, "loftq_layer", real)
    apply_loftq(reference, tiny_model_dir, r=R, scaling=lora_scaling(reference), iters=1)
    for name, t in lora_targets(model).items():
        ref = lora_targets(reference)[name]
        assert torch.equal(t.lora_A.weight, ref.lora_A.weight) and torch.equal(t.lora_B.weight, ref.lora_B.weight)
        assert same_codes(t.base.weight, ref.base.weight)
