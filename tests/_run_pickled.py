"""The `main` of the kill tests' small fork server (tests/_helpers._in_a_child): runs the pickled
callable its one argument holds (the tests' own, never a user's file), then ends as a SIGKILL would
(status 9, no cleanup) unless the callable ended the process itself."""

from __future__ import annotations

import os
import pickle


def main(argv: list[str]) -> None:
    act = pickle.loads(bytes.fromhex(argv[0]))
    try:
        act()
    finally:
        os._exit(9)
