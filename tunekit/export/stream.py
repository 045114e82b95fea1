"""A LoRA run merged into its base tensor by tensor, streamed from the base's safetensors files.

The in-memory merge (tunekit.methods.lora.LoRA.merge over a loaded model) holds the whole merged
model in fp32: 32 GB for an 8B model. Here each tensor of the base is read alone (safetensors'
safe_open, per tensor: read_tensor), merged, rounded once to the stored dtype and written
(tunekit.export.shards) before the next is read:

    W_out = round_dtype(dequant(quant_nf4(W)) + s (B @ A))   a 4-bit run merged into the dequantized
                                                             NF4 weights it trained against (default)
    W_out = round_dtype(W + s (B @ A))                       a run over the high-precision base

W: (out, in) as stored in the base's files, read in fp32; A: (r, in), B: (out, r) from the
adapter's adapter_model.safetensors; s = alpha / r (alpha / sqrt(r) under rsLoRA), from its
adapter_config.json as peft computes it. quant_nf4 / dequant are bitsandbytes' functional
quantize_4bit / dequantize_4bit with the loader's settings (NF4, blocks of 64, double-quantized
scales), on the fp32 weight: the codes a 4-bit load of the base holds, since a 16-bit weight is
exactly representable in fp32 (the in-memory path loads the 4-bit base in fp32 too). A weight
of the 4-bit base the adapter does not touch is rounded through NF4 all the same: the trained
model computed with that rounding. Reading from the files also keeps away from bitsandbytes'
CPU repack of a loaded 4-bit layer (tunekit.model.loader.keep_bnb_layout), after which
dequantizing returns wrong weights.

Memory: one tensor's working set, on the export's device: its stored copy, the fp32 weight and the
NF4 codes, then the dequantized fp32 weight beside them (8.5 bytes per element plus the stored copy,
for the largest adapted projection; a tensor that is only cast, such as a 128k-vocabulary
embedding, costs its stored and output bytes: tunekit.export.memory.merge_tensor_bytes). plan_stream returns None and the reason for
what it does not stream, and the export falls back to the in-memory merge: methods other than
LoRA, DoRA (its magnitude rescales rows by the merged weight's norms: the in-memory merge is the
checked implementation), a LoftQ start of more than one alternation or merged into the original
weights (its base is rebuilt, or its start subtracted; one alternation trained over the loader's own
4-bit base and streams into the dequantized weights like any QLoRA run), a 4-bit run
merged into the original weights (the gate then compares with the exact fp32 merge, which only
the in-memory path holds), peft features tunekit does not train with, and bases whose tensors
are not stored under the model's own names.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from tunekit import TunekitError
from tunekit.export.shards import MAX_SHARD_BYTES, Entry, write_checkpoint

# bitsandbytes' Params4bit block size when the loader gives none (tunekit.model.loader.load_kwargs
# gives none): 64 weights per absmax; double quantization groups 256 absmax values.
NF4_BLOCKSIZE = 64
ADAPTER_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."  # peft's path to the wrapped model in adapter keys
# adapter_config.json keys of peft features a plain LoRA merge would get wrong: each must be off
UNSUPPORTED = {"use_dora": "DoRA", "modules_to_save": "modules_to_save", "rank_pattern": "per-module ranks",
               "alpha_pattern": "per-module alphas", "lora_bias": "LoRA biases", "fan_in_fan_out": "fan_in_fan_out",
               "layer_replication": "layer replication", "trainable_token_indices": "trainable tokens",
               "use_qalora": "QA-LoRA", "target_parameters": "target_parameters"}


@dataclass
class StreamPlan:
    """What a streamed merge reads and writes (built by plan_stream, before anything loads); without
    updates (plan_base), the base itself as the run computed with it."""

    base: Path  # the base model folder
    files: dict[str, Path]  # tensor name -> the base file holding it
    names: list[str]  # the merged checkpoint's tensors, in the base files' order
    updates: dict[str, tuple[str, str]]  # weight name -> (lora_A key, lora_B key) in the adapter file
    scale: float  # s
    nf4: frozenset[str]  # weight names rounded through NF4 (empty unless the run's base is 4-bit, and merged
    # into or written as the dequantized weights)
    adapter_file: Path
    tied: dict[str, str]  # tied name (not written) -> the name it shares a tensor with


def plan_stream(src, target: Optional[str]) -> tuple[Optional[StreamPlan], str]:
    """(the plan, "") for a merge that streams; (None, why not) for one the in-memory path does."""
    from tunekit.methods.lora.loftq_io import LOFTQ_INIT_FILE, saved_iters

    if src.method != "lora":
        return None, f"method {src.method}: its merge is computed on the loaded model"
    if getattr(src, "start", None) is not None:
        return None, "the run trained over a frozen start adapter (model.adapter): both merge on the loaded model"
    from tunekit.model.folder import read_json

    folder = Path(src.adapter_dir)
    cfg = read_json(folder / "adapter_config.json", "RUN_DIR")  # one error line for a damaged file
    used = [what for key, what in UNSUPPORTED.items() if cfg.get(key) not in (None, False, {}, [], "none")]
    if cfg.get("bias", "none") != "none":
        used.append("trained biases")
    if used:
        return None, f"the adapter uses {', '.join(used)}"
    # A LoftQ start of one alternation trained over quant(W), the loader's own 4-bit base: merged into
    # the dequantized weights it streams as a plain QLoRA run. More alternations rebuilt the base, and
    # a merge into the original weights subtracts the start: both on the loaded model.
    if (folder / LOFTQ_INIT_FILE).is_file() and (saved_iters(folder) != 1 or src.quantize != "nf4"
                                                  or target == "original"):
        return None, "a LoftQ start (its base is rebuilt, or the start subtracted, on the loaded model)"
    if src.quantize == "nf4" and target == "original":
        return None, "--merge-into original over a 4-bit base is checked against the exact fp32 merge"
    plan, why = plan_base(Path(src.base_path), src.base_key, src.quantize == "nf4")
    if plan is None:
        return None, why
    updates, why = _updates(folder / ADAPTER_FILE, set(plan.names), plan.tied)
    if updates is None:
        return None, why
    r = float(cfg["r"])
    scale = float(cfg["lora_alpha"]) / (math.sqrt(r) if cfg.get("use_rslora") else r)
    return dataclasses.replace(plan, updates=updates, scale=scale, adapter_file=folder / ADAPTER_FILE), ""


def plan_base(base: Path, key: str, nf4: bool) -> tuple[Optional[StreamPlan], str]:
    """The base alone as a streamed plan (no update: each tensor comes out as the run computed with
    it, rounded through NF4 where `nf4` and the 4-bit loader quantizes it), or (None, why not): the
    tensors of `base`'s safetensors files under the model's own names, in the files' order. `key`:
    the setting that named `base`, for the error line of a config.json transformers rejects."""
    files = _base_files(base)
    if files is None:
        return None, f"{base} holds no safetensors weights to stream from"
    from tunekit.model.folder import model_skeleton

    skeleton = model_skeleton(str(base), key)
    tied = dict(getattr(skeleton, "all_tied_weights_keys", None) or {})
    wanted = [k for k in skeleton.state_dict() if k not in tied]
    missing = [k for k in wanted if k not in files]
    if missing:
        return None, f"{base}'s files do not name the model's tensor {missing[0]} (transformers renames them on load)"
    order = {f: i for i, f in enumerate(dict.fromkeys(files.values()))}
    names = sorted(wanted, key=lambda k: (order[files[k]], k))
    rounded = frozenset(nf4_weights(skeleton)) if nf4 else frozenset()
    return StreamPlan(base, files, names, {}, 0.0, rounded, Path(), tied), ""


def stored_dtype(src) -> torch.dtype:
    """The dtype the base's config.json says its weights are stored in (fp32 where it names none)."""
    cfg = json.loads((Path(src.base_path) / "config.json").read_text())
    name = cfg.get("dtype") or cfg.get("torch_dtype")
    return {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(name, torch.float32)


def reference_in_storage(src) -> bool:
    """Whether a streamed export measures the trained model over its 16-bit base held as stored,
    computing in fp32 (tunekit.export.fidelity.UpcastHalfWeights: one 16-bit copy in memory instead
    of an fp32 one). Not where the method rewrites the base at apply time (PiSSA/OLoRA: W - s B0 A0,
    which a 16-bit weight would round; the merge adds their saved rank-2r LoRA to W instead)."""
    from tunekit.methods.lora.variants import REWRITES_BASE

    return stored_dtype(src) != torch.float32 and src.method_impl.settings(src.run.cfg.method).init not in REWRITES_BASE


def _base_files(base: Path) -> Optional[dict[str, Path]]:
    """{tensor name: file} of a base folder's safetensors weights (one file, or an index's shards)."""
    from tunekit.model.folder import read_json

    index = base / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index, "model.path").get("weight_map")
        return {k: base / v for k, v in weight_map.items()} if isinstance(weight_map, dict) else None
    single = base / "model.safetensors"
    if not single.is_file():
        return None
    from safetensors import safe_open

    with safe_open(str(single), "pt") as f:
        return {k: single for k in f.keys()}


