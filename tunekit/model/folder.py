"""Is this a causal-LM folder we can load? Answered from its small files, before any weight loads.

`resolve_model_path` is the one entry for every model path a user hands us (model.path,
distill.teacher, generate --model, an exported run's base). A local folder must hold a valid
config.json of a causal language model, intact weights and a tokenizer; a hub id ("org/name")
must be reachable, or present in the local hub cache when offline. Each failure is one
TunekitError naming the key and the path, instead of a transformers traceback after seconds or
minutes of loading.
"""

from __future__ import annotations

import json
import os
import re
import socket
import struct
from pathlib import Path
from typing import Optional
from urllib.parse import urlparse

from tunekit import TunekitError

WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
# Any one of these is enough for AutoTokenizer (fast json, sentencepiece, BPE vocab, WordPiece, tiktoken).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
                   "sentencepiece.bpe.model", "tokenizer.tiktoken")
# Architecture names that are causal LMs even when transformers maps their model_type elsewhere.
CAUSAL_SUFFIXES = ("ForCausalLM", "LMHeadModel")


def resolve_model_path(path: Optional[str], key: str = "model.path") -> str:
    """Local folder (checked), the converted default model when path is None, or a reachable hub id.

    `key` is the config key or flag being resolved (model.path, distill.teacher, --model), named
    in every error.
    """
    if path is None:
        from tunekit.model.default import default_model_dir

        return str(default_model_dir())
    if not str(path).strip():
        raise TunekitError(f"{key}: empty; give a model folder, or null for the default model")
    p = Path(path).expanduser()
    if p.is_dir():
        if not os.access(p, os.R_OK | os.X_OK):
            raise TunekitError(f"{key}: {path} cannot be read by this user (permission denied)")
        try:
            check_model_folder(p, key)
        except PermissionError as e:
            raise TunekitError(f"{key}: {e.filename or path} cannot be read by this user (permission denied)") from None
        return str(p)
    if p.exists():
        raise TunekitError(f"{key}: {path} is a file; give a Hugging Face model folder (with config.json)")
    if path.startswith((".", "/", "~")) or path.count("/") != 1:
        raise TunekitError(f"{key}: no model folder at {path}")
    check_hub_id(path, key)
    return path


