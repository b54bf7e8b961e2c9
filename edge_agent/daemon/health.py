"""The /health body and the model gauges of /metrics, assembled from the daemon's parts.

Invariants owned here:
- /health's body has its keys in one order (status, pid, uptime_s, models, mlock, queue, cgroup,
  pressure, socket, journal, degraded), points in time as ISO 8601 (wallclock.health_times).
  A daemon that is "serving" with reasons to be degraded says "degraded"; only "serving" is a
  200 (daemon/routes.py).
- Reading the process's cgroup files never raises: what cannot be read is None (or
  `available: false`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from edge_agent.wallclock import health_times

if TYPE_CHECKING:
    from edge_agent.scheduler import ModelLifecycle

__all__ = ["cgroup_info", "health_body", "model_gauges"]


class GaugedModel(Protocol):
    """What /health and /metrics read of one model service (daemon/service.py)."""

    @property
    def name(self) -> str: ...

    @property
    def lifecycle(self) -> ModelLifecycle: ...

    @property
    def active(self) -> Mapping[str, Any]: ...  # the running requests by id

    @property
    def free_blocks(self) -> int | None: ...

    @property
    def lock(self) -> dict[str, Any] | None: ...  # the mlock report, once loaded

    def to_dict(self) -> dict[str, Any]: ...


def _read_int(path: Path) -> int | str | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else text


def cgroup_info(root: Path = Path("/sys/fs/cgroup")) -> dict[str, Any]:
    """This process's cgroup v2 path, memory limit/usage and memory pressure (when readable)."""
    try:
        line = next(ln for ln in Path("/proc/self/cgroup").read_text().splitlines()
                    if ln.startswith("0::"))
    except (OSError, StopIteration):
        return {"available": False}
    rel = line[3:].strip()
    d = root / rel.lstrip("/")
    info: dict[str, Any] = {"available": (d / "cgroup.procs").exists(), "path": rel,
                            "memory_max": _read_int(d / "memory.max"),
                            "memory_current": _read_int(d / "memory.current")}
    try:
        some = (d / "memory.pressure").read_text().splitlines()[0]
        info["memory_pressure"] = dict(kv.split("=") for kv in some.split()[1:])
    except (OSError, IndexError, ValueError):
        info["memory_pressure"] = None
    return info


def health_body(*, status: str, started: float, services: Mapping[str, GaugedModel],
                queue: dict[str, Any], cgroup: dict[str, Any], pressure: Any, socket: str,
                journal: dict[str, Any], degraded: list[str],
                context_notes: Mapping[str, str],
                serial: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """/health's body: `status` is loading / serving / stopping (degraded when serving with
    `degraded` reasons); `cgroup` is the memory guard's view, the process's own is added;
    `context_notes` say per model why its context was capped."""
    body: dict[str, Any] = {
        "status": status, "pid": os.getpid(),
        "uptime_s": round(time.monotonic() - started, 3),
        "models": {n: s.to_dict() for n, s in services.items()},
        "mlock": {n: s.lock for n, s in services.items() if s.lock is not None},
        "queue": queue,
        "cgroup": {**cgroup, "process": cgroup_info()},
        "pressure": pressure,
        "socket": socket,
        "journal": journal,
    }
    if serial:  # the UART ports (serial.port): a link that is down is visible from here too
        body["serial"] = serial
    body = health_times(body, started=started)  # points in time as ISO 8601
    body["degraded"] = degraded
    for name, note in context_notes.items():
        if isinstance(body.get("models", {}).get(name), dict):
            body["models"][name]["context_note"] = note
    if degraded and body.get("status") == "serving":
        body["status"] = "degraded"
    return body


def model_gauges(services: Iterable[GaugedModel], *, depth: int,
                 queued: Callable[[str], int]) -> dict[str, list[tuple[str, float]]]:
    """The per-model gauges of /metrics (`depth`: the scheduler's queue, `queued(model)`: its
    queued requests of one model)."""
    svcs = list(services)
    return {
        "edge_agent_queue_depth": [("", depth)],
        "edge_agent_requests_queued": [(f'model="{s.name}"', queued(s.name)) for s in svcs],
        "edge_agent_requests_running": [(f'model="{s.name}"', len(s.active)) for s in svcs],
        "edge_agent_kv_free_blocks": [(f'model="{s.name}"', s.free_blocks)
                                      for s in svcs if s.free_blocks is not None],
        "edge_agent_locked_bytes": [(f'model="{s.name}"', s.lock.get("locked_bytes", 0))
                                    for s in svcs if s.lock],
        "edge_agent_weight_bytes": [(f'model="{s.name}"', s.lock.get("weight_bytes", 0))
                                    for s in svcs if s.lock],
        "edge_agent_model_serving": [
            (f'model="{s.name}"', float(s.lifecycle.can_serve)) for s in svcs],
    }
