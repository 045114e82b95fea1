"""LoRA's variants (tunekit.methods.lora): which combine, how PiSSA/OLoRA save, LoRA+'s groups, DoRA's plan.

Combinations. rsLoRA and LoRA+ combine with everything. DoRA does not combine with a PiSSA/OLoRA
start: the saved adapter must load over the original base, and peft's conversion of such a start
(below) carries only lora_A/lora_B, dropping DoRA's magnitude. PiSSA and OLoRA rewrite the base
weight to W - s B0 A0; over a 4-bit base that residual would be requantized (quant(W_res) + s B0 A0
!= W, so the start is no longer the base's function, and the adapter saved as a LoRA over the
original base would not apply over quant(W) either). tunekit refuses them there: a start fitted to
the 4-bit base is LoftQ's job (method.init=loftq, tunekit.methods.lora.loftq), which in turn needs a
4-bit base (over bf16 there is no rounding to fit) and no DoRA (peft sets DoRA's magnitude from
W + s B A at apply time, before the LoftQ start would change B A).

PiSSA/OLoRA saving. Training changes B0 A0 into B A over W_res = W - s B0 A0, which equals
W + s (B A - B0 A0) = W + s [B, -B0] [A; A0]: a standard LoRA of rank 2r over the original W, with
peft's config then saying r = 2r and alpha scaled to keep s (2x, or sqrt(2)x under rsLoRA). That is
what peft's `save_pretrained(path_initial_model_for_weight_conversion=...)` writes, from the start
(A0, B0) `keep_start` copies at apply time. A model rebuilt by `apply` (resuming, opening a run)
recomputes the same start (exact QR for OLoRA; PiSSA's randomized SVD under a fixed seed), and
`unconverted` splits a saved folder back into the trained halves.

Importing this module imports no torch (tunekit.methods.registry).
"""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from tunekit import TunekitError

if TYPE_CHECKING:
    import torch.nn as nn

# method.init -> peft's init_lora_weights. PiSSA through peft's fast SVD (4 subspace iterations, the
# paper's fast variant: minutes instead of hours of full SVDs on a 7B model; B0 A0 is then close to,
# not exactly, W's top-r part, and W_res = W - s B0 A0 exactly whatever B0 A0 is).
# LoftQ builds peft's default layers (B = 0), then tunekit.methods.lora.loftq_io.start_loftq sets its start.
# "auto" is resolved to loftq or default before training (tunekit.methods.lora.start_choice); where a
# config is applied unresolved (a test, a script building the model itself) it is the plain start
PEFT_INIT = {"default": True, "pissa": "pissa_niter_4", "olora": "olora", "loftq": True, "auto": True}
REWRITES_BASE = ("pissa", "olora")  # inits that rewrite the base as W - s B0 A0 at apply time
# method.loftq_iters' upper bound: each alternation requantizes every target once more, and the
# weight error had stopped falling by 5 on the default model (benchmarks/quantization/).
LOFTQ_MAX_ITERS = 10
START_ATTR = "_tunekit_lora_start"  # on the PeftModel: {saved key: the tensor's value at apply time}
SEED = 0

DORA_NOT_FUSED = ("kernels.fused_lora=on: the fused LoRA kernel does not implement DoRA (method.use_dora=true); "
                  "use kernels.fused_lora=auto (peft's DoRA layers) or off")


def check_combination(c, quantize: str, training: bool = True) -> None:
    """One error line for a variant that does not combine with the others or with the base.
    training=False: the structure only (a LoftQ run's LoRA applied over the original weights to
    merge into them); the base a LoftQ start needs is checked when it trains."""
    if c.init in REWRITES_BASE and quantize == "nf4":
        raise TunekitError(f"method.init={c.init}: rewrites the base weight as W - (principal part), which a "
                           "4-bit base cannot hold exactly; over model.quantize=nf4 use method.init=default or "
                           "loftq, or train over the bf16 base (model.quantize=none)")
    if c.init == "loftq" and quantize != "nf4" and training:
        raise TunekitError("method.init=loftq: fits the LoRA start to what 4-bit rounding loses, and this base is "
                           f"not 4-bit (model.quantize={quantize}); use model.quantize=nf4 (recipe=qlora), or "
                           "method.init=default/pissa/olora over a bf16 base")
    if c.init in REWRITES_BASE and c.use_dora:
        raise TunekitError(f"method.use_dora: not with method.init={c.init} (its adapter is saved as a standard LoRA "
                           "over the original base, which has no place for DoRA's magnitude); choose one")
    if c.init == "loftq" and c.use_dora:
        raise TunekitError("method.use_dora: not with method.init=loftq (DoRA's magnitude is set from the layer "
                           "before the LoftQ start changes it); choose one")
    if c.init not in ("loftq", "auto") and c.loftq_iters != 1:
        raise TunekitError(f"method.loftq_iters={c.loftq_iters}: applies to method.init=loftq (or auto) only "
                           f"(method.init={c.init})")