def one_line(err: BaseException, limit: int = 300) -> str:
    """An exception's message as one line: its lines joined (libraries nest the reason below a title)."""
    text = " ".join(line.strip() for line in str(err).splitlines() if line.strip()) or type(err).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def read_json(path: Path, key: str) -> dict:
    """A JSON object from `path`; one error naming the file otherwise."""
    try:
        value = json.loads(path.read_bytes())
    except OSError as e:
        raise TunekitError(f"{key}: cannot read {path}: {e.strerror or e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TunekitError(f"{key}: {path} is not valid JSON ({str(e).splitlines()[0][:120]})") from None
    if not isinstance(value, dict):
        raise TunekitError(f"{key}: {path} holds a JSON {type(value).__name__}, not an object")
    return value


def check_causal_config(config: dict, where: str, key: str) -> None:
    """config.json describes a model that AutoModelForCausalLM builds."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL

    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise TunekitError(f"{key}: {where} has no model_type (not a Hugging Face model config)")
    if model_type not in CONFIG_MAPPING_NAMES:
        raise TunekitError(f"{key}: {where}: model_type {model_type!r} is unknown to this transformers "
                           "(custom-code models are not supported)")
    causal_classes = set(CAUSAL.values())
    archs = config.get("architectures") or []
    if model_type not in CAUSAL or (archs and not any(
            a in causal_classes or str(a).endswith(CAUSAL_SUFFIXES) for a in archs)):
        what = ", ".join(map(str, archs)) or f"model_type {model_type!r}"
        raise TunekitError(f"{key}: {where} describes {what}, not a causal language model; tunekit trains "
                           "decoder-only LMs (…ForCausalLM)")


def _safetensors_header(path: Path, key: str) -> dict[str, list[int]]:
    """{tensor name: shape} from the header, after checking the header fits the file: a truncated
    download or copy is caught here, not mid-load."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if n < 2 or 8 + n > size:
                raise ValueError("no valid header")
            header = json.loads(f.read(n))
        tensors = {k: v for k, v in header.items() if k != "__metadata__"}
        ends = [v["data_offsets"][1] for v in tensors.values()]
        shapes = {k: list(v["shape"]) for k, v in tensors.items()}
    except OSError as e:
        raise TunekitError(f"{key}: cannot read {path}: {e.strerror or e}") from None
    except (ValueError, KeyError, TypeError, IndexError, AttributeError):
        raise TunekitError(f"{key}: {path} is not a valid safetensors file (corrupt or truncated)") from None
    need = 8 + n + max(ends, default=0)
    if size < need:
        raise TunekitError(f"{key}: {path} is truncated ({size:,} bytes, its header needs {need:,}); "
                           "copy or download it again")
    return shapes


def check_weights(folder: Path, key: str) -> Optional[dict[str, list[int]]]:
    """The weight files are there and whole; {tensor name: shape} where they are safetensors."""
    present = [name for name in WEIGHTS if (folder / name).is_file()]
    if not present:
        raise TunekitError(f"{key}: {folder} has no weights ({' or '.join(WEIGHTS[::2])})")
    name = present[0]
    if name.endswith(".index.json"):
        index = read_json(folder / name, key)
        shards = sorted(set((index.get("weight_map") or {}).values()))
        if not shards:
            raise TunekitError(f"{key}: {folder / name} lists no weight files (no weight_map)")
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise TunekitError(f"{key}: {folder} lacks {len(missing)} weight file(s) its {name} lists, "
                               f"e.g. {missing[0]}")
        files = [folder / s for s in shards]
    else:
        files = [folder / name]
    if not all(f.suffix == ".safetensors" for f in files):
        return None  # a pickle-format checkpoint: its names are not readable without loading it
    shapes: dict[str, list[int]] = {}
    for f in files:
        shapes.update(_safetensors_header(f, key))
    return shapes


def _natural(name: str) -> list:
    """Sort key that puts layers.2 before layers.10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _some(names, limit: int = 3) -> str:
    shown = sorted(names, key=_natural)
    return ", ".join(shown[:limit]) + (", ..." if len(shown) > limit else "")


def mismatch_message(key: str, folder, missing, unexpected, mismatched) -> Optional[str]:
    """One line for weights that do not fit the model their config.json describes, or None when they fit.

    missing: parameter names the model has and the files lack; unexpected: tensor names in the files
    that no weight of the model takes; mismatched: (name, shape in the files, shape in the model).
    """
    parts = []
    if missing:
        parts.append(f"{len(missing)} weight(s) the config expects are missing from the files ({_some(missing)})")
    if unexpected:
        parts.append(f"{len(unexpected)} tensor(s) in the files fit no weight of the config ({_some(unexpected)})")
    if mismatched:
        first = sorted(mismatched, key=lambda m: _natural(m[0]))[0]
        parts.append(f"{len(mismatched)} tensor(s) have another shape than the config gives them ({first[0]} is "
                     f"{list(first[1])} in the files, {list(first[2])} in the config"
                     + (", ..." if len(mismatched) > 1 else "") + ")")
    if not parts:
        return None
    return (f"{key}: the weights in {folder} do not fit its config.json: " + "; ".join(parts)
            + ". A model loaded from them would be partly random values (another model's weights, or an edited "
            "config.json?)")


def _ignored(model, which: str):
    """transformers' own exceptions to missing ("missing") or unexpected ("unexpected") keys, as one regex.

    The per-class patterns, and for unexpected keys what the loader itself adds: rotary inv_freq
    buffers (older checkpoints saved one per layer) and position_ids (once a persistent buffer).
    """
    patterns = set(getattr(model, f"_keys_to_ignore_on_load_{which}", None) or ())
    if which == "unexpected":
        buffers = [name for name, _ in model.named_buffers()]
        if any(b.endswith("rotary_emb.inv_freq") for b in buffers):
            patterns.add(r"rotary_emb\.inv_freq")
        if any(b.endswith("position_ids") for b in buffers):
            patterns.add(r"(^|\.)position_ids$")
    return re.compile("|".join(f"({p})" for p in patterns)) if patterns else None


def tied_groups(model) -> dict[str, set[str]]:
    """{parameter name: every name that shares its tensor}: a tied output head is the input embedding
    under a second name, saved once (either name loads both)."""
    groups: dict[int, set[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), set()).add(name)
    by_name = {name: group for group in groups.values() for name in group}
    # a skeleton that was not tied yet still declares its ties
    for target, source in (getattr(model, "all_tied_weights_keys", None) or {}).items():
        if target in by_name and source in by_name and by_name[target] is not by_name[source]:
            merged = by_name[target] | by_name[source]
            for name in merged:
                by_name[name] = merged
    return by_name


def _checkpoint_renamer(model, expected: dict):
    """(rename, exact): rename maps a checkpoint name to ([model names], converted?) by transformers'
    own rules: its renamings of legacy names, its converters (several checkpoint tensors fused into
    one weight, e.g. MoE experts, or one split into several, a fused qkv; their shapes cannot be
    compared one to one), and the base-model prefix added or dropped. exact is False where this
    transformers lacks that (internal) API: then only the prefix is handled."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

        mapping = get_model_conversion_mapping(model)
        renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
        converters = [m for m in mapping if isinstance(m, WeightConverter)]
    except Exception:  # an internal API of transformers: absent, or changed, in another version
        def rename(name: str) -> tuple[list[str], bool]:
            if name in expected:
                return [name], False
            bare = name[len(prefix) + 1:] if prefix and name.startswith(prefix + ".") else name
            if bare in expected:
                return [bare], False
            return [f"{prefix}.{bare}" if prefix else bare], False

        return rename, False

    by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}

    def rename(name: str) -> tuple[list[str], bool]:
        new, pattern = rename_source_key(name, renamings, converters, prefix or None, expected)
        if new not in expected and name in expected:  # as the loader does: a name that needed no renaming
            new, pattern = rename_source_key(name, [], [], prefix or None, expected)
        if pattern is None:
            return [new], False
        targets = by_pattern[pattern].target_patterns  # one checkpoint tensor may fill several weights
        return [new.replace(targets[0], t) for t in targets], True

    return rename, True


