"""The `main` of a gloo rank forked from the tests' fork server (tests/_helpers.fork_ranks): calls
fn(rank, *args) from the pickled (fn, args) its one argument holds (a test module's own function,
never a user's file), rank from TUNEKIT_TEST_RANK; exit status 0 when it returns, 1 with its
traceback when it raises (tunekit.commands.forkserver's child)."""

from __future__ import annotations

import os
import pickle
import sys
from pathlib import Path


def main(argv: list[str]) -> None:
    # the test module's own imports (tests/_helpers.py): tests/ on this child's path only, not the server's
    sys.path.append(str(Path(__file__).resolve().parents[1]))
    fn, args = pickle.loads(bytes.fromhex(argv[0]))
    fn(int(os.environ["TUNEKIT_TEST_RANK"]), *args)
