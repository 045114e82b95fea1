"""`python -c CODE ARGS...` for the GPU check's dry run: its snippet stages (env, models) run as a
fork of the dry run's server (scripts/gpu_check.py), which imported torch and transformers once."""

from __future__ import annotations

import sys


def main(argv: list[str]) -> None:
    code, sys.argv = argv[0], ["-c", *argv[1:]]
    exec(compile(code, "<gpu_check stage>", "exec"), {"__name__": "__main__"})
