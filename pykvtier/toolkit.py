"""What the package's tools (``replay``, ``bench``, ``doctor``, the operators' commands) share:
byte sizes as people write them, and JSON of their results.

A leaf of the tools: it imports nothing of pykvtier, and no module of the library imports it
(the import contract in pyproject.toml, checked by tests/test_imports.py).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

__all__ = ["parse_size", "format_bytes", "jsonable"]

_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*$")
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10, "kib": 1 << 10, "kb": 10**3,
    "m": 1 << 20, "mib": 1 << 20, "mb": 10**6,
    "g": 1 << 30, "gib": 1 << 30, "gb": 10**9,
    "t": 1 << 40, "tib": 1 << 40, "tb": 10**12,
}


def parse_size(text: str | int) -> int:
    """Parse a byte count: ``8589934592``, ``8GiB``, ``8G``, ``1.5GiB``, ``512M``, ``8GB``.

    ``K/M/G/T`` and ``KiB/MiB/GiB/TiB`` are powers of 1024; ``KB/MB/GB/TB`` powers of 1000.
    Raises ValueError naming the text for anything else, a negative int or fractional bytes.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"size must be >= 0, got {text}")
        return text
    m = _SIZE_RE.match(str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _SIZE_UNITS:
        raise ValueError(
            f"invalid size {text!r}: expected a number of bytes with an optional suffix "
            "K/M/G/T, KiB/MiB/GiB/TiB (x1024) or KB/MB/GB/TB (x1000), e.g. 8GiB"
        )
    value = float(m.group(1)) * _SIZE_UNITS[unit]
    if value != int(value) and unit in ("", "b"):
        raise ValueError(f"invalid size {text!r}: fractional bytes")
    return int(value)


def format_bytes(n: float) -> str:
    """``1835008`` -> ``'1.75 MiB'`` (powers of 1024, two decimals; below 1 KiB whole bytes)."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def jsonable(v: Any) -> Any:
    """``v`` with dict keys as str, tuples as lists, numpy scalars as Python numbers, bytes
    decoded as latin-1 and anything else JSON cannot hold as its ``str()``."""
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    if isinstance(v, dict):
        return {str(k): jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [jsonable(x) for x in v]
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, bytes):
        return v.decode("latin-1")
    return str(v)
