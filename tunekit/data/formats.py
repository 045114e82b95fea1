"""Read a dataset file into rows and turn each row into (prompt, response) segments.

Formats (detected from the first row's columns unless `data.format` says):
  alpaca: {"instruction", "input" (optional), "output"}  -> one user turn, one assistant turn
  chat:   {"messages": [{"role", "content"}, ...]}        -> the tokenizer's chat template
  text:   {"text"}                                       -> plain text, every token trained
  sharegpt: {"conversations": [{"from": "human"|"gpt"|"system", "value"}, ...]} -> a chat
  prompt_completion: {"prompt", "completion"}, both strings or both message lists -> a chat
Alpaca rows are rendered as a chat so an instruct model sees the template it was tuned on.
A data path may also be a folder written by `datasets`' save_to_disk or a hub dataset id
(tunekit.data.sources); their rows go through the same checks.

Files are read here rather than through `datasets`: a bad byte, a broken line or a row of another
format is then reported once, at its own 1-based line or row, and rows keep exactly the keys
they were written with (`datasets` unifies the columns of all rows, so a chat row after alpaca
rows made row 1 look like chat). Every check of a row needs no tokenizer, so `check_file` runs
at config validation, before anything loads.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any, Iterable, Optional

from tunekit import TunekitError

DEFAULT_DATA_DIR = Path(__file__).parent / "default"
SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")
ROLES = {"system", "user", "assistant"}
# The key each format cannot do without, in detection order.
FORMAT_KEYS = {"chat": ("messages",), "sharegpt": ("conversations",), "prompt_completion": ("prompt", "completion"),
               "alpaca": ("instruction", "output"), "text": ("text",)}
# ShareGPT's speaker names (`from`) as chat roles: the community's spellings of the three roles.
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "model": "assistant"}


class DataError(TunekitError):
    pass


class Rows(list):
    """The rows of a file, each with the label a user finds it by: "row 3", "row 3 (line 5)".

    held_out: the rows of a saved or hub dataset's validation (or test) split, when data.path is a
    dataset with splits; None for a file."""

    def __init__(self, rows: list[dict], labels: list[str], held_out: Optional["Rows"] = None):
        super().__init__(rows)
        self.labels = labels
        self.held_out = held_out


def _label(row: int, line: int) -> str:
    return f"row {row}" if row == line else f"row {row} (line {line})"


def _decode(data: bytes, path: Path) -> str:
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise DataError(f"{path}: line {line}: not UTF-8 text (byte 0x{data[e.start]:02x} at column {column}); "
                        "save the file as UTF-8") from None


JSON_TYPES = {list: "array", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}


def _object(value: Any, path: Path, label: str) -> dict:
    if not isinstance(value, dict):
        raise DataError(f"{path}: {label}: a JSON {JSON_TYPES.get(type(value), type(value).__name__)}, "
                        "not an object {\"key\": value, ...}")
    return value


def _json_error(e: json.JSONDecodeError, path: Path, line: Optional[int] = None) -> DataError:
    return DataError(f"{path}: line {line or e.lineno}: not valid JSON ({e.msg} at column {e.colno})")


def _read_jsonl(text: str, path: Path) -> Rows:
    rows, labels = [], []
    # "\n" only: str.splitlines() would also break at U+2028, U+0085, ... which JSON strings may hold raw
    for line_no, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            raise _json_error(e, path, line_no) from None
        except RecursionError:
            raise DataError(f"{path}: line {line_no}: JSON nested too deeply to read") from None
        label = _label(len(rows) + 1, line_no)
        rows.append(_object(value, path, label))
        labels.append(label)
    return Rows(rows, labels)


def _read_json(text: str, path: Path) -> Rows:
    """A JSON array of row objects; JSON lines in a .json file are read as such."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # several top-level values: JSON lines
            return _read_jsonl(text, path)
        raise _json_error(e, path) from None
    except RecursionError:
        raise DataError(f"{path}: JSON nested too deeply to read") from None
    if not isinstance(value, list):
        raise DataError(f"{path}: holds a JSON {'object' if isinstance(value, dict) else JSON_TYPES.get(type(value))}; "
                        "expected an array of row objects "
                        "[{...}, ...] (or one object per line)")
    labels = [f"row {i}" for i in range(1, len(value) + 1)]
    return Rows([_object(v, path, label) for v, label in zip(value, labels)], labels)


