"""The tokenized cache: rows tokenized once, reused by every later run over the same rows.

An entry holds what `tokenize_rows` makes of one list of rows: the examples' token ids and labels,
how many trained tokens data.max_seq_len cut from each, and which rows it dropped. It is keyed by
everything that changes those examples (`cache_key`): the rows themselves (a content hash of the
rows as read, so a file, a saved dataset, a hub split or a mixture of them are all keyed alike), the
format, the tokenizer (its whole serialized tokenizer, its special tokens and flags), the chat
template's text, data.max_seq_len, the code that renders and masks rows (tokenize.py, formats.py)
and the library versions that tokenize. Any change among them is another key, so a miss.

On disk, under the cache folder (data.cache_dir; default $TUNEKIT_DATA_CACHE, else
$TUNEKIT_CACHE/tokenized, i.e. ~/.cache/tunekit/tokenized), one folder per key:

    <key>/examples.safetensors   input_ids and labels of all examples end to end (int32), offsets
                                 (int64, examples + 1), lost (int32, -1: the example fit), dropped
                                 (int64, the 0-based positions of the dropped rows)
    <key>/manifest.json          written_by, format, key, its components, counts, the SHA-256 of
                                 examples.safetensors

No pickle anywhere: safetensors holds flat arrays only. An entry is built in a marked scratch folder
and renamed into place (tunekit.owned.atomic_dir), so a killed run leaves a scratch folder, never a
half entry under a key's name; the next write removes such leftovers of dead processes. An entry
whose manifest is tunekit's but whose data does not match it (a damaged disk, a hand edit) is
ignored with one warning and rebuilt in its place; a folder under a key's name that tunekit did not
write is ignored with one warning and left alone (the rows are tokenized, not cached).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from tunekit.data.tokenize import IGNORE

log = logging.getLogger(__name__)

WRITTEN_BY = "tunekit tokenized cache"
FORMAT = 1  # of the files in an entry; bump when their layout changes
MANIFEST = "manifest.json"
DATA = "examples.safetensors"
ENV = "TUNEKIT_DATA_CACHE"
# The flags of a tokenizer that change what it makes of a text, besides its serialized backend.
_FLAGS = ("add_bos_token", "add_eos_token", "add_prefix_space", "do_lower_case", "legacy", "split_special_tokens")
_ROWS_PER_HASH = 10_000  # rows serialized at a time for the content hash (bounded memory)


def default_cache_dir() -> Path:
    """Where entries go when data.cache_dir is unset: $TUNEKIT_DATA_CACHE, else the tokenized/ folder of
    tunekit's cache (TUNEKIT_CACHE, ~/.cache/tunekit), beside the converted default model."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV]).expanduser()
    from tunekit.model.default import cache_root

    return cache_root() / "tokenized"


def cache_for(enabled: bool, folder: Optional[str], write: bool = True) -> Optional["TokenCache"]:
    """The TokenCache data.cache and data.cache_dir ask for (None: off); `write`: this process may add
    entries (with several ranks, one per machine writes and the others read what it wrote)."""
    if not enabled:
        return None
    return TokenCache(Path(folder).expanduser() if folder is not None else default_cache_dir(), write=write)


def rows_fingerprint(rows) -> str:
    """A SHA-256 over the rows' content (each as canonical JSON, in order): what they say, not where
    they were read from."""
    h = hashlib.sha256(f"{len(rows)}\0".encode())
    for start in range(0, len(rows), _ROWS_PER_HASH):
        chunk = [rows[i] for i in range(start, min(start + _ROWS_PER_HASH, len(rows)))]
        h.update(json.dumps(chunk, sort_keys=True, ensure_ascii=False, default=repr).encode())
    return h.hexdigest()


