"""Capabilities the PSI triggers need, read from /proc/self/status and dropped with capset(2).

Invariants owned here:
- CAP_SYS_RESOURCE is held only to arm PSI triggers (Linux < 6.5 checks it when a pressure file
  is opened for writing; an armed trigger keeps working without it). `drop_ambient()` removes a
  capability from this process's effective, permitted and inheritable sets (the kernel then
  drops it from the ambient set too, so runners spawned later never get it), and only when it
  was granted ambiently (AmbientCapabilities= in the unit): a root shell or a test run keeps
  what it has.
- Reading never raises: an unreadable status file means "not held".
"""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

from edge_agent.cgroup.fs import CgroupError
from edge_agent.libc import libc

__all__ = ["CAP_SYS_RESOURCE", "cap_sets", "holds", "drop_ambient"]

CAP_SYS_RESOURCE = 24
_VERSION_3 = 0x20080522  # _LINUX_CAPABILITY_VERSION_3: two 32-bit words per set


class _Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _Data(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


def cap_sets(status_text: str | None = None) -> dict[str, int]:
    """CapInh/CapPrm/CapEff/CapBnd/CapAmb of /proc/self/status as integers (missing: 0)."""
    if status_text is None:
        try:
            status_text = Path("/proc/self/status").read_text()
        except OSError:
            status_text = ""
    found = dict(re.findall(r"^(Cap\w+):\s*([0-9a-fA-F]+)", status_text, re.M))
    return {k: int(found.get(k, "0"), 16) for k in ("CapInh", "CapPrm", "CapEff", "CapBnd",
                                                      "CapAmb")}


def holds(cap: int, status_text: str | None = None, which: str = "CapEff") -> bool:
    return bool(cap_sets(status_text)[which] >> cap & 1)


def drop_ambient(cap: int) -> bool:
    """Drop `cap` from this process if it was granted ambiently; True when dropped."""
    if not holds(cap, which="CapAmb"):
        return False
    lib = libc()
    hdr = _Header(_VERSION_3, 0)
    data = (_Data * 2)()
    if lib.capget(ctypes.byref(hdr), data) != 0:
        err = ctypes.get_errno()
        raise CgroupError(f"capget(2) for this process failed (errno {err}). Hint: the "
                          f"capability {cap} stays held; report this kernel.", err=err)
    word, bit = divmod(cap, 32)
    mask = ctypes.c_uint32(~(1 << bit)).value
    for name in ("effective", "permitted", "inheritable"):
        setattr(data[word], name, getattr(data[word], name) & mask)
    if lib.capset(ctypes.byref(hdr), data) != 0:
        err = ctypes.get_errno()
        raise CgroupError(f"capset(2) dropping capability {cap} failed (errno {err}). Hint: "
                          "it stays held; remove it from the unit's AmbientCapabilities= on "
                          "kernels >= 6.5.", err=err)
    return not holds(cap)