def _read_csv(text: str, path: Path) -> Rows:
    # csv refuses fields over 128 KiB by default; row sizes are judged by row_char_limit instead
    csv.field_size_limit(max(csv.field_size_limit(), len(text) + 1))
    reader = csv.DictReader(io.StringIO(text, newline=""))
    rows, labels = [], []
    try:
        for row in reader:
            label = f"row {len(rows) + 1} (line {reader.line_num})"
            if None in row:
                raise DataError(f"{path}: {label}: more fields than the header has columns {reader.fieldnames}")
            rows.append(row)
            labels.append(label)
    except csv.Error as e:
        raise DataError(f"{path}: line {reader.line_num}: not valid CSV ({e})") from None
    return Rows(rows, labels)


def _read_parquet(path: Path) -> Rows:
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ... for a damaged file
        raise DataError(f"{path}: cannot read as parquet ({str(e).splitlines()[0][:200]})") from None
    return Rows(rows, [f"row {i}" for i in range(1, len(rows) + 1)])


def read_rows(path: str | Path, key: str = "data.path", split: Optional[str] = None) -> Rows:
    """All rows of a .jsonl/.json/.csv/.parquet file, each a dict with the row's own keys; or of a
    save_to_disk folder or a hub dataset id (tunekit.data.sources: data.path takes the train split
    and keeps the held-out one in Rows.held_out, data.val_path takes the held-out split; `split`,
    a source's own choice, takes that split alone)."""
    from tunekit.data import sources

    path = Path(path)
    if path.is_dir():
        return sources.read_saved(path, key, split)
    if not path.exists():
        if sources.looks_like_hub_id(str(path)):
            return sources.read_hub(str(path), key, split)
        raise DataError(f"{key}: file not found: {path}")
    if split is not None:
        raise DataError(f"{key}: split {split!r} picks a split of a save_to_disk folder or hub dataset; {path} is a "
                        "file (its rows are one split): leave 'split' out")
    if not path.is_file():  # a FIFO or device would block or never end
        raise DataError(f"{key}: {path} is not a regular file")
    if path.suffix.lower() not in SUFFIXES:
        raise DataError(f"{path}: unsupported file type {path.suffix!r}; use one of {list(SUFFIXES)}")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise DataError(f"{key}: cannot read {path}: {e.strerror or e}") from None
    if not data.strip():
        raise DataError(f"{path}: no rows (the file is empty)")
    kind = path.suffix.lower()
    if kind == ".parquet":
        rows = _read_parquet(path)
    else:
        text = _decode(data, path)
        rows = {".jsonl": _read_jsonl, ".json": _read_json, ".csv": _read_csv}[kind](text, path)
    if not rows:
        raise DataError(f"{path}: no rows")
    return rows


def row_format(row: dict) -> Optional[str]:
    """The format a row's keys say, or None."""
    for fmt, keys in FORMAT_KEYS.items():
        if all(row.get(k) is not None for k in keys):
            return fmt
    return None


def detect_format(rows: list[dict], path: str | Path) -> str:
    fmt = row_format(rows[0])
    if fmt is None:
        raise DataError(
            f"{path}: cannot tell the format from the columns {sorted(rows[0])} of its first row; expected "
            "'messages' (chat), 'conversations' (sharegpt), 'prompt'+'completion', 'instruction'+'output' "
            "(alpaca) or 'text'"
            + ("; preference pairs (chosen/rejected) train with objective=preference (recipe=dpo)"
               if rows[0].get("chosen") is not None else "")
        )
    return fmt


def _need_str(value: Any, what: str, where: str, allow_empty: bool = False) -> str:
    if not isinstance(value, str) or (not allow_empty and not value.strip()):
        raise DataError(f"{where}: {what} must be a non-empty string, got {value!r:.80}")
    return value


