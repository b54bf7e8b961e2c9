"""Retention and size of the journal: pruning finished requests, checkpoints, VACUUM.

Invariants this module owns:
- Pruning only deletes finished requests (their tokens go with them, foreign key cascade),
  sessions idle longer than asked, and old events; queued and running requests are never
  touched.
- `prune(limit=N)` bounds one call to N rows of each kind (and 8 x N freed pages returned to
  the OS), so a caller on the decode loop's thread can prune in short transactions and let
  decode steps run between them; repeated calls until `total == 0` end where one unbounded
  call ends.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from edge_agent.journal.errors import JournalError
from edge_agent.journal.migrations import FINISHED_STATES

if TYPE_CHECKING:
    import sqlite3

    from edge_agent.journal.db import Journal

__all__ = ["PruneResult", "Retention"]

_FIN_SQL = ", ".join(f"'{s}'" for s in FINISHED_STATES)


@dataclass(frozen=True)
class PruneResult:
    requests: int
    sessions: int
    events: int
    pages_freed: int

    @property
    def total(self) -> int:
        """Rows deleted (0: nothing left to prune)."""
        return self.requests + self.sessions + self.events


class Retention:
    """Mixin of JournalStore: needs `journal`, `conn` and `_clock`."""

    journal: Journal
    conn: sqlite3.Connection
    _clock: Any

    def prune(self, *, max_age_s: float | None = None, max_finished: int | None = None,
              session_max_age_s: float | None = None, max_events: int = 1000,
              now: float | None = None, limit: int | None = None) -> PruneResult:
        """Delete finished requests (and their tokens) older than max_age_s or beyond the
        newest max_finished, idle sessions, old events; give freed pages back to the OS.

        limit: delete at most this many rows of each kind (and free at most 8 x limit pages)
        in this call, so one transaction stays short; call again until `PruneResult.total` is 0
        (the daemon does this after READY, between decode steps)."""
        if limit is not None and (type(limit) is not int or limit < 1):
            raise JournalError(f"prune: limit {limit!r} is not a positive whole number of "
                               "rows. Hint: pass e.g. limit=200, or None for one unbounded "
                               "pass.")
        now = self._clock() if now is None else now
        cap = "" if limit is None else f" LIMIT {limit}"
        n_req = n_ses = 0
        with self.journal.transaction() as conn:
            if max_age_s is not None:
                n_req += conn.execute(
                    f"DELETE FROM requests WHERE id IN (SELECT id FROM requests WHERE state IN "
                    f"({_FIN_SQL}) AND finished_at < ?{cap})", (now - max_age_s,)).rowcount
            if max_finished is not None:
                window = "LIMIT -1" if limit is None else f"LIMIT {limit}"
                n_req += conn.execute(
                    f"DELETE FROM requests WHERE id IN (SELECT id FROM requests WHERE state IN "
                    f"({_FIN_SQL}) ORDER BY finished_at DESC {window} OFFSET ?)",
                    (int(max_finished),)).rowcount
            if session_max_age_s is not None:
                n_ses = conn.execute(
                    f"DELETE FROM sessions WHERE id IN (SELECT id FROM sessions WHERE "
                    f"updated_at < ?{cap})", (now - session_max_age_s,)).rowcount
                if n_ses:  # a forgotten session's KV snapshot goes with it
                    conn.execute("DELETE FROM kv_snapshots WHERE session NOT IN "
                                 "(SELECT id FROM sessions)")
            n_ev = conn.execute(
                f"DELETE FROM events WHERE id IN (SELECT id FROM events ORDER BY id DESC "
                f"LIMIT {-1 if limit is None else limit} OFFSET ?)",
                (int(max_events),)).rowcount
        free = int(self.journal.pragma("freelist_count"))
        if free:
            pages = "" if limit is None else f"({8 * limit})"
            self.conn.execute(f"PRAGMA incremental_vacuum{pages}").fetchall()
        return PruneResult(n_req, n_ses, n_ev, free)

    def checkpoint(self) -> tuple[int, int, int]:
        """Copy the WAL into the main file and truncate it: (busy, wal pages, checkpointed)."""
        row = self.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        return int(row[0]), int(row[1]), int(row[2])

    def vacuum(self) -> tuple[int, int]:
        """Rebuild the file compactly; returns (bytes before, bytes after) of file + WAL."""
        before = self.file_bytes()
        self.checkpoint()
        self.conn.execute("VACUUM")
        self.checkpoint()
        return before, self.file_bytes()

    def file_bytes(self) -> int:
        total = 0
        for suffix in ("", "-wal"):
            try:
                total += os.path.getsize(str(self.journal.path) + suffix)
            except OSError:
                pass
        return total

