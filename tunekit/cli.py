"""`tunekit` command line: a small argparse dispatcher in front of Hydra.

`tunekit train recipe=qlora trainer.max_steps=10` -> Hydra composes recipes/ with the overrides.
A bare @hydra.main console script would reject the word `train`, so we strip it and hand the
rest to the Hydra entry point, which keeps every Hydra feature (-m sweeps, --cfg job, --help).

Before Hydra runs, the overrides are composed once with Hydra's compose API and validated, so
that a typo, an unknown recipe or a wrong type ends in one line naming the culprit instead of a
multi-line Hydra report or, worse, a traceback after minutes of model loading. A single run made
of key=value overrides alone (no flag, no hydra.* key) then trains that checked config directly:
Hydra's entry point would compose it twice more (~0.3 s) to do nothing else, as recipes/train.yaml
turns off its logging, output folders and chdir. Sweeps, flags and hydra.* overrides go through it.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import sys
import warnings
from pathlib import Path

from tunekit import TunekitError, __version__
from tunekit.threads import openmp_env

log = logging.getLogger("tunekit")
PASSTHROUGH = {"--help", "-h", "--hydra-help", "--shell-completion", "-sc"}
CONFIG_MODULE = "tunekit_recipes"


def _setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="[tunekit] %(message)s", stream=sys.stderr)
    # Libraries' own chatter (deprecation notes, per-tensor progress bars) buries our lines.
    for name in ("transformers", "peft", "accelerate", "datasets", "bitsandbytes", "httpx", "urllib3", "huggingface_hub"):
        logging.getLogger(name).setLevel(logging.ERROR)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass


def fail(msg: str, code: int = 2) -> None:
    print(f"tunekit: error: {msg}", file=sys.stderr)
    sys.exit(code)


def _hydra_message(err: Exception) -> str:
    """Boil a Hydra/OmegaConf composition error down to one line naming the key or group."""
    from hydra.errors import MissingConfigException

    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if isinstance(err, MissingConfigException) and "Could not find" in first:
        options = list(getattr(err, "options", None) or [])
        hint = f"; available: {', '.join(options)}" if options else ""
        what = first.split(":", 1)[-1].strip()  # "Could not find 'recipe/nope'"
        group = what.split("'")[1].rsplit("/", 1)[0] if what.count("'") >= 2 and "/" in what else None
        return (f"{group}: " if group else "") + what + hint
    cause = err.__cause__ if getattr(err.__cause__, "full_key", None) else err  # OmegaConf errors carry the key
    key = getattr(cause, "full_key", None)
    if key:
        # "Value 'abc' of type 'str' could not be converted to Integer" -> "trainer.max_steps: ..."
        reason = str(cause).strip().splitlines()[0]
        if "not in" in reason:  # unknown key
            return f"{key}: unknown config key ({reason})"
        if "is not a ListConfig" in reason:
            return f"{key}: must be a list, e.g. {key}=[a,b] ({reason})"
        return f"{key}: {reason}"
    return " ".join(ln.strip() for ln in str(err).splitlines()[:2] if ln.strip())


# Hydra flags that take a value; they and their value are Hydra's business, not overrides.
FLAGS_WITH_VALUE = {"--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn",
                    "--config-dir", "-cd", "--experimental-rerun", "--info", "-i"}


HYDRA_FLAGS = PASSTHROUGH | FLAGS_WITH_VALUE | {"--multirun", "-m", "--run", "-r", "--resolve", "--version"}
# Words of a train command line that are Hydra's own (flags, hydra.* keys), not tunekit's overrides.
HYDRA_WORDS = ("-", "hydra.", "hydra/", "+hydra", "~hydra")


def check_flags(argv: list[str]) -> None:
    """Hydra's argparse answers an unknown flag with its usage text: say it in one line instead."""
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg.startswith("-"):
            flag = arg.split("=", 1)[0]
            if flag not in HYDRA_FLAGS:
                raise TunekitError(f"{flag}: unknown flag; train takes key=value overrides (e.g. "
                                   "trainer.max_steps=10) and Hydra's flags (-m, --cfg job, --help)")
            skip = flag in FLAGS_WITH_VALUE and "=" not in arg


def split_overrides(argv: list[str]) -> list[str]:
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in FLAGS_WITH_VALUE:
            skip = True
        elif not arg.startswith(HYDRA_WORDS):
            out.append(arg)
    return out


