"""trainer.strategy=fsdp with the base streamed from rank 0 (tunekit.train.fsdp_load): rank 1 never
opens the weight files; what the ranks gather is rank 0's load bit for bit (4-bit codes and states,
LoRA's random start); bad weights stop every rank with one line; and through the trainer, a QLoRA
run on two ranks matches one process."""

from __future__ import annotations

import contextlib
import ctypes
import json
import types
from pathlib import Path

import pytest
import torch

from _helpers import fork_ranks, launch_two_ranks, read_jsonl, run_cli, tiny_args


def _strategy(rank: int, world: int):
    from tunekit.methods.lora.backend import broadcast_from_rank0

    return types.SimpleNamespace(rank=rank, world_size=world, broadcast=broadcast_from_rank0)


def _digest(t: torch.Tensor) -> str:
    import hashlib

    return hashlib.sha256(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _rank(rank: int, world: int, init_file: str, model_dir: str, bad_dir: str, out: str) -> None:
    """One process group for every case: each spawn of two ranks costs seconds of imports."""
    import torch.distributed as dist

    from tunekit import TunekitError
    from tunekit.methods import MethodConfig, get_method
    from tunekit.model import prepare_for_training
    from tunekit.train.fsdp import Sharded
    from tunekit.train.fsdp_load import open_streamed

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    report = {}
    method, cfg = get_method("lora"), MethodConfig(name="lora", r=4, alpha=8, dropout=0.0)
    for quantize in ("nf4", "none"):
        torch.manual_seed(7)  # as the trainer seeds every rank alike before the method draws A
        stream, line = open_streamed(model_dir, quantize, torch.float32, torch.bfloat16 if quantize == "nf4" else None,
                                     "lora", method, cfg, _strategy(rank, world))
        model = stream.skeleton
        prepare_for_training(model, quantize, False)
        with stream.applying():
            model = method.apply(model, cfg)
        sharded = Sharded(torch.device("cpu"), world, rank)
        sharded.shard(model, stream)
        full = {}
        with torch.no_grad():
            for name, p in model.named_parameters():
                full[name] = _digest(p.full_tensor())
            for name, m in model.named_modules():
                if vars(m).get("quant_state") is not None:  # the Linear4bit's own, not peft's forwarding
                    qs = m.quant_state
                    full[name + ".absmax"] = _digest(qs.absmax)
                    full[name + ".nested_absmax"] = _digest(qs.state2.absmax)
        report[quantize] = {"line": line, "tensors": full, "opens": stream.opens, "bytes_read": stream.bytes_read,
                            "sums": len(sharded._checks)}
    report["scatter_growth_mib"] = _scatter_growth_mib(rank, world)
    try:  # a NaN in one tensor: every rank stops with the same line, none waits in a collective
        stream, _ = open_streamed(bad_dir, "none", torch.float32, None, "lora", method, cfg, _strategy(rank, world))
        with stream.applying():
            model = method.apply(stream.skeleton, cfg)
        Sharded(torch.device("cpu"), world, rank).shard(model, stream)
        report["bad"] = None
    except TunekitError as e:
        report["bad"] = str(e)
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


def _scatter_growth_mib(rank: int, world: int) -> float:
    """How far rank 0's peak RSS rises while it sends each rank its rows of a 32 MiB tensor into
    shards already in memory (tunekit.train.fsdp_load._scatter); None where VmHWM cannot be reset."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from tunekit.train.fsdp_load import _scatter

    def status(key: str) -> float:
        line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(key))
        return int(line.split()[1]) / 1024

    full = torch.ones(4096, 2048) if rank == 0 else None  # fp32: 32 MiB, its pages touched
    shard = DTensor.from_local(torch.zeros(4096 // world, 2048), init_device_mesh("cpu", (world,)), [Shard(0)])
    try:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    except OSError:
        return None
    before = status("VmRSS:")
    _scatter(shard, full, rank, world)
    return status("VmHWM:") - before


def _reference(model_dir: Path, quantize: str) -> dict:
    """What one process loads (tunekit.model.load_base_model) and LoRA starts from, as digests."""
    from tunekit.methods import MethodConfig, get_method
    from tunekit.model import load_base_model, prepare_for_training

    model = load_base_model(str(model_dir), quantize, torch.float32, torch.device("cpu"),
                            torch.bfloat16 if quantize == "nf4" else None)
    prepare_for_training(model, quantize, False)
    torch.manual_seed(7)
    cfg = MethodConfig(name="lora", r=4, alpha=8, dropout=0.0)
    model = get_method("lora").apply(model, cfg)
    out = {name: _digest(p) for name, p in model.named_parameters()}
    for name, m in model.named_modules():
        state = getattr(m.weight, "quant_state", None) if type(m).__name__ == "Linear4bit" and "weight" in m._parameters \
            else None  # bitsandbytes' layer itself, not peft's wrapper (which forwards .weight)
        if state is not None:
            out[name + ".absmax"] = _digest(state.absmax)
            out[name + ".nested_absmax"] = _digest(state.state2.absmax)
    return out


@pytest.fixture(scope="module")
def two_ranks(tiny_model_dir, tmp_path_factory) -> Path:
    import shutil

    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("fsdp-load")
    bad = out / "bad-model"
    shutil.copytree(tiny_model_dir, bad)
    weights = load_file(str(bad / "model.safetensors"))
    weights["model.layers.1.mlp.up_proj.weight"][3, 5] = float("nan")
    save_file(weights, str(bad / "model.safetensors"), metadata={"format": "pt"})
    fork_ranks(_rank, (2, str(out / "pg"), str(tiny_model_dir), str(bad), str(out)))
    return out


@pytest.mark.parametrize("quantize", ["nf4", "none"])
def test_ranks_gather_rank_0s_load_and_rank_1_never_opens_the_weights(quantize, two_ranks, tiny_model_dir):
    r0, r1 = (json.loads((two_ranks / f"rank{r}.json").read_text())[quantize] for r in (0, 1))
    assert "rank 0 alone reads the base" in r0["line"]
    assert r0["opens"] > 0 and r0["bytes_read"] > 0  # the audit hook sees the loader's own opens
    assert r1["opens"] == 0 and r1["bytes_read"] == 0
    # every gathered tensor (base weights, 4-bit codes and their states, LoRA's A and B) is the same
    # on both ranks and the same as one process's load, bit for bit
    assert r0["tensors"] == r1["tensors"]
    ref = _reference(tiny_model_dir, quantize)
    assert ref.keys() == r0["tensors"].keys()
    assert {k for k in ref if ref[k] != r0["tensors"][k]} == set()
    assert r0["sums"] == r1["sums"] == (14 if quantize == "nf4" else 0)  # the first-forward checks, armed


def test_rank_0_sends_each_rank_its_rows_without_copying_them(two_ranks):
    """The pieces rank 0 scatters are views of the tensor it read, received straight into each
    shard: its peak grows by gloo's own small buffers only. Copying them, as passing accelerate's
    "cpu:0" to `.to()` did, costs the 32 MiB tensor once more and a 16 MiB receive buffer besides
    (48 MiB); the bound, 8 MiB, is a quarter of the tensor, far above the ~0 measured and far below
    the copies."""
    growth = json.loads((two_ranks / "rank0.json").read_text())["scatter_growth_mib"]
    if growth is None:
        pytest.skip("VmHWM cannot be reset here (/proc/self/clear_refs)")
    assert growth < 8, growth


def test_a_non_finite_weight_stops_every_rank_with_one_line(two_ranks):
    lines = [json.loads((two_ranks / f"rank{r}.json").read_text())["bad"] for r in (0, 1)]
    assert lines[0] == lines[1] and "\n" not in lines[0]
    assert "NaN or infinite" in lines[0] and "model.layers.1.mlp.up_proj.weight" in lines[0]


def test_rank_0_holds_at_most_the_plans_largest_unit_at_a_time(tmp_path):
    """Each unit rank 0 reads whole is a decoder layer or one other tensor: an untied model's
    embeddings and head are never held together (they were: 2 x 201 MB on a 1B model, against
    tunekit plan's host figure of one), so its largest unit is tunekit.plan.host.largest_unit_bytes."""
    from transformers import LlamaConfig

    from tunekit.plan.host import largest_unit_bytes
    from tunekit.plan.shape import shape_from_config
    from tunekit.train.fsdp_load import StreamedBase

    # embeddings (1000 x 64) larger than a layer (4 x 64 x 64 + 3 x 64 x 128 + 2 x 64)
    cfg = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False)
    cfg.save_pretrained(tmp_path)
    base = StreamedBase(str(tmp_path), "none", torch.float32, None, 0, 2, contextlib.ExitStack(), lambda: 0)
    plan, kept = base.plan(base.skeleton)
    held: dict[int, int] = {}
    for unit, m, leaf, _ in plan:
        t = getattr(m, leaf)
        held[unit] = held.get(unit, 0) + t.numel() * t.element_size()
    assert sorted(u for u in held if u >= 0) == [0, 1]
    assert max(held.values()) == largest_unit_bytes(shape_from_config(cfg.to_dict()), 4) == 1000 * 64 * 4
    assert sum(held.values()) == 4 * sum(p.numel() for p in base.skeleton.parameters())  # nothing missed
    assert all(not t.is_meta for *_, t in kept)  # the rotary frequencies: computed, not read


# The tolerances of tests/train/test_fsdp.py (its comment derives them: fp32 compute, G = 2 sums in
# another order, Adam over 4 steps at lr 1e-3).
ATOL, RTOL = 1e-5, 1e-4


def test_streamed_qlora_on_two_ranks_matches_one_process_and_resumes(tiny_model_dir, tiny_data, tmp_path):
    """The trainer's own path: two ranks (rank 0 streams the 4-bit base) == one process, and a resume
    from step 2 (the adapter loaded into rank 0's tensors before sharding) ends where the run ended."""
    import shutil

    from safetensors.torch import load_file

    # the plain start on both sides: method.init=auto picks LoftQ for one process, the plain start for
    # FSDP's ranks (whose base streams only without one)
    common = ["recipe=qlora", "model.dtype=fp32", "method.dropout=0", "trainer.micro_batch_size=1",
              "trainer.max_steps=4", "data.max_val_examples=1", "trainer.strategy=fsdp", "method.init=default"]
    two = tmp_path / "two"
    r = launch_two_ranks(tiny_args(tiny_model_dir, tiny_data, two, *common), tmp_path, 29531)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr.count("rank 0 alone reads the base") == 1
    one = tmp_path / "one"
    r1 = run_cli(["train", *tiny_args(tiny_model_dir, tiny_data, one, *common, "trainer.grad_accum=4")], tmp_path)
    assert r1.returncode == 0, r1.stderr[-3000:]
    last = "checkpoints/step-000004/adapter/adapter_model.safetensors"
    a, b = load_file(str(two / last)), load_file(str(one / last))
    assert a.keys() == b.keys() and len(a) == 28
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=RTOL, atol=ATOL, msg=k)
    fsdp = json.loads((two / "summary.json").read_text())["fsdp"]
    assert fsdp["base_streamed_from_rank_0"] and fsdp["rank_weight_file_opens"][1] == 0
    # gathered-and-freed weights leave the process (tunekit.device.allocator; glibc: tests/device/test_allocator.py)
    assert fsdp["host_returns_freed_blocks"] is hasattr(ctypes.CDLL(None), "gnu_get_libc_version")
    assert fsdp["rank_weight_bytes_read"][0] == (tiny_model_dir / "model.safetensors").stat().st_size - 8 - int.from_bytes(
        (tiny_model_dir / "model.safetensors").read_bytes()[:8], "little") and fsdp["rank_weight_bytes_read"][1] == 0
    assert [row["step"] for row in read_jsonl(two / "metrics.jsonl") if "loss" in row] == [1, 2, 3, 4]

    resumed = tmp_path / "resumed"
    shutil.copytree(two, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step-000004")
    shutil.rmtree(resumed / "adapter")
    r = launch_two_ranks(tiny_args(tiny_model_dir, tiny_data, resumed, *common, "trainer.resume=true"), tmp_path, 29532)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stderr and "rank 0 alone reads the base" in r.stderr
    a, b = load_file(str(two / "adapter/adapter_model.safetensors")), load_file(str(resumed / "adapter/adapter_model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
