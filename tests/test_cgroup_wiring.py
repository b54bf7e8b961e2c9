"""The pieces as the daemon wires them, in one asyncio loop: layout on a temporary tree,
memory.events through inotify, systemd's pressure protocol over a real FIFO, and the stages."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from cgroup_fake import make_tree

from edge_agent.cgroup import CgroupManager, EventsWatcher, PressureWatcher, Stages, load_policy
from edge_agent.cgroup.events import MemoryEvent


def test_daemon_style_wiring(tmp_path: Path) -> None:
    t = make_tree(tmp_path)
    policy = load_policy("default")
    mgr = CgroupManager.detect(t.root)
    assert mgr.setup(policy).available
    group = mgr.model_group("smollm2", 700 << 20)
    assert group is not None
    fifo = tmp_path / "pressure.fifo"
    os.mkfifo(fifo)
    env = {"MEMORY_PRESSURE_WATCH": str(fifo)}
    pressure = PressureWatcher.from_env(env, t.mount / mgr.base / "memory.pressure",
                                        policy.pressure.trigger)
    assert pressure is not None
    pressure.open()
    stages = Stages(policy.pressure.stages)
    watcher = EventsWatcher()
    watcher.watch("smollm2", group.events_file)
    seen: list[MemoryEvent] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        oom = asyncio.Event()
        escalated = asyncio.Event()

        def on_events() -> None:
            seen.extend(watcher.poll())
            if any(e.is_oom_kill for e in seen):
                oom.set()

        def on_pressure() -> None:
            if pressure.handle_ready() and stages.on_pressure(time.monotonic()):
                escalated.set()

        fd = watcher.fileno()
        assert fd is not None
        loop.add_reader(fd, on_events)
        loop.add_reader(pressure.fileno(), on_pressure)
        # the kernel kills the runner group, and a sibling's hog raises pressure
        loop.call_later(0.05, group.events_file.write_text,
                        "low 0\nhigh 3\nmax 1\noom 1\noom_kill 1\noom_group_kill 1\n")
        def hog() -> None:
            fd = os.open(fifo, os.O_WRONLY)
            os.write(fd, b"\0")
            os.close(fd)

        loop.call_later(0.05, hog)
        await asyncio.wait_for(asyncio.gather(oom.wait(), escalated.wait()), 5)
        loop.remove_reader(fd)
        loop.remove_reader(pressure.fileno())

    try:
        asyncio.run(main())
    finally:
        pressure.close()
        watcher.close()
    assert MemoryEvent("smollm2", "oom_group_kill", 1, 1) in seen
    assert stages.stage == 1 and stages.actions.admit is True
    assert stages.actions.batch_limit(8) == 4
    (t.mount / group.rel / "cgroup.procs").write_text("")
    mgr.remove("smollm2")
    assert mgr.teardown() == []
