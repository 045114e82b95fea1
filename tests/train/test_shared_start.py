"""A computed LoRA start (method.init=loftq|pissa) on two gloo ranks: rank 0 computes it alone and
every rank ends with bit-identical start tensors (tunekit.train.start)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from _helpers import fork_ranks


def _rank(rank: int, world: int, init_file: str, model_dir: str, out: str) -> None:
    """Both starts in one process group: each spawn of two ranks costs seconds of imports."""
    import types

    import torch.distributed as dist
    from peft.tuners.lora import LoraLayer

    from tunekit.methods import MethodConfig, get_method
    from tunekit.methods.lora import loftq, loftq_io, variants
    from tunekit.model import load_base_model
    from tunekit.train.start import apply_method
    from tunekit.train.strategy import SingleOrDDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    calls = []  # every start computed on this rank: LoftQ's layers, PiSSA's SVDs
    real_loftq, real_pissa = loftq.apply_loftq, LoraLayer.pissa_init
    loftq.apply_loftq = lambda *a, **k: calls.append("loftq") or real_loftq(*a, **k)
    LoraLayer.pissa_init = lambda self, *a, **k: calls.append("pissa") or real_pissa(self, *a, **k)
    for init in ("loftq", "pissa"):
        calls.clear()
        quantize = "nf4" if init == "loftq" else "none"
        model = load_base_model(model_dir, quantize, torch.float32, torch.device("cpu"))
        if rank == 1 and quantize == "none":  # a rank whose own start would differ: it must take rank 0's
            with torch.no_grad():
                for n, p in model.named_parameters():
                    if "proj" in n:
                        p.add_(1e-3)
        strategy = SingleOrDDP(types.SimpleNamespace(num_processes=world, process_index=rank), torch.device("cpu"))
        cfg = MethodConfig(name="lora", r=4, alpha=8, dropout=0.0, init=init,
                           target_modules=["q_proj", "v_proj", "down_proj"])
        method = get_method("lora")
        model = apply_method(method, model, cfg, model_dir, None, strategy, lambda msg: None)

        def digest(tensors) -> dict:
            return {n: hashlib.sha256(t.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
                    for n, t in tensors.items()}

        kept = variants.start_of(model)
        init_attr = getattr(model, loftq_io.INIT_ATTR, None)
        Path(out, f"rank{rank}-{init}.json").write_text(json.dumps({
            "calls": calls, "tensors": digest(method.start_tensors(model)),
            "kept": None if kept is None else digest(kept),
            "loftq_layers": None if init_attr is None else sorted(init_attr.layers)}))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tiny_model_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("shared-start")
    fork_ranks(_rank, (2, str(out / "pg"), str(tiny_model_dir), str(out)))
    return out


@pytest.mark.parametrize("init", ["loftq", "pissa"])
def test_rank_0_computes_the_start_and_every_rank_gets_it_bit_for_bit(init, two_ranks):
    r0, r1 = (json.loads((two_ranks / f"rank{r}-{init}.json").read_text()) for r in (0, 1))
    assert r0["calls"] and not r1["calls"]  # only rank 0 computed a start
    assert r0["tensors"] == r1["tensors"]  # A, B, the rewritten base (codes and absmax), bit for bit
    assert len(r0["tensors"]) >= 3 * 2 * 3  # 2 layers x 3 targets x (A, B, base weight, ...)
    if init == "pissa":
        assert r0["kept"] is not None and r0["kept"] == r1["kept"]  # the start the save converts against
    else:
        assert r0["loftq_layers"] and r0["loftq_layers"] == r1["loftq_layers"]  # saved beside the adapter


# Through the trainer under FSDP on two ranks: tests/train/test_fsdp.py's qlora run starts from LoftQ.


@pytest.mark.parametrize("load, device, expected", [
    ("cpu", "cuda:1", "cuda:1"),  # FSDP on a GPU: the base in host memory, the start on this rank's GPU
    ("cuda:1", "cuda:1", None),   # single GPU or DDP: the start computes where the base already sits
    ("cpu", "cpu", None),         # a CPU run
])
def test_the_start_is_computed_on_the_rank_s_device_where_the_base_waits_in_host_memory(load, device, expected):
    import types

    from tunekit.train.start import apply_method

    seen = []

    class Method:
        def computes_start(self, cfg):
            return True

        def apply(self, model, cfg, compute_start=True):
            return model

        def start(self, model, cfg, model_dir, resume_dir, log, compute_device=None):
            seen.append(None if compute_device is None else str(compute_device))

    for world in (1, 2):  # alone, and as rank 0 of two (the others receive rank 0's start)
        strategy = types.SimpleNamespace(world_size=world, rank=0, device=torch.device(device),
                                         load_device=torch.device(load), broadcast_tensors=lambda t: None,
                                         broadcast=lambda obj: obj)
        Method.start_tensors = lambda self, model: {}
        Method.start_extras = lambda self, model: None
        apply_method(Method(), object(), types.SimpleNamespace(name="lora"), "dir", None, strategy, lambda m: None)
    assert seen == [expected, expected]
