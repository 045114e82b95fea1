"""A rank that fails or dies stops the others with one line naming it (tunekit.train.peers), on two
gloo ranks forked as `accelerate launch` starts them (tests/_helpers.py: launch_two_ranks).

TUNEKIT_TEST_FAIL_AT="RANK:STEP[:HOW]" makes one rank fail as it reaches a step (docs/testing.md).
Step 3 of 3: the checkpoint of step 2 is written before, and must still resume afterwards."""

from __future__ import annotations

import re

import pytest

from _helpers import launch_two_ranks, tiny_args
from tunekit.train.checkpoint import find_resumable


def _errors(stderr: str) -> list[str]:
    """The error lines (a progress bar's last redraw may precede one on the same line)."""
    return re.findall(r"tunekit: error: ([^\r\n]*)", stderr)


@pytest.mark.parametrize("failing", [1, 0])
def test_a_rank_that_raises_is_named_by_the_other(tiny_model_dir, tiny_data, tmp_path, failing):
    """Rank 1 raises (rank 0 hosts the store and finds its line there); rank 0 raises (it hosts the
    store and waits until rank 1 has read its line before it exits)."""
    out = tmp_path / "run"
    r = launch_two_ranks(tiny_args(tiny_model_dir, tiny_data, out, "recipe=lora"), tmp_path, 29531 + failing,
                         env={"TUNEKIT_TEST_FAIL_AT": f"{failing}:3"})
    own = f"TUNEKIT_TEST_FAIL_AT: rank {failing} fails at step 3 as asked"
    # the failing rank ends as any TunekitError does (2); the other with the line naming it (1), on its
    # own: None would mean the test harness had to stop it after its grace period
    assert r.rank_codes[failing] == 2 and r.rank_codes[1 - failing] == 1, (r.rank_codes, r.stderr[-3000:])
    assert sorted(_errors(r.stderr)) == sorted([own, f"rank {failing} failed: {own}"]), r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "frame #" not in r.stderr, r.stderr[-3000:]
    ckpt, skipped = find_resumable(out)  # verifies every file's checksum
    assert ckpt is not None and ckpt.name == "step-000002" and not skipped


def test_a_rank_that_dies_is_named_by_the_other(tiny_model_dir, tiny_data, tmp_path):
    """Rank 1 is killed (SIGKILL) mid-run: no word from it; rank 0 finds its process gone."""
    out = tmp_path / "run"
    r = launch_two_ranks(tiny_args(tiny_model_dir, tiny_data, out, "recipe=lora", "trainer.dist_timeout_s=60"),
                         tmp_path, 29533, env={"TUNEKIT_TEST_FAIL_AT": "1:3:kill"})
    assert r.rank_codes[0] == 1 and r.rank_codes[1] != 0, (r.rank_codes, r.stderr[-3000:])
    errors = _errors(r.stderr)
    assert len(errors) == 1 and errors[0].startswith("rank 1 stopped (exit/connection lost: its process "), r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "frame #" not in r.stderr, r.stderr[-3000:]
    assert "collectives time out after 60 s (trainer.dist_timeout_s)" in r.stderr
    ckpt, skipped = find_resumable(out)
    assert ckpt is not None and ckpt.name == "step-000002" and not skipped
