"""Pressure stall information: a trigger on memory.pressure, or systemd's memory pressure
protocol ($MEMORY_PRESSURE_WATCH / $MEMORY_PRESSURE_WRITE), waited on without asyncio.

Invariants owned here:
- Source kinds follow systemd's protocol: a regular (PSI) file is opened O_RDWR, the trigger
  written, POLLPRI watched and never read; a FIFO is opened (O_RDWR, so it never reports HUP),
  POLLIN watched and the data discarded; an AF_UNIX socket is connected, POLLIN watched, data
  discarded, EOF means closed. The payload is written right after opening.
  `MEMORY_PRESSURE_WATCH=/dev/null` means pressure handling is off (`from_env` returns None).
- The kernel replaces the last byte of a trigger write with NUL, so a payload for a PSI file
  always ends with NUL (appended when missing).
- `fileno()` is a private epoll descriptor holding the source with EPOLLPRI (PSI) or EPOLLIN, so
  asyncio's `loop.add_reader(w.fileno(), cb)` works although asyncio cannot ask for EPOLLPRI.
  A PSI fd always polls as readable (EPOLLIN), so it must never be given to add_reader itself.
  When the outer loop finds the epoll fd readable, the kernel has already consumed the PSI
  event while checking it, so `handle_ready()` (the add_reader callback) counts readiness as
  one event. `wait(timeout)` is the blocking form for threads and tests.
- Failures become PressureError with the cause: EOPNOTSUPP (PSI compiled in but disabled:
  psi=1 missing), ENOENT (no PSI file), EINVAL (trigger rejected; on a kernel >= 6.5 without
  CAP_SYS_RESOURCE also a window that is not a multiple of 2 s), EACCES/EPERM (kernel < 6.5
  without CAP_SYS_RESOURCE, or a root-owned file under systemd < 254: never a Delegate= issue).
  The hint says which of these applies to this process (kernel release, CapEff, file owner).
"""

from __future__ import annotations

import base64
import binascii
import errno
import os
import re
import select
import socket
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from edge_agent.cgroup.caps import CAP_SYS_RESOURCE, holds
from edge_agent.cgroup.fs import FIX_PSI, CgroupError, errno_name
from edge_agent.cgroup.values import Trigger
from edge_agent.errors import ConfigError

__all__ = ["PressureWatcher", "PressureError", "PressureStats", "parse_pressure",
           "read_pressure", "permission_hint", "window_hint", "has_cap_sys_resource",
           "unprivileged_triggers", "ENV_WATCH", "ENV_WRITE", "CAP_SYS_RESOURCE",
           "FIX_TRIGGER"]

ENV_WATCH = "MEMORY_PRESSURE_WATCH"
ENV_WRITE = "MEMORY_PRESSURE_WRITE"
UNPRIVILEGED_SINCE = (6, 5)  # Linux 6.5: triggers without CAP_SYS_RESOURCE, 2 s windows only
FIX_TRIGGER = ("add CAP_SYS_RESOURCE to the unit's CapabilityBoundingSet= and "
               "AmbientCapabilities= (the shipped unit has it: re-run `edge-agent systemd "
               "install`); or boot a kernel >= 6.5 and use a trigger window that is a multiple "
               "of 2 s (cgroup policy pressure.trigger)")


class PressureError(CgroupError):
    """The pressure source could not be opened or armed, or it went away."""


@dataclass(frozen=True)
class PressureStats:
    some_avg10: float
    some_avg60: float
    some_avg300: float
    some_total_us: int
    full_avg10: float | None = None
    full_total_us: int | None = None

    def to_dict(self) -> dict[str, float | int | None]:
        return {"some_avg10": self.some_avg10, "some_avg60": self.some_avg60,
                "some_avg300": self.some_avg300, "some_total_us": self.some_total_us,
                "full_avg10": self.full_avg10, "full_total_us": self.full_total_us}


