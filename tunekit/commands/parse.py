"""argparse for the subcommands, with tunekit's error contract: one `tunekit: error:` line, exit 2.

A bare ArgumentParser prints its whole usage block before the error; for a user that is several
lines where one naming the argument says more.
"""

from __future__ import annotations

import argparse
import sys

from tunekit import TunekitError
from tunekit.checks import number


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are a TunekitError: `tunekit: error: <prog words>: <message>`."""

    def error(self, message: str):
        command = self.prog.removeprefix("tunekit ").strip()
        raise TunekitError(f"{command}: {message} (see {self.prog} --help)")


def check_number(parser: argparse.ArgumentParser, option: str, value, **bounds) -> None:
    """A numeric option against its range, as a parser error (`plan: --memory: must be > 0 GiB and finite,
    got nan`). The same check as the config keys' (tunekit.checks.number): argparse's float() takes
    "nan", "inf" and negatives, and a NaN passes every `not (x > 0)`-style test. None (an option left
    out) passes. `bounds`: number()'s gt, ge, lt, le, allow_inf, unit."""
    if value is None:
        return
    try:
        number(option, value, **bounds)
    except TunekitError as e:
        parser.error(str(e))


def add_device_argument(parser: argparse.ArgumentParser) -> None:
    """--device, the same for every command that runs a model (tunekit.device.facts.command_device)."""
    parser.add_argument("--device", metavar="D", default="auto",
                        help="where the model runs: auto (default: the first GPU, else the CPU), cpu, cuda or "
                             "cuda:N; the compute dtype follows the device (bf16 where native, else fp32)")


def fail(msg: str, code: int = 2) -> None:
    """End the command with one `tunekit: error:` line on stderr."""
    print(f"tunekit: error: {msg}", file=sys.stderr)
    sys.exit(code)
