"""trainer.strategy=fsdp: the base read once per node, by rank 0, one unit at a time.

Without this, every FSDP rank would load (and for a 4-bit base, quantize) the whole base into host
memory and `fully_shard` would then cut its shards: N copies and N times the quantization work.
Here:

* Every rank builds the model's structure on the meta device (`from_config`, no weights, no
  memory), with the same 4-bit layer replacement as the loader (bitsandbytes `Linear4bit`, codes
  stored as bf16 in the packed shape, tunekit.train.fsdp) and the method applied. What the method
  creates (LoRA's A and B) is made in host memory as peft makes it, from the same random stream;
  rank 0's values, or a resumed adapter loaded into them, are sent to every rank.
* The model is sharded while its base is still on the meta device; each rank then allocates its
  own shards only.
* Rank 0 alone reads the weight files, one unit at a time (a decoder layer; then each other tensor
  alone: embeddings, head, final norm) with plain file reads (no memory map, whose pages would count in
  its resident memory until closed), checks that every tensor is finite, quantizes the unit's
  4-bit weights exactly as transformers' loader does (the same bitsandbytes call on the same
  values), and sends each rank its slice of every tensor (a scatter along the first dimension, as
  FSDP2 cuts it). The 4-bit quantization state (absmax, code, the nested state: small) and the
  checksum of each packed weight go to every rank with the unit; the first forward compares the
  gathered weights with those checksums (tunekit.train.fsdp).
* A missing, unexpected or misshapen tensor is refused before anything loads with the single-process
  loader's own check and message (tunekit.model.folder.check_weights_match), decided on rank 0 and
  raised on every rank; a non-finite tensor stops every rank at its unit.

Host memory a node holds (CPU training: the shards live in host memory; on GPUs they go to the
device and only the unit in transit stays in host memory):

    host per node = ranks_per_node x shard_bytes + largest_unit_bytes  (+ each process's own baseline)

shard_bytes: one rank's share of the base and the trained tensors (about total / world size);
largest_unit_bytes: the largest unit's tensors in the compute dtype as rank 0 holds them while it
quantizes and sends them, plus their packed 4-bit codes (tunekit.plan.host.host_bytes_per_node).

Not streamed (every rank loads the base itself, as DDP does; one log line says why): a start
computed from the base's weights (LoRA's init=loftq|pissa|olora), DoRA (its magnitude is computed
from the weights at apply time), methods other than LoRA, pickle or pre-quantized checkpoints, and
weight files whose names need transformers' renaming.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import struct
import sys
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn

from tunekit import TunekitError

log = logging.getLogger(__name__)

DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}

# ---------------------------------------------------------------- who opened the weight files
_WATCHED: dict[str, int] = {}  # absolute path of a weight file -> opens seen in this process while watched
_HOOKED = False


def _audit(event: str, args) -> None:
    if event != "open" or not _WATCHED:
        return
    try:
        path = os.path.abspath(os.fsdecode(args[0]))
    except (TypeError, ValueError):
        return  # a file descriptor
    if path in _WATCHED:
        _WATCHED[path] += 1


@contextlib.contextmanager
def watch_opens(files: list[Path]):
    """Count the opens of `files` by any Python code of this process while inside (an audit hook:
    open(), io, os.open; tunekit's header checks and loaders all open through Python). Yields a
    callable giving the count so far."""
    global _HOOKED
    if not _HOOKED:
        sys.addaudithook(_audit)  # cannot be removed: idle while nothing is watched
        _HOOKED = True
    paths = {os.path.abspath(f) for f in files} | {os.path.realpath(f) for f in files}
    for p in paths:
        _WATCHED[p] = 0
    try:
        yield lambda: sum(_WATCHED.get(p, 0) for p in paths)
    finally:
        for p in paths:
            _WATCHED.pop(p, None)


# ---------------------------------------------------------------- reading, one tensor at a time
class WeightFiles:
    """The safetensors files of a folder, read tensor by tensor with plain reads."""

    def __init__(self, folder: Path, key: str):
        index = folder / "model.safetensors.index.json"
        files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() \
            else ["model.safetensors"]
        self.where: dict[str, tuple] = {}
        self.bytes_read = 0
        for name in files:
            path = folder / name
            with path.open("rb") as f:
                n = struct.unpack("<Q", f.read(8))[0]
                header = json.loads(f.read(n))
            for tensor, v in header.items():
                if tensor == "__metadata__":
                    continue
                if v["dtype"] not in DTYPES:
                    raise TunekitError(f"{key}: {path}: tensor {tensor} has dtype {v['dtype']}, which tunekit's "
                                       "sharded loader does not read")
                start, end = v["data_offsets"]
                self.where[tensor] = (path, DTYPES[v["dtype"]], list(v["shape"]), 8 + n + start, end - start)

    def read(self, name: str) -> torch.Tensor:
        path, dtype, shape, offset, size = self.where[name]
        buf = bytearray(size)
        with path.open("rb") as f:
            f.seek(offset)
            got = f.readinto(buf)
        if got != size:
            raise TunekitError(f"model.path: {path} is truncated (tensor {name})")
        self.bytes_read += size
        if size == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(shape)


def weight_files(folder: Path) -> list[Path]:
    """Every file of the folder that holds weights (what rank 1 must never open)."""
    return sorted(p for p in folder.iterdir() if p.suffix in (".safetensors", ".bin", ".pt", ".pth"))


# ---------------------------------------------------------------- which runs stream
def not_streamed_because(method_name: str, method, method_cfg) -> Optional[str]:
    """Why this method cannot start on a meta-device base (None: it can)."""
    if method_name != "lora":
        return f"method.name={method_name} (only LoRA is applied to a base on the meta device)"
    c = method.settings(method_cfg)
    if method.computes_start(method_cfg):
        return f"method.init={c.init} computes its start from the base's weights"
    if c.use_dora:
        return "method.use_dora computes its magnitude from the base's weights"
    return None


def _folder_problem(folder: Path, skeleton: nn.Module, key: str) -> tuple[Optional[str], Optional[str]]:
    """(error, fallback) for streaming `folder` into `skeleton` (rank 0 reads the headers): the
    loader's own mismatch refusal, or why the names need transformers' loader."""
    from tunekit.model.folder import check_weights, check_weights_match

    try:
        check_weights_match(folder, skeleton, key)
        shapes = check_weights(folder, key)
    except TunekitError as e:
        return str(e), None
    if shapes is None:
        return None, "the weights are a pickle checkpoint"
    if getattr(skeleton.config, "quantization_config", None) is not None:
        return None, "the folder holds a quantized model"
    params = {n for n, _ in skeleton.named_parameters(remove_duplicate=False)}
    buffers = {n for n, _ in skeleton.named_buffers()}
    odd = [n for n in shapes if n not in params and n not in buffers]
    if odd:
        return None, f"tensor names need transformers' renaming ({odd[0]})"
    return None, None


# ---------------------------------------------------------------- the skeleton
def _bnb_config(dtype: torch.dtype, storage: torch.dtype):
    from transformers import BitsAndBytesConfig

    from tunekit.model.loader import load_kwargs

    return load_kwargs("nf4", dtype, torch.device("cpu"), storage)["quantization_config"]


def build_skeleton(path: str, quantize: str, dtype: torch.dtype, storage: Optional[torch.dtype]) -> tuple[nn.Module, dict]:
    """The model on the meta device as the loader would return it (buffers real: they are computed,
    not loaded); 4-bit layers hold a meta weight in the packed shape and storage dtype. Returns
    (model, {Linear4bit module: dtype its weight is cast to before quantization})."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from tunekit.model.loader import NF4_SKIP_MODULES, keep_bnb_layout

    config = AutoConfig.from_pretrained(path)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.tie_weights()
    if (Path(path) / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(path)
    cast: dict = {}
    if quantize == "nf4":
        import bitsandbytes as bnb
        from transformers.integrations.bitsandbytes import replace_with_bnb_linear
        from transformers.quantizers import AutoHfQuantizer
        from transformers.utils.quantization_config import QuantizationMethod

        qc = _bnb_config(dtype, storage)
        replace_with_bnb_linear(model, modules_to_not_convert=list(NF4_SKIP_MODULES), quantization_config=qc)
        for m in model.modules():
            if isinstance(m, bnb.nn.Linear4bit):
                w = m.weight
                per = torch.empty((), dtype=storage).element_size() * 2
                packed = torch.empty(((w.numel() + 1) // per, 1), dtype=storage, device="meta")
                cast[m] = (w.dtype, dict(blocksize=w.blocksize, compress_statistics=w.compress_statistics,
                                         quant_type=w.quant_type, quant_storage=storage))
                m.weight = bnb.nn.Params4bit(packed, requires_grad=False, bnb_quantized=True, module=m, **cast[m][1])
        model.config.quantization_config = qc
        model.is_loaded_in_4bit = model.is_quantized = True
        model.quantization_method = QuantizationMethod.BITS_AND_BYTES
        model.hf_quantizer = AutoHfQuantizer.from_config(qc, pre_quantized=False)
        keep_bnb_layout(model)
    model.requires_grad_(False)
    return model, cast


@contextlib.contextmanager
def adapters_in_host_memory(device: torch.device):
    """peft moves a new adapter to its base layer's device (twice: when the layer is built, and when
    it replaces the base module): with the base on the meta device the A and B it has just drawn
    would become meta too. Inside, they stay on `device` (host memory) with the values peft drew,
    from the same random stream as over a loaded base."""
    from peft.tuners.lora.model import LoraModel
    from peft.tuners.tuners_utils import BaseTunerLayer

    real_move, real_replace = BaseTunerLayer._move_adapter_to_device_of_base_layer, LoraModel._replace_module

    def move(self, adapter_name, device_=None):
        w = getattr(self.get_base_layer(), "weight", None)
        if device_ is None and w is not None and w.is_meta:
            device_ = device
        return real_move(self, adapter_name, device_)

    def replace(self, parent, child_name, new_module, child):
        drawn = {n: p.detach().clone() for n, p in new_module.named_parameters()
                 if self.prefix in n and not p.is_meta}
        real_replace(self, parent, child_name, new_module, child)
        for n, value in drawn.items():
            owner, _, leaf = n.rpartition(".")
            m = new_module.get_submodule(owner)
            p = m._parameters[leaf]
            if p.is_meta:
                m._parameters[leaf] = nn.Parameter(value.to(p.dtype), requires_grad=p.requires_grad)

    BaseTunerLayer._move_adapter_to_device_of_base_layer = move
    LoraModel._replace_module = replace
    try:
        yield
    finally:
        BaseTunerLayer._move_adapter_to_device_of_base_layer = real_move
        LoraModel._replace_module = real_replace


# ---------------------------------------------------------------- the stream
class StreamedBase:
    """A base whose weights rank 0 streams into the shards (module docstring). Built on every rank
    by `open_streamed`; `skeleton` is the model to apply the method to; Sharded.shard calls
    `before_shard` and `fill`."""

    def __init__(self, path: str, quantize: str, dtype: torch.dtype, storage, rank: int, world: int,
                 watching: contextlib.ExitStack, opens, key: str = "model.path"):
        self.path, self.quantize, self.dtype, self.rank, self.world, self.key = path, quantize, dtype, rank, world, key
        self.skeleton, self.cast = build_skeleton(path, quantize, dtype, storage)
        # each weight's names in the files, taken before the method renames the modules (peft's
        # base_model.model....base_layer): (module, leaf) -> names, a tied weight under every name
        self.names: dict[tuple, list[str]] = {}
        for mname, m in self.skeleton.named_modules(remove_duplicate=False):
            for leaf in m._parameters:
                self.names.setdefault((m, leaf), []).append(f"{mname}.{leaf}" if mname else leaf)
        self.bytes_read = self.tensors_read = 0
        self._watching, self._opens = watching, opens
        self.opens: Optional[int] = None  # this rank's opens of the weight files, from open_streamed to fill's end

    def applying(self):
        """The context the method is applied in: its new tensors in host memory."""
        return adapters_in_host_memory(torch.device("cpu"))

    # before fully_shard: what is real (the method's tensors, buffers) and what loads from the files
    def before_shard(self, model: nn.Module, device: torch.device) -> list:
        """Rank 0's real tensors broadcast to every rank (trained init or resumed adapter, buffers);
        returns the plan (`plan`) for the meta parameters, and keeps the real tensors' full values
        for after `to_empty`."""
        import torch.distributed as dist

        plan, self.kept = self.plan(model)
        with torch.no_grad():
            for _, _, t in self.kept:  # the same on every rank: rank 0's
                buf = t.to(device)
                dist.broadcast(buf, src=0)
                t.copy_(buf.to(t.device))
        self.full_bytes = sum(p.numel() * p.element_size() for _, m, leaf, _ in plan
                              for p in [getattr(m, leaf)]) + sum(t.numel() * t.element_size() for *_, t in self.kept)
        return plan

    def plan(self, model: nn.Module) -> tuple[list, list]:
        """([(unit, module, leaf, checkpoint names)] of the meta tensors, in the order rank 0 reads
        them; [(module, leaf, copy)] of the real ones). A unit is a decoder layer (its index), or one
        tensor outside the layers (-1, -2, ...): the embeddings and an untied head are the largest
        tensors, and rank 0 holds one unit's full tensors at a time
        (tunekit.plan.host.largest_unit_bytes counts the same)."""
        from tunekit.model.layers import decoder_layers

        layer_of = {}
        for i, layer in enumerate(decoder_layers(model)):
            for m in layer.modules():
                layer_of[m] = i
        names: dict[int, list[str]] = {}  # a tied weight: the names of every module holding it
        for (m, leaf), ns in self.names.items():
            p = m._parameters.get(leaf)
            if p is not None:
                names.setdefault(id(p), []).extend(ns)
        plan, kept, seen, outside = [], [], set(), 0
        for mname, m in model.named_modules():
            for leaf, t in [*m._parameters.items(), *m._buffers.items()]:
                if t is None or id(t) in seen:
                    continue
                seen.add(id(t))
                if t.is_meta:
                    if m not in layer_of:
                        outside += 1
                    unit = layer_of.get(m, -outside)
                    plan.append((unit, m, leaf, names.get(id(t), [f"{mname}.{leaf}"])))
                else:
                    kept.append((m, leaf, t.detach().clone()))
        return plan, kept

    def fill(self, root: nn.Module, plan: list, device: torch.device) -> dict:
        """Allocate this rank's shards and fill them: the kept tensors from their full values, the
        base from rank 0's stream, one unit at a time. Returns {Linear4bit module: checksum}."""
        with torch.no_grad():
            root.to_empty(device=device)
            for m, leaf, full in self.kept:
                _put_local(_tensor(m, leaf), full, self.rank, self.world)
        del self.kept
        files = WeightFiles(Path(self.path), self.key) if self.rank == 0 else None
        sums: dict = {}
        units = sorted({u for u, *_ in plan})
        for u in [*[x for x in units if x >= 0], *sorted((x for x in units if x < 0), reverse=True)]:  # layers first
            sums.update(self._unit([r for r in plan if r[0] == u], files))
        if files is not None:
            self.bytes_read, self.tensors_read = files.bytes_read, len(plan)
        self.opens = self._opens()
        self._watching.close()
        self.full_bytes += sum(sum(t.numel() * t.element_size() for t in _state_tensors(m.quant_state))
                               for m in sums)
        return sums

    def _unit(self, rows: list, files: Optional[WeightFiles]) -> dict:
        """One unit: rank 0 reads, checks and quantizes it; every rank learns the verdict, the 4-bit
        states and checksums; then each tensor is scattered."""
        import torch.distributed as dist

        fulls, info = [], {"error": None, "states": [], "sums": []}
        if self.rank == 0:
            try:
                for _, m, leaf, names in rows:
                    fulls.append(self._read(files, m, leaf, names, info))
            except TunekitError as e:
                info, fulls = {"error": str(e)}, []
        box = [info]
        dist.broadcast_object_list(box, src=0)
        info = box[0]
        if info["error"]:
            raise TunekitError(info["error"])
        states = iter(info["states"])
        sums = {}
        with torch.no_grad():
            for i, (_, m, leaf, names) in enumerate(rows):
                full = fulls[i] if fulls else None
                if fulls:
                    fulls[i] = None  # freed as soon as it is sent
                _scatter(_tensor(m, leaf), full, self.rank, self.world)
                del full
                if m in self.cast and leaf == "weight":
                    m.quant_state = next(states)
                    sums[m] = info["sums"][len(sums)]
        del fulls
        return sums

    def _read(self, files: WeightFiles, m: nn.Module, leaf: str, names: list, info: dict) -> torch.Tensor:
        """Rank 0: one tensor from the files, finite, in the model's dtype (quantized for 4-bit)."""
        from tunekit.train.fsdp import packed_checksum

        name = next((n for n in names if n in files.where), None)
        if name is None:  # the header check passed: only a renaming would explain it
            raise TunekitError(f"{self.key}: the weights in {self.path} lack {names[0]}")
        raw = files.read(name)
        if raw.is_floating_point() and not _all_finite(raw):
            raise TunekitError(f"{self.key}: the weights in {self.path} hold NaN or infinite values, first "
                               f"{names[0]}: damaged files, or a model that diverged in its own training; nothing "
                               "trained on or computed from it would mean anything")
        if m in self.cast and leaf == "weight":
            import bitsandbytes as bnb

            to, kwargs = self.cast[m]
            q = bnb.nn.Params4bit(raw.to(to), requires_grad=False, **kwargs).to("cpu")  # as transformers does
            info["states"].append(q.quant_state)
            info["sums"].append(packed_checksum(q.data))
            return q.data
        target = _tensor(m, leaf)
        return raw.to(target.dtype)


def sharded_bits_per_param(model: nn.Module) -> Optional[float]:
    """tunekit.model.quantized_bits_per_param of a sharded 4-bit base (the states on the modules,
    the weights' full shapes)."""
    bits = params = 0
    for m in model.modules():
        state = vars(m).get("quant_state")  # the Linear4bit's own (peft's wrapper forwards attributes)
        w = getattr(m, "weight", None)
        if state is None or w is None:
            continue
        params += state.shape.numel()
        bits += w.numel() * w.element_size() * 8 + state.absmax.numel() * state.absmax.element_size() * 8
        if state.nested:
            bits += state.state2.absmax.numel() * state.state2.absmax.element_size() * 8 + 32
    return bits / params if params else None


def _all_finite(t: torch.Tensor, chunk: int = 1 << 22) -> bool:
    """Whether every element is finite, checked a slice at a time (no bool copy of the whole tensor:
    an embedding of a 49k vocabulary would need 100 MB for it)."""
    flat = t.reshape(-1)
    return all(bool(flat[i:i + chunk].isfinite().all()) for i in range(0, flat.numel(), chunk))


def _tensor(m: nn.Module, leaf: str) -> torch.Tensor:
    return m._parameters[leaf] if leaf in m._parameters else m._buffers[leaf]


def _state_tensors(state) -> list[torch.Tensor]:
    out = [state.absmax, state.code]
    if getattr(state, "nested", False):
        out += [state.state2.absmax, state.state2.code, state.offset]
    return [t for t in out if isinstance(t, torch.Tensor)]


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _put_local(t: torch.Tensor, full: torch.Tensor, rank: int, world: int) -> None:
    """This rank's part of a tensor whose full value every rank holds (FSDP2 cuts dim 0 with torch.chunk)."""
    from torch.distributed.tensor import DTensor

    local = _local(t)
    if isinstance(t, DTensor):
        chunks = torch.chunk(full, world, dim=0)
        full = chunks[rank] if rank < len(chunks) else full[:0]
    local.copy_(full.to(local.device).reshape(local.shape))


def _scatter(t: torch.Tensor, full: Optional[torch.Tensor], rank: int, world: int) -> None:
    """Rank 0's `full` cut along dim 0 as FSDP2 cuts it; each rank receives its own piece into its
    shard. A tensor FSDP did not shard is broadcast whole.

    The collective runs on the shard's own device, `local.device`, never on the run's device as
    named: accelerate names a CPU rank's device "cpu:0", which compares unequal to a shard's "cpu"
    and makes `.to("cpu:0")` copy a CPU tensor. Passing it made rank 0 copy both pieces of every
    tensor and receive into a scratch buffer: three extra copies of the tensor's size (288 MiB for
    the 1.02B benchmark's 192 MiB head, all of rank 0's load peak above one unit)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    local = _local(t)
    device = local.device
    if not isinstance(t, DTensor):
        buf = full.to(device) if rank == 0 else torch.empty(local.shape, dtype=local.dtype, device=device)
        dist.broadcast(buf, src=0)
        local.copy_(buf)
        return
    shape = tuple(t.shape)
    step = -(-shape[0] // world)  # torch.chunk's piece length; the last pieces may be short or absent
    into = tuple(local.shape) == (step, *shape[1:]) and local.is_contiguous()
    buf = local if into else torch.empty((step, *shape[1:]), dtype=local.dtype, device=device)
    pieces = None
    if rank == 0:
        full = full.reshape(shape)
        pieces = []
        for r in range(world):
            part = full[r * step:(r + 1) * step]
            if part.shape[0] != step:
                part = torch.cat([part, part.new_zeros((step - part.shape[0], *shape[1:]))])
            pieces.append(part.to(device).contiguous())
    dist.scatter(buf, pieces, src=0)
    if not into:
        local.copy_(buf[:local.shape[0]])


# ---------------------------------------------------------------- the entry
def open_streamed(path: str, quantize: str, dtype: torch.dtype, storage, method_name: str, method, method_cfg,
                  strategy, key: str = "model.path") -> tuple[Optional[StreamedBase], str]:
    """(the streamed base, its log line) on every rank, or (None, why every rank loads the base
    itself). Rank 0 alone reads the weight files' headers; its verdict is every rank's."""
    why = not_streamed_because(method_name, method, method_cfg)
    folder = Path(path)
    if why is None and not folder.is_dir():
        why = "model.path is a hub id"
    error = None
    watching = contextlib.ExitStack()
    opens = watching.enter_context(watch_opens(weight_files(folder))) if why is None else None
    if why is None:
        if strategy.rank == 0:
            from tunekit.model.folder import model_skeleton

            error, why = _folder_problem(folder, model_skeleton(path, key), key)
        error, why = strategy.broadcast((error, why))
    if error or why is not None:
        watching.close()
    if error:
        raise TunekitError(error)
    if why is not None:
        return None, f"fsdp: every rank loads the whole base itself: {why}"
    base = StreamedBase(path, quantize, dtype, storage, strategy.rank, strategy.world_size, watching, opens, key)
    others = "the other rank builds" if strategy.world_size == 2 else f"the {strategy.world_size - 1} others build"
    return base, ("fsdp: rank 0 alone reads the base, one unit at a time, and sends each rank its shards "
                  f"({others} the model on the meta device)")
