"""What a run shows and keeps: progress bar, metrics.jsonl, loss-curve PNG, optional W&B.

Only rank 0 builds a Tracker; the other ranks get `NullTracker`, so no file is written twice.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Optional


log = logging.getLogger(__name__)


def read_metrics(path: Path) -> list[dict]:
    if not Path(path).is_file():
        return []
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by a crash; the rest is still good
            continue
    return rows


def plot_losses(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    if train:
        ax.plot(*zip(*train), label="train loss", alpha=0.8)
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.grid(alpha=0.3)
    if train or val:
        ax.legend()
    fig.tight_layout()
    tmp = Path(out).with_name(f".{Path(out).name}.tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, out)


class Tracker:
    def __init__(self, output_dir: Path, total_steps: int, start_step: int, tracker: str, project: str,
                 run_name: Optional[str], config: dict):
        from tqdm import tqdm

        self.output_dir = Path(output_dir)
        self.metrics_path = self.output_dir / "metrics.jsonl"
        self._truncate_after(start_step)
        self.metrics = open(self.metrics_path, "a")
        self.bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True,
                        file=sys.stderr, mininterval=1.0)
        self.wandb = self._start_wandb(project, run_name, config) if tracker == "wandb" else None

    def _truncate_after(self, step: int) -> None:
        """On resume, drop rows logged after the checkpoint we restart from (they will be redone)."""
        rows = [r for r in read_metrics(self.metrics_path) if r.get("step", 0) <= step] if step > 0 else []
        if self.metrics_path.exists():
            self.metrics_path.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def _start_wandb(self, project: str, run_name: Optional[str], config: dict):
        import wandb

        mode = os.environ.get("WANDB_MODE")
        if mode is None:
            # No key -> offline: never block a run on a login prompt or the network.
            has_key = bool(os.environ.get("WANDB_API_KEY")) or (Path.home() / ".netrc").is_file()
            mode = "online" if has_key else "offline"
        run = wandb.init(project=project, name=run_name, config=config, dir=str(self.output_dir), mode=mode)
        if mode == "offline":
            log.info("W&B offline: run saved in %s; upload it later with: wandb sync %s", run.dir, Path(run.dir).parent)
        return run

    def log(self, row: dict) -> None:
        self.metrics.write(json.dumps(row) + "\n")
        self.metrics.flush()
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in row.items() if k != "step"}, step=row["step"])

    def step(self, row: dict) -> None:
        self.log(row)
        self.bar.set_postfix(loss=f"{row['loss']:.3f}", tok_s=f"{row['tokens_per_s']:.0f}", refresh=False)
        self.bar.update(1)

    def eval(self, row: dict) -> None:
        self.log(row)
        extra = "".join(f", {k} {row[k]:.4f}" for k in ("val_kl", "val_ce") if k in row)
        self.bar.write(f"step {row['step']}: val_loss {row['val_loss']:.4f} (ppl {row['val_ppl']:.2f}{extra})")
        self.plot()

    def plot(self) -> None:
        plot_losses(read_metrics(self.metrics_path), self.output_dir / "loss_curve.png")

    def abort(self) -> None:
        """A run stopped by an error or a signal: end the progress line so the message starts on its own."""
        self.bar.close()
        self.metrics.close()

    def close(self) -> None:
        self.bar.close()
        self.metrics.close()
        self.plot()
        if self.wandb is not None:
            self.wandb.finish()


class NullTracker:
    def log(self, row): ...
    def step(self, row): ...
    def eval(self, row): ...
    def plot(self): ...
    def close(self): ...
    def abort(self): ...
