"""What the trainer shows and keeps at every evaluation, beyond the held-out loss.

TrainingProbe   a few fixed held-out prompts with the model's greedy answer and the reference
                (trainer.eval_samples), and with trainer.eval_task the task metric (exact match;
                accuracy by likelihood over a closed answer set) on the first trainer.eval_task_rows
                held-out rows. The same rows every time, so a reader sees the answers change.
BestKeeper      trainer.keep_best: the adapter of the best evaluation so far in output_dir/best/
                (adapter/ + best.json), which becomes output_dir/adapter/ at the end; the last
                state stays in checkpoints/.

Both take plain values (the recipe reads the config) and run on rank 0 only.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable, Optional

from tunekit import TunekitError
from tunekit.infer.rows import closed_set, task_rows, user_text

# metric -> True when lower is better
METRICS = {"val_loss": True, "val_accuracy": False, "val_exact_match": False}


class TrainingProbe:
    def __init__(self, tokenizer, val_data: list[dict], samples: int, task: bool, task_rows_max: int,
                 max_new_tokens: int, batch_size: int):
        rows, _ = task_rows(val_data, tokenizer)
        self.tokenizer, self.batch_size, self.n_samples = tokenizer, batch_size, samples
        self.rows = rows[:task_rows_max] if task else rows[:samples]
        self.task = task and bool(self.rows)
        self.classes = closed_set(self.rows) if self.task else None
        longest = max((len(r.answer) for r in self.rows), default=1)
        self.max_new_tokens = max(1, min(max_new_tokens, longest + 4))

    @property
    def active(self) -> bool:
        return bool(self.rows)

    @property
    def task_metric(self) -> Optional[str]:
        """The metric keep_best=auto follows: accuracy over a closed set, else exact match."""
        if not self.task:
            return None
        return "val_accuracy" if self.classes is not None else "val_exact_match"

    def __call__(self, model) -> tuple[dict, list[dict]]:
        """(task metrics for the eval row, the sample answers)."""
        from tunekit.infer.score import score_rows

        if not self.rows:
            return {}, []
        rows = self.rows if self.task else self.rows[:self.n_samples]
        result = score_rows(model, self.tokenizer, rows, self.classes, self.batch_size, self.max_new_tokens)
        metrics = {}
        if self.task:
            m = result.metrics
            metrics = {"val_exact_match": m["exact_match"], "val_task_rows": m["rows"]}
            if "accuracy" in m:
                metrics["val_accuracy"] = m["accuracy"]
        samples = [{"prompt": user_text(self.tokenizer, r.prompt), "answer": res.answer, "reference": r.reference,
                    "exact": res.exact} for r, res in list(zip(rows, result.rows))[:self.n_samples]]
        return metrics, samples


class BestKeeper:
    """Keeps output_dir/best/{adapter/, best.json} at the best value of `metric` seen so far."""

    def __init__(self, output_dir: Path, metric: str, start_step: int):
        if metric not in METRICS:
            raise TunekitError(f"trainer.best_metric: unknown {metric!r}; choose one of auto, {', '.join(METRICS)}")
        self.dir, self.metric, self.lower = Path(output_dir) / "best", metric, METRICS[metric]
        self.step: Optional[int] = None
        self.value: Optional[float] = None
        saved = self.dir / "best.json"
        if saved.is_file():
            state = json.loads(saved.read_text())
            # A best recorded after the checkpoint we resume from belongs to steps that will be redone.
            if state.get("metric") == metric and state.get("step", 1 << 62) <= start_step:
                self.step, self.value = state["step"], state["value"]
            else:
                shutil.rmtree(self.dir, ignore_errors=True)

    def update(self, step: int, metrics: dict, save_adapter: Callable[[Path], None]) -> bool:
        """Record this evaluation; save the adapter when it beats the best so far. True if it did."""
        from tunekit.train.checkpoint import atomic_dir, atomic_write_text

        value = metrics.get(self.metric)
        if value is None:
            raise TunekitError(f"trainer.best_metric: {self.metric} is not measured at step {step} "
                               "(accuracy and exact match need trainer.eval_task=true)")
        if self.value is not None and not (value < self.value if self.lower else value > self.value):
            return False
        self.dir.mkdir(parents=True, exist_ok=True)
        atomic_dir(self.dir / "adapter", save_adapter)
        atomic_write_text(self.dir / "best.json", json.dumps({"step": step, "metric": self.metric, "value": value}))
        self.step, self.value = step, value
        return True

    @property
    def adapter_dir(self) -> Optional[Path]:
        return self.dir / "adapter" if self.step is not None else None

    def summary(self) -> dict:
        return {"best_step": self.step, "best_metric": self.metric, "best_value": self.value}


def resolve_best_metric(name: str, probe: Optional[TrainingProbe]) -> str:
    """auto: the task metric when trainer.eval_task measures one, else val_loss."""
    if name != "auto":
        return name
    return (probe.task_metric if probe is not None else None) or "val_loss"
