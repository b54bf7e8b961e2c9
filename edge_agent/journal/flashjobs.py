"""Flash jobs in the journal: image, board, port and the state of every sector.

Invariants this module owns:
- A sector's state only moves forward: pending -> erased -> written -> verified (a step may be
  skipped, e.g. a sector already equal is marked verified at once); moving back is
  JournalConflictError. Each call is one transaction.
- A job is "running" until `finish()`; `resumable(image_sha256, board, port)` returns the newest
  running job of that image on that board and port, so an interrupted flash resumes from it.
(firmware_tools/flasher.py keeps a JSON progress file today; this is the table it moves to.)
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from edge_agent.journal.db import Journal
from edge_agent.journal.errors import JournalConflictError, JournalError
from edge_agent.journal.migrations import SECTOR_STATES

__all__ = ["FlashJobs", "FlashJob", "FlashSector"]

_RANK = {s: i for i, s in enumerate(SECTOR_STATES)}


@dataclass(frozen=True)
class FlashSector:
    sector: int
    address: int
    size: int
    state: str


@dataclass(frozen=True)
class FlashJob:
    id: int
    image_sha256: str
    board: str
    port: str
    state: str
    created_at: float
    updated_at: float
    error: str | None
    sectors: list[FlashSector] = field(default_factory=list)

    def count(self, state: str) -> int:
        return sum(1 for s in self.sectors if s.state == state)


class FlashJobs:
    def __init__(self, journal: Journal, *, clock: Any = time.time) -> None:
        self.journal = journal
        self._clock = clock

    def create(self, image_sha256: str, board: str, port: str,
               sectors: Iterable[tuple[int, int, int]]) -> int:
        """A new running job over sectors (index, address, size), all pending; its id."""
        now = self._clock()
        with self.journal.transaction() as conn:
            cur = conn.execute(
                "INSERT INTO flash_jobs (image_sha256, board, port, state, created_at, "
                "updated_at) VALUES (?, ?, ?, 'running', ?, ?)",
                (image_sha256, board, port, now, now))
            job_id = int(cur.lastrowid or 0)
            conn.executemany(
                "INSERT INTO flash_sectors (job_id, sector, address, size, state, updated_at) "
                "VALUES (?, ?, ?, ?, 'pending', ?)",
                [(job_id, int(i), int(a), int(s), now) for i, a, s in sectors])
        return job_id

    def mark(self, job_id: int, sectors: Iterable[int], state: str) -> None:
        if state not in _RANK:
            raise JournalError(f"flash job {job_id}: sector state {state!r} is not one of "
                               f"{', '.join(SECTOR_STATES)}. Hint: pass one of those.")
        now = self._clock()
        with self.journal.transaction() as conn:
            for sector in sectors:
                row = conn.execute("SELECT state FROM flash_sectors WHERE job_id = ? AND "
                                   "sector = ?", (job_id, sector)).fetchone()
                if row is None:
                    raise JournalConflictError(
                        f"flash job {job_id}: sector {sector} is not part of the job. "
                        "Hint: mark only the sectors the job was created with.")
                if _RANK[row[0]] > _RANK[state]:
                    raise JournalConflictError(
                        f"flash job {job_id}: sector {sector} is {row[0]}, cannot go back to "
                        f"{state}. Hint: start a new job to flash it again.")
                conn.execute("UPDATE flash_sectors SET state = ?, updated_at = ? WHERE "
                             "job_id = ? AND sector = ?", (state, now, job_id, sector))
            conn.execute("UPDATE flash_jobs SET updated_at = ? WHERE id = ?", (now, job_id))

    def finish(self, job_id: int, state: str, error: str | None = None) -> None:
        if state not in ("done", "failed"):
            raise JournalError(f"flash job {job_id}: final state {state!r} is not done or "
                               "failed. Hint: pass one of those.")
        with self.journal.transaction() as conn:
            cur = conn.execute("UPDATE flash_jobs SET state = ?, error = ?, updated_at = ? "
                               "WHERE id = ? AND state = 'running'",
                               (state, error, self._clock(), job_id))
            if cur.rowcount != 1:
                raise JournalConflictError(f"flash job {job_id}: not running. Hint: finish "
                                           "a job once.")

    def get(self, job_id: int) -> FlashJob | None:
        conn = self.journal.conn
        row: tuple[int, str, str, str, str, float, float, str | None] | None = conn.execute(
            "SELECT id, image_sha256, board, port, state, created_at, updated_at, error FROM "
            "flash_jobs WHERE id = ?", (job_id,)).fetchone()
        if row is None:
            return None
        sectors = [FlashSector(*r) for r in conn.execute(
            "SELECT sector, address, size, state FROM flash_sectors WHERE job_id = ? ORDER BY "
            "sector", (job_id,))]
        return FlashJob(*row, sectors=sectors)

    def resumable(self, image_sha256: str, board: str, port: str) -> FlashJob | None:
        row = self.journal.conn.execute(
            "SELECT id FROM flash_jobs WHERE image_sha256 = ? AND board = ? AND port = ? AND "
            "state = 'running' ORDER BY id DESC LIMIT 1", (image_sha256, board, port)).fetchone()
        return None if row is None else self.get(int(row[0]))
