"""What a run shows and keeps: progress bar, metrics.jsonl, loss-curve PNG, optional W&B.

Only rank 0 builds a Tracker; the other ranks get `NullTracker`, so no file is written twice.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Optional

from tunekit import TunekitError
from tunekit.infer.report import distinct_parts


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


def check_metrics(path: Path) -> None:
    """A resumed run rewrites metrics.jsonl without the rows after its checkpoint: refuse, naming the
    file and line, one it could not read back whole (not UTF-8 text, a row that is not an object),
    before anything loads and before it is rewritten. A line cut by a crash stays allowed."""
    path = Path(path)
    if not path.exists():
        return
    if not path.is_file():
        raise TunekitError(f"{path}: not a file; move it out of the run folder to resume")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        line = path.read_bytes()[: e.start].count(b"\n") + 1
        raise TunekitError(f"{path}: line {line}: not UTF-8 text (byte 0x{path.read_bytes()[e.start]:02x}); "
                           "this is not the metrics.jsonl tunekit writes: fix or move it to resume") from None
    except OSError as e:
        raise TunekitError(f"{path}: cannot read ({e.strerror or e})") from None
    for number, line in enumerate(text.splitlines(), 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a crash: dropped when the file is rewritten
        if not isinstance(row, dict):
            raise TunekitError(f"{path}: line {number}: a JSON {type(row).__name__}, not an object; this is not "
                               "the metrics.jsonl tunekit writes: fix or move it to resume")


def smooth(values: list[float], weight: float = 0.9) -> list[float]:
    """Exponential moving average with bias correction (TensorBoard's smoothing): the first points
    are not pulled toward 0, and a flat series stays flat."""
    out, avg = [], 0.0
    for i, v in enumerate(values, start=1):
        avg = weight * avg + (1 - weight) * v
        out.append(avg / (1 - weight**i))
    return out


PREFERENCE_EVAL = ("val_rewards/chosen", "val_rewards/rejected", "val_rewards/accuracies", "val_rewards/margins")
TASK_METRICS = {"val_accuracy": "accuracy (likelihood)", "val_exact_match": "exact match"}


def plot_losses(rows: list[dict], out: Path) -> None:
    """Training loss (raw, faint, and smoothed) with validation loss; a second panel for the task
    metric when the run measures one (trainer.eval_task)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    task = {k: [(r["step"], r[k]) for r in rows if k in r] for k in TASK_METRICS}
    task = {k: v for k, v in task.items() if v}
    fig, axes = plt.subplots(1, 2 if task else 1, figsize=(12 if task else 7, 4), dpi=100, squeeze=False)
    ax = axes[0][0]
    if train:
        steps, losses = zip(*train)
        ax.plot(steps, losses, color="tab:blue", alpha=0.25, linewidth=1, label="train loss (raw)")
        ax.plot(steps, smooth(list(losses)), color="tab:blue", linewidth=2, label="train loss (smoothed)")
    if val:
        ax.plot(*zip(*val), "o-", color="tab:orange", label="validation loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.grid(alpha=0.3)
    if train or val:
        ax.legend()
    if task:
        ax2 = axes[0][1]
        for key, points in task.items():
            ax2.plot(*zip(*points), "o-", label=TASK_METRICS[key])
        ax2.set_xlabel("optimizer step")
        ax2.set_ylabel("held-out task metric")
        ax2.set_ylim(-0.02, 1.02)
        ax2.grid(alpha=0.3)
        ax2.legend()
    fig.tight_layout()
    from tunekit.owned import atomic_write

    try:
        atomic_write(Path(out), fig.savefig)  # a marked scratch file, not a fixed name a user file could have
    finally:
        plt.close(fig)


def _clip(text: str, width: int) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= width else text[:width - 1] + "…"




class Tracker:
    # Drawing loss_curve.png costs a noticeable fraction of a second of CPU (matplotlib). An evaluation
    # redraws it only when the last drawing is this old, so a run that evaluates every few seconds does
    # not spend a share of its time on PNGs; the end of a run, finished or stopped, always draws what
    # was logged.
    REDRAW_AFTER_S = 30.0

    def __init__(self, output_dir: Path, total_steps: int, start_step: int, tracker: str, project: str,
                 run_name: Optional[str], config: dict, epochs: Optional[float] = None, first_epoch: float = 0.0):
        """`epochs`: trainer.epochs where it sized the run; the bar shows "epoch 1.4/3" (without it,
        "epoch 1.4"), from each step's row and `first_epoch` (where a resumed run starts) at first."""
        from tqdm import tqdm

        self.output_dir = Path(output_dir)
        self.drawn_at = time.monotonic()  # the start counts as a drawing: one point is no curve
        self.undrawn = False  # rows logged since the last drawing
        self.metrics_path = self.output_dir / "metrics.jsonl"
        self._truncate_after(start_step)
        self.metrics = open(self.metrics_path, "a")
        self.epochs = epochs
        self.bar = tqdm(total=total_steps, initial=start_step, desc=self.epoch_label(first_epoch), unit="step",
                        dynamic_ncols=True, file=sys.stderr, mininterval=1.0)
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

    def epoch_label(self, epoch: float) -> str:
        return f"epoch {epoch:.1f}" + (f"/{self.epochs:g}" if self.epochs is not None else "")

    def step(self, row: dict) -> None:
        self.log(row)
        if "epoch" in row:
            self.bar.set_description(self.epoch_label(row["epoch"]), refresh=False)
        # preference objectives: reward accuracy (pairs only) and margin
        extra = {name: f"{row[k]:.3f}" for name, k in (("acc", "rewards/accuracies"), ("margin", "rewards/margins"))
                 if k in row}
        self.bar.set_postfix(loss=f"{row['loss']:.3f}", **extra, tok_s=f"{row['tokens_per_s']:.0f}", refresh=False)
        self.bar.update(1)

    def eval(self, row: dict) -> None:
        self.log(row)
        extra = "".join(f", {k} {row[k]:.4f}" for k in ("val_kl", "val_ce") if k in row)
        extra += "".join(f", {k.removeprefix('val_')} {row[k]:.4f}" for k in PREFERENCE_EVAL if k in row)
        task = "".join(f", {name.split(' ')[0]} {100 * row[k]:.1f}%" for k, name in TASK_METRICS.items() if k in row)
        task += f" on {row['val_task_rows']} rows" if task else ""
        own = [f"{k[len('eval/'):-len('/loss')]} {v:.4f}" for k, v in row.items()
               if k.startswith("eval/") and k.endswith("/loss")]
        task += f"; per source: {', '.join(own)}" if own else ""  # a list of sources (tunekit.data.mixture)
        ppl = f"ppl {row['val_ppl']:.2f}" if "val_ppl" in row else "mean per pair, KTO: per row"
        self.bar.write(f"step {row['step']}: val_loss {row['val_loss']:.4f} ({ppl}{extra}){task}")
        self.undrawn = True
        if time.monotonic() - self.drawn_at >= self.REDRAW_AFTER_S:
            self.plot()

    def samples(self, step: int, samples: list[dict]) -> None:
        """Held-out prompts with the model's greedy answer and the reference: one line each, a
        metrics.jsonl row {"step", "samples": [...]}, and a W&B table."""
        if not samples:
            return
        for s, prompt in zip(samples, distinct_parts([s["prompt"] for s in samples])):
            mark = "ok" if s["exact"] else " x"
            self.bar.write(f"  [{mark}] {_clip(prompt, 50)!r} -> {_clip(s['answer'], 40)!r} "
                           f"(ref {_clip(s['reference'], 30)!r})")
        self.metrics.write(json.dumps({"step": step, "samples": samples}) + "\n")
        self.metrics.flush()
        if self.wandb is not None:
            import wandb

            table = wandb.Table(columns=["step", "prompt", "answer", "reference", "exact"],
                                data=[[step, s["prompt"], s["answer"], s["reference"], s["exact"]] for s in samples])
            self.wandb.log({"samples": table}, step=step)

    def plot(self) -> None:
        plot_losses(read_metrics(self.metrics_path), self.output_dir / "loss_curve.png")
        self.drawn_at, self.undrawn = time.monotonic(), False

    def abort(self) -> None:
        """A run stopped by an error or a signal: end the progress line so the message starts on its
        own, and draw the evaluations not drawn yet (never at the cost of the error being reported)."""
        self.bar.close()
        self.metrics.close()
        if self.undrawn:
            try:
                self.plot()
            except Exception as e:  # e.g. the disk that stopped the run is full
                log.debug("loss curve not redrawn: %s", e)

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
    def samples(self, step, samples): ...
    def plot(self): ...
    def close(self): ...
    def abort(self): ...
