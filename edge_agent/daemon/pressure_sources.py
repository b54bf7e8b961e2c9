"""Where the daemon learns about memory pressure: which files are watched, how, and why.

Invariants owned here:
- Order: systemd's $MEMORY_PRESSURE_WATCH first when it is set (`/dev/null`: pressure handling
  is off); else a PSI trigger on the service's own memory.pressure; when that is refused (on
  Debian 12, systemd 252 leaves the file root-owned even with Delegate=yes: EACCES), triggers on
  the groups this process created itself and so owns: supervisor/ (the daemon) and models/ (the
  inner node above every runner group). The service's group holds no process of its own, so the
  two together see every stall the service's file would.
- A leaf whose trigger is refused with EACCES/EPERM while another one armed is polled instead.
  When nothing can be armed, the first PSI file refused with EACCES/EPERM is polled (some or
  full avg10 >= stall/window, in percent) every `PSI_POLL_S`; the log line names each file
  tried and the errno it got.
- A readiness on any source, or a polled reading at or above the threshold, is one pressure
  event (`on_hit(detail)`); each source counts its own events for /health and /metrics.
- A source that closes or errors is dropped with a log line; the others keep working.
- "Still high" (may a stage be released?) is the stall share measured from the `total`
  counter since the last pressure event or reading, at least RATE_MIN_S apart: it drops to 0
  as soon as stalls stop, where avg10 (the fallback for a first reading) decays for ~20 s.
- Only `start()` raises (ConfigError: a bad $MEMORY_PRESSURE_WRITE). After arming it drops
  CAP_SYS_RESOURCE when the unit granted it ambiently (caps.py): it is needed only to arm.
"""

from __future__ import annotations

import asyncio
import errno
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edge_agent.cgroup import (
    CgroupError,
    PressureStats,
    PressureWatcher,
    Trigger,
    read_pressure,
)
from edge_agent.cgroup.caps import CAP_SYS_RESOURCE, drop_ambient
from edge_agent.cgroup.fs import errno_name
from edge_agent.cgroup.psi import ENV_WATCH, has_cap_sys_resource

__all__ = ["PressureSources", "Source", "PSI_POLL_S", "KIND_HELP"]

log = logging.getLogger(__name__)

PSI_POLL_S = 2.0  # memory.pressure poll period when no trigger can be armed
RATE_MIN_S = 0.5  # shortest interval a stall share is measured over (else avg10 is used)
KIND_HELP = ("psi = a kernel PSI trigger woken by POLLPRI; fifo/socket = systemd's "
             "$MEMORY_PRESSURE_WATCH; poll = avg10 read every 2 s because no trigger could be "
             "armed")
_REFUSED = (errno.EACCES, errno.EPERM)


@dataclass
class Source:
    """One watched file: how (`kind`) and what it stands for (`role`)."""

    path: Path
    kind: str  # "psi" | "fifo" | "socket" | "poll"
    role: str  # "systemd" | "service" | "supervisor" | "models"
    watcher: PressureWatcher | None = None
    trigger: str = ""
    note: str = ""
    events: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"file": str(self.path), "kind": self.kind, "role": self.role,
                "trigger": self.trigger or None, "note": self.note or None,
                "events": self.events}


