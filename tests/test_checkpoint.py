"""Checkpoint files: state without pickle, integrity checks, fallback, leftovers (no model needed)."""

from __future__ import annotations

import json
import pickle

import pytest
import torch

from tunekit import TunekitError
from tunekit import device as dev
from tunekit.checkpoint import (cleanup_leftovers, damage, decode_tree, encode_tree, find_resumable,
                                load_checkpoint, save_checkpoint)
from tunekit.optim import build_optimizer, warmup_cosine
from tunekit.resume import check_output_dir, check_same_run

CPU = torch.device("cpu")


def _trained_optimizer(name: str):
    """A few steps of `name` on params large enough for bnb's 8-bit state (>= 4096 elements)."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(128, 64)), torch.nn.Parameter(torch.randn(64))]
    opt = build_optimizer(name, params, 1e-3, 0.01, CPU)
    sched = warmup_cosine(opt, 2, 10)
    for _ in range(3):
        sum((p ** 2).sum() for p in params).backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return params, opt, sched


def _save(tmp_path, opt, sched, step=3, keep=5):
    def adapter(d):
        d.mkdir(parents=True)
        (d / "adapter_model.safetensors").write_bytes(b"x" * 100)

    return save_checkpoint(tmp_path, step, adapter, opt, sched, {"tokens_seen": 7, "fingerprint": {"seed": 0}},
                           [dev.rng_state(CPU)], keep)


@pytest.mark.parametrize("name", ["adamw", "adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit"])
def test_optimizer_state_round_trips_without_pickle(tmp_path, name):
    params, opt, sched = _trained_optimizer(name)
    ckpt = _save(tmp_path, opt, sched)
    assert sorted(p.name for p in ckpt.iterdir()) == ["adapter", "optimizer.safetensors", "trainer_state.json"]

    params2, opt2, sched2 = _trained_optimizer(name)
    for p in params2:  # a different state to overwrite
        p.data.mul_(2)
    opt2.state.clear()
    state = load_checkpoint(ckpt, opt2, sched2)
    assert state["step"] == 3 and state["tokens_seen"] == 7
    _assert_same(opt.state_dict(), opt2.state_dict())
    assert sched.state_dict() == sched2.state_dict()


def _assert_same(a, b, path="state"):
    """Equal nested states: same types, same keys, bit-identical tensors."""
    assert type(a) is type(b), path
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            _assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


def test_tree_encoding_keeps_types_and_refuses_objects():
    tensors = {}
    tree = {"a": (1, 2.5, None), 3: [True, "s", float("inf")], "__x": torch.float16, "t": torch.arange(3)}
    encoded = json.loads(json.dumps(encode_tree(tree, tensors)))
    back = decode_tree(encoded, tensors)
    assert back["a"] == (1, 2.5, None) and back[3] == [True, "s", float("inf")] and back["__x"] == torch.float16
    assert torch.equal(back["t"], torch.arange(3))
    with pytest.raises(TypeError, match="without pickle"):
        encode_tree({"f": lambda: 0}, {})


def test_damaged_checkpoints_are_found_and_skipped(tmp_path):
    _, opt, sched = _trained_optimizer("adamw")
    older = _save(tmp_path, opt, sched, step=2)
    newer = _save(tmp_path, opt, sched, step=4)
    assert damage(older) is None and damage(newer) is None
    assert find_resumable(tmp_path) == (newer, [])

    data = (newer / "optimizer.safetensors").read_bytes()
    (newer / "optimizer.safetensors").write_bytes(data[: len(data) // 2])  # a truncated copy
    ckpt, skipped = find_resumable(tmp_path)
    assert ckpt == older and "step-000004" in skipped[0] and "truncated or altered" in skipped[0]

    (older / "adapter" / "adapter_model.safetensors").unlink()
    assert "missing" in damage(older)
    (newer / "trainer_state.json").write_text("{not json")
    ckpt, skipped = find_resumable(tmp_path)
    assert ckpt is None and len(skipped) == 2 and "unreadable" in skipped[0]


def test_a_pickled_training_state_is_never_loaded(tmp_path):
    """The old format's training_state.pt was a pickle: planted in a checkpoint, it must not run."""
    _, opt, sched = _trained_optimizer("adamw")
    ckpt = _save(tmp_path, opt, sched)
    marker = tmp_path / "payload-ran"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    (ckpt / "training_state.pt").write_bytes(pickle.dumps({"optimizer": Payload()}))
    torch.save({"x": Payload()}, ckpt / "optimizer.pt")
    _, opt2, sched2 = _trained_optimizer("adamw")
    load_checkpoint(ckpt, opt2, sched2)
    assert damage(ckpt) is None  # extra files are not part of the checkpoint
    assert not marker.exists()


