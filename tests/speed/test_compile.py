"""kernels.compile: decoder layers through torch.compile, checked against eager before step 1."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tunekit import TunekitError
from tunekit.speed import torch_compile as compiled
from tunekit.config import DataConfig, KernelsConfig, ModelConfig, TrainConfig, TrainerConfig
from tunekit.methods import MethodConfig
from tunekit.model.layers import decoder_layers
from tunekit.train.loop import TrainRecipe


def _recipe(tiny_model_dir, tiny_data, out, compile_: bool, dtype: str = "fp32", quantize: str = "nf4") -> TrainRecipe:
    cfg = TrainConfig(
        output_dir=str(out), seed=0,
        model=ModelConfig(path=str(tiny_model_dir), quantize=quantize, dtype=dtype),
        data=DataConfig(path=str(tiny_data), max_seq_len=64, val_fraction=0.2),
        method=MethodConfig(r=4, alpha=12, dropout=0.0),  # scaling 3: not a power of two
        trainer=TrainerConfig(max_steps=3, micro_batch_size=4, grad_accum=2, lr=1e-3, eval_samples=0),
        kernels=KernelsConfig(compile=compile_),
    )
    r = TrainRecipe(cfg, out)
    r.setup()
    return r


def test_compiled_training_takes_eager_steps_and_saves_the_same_adapter(tiny_model_dir, tiny_data, tmp_path,
                                                                      monkeypatch):
    """The wiring, through a training run: every layer routed through the compiler while autograd
    records, evaluation eager, the same adapter saved. The compiler here is dynamo with the `eager`
    backend: the same tracing, graphs and guards as inductor without AOTAutograd and code generation
    (a fraction of inductor's compile time); inductor itself is checked on a layer in the
    tests below and before every compiled run. A compiled qlora run (fp32 compute)
    against the eager one, 3 optimizer steps from the same start; step 0 has lora_B = 0, so steps 1-2
    are the ones that see the LoRA branch's scaling (alpha/r = 3).
    Tolerance (sized for a real compiler, which fuses and reorders fp32 arithmetic, ~1e-6 relative
    per value; the eager backend replays the traced ops and should agree more closely): Adam at
    lr 1e-3 turns a gradient difference into a parameter difference of at most
    lr * (relative gradient difference) except where a gradient is near 0, which moves a parameter by
    < 2 lr either way, so after 2 updates the losses stay within ~1e-4 relative (2e-4 allowed)."""
    through = []  # the layers each compiled call ran

    def recording(fn):
        run = torch.compile(fn, backend="eager", dynamic=True)

        def call(layer, *args, **kwargs):
            through.append(layer)
            return run(layer, *args, **kwargs)
        return call

    monkeypatch.setattr(compiled, "compile_fn", recording)
    runs = {}
    for mode in (False, True):
        r = _recipe(tiny_model_dir, tiny_data, tmp_path / str(mode), mode)
        losses = [r.train_step(step)["loss"] for step in range(3)]
        r.save_final()
        runs[mode] = (r, losses)
    (eager, eager_losses), (comp, comp_losses) = runs[False], runs[True]
    assert not eager.compiled.on and comp.compiled.on and comp.compiled.layers == 2
    # The eager backend runs the traced torch calls themselves, in eager's order on the same inputs:
    # the same CPU kernels, so the check's layer copy compiled and eager agree bit for bit
    assert comp.compiled.check["max_rel_diff"] == 0.0 and comp.compiled.check["compared"] == 2 * (2 + 7 * 2)
    layers = decoder_layers(comp.model)
    assert all(hasattr(layer, compiled.ATTR) for layer in layers)
    # qlora's embedding is frozen, so the first layer's input needs no gradient: that layer runs eager
    # (no graph variant of its own to compile), the second through the compiler
    assert not any(seen is layers[0] for seen in through) and any(seen is layers[1] for seen in through)
    assert comp_losses == pytest.approx(eager_losses, rel=2e-4)
    assert eager_losses[2] != pytest.approx(eager_losses[0], rel=1e-3)  # the steps really trained
    # The saved adapter is the eager run's, tensor for tensor (same keys, values within training's drift)
    a = load_file(eager.output_dir / "adapter" / "adapter_model.safetensors")
    b = load_file(comp.output_dir / "adapter" / "adapter_model.safetensors")
    assert sorted(a) == sorted(b) and len(a) == 2 * 7 * 2  # A and B of 7 projections in 2 layers
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-4 * float(a[k].abs().max()) + 1e-7)
    # Evaluation runs eager (no grad): nothing more is traced, and the held-out loss is the eager model's
    from torch._dynamo.utils import counters

    traced = counters["frames"]["total"]
    assert comp.evaluate(3)["val_loss"] == pytest.approx(eager.evaluate(3)["val_loss"], rel=2e-4)
    assert counters["frames"]["total"] == traced > 0
    for r, _ in runs.values():
        r.tracker.close()


@pytest.fixture(scope="module")
def eager_recipe(tiny_model_dir, tiny_data, tmp_path_factory):
    r = _recipe(tiny_model_dir, tiny_data, tmp_path_factory.mktemp("eager"), False)
    yield r
    r.tracker.close()


def _check(r: TrainRecipe):
    return compiled.check(r.model, decoder_layers(r.model)[0], r.compile_check_inputs(), r.dtype)


def _off_by_a_little(where):
    """A 'compiler' whose layer output is 1e-3 relative off for the batches `where(rows)` picks."""
    def compiler(fn):
        def run(layer, hidden, *args, **kwargs):
            out = fn(layer, hidden, *args, **kwargs)
            if not where(len(hidden)):
                return out
            return (out[0] * (1 + 1e-3), *out[1:]) if isinstance(out, tuple) else out * (1 + 1e-3)
        return run
    return compiler


def test_the_check_stops_a_compiler_whose_layer_computes_otherwise(eager_recipe, monkeypatch):
    """A 'compiler' whose layer output is off by 1e-3 relative (10x the fp32 tolerance) stops the
    run with a message that names the key; the layer under test is a copy, the model is untouched."""
    monkeypatch.setattr(compiled, "compile_fn", _off_by_a_little(lambda rows: True))
    with pytest.raises(TunekitError, match=r"kernels.compile: the compiled decoder layer differs from eager "
                                           r"by 1\.00e-03 of its largest value in "):
        _check(eager_recipe)
    assert not any(hasattr(layer, compiled.ATTR) for layer in decoder_layers(eager_recipe.model))


def test_the_check_covers_the_graph_of_a_one_row_micro_batch(eager_recipe, monkeypatch):
    """A micro-batch of one row has no padding, so no mask, and dynamo compiles a graph of its own for
    it: a 'compiler' wrong only there (output off by 1e-3 for one row) is caught by the check's
    one-row batch, before any step runs it."""
    monkeypatch.setattr(compiled, "compile_fn", _off_by_a_little(lambda rows: rows == 1))
    with pytest.raises(TunekitError, match=r"differs from eager by 1\.00e-03 of its largest value in \S+ on a "
                                           r"batch of 1 row of 37 positions \(tolerance"):
        _check(eager_recipe)


def test_the_check_compares_two_rows_and_one_row(eager_recipe, monkeypatch):
    """Both batches a step can bring (several rows, padded; one row, no mask), every tensor of each."""
    monkeypatch.setattr(compiled, "compile_fn", lambda fn: fn)  # eager stands in for the compiler
    result = _check(eager_recipe)
    assert result["batches"] == ["2 rows of 37 positions", "1 row of 37 positions"]
    assert result["compared"] == 2 * (2 + 7 * 2) and result["max_rel_diff"] == 0.0


def test_the_check_stops_a_compiler_that_drops_the_trained_branchs_gradient(eager_recipe, monkeypatch):
    """Right output, wrong gradients: the trained tensors' gradients are compared too."""
    monkeypatch.setattr(compiled, "compile_fn", _no_grad_into_lora)
    with pytest.raises(TunekitError,
                       match=r"differs from eager by 5\.00e-01 of its largest value in (input_grad|.*lora)"):
        _check(eager_recipe)


def test_a_compile_error_becomes_one_message(eager_recipe, monkeypatch):
    def broken(fn):
        def run(*args, **kwargs):
            raise RuntimeError("InductorError: C++ compile error\nlong\ntraceback")
        return run

    monkeypatch.setattr(compiled, "compile_fn", broken)
    with pytest.raises(TunekitError, match=r"kernels.compile: torch.compile failed on this build \(RuntimeError: "
                                           r"InductorError: C\+\+ compile error\); run with kernels.compile=false"):
        _check(eager_recipe)


def test_the_real_compiler_passes_the_check_with_a_margin(eager_recipe):
    """inductor on this machine: the layer copy's output and gradients within an fp32 bound well inside
    the check's own tolerance, and the check's random lora_B really reached the gradients compared
    (all of A's and B's). This also pins tunekit/methods/lora/compute_dtype.py under inductor (it replaced a
    LoRA-layer-only test): torch 2.13's inductor drops `alpha` from `y.add_(a @ b, alpha=s)`, and
    with that form put back this check reads 9.97e-01 at alpha/r = 3.

    Bound: in fp32 storage inductor changes only the order of reductions (re-blocked, vectorised) and
    the evaluation of fused elementwise chains (FMA, vectorised exp/rsqrt within an ulp). The tiny
    layer's reductions run over K <= 128 terms (hidden 64, MLP 128, 37 positions, 74 tokens into a
    weight gradient), whose rounding error grows as sqrt(K) * 2^-24 ~ 6.7e-7 of their scale with
    random-sign terms; a LoRA gradient carries those of ~20 ops forward and back, again random in
    sign: ~sqrt(20) * 6.7e-7 ~ 3e-6. 2e-5 leaves 7x; a compiler that computes something else (the
    alpha above, a dropped term) is off by O(1) of the trained branch."""
    assert eager_recipe.lora_backend.path == "torch"  # the LoRA math of tunekit/methods/lora/compute_dtype.py
    # The two-row batch only: the one-row graph would double inductor's work (most with its cache
    # empty, as on CI); the test below checks that every check covers both batches.
    r = eager_recipe
    result = compiled.check(r.model, decoder_layers(r.model)[0], r.compile_check_inputs()[:1], r.dtype)
    assert result["max_rel_diff"] <= 2e-5, result
    assert result["compared"] == 2 + 7 * 2  # output, input gradient, A and B of 7 projections
    assert json.dumps(result)  # summary.json takes it as is


@pytest.mark.parametrize("diffs, near, failed", [
    ({"out": 0.01}, {}, None),                                    # within the tolerance of eager
    ({"out": 0.03}, {}, None),                                    # at it
    ({"out": 0.05}, {}, "out"),                                   # beyond, and no fp32 reference (fp32 compute)
    ({"out": 0.05}, {"out": (0.02, 0.001)}, None),                # beyond, but within the tolerance of fp32
    ({"out": 0.05}, {"out": (0.06, 0.03)}, None),                 # beyond both, exactly twice eager's distance
    ({"out": 0.05}, {"out": (0.07, 0.03)}, "out"),                # further from fp32 than twice eager
    ({"out": 0.01, "dA": float("nan")}, {"dA": (0.0, 0.0)}, "dA"),  # NaN fails, whatever fp32 says
    ({"dA": 0.05, "dB": 0.05}, {"dA": (0.01, 0.0), "dB": (0.5, 0.1)}, "dB"),  # the first that fails
])
def test_the_judging_rule(diffs, near, failed):
    """judge() on hand-chosen differences, tolerance 3e-2: diffs are compiled-vs-eager, near the
    (compiled, eager) distances from the layer in fp32."""
    assert compiled.judge(diffs, near, 0.03) == failed


def test_only_calls_that_record_a_gradient_into_the_input_are_compiled(monkeypatch):
    """compile_layers' rule, on a plain module: compiled while autograd records and the input (by
    position or as hidden_states=) needs a gradient; eager with no_grad (evaluation, generation)
    and for an input that needs none (the first layer over a frozen embedding)."""
    calls = []

    def recording(fn):
        def call(layer, *args, **kwargs):
            calls.append(kwargs.get("hidden_states", args[0] if args else None))
            return fn(layer, *args, **kwargs)
        return call

    class Layer(torch.nn.Module):
        def forward(self, hidden_states, scale=1.0):
            return hidden_states * scale

    monkeypatch.setattr(compiled, "compile_fn", recording)
    layer = Layer()
    compiled.compile_layers([layer])
    needs, frozen = torch.ones(2, requires_grad=True), torch.ones(2)
    layer(needs)
    layer(hidden_states=needs, scale=2.0)
    layer(frozen)
    with torch.no_grad():
        layer(needs)
    assert [c is needs for c in calls] == [True, True]
    assert torch.equal(layer(frozen, 3.0), torch.full((2,), 3.0))  # the eager path still computes


def test_a_layer_whose_forward_is_already_replaced_is_refused(eager_recipe, monkeypatch):
    """The compiled path calls the layer class's forward; a forward set on the instance (accelerate's
    offloading hooks do that) would be skipped, so it is refused before anything compiles."""
    layer = decoder_layers(eager_recipe.model)[1]
    monkeypatch.setattr(layer, "forward", layer.forward)
    with pytest.raises(TunekitError, match=r"kernels.compile: decoder layer 1's forward is already replaced"):
        compiled.apply(eager_recipe.model, eager_recipe.compile_check_inputs(), torch.float32)
    assert not any(hasattr(m, compiled.ATTR) for m in decoder_layers(eager_recipe.model))


@pytest.fixture(scope="module")
def bf16_recipes(tiny_model_dir, tiny_data, tmp_path_factory):
    """bf16 compute over a 4-bit base ("nf4", as qlora: fp32 norms and residual stream) and over a
    bf16 base ("none", as lora: every op in bf16)."""
    runs = {q: _recipe(tiny_model_dir, tiny_data, tmp_path_factory.mktemp(q), False, "bf16", q)
            for q in ("nf4", "none")}
    assert all(r.dtype == torch.bfloat16 for r in runs.values())
    yield runs
    for r in runs.values():
        r.tracker.close()


def _no_grad_into_lora(fn):
    def run(*args, **kwargs):
        out = fn(*args, **kwargs)
        first = out[0] if isinstance(out, tuple) else out
        halved = first.detach() + 0.5 * (first - first.detach())  # same values, half the gradient
        return (halved, *out[1:]) if isinstance(out, tuple) else halved
    return run


@pytest.mark.parametrize("base", ["nf4", "none"])
def test_in_bf16_the_fp32_reference_is_the_same_layer(bf16_recipes, base, monkeypatch):
    """In half precision the check also runs the layer in fp32. Eager bf16 must then sit at bf16's
    rounding distance from it (u = 2^-8, bf16's 8-bit significand):
    - above 1e-4: the layer's output alone is rounded to bf16 once, and over its 2 x 37 x 64 values the
      largest rounding comes near half an ulp of the top binade, >= 2^-10 ~ 1e-3 of the largest value;
      a copy left in bf16 would read 0;
    - below 32 u = 0.125: the longest path, to a LoRA A gradient, passes ~16 bf16 roundings forward
      (norm, projection, rotary, attention's three, o_proj, residual, norm, gate/up, SiLU and product,
      down_proj) and as many back, each <= u relative, so even their worst-case sum stays 8x below the
      O(1) of a copy that lost a term or a weight.
    The compiler is dynamo with the `eager` backend, which runs eager's own torch calls in eager's
    order: compiled and eager agree bit for bit, and nothing needs judging."""
    monkeypatch.setattr(compiled, "compile_fn", lambda fn: torch.compile(fn, backend="eager", dynamic=True))
    result = _check(bf16_recipes[base])
    assert result["max_rel_diff"] == 0.0 and result["judged_against_fp32"] == []
    assert 1e-4 < result["fp32_distance"]["eager"] < 32 * 2**-8
    assert result["fp32_distance"]["compiled"] == result["fp32_distance"]["eager"]


def test_in_bf16_a_compiler_that_skips_roundings_passes_where_eager_is_further_off(bf16_recipes, monkeypatch):
    """What inductor does in bf16 (keeps fused chains in fp32), made large: a 'compiler' that runs
    the whole layer in fp32 inside (its frozen bf16 weights widened for the call, the 4-bit
    projections computing in fp32) and rounds only its output back to bf16. With the tolerance
    against eager shrunk to 1e-7, every tensor differs from eager beyond it, and passes because it
    is nearer the fp32 layer than eager (one rounding against every op's). (A real compiler in bf16
    can differ from eager by nearly the tolerance while being nearer fp32 than eager.)"""
    def fp32_inside(fn):
        def run(layer, *args, **kwargs):
            widened = [(p, p.data) for p in layer.parameters() if p.dtype == torch.bfloat16]
            fours = [m for m in layer.modules() if getattr(m, "compute_dtype", None) == torch.bfloat16]
            for p, data in widened:
                p.data = data.float()
            for m in fours:
                m.compute_dtype = torch.float32
            try:
                out = fn(layer, *compiled._fp32(args), **compiled._fp32(kwargs))
            finally:
                for p, data in widened:
                    p.data = data
                for m in fours:
                    m.compute_dtype = torch.bfloat16
            first = out[0] if isinstance(out, tuple) else out
            first = first.to(torch.bfloat16)
            return (first, *out[1:]) if isinstance(out, tuple) else first
        return run

    from tunekit.methods.lora.compute_dtype import CACHE_ATTR

    monkeypatch.setattr(compiled, "compile_fn", fp32_inside)
    monkeypatch.setattr(compiled, "TOL", {torch.bfloat16: 1e-7})
    recipe = bf16_recipes["nf4"]
    # Without the projections' dense bf16 copies (the 4-bit codes dequantized for each use instead, to
    # the same bf16 values), so that the fp32 reference and this 'compiler' both dequantize the codes
    # straight to fp32: the same weights, where the reference would widen the bf16 copy
    for m in recipe.model.modules():
        if hasattr(m, CACHE_ATTR):
            monkeypatch.delattr(m, CACHE_ATTR)
    result = _check(recipe)
    assert result["max_rel_diff"] > 1e-4 and len(result["judged_against_fp32"]) == result["compared"]
    # This 'compiler' computes the fp32 layer's ops in fp32, so a tensor it hands back carries two
    # bf16 roundings where eager's carry one per op (~30 on the way to a LoRA gradient): its own
    # rounding to bf16 where it is bf16 (the output, the input gradient: <= 2^-9 of each value, bf16's
    # half ulp), and that of the output gradient, the loss's weights rounded to the bf16 output's
    # dtype (<= 2^-9 each, random in sign: a gradient summing many of them errs by ~2^-9 / sqrt(3) rms
    # of its scale, up to ~4x that at its worst entry). 2^-9 (1 + 4 / sqrt(3)) ~ 6.5e-3 < 2^-7; how
    # much nearer fp32 than eager a compiled tensor must be is judge()'s, tested on its own above.
    assert result["fp32_distance"]["compiled"] <= 2**-7, result["fp32_distance"]


@pytest.mark.parametrize("base", ["nf4", "none"])
def test_in_bf16_a_wrong_gradient_still_stops_the_run(bf16_recipes, base, monkeypatch):
    """A fault is far beyond both rules: half the gradient into the layer, judged against fp32 too."""
    monkeypatch.setattr(compiled, "compile_fn", _no_grad_into_lora)
    with pytest.raises(TunekitError, match=r"differs from eager by 5\.00e-01 of its largest value in \S+ on a "
                                           r"batch of 2 rows of 37 positions \(tolerance 3e-02 for torch.bfloat16\), "
                                           r"and from the layer in fp32 by "
                                           r"(4\.9\d|5\.\d\d)e-01, beyond that and twice eager's \d\.\d\de-0[2-5]; "
                                           r"run with kernels.compile=false"):
        _check(bf16_recipes[base])


def test_in_bf16_a_layer_that_cannot_run_in_fp32_stops_with_one_message(bf16_recipes, monkeypatch):
    """The reference run failing (here: a layer left in bf16 given the fp32 inputs, a dtype clash
    inside a matmul) is no check, so no compiling: one message, not a traceback."""
    import copy

    monkeypatch.setattr(compiled, "_fp32_copy", copy.deepcopy)
    with pytest.raises(TunekitError, match=r"kernels.compile: the check could not run the decoder layer in fp32 "
                                           r"\(RuntimeError: .*dtype.*\); run with kernels.compile=false"):
        _check(bf16_recipes["none"])
