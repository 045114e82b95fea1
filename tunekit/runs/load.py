"""Build the models and tokenizer of an opened source (tunekit.runs.open.Source), fresh from disk.

Every model comes back in eval mode, frozen, on the source's device and in its compute dtype:

    load_base(src)              the untuned base: --base-model where named, else the base the source
                                trained over, prepared as the trainer prepares it
    load_trained(src)           that base + the trained part, exactly as trained (a model folder: as it is)
    apply_and_load(src, base)   the trained part on a base already loaded (its storage is reused): one
                                load of a 4-bit base serves an export's base loss, the trained model's
                                logits and the merge into the dequantized weights, which consumes it
    load_original_base(src)     the base's own high-precision weights in fp32 (never 4-bit): what a
                                merge into the original model adds the fine-tune to
    load_tokenizer_for(src)     the tokenizer saved with the trained part (its chat template), else the base's

Bases load with tunekit's own loader (keep_bnb_layout: no bitsandbytes CPU repack on eval
forwards; tunekit.model.loader explains why).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn

from tunekit import TunekitError
from tunekit.runs.open import Source

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def _not_torch(src: Source) -> TunekitError:
    return TunekitError(f"{src.path}: a GGUF file runs in llama.cpp, which only `tunekit eval` drives; "
                        "generate and chat take a run, an adapter folder or a model folder")


def _prepared_base(path: str, quantize: str, dtype: torch.dtype, device: torch.device, key: str) -> nn.Module:
    """The frozen base as the trainer prepares it (every frozen weight in the compute dtype);
    gradient checkpointing has no numeric effect and is left off."""
    from tunekit.model import load_base_model, prepare_for_training

    model = load_base_model(path, quantize, dtype, device, key=key)
    prepare_for_training(model, quantize, gradient_checkpointing=False)
    return model.eval()


def load_base(src: Source) -> nn.Module:
    """The untuned base: --base-model where named, else the base the source trained over."""
    if src.base_override is not None:
        from tunekit.model import resolve_model_path

        return _with_added_tokens(_prepared_base(resolve_model_path(src.base_override, key="--base-model"),
                                                 src.quantize, src.dtype, src.device, "--base-model"), src)
    if src.kind == "model":
        raise TunekitError(f"--base: the base of the model folder {src.path} is unknown; name it with --base-model DIR")
    if src.kind == "gguf":
        raise TunekitError(f"--base: the base of the GGUF file {src.path} is unknown; name its untuned Hugging Face "
                           "model folder with --base-model DIR")
    return _own_base(src)


def _own_base(src: Source) -> nn.Module:
    return _with_added_tokens(_prepared_base(src.base_path, src.quantize, src.dtype, src.device, src.base_key), src)


def _with_added_tokens(base: nn.Module, src: Source) -> nn.Module:
    """A base whose trained part adds tokens (data.chat_template) gets their rows, at the mean of its
    rows, as training started them: its tokenizer is the run's, whose rows hold those ids."""
    from tunekit.model.vocab import grow_for_adapter

    if src.adapter_dir is not None and Path(src.adapter_dir).is_dir():
        grow_for_adapter(base, Path(src.adapter_dir))
    return base


def apply_and_load(src: Source, base: nn.Module, adapter_dir: Optional[Path] = None) -> nn.Module:
    """The trained part (from adapter_dir, default the source's) on `base`, whose storage it reuses:
    the trained model, frozen, eval mode. A standalone peft LoRA folder (tunekit's, TRL's, ...)
    loads with peft's own loader; everything else with the tunekit method that wrote it."""
    from tunekit.model.vocab import grow_for_adapter

    folder = Path(adapter_dir or src.adapter_dir)
    method = src.method_impl
    grow_for_adapter(base, folder)  # rows for the tokens the run added (data.chat_template), before they load
    if src.run is None:  # a standalone folder: the method rebuilds its structure from the folder itself
        return method.open_adapter(base, folder)
    if src.start is not None:  # over its frozen start adapter (model.adapter), as it trained
        model = method.apply_over_start(base, src.run.cfg.method, src.start.folder)
    else:
        model = method.apply(base, src.run.cfg.method)
    method.load(model, folder)
    model.requires_grad_(False)
    return model.eval()


def load_trained(src: Source, adapter_dir: Optional[Path] = None) -> nn.Module:
    """The base the source trained over + its trained part (adapter_dir: another folder of the same
    kind, e.g. an exported copy), exactly as trained; a model folder loads as it is."""
    if src.kind == "gguf":
        raise _not_torch(src)
    if src.kind == "model":
        from tunekit.model import load_base_model

        return load_base_model(str(src.path), src.quantize, src.dtype, src.device, key=src.base_key).eval()
    return apply_and_load(src, _own_base(src), adapter_dir)


def load_original_base(src: Source) -> nn.Module:
    """The base's own high-precision weights from its folder (never 4-bit), in fp32, eval mode.

    The weights a merge into the original model adds the fine-tune to; fp32 so that the sum
    W + delta is exact before the export's dtype rounds it once.
    """
    from tunekit.model import load_base_model

    return load_base_model(src.base_path, "none", torch.float32, src.device, key=src.base_key).eval()


def load_gguf_tokenizer(path: Path):
    """The tokenizer stored in a GGUF file, as transformers reads it (vocabulary, merges, special
    ids, chat template)."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as e:  # gguf's reader and transformers' converter raise their own types for a bad file
        raise TunekitError(f"{path}: transformers cannot read the tokenizer in this GGUF file "
                           f"({type(e).__name__}: {str(e).splitlines()[0][:160]}); pass --model DIR naming "
                           "a folder with the model's tokenizer") from None
    if tok.eos_token_id is None:
        raise TunekitError(f"{path}: the tokenizer in this GGUF file has no EOS token; pass --model DIR")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token  # as tunekit.model.load_tokenizer: padding is masked by length
    return tok


def load_tokenizer_for(src: Source):
    """The tokenizer saved beside the trained part or in the model folder (it carries the chat
    template trained with); a run's checkpoint folder may hold none: then the run's finished
    adapter's; else the base's."""
    from tunekit.model import load_tokenizer

    if src.kind == "gguf":
        return load_tokenizer(src.tokenizer_dir) if src.tokenizer_dir else load_gguf_tokenizer(src.path)
    if src.kind == "model":
        folders = [src.path]
    else:
        folders = [src.adapter_dir] + ([src.run.adapter_dir] if src.run is not None else [])
    for folder in folders:
        if any((Path(folder) / f).is_file() for f in TOKENIZER_FILES):
            return load_tokenizer(str(folder), key=src.base_key if src.kind == "model" else str(folder))
    return load_tokenizer(src.base_path, key=src.base_key)