def weights_mismatch(shapes: dict[str, list[int]], model) -> tuple[list[str], list[str], list[tuple]]:
    """(missing, unexpected, mismatched) of checkpoint tensors {name: shape} against `model` (a
    skeleton on the meta device), as transformers' loader will match them.

    Missing counts parameters only: buffers are computed (rotary inv_freq) or have a defined
    initial value, and a tied weight is present when any of its names is.
    """
    expected = {name: list(t.shape) for name, t in model.state_dict(keep_vars=True).items()}
    buffers = {name for name, _ in model.named_buffers()}
    rename, exact = _checkpoint_renamer(model, expected)
    found: set[str] = set()
    unexpected, mismatched = [], []
    for name, shape in shapes.items():
        targets, converted = rename(name)
        if not any(t in expected for t in targets):
            if not any(t in buffers for t in targets):
                unexpected.append(name)
            continue
        found.update(targets)
        if not converted and list(shape) != expected[targets[0]]:
            mismatched.append((targets[0], list(shape), expected[targets[0]]))
    if not exact and not found:
        return [], [], []  # another naming scheme that this transformers may convert: left to the load
    groups = tied_groups(model)
    missing = [name for name, _ in model.named_parameters() if not groups[name] & found]  # a tied pair once
    skip_missing, skip_unexpected = _ignored(model, "missing"), _ignored(model, "unexpected")
    if skip_missing is not None:
        missing = [n for n in missing if not skip_missing.search(n)]
    if skip_unexpected is not None:
        unexpected = [n for n in unexpected if not skip_unexpected.search(n)]
    return missing, unexpected, mismatched


def check_weights_match(folder: Path, model, key: str) -> None:
    """The weight files hold every parameter of the model config.json describes, in its shape, and
    nothing else; checked from the safetensors headers against `model`, the skeleton (meta device).

    transformers fills a weight it cannot match (renamed tensors, a config.json edited to more or
    fewer layers, another architecture's config over these weights) with random values and only logs
    it; a 4-bit load even quantizes a tensor of the wrong shape without a word. Training would start
    from a partly random model. A pickle checkpoint (no readable header) and an already quantized
    one (its files hold packed codes and scales) are checked after the load instead
    (tunekit.model.loader).
    """
    shapes = check_weights(folder, key)
    if not shapes or getattr(model.config, "quantization_config", None) is not None:
        return
    message = mismatch_message(key, folder, *weights_mismatch(shapes, model))
    if message:
        raise TunekitError(message)