def parse_pressure(text: str, source: str = "memory.pressure") -> PressureStats:
    rows: dict[str, dict[str, str]] = {}
    try:
        for line in text.splitlines():
            if line.strip():
                kind, *pairs = line.split()
                rows[kind] = dict(p.split("=", 1) for p in pairs)
        some, full = rows["some"], rows.get("full")
        return PressureStats(float(some["avg10"]), float(some["avg60"]), float(some["avg300"]),
                             int(some["total"]), float(full["avg10"]) if full else None,
                             int(full["total"]) if full else None)
    except (KeyError, ValueError) as exc:
        raise CgroupError(f"{source}: cannot parse {text[:80]!r} ({exc}). Hint: expected "
                          "`some avg10=.. avg60=.. avg300=.. total=..` lines.") from None


def read_pressure(path: Path) -> PressureStats:
    try:
        text = Path(path).read_text(encoding="ascii")
    except OSError as exc:
        raise _error("read", Path(path), exc) from exc
    return parse_pressure(text, str(path))


def has_cap_sys_resource(status_text: str | None = None) -> bool:
    """CAP_SYS_RESOURCE in this process's effective set (CapEff of /proc/self/status)."""
    return holds(CAP_SYS_RESOURCE, status_text)


def unprivileged_triggers(release: str) -> bool:
    """Linux >= 6.5 lets a process without CAP_SYS_RESOURCE arm a trigger (2 s windows)."""
    m = re.match(r"(\d+)\.(\d+)", release)
    return m is not None and (int(m.group(1)), int(m.group(2))) >= UNPRIVILEGED_SINCE


def _window(payload: bytes | None) -> int | None:
    parts = (payload or b"").rstrip(b"\0\n").split()
    return int(parts[2]) if len(parts) == 3 and parts[2].isdigit() else None


def window_hint(release: str, has_cap: bool, window_us: int | None) -> str | None:
    """The 2 s rule, when it is what refused the trigger: kernel >= 6.5, no CAP_SYS_RESOURCE and
    a window that is not a multiple of 2 s. None when that rule does not apply."""
    if has_cap or window_us is None or window_us % 2_000_000 == 0:
        return None
    if not 500_000 <= window_us <= 10_000_000:
        return None  # out of range for everyone: the generic EINVAL hint says so
    if not unprivileged_triggers(release):
        return None
    return (f"this process lacks CAP_SYS_RESOURCE and runs Linux {release} (>= 6.5), which "
            f"accepts unprivileged triggers only with a window that is a multiple of 2 s; "
            f"{window_us} us is not. Fix: use a window of 2000000, 4000000, ... us in the cgroup "
            "policy's pressure.trigger, or grant CAP_SYS_RESOURCE (AmbientCapabilities= and "
            "CapabilityBoundingSet= in the unit)")


def permission_hint(path: Path, release: str | None = None, uid: int | None = None,
                    has_cap: bool | None = None, window_us: int | None = None) -> str:
    """Why a trigger write is refused with EACCES/EPERM and what fixes it. Delegate=yes is
    not the cause when the group is delegated: the kernel, the capability, the file's owner
    (systemd < 254) or the 2 s rule is."""
    release = os.uname().release if release is None else release
    uid = os.geteuid() if uid is None else uid
    has_cap = has_cap_sys_resource() if has_cap is None else has_cap
    try:
        owner: int | None = os.stat(path).st_uid
    except OSError:
        owner = None
    why = []
    if owner is not None and owner != uid:
        why.append(f"{path.name} is owned by uid {owner}, not by this process (uid {uid}): "
                   "systemd < 254 leaves it root-owned even with Delegate=yes (edge-agent then "
                   "arms triggers on the supervisor/ and models/ groups it creates and owns)")
    if not unprivileged_triggers(release) and not has_cap:
        why.append(f"Linux {release} (< 6.5) opens a pressure file for writing only with "
                   "CAP_SYS_RESOURCE, which this process lacks")
    rule = window_hint(release, has_cap, window_us)
    if rule:
        why.append(rule)
    cap = "holds" if has_cap else "lacks"
    return (f"not allowed to create a PSI trigger (kernel {release}; this process {cap} "
            f"CAP_SYS_RESOURCE): {'; '.join(why) or 'no known rule explains it'}. Before Linux "
            "6.5 creating a trigger needs CAP_SYS_RESOURCE; from 6.5 unprivileged triggers are "
            f"allowed when the window is a multiple of 2 s. Fix one of: {FIX_TRIGGER}; or use "
            "systemd >= 254, which arms the trigger itself and passes $MEMORY_PRESSURE_WATCH "
            "(MemoryPressureWatch=auto). Without any trigger the daemon polls memory.pressure "
            "(avg10) every 2 s instead")


