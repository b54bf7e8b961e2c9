"""A corrupt journal: the integrity check, and moving the file aside (quarantine).

Invariants this module owns:
- `check_integrity` reads the pages through a temporary memory map and drops it again, so a
  later I/O error comes back as an SQLite error, never as SIGBUS.
- `quarantine` moves the file with its -wal and -shm (and the -wal kept from before SQLite
  touched it, `wal_keep_path`) to `<name>.corrupt-<UTC timestamp>[-n]`, never over an earlier
  one, and fsyncs the directory before it returns; a move that fails is a JournalError naming
  both paths.
"""

from __future__ import annotations

import os
import sqlite3
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from edge_agent.journal.errors import JournalError
from edge_agent.paths import fsync_dir

__all__ = ["QuarantineEvent", "check_integrity", "integrity_pragma", "is_corruption", "quarantine",
           "wal_keep_path"]

_CORRUPT_CODES = (11, 26)  # SQLITE_CORRUPT, SQLITE_NOTADB (primary result codes)
CHECK_MMAP_BYTES = 1 << 30  # memory map used while checking (address space, not memory)


@dataclass(frozen=True)
class QuarantineEvent:
    """A corrupt journal was moved aside and a new one started."""

    path: str
    moved_to: str
    reason: str
    at: float  # wall clock (unix seconds)

    def message(self) -> str:
        stamp = time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(self.at))
        return (
            f"journal {self.path} was corrupt ({self.reason}); moved aside to {self.moved_to} at "
            f"{stamp} and a new journal was started: requests, sessions and caches recorded "
            "before are not resumed. Hint: keep the moved file for inspection "
            "(`sqlite3 FILE .recover`), and check the storage (dmesg, power supply)."
        )

    def to_dict(self) -> dict[str, Any]:
        return dict(asdict(self), message=self.message())


def is_corruption(exc: sqlite3.DatabaseError) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return (code & 0xFF) in _CORRUPT_CODES
    return type(exc) is sqlite3.DatabaseError  # Python 3.10: no error code; CORRUPT/NOTADB


def wal_keep_path(path: Path) -> Path:
    return path.with_name(path.name + "-wal.found")


def integrity_pragma(full: bool) -> str:
    """The PRAGMA `check_integrity` runs: integrity_check when full, else quick_check."""
    return "integrity_check" if full else "quick_check"


def check_integrity(conn: sqlite3.Connection, *, full: bool = False) -> list[str]:
    """Problems found by `quick_check` (or `integrity_check` when full); [] when the file is ok.

    The check reads the pages through a memory map (about twice as fast as read() calls on a
    file in the page cache); the map is dropped again afterwards, so later I/O errors come back
    as SQLite errors, never as SIGBUS. Raises sqlite3.DatabaseError when the file is too
    damaged to check at all.
    """
    pragma = integrity_pragma(full)
    conn.execute(f"PRAGMA mmap_size={CHECK_MMAP_BYTES}").fetchall()
    try:
        rows = [str(r[0]) for r in conn.execute(f"PRAGMA {pragma}(20)").fetchall()]
    finally:
        conn.execute("PRAGMA mmap_size=0").fetchall()
    return [] if rows == ["ok"] else rows


def quarantine(path: Path, reason: str, *, now: float) -> QuarantineEvent:
    """Move `path` (and its -wal, -shm) aside with a UTC timestamp; fsync the directory."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
    target = path.with_name(f"{path.name}.corrupt-{stamp}")
    n = 1
    while target.exists():
        target = path.with_name(f"{path.name}.corrupt-{stamp}-{n}")
        n += 1
    try:
        for suffix in ("-wal", "-shm"):
            side = path.with_name(path.name + suffix)
            if side.exists():
                os.replace(side, target.with_name(target.name + suffix))
        kept = wal_keep_path(path)  # the -wal as it was before SQLite touched it (see open_journal)
        if kept.exists():
            os.replace(kept, target.with_name(target.name + "-wal"))
        os.replace(path, target)
        fsync_dir(path.parent)
    except OSError as exc:
        raise JournalError(
            f"journal {path} is corrupt ({reason}) and could not be moved aside to {target}: "
            f"{exc.strerror or exc}. Hint: move or delete the file by hand, then restart."
        ) from exc
    return QuarantineEvent(str(path), str(target), reason, now)
