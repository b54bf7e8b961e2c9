"""The daemon's memory guard: cgroup v2 groups for runners, OOM attribution from memory.events,
and the staged response to memory pressure (PSI), wired into the event loop.

Invariants owned here:
- `start()` runs once, before any runner exists: detect, then set up the layout (the daemon moves
  itself into supervisor/). Without a usable subtree nothing is written; budgets are enforced by
  accounting alone and /health says what is missing and how to fix it. Only `start()` raises
  (ConfigError: a bad $MEMORY_PRESSURE_WRITE); later cgroup failures become warnings in /health
  and the log, and the only exception is `check_admission`'s AdmissionRefused (a domain error
  with `retry_after_s`; the HTTP and UART edges map it to 503 / `memory_pressure`).
- The guard sees the daemon through what its constructor is given (the composition root,
  daemon/app.py, wires them): the cgroup configuration, the environment, the model services as
  `GuardedModel`s, the queue depth per model, `shed` (fail one running request), `stopping`
  and `record_event` (the journal's event log); cgroup files are accessed through `io_factory`.
- models/<name>/ is created with the policy's limits (from the model's computed budget) and its
  memory.events watched before the runner is spawned; the runner is attached right after the
  spawn (`runner_hook`). After the runner is reaped (death, unload, failed load) memory.events is
  polled first, so an oom_kill / oom_group_kill is attributed to that model, then the group is
  removed. `close()` tears the rest down at exit.
- An OOM kill is counted (/metrics), journaled when the journal is there, logged, and kept per
  model (/health `models.NAME.memory`); the runner's requests are requeued by the service.
- Other memory.events increases (high, max, oom) are always counted, but logged at most once
  per `EVENT_LOG_INTERVAL_S` per group and key (by `clock`), with the delta summed since the
  last line; what is still pending is logged when the runner exits and at `close()`.
- Every pressure-stage change is logged, counted, journaled and applied at once: stage >= 1
  limits new batches (`batch_limit`), >= 2 refuses new requests (503 + Retry-After,
  `check_admission`) and unloads idle models, 3 fails the lowest-priority running requests with
  the reason (again at most every `escalate_interval_s` while pressure lasts). Releases come from
  a timer at `Stages.next_wakeup`.
- Pressure comes from `PressureSources` (pressure_sources.py: $MEMORY_PRESSURE_WATCH, else a
  trigger on the service's memory.pressure, else triggers on supervisor/ and models/, which this
  process created and owns; polling avg10 only when nothing can be armed). Any source firing is
  one pressure event; /health `pressure.sources` and /metrics say which files and how.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from edge_agent.cgroup import (
    CgroupError,
    CgroupIO,
    CgroupManager,
    CgroupRoot,
    EventsWatcher,
    MemoryEvent,
    ModelGroup,
    Stages,
    Status,
    Transition,
    load_policy,
)
from edge_agent.cgroup.fs import MODELS, SUPERVISOR
from edge_agent.cgroup.stages import STAGE_NAMES
from edge_agent.daemon.pressure_sources import PressureSources
from edge_agent.errors import AdmissionRefused, EdgeAgentError
from edge_agent.scheduler import ModelLifecycle, ModelState

if TYPE_CHECKING:
    from edge_agent.config import CgroupConfig
    from edge_agent.daemon.requests import RequestRecord

__all__ = ["MemoryGuard", "GuardedModel"]

log = logging.getLogger(__name__)

EVENTS_POLL_S = 1.0  # memory.events poll period when inotify is unavailable
EVENT_LOG_INTERVAL_S = 30.0  # at most one log line per group and key (high/max/oom) this often
LOGGED_KEYS = ("high", "max", "oom")


class GuardedModel(Protocol):
    """What the guard reads and asks of one model service (daemon/service.py)."""

    @property
    def name(self) -> str: ...

    @property
    def max_batch(self) -> int: ...

    @property
    def lifecycle(self) -> ModelLifecycle: ...

    @property
    def active(self) -> Mapping[str, RequestRecord]: ...  # running requests by id

    def poke(self) -> None: ...  # wake the model loop: limits changed, a request ended

    def request_unload(self) -> None: ...  # the model loop unloads the model once it is idle


class MemoryGuard:
    def __init__(self, cfg: CgroupConfig, *, env: Mapping[str, str],
                 models: Callable[[], Mapping[str, GuardedModel]],
                 queued: Callable[[str], int],
                 shed: Callable[[RequestRecord, float, str], object],
                 stopping: Callable[[], bool],
                 record_event: Callable[[str, str], None],
                 io_factory: Callable[[], CgroupIO] = CgroupIO) -> None:
        """`models()`: the model services by name; `queued(name)`: requests waiting for one;
        `shed(rec, now, message)`: fail a running request for memory pressure;
        `record_event(kind, message)`: the journal's event log (may raise, is suppressed)."""
        self.cfg = cfg
        self.env = env
        self.models = models
        self.queued = queued
        self.shed_request = shed
        self.stopping = stopping
        self.record_event = record_event
        self.io_factory = io_factory
        self.policy = load_policy(self.cfg.policy)  # ConfigError (exit 78) naming file and key
        self.stages = Stages(self.policy.pressure.stages)
        self.mgr: CgroupManager | None = None
        self.status = Status(False, "not started", "", policy=self.policy.name)
        self.events: EventsWatcher | None = None
        self.pressure_file: Path | None = None  # the service's memory.pressure (detection)
        self.psi = PressureSources(self.policy.pressure.trigger, on_hit=self._pressure_hit,
                                   stopping=stopping)
        self.oom_kills: dict[str, int] = defaultdict(int)
        self.memory_events: dict[tuple[str, str], int] = defaultdict(int)
        self.transitions: dict[tuple[int, int], int] = defaultdict(int)
        self.shed: dict[str, int] = defaultdict(int)
        self.last_oom: dict[str, dict[str, Any]] = {}
        self._oom_pending: dict[str, MemoryEvent] = {}
        self._last_cancel: float | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._readers: list[int] = []
        self.clock: Callable[[], float] = time.monotonic  # for event log rate limiting
        self._log_last: dict[tuple[str, str], float] = {}
        self._log_pending: dict[tuple[str, str], tuple[int, int]] = {}  # delta, last total

    # -- startup / shutdown --------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        if not self.cfg.enabled:
            self.status = Status(False, "disabled by configuration (cgroup.enabled = false)",
                                 "set cgroup.enabled = true", policy=self.policy.name)
        else:
            root = CgroupRoot(proc=Path(self.cfg.proc_root or "/proc"), io=self.io_factory())
            self.mgr = CgroupManager.detect(root)
            self.status = self.mgr.setup(self.policy)
            self.pressure_file = self.mgr.detection.pressure_file
        if self.status.available:
            log.info(f"cgroup v2: managing {self.status.base} (policy {self.policy.name}); "
                     "this process is in supervisor/, runners go to models/NAME/")
        else:
            log.warning(f"cgroup v2: not managed, budgets by accounting only: {self.status.reason}"
                        + (f". Fix: {self.status.fix}" if self.status.fix else ""))
        for w in self.status.warnings:
            log.warning(f"cgroup v2: {w}")
        self.events = EventsWatcher()
        fd = self.events.fileno()
        if fd is not None:
            loop.add_reader(fd, self._on_events)
            self._readers.append(fd)
        else:
            self._later("events", EVENTS_POLL_S, self._on_events)
        self._start_pressure(loop)

    def _start_pressure(self, loop: asyncio.AbstractEventLoop) -> None:
        leaves: list[tuple[str, Path]] = []
        if self.mgr is not None and self.mgr.available:
            leaves = [(leaf, self.mgr.file(leaf, name="memory.pressure"))
                      for leaf in (SUPERVISOR, MODELS)]
        self.psi.start(loop, self.env, self.pressure_file, leaves)

    def close(self) -> None:
        """At exit, after every runner is reaped: remove our groups and stop watching."""
        for h in self._timers.values():
            h.cancel()
        self._timers.clear()
        if self._loop is not None:
            for fd in self._readers:
                self._loop.remove_reader(fd)
        self._readers.clear()
        if self.events is not None:
            self._record(self._safe_poll())
            self._flush_event_log()
            self.events.close()
            self.events = None
        self.psi.close()
        if self.mgr is not None:
            for err in self.mgr.teardown():
                log.warning(f"cgroup v2: teardown: {err}")

    # -- runners -------------------------------------------------------------------------------
    def runner_hook(self, name: str, budget: int | None) -> Callable[[int], None] | None:
        """Create models/<name>/ now (before the spawn); returns the callback that attaches
        the runner's pid right after the spawn (None without a usable subtree)."""
        if self.mgr is None or not self.mgr.available:
            return None
        try:
            group = self.mgr.model_group(name, budget)
            if group is None:
                return None
            if self.events is not None:
                self.events.watch(name, group.events_file)
        except (CgroupError, EdgeAgentError) as exc:
            self._warn(f"model {name}: runner will run outside its own group: {exc}")
            return None
        self._oom_pending.pop(name, None)
        return lambda pid: self._attach(group, pid)

    def _attach(self, group: ModelGroup, pid: int) -> None:
        try:
            group.attach(pid)
        except CgroupError as exc:
            self._warn(f"model {group.name}: runner (pid {pid}) left outside {group.path}: {exc}")

    def runner_exited(self, name: str) -> str | None:
        """The runner of `name` is reaped: attribute an OOM kill, then remove its group.
        Returns the OOM reason ('OOM-killed by the kernel ...') or None."""
        self._record(self._safe_poll())
        self._flush_event_log(name)
        oom = self._oom_pending.pop(name, None)
        if self.events is not None:
            self.events.unwatch(name)
        if self.mgr is not None and name in self.mgr.groups:
            group = self.mgr.groups[name]
            limit = (group.values().get("memory.max") or "?") if oom else None
            try:
                self.mgr.remove(name)
            except CgroupError as exc:
                self._warn(f"model {name}: group not removed: {exc}")
        else:
            limit = None
        if oom is None:
            return None
        where = f"{self.status.base}/models/{name}" if self.status.base else f"models/{name}"
        reason = (f"OOM-killed by the kernel ({oom.key} +{oom.delta} in {where}/memory.events, "
                  f"memory.max {limit}). Hint: raise the policy's model.memory_max, lower the "
                  "model's max_batch or context, or pick a larger cgroup.policy")
        self.oom_kills[name] += 1
        self.last_oom[name] = {"at": time.time(), "event": oom.key, "limit": limit,
                               "reason": reason}
        self._journal("oom_kill", f"model {name}: runner {reason}")
        return reason

    def _safe_poll(self) -> list[MemoryEvent]:
        if self.events is None:
            return []
        try:
            return self.events.poll()
        except CgroupError as exc:
            self._warn(f"memory.events: {exc}")
            return []

    def _on_events(self) -> None:
        self._record(self._safe_poll())
        if self.events is not None and self.events.fileno() is None:
            self._later("events", EVENTS_POLL_S, self._on_events)  # no inotify: poll

    def _record(self, evs: list[MemoryEvent]) -> None:
        for ev in evs:
            if ev.key == "gone":
                continue
            self.memory_events[(ev.group, ev.key)] += ev.delta
            if ev.is_oom_kill:
                if ev.key == "oom_group_kill" or ev.group not in self._oom_pending:
                    self._oom_pending[ev.group] = ev
                log.error(f"memory: {ev.describe()}: the kernel killed the runner of model "
                          f"{ev.group} (its memory.max was reached)")
            elif ev.key in LOGGED_KEYS:
                self._log_event(ev)

    def _log_event(self, ev: MemoryEvent) -> None:
        """Log high/max/oom increases at most every EVENT_LOG_INTERVAL_S per group and key
        (a throttled runner raises `high` thousands of times), with the summed delta."""
        k = (ev.group, ev.key)
        delta = self._log_pending.pop(k, (0, 0))[0] + ev.delta
        now = self.clock()
        last = self._log_last.get(k)
        if last is not None and now - last < EVENT_LOG_INTERVAL_S:
            self._log_pending[k] = (delta, ev.total)
            return
        self._log_last[k] = now
        since = "" if last is None else f" in the last {now - last:.0f} s"
        log.warning(f"memory: {ev.group}: {ev.key} +{delta}{since} (total {ev.total}); "
                    f"logged at most every {EVENT_LOG_INTERVAL_S:g} s per model and event")

    def _flush_event_log(self, group: str | None = None) -> None:
        """Log the increases still held back (all groups, or only `group`)."""
        for k in [k for k in self._log_pending if group is None or k[0] == group]:
            delta, total = self._log_pending.pop(k)
            log.warning(f"memory: {k[0]}: {k[1]} +{delta} (total {total}) since the last line")
        for k in [k for k in self._log_last if group is None or k[0] == group]:
            del self._log_last[k]

    # -- pressure ------------------------------------------------------------------------------
    def _pressure_hit(self, detail: str = "PSI trigger fired") -> None:
        now = time.monotonic()
        self.psi.mark(now)  # a release measures the stall share from here
        t = self.stages.on_pressure(now, detail)
        if t is not None:
            self._changed(t)
        self._act(now, escalated=t is not None)
        self._schedule_release(now)

    def _tick(self) -> None:
        now = time.monotonic()
        t = self.stages.tick(now, still_high=self.psi.still_high(now))
        if t is not None:
            self._changed(t)
        self._schedule_release(now)

    def _schedule_release(self, now: float) -> None:
        at = self.stages.next_wakeup(now)
        if at is not None:
            self._later("release", max(0.01, at - now + 0.01), self._tick)

    def _later(self, key: str, delay: float, fn: Callable[[], None]) -> None:
        if self._loop is None or self.stopping():
            return
        old = self._timers.pop(key, None)
        if old is not None:
            old.cancel()
        self._timers[key] = self._loop.call_later(delay, fn)

    def _changed(self, t: Transition) -> None:
        self.transitions[(t.from_stage, t.to_stage)] += 1
        log.log(logging.WARNING if t.to_stage > t.from_stage else logging.INFO, t.describe())
        self._journal("memory_pressure", t.describe())
        for svc in self.models().values():
            svc.poke()  # batch limits changed

    def _act(self, now: float, *, escalated: bool) -> None:
        a = self.stages.actions
        if a.unload_idle:
            for svc in self.models().values():
                if (svc.lifecycle.state is ModelState.IDLE and not svc.active
                        and self.queued(svc.name) == 0):
                    log.warning(f"memory pressure: unloading idle model {svc.name}")
                    svc.request_unload()
        interval = self.stages.config.escalate_interval_s
        if a.cancel_lowest and (escalated or self._last_cancel is None
                                or now - self._last_cancel >= interval):
            self._last_cancel = now
            self._cancel_lowest(now)

    def _cancel_lowest(self, now: float) -> None:
        models = self.models()
        running = [rec for svc in models.values() for rec in svc.active.values()
                   if not rec.done.is_set()]
        if not running:
            return
        prios = {rec.job.priority for rec in running}
        low = min(prios)
        victims = [rec for rec in running if rec.job.priority == low]
        if len(prios) == 1:  # one level only: shed the newest, keep the rest going
            victims = [max(running, key=lambda r: r.job.started_at or 0.0)]
        counts = Counter(rec.job.priority for rec in running)
        seen = ", ".join(f"{counts[p]} at priority {p}" for p in sorted(counts))
        for rec in victims:
            msg = (f"request {rec.id} (model {rec.model}, priority {rec.job.priority}) cancelled "
                   f"under memory pressure: stage 3 ({STAGE_NAMES[3]}) sheds the lowest-priority "
                   f"running requests so the kernel does not have to kill a runner (running: "
                   f"{seen}). Hint: retry later, or send it with a higher priority.")
            self.shed[rec.model] += 1
            self.shed_request(rec, now, msg)
            log.warning(msg)
            self._journal("memory_pressure", msg)
            svc = models.get(rec.model)
            if svc is not None:
                svc.poke()

    # -- what the daemon asks ------------------------------------------------------------------
    def batch_limit(self, max_batch: int) -> int:
        return self.stages.actions.batch_limit(max_batch)

    def check_admission(self) -> None:
        a = self.stages.actions
        if not a.admit:
            raise AdmissionRefused(
                f"not admitting new requests: memory pressure stage {self.stages.stage} "
                f"({self.stages.name}). Hint: retry after {a.retry_after_s} s; stages release "
                f"when pressure stays low for {self.stages.config.hold_s:g} s.",
                retry_after_s=a.retry_after_s, stage=self.stages.stage)

    def service_memory_max(self) -> int | None:
        """memory.max of the service's cgroup (our delegated group), when managed and limited."""
        if self.mgr is None or not self.mgr.available:
            return None
        text = self.mgr.fs.read_optional(self.mgr.base, "memory.max")
        text = (text or "").strip()
        return int(text) if text.isdigit() else None

    def model_dict(self, name: str) -> dict[str, Any]:
        group = self.mgr.groups.get(name) if self.mgr is not None else None
        return {"group": str(group.path) if group else None,
                "limits": group.values() if group else None,
                "oom_kills": self.oom_kills.get(name, 0),
                "last_oom": self.last_oom.get(name)}

    def health(self) -> dict[str, Any]:
        out = self.status.to_dict()
        out["service_memory_max"] = self.service_memory_max()
        if self.mgr is not None:
            out["detection"] = self.mgr.detection.to_dict()
        out["oom_kills"] = {n: self.model_dict(n)["oom_kills"] for n in self.models()}
        return out

    def pressure_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.stages.to_dict())
        out.update(self.psi.to_dict())
        out.update(trigger=str(self.policy.pressure.trigger),
                   retry_after_s=self.stages.actions.retry_after_s,
                   batch_limits={n: self.batch_limit(s.max_batch)
                                 for n, s in self.models().items()})
        return out

    def render_metrics(self) -> str:
        from edge_agent.daemon.memory_metrics import render

        return render(self) + self.psi.render_metrics()

    # -- helpers -------------------------------------------------------------------------------
    def _warn(self, text: str) -> None:
        self.status.warnings.append(text)
        del self.status.warnings[:-20]
        log.warning(f"cgroup v2: {text}")

    def _journal(self, kind: str, message: str) -> None:
        with contextlib.suppress(EdgeAgentError, sqlite3.Error, OSError):
            self.record_event(kind, message)
