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


def scaled_tiny_model(tiny_model_dir: Path, out: Path, seed: int) -> Path:
    """The tiny model with std-0.25 projections and unit embeddings, saved in fp32 at `out`.

    At its save-time init (std 0.02) the tiny model's greedy output is one token (a newline) over
    and over whatever the context, which would make "batched equals alone" trivially true; with
    these scales every context gives a different sequence. fp32: batched and solo matmuls round
    differently, and fp32 keeps that ~1e-6, far below logit gaps.
    """
    import torch
    from transformers import AutoTokenizer

    from tunekit.model import load_base_model

    model = load_base_model(str(tiny_model_dir), "none", torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * (1.0 if "embed" in name else 0.25))
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(out)
    return out
