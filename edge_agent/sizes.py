"""Byte sizes as people write them in configuration ("512M", "2G", "max") and back.

Invariants owned here:
- Suffixes are binary, as in systemd's `MemoryMax=`: K = 1024, M = 1024², G = 1024³, T = 1024⁴.
  `K`, `KB`, `KiB` (any case) mean the same thing; a bare integer is bytes.
- "max" (also "infinity") means "no configured limit" and parses to None.
- `format_size(parse_size(s))` is a readable form; `parse_size(format_size(n)) == n` holds for
  any n that is a whole multiple of its unit (format_size falls back to bytes otherwise).
"""

from __future__ import annotations

import re

__all__ = ["parse_size", "format_size", "UNLIMITED_WORDS"]

UNLIMITED_WORDS = ("max", "infinity")
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)


def parse_size(value: object, *, allow_max: bool = True) -> int | None:
    """Bytes from an int or a string like "512M"; None for "max" when allowed.

    Raises ValueError with a sentence saying what was expected (callers add the key and source).
    """
    if isinstance(value, bool):
        raise ValueError(f"expected a size like 512M or 2G, got boolean {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"expected a size >= 0, got {value}")
        return value
    if not isinstance(value, str):
        raise ValueError(f"expected a size like 512M or 2G, got {type(value).__name__} {value!r}")
    text = value.strip().lower()
    if text in UNLIMITED_WORDS:
        if not allow_max:
            raise ValueError(f"expected a size like 512M or 2G, got {value!r} (no limit here)")
        return None
    match = _SIZE_RE.match(text)
    if match is None:
        choices = "an integer byte count, a number with K/M/G/T (binary units)"
        if allow_max:
            choices += ", or 'max'"
        raise ValueError(f"expected {choices}; got {value!r}")
    number, unit = match.groups()
    size = float(number) * _UNITS[unit.lower()]
    if size != int(size):
        raise ValueError(f"{value!r} is not a whole number of bytes")
    return int(size)


def format_size(size: int | None) -> str:
    """Shortest exact form: 1073741824 -> "1G", 1536 -> "1536", None -> "max"."""
    if size is None:
        return "max"
    for suffix, unit in (("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if size >= unit and size % unit == 0:
            return f"{size // unit}{suffix}"
    return str(size)
