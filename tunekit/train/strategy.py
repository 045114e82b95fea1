"""How a run spreads over its processes: one interface, two strategies, chosen once per run.

The training loop (tunekit.train.loop) asks the same questions of every run and never which
strategy answers them:

    load_device, storage_dtype   where the base loads, and the dtype its 4-bit codes are stored in
    stream_base(...)             FSDP: the base as a meta skeleton that rank 0 streams in at wrap (or None)
    offload_activations(...)     whether checkpointed blocks' inputs go to host memory
    choose_lora_backend(...)        the LoRA compute path every rank takes
    wrap(model)                  after the method is applied: the tensors the optimizer steps
    run(fn, *args)               every forward (training, evaluation, the probe) goes through it
    reduce_grads(params)         once after the last micro-batch's backward: the summed gradients
    clip_grad_norm / all_finite  over the whole model, the same verdict on every rank
    check_first_step(...)        the strategy's own known failures, at the first step
    zero_grad(optimizer)         after the optimizer step
    missing_forwards(n)          filler forwards a rank runs so that collective forwards pair up
    forwards_are_collective      True where every rank must run every forward (the task probe too)
    full_trained(model)          the full trained tensors in the model on rank 0, for Method.save
    optimizer_to_save/_load      what the checkpoint writes and reads as the optimizer state
    in_sync / summary            the end-of-run check, and the strategy's own summary.json figures
    barrier, broadcast, sum,     the collectives the loop itself runs (identical in both strategies;
    gather, least                one process: no-ops)

`SingleOrDDP`: one process, or data parallelism by hand. Every rank holds the whole model;
gradient accumulation needs no `no_sync`, since nothing is reduced until `reduce_grads` sums the
trained tensors' gradients once per step, after the last micro-batch (a few MB: an adapter).

`FSDP2`: trainer.strategy=fsdp on several ranks; the model sharded over them (tunekit.train.fsdp,
whose `Sharded` does the work). Gradients are reduce-scattered into the shards at every micro-batch's
backward, summed, never averaged: the loss is already normalised over the global batch.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from abc import ABC, abstractmethod
from typing import Any, Callable, ContextManager, Optional

import torch
import torch.nn as nn

from tunekit import TunekitError
from tunekit.device import allocator
from tunekit.device import facts as dev
from tunekit.methods.lora.backend import FusedDecision, agree_on_backend, broadcast_from_rank0, choose_lora_backend

log = logging.getLogger(__name__)


class Strategy(ABC):
    """The interface the loop trains through (module docstring). `acc` is the run's Accelerator,
    which started the process group; `device` this rank's device."""

    def __init__(self, acc, device: torch.device):
        self.acc, self.device = acc, torch.device(device)
        self.world_size, self.rank = acc.num_processes, acc.process_index

    @abstractmethod
    def describe(self) -> str:
        """The log line naming the strategy, once per run."""

    # ---------------------------------------------------------------- the model
    load_device: torch.device

    @abstractmethod
    def storage_dtype(self, quantize: str, dtype: torch.dtype) -> Optional[torch.dtype]:
        """The dtype 4-bit codes are stored in (None: bitsandbytes' own uint8)."""

    def stream_base(self, path: str, quantize: str, dtype: torch.dtype, method_name: str, method, method_cfg):
        """None: every rank loads the base itself (tunekit.model.load_base_model). Otherwise the
        base's structure on the meta device, which `wrap` fills from rank 0's reads (FSDP)."""
        return None

    @abstractmethod
    def offload_activations(self, setting, facts: dev.DeviceFacts, checkpointing: bool) -> bool:
        """model.offload_activations resolved for this run."""

    @abstractmethod
    def choose_lora_backend(self, model: nn.Module, setting: str, facts: dev.DeviceFacts,
                         dtype: torch.dtype) -> FusedDecision:
        """kernels.fused_lora resolved, applied to `model` and the same on every rank."""

    @abstractmethod
    def wrap(self, model: nn.Module) -> list[nn.Parameter]:
        """Make `model` (the method applied, a resumed adapter loaded) this strategy's; returns the
        tensors the optimizer steps."""

    # ---------------------------------------------------------------- a step
    forwards_are_collective: bool

    @abstractmethod
    def run(self, fn: Callable, *args) -> Any:
        """fn(*args): a forward (and what it computes), as this strategy must run it."""

    def decoder_inputs(self, model: nn.Module, decoder: nn.Module, inputs: dict) -> dict:
        """The keyword arguments of the decoder's forward for `inputs` (model_inputs of a batch): as
        they are, unless the strategy embeds the tokens itself (FSDP's sliced lookup)."""
        return inputs

    @abstractmethod
    def reduce_grads(self, params: list[nn.Parameter]) -> None:
        """After the last micro-batch's backward: every param's .grad is the sum over all ranks."""

    @abstractmethod
    def clip_grad_norm(self, params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
        """Clip to max_norm as torch.nn.utils.clip_grad_norm_ over the whole model; returns the norm as
        a 0-dim tensor on the device, unread (the loop reads it with the loss, in one transfer)."""

    @abstractmethod
    def check_first_step(self, step: int, loss: float, grad_norm: float) -> None:
        """Raise TunekitError on this strategy's known silent failures, seen at the first step."""

    @abstractmethod
    def zero_grad(self, optimizer) -> None:
        """Drop every gradient after the optimizer step."""

    @abstractmethod
    def all_finite(self, params: list[nn.Parameter]) -> bool:
        """Whether the trained tensors are finite, the same answer on every rank."""

    @abstractmethod
    def missing_forwards(self, mine: int) -> int:
        """How many filler forwards this rank runs beside its `mine` evaluation batches."""

    # ---------------------------------------------------------------- saving
    @abstractmethod
    def full_trained(self, model: nn.Module) -> ContextManager:
        """Within: rank 0's model holds the full trained tensors (Method.save). Every rank enters."""

    @abstractmethod
    def optimizer_to_save(self, optimizer):
        """What the checkpoint saves as the optimizer (its state_dict()). Every rank calls it."""

    @abstractmethod
    def optimizer_to_load(self, optimizer):
        """What the checkpoint loads the saved optimizer state into (its load_state_dict())."""

    @abstractmethod
    def in_sync(self, params: list[nn.Parameter]) -> bool:
        """Whether every rank ends with the same trained weights (a desync is logged as an error)."""

    @abstractmethod
    def summary(self, peak_mb: float) -> dict:
        """This strategy's entries of summary.json (collective)."""

    # ---------------------------------------------------------------- collectives, the same for both
    def barrier(self) -> None:
        self.acc.wait_for_everyone()

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` (picklable) on every rank."""
        return obj if self.world_size == 1 else broadcast_from_rank0(obj)

    def broadcast_tensors(self, tensors: dict) -> None:
        """Overwrite every rank's tensors ({name: tensor}, the same names, shapes and dtypes on every
        rank) with rank 0's, bit for bit, one at a time through this rank's device (NCCL sends device
        tensors; an FSDP base waits in host memory). Shapes that differ stop every rank with one line."""
        if self.world_size == 1:
            return
        import torch.distributed as dist

        layout = [(n, tuple(t.shape), str(t.dtype)) for n, t in tensors.items()]
        theirs = self.broadcast(layout)
        same = torch.tensor([int(theirs == layout)], device=self.device)
        dist.all_reduce(same, op=dist.ReduceOp.MIN)
        if not same.item():
            odd = next((a, b) for a, b in zip(theirs + [None] * len(layout), layout + [None] * len(theirs)) if a != b)
            raise TunekitError(f"rank 0's start does not fit the model of every rank (rank 0: {odd[0]}, "
                               f"rank {self.rank}: {odd[1]})" if theirs != layout else
                               "rank 0's start does not fit the model of another rank")
        with torch.no_grad():
            for t in tensors.values():
                buf = t.to(self.device).contiguous()
                dist.broadcast(buf, src=0)
                if buf.data_ptr() != t.data_ptr():
                    t.copy_(buf)

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of `t` over the ranks (a new tensor)."""
        return self.acc.reduce(t, reduction="sum")

    def sum_counts(self, counts: list[int]) -> list[int]:
        """Host integers summed over the ranks: one all-reduce and one read with several ranks, none
        with one (the counts never leave the host)."""
        if self.world_size == 1:
            return list(counts)
        return [int(v) for v in self.sum(torch.tensor(counts, device=self.device)).tolist()]

    def gather(self, obj: Any) -> list:
        """Every rank's `obj`, in rank order, on every rank."""
        from accelerate.utils import gather_object

        return gather_object([obj])

    def least(self, n: int) -> int:
        """The smallest of every rank's n."""
        return int(self.acc.gather(torch.tensor([n], device=self.device)).min())


def finite_flag(tensors: list[torch.Tensor]) -> torch.Tensor:
    """A 0-dim bool tensor, unread: every element of every tensor is finite.

    One multi-tensor L2 norm over the list instead of an isfinite check and a host read per tensor
    (an 8B model with LoRA on every projection trains 448 tensors: 448 device-to-host waits a step).
    A NaN or inf anywhere makes its tensor's norm NaN or inf. The norm accumulates in fp64, where no
    finite fp32 tensor can overflow it (numel * (3.4e38)^2 < 1.8e308 for any numel below 1e231), so
    large but finite weights read as finite, as an element-wise check would say.
    """
    tensors = [t.detach() for t in tensors]
    if not tensors:
        return torch.ones((), dtype=torch.bool)
    return torch.stack(torch._foreach_norm(tensors, 2.0, dtype=torch.float64)).isfinite().all()


def choose_strategy(setting: str, acc, device: torch.device) -> Strategy:
    """trainer.strategy and the process facts -> the run's strategy: FSDP2 for fsdp on several
    ranks, else SingleOrDDP (fsdp in one process has nothing to shard)."""
    if setting == "fsdp" and acc.num_processes > 1:
        return FSDP2(acc, device)
    return SingleOrDDP(acc, device, asked=setting)


class SingleOrDDP(Strategy):
    """One process, or every rank holding the whole model with the trained gradients summed by hand."""

    forwards_are_collective = False

    def __init__(self, acc, device: torch.device, asked: str = "ddp"):
        super().__init__(acc, device)
        self.asked = asked
        self.load_device = self.device

    def describe(self) -> str:
        if self.world_size > 1:
            return (f"strategy: ddp over {self.world_size} ranks (each holds the whole model; the trained "
                    "tensors' gradients are summed once per step)")
        if self.asked == "fsdp":
            return "trainer.strategy=fsdp with one process: nothing to shard, training as a single process"
        return "strategy: one process"

    def storage_dtype(self, quantize: str, dtype: torch.dtype) -> Optional[torch.dtype]:
        return None

    def offload_activations(self, setting, facts: dev.DeviceFacts, checkpointing: bool) -> bool:
        return dev.offload_activations(setting, facts, checkpointing)

    def choose_lora_backend(self, model, setting, facts, dtype) -> FusedDecision:
        # every rank takes rank 0's path (its own proof's timings could differ)
        return agree_on_backend(choose_lora_backend(model, setting, facts, dtype), self.broadcast, model)

    def wrap(self, model: nn.Module) -> list[nn.Parameter]:
        return [p for p in model.parameters() if p.requires_grad]

    def run(self, fn: Callable, *args) -> Any:
        return fn(*args)

    def reduce_grads(self, params: list[nn.Parameter]) -> None:
        """One all-reduce of every trained gradient, flattened into one tensor."""
        if self.world_size == 1:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = self.sum(torch.cat([g.reshape(-1) for g in grads]))
        offset = 0
        for p, g in zip(params, grads):
            n = g.numel()
            p.grad = flat[offset : offset + n].view_as(p).to(p.dtype)
            offset += n

    def clip_grad_norm(self, params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def check_first_step(self, step: int, loss: float, grad_norm: float) -> None:
        """Nothing of its own: the loop's inf/nan check covers every step."""

    def zero_grad(self, optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)

    def all_finite(self, params: list[nn.Parameter]) -> bool:
        """Every rank holds the same weights (reduced gradients, same step): a local answer, one read."""
        return bool(finite_flag(params))

    def missing_forwards(self, mine: int) -> int:
        return 0

    def full_trained(self, model: nn.Module) -> ContextManager:
        return contextlib.nullcontext()

    def optimizer_to_save(self, optimizer):
        return optimizer

    def optimizer_to_load(self, optimizer):
        return optimizer

    def in_sync(self, params: list[nn.Parameter]) -> bool:
        """Replicas must end bit-identical; a desync is a bug, say so."""
        h = hashlib.sha256()
        for p in params:
            h.update(p.detach().float().cpu().numpy().tobytes())
        digests = self.gather(h.hexdigest())
        if len(set(digests)) != 1:
            log.error("ranks disagree on the trained weights: %s", digests)
            return False
        return True

    def summary(self, peak_mb: float) -> dict:
        return {}


class FSDP2(Strategy):
    """trainer.strategy=fsdp on several ranks: tunekit.train.fsdp.Sharded behind the interface."""

    forwards_are_collective = True  # each forward all-gathers weights from every rank

    def __init__(self, acc, device: torch.device):
        from tunekit.train.fsdp import Sharded

        import torch.distributed as dist

        super().__init__(acc, device)
        # On a CPU each step gathers and frees every layer's weights in host memory: freed blocks
        # must leave the process (tunekit.device.allocator; they stayed resident, 2 GB on rank 1 of
        # a 1B model). Set here, the first step of a run's setup: blocks placed before it stay where
        # glibc put them (set at wrap instead, each rank of the 1B run held 50-100 MB more). Only in
        # a process that is one rank of several (a test's own process keeps glibc's default: the
        # setting is for life), and not on GPUs, whose gathers do not touch host memory.
        world = dist.get_world_size() if dist.is_initialized() else 1
        self.returns_large_frees = (allocator.needs_returned_frees(self.device.type, world)
                                    and allocator.return_large_frees())
        self.sharded = Sharded(self.device, self.world_size, self.rank)
        self.load_device = self.sharded.load_device  # host memory: sharding moves each rank's part
        self.stream = None

    def stream_base(self, path, quantize, dtype, method_name, method, method_cfg):
        """Rank 0 alone reads the base, one unit at a time, at `wrap` (tunekit.train.fsdp_load); where
        that cannot work, every rank loads it itself and one line says why."""
        from tunekit.train.fsdp_load import open_streamed

        self.stream, line = open_streamed(path, quantize, dtype, self.storage_dtype(quantize, dtype), method_name,
                                          method, method_cfg, self)
        log.info(line)
        return self.stream

    def describe(self) -> str:
        return f"strategy: fsdp over {self.world_size} ranks (FSDP2: every rank holds 1/{self.world_size} of the model)"

    def storage_dtype(self, quantize: str, dtype: torch.dtype) -> Optional[torch.dtype]:
        from tunekit.train.fsdp import quant_storage

        return quant_storage(quantize, dtype)

    def offload_activations(self, setting, facts: dev.DeviceFacts, checkpointing: bool) -> bool:
        return dev.offload_activations(setting, facts, checkpointing, sharded=True)

    def choose_lora_backend(self, model, setting, facts, dtype) -> FusedDecision:
        return FusedDecision(setting, "peft", "trainer.strategy=fsdp")

    def wrap(self, model: nn.Module) -> list[nn.Parameter]:
        """Shard `model` in place; the optimizer steps plain tensors aliasing this rank's shards."""
        log.info(self.sharded.shard(model, self.stream))
        return self.sharded.local

    def run(self, fn: Callable, *args) -> Any:
        return self.sharded.run(fn, *args)

    def decoder_inputs(self, model: nn.Module, decoder: nn.Module, inputs: dict) -> dict:
        """A frozen untied embedding's lookup from the ranks' vocabulary slices, never the table
        gathered whole (tunekit.train.fsdp.sliced_embeddings); where it does not apply, as they are."""
        from tunekit.train.fsdp import sliced_embeddings

        embeds = sliced_embeddings(model, decoder, inputs.get("input_ids"))
        if embeds is None:
            return inputs
        return {**{k: v for k, v in inputs.items() if k != "input_ids"}, "inputs_embeds": embeds}

    def reduce_grads(self, params: list[nn.Parameter]) -> None:
        """FSDP summed every micro-batch's gradients into the shards in backward: collect them."""
        self.sharded.collect_grads()

    def clip_grad_norm(self, params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
        return self.sharded.clip_grad_norm(max_norm)

    def check_first_step(self, step: int, loss: float, grad_norm: float) -> None:
        self.sharded.check_first_step(step, loss, grad_norm)

    def zero_grad(self, optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)
        self.sharded.zero_grad()

    def all_finite(self, params: list[nn.Parameter]) -> bool:
        return self.sharded.all_finite(params)

    def missing_forwards(self, mine: int) -> int:
        return self.sharded.missing_forwards(mine)

    def full_trained(self, model: nn.Module) -> ContextManager:
        return self.sharded.full_trained(model)

    def optimizer_to_save(self, optimizer):
        return self.sharded.optimizer_to_save(optimizer)

    def optimizer_to_load(self, optimizer):
        return self.sharded.optimizer_to_load(optimizer)

    def in_sync(self, params: list[nn.Parameter]) -> bool:
        return self.sharded.in_sync()

    def summary(self, peak_mb: float) -> dict:
        return {"fsdp": {**self.sharded.summary(peak_mb), "host_returns_freed_blocks": self.returns_large_frees}}
