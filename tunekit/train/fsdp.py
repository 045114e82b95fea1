"""trainer.strategy=fsdp: the frozen base and the trained part sharded over the ranks (FSDP2).

PyTorch's FSDP2 (`torch.distributed.fsdp.fully_shard`; Zhao et al. 2023, "PyTorch FSDP") splits
every parameter along its first dimension into one shard per rank. Each decoder layer is one
unit: its weights are all-gathered just before the layer runs and freed after, and its gradients
are reduce-scattered in backward, so a rank holds 1/N of the base, of the trained tensors, of
their gradients and of the optimizer state, plus about two gathered layers at a time (on a CPU,
where the gathered weights are host memory, every frozen projection is a unit of its own and a rank
holds about two projections at a time: tunekit.device.facts.fsdp_projection_units). Untied
input embeddings and output head are a unit each, gathered only while they compute (a frozen head
not even then: the loss takes its vocabulary slices from the ranks one at a time,
tunekit.losses.sliced_head); everything else (final norm, a soft prompt, and a head tied to the
embeddings) is the root unit, gathered for a whole micro-batch. tunekit.plan.memory counts the
same ("gathered blocks (FSDP)").

What the training loop reaches through tunekit.train.strategy.FSDP2 (DDP runs never reach this module):

    shard(model)            after the method is applied: wrap, return the per-rank memory figures
    run(fn)                 run a forward (decoder + loss, an evaluation, the probe) inside the root unit
    collect_grads()         after backward: the shards' gradients, for the optimizer
    clip_grad_norm(max)     the global norm over all shards
    check_first_step(...)   loss exactly 0 or inf/nan at the first step: the known corruption, one error
    full_trained(model)     the full trained tensors in place of the shards on rank 0, for Method.save
    optimizer_to_save/load  every rank's own optimizer state in one checkpoint (JSON + safetensors)
    in_sync / summary       the end-of-run check and the per-rank memory figures

Why the pieces are as they are:

* Loss normalisation stays exact: each micro-batch's token-summed loss is divided by the trained
  tokens of the whole global batch (as under DDP), so the ranks' gradients must be *summed*.
  FSDP averages by default; every unit is set to divide by 1 with plain SUM collectives (gloo has
  no PREMUL_SUM). Gradients are reduce-scattered at every micro-batch and accumulate in the shards.
* tunekit runs the decoder and then the head on the trained positions only, never the model's own
  forward, so FSDP's root hooks would not fire. The model sits inside `_Root`, whose forward runs
  whatever callable it is given: the root gathers the outer weights for that call and its backward.
* The optimizer steps plain tensors that alias each rank's shard (same storage). bitsandbytes'
  optimizers have no DTensor rule ("Operator bitsandbytes.optimizer_update_32bit.default does not
  have a sharding strategy registered"); on plain shards every optimizer runs, and its state is
  per rank. 8-bit state is then quantized per shard, not per full tensor.
* A 4-bit base is loaded with its packed NF4 codes stored as bf16 (bitsandbytes' quant_storage,
  as in Answer.AI's fsdp_qlora): FSDP1 shards only floating-point tensors, and some FSDP2 releases
  failed on uint8 ones (github.com/huggingface/accelerate/issues/3983). The quantization state (absmax...) stays a module
  attribute, replicated, and bitsandbytes re-attaches it to the gathered weight at each forward.
  Known failure: FSDP2 on CUDA has been reported to canonicalise the NaN bit patterns that packed
  codes form when read as bf16 (github.com/bitsandbytes-foundation/bitsandbytes/issues/1945), which silently changes the weights
  (symptoms: loss 0, NaN gradients); whether it happens depends on the backend and the release,
  and gloo on the CPU keeps them. So the first forward compares every gathered 4-bit weight with a
  checksum taken before sharding, and the first step's loss and gradients are checked; either
  failure stops the run with one error line.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
from typing import Callable, Optional

import torch
import torch.nn as nn

from tunekit import TunekitError
from tunekit.device.facts import fsdp_projection_units
from tunekit.model.layers import decoder_layers, is_4bit
from tunekit.train.optim import load_state

log = logging.getLogger(__name__)

ISSUE = "FSDP2 over 4-bit weights stored as floats (github.com/bitsandbytes-foundation/bitsandbytes/issues/1945)"
CHECKSUM_CHUNK = 1 << 24  # bytes per slice of the first-forward checksum (an int64 copy of 128 MB at most)


def check_config(fused_lora: str, objective: str) -> None:
    """What trainer.strategy=fsdp refuses before anything loads (one line each)."""
    if fused_lora == "on":
        raise TunekitError("kernels.fused_lora: on is not supported with trainer.strategy=fsdp (the fused kernel "
                           "reads a layer's whole 4-bit weight and its quantization state, which FSDP shards and "
                           "re-gathers; it is untested there); use kernels.fused_lora=auto or off")
    if objective == "distill":
        raise TunekitError("trainer.strategy: fsdp does not run objective=distill (its chunked loss calls the "
                           "student's head once per chunk of a rank's own tokens, so ranks would gather a sharded "
                           "head different numbers of times and wait on each other, and the teacher would not be "
                           "sharded); use trainer.strategy=ddp")


def quant_storage(quantize: str, dtype: torch.dtype) -> Optional[torch.dtype]:
    """The dtype a sharded 4-bit base stores its packed codes in: bf16, as fsdp_qlora does. Any
    float dtype holds the same bytes (bitsandbytes dequantizes to the compute dtype `dtype`
    whatever the storage), and FSDP2, unlike FSDP1's flat parameters, gathers units of mixed
    dtypes, so the storage need not match the compute dtype."""
    return torch.bfloat16 if quantize == "nf4" else None


def outer_units(model: nn.Module) -> list[nn.Module]:
    """Input embeddings and output head as units of their own when they hold different weights
    (a tied pair stays in the root unit: one parameter cannot be in two units). Every rank must
    then call the head as often as the others in each forward: the SFT loss calls it once per
    micro-batch, whatever the batch holds."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if emb is None or head is None or getattr(emb, "weight", None) is getattr(head, "weight", None):
        return []
    return [emb, head]


