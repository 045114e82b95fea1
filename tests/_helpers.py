"""Helpers shared by the test modules (plain functions; fixtures live in conftest.py).

Kept out of conftest.py: tests/kernel_ops has a conftest.py of its own, and pytest imports both
under the module name `conftest`, so `from _helpers import ...` would find whichever came last.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def tiny_args(model_dir: Path, data: Path, out: Path, *extra: str) -> list[str]:
    """Overrides for a fast run of any recipe on the tiny model."""
    return [
        f"model.path={model_dir}", f"data.path={data}", f"output_dir={out}",
        "trainer.max_steps=3", "trainer.micro_batch_size=4", "trainer.grad_accum=2",
        "trainer.eval_every=2", "trainer.save_every=2", "trainer.warmup_steps=1", "trainer.lr=1e-3",
        "data.val_fraction=0.2", "data.max_seq_len=64", *extra,
    ]


def run_cli(args: list[str], cwd: Path, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run the installed `tunekit` console script, the way a user does."""
    full_env = {**os.environ, **(env or {})}
    exe = Path(sys.executable).with_name("tunekit")
    return subprocess.run([str(exe), *args], cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
