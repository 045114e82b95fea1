"""What a run shows and keeps while it trains (tunekit.train.tracking, tunekit.train.task_eval): the
loss-curve plot and when it is redrawn, and the keeper of the best evaluation across a resume."""

from __future__ import annotations

import pytest


def test_smooth_and_two_panel_plot(tmp_path):
    from PIL import Image

    from tunekit.train.tracking import plot_losses, smooth

    assert smooth([2.0] * 5) == pytest.approx([2.0] * 5)
    assert smooth([4.0, 0.0])[0] == 4.0 and 0 < smooth([4.0, 0.0])[1] < 4.0
    rows = [{"step": s, "loss": 3 - s / 10} for s in range(1, 11)] + [{"step": 10, "val_loss": 2.0}]
    plot_losses(rows, tmp_path / "one.png")
    plot_losses(rows + [{"step": 10, "val_loss": 2.0, "val_accuracy": 0.5}], tmp_path / "two.png")
    assert Image.open(tmp_path / "one.png").size == (700, 400)
    assert Image.open(tmp_path / "two.png").size == (1200, 400)  # the task metric's own panel


def test_loss_curve_is_redrawn_when_old_and_always_at_the_end(tmp_path, monkeypatch):
    """An evaluation redraws loss_curve.png only once the last drawing is REDRAW_AFTER_S old; close()
    always draws, and abort() draws what was logged since the last drawing."""
    import tunekit.train.tracking as tracking

    clock = [1000.0]
    monkeypatch.setattr(tracking.time, "monotonic", lambda: clock[0])
    drawn = []
    monkeypatch.setattr(tracking, "plot_losses", lambda rows, out: drawn.append([r["step"] for r in rows]))

    for run in "abcd":
        (tmp_path / run).mkdir()

    def evaluate(tracker, step):
        tracker.step({"step": step, "loss": 3.0, "tokens_per_s": 1.0})
        tracker.eval({"step": step, "val_loss": 2.0, "val_ppl": 7.4})

    t = tracking.Tracker(tmp_path / "a", 10, 0, "none", "p", None, {})
    evaluate(t, 1)
    clock[0] += t.REDRAW_AFTER_S - 1
    evaluate(t, 2)
    assert drawn == []  # two evaluations inside the first 30 s: no drawing yet
    clock[0] += 1
    evaluate(t, 3)
    assert drawn == [[1, 1, 2, 2, 3, 3]]
    evaluate(t, 4)
    assert len(drawn) == 1  # just drawn
    t.close()
    assert len(drawn) == 2 and drawn[-1][-1] == 4

    drawn.clear()
    stopped = tracking.Tracker(tmp_path / "b", 10, 0, "none", "p", None, {})
    stopped.abort()
    assert drawn == []  # nothing logged, nothing to draw
    stopped = tracking.Tracker(tmp_path / "c", 10, 0, "none", "p", None, {})
    evaluate(stopped, 1)
    stopped.abort()
    assert drawn == [[1, 1]]

    def full_disk(rows, out):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tracking, "plot_losses", full_disk)
    failing = tracking.Tracker(tmp_path / "d", 10, 0, "none", "p", None, {})
    evaluate(failing, 1)
    failing.abort()  # the run's own error is the one reported, not the drawing's


def test_best_keeper_keeps_the_best_and_survives_resume(tmp_path):
    from tunekit import TunekitError
    from tunekit.train.task_eval import BestKeeper, resolve_best_metric

    def saver(tag):
        return lambda d: (d / "w.txt").write_text(tag)

    keeper = BestKeeper(tmp_path, "val_loss", start_step=0)
    assert keeper.update(0, {"val_loss": 3.0}, saver("s0"))
    assert keeper.update(10, {"val_loss": 2.0}, saver("s10"))
    assert not keeper.update(20, {"val_loss": 2.5}, saver("s20"))
    assert not keeper.update(30, {"val_loss": 2.0}, saver("s30"))  # a tie keeps the earlier
    assert (keeper.adapter_dir / "w.txt").read_text() == "s10"
    assert keeper.summary() == {"best_step": 10, "best_metric": "val_loss", "best_value": 2.0}
    # resumed from step 20: the best of step 10 stands; from step 5: it is redone, so forgotten
    assert BestKeeper(tmp_path, "val_loss", start_step=20).step == 10
    assert BestKeeper(tmp_path, "val_loss", start_step=5).step is None and not (tmp_path / "best").exists()
    acc = BestKeeper(tmp_path, "val_accuracy", 0)
    assert acc.update(0, {"val_accuracy": 0.2}, saver("a")) and acc.update(1, {"val_accuracy": 0.4}, saver("b"))
    with pytest.raises(TunekitError, match="trainer.best_metric: val_accuracy is not measured"):
        acc.update(2, {"val_loss": 1.0}, saver("c"))
    assert resolve_best_metric("auto", None) == "val_loss"
