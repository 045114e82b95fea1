"""Every row of a file encoded (tokenize.encode_example), in one process or several.

Large inputs (AUTO_ROWS rows or more) are split into consecutive chunks that forked worker processes
encode; the results come back in the rows' order, so the examples, their order and the rows a seed
draws from them are those of one process. A row's error names it as in one process (each chunk keeps
its rows' labels), and the first failing chunk in order raises it. The workers inherit the tokenizer
and the rows by fork (nothing of them is pickled); where fork is missing, one process encodes.
"""

from __future__ import annotations

import multiprocessing
import os
from typing import Optional

from tunekit.data.formats import Rows, iter_examples, row_char_limit
from tunekit.data.tokenize import encode_example

AUTO_ROWS = 20_000  # below this, starting workers costs more than it saves
MAX_AUTO_PROCS = 8
CHUNKS_PER_PROC = 4  # chunks per worker: a slow chunk (long rows) does not leave the others idle

# What the forked workers encode: set before the pool forks, read by _encode_chunk in the children.
_JOB: Optional[tuple] = None


def auto_num_proc(rows: int) -> int:
    """Processes data.num_proc=null gives: 1 below AUTO_ROWS rows, else the cores this process may
    use (shared among the ranks of this machine, LOCAL_WORLD_SIZE), at most MAX_AUTO_PROCS."""
    if rows < AUTO_ROWS:
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    return max(1, min(MAX_AUTO_PROCS, cores // ranks))


def _encode(rows, fmt: str, path, why: str, tokenizer, max_len: int, ends) -> list[tuple]:
    return [encode_example(tokenizer, messages, row, where, max_len, ends)
            for where, messages, row in iter_examples(rows, fmt, path, why, row_char_limit(max_len))]


def _encode_chunk(bounds: tuple[int, int]) -> list[tuple]:
    rows, labels, fmt, path, why, tokenizer, max_len, ends = _JOB
    start, stop = bounds
    return _encode(Rows(rows[start:stop], labels[start:stop]), fmt, path, why, tokenizer, max_len, ends)


def encode_rows(rows, fmt: str, path, why: str, tokenizer, max_len: int, ends,
                num_proc: Optional[int] = 1) -> list[tuple]:
    """[(example or None, lost)] per row, in order (encode_example's). num_proc: processes; None: auto."""
    n = len(rows)
    procs = auto_num_proc(n) if num_proc is None else num_proc
    procs = min(procs, n)
    if procs <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        return _encode(rows, fmt, path, why, tokenizer, max_len, ends)
    global _JOB
    labels = getattr(rows, "labels", None) or [f"row {i}" for i in range(1, n + 1)]
    chunks = procs * CHUNKS_PER_PROC
    bounds = [(n * i // chunks, n * (i + 1) // chunks) for i in range(chunks)]
    _JOB = (list(rows), labels, fmt, path, why, tokenizer, max_len, ends)
    try:
        with multiprocessing.get_context("fork").Pool(procs) as pool:
            out: list[tuple] = []
            for part in pool.imap(_encode_chunk, [b for b in bounds if b[0] < b[1]]):
                out += part
        return out
    finally:
        _JOB = None