def tokenizer_fingerprint(tokenizer) -> str:
    """A SHA-256 of what the tokenizer makes of text: its class, its serialized backend (vocabulary,
    merges, normalizer, pre-tokenizer, post-processor, added tokens) or, for a slow tokenizer, its
    vocabulary; its special tokens and flags. Not its folder's path: a copy keys the same."""
    h = hashlib.sha256(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    added = {int(i): [str(getattr(t, "content", t)), bool(getattr(t, "special", False))]
             for i, t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()}
    special = {name: getattr(tokenizer, f"{name}_token_id", None) for name in ("bos", "eos", "unk", "pad")}
    flags = {name: getattr(tokenizer, name, None) for name in _FLAGS}
    h.update(json.dumps([added, special, sorted(tokenizer.all_special_ids), flags], sort_keys=True,
                        default=repr).encode())
    return h.hexdigest()


def code_fingerprint() -> str:
    """The code that turns rows into examples and the libraries that tokenize: a change in them may
    change the examples, so it is part of the key."""
    import jinja2
    import tokenizers
    import transformers

    here = Path(__file__).parent
    h = hashlib.sha256(f"{FORMAT}\0{transformers.__version__}\0{tokenizers.__version__}\0{jinja2.__version__}".encode())
    for name in ("tokenize.py", "formats.py"):
        h.update((here / name).read_bytes())
    return h.hexdigest()


def cache_key(rows, fmt: str, tokenizer, max_len: int, tokenizer_hash: Optional[str] = None) -> tuple[str, dict]:
    """(key, its components): a hex digest of everything that changes the examples of `rows`."""
    template = getattr(tokenizer, "chat_template", None)
    components = {
        "rows": rows_fingerprint(rows),
        "format": fmt,
        "tokenizer": tokenizer_hash or tokenizer_fingerprint(tokenizer),
        "chat_template": hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest(),
        "max_seq_len": int(max_len),
        "code": code_fingerprint(),
    }
    key = hashlib.sha256(json.dumps(components, sort_keys=True).encode()).hexdigest()
    return key, components


@dataclass
class Cached:
    """What an entry holds, as tokenize_rows made it."""

    examples: list[dict]
    lost: list[Optional[int]]
    dropped: list[int]  # 0-based positions of the rows dropped


@dataclass
class TokenCache:
    """A cache folder; `write`: whether this process may add entries (one rank of several writes).
    A folder it cannot write in is one warning (`warned`), then the run goes on uncached. `events`:
    (the rows' file, "hit"|"written"|"skipped", entry folder) of each tokenize_rows call, for
    `tunekit data prepare` to report."""

    root: Path
    write: bool = True
    warned: bool = False
    events: list[tuple[str, str, Path]] = field(default_factory=list)
    _tokenizer_hash: dict[int, str] = field(default_factory=dict)

    def entry(self, name: str, rows, fmt: str, tokenizer, max_len: int) -> "Entry":
        tok_hash = self._tokenizer_hash.get(id(tokenizer))
        if tok_hash is None:
            tok_hash = self._tokenizer_hash[id(tokenizer)] = tokenizer_fingerprint(tokenizer)
        key, components = cache_key(rows, fmt, tokenizer, max_len, tok_hash)
        return Entry(self, str(name), Path(self.root) / key, key, components, len(rows))


@dataclass
class Entry:
    cache: TokenCache
    name: str  # the rows' file, as the run names it
    folder: Path
    key: str
    components: dict
    rows: int
    foreign: bool = False  # a folder under this key's name that tunekit did not write

    def _manifest(self) -> Optional[dict]:
        try:
            info = json.loads((self.folder / MANIFEST).read_text())
        except (OSError, UnicodeDecodeError, ValueError):
            return None
        return info if isinstance(info, dict) and info.get("written_by") == WRITTEN_BY else None

    def load(self) -> Optional[Cached]:
        """The entry's examples, or None: no entry (a miss), or one that cannot be trusted (warned)."""
        if not self.folder.exists():
            return None
        info = self._manifest()
        if info is None:
            self.foreign = True
            log.warning("%s: not an entry of tunekit's tokenized cache (no manifest of its own); left alone, the rows "
                        "are tokenized without the cache (remove it to let tunekit cache them there)", self.folder)
            return None
        try:
            got = self._read(info)
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("%s: damaged tokenized-cache entry (%s); tokenizing again and replacing it", self.folder,
                        " ".join(str(e).split())[:200] or type(e).__name__)
            return None
        self.cache.events.append((self.name, "hit", self.folder))
        return got

    def _read(self, info: dict) -> Cached:
        from safetensors.numpy import load

        if info.get("format") != FORMAT or info.get("key") != self.key or info.get("rows") != self.rows:
            raise ValueError("its manifest is of another format, key or row count")
        data = (self.folder / DATA).read_bytes()
        if hashlib.sha256(data).hexdigest() != info.get("sha256"):
            raise ValueError(f"{DATA} does not match the SHA-256 its manifest records")
        arrays = load(data)
        ids, offsets = arrays["input_ids"].tolist(), arrays["offsets"].tolist()
        trained = arrays["labels"] == arrays["input_ids"]
        if len(trained) == len(ids) and bool(np.all(trained | (arrays["labels"] == IGNORE))):
            # each label its token or IGNORE (tokenize's rule): the labels then hold the ids' own int objects,
            # as a fresh tokenization's do (separate ones would take ~40% more memory)
            ignore = IGNORE
            labels = [t if m else ignore for t, m in zip(ids, trained.tolist())]
        else:
            labels = arrays["labels"].tolist()
        lost = [None if n < 0 else n for n in arrays["lost"].tolist()]
        dropped = arrays["dropped"].tolist()
        n = len(offsets) - 1
        if len(lost) != n or n + len(dropped) != self.rows or offsets[-1] != len(ids) or len(labels) != len(ids):
            raise ValueError("its arrays disagree in length")
        examples = [{"input_ids": ids[offsets[i]:offsets[i + 1]], "labels": labels[offsets[i]:offsets[i + 1]]}
                    for i in range(n)]
        return Cached(examples, lost, dropped)

    def store(self, examples: list[dict], lost: list[Optional[int]], dropped: list[int]) -> None:
        """Write the entry (atomically; a failure to write is a warning, never the run's end)."""
        if self.foreign or not self.cache.write:
            self.cache.events.append((self.name, "skipped", self.folder))
            return
        from safetensors.numpy import save

        from tunekit.owned import atomic_dir, cleanup_leftovers

        lengths = [len(e["input_ids"]) for e in examples]
        arrays = {
            "input_ids": np.fromiter((t for e in examples for t in e["input_ids"]), np.int32, sum(lengths)),
            "labels": np.fromiter((t for e in examples for t in e["labels"]), np.int32, sum(lengths)),
            "offsets": np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64),
            "lost": np.array([-1 if n is None else n for n in lost], np.int32),
            "dropped": np.array(dropped, np.int64),
        }
        data = save(arrays)
        manifest = {"written_by": WRITTEN_BY, "format": FORMAT, "key": self.key, "components": self.components,
                    "rows": self.rows, "examples": len(examples), "tokens": int(sum(lengths)),
                    "sha256": hashlib.sha256(data).hexdigest()}

        def write(folder: Path) -> None:
            (folder / DATA).write_bytes(data)
            (folder / MANIFEST).write_text(json.dumps(manifest, indent=1))

        try:
            root = Path(self.cache.root)
            root.mkdir(parents=True, exist_ok=True)
            cleanup_leftovers(root)  # what killed writers left here: marked scratch folders of dead processes
            atomic_dir(self.folder, write)
        except OSError as e:
            if not self.cache.warned:
                log.warning("data.cache_dir: cannot write the tokenized cache in %s (%s); going on without it",
                            self.cache.root, e.strerror or e)
                self.cache.warned = True
            self.cache.events.append((self.name, "skipped", self.folder))
            return
        self.cache.events.append((self.name, "written", self.folder))
