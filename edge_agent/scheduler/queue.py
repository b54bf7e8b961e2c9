"""The one bounded priority queue across every stage, deadlines and batching decisions.

Pure: no clock, no I/O. Every method that depends on time takes `now` (seconds, one monotonic
clock chosen by the caller). The daemon calls `take` when a runner has free slots, `expire` and
`take` again at `next_wakeup(now)`, and `finish`/`requeue` when runners report.

Invariants owned here:
- Bound: the number of unfinished jobs (QUEUED + RUNNING, every model, whatever stage they wait
  in: model load or batch slot) never exceeds `queue_max`; `submit` raises QueueFull otherwise.
  `requeue` never breaks the bound (a requeued job was already counted).
- Order (per model): `take` starts starved jobs first (queued for >= starvation_age_s since
  submission), oldest first; then the rest by priority (higher first), FIFO within a level
  (submission time, then submission order). So no job waits behind fresher jobs for longer than
  `starvation_age_s`, whatever their priority.
- Batching: per model, RUNNING jobs never exceed `max_batch_size`, and `take` never returns more
  than `free_slots`. When nothing of that model is running and fewer jobs are queued than the
  batch could hold, `take` waits until `batch_window_ms` have passed since the newest queued
  job arrived (company that keeps arriving is gathered: a burst of clients starts as one
  batch, with one shared prefill), but never longer than WINDOW_CAP windows after the oldest;
  it never waits when a batch is already running (new jobs join at the next step).
- Deadlines: `submit` sets `deadline_at` to `now + default_timeout_ms` when the job has none, and
  caps a later one to it (a request may lower its timeout, not raise it). `expire(now)` moves
  every QUEUED or RUNNING job with `deadline_at <= now` to EXPIRED with a message naming how long
  it queued and ran.
- Terminal states are final: finishing, cancelling or expiring an already finished job changes
  nothing. Finished jobs stay readable through `get` until `keep_finished` newer ones finished.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Collection, Iterable

from edge_agent.scheduler.errors import JobError, QueueFull, UnknownJob
from edge_agent.scheduler.jobs import (
    MAX_PRIORITY,
    MIN_PRIORITY,
    TERMINAL_STATES,
    Job,
    JobState,
    SchedulerConfig,
)

# A lone job's wait for company is extended by each arrival, up to this many batch windows.
WINDOW_CAP = 4

__all__ = ["Scheduler"]

_RATE_WINDOW = 32  # finish times kept to estimate Retry-After
_MAX_RETRY_AFTER_S = 60.0


class Scheduler:
    """Bounded priority queue of jobs for every model, with deadlines and batching decisions."""

    def __init__(self, config: SchedulerConfig | None = None) -> None:
        self.config = config if config is not None else SchedulerConfig()
        self._live: dict[str, Job] = {}  # QUEUED or RUNNING, every model
        self._queued: dict[str, dict[str, Job]] = {}  # model -> id -> job
        self._running: dict[str, dict[str, Job]] = {}  # model -> id -> job
        self._finished: OrderedDict[str, Job] = OrderedDict()
        self._totals: dict[JobState, int] = {s: 0 for s in TERMINAL_STATES}
        self._finish_times: deque[float] = deque(maxlen=_RATE_WINDOW)
        self._seq = 0

    # -- admission ------------------------------------------------------------------------

    def submit(self, job: Job, now: float) -> Job:
        """Accept `job` as QUEUED, or raise QueueFull (503 + Retry-After) / JobError (400)."""
        self.check(job)
        if job.submitted_at is None:
            job.submitted_at = now
        timeout_ms = self.config.default_timeout_ms
        if timeout_ms is not None:
            cap = job.submitted_at + timeout_ms / 1000.0
            job.deadline_at = cap if job.deadline_at is None else min(job.deadline_at, cap)
        job.queued_at = now
        job.seq = self._seq
        self._seq += 1
        self._live[job.id] = job
        self._queued.setdefault(job.model, {})[job.id] = job
        return job

    def check(self, job: Job, pending: int = 0) -> None:
        """What `submit(job)` would raise, without queueing it; `pending`: jobs checked
        already and not yet submitted (they take queue room too)."""
        if job.id in self._live or job.id in self._finished:
            raise JobError(
                f"submit job {job.id!r}: a job with this id is already known "
                f"({self._state_of(job.id)}). Hint: use a fresh request id."
            )
        if job.state is not JobState.QUEUED or job.finished_at is not None:
            raise JobError(
                f"submit job {job.id!r}: it is {job.state.value}, expected a new queued job. "
                "Hint: build a new Job for each submission."
            )
        prio = job.priority
        if isinstance(prio, bool) or not isinstance(prio, int) or not (
            MIN_PRIORITY <= prio <= MAX_PRIORITY
        ):
            raise JobError(
                f"submit job {job.id!r}: priority {prio!r} is out of range. "
                f"Hint: use an integer from {MIN_PRIORITY} to {MAX_PRIORITY} (higher runs first)."
            )
        if not job.model:
            raise JobError(
                f"submit job {job.id!r}: no model named. Hint: set the request's model."
            )
        depth = len(self._live) + pending
        if depth >= self.config.queue_max:
            retry = self._retry_after_s()
            raise QueueFull(
                f"submit job {job.id!r} for model {job.model!r}: queue full ({depth} of "
                f"queue_max={self.config.queue_max} requests queued or running, all models). "
                f"Hint: retry after {retry:.0f} s, or raise scheduler.queue_max.",
                depth=depth,
                limit=self.config.queue_max,
                retry_after_s=retry,
            )

    # -- starting work --------------------------------------------------------------------

    def take(self, model: str, free_slots: int, now: float) -> list[Job]:
        """Queued jobs of `model` to start now (-> RUNNING), best first; maybe none yet."""
        queued = self._queued.get(model)
        if not queued or free_slots <= 0:
            return []
        running = len(self._running.get(model, ()))
        room = min(free_slots, self.config.max_batch_size - running)
        if room <= 0:
            return []
        if running == 0 and len(queued) < room and now < self._window_end(queued):
            return []  # a lone job waits briefly for company
        live = (j for j in queued.values() if j.deadline_at is None or j.deadline_at > now)
        chosen = self._ordered(live, now)[:room]  # past-deadline jobs are left for expire()
        run = self._running.setdefault(model, {})
        for job in chosen:
            del queued[job.id]
            job.state = JobState.RUNNING
            job.started_at = now
            job.attempts += 1
            run[job.id] = job
        if not queued:
            del self._queued[model]
        return chosen

    def peek(self, model: str, now: float) -> list[Job]:
        """Queued jobs of `model` in the order `take` would start them (no state change)."""
        return self._ordered(self._queued.get(model, {}).values(), now)

    def pending_models(self, now: float) -> list[str]:
        """Models with queued jobs, the one whose best job comes first in `take` order first.

        For the daemon to decide which model to load (or keep) when memory is short.
        """
        heads = [(self._sort_key(self.peek(m, now)[0], now), m) for m in self._queued]
        return [m for _, m in sorted(heads)]

    def next_wakeup(self, now: float) -> float | None:
        """Earliest time something changes without an external event: a deadline (may be
        <= now: call `expire` at once) or the end of a batch window. None when nothing waits."""
        times = [j.deadline_at for j in self._live.values() if j.deadline_at is not None]
        for model, queued in self._queued.items():
            if not self._running.get(model):
                end = self._window_end(queued)
                if end > now:
                    times.append(end)
        return min(times) if times else None

    # -- ending work ----------------------------------------------------------------------

    def finish(
        self, job_id: str, now: float, state: JobState, error: str | None = None
    ) -> Job | None:
        """End a job in terminal `state`. Returns the job, or None if it had already ended
        (first end wins: a late "done" after a cancel or expiry changes nothing)."""
        if state not in TERMINAL_STATES:
            raise JobError(
                f"finish job {job_id!r}: {state.value!r} is not a final state. "
                f"Hint: use one of {sorted(s.value for s in TERMINAL_STATES)}."
            )
        job = self._require(job_id)
        if job.finished:
            return None
        if state is JobState.DONE and job.state is not JobState.RUNNING:
            raise JobError(
                f"finish job {job_id!r} as done: it is {job.state.value}, it never ran. "
                "Hint: only a running job can be done; fail or cancel a queued one."
            )
        self._end(job, now, state, error)
        return job

    def cancel(self, job_id: str, now: float) -> Job | None:
        """Cancel a queued or running job. Returns it (CANCELLED; `started_at is not None` means
        the caller must release its runner slot), or None if unknown or already ended."""
        job = self._live.get(job_id)
        if job is None:
            return None
        self._end(job, now, JobState.CANCELLED, "cancelled by the client")
        return job

    def expire(self, now: float) -> list[Job]:
        """Every queued or running job past its deadline -> EXPIRED (earliest deadline first)."""
        due = [j for j in self._live.values() if j.deadline_at is not None and j.deadline_at <= now]
        due.sort(key=lambda j: (j.deadline_at, j.seq))
        for job in due:
            queued_s, ran_s = job.queued_s(now), job.running_s(now)
            assert job.submitted_at is not None and job.deadline_at is not None
            timeout_s = job.deadline_at - job.submitted_at
            where = "while running" if job.state is JobState.RUNNING else "while queued"
            self._end(
                job,
                now,
                JobState.EXPIRED,
                f"deadline of {timeout_s:.3f} s passed {where}: queued {queued_s:.3f} s and ran "
                f"{ran_s:.3f} s (model {job.model!r}, {job.attempts} attempt(s)). "
                "Hint: raise timeout_ms, lower max_tokens, or retry when the daemon is less busy.",
            )
        return due

    def requeue(
        self, job_ids: Iterable[str], now: float, reason: str = "runner exited",
        progressed: Collection[str] = (),
    ) -> list[Job]:
        """Put running jobs back in the queue after their runner died, keeping their place.
        A job in `progressed` produced a token in the attempt that ended: its stall count
        starts again, so a runner killed any number of times costs no request that makes
        progress. A job whose runner died `max_retries + 1` times in a row without it producing
        a token (a request that kills its runner, e.g. in prefill) -> FAILED instead. Returns
        every job it changed (check `.state`); ids unknown or not running are skipped."""
        changed: list[Job] = []
        for job_id in job_ids:
            job = self._live.get(job_id)
            if job is None or job.state is not JobState.RUNNING:
                continue
            job.stalls = 0 if job_id in progressed else job.stalls + 1
            if job.stalls > self.config.max_retries:
                self._end(
                    job,
                    now,
                    JobState.FAILED,
                    f"model {job.model!r}: {reason} while running this request, "
                    f"{job.stalls} time(s) in a row without it producing a token; giving up "
                    f"after max_retries={self.config.max_retries}. Hint: check the runner's "
                    "log and memory limit (memory.events), then resubmit (a shorter prompt "
                    "or a lower max_batch needs less memory).",
                )
            else:
                assert job.started_at is not None
                job.ran_s += max(0.0, now - job.started_at)
                job.started_at = None
                job.state = JobState.QUEUED
                job.queued_at = now
                del self._running[job.model][job.id]
                if not self._running[job.model]:
                    del self._running[job.model]
                self._queued.setdefault(job.model, {})[job.id] = job
            changed.append(job)
        return changed

    def fail_queued(self, model: str, now: float, error: str) -> list[Job]:
        """Fail every queued job of `model` (its load failed or it is refused)."""
        jobs = self.peek(model, now)
        for job in jobs:
            self._end(job, now, JobState.FAILED, error)
        return jobs

    # -- reading --------------------------------------------------------------------------

    def get(self, job_id: str) -> Job | None:
        """The job with this id (live or recently finished), or None."""
        return self._live.get(job_id) or self._finished.get(job_id)

    def running(self, model: str) -> list[Job]:
        """Running jobs of `model`, in the order they were submitted."""
        return sorted(self._running.get(model, {}).values(), key=lambda j: j.seq)

    def running_ids(self, model: str) -> list[str]:
        """Ids of the running jobs of `model`, in the order `take` started them (a model
        loop's batch order; a requeued job starts again at the end)."""
        return list(self._running.get(model, ()))

    def queued(self, model: str) -> int:
        return len(self._queued.get(model, ()))

    @property
    def depth(self) -> int:
        """Unfinished jobs (queued + running, all models): the quantity `queue_max` bounds."""
        return len(self._live)

    def counts(self) -> dict[str, int]:
        """Current queued/running counts and, for final states, totals since start."""
        out = {s.value: n for s, n in self._totals.items()}
        out[JobState.QUEUED.value] = sum(len(q) for q in self._queued.values())
        out[JobState.RUNNING.value] = sum(len(r) for r in self._running.values())
        return out

    # -- internals ------------------------------------------------------------------------

    def _sort_key(self, job: Job, now: float) -> tuple[int, float, int]:
        submitted = job.submitted_at if job.submitted_at is not None else now
        if now - submitted >= self.config.starvation_age_s:
            return (-(MAX_PRIORITY + 1), submitted, job.seq)  # starved: ahead of every level
        return (-job.priority, submitted, job.seq)

    def _ordered(self, jobs: Iterable[Job], now: float) -> list[Job]:
        return sorted(jobs, key=lambda j: self._sort_key(j, now))

    def _window_end(self, queued: dict[str, Job]) -> float:
        times = [j.queued_at for j in queued.values() if j.queued_at is not None]
        window = self.config.batch_window_ms / 1000.0
        return min(max(times) + window, min(times) + WINDOW_CAP * window)

    def _end(self, job: Job, now: float, state: JobState, error: str | None) -> None:
        where = self._running if job.state is JobState.RUNNING else self._queued
        bucket = where[job.model]
        del bucket[job.id]
        if not bucket:
            del where[job.model]
        del self._live[job.id]
        job.state = state
        job.finished_at = now
        job.error = error
        self._totals[state] += 1
        self._finish_times.append(now)
        if self.config.keep_finished > 0:
            self._finished[job.id] = job
            while len(self._finished) > self.config.keep_finished:
                self._finished.popitem(last=False)

    def _retry_after_s(self) -> float:
        """Whole seconds (rounded up) until one slot is likely free, from the recent rate of
        finishing jobs: the Retry-After header and the message say the same number."""
        times = self._finish_times
        if len(times) < 2 or times[-1] <= times[0]:
            return 1.0
        per_job = (times[-1] - times[0]) / (len(times) - 1)
        return float(math.ceil(min(_MAX_RETRY_AFTER_S, max(1.0, per_job)) - 1e-9))

    def _require(self, job_id: str) -> Job:
        job = self.get(job_id)
        if job is None:
            raise UnknownJob(
                f"job {job_id!r}: no such job (never submitted, or finished long ago). "
                "Hint: check the request id."
            )
        return job

    def _state_of(self, job_id: str) -> str:
        job = self.get(job_id)
        return job.state.value if job is not None else "unknown"
