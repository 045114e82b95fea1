"""Load the frozen base: a local HF folder, the embedded default model, or a hub id; NF4 or not.

Owns checking a model folder's weights against its config before and after loading, the 4-bit
load through bitsandbytes, the tokenizer, and the model helpers every layer uses once
(decoder_layers, is_4bit). May import tunekit.device for device facts; nothing above it.
"""

from tunekit.model.default import default_model_dir
from tunekit.model.loader import (
    compute_dtype,
    decoder_and_head,
    load_base_model,
    load_tokenizer,
    prepare_for_training,
    quantized_bits_per_param,
    resolve_model_path,
)

__all__ = [
    "compute_dtype",
    "decoder_and_head",
    "default_model_dir",
    "load_base_model",
    "load_tokenizer",
    "prepare_for_training",
    "quantized_bits_per_param",
    "resolve_model_path",
]