def _updates(adapter_file: Path, weights: set[str], tied: dict) -> tuple[Optional[dict], str]:
    """{weight name: (lora_A key, lora_B key)} of an adapter file, or (None, why it does not stream)."""
    from safetensors import safe_open

    with safe_open(str(adapter_file), "pt") as f:
        keys = list(f.keys())
    modules = {}
    for key in keys:
        module, _, kind = key.removeprefix(PREFIX).rpartition(".lora_")
        if not key.startswith(PREFIX) or kind not in ("A.weight", "B.weight"):
            return None, f"the adapter holds {key}, not a LoRA pair of a Linear weight"
        modules.setdefault(module, {})[kind[0]] = key
    updates = {}
    for module, pair in modules.items():
        weight = f"{module}.weight"
        if set(pair) != {"A", "B"}:
            return None, f"the adapter holds half a LoRA pair for {module}"
        if weight in tied or weight in tied.values():
            return None, f"the adapter changes {weight}, which the model ties to another tensor"
        if weight not in weights:
            raise TunekitError(f"{adapter_file}: adapts {module}, which the base has no weight for; this "
                               "adapter was not trained on this base")
        updates[weight] = (pair["A"], pair["B"])
    return updates, ""


def nf4_weights(skeleton) -> set[str]:
    """The weight names a 4-bit load of this model holds as NF4: every Linear but the skipped head."""
    import torch.nn as nn

    from tunekit.model.loader import NF4_SKIP_MODULES

    head = skeleton.get_output_embeddings()
    return {f"{name}.weight" for name, m in skeleton.named_modules()
            if isinstance(m, nn.Linear) and m is not head and name.rsplit(".", 1)[-1] not in NF4_SKIP_MODULES}


