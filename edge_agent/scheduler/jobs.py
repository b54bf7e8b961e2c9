"""Jobs, their states, and the scheduler's configuration.

Invariants owned here:
- A job's state only moves QUEUED -> RUNNING -> (DONE | FAILED | CANCELLED | EXPIRED), or
  QUEUED -> (FAILED | CANCELLED | EXPIRED), or RUNNING -> QUEUED (requeue after a runner death).
  Terminal states are final; `Scheduler` (queue.py) is the only code that moves them.
- `priority` is an int in [MIN_PRIORITY, MAX_PRIORITY]; higher runs first.
- `attempts` counts how many times the job was started; `stalls` how many runner deaths in a
  row it lived through without producing a token (what `max_retries` bounds); `ran_s`
  accumulates the time it spent
  running in earlier, interrupted attempts. `started_at` is set only while the job is (or last
  was, if it ended while running) running: a job returned by `cancel`/`expire` with
  `started_at is not None` held a runner slot that the caller must release.
- All times are floats in seconds on one monotonic clock chosen by the caller.
- `SchedulerConfig` validates itself on construction (ConfigError naming the key).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from edge_agent.errors import ConfigError

__all__ = [
    "MIN_PRIORITY",
    "MAX_PRIORITY",
    "DEFAULT_PRIORITY",
    "JobState",
    "TERMINAL_STATES",
    "Job",
    "SchedulerConfig",
]

MIN_PRIORITY = 0
MAX_PRIORITY = 10
DEFAULT_PRIORITY = 5


class JobState(str, enum.Enum):
    """Where a job is; `.value` is the lower-case name used on the wire and in the journal."""

    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_STATES


TERMINAL_STATES: frozenset[JobState] = frozenset(
    {JobState.DONE, JobState.FAILED, JobState.CANCELLED, JobState.EXPIRED}
)


@dataclass(eq=False)
class Job:
    """One generation request as the scheduler sees it. `params` is opaque (sampling params)."""

    id: str
    model: str
    prompt_ids: Sequence[int]
    params: object = None
    priority: int = DEFAULT_PRIORITY
    submitted_at: float | None = None  # set by submit() when None; kept when resuming a job
    deadline_at: float | None = None  # absolute; submit() applies the config default/cap
    state: JobState = JobState.QUEUED
    attempts: int = 0
    error: str | None = None
    started_at: float | None = None
    finished_at: float | None = None
    queued_at: float | None = None  # when it last entered the queue (submit or requeue)
    ran_s: float = 0.0  # running time of earlier attempts cut short by a runner death
    stalls: int = 0  # runner deaths in a row during which the job produced no token
    seq: int = field(default=-1, repr=False)  # submission order, assigned by submit()

    @property
    def finished(self) -> bool:
        return self.state in TERMINAL_STATES

    def running_s(self, now: float) -> float:
        """Total time spent running, over every attempt, up to `now` (or the end)."""
        total = self.ran_s
        if self.started_at is not None:
            end = self.finished_at if self.finished_at is not None else now
            total += max(0.0, end - self.started_at)
        return total

    def queued_s(self, now: float) -> float:
        """Total time spent waiting in the queue up to `now` (or the end)."""
        if self.submitted_at is None:
            return 0.0
        end = self.finished_at if self.finished_at is not None else now
        return max(0.0, end - self.submitted_at - self.running_s(now))

    def to_dict(self) -> dict[str, object]:
        """JSON-friendly summary (no prompt, no params) for status endpoints."""
        return {
            "id": self.id,
            "model": self.model,
            "priority": self.priority,
            "state": self.state.value,
            "attempts": self.attempts,
            "submitted_at": self.submitted_at,
            "deadline_at": self.deadline_at,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "error": self.error,
        }


@dataclass(frozen=True)
class SchedulerConfig:
    """Scheduling knobs. `default_timeout_ms=None` means no deadline unless a job sets one."""

    queue_max: int = 64
    max_batch_size: int = 8
    batch_window_ms: float = 5
    default_timeout_ms: float | None = 120000
    starvation_age_s: float = 10.0
    max_retries: int = 2
    keep_finished: int = 1024  # finished jobs kept for get() before the oldest are forgotten

    def __post_init__(self) -> None:
        checks: list[tuple[str, object, bool, str]] = [
            ("queue_max", self.queue_max, _is_int(self.queue_max, 1), "an integer >= 1"),
            (
                "max_batch_size",
                self.max_batch_size,
                _is_int(self.max_batch_size, 1),
                "an integer >= 1",
            ),
            (
                "batch_window_ms",
                self.batch_window_ms,
                _is_num(self.batch_window_ms) and self.batch_window_ms >= 0,
                "a number >= 0",
            ),
            (
                "default_timeout_ms",
                self.default_timeout_ms,
                self.default_timeout_ms is None
                or (_is_num(self.default_timeout_ms) and self.default_timeout_ms > 0),
                "a number > 0 (or none for no default deadline)",
            ),
            (
                "starvation_age_s",
                self.starvation_age_s,
                _is_num(self.starvation_age_s) and self.starvation_age_s > 0,
                "a number > 0",
            ),
            ("max_retries", self.max_retries, _is_int(self.max_retries, 0), "an integer >= 0"),
            ("keep_finished", self.keep_finished, _is_int(self.keep_finished, 0),
             "an integer >= 0"),
        ]
        for key, value, ok, expected in checks:
            if not ok:
                raise ConfigError(
                    f"scheduler.{key} = {value!r}: expected {expected}. "
                    f"Hint: fix [scheduler] {key} in the configuration."
                )


def _is_int(value: object, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _is_num(value: object) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return value == value and value not in (float("inf"), float("-inf"))