@contextlib.contextmanager
def seeded(on: bool):
    """Random numbers drawn inside come from SEED, and the caller's streams are left as they were."""
    if not on:
        yield
        return
    import torch

    from tunekit.device.facts import cuda_device_count

    with torch.random.fork_rng(devices=list(range(cuda_device_count()))):
        torch.manual_seed(SEED)
        yield


def keep_start(model: nn.Module, saved_key) -> None:
    """Copy the PiSSA/OLoRA start (A0, B0) onto the model, keyed as peft's files key them."""
    start = {saved_key(n): p.detach().clone() for n, p in model.named_parameters()
             if ".lora_A." in n or ".lora_B." in n}
    object.__setattr__(model, START_ATTR, start)  # not a submodule or buffer: never in a state dict


def start_tensors(model: nn.Module) -> dict:
    """{name: tensor} a start (LoftQ, PiSSA, OLoRA) may write, in module order: every LoRA layer's A
    and B, its base weight (PiSSA/OLoRA: W - s B0 A0; LoftQ: the packed codes of Q) and, over a 4-bit
    base, the quantization state's tensors that LoftQ rewrites in place (loftq.write_packed)."""
    import torch
    from peft.tuners.lora import LoraLayer

    out = {}
    for name, m in model.named_modules():
        if not isinstance(m, LoraLayer):
            continue
        for adapter in sorted(m.lora_A):
            out[f"{name}.lora_A.{adapter}"] = m.lora_A[adapter].weight
            out[f"{name}.lora_B.{adapter}"] = m.lora_B[adapter].weight
        weight = m.get_base_layer().weight
        out[f"{name}.base.weight"] = weight.data
        state = getattr(weight, "quant_state", None)
        if state is not None:
            out[f"{name}.base.absmax"] = state.absmax
            if state.nested:
                for key, t in (("offset", state.offset), ("absmax2", state.state2.absmax)):
                    if isinstance(t, torch.Tensor):
                        out[f"{name}.base.{key}"] = t
    return out


def start_of(model: nn.Module):
    return getattr(model, START_ATTR, None)


def converted(expected: dict, model: nn.Module) -> dict:
    """{saved key: tensor} as a PiSSA/OLoRA model saves them: A: (2r, in) = [A; A0], B: (out, 2r) =
    [B, -B0]; `expected` unchanged for any other model."""
    start = start_of(model)
    if start is None:
        return expected
    import torch

    out = {}
    for key, p in expected.items():
        init = start[key].to(p.device)
        out[key] = torch.cat([p.detach(), init], 0) if ".lora_A." in key else torch.cat([p.detach(), -init], 1)
    return out


def unconverted(state: dict, model: nn.Module) -> dict:
    """A saved PiSSA/OLoRA folder's tensors, as the rank-r model trains them (the first halves); the
    saved start replaces the model's copy, so that saving again writes the same folder."""
    start = start_of(model)
    if start is None:
        return state
    trained = {}
    for key, t in state.items():
        if key not in start:
            trained[key] = t
            continue
        r = start[key].shape[0] if ".lora_A." in key else start[key].shape[1]
        if ".lora_A." in key:
            trained[key], start[key] = t[:r], t[r:].to(start[key])
        else:
            trained[key], start[key] = t[:, :r], (-t[:, r:]).to(start[key])
    return trained


def save_peft(model: nn.Module, out_dir: Path) -> None:
    """peft's save_pretrained; a PiSSA/OLoRA model converted to the rank-2r LoRA over the original base.
    peft's conversion loads the start as a temporary adapter (drawing a Kaiming init for it first,
    and putting the model in eval mode): under fork_rng, and each module's train/eval mode put back,
    so that saving a checkpoint changes nothing about the training that goes on."""
    start = start_of(model)
    # save_embedding_layers=False: where a run added tokens (data.chat_template) the adapter holds their
    # trained rows only; peft's "auto" would add the whole resized embedding matrix (and the head)
    if start is None:
        # the trained adapter only: a frozen start (model.adapter) is recorded by the run, not saved again
        model.save_pretrained(out_dir, safe_serialization=True, selected_adapters=["default"],
                              save_embedding_layers=False)
        return
    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory() as tmp, seeded(True):
        initial = Path(tmp) / "initial"
        initial.mkdir()
        save_file({k: v.detach().cpu().contiguous() for k, v in start.items()},
                  str(initial / "adapter_model.safetensors"))
        modes = [(m, m.training) for m in model.modules()]
        try:
            model.save_pretrained(out_dir, safe_serialization=True, save_embedding_layers=False,
                                  path_initial_model_for_weight_conversion=str(initial))
        finally:
            for m, training in modes:
                m.training = training