def nf4_roundtrip(w: torch.Tensor) -> torch.Tensor:
    """dequant(quant_nf4(w)): (out, in) fp32 -> (out, in) fp32, as a 4-bit load of the base computes with."""
    import bitsandbytes.functional as bnbf

    codes, state = bnbf.quantize_4bit(w, blocksize=NF4_BLOCKSIZE, compress_statistics=True, quant_type="nf4")
    return bnbf.dequantize_4bit(codes, state)  # in state.dtype: fp32


def merged_weight(w: torch.Tensor, nf4: bool, a: Optional[torch.Tensor], b: Optional[torch.Tensor], scale: float,
                  device: torch.device) -> torch.Tensor:
    """(out, in) fp32 on `device`: w (as stored), rounded through NF4 if `nf4`, plus scale * b @ a
    (a: (r, in), b: (out, r)) where there is an update. Summed in fp32, not yet rounded."""
    w = w.to(device=device, dtype=torch.float32)
    if nf4:
        w = nf4_roundtrip(w)
    if a is not None:
        w.addmm_(b.to(device=device, dtype=torch.float32), a.to(device=device, dtype=torch.float32), alpha=scale)
    return w


@contextlib.contextmanager
def _exact_fp32_matmuls():
    """fp32 matmuls in full fp32 (a GPU may otherwise use TF32, 10 significand bits, for B @ A)."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def read_tensor(file: Path, name: str) -> torch.Tensor:
    """One tensor of a safetensors file, as stored, in memory of its own.

    Opened and closed per tensor: safe_open maps the whole file, and every page a read touches
    stays in the process's resident set until the file is closed (file-backed, reclaimable, yet
    counted: through a 2 GB checkpoint held open, RSS grew by the whole file). A header parse per
    tensor costs little beside the tensor's bytes."""
    from safetensors import safe_open

    with safe_open(str(file), "pt") as f:
        return f.get_tensor(name)


