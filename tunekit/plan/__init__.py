"""`tunekit plan`: will a training run fit, and how much will one step compute, before loading anything.

    predict(shape, setup, facts, ranks) -> Plan

is a plain function of the model's shape (config.json), the training setup and the device's
facts, so it answers for a 24 GB or 80 GB GPU on a machine that has none. The memory terms
(`memory.py`) model what tunekit's trainer allocates; on top of them the device adds its own:

* CPU: the process's runtime (Python, torch, transformers, peft, bitsandbytes, the tokenizer:
  CPU_RUNTIME_BYTES, measured) is resident before any model loads; the check against free
  memory leaves it out (it is already spent). glibc's allocator keeps freed tensors resident
  (its mmap threshold rises with every large free, after which big tensors live in the heap and
  the heap does not shrink): measured on the suite's model (benchmarks/plan/plan-cpu-suite.md), a
  step then peaks GLIBC_RETENTION x the saved activations higher without checkpointing, and, with
  checkpointing, every block recomputed in backward stays resident. The planner's peak is live
  memory (what a CPU with an allocator that returns freed memory peaks at); the retention is a
  margin of the device total.
* CUDA: the CUDA context and library handles live outside torch's allocator
  (CUDA_CONTEXT_BYTES), and the caching allocator reserves more than it hands out (block
  rounding, fragmentation, cuBLAS/attention workspaces): CUDA_ALLOCATOR_MARGIN of the peak.
  Both are stated margins, not measurements of this machine.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Optional

from tunekit.plan.compute import step_flops
from tunekit.plan.memory import STATIC_TERMS, Memory, TrainSetup, step_memory
from tunekit.plan.shape import ModelShape

if TYPE_CHECKING:  # importing this package imports no torch: method modules import tunekit.plan.terms
    from tunekit.device.facts import DeviceFacts

GiB = 2**30
# RSS before the model loads, measured with torch 2.13 / transformers 5.23: imports 520 MiB, the
# tokenizer 45 MiB, the default data through `datasets` 75 MiB.
CPU_RUNTIME_BYTES = int(0.65 * GiB)
CUDA_CONTEXT_BYTES = int(0.5 * GiB)  # CUDA context + cuBLAS handle, outside torch's allocator
CUDA_ALLOCATOR_MARGIN = 0.10  # reserved over allocated: block rounding, fragmentation, workspaces
CPU_ALLOCATOR_MARGIN = 0.5  # glibc keeps freed tensors resident: + half a step's working memory
CPU_ALLOCATOR_MARGIN_CHECKPOINTED = 1.0  # ... and, with checkpointing, the recomputed blocks
AUTO_HEADROOM = 0.10  # `auto` settings keep this fraction of the free memory unused


@dataclass
class Plan:
    """One rank's predicted peak (bytes), its breakdown, and the step's FLOPs."""

    shape: ModelShape
    setup: TrainSetup
    facts: DeviceFacts
    ranks: int
    memory: Memory  # per rank, as run (one process, or DDP: the whole base on every rank)
    fsdp: Optional[Memory]  # per rank with base/trainable/optimizer sharded over the ranks (ranks > 1)
    flops: dict = field(default_factory=dict)
    fsdp_setup: Optional[TrainSetup] = None  # the setup `fsdp` plans (FSDP2's own paths); None: `setup`

    def as_run(self, sharded: bool) -> "Plan":
        """This plan as a run of the strategy takes it: sharded, its ranks hold the FSDP figures of
        FSDP's setup (`memory`, `setup`, `peak` and the fit checks then read those)."""
        if not sharded or self.fsdp is None:
            return self
        return replace(self, memory=self.fsdp, setup=self.fsdp_setup or self.setup)

    @property
    def peak(self) -> int:
        """torch-visible peak of one rank: CUDA max_memory_allocated, or RSS growth on a CPU."""
        return self.memory.total

    def overhead(self, memory: Optional[Memory] = None) -> dict:
        """Device-level bytes beyond the modelled tensors, by name."""
        memory = memory or self.memory
        if self.facts.type == "cuda":
            return {"CUDA context": CUDA_CONTEXT_BYTES, "allocator margin": int(CUDA_ALLOCATOR_MARGIN * memory.total)}
        return {"runtime (python, torch, data)": CPU_RUNTIME_BYTES,
                "allocator margin (glibc)": int(self.cpu_margin() * dynamic_bytes(memory))}

    def cpu_margin(self) -> float:
        return CPU_ALLOCATOR_MARGIN_CHECKPOINTED if self.setup.gradient_checkpointing else CPU_ALLOCATOR_MARGIN

    def device_total(self, memory: Optional[Memory] = None) -> int:
        """What one rank occupies on its device, margins included."""
        return (memory or self.memory).total + sum(self.overhead(memory).values())

    def needed_terms(self) -> dict:
        """The terms of `needed_beyond_runtime` for one process (the runtime/context is spent)."""
        spent = ("CUDA context",) if self.facts.type == "cuda" else ("runtime (python, torch, data)",)
        return {**self.memory.terms, **{k: v for k, v in self.overhead().items() if k not in spent}}

    def needed_beyond_runtime(self) -> int:
        """What must still be free once the process runs (context/runtime already spent), summed
        over the processes that share this device's memory (CPU ranks share the host's RAM)."""
        spent = CUDA_CONTEXT_BYTES if self.facts.type == "cuda" else CPU_RUNTIME_BYTES
        sharing = self.ranks if self.facts.type == "cpu" else 1
        return sharing * (self.device_total() - spent)

    def fits(self, available: int, headroom: float = 0.0) -> bool:
        return self.needed_beyond_runtime() <= available * (1.0 - headroom)


def dynamic_bytes(memory: Memory) -> int:
    """What a step allocates and frees: the peak minus the state that lives across steps."""
    return memory.total - sum(memory.terms.get(k, 0) for k in STATIC_TERMS)


def predict(shape: ModelShape, setup: TrainSetup, facts: DeviceFacts, ranks: int = 1,
            fsdp_setup: Optional[TrainSetup] = None) -> Plan:
    """The plan of `setup`; with several ranks its FSDP column too, of `fsdp_setup` where given (the
    setup FSDP2 runs: tunekit.plan.inputs.planner_inputs(..., sharded=True)), else of `setup`."""
    memory = step_memory(shape, setup, ranks=ranks, sharded=False)
    fsdp = step_memory(shape, fsdp_setup or setup, ranks=ranks, sharded=True) if ranks > 1 else None
    return Plan(shape, setup, facts, ranks, memory, fsdp, step_flops(shape, setup),
                fsdp_setup if ranks > 1 else None)


__all__ = ["GiB", "Plan", "TrainSetup", "ModelShape", "predict"]
