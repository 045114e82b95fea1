"""A training step reads values back from the device a fixed number of times, whatever the model.

On a GPU each read (`.item()`, `.tolist()`, `bool(t)`, `float(t)`, ...) waits for every kernel queued
before it. The loop used to check each trained tensor for inf/nan with a read of its own: 448 waits
a step for an 8B model with LoRA on every projection. Here a TorchFunctionMode counts every read of
a step on the CPU; the count must not grow with the number of trained tensors and must stay at the
loop's two reads (loss with gradient norm, then the finite check) plus a few per micro-batch:
the batch's token counts (CPU tensors: no device wait on a GPU either) and transformers' check of
a padded batch's attention mask (one per forward).

Not counted: torch.optim's reads of its step counters, which torch keeps on the host (no device
wait on a GPU: `state["step"]` is a CPU tensor unless the optimizer is fused or capturable).
"""

from __future__ import annotations

import traceback

import torch
from torch.overrides import TorchFunctionMode

from tunekit.config import DataConfig, ModelConfig, TrainConfig, TrainerConfig
from tunekit.methods import MethodConfig
from tunekit.train.loop import TrainRecipe

READS = {"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy", "cpu"}
GRAD_ACCUM = 2


class CountReads(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in READS and not any("/torch/optim/" in f.filename for f in traceback.extract_stack()):
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


def _reads_of_one_step(tiny_model_dir, tiny_data, out, targets: list[str]) -> tuple[list[str], int]:
    cfg = TrainConfig(
        output_dir=str(out), seed=0,
        model=ModelConfig(path=str(tiny_model_dir), quantize="nf4"),
        data=DataConfig(path=str(tiny_data), max_seq_len=64, val_fraction=0.2, max_val_examples=2),
        method=MethodConfig(r=4, alpha=8, dropout=0.0, target_modules=targets),
        trainer=TrainerConfig(max_steps=3, micro_batch_size=2, grad_accum=GRAD_ACCUM, eval_every=100,
                              save_every=100, eval_samples=0),
    )
    r = TrainRecipe(cfg, out)
    try:
        r.setup()
        r.train_step(0)  # the first step also records what attention received: not a steady step
        with CountReads() as spy:
            r.train_step(1)
        return spy.reads, len(r.params)
    finally:
        r.cleanup()


def test_a_step_reads_a_fixed_number_of_values(tiny_model_dir, tiny_data, tmp_path):
    few, n_few = _reads_of_one_step(tiny_model_dir, tiny_data, tmp_path / "q", ["q_proj"])
    many, n_many = _reads_of_one_step(tiny_model_dir, tiny_data, tmp_path / "all", ["all-linear"])
    assert n_many >= 7 * n_few  # 7 projections against 1: the step trains 7x the tensors
    assert sorted(many) == sorted(few), (few, many)
    assert len(many) <= 2 + 4 * GRAD_ACCUM, many


def test_the_finite_check_is_exact():
    """Finite however large (1e30 and bf16's largest overflow an fp32 sum of squares), and any NaN or
    inf in any tensor of the list is found."""
    from tunekit.train.strategy import finite_flag

    big = [torch.full((1000,), 1e30), torch.full((10,), 3.3e38, dtype=torch.bfloat16), torch.zeros(0)]
    assert bool(finite_flag(big)) and bool(finite_flag([]))
    for bad in (float("nan"), float("inf"), -float("inf")):
        t = torch.ones(5)
        t[3] = bad
        assert not bool(finite_flag([*big, t])), bad