def _looks_whole(path: Path, key: str) -> None:
    """A JSON object file that starts with { and ends with }: catches a truncated copy without
    parsing megabytes (tokenizer.json); the tokenizer load parses it in full."""
    try:
        with path.open("rb") as f:
            head = f.read(64).lstrip()
            f.seek(max(0, path.stat().st_size - 64))
            tail = f.read().rstrip()
    except OSError as e:
        raise TunekitError(f"{key}: cannot read {path}: {e.strerror or e}") from None
    if not head.startswith(b"{") or not tail.endswith(b"}"):
        raise TunekitError(f"{key}: {path} is not a whole JSON object (truncated or corrupt?)")


_CHECKED: dict[tuple, dict] = {}


def check_model_folder(folder: Path, key: str = "model.path") -> dict:
    """config.json (valid, causal LM), weights (present, not truncated), a tokenizer. Returns config.

    Remembered per folder listing (names, sizes, mtimes): a run resolves its model several times."""
    try:
        memo = (str(folder.resolve()), key, tuple(sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns)
                                                        for e in os.scandir(folder))))
    except OSError:
        memo = None
    if memo in _CHECKED:
        return _CHECKED[memo]
    config = _check_model_folder(folder, key)
    if memo is not None:
        _CHECKED[memo] = config
    return config


def _check_model_folder(folder: Path, key: str) -> dict:
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise TunekitError(f"{key}: {folder} is a folder but has no config.json (not a HF model folder)")
    config = read_json(cfg_path, key)
    check_causal_config(config, str(cfg_path), key)
    check_weights(folder, key)
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise TunekitError(f"{key}: {folder} has no tokenizer (none of {', '.join(TOKENIZER_FILES[:3])}, ...); "
                           "save the model's tokenizer into the folder")
    if (folder / "tokenizer_config.json").is_file():
        read_json(folder / "tokenizer_config.json", key)
    if (folder / "tokenizer.json").is_file():
        _looks_whole(folder / "tokenizer.json", key)
    from tunekit.model.template import check_chat_templates

    check_chat_templates(folder, key)  # code that comes with the model: parsed, never rendered, here
    return config


def _hub_host() -> str:
    return urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co").hostname or "huggingface.co"


def check_hub_id(repo: str, key: str) -> None:
    """Fetch (or find in the local cache) the repo's config.json and check it is a causal LM.

    huggingface_hub retries an unreachable host for ~25 s, logging each try: a name lookup first
    answers "offline" at once.
    """
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    if not offline:
        try:
            socket.getaddrinfo(_hub_host(), 443)
        except OSError:
            offline = True
    from huggingface_hub import hf_hub_download

    try:
        cfg_file = hf_hub_download(repo, "config.json", local_files_only=offline)
    except Exception as e:  # not cached, no such repo, gated, network: all mean "cannot use this id"
        why = ("is not in the local hub cache, and the hub is out of reach (offline)" if offline
               else f"the Hugging Face hub refused it ({type(e).__name__})")
        raise TunekitError(f"{key}: {repo!r} is not a local folder, {why}; pass a local model folder") from None
    check_causal_config(read_json(Path(cfg_file), key), f"{repo} (config.json)", key)


def max_positions(config: dict) -> Optional[int]:
    """The longest sequence the model was built for, if its config says (names differ by family)."""
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = config.get(name)
        if isinstance(value, int) and value > 0:
            return value
    return None


_SKELETONS: dict = {}


def model_skeleton(path: str, key: str = "model.path"):
    """The model `path` holds, built on the meta device from its config.json: every module with its
    name and type, no weights, no memory, ~0.1 s. Methods check the modules they target against it
    before the real load. Cached per folder and config.json mtime."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg_file = Path(path) / "config.json"
    cache_key = (str(Path(path).resolve()), cfg_file.stat().st_mtime_ns)
    if cache_key not in _SKELETONS:
        try:
            config = AutoConfig.from_pretrained(path)
            with torch.device("meta"):
                _SKELETONS[cache_key] = AutoModelForCausalLM.from_config(config)
        except Exception as e:  # a config whose values transformers rejects (sizes, head counts, ...)
            raise TunekitError(f"{key}: transformers cannot build a model from {cfg_file}: {one_line(e)}") from None
    return _SKELETONS[cache_key]