def test_old_format_is_refused_with_a_reason(tmp_path):
    ckpt = tmp_path / "checkpoints" / "step-000002"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 2, "tokens_seen": 1}))
    assert "older checkpoints held pickled state" in damage(ckpt)


def test_keep_prunes_old_checkpoints(tmp_path):
    _, opt, sched = _trained_optimizer("adamw")
    for step in (1, 2, 3):
        _save(tmp_path, opt, sched, step=step, keep=2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-000002", "step-000003"]


def test_cleanup_leftovers_of_interrupted_saves(tmp_path):
    ck = tmp_path / "checkpoints"
    (ck / ".step-000004.tmp-abc" / "adapter").mkdir(parents=True)
    (tmp_path / ".adapter.tmp-xyz").mkdir()
    (tmp_path / ".config.yaml.tmp").write_text("half")
    (tmp_path / ".adapter.old").mkdir()  # killed between atomic_dir's two renames: adapter/ is missing
    (tmp_path / ".adapter.old" / "adapter_model.safetensors").write_text("w")
    (ck / "step-000002").mkdir()
    (ck / ".step-000002.old").mkdir()  # replaced and already renamed back: just delete
    done = cleanup_leftovers(tmp_path)
    assert len(done) == 5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "checkpoints"]
    assert (tmp_path / "adapter" / "adapter_model.safetensors").read_text() == "w"
    assert [p.name for p in ck.iterdir()] == ["step-000002"]
    assert cleanup_leftovers(tmp_path) == []


def test_fingerprint_changes_are_named(tmp_path):
    saved = {"method.r": 16, "seed": 0, "data.path:sha256": "aa", "world_size": 1}
    check_same_run(saved, dict(saved), tmp_path)
    with pytest.raises(TunekitError, match=r"data.path \(file content changed\), method.r \(16 -> 8\)"):
        check_same_run(saved, {**saved, "method.r": 8, "data.path:sha256": "bb"}, tmp_path)


@pytest.mark.parametrize("files", [["config.yaml"], ["metrics.jsonl"], ["summary.json"], ["checkpoints"], ["adapter"]])
def test_a_folder_with_any_run_file_is_not_overwritten(tmp_path, files):
    for name in files:
        (tmp_path / name).mkdir() if "." not in name else (tmp_path / name).write_text("x")
    with pytest.raises(TunekitError, match="already holds a run"):
        check_output_dir(tmp_path, resume=False)
    check_output_dir(tmp_path, resume=True)
    check_output_dir(tmp_path / "new", resume=False)


def _paging_allocator(calls):
    """Stands in for bitsandbytes' get_state_buffer on CUDA: a buffer marked paged, as F.get_paged
    marks the unified-memory tensors it makes (a CPU has none, so bnb never pages there)."""

    def allocate(p, dtype=torch.float32):
        calls.append((tuple(p.shape), dtype))
        buf = torch.zeros_like(p, dtype=dtype)
        buf.is_paged = True
        return buf

    return allocate


@pytest.mark.parametrize("name,state_dtype", [("paged_adamw_32bit", torch.float32), ("paged_adamw_8bit", torch.uint8)])
def test_a_resumed_paged_optimizer_is_still_paged(tmp_path, name, state_dtype):
    params, opt, sched = _trained_optimizer(name)
    ckpt = _save(tmp_path, opt, sched)
    params2, opt2, sched2 = _trained_optimizer(name)
    opt2.state.clear()
    calls = []
    opt2.get_state_buffer = _paging_allocator(calls)  # what load_checkpoint re-creates the buffers with
    load_checkpoint(ckpt, opt2, sched2)

    assert opt2.is_paged
    # both Adam moments of the 128x64 weight come back through the allocator in their own dtype; the
    # 64-element bias too, in fp32 (bnb keeps 32-bit state under 4096 elements even in 8-bit
    # optimizers; on CUDA its allocator leaves tensors under 1e5 elements unpaged: its rules, not ours)
    assert calls == [((128, 64), state_dtype)] * 2 + [((64,), torch.float32)] * 2
    for p in params2:
        for key in ("state1", "state2"):
            assert getattr(opt2.state[p][key], "is_paged", False), (name, key)
    _assert_same(opt.state_dict(), opt2.state_dict())  # the values are the saved ones


def test_an_unpaged_optimizer_keeps_its_loaded_state(tmp_path):
    params, opt, sched = _trained_optimizer("adamw_8bit")
    ckpt = _save(tmp_path, opt, sched)
    params2, opt2, sched2 = _trained_optimizer("adamw_8bit")
    calls = []
    opt2.get_state_buffer = _paging_allocator(calls)
    load_checkpoint(ckpt, opt2, sched2)
    assert calls == [] and not any(getattr(s.get("state1"), "is_paged", False) for s in opt2.state.values())
    _assert_same(opt.state_dict(), opt2.state_dict())
