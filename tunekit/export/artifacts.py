"""Each export format as a pair: write(run, into) builds the artifact, reload(...) reads it back
the way its consumer will (peft / tunekit for adapters, transformers for HF folders, transformers'
GGUF loader for GGUF files), so the fidelity check measures what a user actually gets.
"""

from __future__ import annotations

import gc
import json
import logging
import shutil
from pathlib import Path

import torch
import torch.nn as nn

from tunekit import TunekitError
from tunekit.export.run import Run, load_base, trained_model

log = logging.getLogger("tunekit")
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _free(*models) -> None:
    del models
    gc.collect()


# ---------------------------------------------------------------- adapter
def write_adapter(run: Run, tokenizer, out_dir: Path) -> nn.Module:
    """method.save() of the rebuilt model + the run's tokenizer. Returns the rebuilt (trained)
    model: saving does not touch it, so it doubles as the fidelity reference."""
    model = trained_model(run)
    run.method.save(model, out_dir)
    tokenizer.save_pretrained(out_dir)
    return model


def reload_adapter(run: Run, folder: Path) -> nn.Module:
    """A peft-format folder (adapter_config.json has peft_type) through peft.PeftModel on a freshly
    loaded base; a tunekit-only format (bottleneck adapters, BitFit) through tunekit's method.load."""
    config = json.loads((folder / "adapter_config.json").read_text())
    if "peft_type" not in config:
        return trained_model(run, adapter_dir=folder)
    from peft import PeftModel

    return PeftModel.from_pretrained(load_base(run), folder).eval()


# ---------------------------------------------------------------- merged
def merged_model(run: Run) -> nn.Module:
    """method.merge() of a freshly rebuilt model: plain transformers model, fp32 over a 4-bit base
    (dequantized from the packed NF4 codes the adapter trained against, never re-quantized)."""
    if not run.method.can_merge:
        from tunekit.methods import cannot_merge

        raise cannot_merge(run.cfg.method.name)  # "... export the adapter instead (--format adapter)"
    return run.method.merge(trained_model(run))


def _clean_config(model: nn.Module, dtype: torch.dtype) -> None:
    """Nothing of the training setup may leak into config.json: a stale quantization_config would
    make transformers try to load plain weights as 4-bit."""
    cfg = model.config
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(cfg, attr):
            delattr(cfg, attr)
    cfg.dtype = dtype
    cfg.use_cache = True


def write_merged(run: Run, tokenizer, out_dir: Path, dtype: str) -> None:
    """A standalone HF folder: model.safetensors (in `dtype`), config.json, generation_config.json, tokenizer."""
    model = merged_model(run).to(TORCH_DTYPES[dtype])
    _clean_config(model, TORCH_DTYPES[dtype])
    model.save_pretrained(out_dir, safe_serialization=True)
    if not (out_dir / "generation_config.json").is_file():
        from transformers import GenerationConfig

        GenerationConfig.from_model_config(model.config).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    _free(model)


def reload_merged(folder: Path) -> nn.Module:
    """As a consumer loads it: plain transformers, stored dtype; bitsandbytes when config asks for it."""
    from transformers import AutoModelForCausalLM

    cfg = json.loads((folder / "config.json").read_text())
    if "quantization_config" not in cfg:
        return AutoModelForCausalLM.from_pretrained(folder, dtype="auto").eval()
    from tunekit.model.loader import keep_bnb_layout

    model = AutoModelForCausalLM.from_pretrained(folder, dtype="auto", device_map="cpu")
    # Same 4-bit math as training measured it: no bitsandbytes CPU repack on eval forwards (TRAPS.md).
    keep_bnb_layout(model)
    return model.eval()


def write_requantized_nf4(run: Run, tokenizer, out_dir: Path, dtype: str) -> None:
    """Merged weights re-quantized to NF4 + double quant (bitsandbytes), as a HF folder with its
    quantization_config. Built the way a consumer would quantize the merged folder: the merged
    model is saved in `dtype` to a scratch folder and loaded back through transformers'
    bitsandbytes integration (lm_head kept in high precision, as in training), then saved."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    scratch = out_dir / ".merged-scratch"
    write_merged(run, tokenizer, scratch, dtype)
    torch_dtype = TORCH_DTYPES[dtype]
    qcfg = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=run.dtype, llm_int8_skip_modules=["lm_head"])
    model = AutoModelForCausalLM.from_pretrained(scratch, quantization_config=qcfg, dtype=torch_dtype, device_map="cpu")
    shutil.rmtree(scratch)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    _free(model)


# ---------------------------------------------------------------- gguf
def write_gguf_file(run: Run, tokenizer, path: Path, dtype: str) -> None:
    from tunekit.export.gguf import write_gguf

    model = merged_model(run)
    write_gguf(model, tokenizer, path, dtype, name=f"{Path(run.model_path).name}-{run.cfg.method.name}")
    _free(model)


def reload_gguf(path: Path) -> nn.Module:
    """transformers' GGUF loader (an independent reader: dequantizes, undoes the q/k interleave)."""
    import contextlib
    import io

    from transformers import AutoModelForCausalLM

    # transformers draws a tqdm bar per GGUF load that its progress-bar switch does not reach;
    # our log lines go through logging's handler (bound to the real stderr), not sys.stderr.
    with contextlib.redirect_stderr(io.StringIO()):
        return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def reload_tokenizer(folder: Path, gguf_file: str | None = None):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file) if gguf_file else AutoTokenizer.from_pretrained(folder)


def tokenizer_agreement(reference, exported, batches: list[dict]) -> float:
    """Fraction of held-out texts that the exported tokenizer encodes to the same ids as the run's.

    Logit comparisons feed token ids, so they cannot see a broken vocabulary or merge list; this can.
    """
    same = total = 0
    for batch in batches:
        for ids, mask in zip(batch["input_ids"], batch["attention_mask"]):
            text = reference.decode(ids[mask.bool()].tolist(), skip_special_tokens=False)
            a = reference(text, add_special_tokens=False)["input_ids"]
            b = exported(text, add_special_tokens=False)["input_ids"]
            same += a == b
            total += 1
    if total == 0:
        raise TunekitError("export: the held-out split is empty; nothing to check the export against")
    return same / total
