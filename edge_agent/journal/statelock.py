"""One daemon per state directory: an exclusive `flock` on `STATE_DIR/edge-agent.lock`.

Invariants this module owns:
- `StateDirLock.acquire()` takes the lock without waiting; the daemon takes it before anything
  else touches the state directory, the socket or the journal (recovery would otherwise
  resume, and run a second time, the requests the first daemon is running). A second daemon
  gets `StateDirBusyError` (exit status 75, EX_TEMPFAIL) naming the holder's pid and the
  directory; the holder is left alone.
- The lock belongs to the open file description: the kernel drops it when the holder exits,
  however it exits (SIGKILL, power cut), so a stale lock file never blocks a start; the file
  itself is never removed (removing it would let two daemons lock two different files). The
  descriptor is close-on-exec: runners do not inherit (and cannot keep) the lock.
- The file holds the holder's pid (for the message); it is only informative.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from edge_agent.journal.errors import EXIT_TEMPFAIL, JournalError, StateDirBusyError

__all__ = ["LOCK_FILE", "StateDirLock"]

LOCK_FILE = "edge-agent.lock"


class StateDirLock:
    def __init__(self, state_dir: Path) -> None:
        self.state_dir = Path(state_dir)
        self.path = self.state_dir / LOCK_FILE
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock (no wait) and write our pid; StateDirBusyError when another process
        holds it, JournalError when the lock file cannot be opened."""
        if self._fd is not None:
            return
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise JournalError(
                f"state directory {self.state_dir}: cannot open the lock file {self.path} "
                f"({exc.strerror or exc}). Hint: the daemon's user must be able to write the "
                "state directory (--state-dir or server.state_dir).") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_pid(fd)
            os.close(fd)
            who = f"pid {holder}" if holder else "a process whose pid is not recorded"
            raise StateDirBusyError(
                f"state directory {self.state_dir} is in use by another edge-agent daemon "
                f"({who}, holding {self.path}); this one exits with status {EXIT_TEMPFAIL} "
                "without touching it: two daemons would both recover the journal and run the "
                "same requests. Hint: stop the other daemon (`systemctl stop edge-agent`"
                + (f" or `kill {holder}`" if holder else "")
                + "), or give this one its own --state-dir and --socket.") from None
        except OSError as exc:
            os.close(fd)
            raise JournalError(
                f"state directory {self.state_dir}: flock on {self.path} failed "
                f"({exc.strerror or exc}). Hint: keep the state directory on a local file "
                "system that supports flock (not NFS without lock support).") from exc
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # drops the flock
            self._fd = None


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 64, 0).decode("ascii", "replace").strip()
        return int(text) if text.isdigit() else None
    except OSError:
        return None