def parse_overrides(overrides: list[str], multirun: bool) -> list:
    """Hydra's parse of each override, one at a time, so that a parse error names its key.

    Outside -m, a value with an unquoted comma (data.path=a,b.jsonl) parses as a sweep over
    ['a', 'b.jsonl']; Hydra then fails with "Ambiguous value", and before that our per-job check
    would report the truncated path 'a'. Say what happened and how to quote instead.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    parsed = []
    for text in overrides:
        key, eq, value = text.partition("=")
        try:
            [override] = parser.parse_overrides([text])
        except Exception as e:  # OverrideParseException, with the grammar's complaint on its 2nd line
            if not eq:
                raise TunekitError(f"{text}: not a key=value override (e.g. trainer.max_steps=10)") from None
            lines = [ln.strip() for ln in str(e).splitlines() if ln.strip() and not ln.startswith("See https")]
            reason = next((ln for ln in lines if not ln.startswith("Error parsing override")), "syntax error")
            raise TunekitError(f"{key}: cannot parse the value {value!r} ({reason}); quote it: '{key}=\"{value}\"'"
                               ) from None
        if override.is_sweep_override() and not multirun:
            what = "an unquoted comma, which Hydra reads as several values to sweep" if "," in value \
                else "a sweep (several values)"
            raise TunekitError(f"{override.key_or_group}: the value {value!r} holds {what}; quote it "
                               f"('{key}=\"{value}\"') or pass -m to run a sweep")
        parsed.append(override)
    return parsed


def _schema_has(key: str) -> bool:
    """Whether a dotted key names a field of the TrainConfig schema (at any depth)."""
    import dataclasses

    from tunekit.config import TrainConfig

    node = TrainConfig
    for part in key.split("."):
        fields = {f.name: f for f in dataclasses.fields(node)} if dataclasses.is_dataclass(node) else {}
        if part not in fields:
            return False
        f = fields[part]
        node = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        node = type(node) if dataclasses.is_dataclass(node) else node
    return True


def check_added_keys(parsed: list) -> None:
    """`+key=value` and `++key=value` make Hydra add a key the schema lacks instead of refusing it,
    and OmegaConf.to_object then drops it without a word: a typo such as +trainer.lr_typo=1 would
    train with the default lr. Only keys of the schema (or a config group: +tracker=wandb) pass."""
    from importlib.resources import files

    groups = {p.name for p in files(CONFIG_MODULE).iterdir() if p.is_dir() and not p.name.startswith("_")}
    for override in parsed:
        if not (override.is_add() or override.is_force_add()):
            continue
        key = override.key_or_group
        if key.split("/")[0] in groups and "." not in key or key.startswith(HYDRA_WORDS[1:]):
            continue
        if not _schema_has(key):
            raise TunekitError(f"{key}: unknown config key (the + prefix adds a key, but tunekit reads only the "
                               "keys of its schema: tunekit train --help lists them)")


def is_multirun(argv: list[str]) -> bool:
    return bool({"-m", "--multirun"} & set(argv))


def compose_configs(overrides: list[str]) -> list:
    """Compose every job of the command line (each point of a -m sweep) and validate it.

    Returns the validated TrainConfig objects; `tunekit plan` plans them, `train` checks them.
    """
    from hydra import compose, initialize_config_module
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from omegaconf import OmegaConf

    from tunekit.config import register_schema, validate

    mine = split_overrides(overrides)
    register_schema()
    parsed = parse_overrides(mine, multirun=is_multirun(overrides))
    check_added_keys(parsed)
    try:
        jobs = [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]
        with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
            configs = [OmegaConf.to_object(compose(config_name="train", overrides=job)) for job in jobs]
    except Exception as e:  # Hydra and OmegaConf raise a dozen types; all mean "bad config"
        raise TunekitError(_hydra_message(e)) from None
    for cfg in configs:  # outside the handler above: a TunekitError here already names its culprit
        validate(cfg)
    return configs


def check_overrides(overrides: list[str]) -> list:
    """Compose and validate every job of a `train` command line, before Hydra runs it."""
    from tunekit.config import check_trainable

    configs = compose_configs(overrides)
    for cfg in configs:
        check_trainable(cfg)
    return configs


def sweep_dir_override(argv: list[str], configs: list) -> list[str]:
    """Where a -m sweep's jobs share one output_dir (job N runs in output_dir/N), Hydra's record of
    the sweep (multirun.yaml) goes there too, not into the working directory (hydra.sweep.dir is
    "." so that Hydra makes no folder of its own). Nothing if the user set it or the jobs differ.

    The default output_dir (runs/<time>) is pinned to its value now: each job would otherwise
    read the clock when it starts, and a sweep would scatter over several runs/<time> folders."""
    if not is_multirun(argv) or any(a.startswith("hydra.sweep.dir=") for a in argv):
        return []
    roots = {str(cfg.output_dir) for cfg in configs}
    root = roots.pop() if len(roots) == 1 else None
    if root is None or not re.fullmatch(r"[\w./-]+", root):  # one that needs no quoting in an override
        return []
    pin = [] if any(a.startswith("output_dir=") for a in argv) else [f"output_dir={root}"]
    return [f"hydra.sweep.dir={root}", *pin]


class Terminated(KeyboardInterrupt):
    """SIGTERM, turned into the same unwinding as Ctrl-C so temp folders are cleaned up."""


def _raise_terminated(signum, frame) -> None:
    raise Terminated()


def _train_job(cfg) -> None:
    """Hydra's task function: one job of a sweep, or a single run that needs Hydra (see run_train)."""
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
    from tunekit.config import check_trainable, validate
    from tunekit.recipe import TrainRecipe

    recipe = TrainRecipe(obj, output_dir)
    previous = signal.signal(signal.SIGTERM, _raise_terminated)  # schedulers stop jobs with SIGTERM
    try:
        validate(obj)  # again: files may have changed since check_overrides (its costly parts are cached)
        check_trainable(obj)
        recipe.setup()
        summary = recipe.train()
    except TunekitError as e:  # also where Hydra runs the job: report it ourselves, as one line
        fail(str(e))
    except KeyboardInterrupt as e:  # SIGINT, or SIGTERM through _raise_terminated
        # Whatever was being written when the signal came was in a temp folder, removed on the way out.
        from tunekit.checkpoint import latest_checkpoint

        last = latest_checkpoint(output_dir)
        where = (f"the last checkpoint is {last.name}: resume with output_dir={output_dir} trainer.resume=true"
                 if last else "no checkpoint was saved yet; start again to train")
        name, code = ("SIGTERM", 143) if isinstance(e, Terminated) else ("SIGINT", 130)
        fail(f"interrupted by {name}; {where}", code=code)
    finally:
        signal.signal(signal.SIGTERM, previous)
        # Whatever the way out: the next run may use output_dir at once (process death drops the lock too).
        recipe.release()
    if recipe.main:
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
    recipe.cleanup()