def loraplus_groups(model: nn.Module, params: list, lr: float, ratio: float) -> list[dict]:
    """LoRA+ optimizer groups over `params` (the tensors the optimizer steps): lora_B and 1-d tensors
    (DoRA's magnitude) at ratio x lr, the rest (lora_A) at lr, as peft's create_loraplus_optimizer
    groups them. A tensor the model does not name (a strategy's wrapper) stays at lr."""
    names = {id(p): n for n, p in model.named_parameters()}
    fast, rest = [], []
    for p in params:
        name = names.get(id(p), "")
        (fast if ".lora_B." in name or (name and p.ndim == 1) else rest).append(p)
    groups = [{"params": rest, "lr": lr}, {"params": fast, "lr": lr * ratio}]
    return [g for g in groups if g["params"]]


# ------------------------------------------------------------------ DoRA in the plan
def dora_flops(o, shape) -> int:
    """Forward FLOPs per position of one block's DoRA rescaling: (m / ||W + s B A|| - 1) * base +
    m / ||.|| * s * lora, ~4 per output of each target; with dropout peft recomputes the base matmul
    on the dropped input (2 in out). The per-step norm (B A, then W + s B A and its row norms:
    ~2 r in out + 3 in out per target, once per forward, not per position) is not in this figure."""
    total = 0
    for p in o.targets:
        i, out = shape.projection(p)
        total += 4 * out + (2 * i * out if o.dropout > 0 else 0)
    return total


def dora_transient_bytes(o, shape) -> int:
    """What peft's DoRA layer builds and frees within each forward of its largest target (and again
    in a recomputed block): B A through an identity input, `torch.eye(in)`, and for the weight's row
    norm the dequantized W, B A itself (out, in) and W + s B A. Counted in fp32, the trained weights'
    dtype peft computes that branch in: 4 (in^2 + 3 out in). Llama-3-8B's down_proj: 1.42 GiB, of
    which the identity alone is 784 MiB; invisible on small models."""
    if not o.dora:
        return 0
    return max((4 * (i * i + 3 * out * i) for p in o.targets for i, out in [shape.projection(p)]), default=0)


def dora_saves(o, site, shape) -> int:
    """Bytes DoRA's rescaling keeps at one site, beyond plain LoRA's, for each target there:

    * per position: the base output (out,) the magnitude's gradient reads, in the stream's dtype
      (peft reuses the base layer's output), and the fp32 LoRA output (out,);
    * with dropout, peft recomputes the base matmul on the dropped fp32 input instead: that output
      is fp32, and the matmul keeps the fp32 dequantized weight (out, in) for the input's gradient,
      once per layer and micro-batch.

    (Each forward also builds B A through an identity input and W + s B A for the norm: freed within
    the layer's forward, not kept: a transient, `dora_transient_bytes`.)"""
    if not o.dora:
        return 0
    total = 0
    for p in site.projections:
        if p in o.targets:
            i, out = shape.projection(p)
            if o.dropout > 0:
                total += site.tokens * 8 * out + 4 * i * out
            else:
                total += site.tokens * (site.dtype_bytes + 4) * out
    return total


# ------------------------------------------------------------------ LoftQ in the plan
def loftq_start_bytes(in_dim: int, out_dim: int, r: int, iters: int) -> int:
    """Peak bytes of one target's LoftQ start (tunekit.methods.lora.loftq._loftq_one) beside the model;
    the layers go one at a time, so the plan counts the largest target. W: (out, in), n = out in,
    k = min(out, in); in units of n bytes:

    * held through the layer: the tensor as read (4, an fp32 checkpoint at most), W in fp32 (4),
      quant(W)'s codes (0.5; 1 with a requantized base beside them) and the dequantized base in
      the compute dtype (2);
    * the largest transient of: the fit's error W - dequant - s B A (dequant in fp32, the
      difference, B A and s B A: 16); the SVD of the fp32 residual (4): LAPACK's copy of it (4),
      U (out, k), V^T (k, in) and LAPACK's workspace, bounded by 6 k^2 floats (24 k^2 bytes;
      torch's MKL gesdd took 3-4.7 k^2 on the 2-core EPYC, the most for tall weights: the bound
      leaves room for a LAPACK build that blocks differently); with 2 or more iterations,
      W - s B A formed in fp64 (B A and W in fp64: 16).
    tests/methods/test_loftq_train.py holds this against the measured growth on the CPU. A GPU's SVD
    (cuSOLVER) has a workspace of its own, not measured."""
    n, k = in_dim * out_dim, min(in_dim, out_dim)
    held = int((11 if iters >= 2 else 10.5) * n)
    svd = 4 * n + 4 * n + 4 * k * (in_dim + out_dim) + 24 * k * k
    return held + max(16 * n, svd) + 4 * r * (in_dim + out_dim)
