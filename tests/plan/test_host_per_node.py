"""tunekit.plan.host: a node's host memory while rank 0 streams the base into the FSDP shards."""

from __future__ import annotations

import pytest

from tunekit.plan.host import host_bytes_per_node, largest_unit_bytes
from tunekit.plan.shape import ModelShape

# Llama-2-7B's widths: one block 4 x 4096^2 + 3 x 4096 x 11008 + 2 x 4096 = 202,383,360 parameters;
# the embeddings (and the untied head) 32000 x 4096 = 131,072,000: the block is the largest unit.
LLAMA_7B = ModelShape(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32, num_heads=32,
                      num_kv_heads=32, head_dim=128)


def test_the_largest_unit_is_a_block_or_the_embeddings_in_the_compute_dtype():
    assert largest_unit_bytes(LLAMA_7B, 2) == 2 * 202_383_360
    wide_vocab = ModelShape(vocab_size=256_000, hidden_size=2048, intermediate_size=5632, num_layers=16,
                            num_heads=16, num_kv_heads=16, head_dim=128, tie_word_embeddings=True)
    assert largest_unit_bytes(wide_vocab, 4) == 4 * 256_000 * 2048  # the embeddings outgrow a block


def test_host_per_node_counts_every_rank_s_shards_once_and_one_unit():
    shard, unit = 3 * 2**30, 400 * 2**20
    assert host_bytes_per_node(shard, unit, 8) == 8 * shard + unit  # CPU training: shards in host memory
    assert host_bytes_per_node(shard, unit, 8, shards_in_host=False) == unit  # GPUs: only rank 0's unit
    # against the per-rank load it replaces (every rank held the whole base: 8 x 8 shards)
    assert host_bytes_per_node(shard, unit, 8) < 8 * (8 * shard)
    with pytest.raises(ValueError):
        host_bytes_per_node(shard, unit, 0)


def test_tunekit_plan_shows_host_per_node_under_fsdp(tiny_model_dir):
    from tunekit.commands.compose import compose_configs
    from tunekit.commands.plan import as_dict, resolve_auto
    from tunekit.device.facts import DeviceFacts
    from tunekit.plan import predict
    from tunekit.plan.inputs import planner_inputs

    cfg = compose_configs([f"model.path={tiny_model_dir}"])[0]
    facts = DeviceFacts("cpu")
    resolve_auto(cfg, facts, 8, 2)  # as `tunekit plan --gpus 2 --memory 8` does before planning
    shape, setup = planner_inputs(cfg, facts, ranks=2, sharded=False)
    fsdp_setup = planner_inputs(cfg, facts, student=shape, ranks=2, sharded=True)[1]
    plan = predict(shape, setup, facts, 2, fsdp_setup)
    setup = fsdp_setup
    terms = plan.fsdp.terms
    expected = 2 * (terms["base weights"] + terms["trainable parameters"]) + largest_unit_bytes(shape, setup.compute_bytes)
    assert as_dict(plan, None, cfg)["fsdp_host_per_node_bytes"] == expected