def row_to_messages(row: dict, fmt: str, where: str, why: str = "") -> list[dict] | None:
    """Chat messages for alpaca/chat rows; None for plain text rows. Raises DataError on a bad row.

    `why` says where the file's format came from ("as its first row", "data.format"), for the
    error of a row written in another format.
    """
    own = row_format(row)
    if own is not None and own != fmt and any(row.get(k) is None for k in FORMAT_KEYS[fmt]):
        raise DataError(f"{where}: {'an' if own == 'alpaca' else 'a'} {own} row (has {'+'.join(FORMAT_KEYS[own])}) "
                        f"in a file of {fmt} rows"
                        f"{' (' + why + ')' if why else ''}; one format per file")
    if fmt == "text":
        _need_str(row.get("text"), "'text'", where)
        return None
    if fmt == "sharegpt":
        return _sharegpt(row.get("conversations"), where)
    if fmt == "prompt_completion":
        return _prompt_completion(row, where)
    if fmt == "alpaca":
        instruction = _need_str(row.get("instruction"), "'instruction'", where)
        extra = row.get("input") or ""
        _need_str(extra, "'input'", where, allow_empty=True)
        output = _need_str(row.get("output"), "'output'", where)
        prompt = f"{instruction}\n\n{extra}" if extra.strip() else instruction
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": output}]
    out = _messages(row.get("messages"), "messages", where)
    if not any(m["role"] == "assistant" for m in out):
        raise DataError(f"{where}: no assistant message, so nothing to train on")
    return _ends_on_reply(out, "messages", where)


def _ends_on_reply(messages: list[dict], key: str, where: str) -> list[dict]:
    """Only assistant turns train: a turn after the last one is a slip (a reply cut off, turns
    shifted), not context for anything."""
    last = messages[-1]["role"]
    if last != "assistant":
        raise DataError(f"{where}: the conversation ends on a {last} turn ({key}[{len(messages) - 1}]); "
                        "the last turn must be the assistant's reply (only assistant turns train)")
    return messages


