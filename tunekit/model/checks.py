"""The `model.*` keys' values, checked before anything loads (the folders they name are checked
with the method's targets in tunekit.train.checks, which sees both). Called by
tunekit.train.checks.validate."""

from __future__ import annotations

from tunekit.checks import one_of, text
from tunekit.config import DType, ModelConfig, Quantize, plain


def check_model_values(m: ModelConfig) -> None:
    text("model.path", m.path, "a model folder, or null for the default model")
    one_of("model.quantize", plain(m.quantize), [q.value for q in Quantize])
    one_of("model.dtype", plain(m.dtype), [x.value for x in DType])
    text("model.adapter", m.adapter, "a tunekit run folder or a LoRA adapter folder, or null")
