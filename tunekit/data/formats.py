"""Read a dataset file into rows and turn each row into (prompt, response) segments.

Formats (detected from the columns unless `data.format` says):
  alpaca: {"instruction", "input" (optional), "output"}  -> one user turn, one assistant turn
  chat:   {"messages": [{"role", "content"}, ...]}        -> the tokenizer's chat template
  text:   {"text"}                                       -> plain text, every token trained
Alpaca rows are rendered as a chat so an instruct model sees the template it was tuned on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

from tunekit import TunekitError

DEFAULT_DATA_DIR = Path(__file__).parent / "default"
LOADERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
ROLES = {"system", "user", "assistant"}


class DataError(TunekitError):
    pass


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """All rows of a .jsonl/.json/.csv/.parquet file, through `datasets`."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file not found: {path}")
    kind = LOADERS.get(path.suffix.lower())
    if kind is None:
        raise DataError(f"{path}: unsupported file type {path.suffix!r}; use one of {sorted(LOADERS)}")
    import datasets

    datasets.disable_progress_bars()
    try:
        ds = datasets.load_dataset(kind, data_files=str(path), split="train")
    except Exception as e:  # datasets wraps parse errors in several exception types
        cause = e.__cause__ or e
        raise DataError(f"{path}: cannot parse as {path.suffix}: {str(cause).splitlines()[0][:300]}") from None
    if len(ds) == 0:
        raise DataError(f"{path}: no rows")
    return ds.to_list()


def detect_format(rows: list[dict], path: str | Path) -> str:
    cols = set(rows[0])
    if "messages" in cols:
        return "chat"
    if "instruction" in cols and "output" in cols:
        return "alpaca"
    if "text" in cols:
        return "text"
    raise DataError(
        f"{path}: cannot tell the format from columns {sorted(cols)}; expected 'messages' (chat), "
        "'instruction'+'output' (alpaca) or 'text'"
    )


def _need_str(value: Any, what: str, where: str, allow_empty: bool = False) -> str:
    if not isinstance(value, str) or (not allow_empty and not value.strip()):
        raise DataError(f"{where}: {what} must be a non-empty string, got {value!r:.80}")
    return value


def row_to_messages(row: dict, fmt: str, where: str) -> list[dict] | None:
    """Chat messages for alpaca/chat rows; None for plain text rows. Raises DataError on a bad row."""
    if fmt == "text":
        _need_str(row.get("text"), "'text'", where)
        return None
    if fmt == "alpaca":
        instruction = _need_str(row.get("instruction"), "'instruction'", where)
        extra = row.get("input") or ""
        _need_str(extra, "'input'", where, allow_empty=True)
        output = _need_str(row.get("output"), "'output'", where)
        prompt = f"{instruction}\n\n{extra}" if extra.strip() else instruction
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": output}]
    messages = row.get("messages")
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: 'messages' must be a non-empty list of {{role, content}}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise DataError(f"{where}: messages[{i}] needs a role in {sorted(ROLES)}, got {m!r:.80}")
        out.append({"role": m["role"], "content": _need_str(m.get("content"), f"messages[{i}].content", where)})
    if not any(m["role"] == "assistant" for m in out):
        raise DataError(f"{where}: no assistant message, so nothing to train on")
    return out


def iter_examples(rows: Iterable[dict], fmt: str, path: str | Path):
    """Yield (row_number, messages or None, row) with row numbers counted from 1 as a user sees them."""
    for i, row in enumerate(rows, start=1):
        where = f"{path}: row {i}"
        yield i, row_to_messages(row, fmt, where), row
