"""Optional ways a training step runs faster or in less memory, each behind its own switch.

Owns: per-example attention for packed rows with no (T x T) mask (packed_attention.py), activation
offloading to host memory on a side stream (offload.py), and torch.compile of the decoder layers,
checked against eager first (torch_compile.py). None changes what a step computes beyond rounding,
and nothing here changes what is saved. May import device, model and methods; not train, runs or
commands.
"""
