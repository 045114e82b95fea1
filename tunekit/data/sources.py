"""Rows from a `datasets` dataset: a folder written by save_to_disk, or a hub dataset id.

A data path that is a folder must be one that `Dataset.save_to_disk` or `DatasetDict.save_to_disk`
wrote (its state.json or dataset_dict.json says so). A data path that names nothing on disk and
looks like a hub id ("tatsu-lab/alpaca", "imdb") is loaded with `datasets.load_dataset`.

A dataset with splits gives data.path its "train" split (or its only split) and keeps its
held-out split ("validation", else "test", ...) for the held-out set when data.val_path is
unset; data.val_path takes the held-out split (or the only split). Rows keep the labels a user
finds them by: "row 3", or "row 3 of split 'validation'".

`datasets` stores a column per key of all rows, so a key one row lacks reads as None in it: the
row checks treat a None value as a missing key.
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
from pathlib import Path
from typing import Optional
from urllib.parse import urlparse

from tunekit.data.formats import SUFFIXES, DataError, Rows
from tunekit.owned import sha256_file

SAVED_MARKERS = ("dataset_dict.json", "state.json")  # DatasetDict / Dataset .save_to_disk
TRAIN_SPLIT = "train"
HELD_OUT_SPLITS = ("validation", "valid", "val", "dev", "test")  # in order of preference
# owner/name or a canonical name: letters, digits, '-', '_', '.'; no suffix of a data file
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
_LOADED: dict[str, object] = {}  # hub id -> its DatasetDict, so validation and training load it once


def looks_like_hub_id(text: str) -> bool:
    return bool(_HUB_ID.fullmatch(text)) and Path(text).suffix.lower() not in SUFFIXES and ".." not in text


def is_saved_dataset(folder: Path) -> bool:
    return any((folder / name).is_file() for name in SAVED_MARKERS)


def _one_line(err: BaseException, limit: int = 200) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def read_saved(folder: Path, key: str, split: Optional[str] = None) -> Rows:
    if not is_saved_dataset(folder):
        raise DataError(f"{key}: {folder} is a folder, and not one datasets' save_to_disk wrote (no "
                        f"{' or '.join(SAVED_MARKERS)} in it); give a {'/'.join(SUFFIXES)} file or such a folder")
    import datasets

    try:
        ds = datasets.load_from_disk(str(folder))
    except Exception as e:  # a damaged arrow file, a state.json of another version, ...
        raise DataError(f"{key}: {folder}: cannot read the dataset save_to_disk wrote there ({_one_line(e)})") from None
    return rows_of(ds, str(folder), key, split)


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _hub_resolves() -> bool:
    """A name lookup of the hub's host: huggingface_hub retries an unreachable host for ~25 s, a
    failed lookup answers at once."""
    host = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co").hostname or "huggingface.co"
    try:
        socket.getaddrinfo(host, 443)
    except OSError:
        return False
    return True


def _unreachable(err: BaseException) -> bool:
    """Whether an error of load_dataset says the hub could not be reached (rather than refusing the id)."""
    seen = err
    while seen is not None:
        if isinstance(seen, (ConnectionError, TimeoutError)) or type(seen).__name__ in (
                "OfflineModeIsEnabled", "LocalEntryNotFoundError", "ConnectError", "ConnectTimeout", "ReadTimeout"):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _load_hub(name: str, key: str):
    """The DatasetDict of hub dataset `name` (datasets.load_dataset; its local cache when
    HF_HUB_OFFLINE is set), loaded once per process."""
    not_local = f"{key}: {name!r} is not a local file or folder (no {Path(name).absolute()})"
    unreachable = (f"{not_local}, and the Hugging Face hub could not be reached to load it as a dataset id "
                   "({why}); give a local data file or a save_to_disk folder, or run where the hub is reachable")
    if name not in _LOADED:
        if not _offline() and not _hub_resolves():
            raise DataError(unreachable.format(why="its host name does not resolve"))
        import datasets

        try:
            _LOADED[name] = datasets.load_dataset(name)
        except Exception as e:  # noqa: BLE001 - every failure becomes one line naming the id
            if _offline() or _unreachable(e):
                why = ("HF_HUB_OFFLINE is set and the dataset is not in the local cache" if _offline()
                       else _one_line(e))
                raise DataError(unreachable.format(why=why)) from None
            if type(e).__name__ == "DatasetNotFoundError":
                raise DataError(f"{not_local}, and the hub has no dataset {name!r} (or it is private or gated: "
                                "log in with `hf auth login`)") from None
            raise DataError(f"{key}: datasets.load_dataset({name!r}) failed: {_one_line(e)}") from None
    return _LOADED[name]


def read_hub(name: str, key: str, split: Optional[str] = None) -> Rows:
    return rows_of(_load_hub(name, key), name, key, split)


def data_fingerprint(path: str | Path, key: str = "data.path") -> str:
    """A hex digest that changes when the rows behind a data path change (what resume compares):
    a file's SHA-256 (as checkpoints have always recorded it); over a save_to_disk folder's file
    names and contents; over a hub dataset's id and its splits' `datasets` fingerprints; over every
    source of a list and its settings (tunekit.data.mixture.fingerprint)."""
    from tunekit.data import mixture

    if mixture.is_mixture(path):
        return mixture.fingerprint(path, key)
    p = Path(path)
    if p.is_file():
        return sha256_file(p)
    h = hashlib.sha256()
    if p.is_dir():
        for f in sorted(p.rglob("*")):
            if f.is_file():
                h.update(f"{f.relative_to(p)}\0{sha256_file(f)}\0".encode())
        return h.hexdigest()
    ds = _load_hub(str(path), key)
    h.update(str(path).encode())
    for split in sorted(ds.keys()):
        h.update(f"\0{split}\0{ds[split]._fingerprint}".encode())
    return h.hexdigest()


def _split_rows(ds, split: str | None) -> Rows:
    rows = ds.to_list()
    if split is None:
        return Rows(rows, [f"row {i}" for i in range(1, len(rows) + 1)])
    return Rows(rows, [f"row {i} of split {split!r}" for i in range(1, len(rows) + 1)])


def rows_of(ds, where: str, key: str, split: Optional[str] = None) -> Rows:
    """The rows data.path (train split, held-out split kept aside) or data.val_path (held-out
    split) takes from a Dataset or DatasetDict; `split` (a source's own choice in a list of
    sources, tunekit.data.mixture): that split alone, no held-out split kept aside."""
    if split is not None:
        names = list(ds.keys()) if hasattr(ds, "keys") else []
        if split not in names:
            has = f"splits {names}" if names else "no splits (one Dataset)"
            raise DataError(f"{key}: {where} has {has}, no split {split!r}")
        rows = _split_rows(ds[split], split)
        if not rows:
            raise DataError(f"{key}: {where}: split {split!r} has no rows")
        return rows
    if not hasattr(ds, "keys"):  # one Dataset, no splits
        rows = _split_rows(ds, None)
        if not rows:
            raise DataError(f"{where}: no rows (the dataset is empty)")
        return rows
    names = list(ds.keys())
    held = next((s for s in HELD_OUT_SPLITS if s in names), None)
    only = names[0] if len(names) == 1 else None
    want = (held or only) if key.endswith("val_path") else (TRAIN_SPLIT if TRAIN_SPLIT in names else only)
    if want is None:
        role = f"held-out split ({', '.join(HELD_OUT_SPLITS)})" if key.endswith("val_path") else "'train' split"
        raise DataError(f"{key}: {where} has splits {names} but no {role}")
    rows = _split_rows(ds[want], want)
    if not rows:
        raise DataError(f"{where}: split {want!r} has no rows")
    if not key.endswith("val_path") and held is not None and held != want and len(ds[held]):
        rows.held_out = _split_rows(ds[held], held)
    return rows
