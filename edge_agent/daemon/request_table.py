"""The daemon's requests by id, and the one way a request ends (`RequestTable.finish`).

Invariants owned here:
- One request is one record here, one job in the scheduler and one row in the journal; they
  end together in `finish(rid, outcome, now)` and nowhere else, in this order: the
  scheduler (unless it ended the job itself: expiry, a failed load, retries exhausted), the
  record (its `outcome` set, waiters woken), the metrics, the journal.
- Exactly once: a request ends at its first `finish`; a later one (a late token after a
  cancel, a failure after an expiry) changes nothing and returns False.
- A `kept` outcome (daemon stopping with the journal on) answers the client only: the job,
  the metrics and the journal are left as they are, the request resumes at the next start.
- The table knows the scheduler, the metrics and the journal only through the callables and
  Protocols given to its constructor, never the Daemon.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Protocol

from edge_agent.daemon.outcome import Outcome
from edge_agent.daemon.requests import RequestRecord
from edge_agent.scheduler import Job, JobState

__all__ = ["RequestTable", "JobEnds"]

_STATES = {"done": JobState.DONE, "failed": JobState.FAILED, "expired": JobState.EXPIRED}


class JobEnds(Protocol):
    """What the table asks of the scheduler (scheduler/queue.py)."""

    def finish(self, job_id: str, now: float, state: JobState,
               error: str | None = None) -> Job | None: ...

    def cancel(self, job_id: str, now: float) -> Job | None: ...


class RequestTable:
    def __init__(self, scheduler: JobEnds, *, keep_finished: int,
                 count: Callable[[RequestRecord, str], object],
                 journal: Callable[[RequestRecord], object]) -> None:
        """`count(rec, state)`: the metrics of an ended request; `journal(rec)`: write its end
        (and save its session turn)."""
        self.scheduler = scheduler
        self.keep_finished = keep_finished
        self.records: OrderedDict[str, RequestRecord] = OrderedDict()
        self._count = count
        self._journal = journal

    # -- the mapping ---------------------------------------------------------------------------
    def get(self, rid: str) -> RequestRecord | None:
        return self.records.get(rid)

    def __contains__(self, rid: object) -> bool:
        return rid in self.records

    def __iter__(self) -> Iterator[str]:
        return iter(self.records)

    def __len__(self) -> int:
        return len(self.records)

    def add(self, rec: RequestRecord) -> None:
        """A new request (or one resumed from the journal); the oldest finished ones beyond
        `keep_finished` are forgotten."""
        self.records[rec.id] = rec
        while len(self.records) > self.keep_finished:
            rid, old = next(iter(self.records.items()))
            if not old.done.is_set():
                break
            del self.records[rid]

    # -- the one terminal transition -------------------------------------------------------------
    def finish(self, rid: str, outcome: Outcome, now: float) -> bool:
        """End request `rid` with `outcome`; False (nothing changed) when it had already ended
        or is unknown."""
        rec = self.records.get(rid)
        if rec is None or rec.outcome is not None:
            return False
        if outcome.kept:
            rec.end(outcome)
            return True
        if not rec.job.state.terminal:  # else the scheduler ended it (expiry, bulk failure)
            if outcome.state == "cancelled":
                ended = self.scheduler.cancel(rid, now)
            else:
                ended = self.scheduler.finish(rid, now, _STATES[outcome.state],
                                              outcome.message or None)
            if ended is None:
                return False
        rec.end(outcome)
        self._count(rec, outcome.state)
        self._journal(rec)
        return True
