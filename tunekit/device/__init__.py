"""The device: its facts and every decision made from them, the precision policy, and threads.

Owns: what a device is (kind, index, compute capability, memory) and the decisions taken from those
facts as plain functions, so tests can ask them about `cuda:1` or sm_75 on a CPU (facts.py, the
one module that talks to torch.cuda: memory readers, random-number state, streams); which dtype each
part of a model computes and is stored in (precision.py); thread settings (threads.py); how the host
allocator returns freed memory (allocator.py).
Imports nothing of tunekit but its error type: every other room may import it.
"""
