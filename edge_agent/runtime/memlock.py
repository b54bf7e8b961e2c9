"""Locking memory with mlock(2), and reading what the kernel says about it.

Invariants owned here:
- `mlock`/`munlock` take an address and a length; they never raise on an OS refusal, they return
  the errno (0 on success), so the caller's policy decides what a refusal means.
- `vmlck_bytes()` is the process-wide `VmLck` line of /proc/self/status (all locks of the process,
  not only ours); None when the kernel does not expose it.
- `lock_failure_message()` is the one place that explains a refused lock: the errno, the
  RLIMIT_MEMLOCK soft/hard values, whether CAP_IPC_LOCK is held, systemd's 8 MiB default
  (`LimitMEMLOCK=infinity`) and the policy switch, ending with a `Hint:`.
"""

from __future__ import annotations

import ctypes
import errno
import os
import resource
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edge_agent.libc import libc

__all__ = [
    "MLOCK_POLICIES",
    "CAP_IPC_LOCK",
    "SYSTEMD_DEFAULT_MEMLOCK",
    "MemlockEnv",
    "mlock",
    "munlock",
    "vmlck_bytes",
    "memlock_env",
    "format_bytes",
    "lock_failure_message",
]

MLOCK_POLICIES = ("required", "best-effort", "off")
CAP_IPC_LOCK = 14  # linux/capability.h
SYSTEMD_DEFAULT_MEMLOCK = 8 * 1024 * 1024  # systemd's default LimitMEMLOCK (v240 and later)

_libc: ctypes.CDLL | None = None


def _lib() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        lib = libc()
        for fn in (lib.mlock, lib.munlock):
            fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
            fn.restype = ctypes.c_int
        _libc = lib
    return _libc


def mlock(address: int, length: int) -> int:
    """mlock(2) the range; returns 0 on success, else the errno (ENOMEM, EPERM, ...)."""
    if length <= 0:
        return 0
    if _lib().mlock(ctypes.c_void_p(address), ctypes.c_size_t(length)) == 0:
        return 0
    return ctypes.get_errno() or errno.EIO


def munlock(address: int, length: int) -> int:
    """munlock(2) the range; returns 0 on success, else the errno."""
    if length <= 0:
        return 0
    if _lib().munlock(ctypes.c_void_p(address), ctypes.c_size_t(length)) == 0:
        return 0
    return ctypes.get_errno() or errno.EIO


def _status_field(name: str, status: Path) -> str | None:
    try:
        text = status.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(name + ":"):
            return line.split(":", 1)[1].strip()
    return None


def vmlck_bytes(status: Path = Path("/proc/self/status")) -> int | None:
    """Bytes this process has locked, from the `VmLck:` line (reported in kB), or None."""
    value = _status_field("VmLck", status)
    if value is None:
        return None
    number, _, unit = value.partition(" ")
    scale = {"kB": 1024, "": 1}.get(unit.strip(), 1024)
    return int(number) * scale


def _has_cap(cap: int, status: Path) -> bool | None:
    value = _status_field("CapEff", status)
    if value is None:
        return None
    return bool(int(value, 16) >> cap & 1)


@dataclass(frozen=True)
class MemlockEnv:
    """What decides whether mlock can succeed: RLIMIT_MEMLOCK and CAP_IPC_LOCK."""

    rlimit_soft: int | None  # bytes, None = unlimited
    rlimit_hard: int | None
    cap_ipc_lock: bool | None  # None when /proc is unavailable

    def can_lock(self, nbytes: int) -> bool:
        """Whether locking `nbytes` more should succeed (ignores what is already locked)."""
        if self.cap_ipc_lock:
            return True
        return self.rlimit_soft is None or nbytes <= self.rlimit_soft

    def describe(self) -> str:
        cap = {True: "held", False: "not held", None: "unknown"}[self.cap_ipc_lock]
        return (
            f"RLIMIT_MEMLOCK soft {_limit(self.rlimit_soft)}, hard {_limit(self.rlimit_hard)}; "
            f"CAP_IPC_LOCK {cap}"
        )

    def as_dict(self) -> dict[str, object]:
        return {
            "rlimit_memlock_soft": self.rlimit_soft,
            "rlimit_memlock_hard": self.rlimit_hard,
            "cap_ipc_lock": self.cap_ipc_lock,
        }


def memlock_env(status: Path = Path("/proc/self/status")) -> MemlockEnv:
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)

    def norm(v: int) -> int | None:
        return None if v == resource.RLIM_INFINITY else int(v)

    return MemlockEnv(norm(soft), norm(hard), _has_cap(CAP_IPC_LOCK, status))


def lock_summary(report: dict[str, Any]) -> str:
    """One line of a weights lock report (either engine's `lock_report()`)."""
    mb = format_bytes
    vm = "unknown" if report.get("vmlck_bytes") is None else mb(int(report["vmlck_bytes"]))
    if report.get("locked"):
        state = f"locked {mb(int(report.get('locked_bytes') or 0))}"
    elif report.get("policy") == "off":
        state = "not locked (mlock policy off)"
    else:
        state = "NOT LOCKED"
    if report.get("populate_s") is None and report.get("model_load_s") is not None:
        # llama.cpp's load maps the GGUF with MAP_POPULATE: the populate has no time of its own
        load = f"llama.cpp load {float(report['model_load_s']) * 1e3:.1f} ms"
    else:
        load = f"populate {float(report.get('populate_s') or 0) * 1e3:.1f} ms"
    return (f"weights {mb(int(report.get('weight_bytes') or 0))}: {state}, VmLck {vm}; "
            f"{load}, mlock {float(report.get('lock_s') or 0) * 1e3:.1f} ms")


def format_bytes(n: int) -> str:
    """1234567 -> '1.2 MiB' (binary units, one decimal)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _limit(v: int | None) -> str:
    return "unlimited" if v is None else format_bytes(v)


def lock_failure_message(what: str, nbytes: int, err: int, env: MemlockEnv) -> str:
    """Why locking `nbytes` of `what` failed with `err`, and how to fix it."""
    name = errno.errorcode.get(err, str(err))
    systemd = SYSTEMD_DEFAULT_MEMLOCK in (env.rlimit_soft, env.rlimit_hard)
    cap = {True: "held", False: "not held", None: "unknown"}[env.cap_ipc_lock]
    cause = (f"mlock of {nbytes:,} bytes ({format_bytes(nbytes)}) of {what} failed: {name} "
             f"({os.strerror(err)}); RLIMIT_MEMLOCK is {_limit(env.rlimit_soft)} soft / "
             f"{_limit(env.rlimit_hard)} hard"
             + (" (8 MiB is systemd's default LimitMEMLOCK)" if systemd else "")
             + f" and CAP_IPC_LOCK is {cap}")
    if err == errno.EPERM and env.rlimit_soft == 0:
        cause += "; a limit of 0 forbids locking anything"
    elif err == errno.ENOMEM and not env.can_lock(nbytes):
        cause += "; the weights are larger than the limit"
    elif err == errno.ENOMEM:
        cause += "; the limit is large enough, so memory itself (or locks already held) ran out"
    return (
        f"{cause}. Hint: under systemd set `LimitMEMLOCK=infinity` in the unit's [Service] "
        "section (or `AmbientCapabilities=CAP_IPC_LOCK`); in a shell raise it with "
        "`ulimit -l unlimited` as root or in /etc/security/limits.conf, or grant CAP_IPC_LOCK "
        "(`setcap cap_ipc_lock+ep` on the interpreter); or set the mlock policy to "
        "`best-effort` or `off` to serve unlocked (pages may then be swapped or dropped)."
    )
