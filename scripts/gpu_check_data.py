"""The GPU check's generated rows (scripts/gpu_check.py): inputs its runs read, written once into its
work folder. Neither needs a download, and nothing here judges what a run learned."""

from __future__ import annotations

import json
from pathlib import Path


def long_rows(work: Path) -> Path:
    """Plain-text rows longer than any max_seq_len the check uses: truncated, every micro-batch is
    micro_batch_size full rows, the worst case the planner sizes."""
    path = work / "long-rows.jsonl"
    if not path.is_file():
        text = " ".join(f"The number {i} follows {i - 1} and comes before {i + 1}." for i in range(600))
        path.write_text("".join(json.dumps({"text": f"Row {r}. {text}"}) + "\n" for r in range(64)))
    return path


def pairs_rows(work: Path) -> Path:
    """Preference pairs for the DPO variant: a question, the right count as chosen, a wrong one as
    rejected (never equal: 6 + r % 7 + r % 3 > 5 + r % 7)."""
    path = work / "pairs.jsonl"
    if not path.is_file():
        rows = []
        for r in range(64):
            words = " ".join(["apple", "pear", "plum", "fig"][(r + k) % 4] for k in range(5 + r % 7))
            rows.append({"prompt": f"How many words are in this list: {words}?",
                         "chosen": f"There are {5 + r % 7} words.", "rejected": f"There are {6 + r % 7 + r % 3} words."})
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path
