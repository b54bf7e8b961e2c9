"""Errors raised by the scheduling core; all subclass edge_agent.errors.EdgeAgentError.

Invariants owned here:
- Every error carries the numbers that explain it as attributes (so the daemon can map them to
  HTTP statuses and headers without parsing text) and a message ending with `Hint: ...`.
- `QueueFull.retry_after_s` is always >= 1.0 (a Retry-After of 0 invites a busy loop).
"""

from __future__ import annotations

from edge_agent.errors import EdgeAgentError

__all__ = [
    "SchedulerError",
    "QueueFull",
    "JobError",
    "UnknownJob",
    "InvalidTransition",
    "BudgetExceeded",
]


class SchedulerError(EdgeAgentError):
    """Root of the scheduling core's errors."""


class QueueFull(SchedulerError):
    """The one bounded queue (queued + running, all models) is at `queue_max`: reject now."""

    def __init__(self, message: str, *, depth: int, limit: int, retry_after_s: float) -> None:
        super().__init__(message)
        self.depth = depth
        self.limit = limit
        self.retry_after_s = max(1.0, retry_after_s)


class JobError(SchedulerError, ValueError):
    """A job that cannot be accepted or an operation that does not apply to its state."""


class UnknownJob(SchedulerError, LookupError):
    """No job with that id is known (never submitted, or forgotten after it finished)."""


class InvalidTransition(SchedulerError, ValueError):
    """A model lifecycle transition that the state machine does not allow."""

    def __init__(self, message: str, *, model: str, from_state: str, to_state: str) -> None:
        super().__init__(message)
        self.model = model
        self.from_state = from_state
        self.to_state = to_state


class BudgetExceeded(SchedulerError):
    """A model load that does not fit the memory limit even after evicting every idle model."""

    def __init__(
        self,
        message: str,
        *,
        model: str,
        need_bytes: int,
        limit_bytes: int,
        used_bytes: int,
        evictable_bytes: int,
    ) -> None:
        super().__init__(message)
        self.model = model
        self.need_bytes = need_bytes
        self.limit_bytes = limit_bytes
        self.used_bytes = used_bytes
        self.evictable_bytes = evictable_bytes
