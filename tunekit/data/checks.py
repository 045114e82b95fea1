"""The `data.*` keys checked before anything loads: their values, then every row of the files they
name (no tokenizer). Called by tunekit.train.checks.validate."""

from __future__ import annotations

from tunekit import TunekitError
from tunekit.checks import number, one_of, text
from tunekit.config import DataConfig, DataFormat, plain


def check_data_values(d: DataConfig) -> None:
    """Types, ranges and choices of the data.* keys."""
    from tunekit.data.mixture import is_mixture, parse_sources

    if is_mixture(d.path):
        parse_sources(d.path)  # each source's keys and values, naming it by index and path
    elif d.path is not None and not isinstance(d.path, str):
        raise TunekitError(f"data.path: give a data file, a list of sources or null, got {d.path!r:.80}")
    else:
        text("data.path", d.path, "a data file, or null for the default data")
    text("data.val_path", d.val_path, "a data file, or null to hold out data.val_fraction")
    number("data.val_fraction", d.val_fraction, gt=0, lt=1)
    one_of("data.format", plain(d.format), [f.value for f in DataFormat])
    if d.chat_template is not None:
        from tunekit.data.templates import template_text

        template_text(d.chat_template)
    number("data.max_seq_len", d.max_seq_len, ge=8, integer=True)
    if d.max_val_examples is not None:
        number("data.max_val_examples", d.max_val_examples, ge=1, integer=True)
    text("data.cache_dir", d.cache_dir, "a folder for the tokenized cache, or null for the default")
    if d.num_proc is not None:
        number("data.num_proc", d.num_proc, ge=1, integer=True)


def check_data_files(d: DataConfig, objective: str = "sft") -> None:
    """Every row of the data files, read and checked (no tokenizer); the held-out split must leave
    training rows. objective=preference: preference rows (tunekit.data.preference)."""
    from tunekit.data.formats import check_file, row_char_limit
    from tunekit.data.preference import check_rows
    from tunekit.data.mixture import is_mixture

    if is_mixture(d.path):
        check_sources(d)
    for key in ("path", "val_path"):
        value = getattr(d, key)
        if value is None or is_mixture(value):
            continue
        if objective == "preference":
            rows, _ = check_rows(value, f"data.{key}")
        else:
            rows, _ = check_file(value, plain(d.format), f"data.{key}", row_char_limit(d.max_seq_len))
        if key == "path" and d.val_path is None and rows - max(1, int(rows * d.val_fraction)) < 1:
            raise TunekitError(f"data.path: {value} has {rows} row(s): too few to hold out data.val_fraction="
                               f"{d.val_fraction} and train on the rest; add rows or give data.val_path")


def check_sources(d: DataConfig) -> None:
    """Every row of every source of data.path's list, read and checked, each error naming the source
    (index and path); each must leave training rows once data.val_fraction of it is held out."""
    from tunekit.data.formats import check_file, row_char_limit
    from tunekit.data.mixture import naming, parse_sources

    for s in parse_sources(d.path):
        with naming(s):
            rows, _ = check_file(s.path, s.format or plain(d.format), s.key, row_char_limit(d.max_seq_len), s.split)
        if d.val_path is None and rows - max(1, int(rows * d.val_fraction)) < 1:
            raise TunekitError(f"{s.label}: {rows} row(s): too few to hold out data.val_fraction={d.val_fraction} and "
                               "train on the rest; add rows, or give data.val_path")
