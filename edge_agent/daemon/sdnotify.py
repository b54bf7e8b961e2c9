"""systemd's notify protocol and socket activation, spoken directly (no libsystemd).

Invariants owned here:
- A notification is one datagram of newline-separated KEY=VALUE lines sent to $NOTIFY_SOCKET;
  a leading '@' means the Linux abstract namespace ('\\0' + rest). Without NOTIFY_SOCKET every
  call is a no-op, so the daemon runs the same in a terminal as under systemd.
- The watchdog is enabled only when WATCHDOG_USEC is set and WATCHDOG_PID is unset or equals our
  pid; pings are due every WATCHDOG_USEC / 2 (seconds returned as float).
- Socket activation: fds 3 .. 3+LISTEN_FDS-1 are ours only when LISTEN_PID equals our pid (a
  child that inherited the environment gets none); they are made close-on-exec.
- The environment is a parameter; nothing here reads os.environ implicitly except as the default.
- Sending never stalls or kills the caller's event loop: the datagram socket is non-blocking, a
  notification that would block (the manager's queue is full) or fails (its socket is gone) is
  dropped, reported through `log` (default: this module's logger, as a warning; once per kind
  of failure until a send succeeds again) and `send` returns False. NotifyError is raised only
  for setup errors (malformed variables).
"""

from __future__ import annotations

import errno
import logging
import os
import socket
from collections.abc import Callable, Mapping

from edge_agent.errors import EdgeAgentError

__all__ = [
    "Notifier",
    "NotifyError",
    "watchdog_interval",
    "listen_fds",
    "listen_fds_with_names",
    "SD_LISTEN_FDS_START",
]

SD_LISTEN_FDS_START = 3


class NotifyError(EdgeAgentError, OSError):
    """A malformed systemd environment variable (setup error; sends never raise it)."""


logger = logging.getLogger(__name__)


def _address(value: str) -> str | bytes:
    if value.startswith("@"):
        return b"\0" + value[1:].encode()
    if value.startswith("/"):
        return value
    raise NotifyError(
        f"NOTIFY_SOCKET={value!r}: expected an absolute path or '@' + an abstract socket name. "
        "Hint: this variable is set by systemd (Type=notify); unset it when running by hand."
    )


class Notifier:
    """Sends sd_notify messages; `Notifier(None)` (no NOTIFY_SOCKET) does nothing."""

    def __init__(self, address: str | None,
                 log: Callable[[str], None] | None = None) -> None:
        self.address = address
        self._target = _address(address) if address else None
        self._sock: socket.socket | None = None
        self._log = log if log is not None else logger.warning
        self._last_failure: int | None = None  # errno of the last reported failure
        self.dropped = 0  # notifications that could not be sent

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ,
                 log: Callable[[str], None] | None = None) -> Notifier:
        return cls(env.get("NOTIFY_SOCKET") or None, log)

    @property
    def enabled(self) -> bool:
        return self._target is not None

    def send(self, *lines: str) -> bool:
        """Send KEY=VALUE lines in one datagram. False when there is no notify socket or the
        datagram was dropped (would block, or failed: reported through `log`, never raised)."""
        if self._target is None:
            return False
        payload = "\n".join(lines).encode()
        try:
            if self._sock is None:
                self._sock = socket.socket(
                    socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
            self._sock.sendto(payload, self._target)
        except OSError as exc:
            self.dropped += 1
            code = exc.errno or -1
            if code != self._last_failure:
                self._last_failure = code
                why = ("would block: the service manager's queue is full"
                       if code in (errno.EAGAIN, errno.EWOULDBLOCK) else (exc.strerror or str(exc)))
                self._log(
                    f"sd_notify {payload[:60]!r} to NOTIFY_SOCKET={self.address}: {why}; "
                    "dropped (further failures of this kind are not reported until a send "
                    "succeeds). Hint: check `systemctl status` and the unit's NotifyAccess=."
                )
            return False
        self._last_failure = None
        return True

    def ready(self, status: str | None = None) -> bool:
        lines = ["READY=1", f"MAINPID={os.getpid()}"]
        if status:
            lines.append(f"STATUS={_one_line(status)}")
        return self.send(*lines)

    def status(self, text: str) -> bool:
        return self.send(f"STATUS={_one_line(text)}")

    def extend_timeout(self, usec: int) -> bool:
        """Ask for `usec` more microseconds before the start/stop timeout fires."""
        if usec <= 0:
            raise ValueError(f"extend_timeout: usec must be > 0, got {usec}")
        return self.send(f"EXTEND_TIMEOUT_USEC={int(usec)}")

    def watchdog(self) -> bool:
        return self.send("WATCHDOG=1")

    def stopping(self, status: str | None = None) -> bool:
        lines = ["STOPPING=1"]
        if status:
            lines.append(f"STATUS={_one_line(status)}")
        return self.send(*lines)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> Notifier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _pid_matches(env: Mapping[str, str], var: str, pid: int | None, required: bool) -> bool:
    value = env.get(var)
    if value is None or value == "":
        return not required
    try:
        return int(value) == (pid if pid is not None else os.getpid())
    except ValueError:
        raise NotifyError(
            f"{var}={value!r}: expected a process id. Hint: this variable is set by systemd; "
            "unset it when running by hand."
        ) from None


def watchdog_interval(
    env: Mapping[str, str] = os.environ, *, pid: int | None = None
) -> float | None:
    """Seconds between WATCHDOG=1 pings (half of WATCHDOG_USEC), or None when not asked for."""
    value = env.get("WATCHDOG_USEC")
    if not value:
        return None
    if not _pid_matches(env, "WATCHDOG_PID", pid, required=False):
        return None
    try:
        usec = int(value)
    except ValueError:
        usec = -1
    if usec <= 0:
        raise NotifyError(
            f"WATCHDOG_USEC={value!r}: expected a positive number of microseconds. "
            "Hint: check WatchdogSec= in the unit, or unset WATCHDOG_USEC."
        )
    return usec / 2 / 1_000_000


def listen_fds_with_names(
    env: Mapping[str, str] = os.environ, *, pid: int | None = None
) -> list[tuple[str, socket.socket]]:
    """Sockets passed by socket activation with their FileDescriptorName= (default "unknown")."""
    count = env.get("LISTEN_FDS")
    if not count or not _pid_matches(env, "LISTEN_PID", pid, required=True):
        return []
    try:
        n = int(count)
    except ValueError:
        n = -1
    if n < 0:
        raise NotifyError(
            f"LISTEN_FDS={count!r}: expected a count of file descriptors. "
            "Hint: this variable is set by systemd socket activation; unset it by hand."
        )
    names = env.get("LISTEN_FDNAMES", "").split(":") if env.get("LISTEN_FDNAMES") else []
    out: list[tuple[str, socket.socket]] = []
    for i in range(n):
        fd = SD_LISTEN_FDS_START + i
        try:
            os.set_inheritable(fd, False)
            sock = socket.socket(fileno=fd)
        except OSError as exc:
            raise NotifyError(
                f"socket activation: LISTEN_FDS={n} but fd {fd} is not a usable socket "
                f"({exc.strerror or exc}). Hint: check the .socket unit's Listen*= lines."
            ) from exc
        out.append((names[i] if i < len(names) and names[i] else "unknown", sock))
    return out


def listen_fds(
    env: Mapping[str, str] = os.environ, *, pid: int | None = None
) -> list[socket.socket]:
    """Sockets passed by socket activation (empty when not socket-activated)."""
    return [sock for _, sock in listen_fds_with_names(env, pid=pid)]