class PressureSources:
    def __init__(self, trigger: Trigger, *, on_hit: Callable[[str], None],
                 stopping: Callable[[], bool]) -> None:
        self.trigger = trigger
        self.on_hit = on_hit
        self.stopping = stopping
        self.sources: list[Source] = []
        self.refused: list[dict[str, Any]] = []  # attempts that failed: file, role, errno, error
        self.error: str | None = None  # why pressure is not (fully) watched by triggers
        self.service_file: Path | None = None
        self.capability = "held" if has_cap_sys_resource() else "not held"  # CAP_SYS_RESOURCE
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._readers: dict[int, Source] = {}
        self._mark: tuple[float, int] | None = None  # (monotonic s, stall total µs) for release

    # -- arming --------------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop, env: Mapping[str, str],
              service_file: Path | None, leaves: Sequence[tuple[str, Path]] = ()) -> None:
        """Arm what can be armed, in the order of the module docstring; then drop an ambient
        CAP_SYS_RESOURCE (from the unit): armed triggers keep working without it."""
        self._start(loop, env, service_file, leaves)
        try:
            if drop_ambient(CAP_SYS_RESOURCE):
                self.capability = "dropped after arming"
                log.info("memory pressure: dropped CAP_SYS_RESOURCE (the unit grants it only "
                         "so that Linux < 6.5 lets us arm PSI triggers; armed triggers keep "
                         "working, runners never get it)")
        except CgroupError as exc:
            log.warning(f"memory pressure: {exc}")

    def _start(self, loop: asyncio.AbstractEventLoop, env: Mapping[str, str],
               service_file: Path | None, leaves: Sequence[tuple[str, Path]]) -> None:
        self._loop = loop
        self.service_file = service_file
        payload = str(self.trigger).encode() + b"\0"
        watch = env.get(ENV_WATCH)
        if watch == "/dev/null":
            self.error = "off ($MEMORY_PRESSURE_WATCH=/dev/null)"
            log.info(f"memory pressure: {self.error}")
            return
        if watch:
            pw = PressureWatcher.from_env(env, service_file, self.trigger)  # ConfigError
            if pw is not None and self._arm("systemd", pw):
                return
        if service_file is not None and self._arm("service",
                                                  PressureWatcher(service_file, payload),
                                                  brief=bool(leaves)):
            return
        waiting = [(role, path) for role, path in leaves
                   if not self._arm(role, PressureWatcher(path, payload))]
        if self.sources:
            for role, path in waiting:
                if not (any(r["file"] == str(path) and r["errno"] in _REFUSED
                            for r in self.refused) and self._poll(role, path)):
                    self.error = f"{path} ({role}) not watched: see `refused`"
            if self.refused and not waiting:
                log.warning(f"memory pressure: {self._summary()}")
            return
        if not self.refused:
            self.error = "no pressure source (no PSI file found)"
            log.warning(f"memory pressure: {self.error}")
            return
        first = next((r for r in self.refused if r["errno"] in _REFUSED and r["psi"]), None)
        if first is None or not self._poll(first["role"], Path(first["file"])):
            self.error = "not watched: " + " | ".join(r["error"] for r in self.refused)
            log.error(f"memory pressure: not watched: {self._summary()} (each error and its "
                      "fix is logged above)")

    def _arm(self, role: str, pw: PressureWatcher, brief: bool = False) -> bool:
        """Open and arm `pw`; False (recorded in `refused`, logged) when that fails. `brief`:
        a refusal is expected and has a fallback, so the log line is one sentence."""
        try:
            pw.open()
        except CgroupError as exc:
            self.refused.append({"file": str(pw.path), "role": role, "errno": exc.errno,
                                 "psi": pw.kind == "psi", "error": str(exc)})
            if brief and exc.errno in _REFUSED:
                why = ("systemd < 254 leaves it root-owned" if exc.errno == errno.EACCES
                       else "no CAP_SYS_RESOURCE on a kernel < 6.5, or a window not a multiple "
                       "of 2 s on >= 6.5")
                log.info(f"memory pressure: no trigger on {pw.path} ({role}): "
                         f"{errno_name(exc.errno or 0)} ({why}); trying the supervisor/ and "
                         "models/ groups this process owns")
            else:
                log.warning(f"memory pressure: cannot watch {pw.path} ({role}): {exc}")
            return False
        assert self._loop is not None
        src = Source(pw.path, pw.kind, role, pw, note=pw.note,
                     trigger=(pw.payload or b"").rstrip(b"\0\n").decode("ascii", "replace"))
        self.sources.append(src)
        self._loop.add_reader(pw.fileno(), self._on_ready, src)
        self._readers[pw.fileno()] = src
        log.info(f"memory pressure: watching {pw.path} ({pw.kind}, {role}"
                 + (f"; {pw.note}" if pw.note else "") + ")")
        return True

    def _summary(self) -> str:
        tried = "; ".join(f"{r['file']} ({r['role']}): {errno_name(r['errno'] or 0)}"
                          for r in self.refused)
        return (f"no trigger armed on {tried}" if not any(s.kind != "poll" for s in self.sources)
                else f"armed {', '.join(f'{s.path} ({s.kind})' for s in self.sources)} after "
                f"{tried}")

    def _poll(self, role: str, path: Path) -> bool:
        try:
            read_pressure(path)
        except CgroupError as exc:
            log.warning(f"memory pressure: cannot poll {path} either: {exc}")
            return False
        why = self._summary()
        self.sources.append(Source(path, "poll", role, trigger=self.threshold_text()))
        self.error = (f"polling {path} instead of a trigger: "
                      + " | ".join(r["error"] for r in self.refused))
        log.warning(f"memory pressure: polling {path} ({self.threshold_text()}) every "
                    f"{PSI_POLL_S:g} s instead of a trigger: {why} (each refusal and its fix is "
                    "logged above)")
        self._schedule_poll()
        return True

    # -- events --------------------------------------------------------------------------------
    def _on_ready(self, src: Source) -> None:
        pw = src.watcher
        if pw is None:
            return
        try:
            hit = pw.handle_ready()
            why = f"{pw.path}: closed by the other end"
        except CgroupError as exc:
            hit, why = False, str(exc)
            pw.closed = True
        if pw.closed:
            self._drop(src, why)
            return
        if hit:
            src.events += 1
            what = "PSI trigger" if src.kind == "psi" else f"{src.kind} source"
            self.on_hit(f"{what} fired on {src.path}")

    def _drop(self, src: Source, why: str) -> None:
        pw = src.watcher
        if pw is not None:
            fd = pw.fileno()
            if self._loop is not None and self._readers.pop(fd, None) is not None:
                self._loop.remove_reader(fd)
            pw.close()
            src.watcher = None
        self.sources.remove(src)
        self.error = f"{src.path} no longer watched: {why}"
        left = ", ".join(str(s.path) for s in self.sources) or "nothing"
        log.error(f"memory pressure: {self.error} (still watching: {left})")

    def _schedule_poll(self) -> None:
        if self._loop is None or self.stopping():
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._loop.call_later(PSI_POLL_S, self._poll_tick)

    def _poll_tick(self) -> None:
        polled = [s for s in self.sources if s.kind == "poll"]
        for src in polled:
            if self.above(src.path):
                src.events += 1
                self.on_hit(f"{src.path}: {self.threshold_text()}")
        if polled:
            self._schedule_poll()

    # -- readings ------------------------------------------------------------------------------
    def threshold(self) -> float:
        """The trigger's share of stalled time, in percent (avg10's unit)."""
        return 100.0 * self.trigger.stall_us / self.trigger.window_us

    def threshold_text(self) -> str:
        return f"{self.trigger.kind} avg10 >= {self.threshold():g}%"

    def _read(self, path: Path | None) -> PressureStats | None:
        if path is None:
            return None
        try:
            return read_pressure(path)
        except CgroupError:
            return None

    def _avg10_above(self, stats: PressureStats) -> bool:
        some = self.trigger.kind == "some"
        return (stats.some_avg10 if some else (stats.full_avg10 or 0.0)) >= self.threshold()

    def _stall_total(self, stats: PressureStats) -> int:
        return stats.some_total_us if self.trigger.kind == "some" else (stats.full_total_us or 0)

    def above(self, path: Path | None) -> bool:
        """A PSI reading of `path` at or above the trigger's share (stall/window)."""
        stats = self._read(path)
        return stats is not None and self._avg10_above(stats)

    def _release_file(self) -> Path | None:
        """The file release decisions read: the service's (it aggregates every leaf), else the
        first polled one."""
        return self.service_file or next((s.path for s in self.sources if s.kind == "poll"), None)

    def mark(self, now: float) -> None:
        """Remember the stall total at a pressure event: the next `still_high` measures from
        here."""
        stats = self._read(self._release_file())
        self._mark = None if stats is None else (now, self._stall_total(stats))

    def still_high(self, now: float) -> bool:
        """Pressure is not over: the stall share since the last mark or reading (if at least
        RATE_MIN_S ago, else avg10) is at or above the trigger's share."""
        stats = self._read(self._release_file())
        if stats is None:
            return False
        total, prev = self._stall_total(stats), self._mark
        if prev is not None and now - prev[0] < RATE_MIN_S:
            return self._avg10_above(stats)  # too short to measure a share: keep the mark
        self._mark = (now, total)
        if prev is None or total < prev[1]:  # no mark yet (or the counter restarted)
            return self._avg10_above(stats)
        share = 100.0 * (total - prev[1]) / ((now - prev[0]) * 1e6)
        return share >= self.threshold()

    # -- reporting -----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        first = self.sources[0] if self.sources else None
        return {"source": str(first.path) if first else None,
                "kind": first.kind if first else None,
                "sources": [s.to_dict() for s in self.sources],
                "triggers_armed": sum(s.kind != "poll" for s in self.sources),
                "refused": [{k: r[k] for k in ("file", "role", "error")} for r in self.refused],
                "cap_sys_resource": self.capability, "error": self.error}

    def render_metrics(self) -> str:
        lines = ["# HELP edge_agent_memory_pressure_source Memory pressure sources watched, one "
                 f"sample per file ({KIND_HELP}).",
                 "# TYPE edge_agent_memory_pressure_source gauge"]
        labels = [f'file="{s.path}",kind="{s.kind}",role="{s.role}"' for s in self.sources]
        lines += [f"edge_agent_memory_pressure_source{{{lab}}} 1" for lab in labels]
        lines += ["# HELP edge_agent_memory_pressure_source_events_total Pressure events seen "
                  "on each source.",
                  "# TYPE edge_agent_memory_pressure_source_events_total counter"]
        lines += [f"edge_agent_memory_pressure_source_events_total{{{lab}}} {s.events}"
                  for lab, s in zip(labels, self.sources, strict=True)]
        lines += ["# HELP edge_agent_memory_pressure_triggers_armed Sources woken by the kernel "
                  "or systemd (not polled); 0 means pressure is polled or not watched.",
                  "# TYPE edge_agent_memory_pressure_triggers_armed gauge",
                  "edge_agent_memory_pressure_triggers_armed "
                  f"{sum(s.kind != 'poll' for s in self.sources)}"]
        return "\n".join(lines) + "\n"

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for fd in list(self._readers):
            if self._loop is not None:
                self._loop.remove_reader(fd)
        self._readers.clear()
        for s in self.sources:
            if s.watcher is not None:
                s.watcher.close()
                s.watcher = None
