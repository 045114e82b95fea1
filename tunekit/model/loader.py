"""Base model + tokenizer loading; 4-bit NF4 with double quantization via bitsandbytes."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn

from tunekit import TunekitError
from tunekit.model.folder import check_weights_match, mismatch_message, model_skeleton, one_line
from tunekit.model.folder import resolve_model_path  # noqa: F401  (re-exported)
from tunekit.device.facts import compute_dtype  # noqa: F401  (re-exported: the precision policy lives with the device facts)

log = logging.getLogger(__name__)
# The modules a 4-bit load keeps in high precision: the output head, as in QLoRA. A streamed merge
# (tunekit.export.stream) rounds every other Linear weight through NF4 as this loader does.
NF4_SKIP_MODULES = ("lm_head",)




def _hub_error(path: str, err: Exception) -> TunekitError:
    return TunekitError(
        f"model.path: {path!r} is not a local folder and could not be loaded from the Hugging Face hub "
        f"({type(err).__name__}; offline?). Pass a local model folder."
    )


def _load_error(path: str, what: str, err: Exception) -> TunekitError:
    """One line for a failed load: a local folder names itself and the first line of the cause."""
    if not Path(path).is_dir():
        return _hub_error(path, err)
    return TunekitError(f"model.path: cannot load the {what} of {path}: {type(err).__name__}: {one_line(err)}")


# Tokenizers a fork server (tunekit.commands.forkserver) loaded before forking: {folder: (stamp, tokenizer)}.
# Building SmolLM2's tokenizer parses a 3.5 MB tokenizer.json (~0.1 s of a 2-core CPU); a forked
# command takes the server's copy as its first load of that folder instead. Each entry is handed out
# once per process, so no two loads share one object (a run adds tokens to its own), and only while
# the folder's files are the ones it was loaded from.
_PRELOADED: dict[str, tuple[tuple, object]] = {}


def _folder_stamp(folder: Path) -> tuple:
    """(name, size, mtime) of every file in a model folder: any file AutoTokenizer may read changes it."""
    stats = ((e.name, e.stat()) for e in os.scandir(folder) if e.is_file())
    return tuple(sorted((name, st.st_size, st.st_mtime_ns) for name, st in stats))


def preload_tokenizer(path: str) -> None:
    """Load a model folder's tokenizer now, for the first load_tokenizer of that folder in this process
    or a fork of it (a fork server calls this before forking)."""
    from transformers import AutoTokenizer

    folder = Path(path).resolve()
    stamp = _folder_stamp(folder)
    _PRELOADED[str(folder)] = (stamp, AutoTokenizer.from_pretrained(str(folder)))


def _take_preloaded(path: str):
    folder = Path(path)
    if not _PRELOADED or not folder.is_dir():
        return None
    stamp, tok = _PRELOADED.pop(str(folder.resolve()), (None, None))
    return tok if tok is not None and stamp == _folder_stamp(folder) else None


def load_tokenizer(path: str, key: str = "model.path"):
    """The tokenizer of a model folder (or hub id); in a folder with config.json, checked against the
    embeddings of the model that folder holds. `key` is the config key or flag naming the folder."""
    from transformers import AutoTokenizer

    from tunekit.model.template import check_chat_templates

    if Path(path).is_dir():  # also the tokenizer a run saved beside its adapter, which no model check reads
        check_chat_templates(Path(path), key)
    try:
        tok = _take_preloaded(path)
        if tok is None:
            tok = AutoTokenizer.from_pretrained(path)
    except Exception as e:  # tokenizers, sentencepiece and json raise their own types for a bad file
        raise _load_error(path, "tokenizer", e) from None
    if tok.eos_token_id is None:
        raise TunekitError(f"{key}: the tokenizer of {path} has no EOS token")
    if (Path(path) / "config.json").is_file():
        rows = model_skeleton(path, key).get_input_embeddings().num_embeddings
        check_vocab_fits(tok, rows, path, key)
    if tok.pad_token_id is None:
        # Padding positions are masked by length, never by id, so reusing EOS as pad is safe.
        tok.pad_token = tok.eos_token
    return tok


def load_kwargs(quantize: str, dtype: torch.dtype, device: torch.device,
                quant_storage: Optional[torch.dtype] = None) -> dict:
    """from_pretrained keyword arguments for the frozen base (a plain function: tested for `cuda`,
    `cuda:1` and the CPU on a machine without a GPU).

    NF4 + double quantization (QLoRA): 4-bit NormalFloat codes in blocks of 64 whose absmax
    constants are themselves 8-bit quantized in blocks of 256: ~4.13 bits per parameter. A 4-bit
    load places the weights itself, so it needs a device map with an explicit device index.
    quant_storage: the dtype the packed codes are stored as (bitsandbytes' default uint8). FSDP
    shards only floating-point parameters, so a sharded 4-bit base stores its codes as a float
    dtype: the same bytes, viewed differently (tunekit.train.fsdp).
    """
    from transformers import BitsAndBytesConfig

    from tunekit.device.facts import device_map

    kwargs = {"dtype": dtype}
    if quantize == "nf4":
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=dtype,
            # the output head stays in high precision, as in QLoRA
            llm_int8_skip_modules=list(NF4_SKIP_MODULES),
            **({"bnb_4bit_quant_storage": quant_storage} if quant_storage is not None else {}),
        )
        kwargs["device_map"] = device_map(device)
    return kwargs


def check_vocab_fits(tokenizer, rows: int, path: str, key: str = "model.path") -> None:
    """Every token id the tokenizer can produce has an embedding row.

    A tokenizer given added tokens without the embeddings being resized yields ids past the last
    row: an IndexError in the middle of a run, as soon as the data holds such a token (a pad token
    feeds its id at every padded position). We refuse rather than resize: the new rows would be
    random, and a fine-tuning method that freezes the embeddings would never train them.
    """
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids = max(len(tokenizer), max(added, default=-1) + 1)
    if ids > rows:
        past = sorted(i for i in added if i >= rows)
        which = (f": {len(past)} added token(s) have none, e.g. {str(added[past[0]])[:40]!r} (id {past[0]:,})" if past
                 else f": ids {rows:,} and up have none")
        raise TunekitError(
            f"{key}: the tokenizer of {path} has {ids:,} token ids, its model {rows:,} embedding rows (vocab_size in "
            f"config.json){which}. Resize the embeddings and save the model with this tokenizer "
            "(model.resize_token_embeddings(len(tokenizer))), or use the tokenizer the model was saved with")


def load_base_model(path: str, quantize: str, dtype: torch.dtype, device: torch.device,
                    quant_storage: Optional[torch.dtype] = None, key: str = "model.path") -> nn.Module:
    """Frozen base in `dtype`; with quantize='nf4', linear layers as bitsandbytes Linear4bit.

    Never a partly random model: the weight files are checked against config.json before the load
    (safetensors headers against a skeleton of the model), what transformers matched is checked
    after it, and every weight must be finite. `key` is the config key or flag naming the folder,
    for the error.
    """
    from transformers import AutoModelForCausalLM

    if Path(path).is_dir():
        check_weights_match(Path(path), model_skeleton(path, key), key)
    kwargs = load_kwargs(quantize, dtype, device, quant_storage)
    try:
        # ignore_mismatched_sizes: a tensor of the wrong shape is reported in the loading info (and
        # refused below, with its name and shapes) instead of raising an error that points at a log
        model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True,
                                                           ignore_mismatched_sizes=True, **kwargs)
    except (ImportError, MemoryError):
        raise  # a missing library or too little memory is not the folder's fault: keep the details
    except Exception as e:  # safetensors, json and shape errors of a damaged or foreign folder
        raise _load_error(path, "model", e) from None
    check_loaded(model, info, path, key)
    if quantize != "nf4":
        model.to(device)
    else:
        keep_bnb_layout(model)
    model.requires_grad_(False)
    return model


def check_loaded(model: nn.Module, info: dict, path: str, key: str = "model.path") -> None:
    """What from_pretrained matched (`output_loading_info`) leaves no weight at random values, and
    every weight is finite.

    Covers what the header check cannot see: pickle checkpoints, already quantized folders, hub ids,
    and a 4-bit load, which quantizes a tensor of the wrong shape without reporting it (its
    quantization state keeps the shape it was given, compared here with the layer's own).
    """
    if info.get("error_msgs"):
        raise TunekitError(f"{key}: cannot load the model of {path}: {one_line(info['error_msgs'][0])}")
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    buffers = {name for name, _ in model.named_buffers()}
    missing = {k for k in info.get("missing_keys") or () if k in params}  # a buffer is computed, not loaded
    ties = getattr(model, "all_tied_weights_keys", None) or {}  # {tied name: the name it shares a tensor with}
    missing = [k for k in missing if ties.get(k) not in missing]  # a tied pair counts once
    unexpected = [k for k in info.get("unexpected_keys") or () if k not in buffers]
    mismatched = [(name, tuple(a), tuple(b)) for name, a, b in info.get("mismatched_keys") or ()]
    for name, module in model.named_modules():
        state = getattr(getattr(module, "weight", None), "quant_state", None)
        want = (getattr(module, "out_features", None), getattr(module, "in_features", None))
        if state is not None and None not in want and tuple(state.shape) != want:
            mismatched.append((f"{name}.weight", tuple(state.shape), want))
    message = mismatch_message(key, path, missing, unexpected, mismatched)
    if message:
        raise TunekitError(message)
    bad = nonfinite_weights(model)
    if bad:
        raise TunekitError(f"{key}: the weights in {path} hold NaN or infinite values, in {len(bad)} tensor(s), "
                           f"first {bad[0]}: damaged files, or a model that diverged in its own training; nothing "
                           "trained on or computed from it would mean anything")


def nonfinite_weights(model: nn.Module, chunk: int = 1 << 24) -> list[str]:
    """Names of the weights holding a NaN or an infinity, in model order.

    One reduction per tensor: a sum is finite unless an element is not (or the sum overflows, which
    the exact per-element test below then rules out), accumulated in fp32 so that fp16 weights
    cannot overflow it; one device sync for the whole model. A 4-bit weight is packed codes: its
    block scales (absmax, and with double quantization their own scales and offset) go non-finite
    when any weight of the block was, so those are what is checked.
    """
    named: list[tuple[str, torch.Tensor]] = []
    for name, p in model.named_parameters():
        state = getattr(p, "quant_state", None)
        if state is not None:
            second = getattr(state, "state2", None)  # double quantization: the scales' own scales
            parts = [state.absmax, getattr(state, "offset", None), getattr(second, "absmax", None)]
            named += [(name, t) for t in parts if isinstance(t, torch.Tensor) and t.is_floating_point()]
        elif p.is_floating_point() and not p.is_meta:
            named.append((name, p.detach()))
    if not named:
        return []
    with torch.no_grad():
        sums = torch.stack([t.sum(dtype=torch.float32).to(named[0][1].device) for _, t in named])
        suspects = (~torch.isfinite(sums)).nonzero().flatten().tolist()
        bad = []
        for i in suspects:
            name, t = named[i]
            if name not in bad and not all(bool(c.isfinite().all()) for c in t.reshape(-1).split(chunk)):
                bad.append(name)
    return bad


def keep_bnb_layout(model: nn.Module) -> None:
    """Stop bitsandbytes from repacking 4-bit weights into its CPU inference layout.

    On CPUs with AVX512-BF16, an eval-mode no-grad forward of Linear4bit repacks the weight in
    place (bitsandbytes 0.50). After that, training forwards give different logits (measured:
    up to 1.25 apart on SmolLM2) and dequantize/merge return wrong weights. Validation
    runs exactly such forwards mid-training, so we turn the repack off per instance: eval and
    train then run the same math, and the weights stay in the layout every consumer expects.
    """
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


def quantized_bits_per_param(model: nn.Module) -> Optional[float]:
    """Storage bits per weight over all 4-bit layers: packed codes + absmax + second-level state.

    The code tables (16 NF4 values, 256 dynamic-map values) are the same constants in every
    layer, so they are not charged per layer.
    """
    bits = params = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        state = getattr(weight, "quant_state", None)
        if state is None:
            continue
        params += state.shape.numel()
        bits += weight.numel() * weight.element_size() * 8
        bits += state.absmax.numel() * state.absmax.element_size() * 8
        if state.nested:  # absmax stored as 8-bit codes; their own fp32 absmax per 256 + offset
            bits += state.state2.absmax.numel() * state.state2.absmax.element_size() * 8 + 32
    return bits / params if params else None


def decoder_and_head(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """The decoder stack (returns last hidden states) and the output head of a causal LM.

    Works through PEFT wrappers (their layers live inside the decoder). Running the two apart
    lets a loss apply the vocabulary-sized head to the few positions it needs. A method whose
    model needs its own decoder (prompt tuning prepends a soft prompt and drops it from the
    output) defines `tunekit_decoder_and_head()`; its decoder keeps the same contract.
    """
    if hasattr(model, "tunekit_decoder_and_head"):
        return model.tunekit_decoder_and_head()
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else None
    head = base.get_output_embeddings()
    if decoder is None or head is None:
        raise TunekitError(f"model: {type(base).__name__} exposes no decoder/output head (not a causal LM?)")
    return decoder, head


def prepare_for_training(model: nn.Module, quantize: str, gradient_checkpointing: bool) -> None:
    """Put a frozen base in the state the trainer trains over (and evaluation and export rebuild).

    Every frozen weight stays in the dtype it was loaded in, the precision policy's compute dtype
    (tunekit.device.precision): over a 4-bit base that keeps the embeddings, the norms and the output head
    in bf16 where peft's prepare_model_for_kbit_training would widen them to fp32, doubling their
    memory and running the residual stream, attention and the head in fp32. A method widens only
    what it trains. Gradient checkpointing uses the non-reentrant variant, which works with frozen
    inputs; the embeddings' output then requires grad so that the checkpointed blocks have a
    gradient to recompute for. It has no numeric effect. `quantize` is accepted for symmetry with
    the loader: a 4-bit base needs nothing else.
    """
    model.requires_grad_(False)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if not getattr(model, "_require_grads_hooks", None):  # transformers may have hooked it already;
            model.enable_input_require_grads()  # a second hook would be orphaned (never removed by a merge)
    model.config.use_cache = False
