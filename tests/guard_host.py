"""The daemon's side of the memory guard, as small recording fakes (a helper, not a test module).

`make_guard` builds a `MemoryGuard` the way daemon/app.py wires it, but with `FakeModel`s for
the model services and a `Host` that records what the guard asked: requests shed, journal events.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from edge_agent.cgroup import CgroupIO
from edge_agent.config import load_config
from edge_agent.daemon.memory_guard import MemoryGuard
from edge_agent.scheduler import ModelLifecycle, ModelState


@dataclass
class FakeModel:
    """A model service as the guard sees it (`GuardedModel`)."""

    name: str
    max_batch: int = 4
    lifecycle: ModelLifecycle = field(init=False)
    active: dict[str, Any] = field(default_factory=dict)
    unload_requested: bool = False  # request_unload() was called
    pokes: int = 0

    def __post_init__(self) -> None:
        self.lifecycle = ModelLifecycle(self.name)

    def poke(self) -> None:
        self.pokes += 1

    def request_unload(self) -> None:
        self.unload_requested = True
        self.poke()

    def idle(self) -> FakeModel:
        self.lifecycle.state = ModelState.IDLE  # a fake: no load happened
        return self

    def run(self, rid: str, priority: int, started_at: float) -> Any:
        """A running request of this model (what the guard reads of a RequestRecord)."""
        rec = SimpleNamespace(id=rid, model=self.name, done=asyncio.Event(),
                              job=SimpleNamespace(priority=priority, started_at=started_at))
        self.active[rid] = rec
        return rec


@dataclass
class Host:
    models: dict[str, FakeModel] = field(default_factory=dict)
    queue: dict[str, int] = field(default_factory=dict)  # model -> queued requests
    stopping: bool = False
    shed: list[tuple[str, str]] = field(default_factory=list)  # (request id, message)
    events: list[tuple[str, str]] = field(default_factory=list)  # journal (kind, message)

    def shed_request(self, rec: Any, now: float, message: str) -> None:
        self.shed.append((rec.id, message))
        rec.done.set()


def make_guard(tmp_path: Path, *, env: Mapping[str, str] | None = None, host: Host | None = None,
               io_factory: Callable[[], CgroupIO] = CgroupIO, **cgroup: Any) -> MemoryGuard:
    """A guard over `host` (an empty one by default) for the configuration `cgroup.KEY=VALUE`;
    $MEMORY_PRESSURE_WATCH=/dev/null unless `env` is given."""
    h = host if host is not None else Host()
    config = load_config(None, env={}, check_paths=False, overrides={
        "server.socket": str(tmp_path / "s.sock"), "server.state_dir": str(tmp_path / "state"),
        **{f"cgroup.{k}": v for k, v in cgroup.items()}})
    return MemoryGuard(
        config.cgroup, env={"MEMORY_PRESSURE_WATCH": "/dev/null"} if env is None else env,
        models=lambda: h.models, queued=lambda name: h.queue.get(name, 0),
        shed=h.shed_request, stopping=lambda: h.stopping,
        record_event=lambda kind, message: h.events.append((kind, message)),
        io_factory=io_factory)
