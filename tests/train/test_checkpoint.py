"""Checkpoint files: state without pickle, integrity checks, fallback, leftovers, output_dir rules (no model needed)."""

from __future__ import annotations

import json
import os
import pickle
import time

import pytest
import torch

from tunekit import TunekitError
from tunekit.device import facts as dev
from _helpers import die_holding_lock, die_mid_save, lost_or_changed, plant_lookalikes, snapshot
from tunekit.train.checkpoint import (atomic_dir, atomic_write_text, cleanup_leftovers, damage, decode_tree, encode_tree,
                                find_resumable, load_checkpoint, save_checkpoint)
from tunekit.owned import is_scratch
from tunekit.train.optim import build_optimizer, warmup_cosine
from tunekit.train.resume import check_output_dir, check_same_run

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
    """Real leftovers (saves in child processes killed at each point) are undone; the user's
    look-alikes beside them, in the run folder and in checkpoints/, are not touched."""
    ck = tmp_path / "checkpoints"
    atomic_dir(tmp_path / "adapter", lambda d: (d / "adapter_model.safetensors").write_text("w"))
    atomic_dir(ck / "step-000002", lambda d: (d / "trainer_state.json").write_text("{}"))
    mine = plant_lookalikes(tmp_path)
    (tmp_path / ".adapter.tmp-xyz").mkdir()  # what older versions' saves left: no marker, so not provably ours
    (tmp_path / ".config.yaml.tmp").write_text("half")
    (ck / ".step-000004.tmp-abc" / "adapter").mkdir(parents=True)
    (ck / ".step-000002.old").mkdir()
    (ck / "step-5").mkdir()  # made by hand, no trainer_state.json
    (ck / "step-5" / "notes.txt").write_text("mine")
    forged = tmp_path / ".tunekit.tmp-forged"  # a marker that points a restore outside the folder
    forged.mkdir()
    (forged / "tunekit-scratch.json").write_text(json.dumps({"tunekit": "tunekit scratch folder v1", "target": "../x"}))
    (forged / "old").mkdir()

    def user_files():  # all but what the saves below replace
        return {k: v for k, v in snapshot(tmp_path).items() if not k.startswith("checkpoints/step-000002/")}

    user = user_files()

    die_mid_save(tmp_path / "adapter", at="rename")  # killed between atomic_dir's two renames: adapter/ is missing
    die_mid_save(ck / "step-000004", at="write")  # killed while writing a new checkpoint
    die_mid_save(tmp_path / "config.yaml", at="file")  # killed while writing a file
    die_mid_save(ck / "step-000002", at="renamed")  # replaced, killed before the old one was removed
    assert not (tmp_path / "adapter").exists() and not (tmp_path / "config.yaml").exists()
    assert len([p for p in (*tmp_path.iterdir(), *ck.iterdir()) if is_scratch(p)]) == 4

    done = cleanup_leftovers(tmp_path)
    assert len(done) == 5 and sum(line.startswith("removed") for line in done) == 4, done
    assert done[0].startswith(f"restored {tmp_path / 'adapter'} from .tunekit.tmp-adapter-")
    assert (tmp_path / "adapter" / "adapter_model.safetensors").read_text() == "w"
    assert sorted(p.name for p in (ck / "step-000002").iterdir()) == ["new.txt"]  # the new one stays
    assert not (tmp_path / "config.yaml").exists() and not (ck / "step-000004").exists()
    assert user_files() == user and lost_or_changed(tmp_path, mine) == []  # every look-alike as it was
    assert cleanup_leftovers(tmp_path) == []


def test_cleanup_keeps_the_scratch_folder_of_a_live_writer(tmp_path):
    """A save still in progress (its process alive: an export writing beside the run, say) is not a leftover."""
    go_read, go_write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            atomic_dir(tmp_path / "adapter", lambda d: (os.read(go_read, 1), (d / "a").write_text("new")))
        finally:
            os._exit(0)
    try:
        deadline = time.time() + 30
        while not [p for p in tmp_path.iterdir() if is_scratch(p)] and time.time() < deadline:
            time.sleep(0.01)
        (line,) = cleanup_leftovers(tmp_path)
        assert line.startswith("kept ") and f"pid {pid} is still writing it" in line
    finally:
        os.write(go_write, b"x")
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["adapter"] and (tmp_path / "adapter" / "a").read_text() == "new"


def test_atomic_writes_leave_only_their_target(tmp_path, monkeypatch):
    target = tmp_path / "adapter"
    for text in ("one", "two"):  # a new target, then a replaced one
        atomic_dir(target, lambda d: (d / "w").write_text(text))
    atomic_write_text(tmp_path / "config.yaml", "a: 1")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "config.yaml"]
    assert (target / "w").read_text() == "two"

    def fail(d):
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        atomic_dir(target, fail)
    # Ctrl-C between the two renames (the old target already moved aside): it is put back on the way out
    real, calls = os.rename, []

    def rename(a, b):
        calls.append(b)
        if len(calls) == 2:
            raise KeyboardInterrupt
        real(a, b)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(KeyboardInterrupt):
        atomic_dir(target, lambda d: (d / "w").write_text("three"))
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "config.yaml"]
    assert (target / "w").read_text() == "two"


def test_a_hand_made_checkpoint_folder_is_never_replaced_or_pruned(tmp_path):
    _, opt, sched = _trained_optimizer("adamw")
    ck = tmp_path / "checkpoints"
    for name in ("step-5", "step-000003"):  # no trainer_state.json: not tunekit's
        (ck / name).mkdir(parents=True)
        (ck / name / "notes.txt").write_text("mine")
    for step in (1, 2):
        _save(tmp_path, opt, sched, step=step, keep=1)
    with pytest.raises(TunekitError, match=r"step-000003 exists and is not a tunekit checkpoint \(no trainer_state.json\)"):
        _save(tmp_path, opt, sched, step=3, keep=1)
    assert sorted(p.name for p in ck.iterdir()) == ["step-000002", "step-000003", "step-5"]
    assert all((ck / n / "notes.txt").read_text() == "mine" for n in ("step-5", "step-000003"))
    with pytest.raises(TunekitError, match=r"step-000003 is not a tunekit checkpoint .* move it out of"):
        check_output_dir(tmp_path, resume=True)  # refused when the run starts, not at that save


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


@pytest.mark.parametrize("resume", [False, True])
def test_a_folder_of_other_files_is_refused_unless_allowed(tmp_path, resume):
    (tmp_path / ".draft.tmp").write_text("x")
    (tmp_path / "photos").mkdir()
    with pytest.raises(TunekitError, match=rf"^output_dir: {tmp_path} is not empty and holds no tunekit run "
                                           r"\(\.draft\.tmp, photos\).*trainer\.allow_nonempty_output_dir=true"):
        check_output_dir(tmp_path, resume=resume)
    check_output_dir(tmp_path, resume=resume, allow_nonempty=True)


def test_what_tunekit_leaves_does_not_make_a_folder_foreign(tmp_path):
    """A stale lock and a marked scratch folder of a run killed before its config.yaml: still empty."""
    die_holding_lock(tmp_path)
    die_mid_save(tmp_path / "config.yaml", at="file")
    (tmp_path / "student_base").mkdir()  # a distillation builds its student first
    check_output_dir(tmp_path, resume=False)
    (tmp_path / ".tunekit.tmp-unmarked").mkdir()  # the prefix alone proves nothing
    with pytest.raises(TunekitError, match=r"\(\.tunekit\.tmp-unmarked\)"):
        check_output_dir(tmp_path, resume=False)


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
