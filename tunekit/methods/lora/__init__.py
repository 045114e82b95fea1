"""LoRA and its family, in one folder: the method (method.py: how it applies, saves, merges and
plans), its keys (config.py), its variants (variants.py: DoRA, rsLoRA, PiSSA/OLoRA starts, LoRA+),
the LoftQ start (loftq.py, its saved start in loftq_io.py), and how its layers compute (backend.py:
peft + bitsandbytes, the compute-dtype torch route of compute_dtype.py, or the fused Triton kernel
of tunekit_kernels, chosen and checked once per run).

Importing this package registers the method and stays cheap (no torch at import time).
"""

from tunekit.methods.lora.config import LoRAConfig
from tunekit.methods.lora.method import (LoRA, LoRAPlan, check_not_head, check_targets, dequantized_linear,  # noqa: F401
                                         peft_config, replace_module, to_plain_model)

__all__ = ["LoRA", "LoRAConfig", "LoRAPlan", "check_not_head", "check_targets", "peft_config"]
