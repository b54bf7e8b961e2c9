"""Scheduling core: jobs, one bounded priority queue, deadlines, batching decisions, model
lifecycle and memory budgets.

Pure: never imports asyncio, sockets, serial, SQLite or `time` (docs/architecture.md; checked
by tests/test_rooms.py); every time-dependent method takes `now` (seconds on the caller's
monotonic clock). Each module states the invariants it owns at its top.
"""

from __future__ import annotations

from edge_agent.scheduler.budget import (
    RUNNER_BASE_BYTES,
    LoadedModel,
    format_bytes,
    model_budget_bytes,
    plan_load,
)
from edge_agent.scheduler.errors import (
    BudgetExceeded,
    InvalidTransition,
    JobError,
    QueueFull,
    SchedulerError,
    UnknownJob,
)
from edge_agent.scheduler.jobs import (
    DEFAULT_PRIORITY,
    MAX_PRIORITY,
    MIN_PRIORITY,
    TERMINAL_STATES,
    Job,
    JobState,
    SchedulerConfig,
)
from edge_agent.scheduler.lifecycle import ALLOWED, ModelLifecycle, ModelState
from edge_agent.scheduler.queue import Scheduler

__all__ = [
    "ALLOWED",
    "DEFAULT_PRIORITY",
    "MAX_PRIORITY",
    "MIN_PRIORITY",
    "RUNNER_BASE_BYTES",
    "TERMINAL_STATES",
    "BudgetExceeded",
    "InvalidTransition",
    "Job",
    "JobError",
    "JobState",
    "LoadedModel",
    "ModelLifecycle",
    "ModelState",
    "QueueFull",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerError",
    "UnknownJob",
    "format_bytes",
    "model_budget_bytes",
    "plan_load",
]
