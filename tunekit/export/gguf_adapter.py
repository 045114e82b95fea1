"""`--format gguf-adapter`: a LoRA as llama.cpp's LoRA adapter GGUF, applied at load time over the
base model's own GGUF (`llama-cli -m base.gguf --lora adapter.gguf`), nothing merged.

What llama.cpp's adapter loader reads (llama-adapter.cpp) and how its graph applies it:

    general.architecture  "llama"      must equal the base GGUF's architecture
    general.type          "adapter"
    adapter.type          "lora"
    adapter.lora.alpha    f32          see "Scaling"
    <base tensor>.lora_a  (r, in)      e.g. blk.3.attn_q.weight.lora_a: peft's lora_A.weight as it is
    <base tensor>.lora_b  (out, r)     peft's lora_B.weight; q and k rows reordered (below)

(shapes as numpy/torch write them; ggml lists dimensions the other way round, ne = [in, r] and
[r, out], and the loader checks lora_a's ne[0] against the base tensor's columns, lora_b's ne[1]
against its rows and the two ranks against each other). Every base tensor is named as
tunekit.export.gguf names it; llama.cpp pairs `X.lora_a` with `X.lora_b` and refuses a file whose
X is not a tensor of the base it is applied to.

Scaling: for each adapted matmul llama.cpp adds  s_user * (alpha / r) * B (A x),  where r is that
tensor's rank (lora_b's ne[0]) and alpha the file's one adapter.lora.alpha (0 would mean "no
alpha/r factor at all"). peft's factor is lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora,
per layer (layer.scaling). Writing alpha = scaling * r makes llama.cpp's alpha / r equal peft's
factor: plain LoRA gets its lora_alpha back, rsLoRA lora_alpha * sqrt(r). The factor is read
from the rebuilt model's own LoRA layers, so what the trained model computed is what is written.
A layer whose scaling * r differs from the file's alpha (peft's per-module rank or alpha
patterns) carries the ratio in its lora_b.

Rotary layout: the base GGUF's q and k rows are interleaved per head (gguf.py). The update to a
weight is B A, so the same row permutation of W applies to B alone; A's columns (the input
features) are untouched.

The check: llama.cpp loads a base GGUF plus the adapter, and its logits go through the export's
usual comparison with the trained model. The base is the one the adapter trained against: the
run's base weights, or for a 4-bit run the dequantized NF4 weights (what the user evaluated),
written by tunekit as an f32 GGUF into the export's temp folder and removed with it. f32 holds
both exactly (bf16 weights and dequantized NF4 values alike), so the check measures the adapter
and llama.cpp's arithmetic, not a rounding of the base that every adapter over an f16 base would
share. Only the adapter ships; the report says which base it was checked over.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from tunekit import TunekitError
from tunekit.export.gguf import gguf_tensor_name, interleave_rotary_rows

FMT = "--format gguf-adapter"
PEFT_PREFIX = "base_model.model."  # peft's path to the wrapped model, in module names and file keys


def refuse_early(run) -> None:
    """Before any model loads: the method, the base's architecture and every LoRA target in the
    saved adapter must be ones llama.cpp can apply as a LoRA adapter; else one line naming why."""
    from tunekit.methods.saving import read_shapes
    from tunekit.plan.shape import read_config_json

    name = run.method
    if name != "lora":
        if run.method_impl.can_merge:  # bitfit, full: their change lives in the weights themselves
            instead = "use --format gguf (the fine-tune merged into one GGUF) or --format merged"
        else:  # prompt_tuning, bottleneck adapters: no form in the weights at all
            instead = "use --format adapter (it cannot be merged either, so no GGUF can hold it)"
        raise TunekitError(f"{FMT}: method {name!r} has no llama.cpp adapter form (llama.cpp applies LoRA "
                           f"adapters only); {instead}")
    config = read_config_json(run.base_path)
    if config.get("model_type") != "llama":
        raise TunekitError(f"{FMT}: only Llama-architecture bases are supported, this run's base "
                           f"{run.base_path} is {config.get('model_type')!r}; use --format adapter or merged")
    tied = bool(config.get("tie_word_embeddings", False))
    keys = sorted(read_shapes(run.adapter_dir))
    for key in keys:  # first what each LoRA adapts: the clearest reason when it is the culprit
        module, lora, _ = key.removeprefix(PEFT_PREFIX).rpartition(".lora_")
        if lora:
            _gguf_target(module, tied)
    for key in keys:  # then anything else in the file (DoRA magnitudes, saved embedding layers)
        module, _, kind = key.removeprefix(PEFT_PREFIX).rpartition(".lora_")
        if kind not in ("A.weight", "B.weight"):
            raise TunekitError(f"{FMT}: adapter tensor {key!r} is not a plain LoRA matrix (lora_A / lora_B "
                               "weight); llama.cpp cannot apply it; use --format gguf (merged)")


def _gguf_target(module: str, tied: bool) -> str:
    """'model.layers.3.self_attn.q_proj' -> 'blk.3.attn_q.weight'; one line for a module llama.cpp cannot map."""
    target = gguf_tensor_name(module + ".weight")
    if target is None or target in ("token_embd.weight", "output_norm.weight") or "_norm." in target:
        raise TunekitError(f"{FMT}: the LoRA on {module!r} has no llama.cpp adapter target (llama.cpp applies "
                           "LoRA to the attention and MLP projections and an untied output head); use --format gguf "
                           "(merged)")
    if target == "output.weight" and tied:
        raise TunekitError(f"{FMT}: the LoRA on {module!r} adapts an output head tied to the token embeddings, "
                           "which a GGUF stores once (as token_embd) and llama.cpp cannot adapt; use --format gguf "
                           "(merged)")
    return target


@dataclass
class LoraTensors:
    """The adapter as llama.cpp will read it: {GGUF base tensor name: (A (r, in), B (out, r))}, fp32 on
    the CPU, B in the GGUF's row order and carrying any per-layer scale correction; `alpha` the file's."""

    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]
    alpha: float

    @property
    def ranks(self) -> list[int]:
        return sorted({a.shape[0] for a, _ in self.pairs.values()})


def lora_tensors(model: nn.Module) -> LoraTensors:
    """Read a peft LoRA model's active adapter (A, B, scaling of every LoRA layer) in llama.cpp's layout."""
    from peft.tuners.lora import LoraLayer

    cfg = model.get_base_model().config if hasattr(model, "get_base_model") else model.config
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, LoraLayer)]
    if not layers:
        raise TunekitError(f"{FMT}: the rebuilt model has no LoRA layer (not a LoRA run?)")
    found = []
    for name, layer in layers:
        module = name.removeprefix(PEFT_PREFIX)
        active = [a for a in layer.active_adapters if a in layer.lora_A]
        if len(active) != 1:
            raise TunekitError(f"{FMT}: {module!r} has {len(active)} active LoRA adapters; llama.cpp's adapter "
                               "file holds one")
        a = active[0]
        if layer.use_dora.get(a) or getattr(layer, "lora_bias", {}).get(a):
            raise TunekitError(f"{FMT}: the LoRA on {module!r} uses DoRA or a LoRA bias, which llama.cpp's "
                               "adapters cannot express; use --format gguf (merged)")
        target = _gguf_target(module, tied)
        A = layer.lora_A[a].weight.detach().float().cpu().clone()  # (r, in)
        B = layer.lora_B[a].weight.detach().float().cpu().clone()  # (out, r)
        if ".attn_q." in target:
            B = interleave_rotary_rows(B, cfg.num_attention_heads)
        elif ".attn_k." in target:
            B = interleave_rotary_rows(B, cfg.num_key_value_heads)
        found.append((target, A, B, float(layer.scaling[a]) * A.shape[0]))
    # The file's alpha: the one most layers need (all of them, unless peft's per-module patterns
    # gave some another rank or alpha); the others carry the ratio in B.
    needs = [n for *_, n in found]
    alpha = max(set(needs), key=needs.count)
    if alpha <= 0:  # llama.cpp reads 0 as "no alpha/r factor"; a LoRA scaled by <= 0 is not a fine-tune
        raise TunekitError(f"{FMT}: a LoRA scaled by alpha {alpha:g} (<= 0) has no llama.cpp adapter form")
    pairs = {}
    for target, A, B, need in found:
        pairs[target] = (A, B if need == alpha else B * (need / alpha))
    return LoraTensors(pairs, alpha)


def unloaded_base(model: nn.Module) -> nn.Module:
    """The base a peft LoRA model computes over, as a plain fp32 transformers model: each LoRA layer
    replaced by its base layer, 4-bit layers dequantized from their packed codes (the weights the
    adapter trained against). Consumes `model` (same storage)."""
    from peft.tuners.lora import LoraLayer

    from tunekit.methods.lora import replace_module, to_plain_model

    base = model.get_base_model()
    for name, layer in [(n, m) for n, m in model.named_modules() if isinstance(m, LoraLayer)]:
        replace_module(base, name.removeprefix(PEFT_PREFIX), layer.get_base_layer())
    return to_plain_model(base)


def write_adapter_gguf(lora: LoraTensors, path: Path, dtype: str, name: str) -> None:
    """The adapter GGUF: metadata llama.cpp's loader checks, then lora_a / lora_b of every adapted tensor."""
    import gguf

    types = {"fp32": (gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32, np.float32),
             "fp16": (gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16, np.float16)}
    if dtype not in types:
        raise TunekitError(f"--dtype: {dtype!r} is not a dtype of {FMT}; choose f32 or f16")
    raw, file_type, np_dtype = types[dtype]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_name(name)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(lora.alpha))
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for target, (A, B) in lora.pairs.items():
        writer.add_tensor(f"{target}.lora_a", A.cpu().contiguous().numpy().astype(np_dtype), raw_dtype=raw)
        writer.add_tensor(f"{target}.lora_b", B.cpu().contiguous().numpy().astype(np_dtype), raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_base_gguf(base: nn.Module, tokenizer, path: Path, name: str) -> None:
    """The base the check applies the adapter over, f32 (exact for the weights it holds: see above)."""
    from tunekit.export.gguf import write_gguf

    write_gguf(base, tokenizer, path, "fp32", name=name)


@dataclass
class Prepared:
    """What the export writes and checks, read once from the trained model (which it consumes)."""

    lora: LoraTensors
    base: nn.Module  # plain fp32 model: the weights the adapter trained against
    base_name: str
    about_base: dict  # the report's "base_gguf"


def prepare(run, trained: nn.Module) -> Prepared:
    lora = lora_tensors(trained)
    base = unloaded_base(trained).cpu()  # written to a GGUF (numpy) and computed by llama.cpp on the CPU
    model = run.base_path
    if run.quantize == "nf4":
        over = (f"the dequantized NF4 weights of {model} that the run trained over, written by tunekit as an f32 "
                "GGUF for the check and removed after it")
        apply = (f"a GGUF of those same dequantized NF4 weights: over a GGUF of {model}'s original weights the "
                 "adapter is applied to weights it was not trained on, a different model (as --format gguf "
                 "--merge-into original); `tunekit export --format gguf --merge-into dequantized` writes the "
                 "trained model itself as one GGUF")
    else:
        over = (f"{model}'s own weights (the run's base), written by tunekit as an f32 GGUF for the check and "
                "removed after it")
        apply = (f"a GGUF of {model} (any float type; a quantized base adds its own rounding of the weights), "
                 "e.g. llama-cli -m base.gguf --lora ADAPTER.gguf")
    about = {"checked_over": over, "apply_over": apply, "lora_alpha": lora.alpha, "lora_ranks": lora.ranks,
             "adapted_tensors": len(lora.pairs)}
    return Prepared(lora, base, f"{Path(model).name}-base", about)


def write(prepared: Prepared, tokenizer, tmp: Path, out_name: str, dtype: str) -> Path:
    """tmp/out_name: the adapter; beside it the f32 base GGUF, whose path is returned."""
    adapter = tmp / out_name
    base = tmp / f".base-f32-{out_name}"
    write_adapter_gguf(prepared.lora, adapter, dtype, name=f"{prepared.base_name.removesuffix('-base')}-lora")
    write_base_gguf(prepared.base, tokenizer, base, prepared.base_name)
    return base


def load(base: Path, adapter: Path, n_ctx: int, threads: int, repack: bool):
    """llama.cpp's model: the base GGUF + the adapter at scale 1. The base GGUF is deleted as soon as
    llama.cpp has loaded it (llama-cpp-python reads a model it applies a LoRA to whole, without
    mapping the file), so only the adapter is left to ship."""
    from tunekit.infer.llamacpp import LlamaCppModel

    try:
        return LlamaCppModel(base, n_ctx, threads, repack, lora=adapter)
    finally:
        base.unlink(missing_ok=True)
