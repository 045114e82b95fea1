"""`tunekit train`: compose and check the config, then run the training loop once or per sweep job.

A bare @hydra.main console script would reject the word `train`, so the dispatcher strips it and
hands the rest here. A single run made of key=value overrides alone (no flag, no hydra.* key)
trains the checked config directly: Hydra's entry point would compose it twice more (~0.3 s) to do
nothing else, as recipes/train.yaml turns off its logging, output folders and chdir. Sweeps, flags
and hydra.* overrides go through Hydra, which keeps every feature (-m sweeps, --cfg job, --help).
"""

from __future__ import annotations

import logging
import signal
import sys
from pathlib import Path

from tunekit import TunekitError
from tunekit.commands.compose import (CONFIG_MODULE, HYDRA_WORDS, PASSTHROUGH, check_flags, check_overrides,
                                      sweep_dir_override)
from tunekit.commands.parse import fail

log = logging.getLogger("tunekit")


class Terminated(KeyboardInterrupt):
    """SIGTERM, turned into the same unwinding as Ctrl-C so temp folders are cleaned up."""


def _raise_terminated(signum, frame) -> None:
    raise Terminated()


def _train_job(cfg) -> None:
    """Hydra's task function: one job of a sweep, or a single run that needs Hydra (see main)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import OmegaConf

    obj = OmegaConf.to_object(cfg)
    output_dir = Path(obj.output_dir)
    hc = HydraConfig.get()
    if hc.mode == RunMode.MULTIRUN:
        output_dir = output_dir / str(hc.job.num)
        log.info("sweep job %d: %s -> %s", hc.job.num, " ".join(hc.overrides.task) or "(defaults)", output_dir)
    _train(obj, output_dir)


def _train(obj, output_dir: Path) -> None:
    """Train one validated TrainConfig into output_dir; errors and signals end as one line."""
    from tunekit.train.checks import check_trainable, validate
    from tunekit.train.loop import TrainRecipe

    recipe = TrainRecipe(obj, output_dir)
    previous = signal.signal(signal.SIGTERM, _raise_terminated)  # schedulers stop jobs with SIGTERM
    try:
        validate(obj)  # again: files may have changed since check_overrides (its costly parts are cached)
        check_trainable(obj)
        recipe.setup()
        summary = recipe.train()
    except BaseException as e:
        _stop(recipe, e, output_dir)
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
        # Whatever the way out: the next run may use output_dir at once (process death drops the lock too).
        recipe.release()
    if recipe.main:
        _report_done(summary, output_dir)
    recipe.cleanup()


def _stop(recipe, e: BaseException, output_dir: Path) -> None:
    """A run that stops on `e`: one line and exit where it is known, else `e` goes on (a bug's traceback).

    With several ranks, an error that came from another rank (a collective whose peer failed or died,
    the launcher's SIGTERM after it) ends this rank with the line naming that rank, exit status 1;
    this rank's own error is told to the others first (tunekit.train.peers)."""
    if isinstance(e, SystemExit):
        return
    line = recipe.stopped_by_peer(e)
    if line is not None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the launcher stops the others too: this line stands
        fail(line, code=1)
    recipe.announce(e)
    if isinstance(e, TunekitError):  # also where Hydra runs the job: report it ourselves, as one line
        fail(str(e))
    if isinstance(e, KeyboardInterrupt):  # SIGINT, or SIGTERM through _raise_terminated
        # Whatever was being written when the signal came was in a temp folder, removed on the way out.
        from tunekit.train.checkpoint import latest_checkpoint

        last = latest_checkpoint(output_dir)
        where = (f"the last checkpoint is {last.name}: resume with output_dir={output_dir} trainer.resume=true"
                 if last else "no checkpoint was saved yet; start again to train")
        name, code = ("SIGTERM", 143) if isinstance(e, Terminated) else ("SIGINT", 130)
        fail(f"interrupted by {name}; {where}", code=code)


def _report_done(summary: dict, output_dir: Path) -> None:
    changes = []
    for name in ("loss", "kl", "ce"):
        first, last = summary.get(f"first_val_{name}"), summary.get(f"last_val_{name}")
        if last is not None:
            changes.append(f"val {name} {'n/a (resumed)' if first is None else f'{first:.4f}'} -> {last:.4f}")
    for name in ("accuracy", "exact_match"):  # trainer.eval_task
        first, last = summary.get(f"first_val_{name}"), summary.get(f"last_val_{name}")
        if last is not None:
            was = "n/a (resumed)" if first is None else f"{100 * first:.1f}%"
            changes.append(f"{name.replace('_', ' ')} {was} -> {100 * last:.1f}%")
    log.info("done in %.0f s: %s; outputs in %s", summary["wall_s"], ", ".join(changes), output_dir)


def main(argv: list[str]) -> None:
    import hydra

    from tunekit.commands.compose import register_schema

    check_flags(argv)
    if not PASSTHROUGH.intersection(argv):
        configs = check_overrides(argv)
        if not any(arg.startswith(HYDRA_WORDS) for arg in argv):
            (cfg,) = configs  # without -m, one job
            _train(cfg, Path(cfg.output_dir))
            return
        argv = [*argv, *sweep_dir_override(argv, configs)]
    register_schema()
    job = hydra.main(version_base="1.3", config_path=f"pkg://{CONFIG_MODULE}", config_name="train")(_train_job)
    sys.argv = ["tunekit train", *argv]
    job()

