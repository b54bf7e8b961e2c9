"""The tty fast path's fd and termios primitives (no state of their own).

Invariants this module owns:
- Only a pyserial POSIX port (a tty or pty) that is open yields an fd; anything else (socket://,
  stm32sim://, loop://) keeps pyserial's own reads.
- `blocking_reads` clears O_NONBLOCK and returns exactly what it changed (fd flags and termios),
  so the caller can put both back; if the fd refuses, nothing was changed and it returns None.
- A wait given to VTIME is rounded up to 0.1 s steps and kept within 1..255 (never 0, which
  would make read() return at once); waits longer than `VTIME_MAX_S` must take another path.
- `write_all` sends a frame in one write() unless a signal cuts it short, then the rest.
"""

from __future__ import annotations

import fcntl
import math
import os
import termios
from typing import Any

__all__ = ["VTIME_MAX_S", "blocking_reads", "deciseconds", "posix_fd", "write_all"]

VTIME_MAX_S = 25.5  # the longest wait VTIME can express; longer ones take the general path


def posix_fd(port: Any) -> int | None:
    """The file descriptor of a pyserial POSIX port (a tty or pty), else None."""
    try:
        from serial.serialposix import Serial as PosixSerial
    except ImportError:  # pragma: no cover - not on POSIX
        return None
    if isinstance(port, PosixSerial) and port.is_open and port.fd is not None:
        return int(port.fd)
    return None


def blocking_reads(fd: int) -> tuple[int, list[Any]] | None:
    """Clear O_NONBLOCK on a tty (VMIN/VTIME are set per wait); returns what to restore, or
    None if the fd refuses (then pyserial's reads are used)."""
    try:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        attrs = termios.tcgetattr(fd)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_NONBLOCK)
    except (OSError, termios.error):
        return None
    return flags, attrs


def deciseconds(seconds: float) -> int:
    """A wait as VTIME: 0.1 s steps, rounded up, within 1..255."""
    return max(1, min(255, math.ceil(seconds * 10 - 1e-9)))


def write_all(fd: int, data: bytes) -> None:
    """All of `data` to a blocking fd (one write() unless a signal cuts it short)."""
    n = os.write(fd, data)
    while n < len(data):
        n += os.write(fd, memoryview(data)[n:])