def _messages(messages: Any, key: str, where: str) -> list[dict]:
    """A list of {role, content} messages, checked."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: '{key}' must be a non-empty list of {{role, content}}, got {messages!r:.80}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise DataError(f"{where}: {key}[{i}] needs a role in {sorted(ROLES)}, got {m!r:.80}")
        out.append({"role": m["role"], "content": _need_str(m.get("content"), f"{key}[{i}].content", where)})
    return out


def _sharegpt(turns: Any, where: str) -> list[dict]:
    """ShareGPT rows: {"conversations": [{"from": "human"|"gpt"|"system", "value": ...}, ...]}."""
    if not isinstance(turns, list) or not turns:
        raise DataError(f"{where}: 'conversations' must be a non-empty list of {{from, value}}, got {turns!r:.80}")
    out = []
    for i, t in enumerate(turns):
        role = SHAREGPT_ROLES.get(str(t.get("from", "")).lower()) if isinstance(t, dict) else None
        if role is None:
            raise DataError(f"{where}: conversations[{i}] needs 'from' in {sorted(SHAREGPT_ROLES)}, got {t!r:.80}")
        out.append({"role": role, "content": _need_str(t.get("value"), f"conversations[{i}].value", where)})
    if not any(m["role"] == "assistant" for m in out):
        raise DataError(f"{where}: no assistant ('gpt') turn, so nothing to train on")
    return _ends_on_reply(out, "conversations", where)


def _prompt_completion(row: dict, where: str) -> list[dict]:
    """TRL's prompt-completion rows: both strings (the prompt is the user's turn, the completion the
    reply), or both message lists (the completion's messages are the replies that train)."""
    prompt, completion = row.get("prompt"), row.get("completion")
    for key, value in (("prompt", prompt), ("completion", completion)):
        if value is None:
            raise DataError(f"{where}: no {key!r}: a prompt_completion row needs 'prompt' and 'completion', "
                            f"it has {sorted(k for k, v in row.items() if v is not None)}")
    if isinstance(prompt, str) and isinstance(completion, str):
        return [{"role": "user", "content": _need_str(prompt, "'prompt'", where)},
                {"role": "assistant", "content": _need_str(completion, "'completion'", where)}]
    if isinstance(prompt, list) and isinstance(completion, list):
        head, tail = _messages(prompt, "prompt", where), _messages(completion, "completion", where)
        if any(m["role"] != "assistant" for m in tail):
            raise DataError(f"{where}: 'completion' may hold assistant messages only (the replies that train)")
        return head + tail
    raise DataError(f"{where}: 'prompt' and 'completion' must both be strings or both lists of {{role, content}}, "
                    f"got {type(prompt).__name__} and {type(completion).__name__}")


def row_char_limit(max_seq_len: int) -> int:
    """The most characters a row may hold. Only its first data.max_seq_len tokens train, and
    tokenizing is slow (measured: a 10 MB row, 46 s on 2 cores): a far longer row is a file
    that was meant to be split into rows. 32 characters per token is 8x English's average."""
    return max(1_000_000, 32 * max_seq_len)


def _chars(value: Any) -> int:
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(_chars(v) for v in value.values())
    if isinstance(value, list):
        return sum(_chars(v) for v in value)
    return 0


def iter_examples(rows: Iterable[dict], fmt: str, path: str | Path, why: str = "",
                  max_chars: Optional[int] = None):
    """Yield (where, messages or None, row); `where` names the file and the row as a user finds
    it ("data.jsonl: row 3", counted from 1), for any later error about that row."""
    labels = getattr(rows, "labels", None)
    for i, row in enumerate(rows, start=1):
        where = f"{path}: {labels[i - 1] if labels else f'row {i}'}"
        if max_chars is not None and _chars(row) > max_chars:
            raise DataError(f"{where}: {_chars(row):,} characters, over the {max_chars:,} a row may hold; only the "
                            "first data.max_seq_len tokens of a row train: split long texts into several rows")
        yield where, row_to_messages(row, fmt, where, why), row


_CHECKED: dict[tuple, tuple[int, str]] = {}


def _memo_key(path: str | Path, fmt: str, max_chars: Optional[int]) -> Optional[tuple]:
    """What check_file's memo is keyed by: the file's (size, mtime), a saved dataset folder's files'
    (name, size, mtime), a hub id as it is; None for anything else (never remembered)."""
    from tunekit.data.sources import is_saved_dataset

    p = Path(path)
    try:
        if p.is_dir():
            if not is_saved_dataset(p):  # refused by read_rows; never walk a big folder for a stamp
                return None
            stamp = tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in sorted(p.rglob("*")) if f.is_file())
        elif p.exists():
            stamp = (p.stat().st_size, p.stat().st_mtime_ns)
        else:
            stamp = ("hub",)
        return (str(p.resolve()), stamp, fmt, max_chars)
    except OSError:
        return None


def check_file(path: str | Path, fmt: str, key: str, max_chars: Optional[int] = None,
               split: Optional[str] = None) -> tuple[int, str]:
    """Read and check every row of a data file, save_to_disk folder or hub dataset (no tokenizer
    needed; a dataset's held-out split too): (rows, format).

    Remembered per (file, size, mtime, format): validation runs once per command and once per
    job, and a file read twice should not cost twice."""
    memo = _memo_key(path, fmt, max_chars)
    memo = memo + (split,) if memo is not None else None
    if memo is not None and memo in _CHECKED:
        return _CHECKED[memo]
    rows = read_rows(path, key, split)
    why = f"data.format={fmt}" if fmt != "auto" else "as its first row"
    for part in (rows, rows.held_out):
        if part is not None:
            detected = detect_format(part, path) if fmt == "auto" else fmt
            for _ in iter_examples(part, detected, path, why, max_chars):
                pass
    detected = detect_format(rows, path) if fmt == "auto" else fmt
    if memo is not None:
        _CHECKED[memo] = (len(rows), detected)
    return len(rows), detected
