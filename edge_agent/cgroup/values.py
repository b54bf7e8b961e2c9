"""Values of cgroup v2 memory files: parsing policy values, checking a value before it is
written, formatting it the way the kernel reads it.

Invariants owned here:
- A policy limit is one of: a byte size (int, or "512M"/"2G", binary suffixes as in
  edge_agent.sizes), "max" (no limit), or relative to the model's computed budget: "1.25x"
  (a factor) or "125%". Anything else is a ConfigError naming the file and the key.
- `resolve(limit, budget)` gives bytes (rounded up to whole 4 KiB pages, as the kernel would) or
  None for "max"; a relative limit without a budget is a ConfigError.
- `check_write(name, value)` accepts exactly what the kernel accepts for the files we write
  (memory.{min,low,high,max,swap.max}, memory.oom.group, cgroup.subtree_control,
  cgroup.procs, memory.pressure triggers) and raises CgroupValueError otherwise, so a bad value
  is refused before it reaches the kernel (which would answer EINVAL).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from edge_agent.errors import ConfigError, EdgeAgentError
from edge_agent.sizes import format_size, parse_size

__all__ = [
    "Limit",
    "parse_limit",
    "resolve",
    "to_kernel",
    "check_write",
    "parse_trigger",
    "Trigger",
    "CgroupValueError",
    "PAGE",
    "MEMORY_LIMIT_FILES",
]

PAGE = 4096
MEMORY_LIMIT_FILES = ("memory.min", "memory.low", "memory.high", "memory.max", "memory.swap.max")
_FACTOR_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(x|%)\s*$", re.IGNORECASE)
_CONTROLLER_RE = re.compile(r"^[+-][a-z_]+$")


class CgroupValueError(EdgeAgentError, ValueError):
    """A value the kernel would reject for a cgroup file (EINVAL), caught before writing."""


@dataclass(frozen=True)
class Limit:
    """bytes (absolute), factor (times the model budget), or neither: "max"."""

    bytes: int | None = None
    factor: float | None = None

    @property
    def is_max(self) -> bool:
        return self.bytes is None and self.factor is None

    def __str__(self) -> str:
        if self.factor is not None:
            return f"{self.factor:g}x budget"
        return format_size(self.bytes)


def parse_limit(value: object, *, where: str, relative: bool = True) -> Limit:
    """A policy value; `where` names file and key for errors ("cgroups/x.toml: model.high")."""
    if isinstance(value, str):
        m = _FACTOR_RE.match(value)
        if m:
            if not relative:
                raise ConfigError(
                    f"{where}: {value!r} is relative to a model budget, which this key does "
                    "not have. Hint: give a size such as 256M, or 'max'."
                )
            factor = float(m.group(1)) / (100.0 if m.group(2) == "%" else 1.0)
            if factor <= 0:
                raise ConfigError(f"{where}: {value!r} must be above zero. Hint: e.g. '1.25x'.")
            return Limit(factor=factor)
    try:
        size = parse_size(value)
    except ValueError as exc:
        rel = ", a factor of the model budget like '1.25x' or '125%'" if relative else ""
        raise ConfigError(
            f"{where}: {exc}. Hint: use bytes, a size with K/M/G/T (binary){rel}, or 'max'."
        ) from None
    return Limit(bytes=size)


def resolve(limit: Limit, budget: int | None, *, where: str = "limit") -> int | None:
    """Bytes for the kernel (whole pages, rounded up) or None for max."""
    if limit.factor is not None:
        if budget is None:
            raise ConfigError(
                f"{where}: {limit} needs the model's budget, and none was given. "
                "Hint: pass --budget BYTES, or use an absolute size in the policy."
            )
        raw = int(math.ceil(budget * limit.factor))
    elif limit.bytes is not None:
        raw = limit.bytes
    else:
        return None
    return -(-raw // PAGE) * PAGE


def to_kernel(size: int | None) -> str:
    """The text written into a memory.* file: digits or "max"."""
    return "max" if size is None else str(int(size))


@dataclass(frozen=True)
class Trigger:
    """A PSI trigger: `some|full <stall_us> <window_us>`."""

    kind: str
    stall_us: int
    window_us: int

    def __str__(self) -> str:
        return f"{self.kind} {self.stall_us} {self.window_us}"


def parse_trigger(text: str, *, where: str = "trigger") -> Trigger:
    """Validate a PSI trigger as the kernel does (window 500 ms..10 s, 0 < stall <= window)."""
    parts = str(text).split()
    hint = ("Hint: write e.g. 'some 300000 2000000' (300 ms stalled per 2 s window; "
            "without CAP_SYS_RESOURCE the window must be a multiple of 2 s).")
    if len(parts) != 3 or parts[0] not in ("some", "full") or not all(
        p.isdigit() for p in parts[1:]
    ):
        raise ConfigError(f"{where}: {text!r} is not `some|full STALL_US WINDOW_US`. {hint}")
    stall, window = int(parts[1]), int(parts[2])
    if not 500_000 <= window <= 10_000_000:
        raise ConfigError(f"{where}: window {window} us is outside 500000..10000000 (the "
                          f"kernel's bounds). {hint}")
    if not 0 < stall <= window:
        raise ConfigError(f"{where}: stall {stall} us must be above 0 and at most the window "
                          f"({window} us). {hint}")
    return Trigger(parts[0], stall, window)


def check_write(name: str, value: str) -> None:
    """Refuse a value the kernel would answer with EINVAL for file `name`."""
    v = value.strip()
    ok: bool
    if name in MEMORY_LIMIT_FILES:
        ok = v == "max" or v.isdigit()
        expect = "a byte count or 'max'"
    elif name == "memory.oom.group":
        ok = v in ("0", "1")
        expect = "0 or 1"
    elif name in ("cgroup.procs", "cgroup.threads"):
        ok = v.isdigit()
        expect = "one process id"
    elif name == "cgroup.subtree_control":
        ok = bool(v.split()) and all(_CONTROLLER_RE.match(w) for w in v.split())
        expect = "controllers with + or - such as '+memory'"
    elif name == "cgroup.kill":
        ok = v == "1"
        expect = "1"
    elif name.endswith(".pressure"):
        try:
            parse_trigger(v)
            ok, expect = True, ""
        except ConfigError as exc:
            raise CgroupValueError(f"{name} <- {value!r}: {exc}") from None
    else:
        raise CgroupValueError(
            f"{name} <- {value!r}: edge-agent does not write this file. Hint: only memory "
            "limits, memory.oom.group, cgroup.procs, cgroup.subtree_control and PSI triggers."
        )
    if not ok:
        raise CgroupValueError(
            f"{name} <- {value!r}: the kernel would reject it (EINVAL); expected {expect}. "
            "Hint: check the policy in cgroups/*.toml."
        )
