"""memory.events: parsing, and watching model groups for OOM kills.

Invariants owned here:
- `parse_memory_events` reads `key value` lines; unknown keys are kept, malformed lines raise
  CgroupError naming the file.
- `EventsWatcher.poll()` returns each counter increase since the previous poll (or since
  `watch`) exactly once, as `MemoryEvent`s; a counter that went down (group recreated) resets the
  baseline without an event. A group whose file vanished is reported once as `gone`.
- The kernel signals a change of memory.events as a file-modified event, so `fileno()` is an
  inotify descriptor (IN_MODIFY) for `loop.add_reader`; `poll()` drains it. Without inotify
  (`fileno()` is None) the caller polls on a timer. Either way, call `poll()` right after a
  runner dies, before removing its group, so an OOM kill is attributed to the right model.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from edge_agent.cgroup.fs import CgroupError
from edge_agent.libc import libc

__all__ = ["parse_memory_events", "MemoryEvent", "EventsWatcher", "Inotify", "OOM_KEYS"]

OOM_KEYS = ("oom_kill", "oom_group_kill")
IN_MODIFY = 0x00000002
IN_IGNORED = 0x00008000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC
_EVENT = struct.Struct("iIII")


def parse_memory_events(text: str, source: str = "memory.events") -> dict[str, int]:
    out: dict[str, int] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        parts = line.split()
        if len(parts) != 2 or not parts[1].isdigit():
            raise CgroupError(f"{source}: cannot parse line {line!r} (expected `key count`). "
                              "Hint: is this a cgroup v2 memory.events file?")
        out[parts[0]] = int(parts[1])
    return out


@dataclass(frozen=True)
class MemoryEvent:
    group: str  # the name given to watch()
    key: str  # "high", "max", "oom", "oom_kill", "oom_group_kill", ... or "gone"
    delta: int
    total: int

    @property
    def is_oom_kill(self) -> bool:
        return self.key in OOM_KEYS

    def describe(self) -> str:
        if self.key == "gone":
            return f"{self.group}: memory.events disappeared (group removed)"
        return f"{self.group}: {self.key} +{self.delta} (total {self.total})"


class Inotify:
    """A minimal inotify(7) wrapper over libc through ctypes."""

    def __init__(self) -> None:
        lib = libc()
        self._add = lib.inotify_add_watch
        self._add.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32)
        self._rm = lib.inotify_rm_watch
        self._rm.argtypes = (ctypes.c_int, ctypes.c_int)
        fd = lib.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            e = ctypes.get_errno()
            raise OSError(e, f"inotify_init1: {os.strerror(e)}")
        self.fd: int = fd

    def fileno(self) -> int:
        return self.fd

    def add(self, path: Path, mask: int = IN_MODIFY) -> int:
        wd = self._add(self.fd, os.fsencode(path), mask)
        if wd < 0:
            e = ctypes.get_errno()
            raise OSError(e, f"inotify_add_watch {path}: {os.strerror(e)}", str(path))
        return int(wd)

    def remove(self, wd: int) -> None:
        self._rm(self.fd, wd)  # EINVAL when the watch is already gone: ignored

    def read(self) -> list[tuple[int, int]]:
        """(wd, mask) of every queued event; [] when none."""
        out: list[tuple[int, int]] = []
        while True:
            try:
                buf = os.read(self.fd, 4096)
            except BlockingIOError:
                return out
            off = 0
            while off + _EVENT.size <= len(buf):
                wd, mask, _cookie, length = _EVENT.unpack_from(buf, off)
                out.append((wd, mask))
                off += _EVENT.size + length

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class EventsWatcher:
    def __init__(self, *, read: Callable[[Path], str] | None = None,
                 use_inotify: bool = True) -> None:
        self._read = read or (lambda p: p.read_text(encoding="ascii"))
        self._files: dict[str, Path] = {}
        self._last: dict[str, dict[str, int]] = {}
        self._wds: dict[str, int] = {}
        self.inotify: Inotify | None = None
        if use_inotify:
            try:
                self.inotify = Inotify()
            except (OSError, AttributeError):
                self.inotify = None

    def fileno(self) -> int | None:
        return self.inotify.fileno() if self.inotify else None

    def _snapshot(self, name: str, path: Path) -> dict[str, int] | None:
        try:
            return parse_memory_events(self._read(path), str(path))
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ENODEV):
                return None
            raise CgroupError(f"read {path}: {exc.strerror}. Hint: check the group "
                              "exists and is readable.", err=exc.errno, path=path) from exc

    def watch(self, name: str, events_file: Path) -> None:
        """Start watching a group's memory.events; counters so far are the baseline."""
        self.unwatch(name)
        snap = self._snapshot(name, events_file)
        if snap is None:
            raise CgroupError(f"watch {events_file}: no such file. Hint: create the group "
                              "(with +memory in its parent's subtree_control) first.",
                              err=errno.ENOENT, path=events_file)
        self._files[name] = events_file
        self._last[name] = snap
        if self.inotify is not None:
            try:
                self._wds[name] = self.inotify.add(events_file)
            except OSError:
                pass  # still polled

    def unwatch(self, name: str) -> None:
        self._files.pop(name, None)
        self._last.pop(name, None)
        wd = self._wds.pop(name, None)
        if wd is not None and self.inotify is not None:
            self.inotify.remove(wd)

    @property
    def watched(self) -> list[str]:
        return sorted(self._files)

    def poll(self) -> list[MemoryEvent]:
        if self.inotify is not None:
            self.inotify.read()
        out: list[MemoryEvent] = []
        for name, path in list(self._files.items()):
            snap = self._snapshot(name, path)
            if snap is None:
                out.append(MemoryEvent(name, "gone", 0, 0))
                self.unwatch(name)
                continue
            last = self._last[name]
            for key, total in snap.items():
                before = last.get(key, 0)
                if total > before:
                    out.append(MemoryEvent(name, key, total - before, total))
            self._last[name] = snap
        return out

    def close(self) -> None:
        for name in list(self._files):
            self.unwatch(name)
        if self.inotify is not None:
            self.inotify.close()