def projection_units(layers: list[nn.Module]) -> list[nn.Module]:
    """The frozen projections of the decoder layers (2-D weights), in model order: the units of
    their own that a CPU rank gathers one at a time (tunekit.device.facts.fsdp_projection_units).
    Each is the outermost module that answers `.weight` with the projection's weight: peft's LoRA
    layer (its base_layer, A and B gathered together, so that every forward hook on it, the 4-bit
    checksum's too, sees the whole weight), else the Linear or Linear4bit itself. The norms stay in
    their layer's unit, small beside them."""
    out = []
    for layer in layers:
        inside: set[int] = set()
        for m in layer.modules():  # outermost first
            if id(m) in inside:
                continue
            w = getattr(m, "weight", None)
            if isinstance(w, nn.Parameter) and w.dim() == 2 and not w.requires_grad:
                out.append(m)
                inside.update(id(c) for c in m.modules())
    return out


def head_loss_route(model: nn.Module) -> str:
    """How the loss reaches the output head under FSDP (the SFT loss, tunekit.losses.sft, and the
    preference losses' log-probabilities, tunekit.losses.logps, alike): "slices" (a frozen
    untied head without bias, each rank's vocabulary rows broadcast in turn, never whole),
    "gathered" (whole for the loss, then let go), "own call" (a trained head, through FSDP's own
    gather) or "root unit" (tied to the embeddings)."""
    from tunekit.losses.sliced_head import frozen_head_slices

    units = outer_units(model)
    if not units:
        return "root unit"
    head = units[1]
    if head.weight.requires_grad or not hasattr(head, "unshard"):
        return "own call"
    return "slices" if frozen_head_slices(head) is not None else "gathered"


def _embedding_slices(model: nn.Module, decoder: nn.Module):
    """broadcast_slices of the embedding table where sliced_embeddings applies, else None."""
    from tunekit.losses.sliced_head import broadcast_slices

    units = outer_units(model)
    if not units:
        return None
    emb = units[0]
    # a plain lookup (FSDP made its class a subclass; one that scales in its own forward is not)
    plain = isinstance(emb, nn.Embedding) and type(emb).forward is nn.Embedding.forward and emb.max_norm is None
    if not plain or emb.weight.requires_grad or getattr(decoder, "get_input_embeddings", lambda: None)() is not emb:
        return None
    return broadcast_slices(emb.weight)


