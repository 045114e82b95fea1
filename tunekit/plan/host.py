"""Host memory a node holds while FSDP loads the base (tunekit.train.fsdp_load).

Rank 0 alone reads the weight files, one unit at a time (a decoder block, the embeddings, the
head), quantizes it and sends every rank its shards; the other ranks never hold a whole unit. So a
node holds, besides each process's own baseline (the libraries, about 0.4 GiB per process on a
CPU):

    host per node = ranks_per_node x shard_bytes + largest_unit_bytes

shard_bytes: one rank's share of the base and the trained tensors (the FSDP column's "base weights"
+ "trainable parameters"); counted only where the shards live in host memory (CPU training: on
GPUs they go to the device). largest_unit_bytes: the largest unit's full tensors in the compute
dtype, as rank 0 holds them while it reads, quantizes and sends them (its 4-bit codes are smaller:
an upper bound). Before this loader every rank read the whole base: ranks_per_node x the base.
Pure functions of the plan's inputs.
"""

from __future__ import annotations

from tunekit.plan.shape import ModelShape


def largest_unit_bytes(shape: ModelShape, compute_bytes: int) -> int:
    """The largest unit rank 0 streams, in the compute dtype: one decoder block, the input
    embeddings or an untied head (the final norm goes with them and is tiny)."""
    block = shape.linear_params_per_layer + shape.norm_params_per_layer
    return compute_bytes * max(block, shape.embedding_params, shape.head_params)


def host_bytes_per_node(shard_bytes: int, largest_unit: int, ranks_per_node: int, shards_in_host: bool = True) -> int:
    """What a node's host memory holds for the model during FSDP's load (module docstring)."""
    if ranks_per_node < 1:
        raise ValueError("ranks_per_node must be at least 1")
    return (ranks_per_node * shard_bytes if shards_in_host else 0) + largest_unit


def plan_host_per_node(plan, ranks_per_node: int) -> int:
    """host_bytes_per_node of a plan's FSDP column (tunekit.plan.Plan with ranks > 1)."""
    terms = plan.fsdp.terms
    shard = terms.get("base weights", 0) + terms.get("trainable parameters", 0)
    st = plan.fsdp_setup or plan.setup
    return host_bytes_per_node(shard, largest_unit_bytes(plan.shape, st.compute_bytes), ranks_per_node,
                               shards_in_host=plan.facts.type == "cpu")
