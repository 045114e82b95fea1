"""How fast and in which precision: device facts, the precision policy, and the compute paths.

Owns: the facts of a device (kind, index, compute capability, memory) and every decision made
from them as plain functions (device.py); which dtype each part computes and is stored in
(precision.py); thread settings (threads.py); how a LoRA layer computes - peft + bitsandbytes,
plain torch, or the fused Triton kernel - chosen and checked once (lora_path.py, lora_math.py);
and torch.compile of the decoder layers (torch_compile.py). Nothing here changes what is saved.
May import tunekit_kernels, methods (to find adapter layers) and model; not train, runs or commands.
"""
