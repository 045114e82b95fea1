"""A stand-in for `tunekit.commands.main` in tests/commands/test_children.py: says what it was given, then ends as told.

    python -m _child_probe exit 3 | exit "a message" | return 4 | raise | sleep SECONDS | read | grow MIB
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import time


def main(argv: list[str]) -> int | None:
    print(json.dumps({"argv": argv, "sys_argv_rest": sys.argv[1:], "cwd": os.getcwd(),
                      "env": {k: v for k, v in os.environ.items() if k.startswith("PROBE_")},
                      "faulthandler": faulthandler.is_enabled(), "uid": os.getuid()}), flush=True)
    print("probe: to stderr", file=sys.stderr, flush=True)
    what = argv[0]
    if what == "sleep":
        time.sleep(float(argv[1]))
    elif what == "exit":
        sys.exit(int(argv[1]) if argv[1].lstrip("-").isdigit() else argv[1])
    elif what == "return":  # an int from main: the status, as `sys.exit(main(argv))` gives
        return int(argv[1])
    elif what == "raise":
        raise RuntimeError("probe: boom")
    elif what == "grow":  # hold MIB more resident memory for a moment (every page written)
        block = bytearray(int(argv[1]) << 20)
        block[::4096] = b"x" * len(block[::4096])
    elif what == "read":  # echo stdin
        print(json.dumps({"stdin": sys.stdin.read()}), flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