def sliced_embeddings(model: nn.Module, decoder: nn.Module, input_ids: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The decoder's input embeddings of `input_ids`, looked up in each rank's vocabulary slice in
    turn (a broadcast per rank), never the table gathered whole: an untied embedding unit gathered
    for its call holds, for a moment, the all-gather's buffer and the table, twice its size. Only a
    frozen plain nn.Embedding that the decoder itself reads (not prompt tuning's wrapper, not a
    scaled embedding class); None otherwise, and the decoder embeds as usual. Every rank calls this
    once per forward, as it runs the forward itself."""
    slices = _embedding_slices(model, decoder) if input_ids is not None else None
    if slices is None:
        return None
    out = None
    for lo, part in slices():
        if out is None:
            out = torch.zeros(*input_ids.shape, part.shape[1], dtype=part.dtype, device=input_ids.device)
        here = (input_ids >= lo) & (input_ids < lo + part.shape[0])
        out[here] = part[input_ids[here] - lo]
    if out is not None and (getattr(model, "_require_grads_hooks", None) or getattr(model, "_require_grads_hook", None)):
        out.requires_grad_(True)  # what the hook of enable_input_require_grads gives the module's output
    return out


def embedding_route(model: nn.Module) -> str:
    """How the training forward reaches the input embeddings under FSDP: "slices"
    (sliced_embeddings), "gathered" (the unit's own call) or "root unit" (tied to the head)."""
    from tunekit.model import decoder_and_head

    if not outer_units(model):
        return "root unit"
    return "slices" if _embedding_slices(model, decoder_and_head(model)[0]) is not None else "gathered"


def _quant_state_tensors(module: nn.Module) -> list[torch.Tensor]:
    state = getattr(module, "quant_state", None)
    if state is None:
        return []
    out = [state.absmax, state.code]
    if getattr(state, "nested", False):
        out += [state.state2.absmax, state.state2.code, state.offset]
    return [t for t in out if isinstance(t, torch.Tensor)]


def held_bytes(model: nn.Module) -> int:
    """Bytes of parameters, buffers and 4-bit quantization state this process holds for `model`
    (a DTensor counts its local shard only)."""
    from torch.distributed.tensor import DTensor

    total = 0
    seen: set[int] = set()
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) in seen:
            continue
        seen.add(id(t))
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.numel() * local.element_size()
    for m in model.modules():
        total += sum(t.numel() * t.element_size() for t in _quant_state_tensors(m) if id(t) not in seen)
    return total


def packed_checksum(t: torch.Tensor) -> tuple[int, int]:
    """(sum of bytes, position-weighted sum of bytes) of a tensor's raw storage, on its device.

    Any single changed byte changes both; several changes cancel out only by coincidence.
    """
    data = t.detach().contiguous().reshape(-1).view(torch.uint8)
    total = weighted = 0
    for start in range(0, data.numel(), CHECKSUM_CHUNK):
        part = data[start:start + CHECKSUM_CHUNK].to(torch.int64)
        pos = torch.arange(start, start + part.numel(), device=part.device, dtype=torch.int64) % 65521 + 1
        total += int(part.sum())
        weighted += int((part * pos).sum())
    return total, weighted


class _Root(nn.Module):
    """FSDP's root unit: holds the model, so that every weight outside the decoder layers forms one
    group, and runs the callable it is given inside its forward, so that the group is gathered for
    that call (and its backward) however the callable reaches the model's parts."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, fn: Callable, *args):
        return fn(*args)


class Sharded:
    """The FSDP2 state of one training run on this rank (see the module docstring)."""

    def __init__(self, device: torch.device, world_size: int, rank: int):
        self.device, self.world_size, self.rank = torch.device(device), world_size, rank
        self.root: Optional[nn.Module] = None
        self.sharded: list[nn.Parameter] = []  # the trained DTensor parameters, in model order
        self.local: list[nn.Parameter] = []  # plain parameters aliasing their shards: what the optimizer steps
        self.quantized = False
        self.full_bytes = self.rank_bytes = 0
        self.memory_after_shard_mb: Optional[float] = None
        self.stream = None  # the streamed base (tunekit.train.fsdp_load), when rank 0 read it for every rank
        self._checks: dict = {}  # layer name -> hook of the first-forward checksum comparison

    # Where the base loads: host memory, from which fully_shard moves each rank's shards onto its
    # device one layer at a time, so the whole base never sits on one device.
    load_device = torch.device("cpu")

    # ---------------------------------------------------------------- wrapping
    def shard(self, model: nn.Module, stream=None) -> str:
        """Wrap `model` (the method already applied) in place; returns the log line with its memory.
        stream: a tunekit.train.fsdp_load.StreamedBase whose base is still on the meta device; it is
        sharded so, then filled from rank 0's files."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FSDPModule, fully_shard
        from torch.distributed.tensor import DTensor

        layers = decoder_layers(model)
        if not layers:
            raise TunekitError(f"trainer.strategy=fsdp: found no decoder layers to shard in {type(model).__name__} "
                               "(transformers' _no_split_modules names none); use trainer.strategy=ddp")
        units = layers + outer_units(model)
        inner = projection_units(layers) if fsdp_projection_units(self.device.type, self.world_size) else []
        sums, plan = {}, None
        if stream is None:
            self.full_bytes = held_bytes(model)
            for name, m in model.named_modules():
                if is_4bit(m):
                    sums[name] = packed_checksum(m.weight)
        else:
            plan = stream.before_shard(model, self.device)
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        self.root = _Root(model)
        try:
            for unit in [*inner, *units]:  # innermost first: a unit takes the parameters no inner unit holds
                fully_shard(unit, mesh=mesh)
            fully_shard(self.root, mesh=mesh)
        except (AssertionError, ValueError, RuntimeError, NotImplementedError, TypeError) as e:
            raise TunekitError(f"trainer.strategy=fsdp: FSDP2 cannot shard this model ({type(e).__name__}: "
                               f"{str(e).strip().splitlines()[0][:200]}); use trainer.strategy=ddp") from None
        for m in self.root.modules():
            if isinstance(m, FSDPModule):  # sum, never average: the loss is already normalised globally
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)
        if inner and hasattr(self.root, "_set_unshard_async_op"):
            # each all-gather's buffer freed at its copy-out, not kept until the next unit's (FSDP2's
            # overlap of the two on a GPU's streams; on a CPU, one more projection held at a time)
            self.root._set_unshard_async_op(True)
        if stream is not None:  # the checksums of rank 0's packed codes
            by_module = stream.fill(self.root, plan, self.device)
            sums = {name: by_module[m] for name, m in model.named_modules() if m in by_module}
            self.full_bytes, self.stream = stream.full_bytes, stream
        self.quantized = bool(sums)
        if self.device.type != "cpu":  # fully_shard moved the shards; the 4-bit states stay module attributes
            for m in model.modules():
                if getattr(m, "quant_state", None) is not None:
                    m.quant_state.to(self.device)
        for name, m in model.named_modules():
            if name in sums:
                self._checks[name] = m.register_forward_pre_hook(self._checksum_hook(name, sums[name]))
        self.sharded = [p for p in model.parameters() if p.requires_grad]
        plain = [n for n, p in model.named_parameters() if p.requires_grad and not isinstance(p, DTensor)]
        if plain:  # cannot happen with the root over the whole model; a silent unreduced gradient would
            raise TunekitError(f"trainer.strategy=fsdp: {plain[0]} trains but was not sharded")
        with torch.no_grad():
            self.local = [nn.Parameter(p.to_local(), requires_grad=True) for p in self.sharded]
        self.rank_bytes = held_bytes(model)
        import gc

        from tunekit.device.facts import current_memory_mb

        gc.collect()  # the whole tensors the shards were cut from
        self.memory_after_shard_mb = current_memory_mb(self.device)
        outer = " + embeddings + head" if len(units) > len(layers) else ""
        return (f"fsdp: {len(layers)} decoder layers{outer} + the rest sharded over {self.world_size} ranks; "
                f"this rank holds {self.rank_bytes / 2**20:.1f} MiB of the model's {self.full_bytes / 2**20:.1f} MiB"
                + (" (4-bit codes stored as bf16; checked at the first forward)" if self.quantized else "")
                + (f"; {len(inner)} frozen projections gathered one at a time (CPU)" if inner else ""))

    def _checksum_hook(self, name: str, expected: tuple[int, int]):
        def hook(module, args):
            got = packed_checksum(module.weight)  # the gathered (unsharded) weight, just before use
            if got != expected:
                raise TunekitError(f"trainer.strategy=fsdp: the 4-bit weight of {name} differs after FSDP gathered "
                                   f"it (checksum {got} != {expected}): the known corruption of {ISSUE}; "
                                   "nothing was trained or saved; use trainer.strategy=ddp")
            self._checks.pop(name).remove()  # once is enough: every later gather runs the same code
        return hook

    # ---------------------------------------------------------------- a step
    def run(self, fn: Callable, *args):
        """fn(*args) inside the root unit's forward (its outer weights gathered). A no-grad call (an
        evaluation) frees them again at once; in training the root keeps them until backward ends."""
        out = self.root(fn, *args)
        if not torch.is_grad_enabled():
            self.root.reshard()
        return out

    @torch.no_grad()
    def collect_grads(self) -> None:
        """Point the optimizer's plain parameters at their shards and the shards' summed gradients."""
        for a, p in zip(self.local, self.sharded):
            a.data = p.to_local()  # FSDP may re-pad a shard once, at its first forward: follow it
            a.grad = None if p.grad is None else p.grad.to_local()

    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over the shards of every rank: the same global L2 norm
        (sqrt of the all-reduced sum of squared per-shard norms) and the same clip coefficient,
        applied as torch does, on the device (min(1, max_norm / norm): no host read). A non-finite
        norm makes the gradients non-finite too; the loop stops before any optimizer step sees them."""
        import torch.distributed as dist

        grads = [a.grad for a in self.local if a.grad is not None and a.grad.numel()]
        squares = torch.zeros((), device=self.device, dtype=torch.float32)
        if grads:
            squares = torch.stack([n.float() for n in torch._foreach_norm(grads, 2.0)]).pow(2).sum()
        dist.all_reduce(squares)
        total = squares.sqrt()
        if grads:
            torch._foreach_mul_(grads, (max_norm / (total + 1e-6)).clamp(max=1.0))
        return total

    def zero_grad(self) -> None:
        for p in self.sharded:
            p.grad = None

    def all_finite(self, params: list[torch.Tensor]) -> bool:
        """Every rank's shards finite: decided together, so that all ranks stop or none does."""
        import torch.distributed as dist

        from tunekit.train.strategy import finite_flag

        ok = finite_flag(params).to(device=self.device, dtype=torch.int32).reshape(1)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        return bool(ok.item())

    def check_first_step(self, step: int, loss: float, grad_norm: float) -> None:
        """The known silent failures of a corrupted sharded base show at once: a loss of exactly 0
        (no real model produces it on text) or inf/nan gradients. Every rank sees the same reduced
        values, so all stop together."""
        if loss == 0.0:
            what = "the training loss is exactly 0"
        elif not (math.isfinite(loss) and math.isfinite(grad_norm)):
            what = f"the training loss is {loss} and the gradient norm {grad_norm}"
        else:
            return
        cause = (f"the known symptom of {ISSUE}" if self.quantized
                 else "FSDP computed garbage (a sharding or dtype problem)")
        raise TunekitError(f"trainer.strategy=fsdp: step {step + 1}: {what}: {cause}; training stopped and nothing "
                           "was saved; use trainer.strategy=ddp")

    def missing_forwards(self, mine: int) -> int:
        """How many more forwards this rank must run to match the busiest (FSDP's all-gathers are
        collective: a rank with fewer held-out batches would leave the others waiting)."""
        import torch.distributed as dist

        n = torch.tensor([mine], device=self.device)
        dist.all_reduce(n, op=dist.ReduceOp.MAX)
        return int(n.item()) - mine

    # ---------------------------------------------------------------- full tensors
    @contextlib.contextmanager
    def full_trained(self, model: nn.Module):
        """Within: on rank 0 the model's trained parameters are plain full tensors (gathered from
        every rank), so that Method.save writes them and reads them back to verify; on exit the
        shards are put back. Collective: every rank enters. No forward, and no load_state_dict
        (FSDP's load hooks expect shards): a resumed adapter is loaded before sharding."""
        for m in self.root.modules():  # every unit sharded, so that state_dict hooks leave our swap alone
            if hasattr(m, "reshard"):
                m.reshard()
        keep = self.rank == 0
        fulls: dict[int, nn.Parameter] = {}
        with torch.no_grad():
            for p in self.sharded:  # one tensor at a time, kept in host memory on rank 0 only
                full = p.full_tensor()
                if keep:
                    fulls[id(p)] = nn.Parameter(full.cpu(), requires_grad=True)
                del full
        swapped = []
        for module in model.modules():
            for leaf, p in list(module._parameters.items()):
                if p is not None and id(p) in fulls:
                    module._parameters[leaf] = fulls[id(p)]
                    swapped.append((module, leaf, p))
        try:
            yield
        finally:
            for module, leaf, p in swapped:
                module._parameters[leaf] = p

    def in_sync(self) -> bool:
        """Each trained tensor exists once, sharded, so ranks cannot drift apart as replicas can;
        what is checked is that every rank gathers the same full tensors (what rank 0 saves)."""
        from accelerate.utils import gather_object

        h = hashlib.sha256()
        with torch.no_grad():
            for p in self.sharded:
                h.update(p.full_tensor().float().cpu().numpy().tobytes())
        digests = gather_object([h.hexdigest()])
        if len(set(digests)) != 1:
            log.error("ranks gather different trained weights: %s", digests)
            return False
        return True

    # ---------------------------------------------------------------- optimizer state
    def optimizer_to_save(self, optimizer) -> "_RankStates":
        """Every rank's own optimizer state (its shards' moments), gathered to rank 0 for the
        checkpoint. Collective. Rank 0 keeps its own state as it is (no pickled copy of it) and
        receives the others' one rank at a time. gather_object pickled and unpickled rank 0's own
        state too and received every rank's bytes into one buffer of world_size times the largest:
        rank 0's peak on two CPU ranks training LoRA on a 1.02B model, at its checkpoint, fell from
        1885 to 1784 MiB this way (benchmarks/training/fsdp-load-2026-11-27.md)."""
        import torch.distributed as dist

        def to_cpu(x):
            if isinstance(x, torch.Tensor):
                return x.detach().cpu()
            if isinstance(x, dict):
                return {k: to_cpu(v) for k, v in x.items()}
            if isinstance(x, (list, tuple)):
                return type(x)(to_cpu(v) for v in x)
            return x

        mine = to_cpu(optimizer.state_dict())
        if self.rank != 0:
            dist.send_object_list([mine], dst=0)
            return _RankStates(optimizer, self.rank, self.world_size, None)
        states = [mine]
        for r in range(1, self.world_size):
            box = [None]
            dist.recv_object_list(box, src=r)
            states.append(box[0])
        return _RankStates(optimizer, self.rank, self.world_size, states)

    def optimizer_to_load(self, optimizer) -> "_RankStates":
        return _RankStates(optimizer, self.rank, self.world_size, None)

    def summary(self, peak_mb: float) -> dict:
        """Per-rank figures for summary.json (collective): bytes held after sharding, peak memory."""
        from accelerate.utils import gather_object

        s = self.stream
        rows = gather_object([(self.rank_bytes, self.memory_after_shard_mb, peak_mb,
                               None if s is None else s.bytes_read, None if s is None else s.opens)])
        out = {"model_bytes": self.full_bytes, "rank_bytes": [r[0] for r in rows],
               "rank_memory_after_shard_mb": [None if r[1] is None else round(r[1], 1) for r in rows],
               "rank_peak_memory_mb": [round(r[2], 1) for r in rows], "base_streamed_from_rank_0": s is not None,
               "head_in_loss": None if self.root is None else head_loss_route(self.root.model),
               "embeddings_in_forward": None if self.root is None else embedding_route(self.root.model)}
        if s is not None:  # who read the weight files: rank 0 alone
            out["rank_weight_bytes_read"] = [r[3] for r in rows]
            out["rank_weight_file_opens"] = [r[4] for r in rows]
        return out


class _RankStates:
    """What the checkpoint sees of a sharded optimizer: {"world_size": N, "ranks": [state of rank 0,
    ...]}. Saving writes all of them (safetensors + JSON, like any optimizer state); loading gives
    each rank back its own. Resume on another number of ranks is refused before the model loads
    (tunekit.train.resume.world_size_change): the parts would not match the new ranks' shards."""

    def __init__(self, optimizer, rank: int, world_size: int, states: Optional[list]):
        self.optimizer, self.rank, self.world_size, self.states = optimizer, rank, world_size, states

    def state_dict(self) -> dict:
        return {"world_size": self.world_size, "ranks": self.states}

    def load_state_dict(self, state: dict) -> None:
        ranks = state.get("ranks") if isinstance(state, dict) else None
        if not isinstance(ranks, list) or len(ranks) != self.world_size:
            held = f"{len(ranks)} FSDP ranks" if isinstance(ranks, list) else "no FSDP ranks"
            raise ValueError(f"it holds the optimizer state of {held}, this run has {self.world_size} "
                             "(tunekit.train.resume.world_size_change refuses that before the model loads)")
        load_state(self.optimizer, ranks[self.rank])