def _error(action: str, path: Path, exc: OSError, payload: bytes | None = None) -> PressureError:
    err = exc.errno or 0
    shown = payload.rstrip(b"\0").decode("ascii", "replace") if payload else None
    what = f"{action} {path}" + (f" <- {shown!r}" if shown is not None else "")
    if err == errno.EOPNOTSUPP:
        hint = ("PSI is compiled into this kernel but disabled at boot (psi=1 missing); "
                + FIX_PSI + ".")
    elif err == errno.ENOENT:
        hint = FIX_PSI + "."
    elif err == errno.EINVAL:
        rule = window_hint(os.uname().release, has_cap_sys_resource(), _window(payload))
        hint = (rule + "." if rule else
                "the kernel rejected the trigger: use `some|full STALL_US WINDOW_US` with a "
                "window of 500000..10000000 us and a stall no longer than the window; without "
                "CAP_SYS_RESOURCE (kernel >= 6.5) the window must be a multiple of 2 s.")
    elif err in (errno.EACCES, errno.EPERM):
        hint = permission_hint(path, window_us=_window(payload))
    else:
        hint = "see `edge-agent doctor`."
    code = errno_name(err)
    return PressureError(f"{what}: {os.strerror(err) if err else exc} ({code}). Hint: {hint}",
                         err=err, path=path)


