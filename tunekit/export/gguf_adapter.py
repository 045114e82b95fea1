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
per layer (its rank_pattern / alpha_pattern may give a layer another r or alpha). Writing alpha =
scaling * r makes llama.cpp's alpha / r equal peft's factor: plain LoRA gets its lora_alpha back,
rsLoRA lora_alpha * sqrt(r). The factor is computed from the saved adapter_config.json as peft
computes it when it loads the folder, so what the trained model computed is what is written. A
layer whose scaling * r differs from the file's alpha carries the ratio in its lora_b.

Rotary layout: the base GGUF's q and k rows are interleaved per head (gguf.py). The update to a
weight is B A, so the same row permutation of W applies to B alone; A's columns (the input
features) are untouched.

Everything is read from files, never from a model in memory: the adapter GGUF from the run's
adapter_model.safetensors (what `--format adapter` ships: a PiSSA/OLoRA run's rank-2r LoRA over
the original weights), the base GGUF tensor by tensor from the base's safetensors files
(tunekit.export.stream, a plan without updates: each weight as the run computed with it, rounded
through NF4 exactly as the 4-bit loader rounds it for a 4-bit run). The trained model, measured
first, is freed before either is written, so the export holds no more than the merged export does.

The check: llama.cpp loads a base GGUF plus the adapter, and its logits go through the export's
usual comparison with the trained model. The base is the one the adapter trained against: the
run's base weights, or for a 4-bit run the dequantized NF4 weights (what the user evaluated),
written by tunekit into the export's temp folder and removed with it. Only the adapter ships; the
report says which base it was checked over, and in which dtype.

The base GGUF's dtype: f16 (1-D tensors f32, as in every GGUF tunekit writes). llama-cpp-python
reads a model it applies a LoRA to whole into memory (it maps no file then), so the base GGUF's
width is the check's memory: f32 is 4 bytes a weight, 30 GiB for an 8B model, twice the one
16-bit copy the rest of the export is held to (tunekit.export.memory). Between the 16-bit types:

  * weights. bf16 values (a bf16 base): f16 has 3 more significand bits and 3 fewer exponent bits,
    so every bf16 value of magnitude in [2^-17, 65504] is exact in f16; below that (f16's
    subnormals, spacing 2^-24) a value moves by at most 2^-25; one of 65520 or more would become
    infinite, and the file is then written in bf16 instead (a log line and the report say so).
    bf16 holds them all exactly. Dequantized NF4 values (code * absmax: fp32 products, 24
    significant bits) and an fp32 base: no 16-bit type holds them; f16 rounds each to within 2^-11
    of its magnitude (2^-25 absolute below 2^-14), bf16 to within 2^-8, 8x as far. (bf16 is exact
    for NF4 dequantized to bf16, what a run computing in bf16 multiplied by; the check compares
    with the trained model computed in fp32, from the fp32 dequantization, and so should the file.)
  * arithmetic. ggml multiplies a 16-bit weight by its input converted to the weight's type: over
    an f16 file each base matmul rounds its input to 11 significant bits, over a bf16 file to 8
    (a bf16 matmul's rounding, on every projection of every layer, even where the weights
    themselves are exact). llama.cpp's attention rounds K, V, Q and the softmax weights to f16
    over either; the LoRA branch stays f32 with an f32 adapter.

So over f16 every weight and every matmul input is within 2^-11 of the fp32 function the check
measures, the same rounding llama.cpp's f16 attention applies anyway, and the check measures the
adapter over its base as llama.cpp runs any f16 GGUF of it (a merged f16 GGUF, rounded the same
way, read KL 1.5e-5 against the trained model on the tweet-sentiment run,
benchmarks/export/deploy-tweet-sentiment-2026-11-25.md, two orders below the gate's KL bound of
3e-3). bf16 would make those roundings 8x larger (KL, which grows as the square of a small
perturbation, ~64x) in the same memory. tests/export/test_gguf_adapter.py bounds the logits from this count.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tunekit import TunekitError
from tunekit.export.gguf import gguf_tensor_name, interleave_rotary_rows
from tunekit.export.stream import ADAPTER_FILE, StreamPlan

