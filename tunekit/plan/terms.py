"""What a PEFT method adds to the training plan: the interface between tunekit.plan and tunekit.methods.

The planner models what every run shares (the frozen base, attention, the MLP, the norms, the
loss, the optimizer); the method says what it adds, through

    Method.plan_terms(shape, setup) -> PlanTerms

and the planner never asks for the method's name. `setup.options` holds the method's own planner
inputs (its `PlanOptions`: a LoRA rank, adapter widths, target projections), built from its
config by `Method.plan_options`. The terms:

* trainable: element counts of the trainable tensors, tensor by tensor: parameters, gradients
  and optimizer state follow from them (8-bit optimizers treat small tensors differently);
* saves(site): bytes the method's layers keep for backward at one site of the block walk
  (tunekit.plan.memory.layer_saved), for the micro-batch's positions; `Site` says whether the
  tensor entering the site needs a gradient and whether another op keeps it already;
* grad_outputs: the projections whose output depends on a trained tensor (o_proj and down_proj
  stand for the output of their sublayer): from there on the block's activations need
  gradients, so attention and the MLP keep what their backward needs;
* decoder_input_grad: the first block's input depends on a trained tensor (a soft prompt, the
  embeddings); extra_positions: positions prepended to every row;
* forward/backward FLOPs per position beyond the frozen decoder's, and per-position bytes the
  method adds to a block's backward working set.
* start_bytes: what the method's start holds once, before the first step, beside the loaded
  model (LoRA's LoftQ start: one layer's original weight and its fit); a phase of its own.
* weight_copy_bytes: compute-dtype copies of the trained weights that the matmuls read, alive for
  the whole step (a full fine-tune's bf16 copies).

A method whose trained parameters are the base's own weights (`Method.trains_base`, a full
fine-tune) also changes what the planner counts as frozen: no frozen copy, an fp32 residual
stream and head, every weight's gradient in backward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from tunekit import TunekitError
from tunekit.plan.shape import PROJECTIONS, ModelShape

# Sites of the block walk, in forward order, and the projections that read each site's input.
SITES = ("embedding", "input_norm", "qkv", "o", "attn_out", "post_norm", "gate_up", "down", "mlp_out", "final_norm")
SITE_PROJECTIONS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
                    "down": ("down_proj",)}


@dataclass(frozen=True)
class Site:
    """One place in the walk where a method may keep tensors for backward.

    name: one of SITES. tokens: positions of the micro-batch (rows x seq; "embedding": the label
    positions). dtype_bytes: bytes per element of the tensor entering the site (the residual
    stream's dtype). input_grad: whether that tensor requires grad. input_saved: whether another
    op of the block already keeps that very tensor (o: sdpa keeps its output when attention
    needs gradients), so saving it again costs nothing.
    """

    name: str
    tokens: int
    dtype_bytes: int
    input_grad: bool = True
    input_saved: bool = False

    @property
    def projections(self) -> tuple:
        return SITE_PROJECTIONS.get(self.name, ())

    def in_dim(self, shape: ModelShape) -> int:
        """Features of the tensor the site's projections read."""
        return shape.projection(self.projections[0])[0]


def _keeps_nothing(site: Site) -> int:
    return 0


@dataclass(frozen=True)
class PlanTerms:
    """A method's part of the plan (see the module docstring)."""

    # True for a method with no plan_terms of its own: the plan leaves out what it adds
    estimated: bool = False
    trainable: tuple = ()
    saves: Callable[[Site], int] = _keeps_nothing
    grad_outputs: frozenset = field(default_factory=frozenset)
    decoder_input_grad: bool = False
    extra_positions: int = 0
    forward_flops_per_token: int = 0
    backward_flops_per_token: int = 0
    block_backward_per_token: int = 0
    block_transient_bytes: int = 0  # built and freed inside one layer's forward (and its recompute)
    start_bytes: int = 0
    # compute-dtype copies of trained weights that the matmuls read, held through the whole step
    # (a full fine-tune under bf16: tunekit.methods.full.rounding)
    weight_copy_bytes: int = 0


def planned_projections(names, key: str = "method.target_modules") -> tuple:
    """Projection names as the planner models them: [all-linear] = the seven of every block."""
    names = list(names)
    if names == ["all-linear"]:
        return PROJECTIONS
    unknown = [n for n in names if n not in PROJECTIONS]
    if unknown:
        raise TunekitError(f"{key}: the planner models the projections {list(PROJECTIONS)}; cannot plan {unknown}")
    return tuple(names)
