"""Range checks shared by config validation and the methods' `check_config`: one line naming the key.

Plain functions of (key, value); they know nothing about the config object, so layers and methods
can use them on the plain values they are given. `path_fits` is the same kind of check for a path
tunekit will create (output_dir, doctor's --out, eval's --out).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Optional

from tunekit import TunekitError


def _fmt(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def number(key: str, value: Any, *, gt: Optional[float] = None, ge: Optional[float] = None,
           lt: Optional[float] = None, le: Optional[float] = None, integer: bool = False,
           allow_inf: bool = False, unit: str = "") -> None:
    """`value` is a (finite, unless allow_inf) number within the given bounds, else TunekitError.

    The message states the whole allowed range, NaN included (float() and Hydra both read "nan" and
    "inf" as numbers, and NaN fails no comparison, so it must be named, not compared):
    "method.dropout: must be in [0, 1), got 2.0", "--memory: must be > 0 GiB and finite, got nan".
    """
    kind = "an integer" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise TunekitError(f"{key}: must be {kind}, got {value!r}")
    lower = (f"[{_fmt(ge)}" if ge is not None else f"({_fmt(gt)}") if (ge is not None or gt is not None) else None
    upper = (f"{_fmt(le)}]" if le is not None else f"{_fmt(lt)})") if (le is not None or lt is not None) else None
    if lower and upper:
        allowed = f"in {lower}, {upper}"
    elif lower:
        allowed = (">= " if ge is not None else "> ") + lower[1:]
    elif upper:
        allowed = ("<= " if le is not None else "< ") + upper[:-1]
    else:
        allowed = "finite"
    allowed += f" {unit}" if unit else ""
    ok = (not math.isnan(value) and (gt is None or value > gt) and (ge is None or value >= ge)
          and (lt is None or value < lt) and (le is None or value <= le) and (allow_inf or math.isfinite(value)))
    if not ok:
        # NaN or inf against a range open on one side: the range alone would not say they are out
        if not math.isfinite(value) and not allow_inf and not (lower and upper) and not allowed.startswith("finite"):
            allowed += " and finite"
        raise TunekitError(f"{key}: must be {allowed}, got {_fmt(value)}")


def one_of(key: str, value: Any, choices) -> None:
    if value not in choices:
        raise TunekitError(f"{key}: unknown value {value!r}; choose one of {', '.join(map(str, choices))}")


def names(key: str, value: Any, what: str = "module names") -> list[str]:
    """A non-empty list of distinct, non-empty strings."""
    items = list(value) if isinstance(value, (list, tuple)) else None
    if not items:
        raise TunekitError(f"{key}: must be a non-empty list of {what}, got {value!r}")
    bad = [v for v in items if not isinstance(v, str) or not v.strip()]
    if bad:
        raise TunekitError(f"{key}: {bad[0]!r} is not a name; give a list of {what}")
    dupes = sorted({v for v in items if items.count(v) > 1})
    if dupes:
        raise TunekitError(f"{key}: {dupes[0]!r} is listed twice")
    return items


# What tunekit writes inside a folder it creates, beyond the folder's own path: the deepest is a
# checkpoint's adapter built in its scratch folder, about 110 bytes; the rest is room to spare.
INSIDE_BYTES = 256


def _limit(folder: str, name: str, default: int) -> int:
    try:
        return os.pathconf(folder, name)
    except (OSError, ValueError):
        return default


def path_fits(key: str, path) -> None:
    """Every name in `path` within the bytes its file system allows (NAME_MAX, 255 on most), and the
    whole, with what tunekit writes inside it, within PATH_MAX: else TunekitError naming the key.

    Otherwise the first stat() or mkdir() of it fails with "File name too long" (ENAMETOOLONG),
    wherever that happens to be. Nothing is created; the limits are read from the deepest folder of
    the path that exists (a mount may have its own)."""
    full = os.path.abspath(os.path.expanduser(str(path)))
    parts = Path(full).parts
    existing = parts[0]
    for part in parts[1:]:
        step = os.path.join(existing, part)
        if len(os.fsencode(part)) > 255 or not os.path.isdir(step):
            break
        existing = step
    name_max = _limit(existing, "PC_NAME_MAX", 255)
    for part in parts[1:]:
        size = len(os.fsencode(part))
        if size > name_max:
            shown = part if len(part) <= 40 else f"{part[:20]}...{part[-12:]}"
            raise TunekitError(f"{key}: the name {shown!r} is {size} bytes long, more than the {name_max} a file or "
                               f"folder name may have on this file system; choose a shorter {key}")
    path_max = _limit(existing, "PC_PATH_MAX", 4096)
    size = len(os.fsencode(full))
    if size + INSIDE_BYTES > path_max:
        raise TunekitError(f"{key}: {full[:60]}... is {size} bytes long; with the {INSIDE_BYTES} bytes tunekit needs for "
                           f"the files inside it that passes the {path_max} a path may have; choose a shorter {key}")


def text(key: str, value, what: str, allow_none: bool = True) -> None:
    """A non-empty string (or None where allowed); one error naming the key and what it wants."""
    if value is None and allow_none:
        return
    if not isinstance(value, str) or not value.strip():
        raise TunekitError(f"{key}: empty; give {what}")

