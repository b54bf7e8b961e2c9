"""The C library through ctypes, for the calls the os module lacks (mlock, capset, inotify)."""

from __future__ import annotations

import ctypes
import functools

__all__ = ["libc"]


@functools.lru_cache(maxsize=1)
def libc() -> ctypes.CDLL:
    """glibc as the process has it loaded already (dlopen(NULL), errno kept for each call).
    `ctypes.util.find_library("c")` would run `ldconfig -p` in a child process, 2-10 ms on
    the daemon's and the runner's way to READY."""
    return ctypes.CDLL(None, use_errno=True)