class PressureWatcher:
    def __init__(self, path: Path, payload: bytes | None = None) -> None:
        self.path = Path(path)
        self.payload = payload
        self.kind = ""  # "psi" | "fifo" | "socket" once open
        self.events = 0
        self.closed = False
        self._fd = -1
        self._sock: socket.socket | None = None
        self._ep: select.epoll | None = None
        self._skip = 0
        self.note = ""  # set when the trigger had to be adjusted

    @classmethod
    def from_env(cls, env: Mapping[str, str], default_path: Path | None,
                 trigger: Trigger) -> PressureWatcher | None:
        """systemd's $MEMORY_PRESSURE_WATCH when set (None for /dev/null), else a trigger on
        `default_path` (our cgroup's memory.pressure); None when neither exists."""
        watch = env.get(ENV_WATCH)
        if watch:
            if watch == "/dev/null":
                return None
            payload = None
            if env.get(ENV_WRITE):
                try:
                    payload = base64.b64decode(env[ENV_WRITE], validate=True)
                except (binascii.Error, ValueError):
                    raise ConfigError(f"${ENV_WRITE}={env[ENV_WRITE]!r}: not valid base64. "
                                      "Hint: systemd sets it; unset it or fix the unit's "
                                      "Environment=.") from None
            return cls(Path(watch), payload if payload is not None else
                       str(trigger).encode() + b"\0")
        if default_path is None:
            return None
        return cls(Path(default_path), str(trigger).encode() + b"\0")

    def open(self) -> PressureWatcher:
        try:
            st = os.stat(self.path)
        except OSError as exc:
            raise _error("open", self.path, exc) from exc
        mask = select.EPOLLIN
        try:
            if stat.S_ISSOCK(st.st_mode):
                self.kind = "socket"
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
                self._sock.connect(str(self.path))
                if self.payload:
                    self._sock.sendall(self.payload)
                self._sock.setblocking(False)
                self._fd = self._sock.fileno()
            elif stat.S_ISFIFO(st.st_mode):
                self.kind = "fifo"
                self._fd = os.open(self.path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
                if self.payload:
                    os.write(self._fd, self.payload)
                    self._skip = len(self.payload)
            else:
                self.kind, mask = "psi", select.EPOLLPRI
                self._fd = os.open(self.path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
                self._arm()
        except OSError as exc:
            action = "open" if self._fd < 0 else "write trigger to"
            self.close()
            raise _error(action, self.path, exc, self.payload) from exc
        self._ep = select.epoll()
        try:
            self._ep.register(self._fd, mask)
        except OSError as exc:
            self.close()
            raise PressureError(
                f"watch {self.path}: cannot be polled ({exc.strerror}): it is "
                "not a PSI file, FIFO or socket. Hint: point $MEMORY_PRESSURE_WATCH (or the "
                "cgroup) at a memory.pressure file.", err=exc.errno, path=self.path) from exc
        return self

    def _arm(self) -> None:
        """Write the trigger. Without CAP_SYS_RESOURCE, kernels >= 6.5 take only windows that
        are a multiple of 2 s (EINVAL otherwise): then retry once with the window rounded up
        to 2 s and the stall scaled alike, and say so in `note`."""
        payload = self.payload or b""
        if not payload.endswith((b"\0", b"\n")):
            payload += b"\0"
        self.payload = payload
        try:
            os.write(self._fd, payload)
            return
        except OSError as exc:
            parts = payload.rstrip(b"\0\n").split()
            if exc.errno != errno.EINVAL or len(parts) != 3 or not all(
                p.isdigit() for p in parts[1:]
            ):
                raise
            stall, window = int(parts[1]), int(parts[2])
            if window % 2_000_000 == 0 or not 500_000 <= window <= 10_000_000 or not (
                0 < stall <= window
            ):
                raise  # not the 2 s rule: the trigger itself is wrong
            wider = -(-window // 2_000_000) * 2_000_000
            retry = b"%s %d %d\0" % (parts[0], stall * wider // window, wider)
            os.write(self._fd, retry)  # raises the kernel's answer if this fails too
            self.note = (f"trigger {payload.rstrip(bytes(1)).decode()!r} refused (EINVAL: "
                         "windows must be a multiple of 2 s without CAP_SYS_RESOURCE); armed "
                         f"{retry.rstrip(bytes(1)).decode()!r} instead")
            self.payload = retry

    def fileno(self) -> int:
        if self._ep is None:
            raise PressureError(f"{self.path}: pressure watcher is not open. Hint: call open().")
        return self._ep.fileno()

    def _drain(self) -> bool:
        """Read and discard queued data (FIFO/socket); True if any was someone else's."""
        got = 0
        while True:
            try:
                data = self._sock.recv(4096) if self._sock else os.read(self._fd, 4096)
            except (BlockingIOError, InterruptedError):
                break
            if not data:
                if self.kind == "socket":
                    self.closed = True
                break
            take = min(self._skip, len(data))
            self._skip -= take
            got += len(data) - take
        return got > 0

    def _process(self, evs: list[tuple[int, int]], ready: bool) -> bool:
        if self.kind == "psi":
            if any(m & (select.EPOLLERR | select.EPOLLHUP) for _, m in evs):
                self.closed = True
                raise PressureError(f"{self.path}: the pressure file reported an error (group "
                                    "removed?). Hint: re-open the watcher after setup.")
            hit = ready or any(m & select.EPOLLPRI for _, m in evs)
        else:
            hit = self._drain() if (evs or ready) else False
        if hit:
            self.events += 1
        return hit

    def wait(self, timeout_s: float | None) -> bool:
        """Block up to timeout_s (None: forever) for one pressure event."""
        if self._ep is None:
            raise PressureError(f"{self.path}: pressure watcher is not open. Hint: call open().")
        evs = self._ep.poll(-1 if timeout_s is None else timeout_s)
        return self._process(evs, False)

    def handle_ready(self) -> bool:
        """The loop.add_reader callback: True when this readiness is a pressure event."""
        if self._ep is None:
            return False
        return self._process(self._ep.poll(0), self.kind == "psi")

    def close(self) -> None:
        if self._ep is not None:
            self._ep.close()
            self._ep = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        elif self._fd >= 0:
            os.close(self._fd)
        self._fd = -1

    def __enter__(self) -> PressureWatcher:
        return self.open() if self._ep is None else self

    def __exit__(self, *exc: object) -> None:
        self.close()