def run_train(argv: list[str]) -> None:
    import hydra

    from tunekit.config import register_schema

    check_flags(argv)
    if not PASSTHROUGH.intersection(argv):
        configs = check_overrides(argv)
        if not any(arg.startswith(HYDRA_WORDS) for arg in argv):
            (cfg,) = configs  # without -m, one job
            _train(cfg, Path(cfg.output_dir))
            return
        argv = [*argv, *sweep_dir_override(argv, configs)]
    register_schema()
    main = hydra.main(version_base="1.3", config_path=f"pkg://{CONFIG_MODULE}", config_name="train")(_train_job)
    sys.argv = ["tunekit train", *argv]
    main()


# Subcommands other than train: name -> ("module:function", help). Each function takes argv
# (the words after the subcommand) and parses them itself; the module is imported on use.
COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("tunekit.generate_cli:main",
                 "greedy answers from a run, adapter or model folder (rows may mix soft prompts or LoRA "
                 "adapters): tunekit generate --help"),
    "chat": ("tunekit.chat:main", "talk to what you trained (chat template, streaming, history): tunekit chat RUN"),
    "eval": ("tunekit.taskeval.cli:main",
             "score a run on held-out rows (loss, exact match, accuracy; --base side by side): tunekit eval RUN"),
    "export": ("tunekit.export:main",
               "adapter | merged HF model | GGUF, each checked against the trained model: tunekit export --help"),
    "doctor": ("tunekit.doctor:main",
               "check this build on this machine (kernels, fused vs peft training, resume, export): a report"),
    "plan": ("tunekit.plan.report:main",
             "will it fit? peak memory and FLOPs of a training step, nothing loaded: tunekit plan --help"),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tunekit",
        description="Parameter-efficient fine-tuning of causal LMs (QLoRA, LoRA, ...).",
        epilog=(
            "examples:\n"
            "  tunekit train recipe=qlora                       # QLoRA on the embedded default model/data\n"
            "  tunekit train recipe=lora trainer.max_steps=20 output_dir=runs/x\n"
            "  tunekit train recipe=qlora data.path=my.jsonl model.path=/models/llama\n"
            "  tunekit train -m recipe=qlora,lora               # a Hydra sweep\n"
            "  tunekit train recipe=qlora --cfg job             # print the resolved config\n"
            "  tunekit plan recipe=qlora model.preset=llama-3-8b --device cuda --memory 24   # will it fit?\n"
            "  tunekit train --help                             # all config groups and keys"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"tunekit {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser("train", help="fine-tune: tunekit train recipe=NAME [key=value ...] (Hydra overrides)",
                   add_help=False)
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return p


def main(argv: list[str] | None = None) -> None:
    # Before anything imports torch: libgomp reads how its threads wait once, at that import.
    os.environ.update(openmp_env(os.environ, torch_loaded="torch" in sys.modules))
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv or argv[0] in ("-h", "--help", "--version"):
        parser.parse_args(argv or ["--help"])
        return
    command, rest = argv[0], argv[1:]
    if command != "train" and command not in COMMANDS:
        fail(f"{command}: unknown command (choose from: {', '.join(['train', *COMMANDS])}; tunekit --help)")
    _setup_logging()
    try:
        if command == "train":
            run_train(rest)
        else:
            import importlib

            module, func = COMMANDS[command][0].split(":")
            getattr(importlib.import_module(module), func)(rest)
    except TunekitError as e:
        fail(str(e))


if __name__ == "__main__":
    main()