log = logging.getLogger("tunekit")
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
    from tunekit.model.vocab import adapter_token_ids

    added = adapter_token_ids(run.adapter_dir)
    if added:
        raise TunekitError(f"{FMT}: the run added {len(added)} token(s) to the vocabulary (data.chat_template) and "
                           "trained their embedding rows; a llama.cpp LoRA adapter cannot grow its base's vocabulary: "
                           "use --format gguf (the fine-tune merged into one GGUF, with the new tokens) or merged")
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


def peft_scaling(config: dict, module: str, rank: int) -> float:
    """The factor peft multiplies a loaded adapter's B A by in `module` (its name in the base model),
    from the folder's adapter_config.json: alpha / r, or alpha / sqrt(r) under use_rslora, with r
    and alpha from rank_pattern / alpha_pattern where a pattern matches the module (peft's own
    matching). `rank`: the saved tensors' rank, which must be that r."""
    from peft.utils.other import get_pattern_key

    ranks, alphas = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    r = ranks.get(get_pattern_key(ranks.keys(), module), config["r"])
    alpha = alphas.get(get_pattern_key(alphas.keys(), module), config["lora_alpha"])
    if int(r) != rank:
        raise TunekitError(f"{FMT}: the saved LoRA on {module!r} has rank {rank}, its adapter_config.json says "
                           f"{r}; the adapter folder is damaged")
    return float(alpha) / (math.sqrt(r) if config.get("use_rslora") else float(r))


def adapter_tensors(adapter_dir: Path, base_config: dict) -> LoraTensors:
    """A saved peft LoRA folder (adapter_config.json, adapter_model.safetensors) in llama.cpp's layout,
    read from its files; base_config: the base's config.json (heads for the rotary order, tying)."""
    from safetensors import safe_open

    from tunekit.model.folder import read_json

    config = read_json(Path(adapter_dir) / "adapter_config.json", "RUN_DIR")
    tied = bool(base_config.get("tie_word_embeddings", False))
    heads = int(base_config["num_attention_heads"])
    kv_heads = int(base_config.get("num_key_value_heads") or heads)
    found = []
    file = Path(adapter_dir) / ADAPTER_FILE
    with safe_open(str(file), "pt") as f:
        keys = set(f.keys())
        for module in sorted({k.removeprefix(PEFT_PREFIX).rpartition(".lora_")[0] for k in keys}):
            target = _gguf_target(module, tied)
            a_key, b_key = f"{PEFT_PREFIX}{module}.lora_A.weight", f"{PEFT_PREFIX}{module}.lora_B.weight"
            if a_key not in keys or b_key not in keys:
                raise TunekitError(f"{FMT}: {file} holds half a LoRA pair for {module!r}; the adapter folder is damaged")
            A = f.get_tensor(a_key).float()  # (r, in)
            B = f.get_tensor(b_key).float()  # (out, r)
            if ".attn_q." in target:
                B = interleave_rotary_rows(B, heads)
            elif ".attn_k." in target:
                B = interleave_rotary_rows(B, kv_heads)
            found.append((target, A, B, peft_scaling(config, module, A.shape[0]) * A.shape[0]))
    if not found:
        raise TunekitError(f"{FMT}: {adapter_dir} holds no LoRA matrices (not a LoRA run?)")
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


def base_plan(src) -> StreamPlan:
    """The base the adapter trained over, as a streamed plan (tunekit.export.stream.plan_base), made
    before anything loads; one line where the base's files cannot be streamed."""
    from tunekit.export.stream import plan_base

    plan, why = plan_base(Path(src.base_path), src.base_key, src.quantize == "nf4")
    if plan is None:
        raise TunekitError(f"{FMT}: llama.cpp's check applies the adapter over a GGUF of the base written from its "
                           f"safetensors files, and {why}; use --format adapter, or gguf (merged)")
    return plan


class _OutsideF16(Exception):
    """A base tensor holds a value f16 cannot (|x| >= 65520 rounds to infinity)."""


