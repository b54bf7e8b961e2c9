"""Value parsers for configuration keys: a TOML value or an environment string in, the typed value
out, or ValueError with a sentence naming what was expected (config_schema adds key and source).

Invariants owned here:
- A parser accepts the TOML type and the same value written as an environment string ("5",
  "true", "0660"), and nothing else: booleans are never integers, NaN is never a number.
- Messages say what was expected and show what was given (type and value).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from edge_agent.sizes import parse_size

__all__ = [
    "describe", "int_in", "float_in", "boolean", "choice", "string", "nonempty", "path", "mode",
    "size", "size_or_max", "threads", "stopbits", "tcp", "split_hostport",
]


def describe(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"


def int_in(lo: int, hi: int) -> Callable[[Any], int]:
    def parse(value: Any) -> int:
        if isinstance(value, str) and re.fullmatch(r"\s*[+-]?\d+\s*", value):
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"expected an integer from {lo} to {hi}, got {describe(value)}")
        if not lo <= value <= hi:
            raise ValueError(f"expected an integer from {lo} to {hi}, got {value}")
        return value

    return parse


def float_in(lo: float, hi: float, *, none_word: str | None = None) -> Callable[[Any], Any]:
    def parse(value: Any) -> float | None:
        if none_word and isinstance(value, str) and value.strip().lower() == none_word:
            return None
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
            extra = f" or {none_word!r}" if none_word else ""
            raise ValueError(f"expected a number from {lo} to {hi}{extra}, got {describe(value)}")
        if not lo <= value <= hi:
            raise ValueError(f"expected a number from {lo} to {hi}, got {value}")
        return float(value)

    return parse


_TRUE = ("true", "yes", "on", "1")
_FALSE = ("false", "no", "off", "0")


def boolean(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise ValueError(f"expected true or false (or {'/'.join(_TRUE[1:] + _FALSE[1:])}), "
                     f"got {describe(value)}")


def choice(*choices: str) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        if not isinstance(value, str) or value not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}; got {value!r}")
        return value

    return parse


def string(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {describe(value)}")
    return value


def nonempty(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"expected a non-empty string, got {describe(value)}")
    return value


def path(value: Any) -> Path:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"expected a non-empty path string, got {describe(value)}")
    return Path(value).expanduser()


def mode(value: Any) -> int:
    if isinstance(value, str) and re.fullmatch(r"(0o?)?[0-7]{1,4}", value.strip()):
        text = value.strip()
        value = int(text[2:] if text.startswith("0o") else text, 8)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 0o7777:
        raise ValueError(f"expected an octal file mode like \"0660\" or 0o660, got {value!r}")
    return value


def size(value: Any) -> int:
    size = parse_size(value, allow_max=False)
    assert size is not None
    return size


def size_or_max(value: Any) -> int | None:
    return parse_size(value, allow_max=True)


def threads(value: Any) -> int | None:
    if isinstance(value, str) and value.strip().lower() == "auto":
        return None
    try:
        return int_in(1, 1024)(value)
    except ValueError:
        raise ValueError(f"expected 'auto' or an integer from 1 to 1024, got {value!r}") from None


def stopbits(value: Any) -> float:
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or value not in (1, 1.5, 2):
        raise ValueError(f"expected 1, 1.5 or 2 stop bits, got {describe(value)}")
    return float(value)


def tcp(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected \"\" (off) or \"HOST:PORT\", got {describe(value)}")
    if value == "":
        return value
    split_hostport(value)
    return value


def split_hostport(value: str) -> tuple[str, int]:
    match = re.fullmatch(r"\[([0-9a-fA-F:.]+)\]:(\d+)|([^:\[\]]+):(\d+)", value.strip())
    if match is None:
        raise ValueError(f"expected \"HOST:PORT\" such as \"127.0.0.1:8080\" or \"[::1]:8080\", "
                         f"got {value!r}")
    host = match.group(1) or match.group(3)
    port = int(match.group(2) or match.group(4))
    if not 1 <= port <= 65535:
        raise ValueError(f"port {port} out of range 1..65535 in {value!r}")
    return host, port
