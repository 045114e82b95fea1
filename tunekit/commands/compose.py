"""Hydra composition for `train` and `plan`: every job of a command line, composed and validated.

`tunekit train recipe=qlora trainer.max_steps=10` -> Hydra composes recipes/ with the overrides.
Before Hydra runs, the overrides are composed once with Hydra's compose API and validated, so
that a typo, an unknown recipe or a wrong type ends in one line naming the culprit instead of a
multi-line Hydra report or, worse, a traceback after minutes of model loading.

Owns: override parsing and checking, `compose_configs`. Imports tunekit.config only; the
commands import it.
"""

from __future__ import annotations

import re

from tunekit import TunekitError

PASSTHROUGH = {"--help", "-h", "--hydra-help", "--shell-completion", "-sc"}
CONFIG_MODULE = "tunekit_recipes"


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
            several = (f"; for several datasets, give a list: '{key}=[{value}]'"
                       if override.key_or_group == "data.path" and "," in value else "")
            raise TunekitError(f"{override.key_or_group}: the value {value!r} holds {what}; quote it "
                               f"('{key}=\"{value}\"') or pass -m to run a sweep{several}")
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


def compose_configs(overrides: list[str], check=None) -> list:
    """Compose every job of the command line (each point of a -m sweep) and validate it.

    Returns the validated TrainConfig objects; `tunekit plan` plans them, `train` checks them.
    `check`: what validates each job (default tunekit.train.checks.validate, every check).
    """
    from hydra import compose, initialize_config_module
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from omegaconf import OmegaConf

    from tunekit.train.checks import validate

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
    from tunekit.methods import check_own_keys

    sweep = tuple(sorted({cfg.method.name for cfg in configs}))
    given = {o.lstrip("+~").split("=")[0].removeprefix("method.") for o in mine if o.lstrip("+~").startswith("method.")}
    for cfg in configs:  # outside the handler above: a TunekitError here already names its culprit
        check_own_keys(cfg.method, sweep, given)  # a method key on the command line no method of it reads
        (check or validate)(cfg)
    return configs


def check_overrides(overrides: list[str]) -> list:
    """Compose and validate every job of a `train` command line, before Hydra runs it."""
    from tunekit.train.checks import check_trainable

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


def register_schema() -> None:
    """Make the config's schema (tunekit.methods.train_schema: TrainConfig with every method's keys
    in its method node) available to the defaults list of recipes/train.yaml as `train_schema`. Once
    a process: building the structured config takes ~65 ms, and Hydra hands each compose a deep
    copy anyway."""
    from hydra.core.config_store import ConfigStore

    from tunekit.methods import train_schema

    store = ConfigStore.instance()
    if "train_schema.yaml" not in store.repo:
        store.store(name="train_schema", node=train_schema())