def write_base_gguf(plan: StreamPlan, tokenizer, path: Path, name: str, device: torch.device) -> str:
    """The base GGUF the check applies the adapter over, tensor by tensor from the base's files (the
    weights as the run computed with them: see the module docstring for the dtype): f16, or bf16
    where a weight is beyond f16's range. Returns the dtype written ("fp16" or "bf16")."""
    from transformers import AutoConfig

    from tunekit.export.gguf import write_gguf_tensors
    from tunekit.export.stream import entries_of, merged_tensor

    cfg = AutoConfig.from_pretrained(plan.base)
    entries = [(e.name, e.shape) for e in entries_of(plan, torch.float32)]
    ndim = {n: len(shape) for n, shape in entries}

    def produce(tensor_name: str, dtype: torch.dtype) -> torch.Tensor:
        if ndim[tensor_name] < 2:  # norms (and biases) stay f32 in the file: as stored, exactly
            return merged_tensor(plan, tensor_name, torch.float32, device)
        t = merged_tensor(plan, tensor_name, dtype, device)  # rounded once, from fp32 or as stored
        if not torch.isfinite(t).all():
            raise _OutsideF16(tensor_name)
        return t

    try:
        write_gguf_tensors(cfg, entries, lambda n: produce(n, torch.float16), bool(plan.tied), tokenizer, path,
                           "fp16", name)
        return "fp16"
    except _OutsideF16 as e:
        log.warning("%s: %s holds a weight beyond f16's range (65504); the base GGUF of the check is bf16 instead",
                    FMT, e)
    path.unlink(missing_ok=True)
    write_gguf_tensors(cfg, entries, lambda n: produce(n, torch.bfloat16), bool(plan.tied), tokenizer, path,
                       "bf16", name)
    return "bf16"


def about_base(src, lora: dict, dtype: str) -> dict:
    """The report's "base_gguf": the base the check applied the adapter over, the one the user must.
    lora: the adapter's lora_alpha, lora_ranks and adapted_tensors."""
    model, width = src.base_path, {"fp16": "f16", "bf16": "bf16"}[dtype]
    written = (f"written by tunekit as an {width} GGUF for the check (each weight rounded once to {width}, 1-D "
               "tensors f32) and removed after it")
    if src.quantize == "nf4":
        over = f"the dequantized NF4 weights of {model} that the run trained over, {written}"
        apply = (f"a GGUF of those same dequantized NF4 weights: over a GGUF of {model}'s original weights the "
                 "adapter is applied to weights it was not trained on, a different model (as --format gguf "
                 "--merge-into original); `tunekit export --format gguf --merge-into dequantized` writes the "
                 "trained model itself as one GGUF")
    else:
        over = f"{model}'s own weights (the run's base), {written}"
        apply = (f"a GGUF of {model} (any float type; a quantized base adds its own rounding of the weights), "
                 "e.g. llama-cli -m base.gguf --lora ADAPTER.gguf")
    return {"checked_over": over, "apply_over": apply, "base_dtype": width, **lora}


def write(src, plan: StreamPlan, tokenizer, tmp: Path, out_name: str, dtype: str) -> tuple[dict, Path]:
    """tmp/out_name: the adapter, from the run's adapter file; beside it the base GGUF, from the base's
    files, written once the adapter's tensors are gone. Returns (the report's "base_gguf", the base
    GGUF's path)."""
    from tunekit.plan.shape import read_config_json

    lora = adapter_tensors(src.adapter_dir, read_config_json(src.base_path))
    write_adapter_gguf(lora, tmp / out_name, dtype, name=f"{Path(src.base_path).name}-lora")
    summary = {"lora_alpha": lora.alpha, "lora_ranks": lora.ranks, "adapted_tensors": len(lora.pairs)}
    del lora
    base = tmp / f".base-{out_name}"
    base_dtype = write_base_gguf(plan, tokenizer, base, f"{Path(src.base_path).name}-base", src.device)
    return about_base(src, summary, base_dtype), base


def load(base: Path, adapter: Path, n_ctx: int, threads: int, repack: bool):
    """llama.cpp's model: the base GGUF + the adapter at scale 1. The base GGUF is deleted as soon as
    llama.cpp has loaded it (llama-cpp-python reads a model it applies a LoRA to whole, without
    mapping the file), so only the adapter is left to ship."""
    from tunekit.infer.llamacpp import LlamaCppModel

    try:
        return LlamaCppModel(base, n_ctx, threads, repack, lora=adapter)
    finally:
        base.unlink(missing_ok=True)
