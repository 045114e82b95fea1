"""Activation offloading that overlaps compute: checkpointed blocks' inputs to host memory and back.

With gradient checkpointing a step keeps little more on the device than each decoder block's input;
offloading moves those to pinned host memory during the forward pass and brings them back for the
backward pass. torch's `save_on_cpu(pin_memory=True)` does the copies on the compute stream, so
every block's forward waits for its input to reach the host and every block's backward waits for
it to come back. Here the copies run on a side stream (as torchtune's activation offloading does):

* forward (pack): the side stream waits for the compute stream to have produced the tensor, copies
  it into a pinned host buffer, and the tensor is marked as in use by the side stream, so torch's
  caching allocator does not hand its memory to the compute stream before the copy has read it;
* backward (unpack): blocks come back in reverse order. Unpacking block k also starts the copy of
  block k-1 (the next one backward needs) on the side stream, so it travels while block k's
  backward computes; the compute stream waits only for the copy it is about to use.

Small tensors (under `MIN_BYTES`) and anything not on the GPU stay where they are: the copies and
their bookkeeping would cost more than they save.

The stream operations sit behind tunekit.device.facts.Streams (the one module that talks to
torch.cuda); on a CPU they are plain copies with nothing to overlap, which is how tests check, on any machine, that gradients are bit-identical with and
without offloading and that every tensor backward needs was prefetched but the first.
"""

from __future__ import annotations

from typing import Optional

import torch

from tunekit.device import facts as dev

MIN_BYTES = 1 << 20  # 1 MiB: a block input of Llama-3-8B at 2 x 2048 tokens is 32 MiB in bf16


class Offloader:
    """saved_tensors_hooks' pack and unpack for one forward + backward; enter it around the forward."""

    def __init__(self, device: torch.device, min_bytes: int = MIN_BYTES):
        self.device = torch.device(device)
        self.min_bytes = min_bytes
        self.streams = dev.Streams(self.device)
        self.host: dict[int, torch.Tensor] = {}  # handle -> pinned (or plain, on a CPU) host copy
        self.back: dict[int, tuple[torch.Tensor, Optional[object]]] = {}  # handle -> (device copy, ready event)
        self.next_handle = 0
        self.stats = {"offloaded": 0, "kept": 0, "prefetched": 0, "fetched_on_demand": 0}

    # ----------------------------------------------------------------------------- forward
    def pack(self, t: torch.Tensor):
        if t.device != self.device or t.numel() * t.element_size() < self.min_bytes or isinstance(t, torch.nn.Parameter):
            self.stats["kept"] += 1
            return ("kept", t)
        handle = self.next_handle
        self.next_handle += 1
        host = torch.empty(t.shape, dtype=t.dtype, layout=t.layout, pin_memory=self.streams.cuda)
        self.streams.side_waits_for_compute()
        with self.streams.on_side():
            host.copy_(t, non_blocking=self.streams.cuda)
        self.streams.keep_for_side(t)
        self.host[handle] = host
        self.stats["offloaded"] += 1
        return ("offloaded", handle)

    # ----------------------------------------------------------------------------- backward
    def _fetch(self, handle: int) -> None:
        """Start bringing `handle` back on the side stream (no-op if it is on its way or gone)."""
        if handle in self.back or handle not in self.host:
            return
        host = self.host.pop(handle)
        with self.streams.on_side():
            t = host.to(self.device, non_blocking=self.streams.cuda)
        self.back[handle] = (t, self.streams.mark())

    def unpack(self, packed):
        kind, value = packed
        if kind == "kept":
            return value
        handle = value
        if handle in self.back:
            self.stats["prefetched"] += 1
        else:
            self.stats["fetched_on_demand"] += 1
            self._fetch(handle)
        t, ready = self.back.pop(handle)
        self.streams.compute_waits_for(ready)
        self.streams.keep_for_compute(t)
        self._fetch(handle - 1)  # backward runs the blocks in reverse: the next one it needs
        return t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def offload_context(device: torch.device):
    """Autograd's saved tensors go to host memory (pinned where the device is a GPU) and come back
    when backward needs them. Around a checkpointed decoder that is each block's input: what a
    checkpointed block keeps while its insides are recomputed in backward. The copies run on a side
    stream and come back one block ahead of backward (tunekit.speed.offload)."""
    return Offloader(device).hooks()