def entries_of(plan: StreamPlan, dtype: torch.dtype) -> list[Entry]:
    """The merged checkpoint's tensors (name, shape, `dtype`) from the base files' headers; one
    error line for a tensor that is not stored as a float (an already quantized checkpoint)."""
    from safetensors import safe_open

    entries = []
    for file in dict.fromkeys(plan.files[n] for n in plan.names):
        with safe_open(str(file), "pt") as f:
            for name in (n for n in plan.names if plan.files[n] == file):
                stored = f.get_slice(name).get_dtype()
                if stored not in ("F32", "F16", "BF16", "F64"):
                    raise TunekitError(f"{file}: {name} is stored as {stored}, not a float: "
                                       "a quantized checkpoint cannot be a merge's base")
                entries.append(Entry(name, tuple(f.get_slice(name).get_shape()), dtype))
    order = {n: i for i, n in enumerate(plan.names)}
    return sorted(entries, key=lambda e: order[e.name])


def merged_tensor(plan: StreamPlan, name: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One tensor of the merged model, in `dtype`, rounded once (from fp32 or from its stored dtype).
    Call it under _exact_fp32_matmuls()."""
    w = read_tensor(plan.files[name], name)
    if name not in plan.nf4 and name not in plan.updates:
        return w.to(dtype)  # a norm, an embedding, a bias: as stored, rounded once
    a_key, b_key = plan.updates.get(name, (None, None))
    a = read_tensor(plan.adapter_file, a_key) if a_key else None  # (r, in)
    b = read_tensor(plan.adapter_file, b_key) if b_key else None  # (out, r)
    if a is not None and (a.shape[1] != w.shape[1] or b.shape[0] != w.shape[0] or a.shape[0] != b.shape[1]):
        raise TunekitError(f"{plan.adapter_file}: {a_key} {tuple(a.shape)} and {b_key} {tuple(b.shape)} "
                           f"do not fit {name} {tuple(w.shape)}: not an adapter of this base")
    return merged_weight(w, name in plan.nf4, a, b, plan.scale, device).to(dtype)


def write_merged(plan: StreamPlan, tokenizer, out_dir: Path, dtype: torch.dtype, device: torch.device,
                 max_shard_bytes: int = MAX_SHARD_BYTES) -> None:
    """A standalone HF folder (weights in `dtype`, config, generation config, tokenizer), merged
    tensor by tensor; every tensor is rounded once, from fp32 or from its stored dtype."""
    with _exact_fp32_matmuls():
        write_checkpoint(out_dir, entries_of(plan, dtype), lambda e: merged_tensor(plan, e.name, dtype, device),
                         max_shard_bytes)
    _write_configs(plan.base, tokenizer, out_dir, dtype)


def write_merged_gguf(plan: StreamPlan, tokenizer, path: Path, dtype: str, device: torch.device, name: str) -> None:
    """The merged model as one GGUF file (bf16, fp16 or fp32 as in tunekit.export.gguf), each tensor
    merged as it is written: the same tensors write_merged stores, with no model in memory. A plan
    without updates (plan_base) writes the base the run computed over (tunekit.export.gguf_adapter)."""
    from transformers import AutoConfig

    from tunekit.export.gguf import write_gguf_tensors

    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    cfg = AutoConfig.from_pretrained(plan.base)
    entries = [(e.name, e.shape) for e in entries_of(plan, torch_dtype)]
    with _exact_fp32_matmuls():
        write_gguf_tensors(cfg, entries, lambda n: merged_tensor(plan, n, torch_dtype, device), bool(plan.tied),
                           tokenizer, path, dtype, name)


def _write_configs(base: Path, tokenizer, out_dir: Path, dtype: torch.dtype) -> None:
    """config.json (the base's, as a plain model stored in `dtype`), generation_config.json, tokenizer."""
    from transformers import AutoConfig, GenerationConfig

    cfg = AutoConfig.from_pretrained(base)
    # Nothing of the training setup may leak into config.json: a stale quantization_config would
    # make transformers try to load plain weights as 4-bit.
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(cfg, attr):
            delattr(cfg, attr)
    cfg.use_cache = True
    cfg.dtype = dtype  # what the files hold: consumers loading with dtype="auto" get it
    cfg.save_pretrained(out_dir)
    gen = (GenerationConfig.from_pretrained(base) if (base / "generation_config.json").is_file()
           else GenerationConfig.from_model_config(cfg))
    gen.save_pretrained(out_dir)
    from tunekit.export.artifacts import stop_at_turn_end

    stop_at_turn_end(out_dir, tokenizer)
    tokenizer.save_pretrained(out_dir)
