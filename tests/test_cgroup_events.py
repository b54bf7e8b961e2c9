"""memory.events parsing and watching (inotify on real files, and plain polling)."""

from __future__ import annotations

import select
from pathlib import Path

import pytest

from edge_agent.cgroup.events import EventsWatcher, Inotify, MemoryEvent, parse_memory_events
from edge_agent.cgroup.fs import CgroupError

EVENTS = "low 0\nhigh {high}\nmax 0\noom {oom}\noom_kill {kill}\noom_group_kill {group}\n"


def events(path: Path, high: int = 0, oom: int = 0, kill: int = 0, group: int = 0) -> None:
    path.write_text(EVENTS.format(high=high, oom=oom, kill=kill, group=group))


def test_parse() -> None:
    assert parse_memory_events(EVENTS.format(high=3, oom=1, kill=1, group=1) + "new_key 7\n") == {
        "low": 0, "high": 3, "max": 0, "oom": 1, "oom_kill": 1, "oom_group_kill": 1,
        "new_key": 7}
    with pytest.raises(CgroupError, match=r"x/memory.events: cannot parse line 'oom one'"):
        parse_memory_events("oom one\n", "x/memory.events")


def readable(fd: int, timeout: float) -> bool:
    return bool(select.select([fd], [], [], timeout)[0])


def test_inotify_reports_a_changed_events_file(tmp_path: Path) -> None:
    f = tmp_path / "memory.events"
    events(f)
    w = EventsWatcher()
    try:
        w.watch("smollm2", f)
        fd = w.fileno()
        assert fd is not None and not readable(fd, 0.05)
        assert w.poll() == []
        events(f, high=5, oom=1, kill=1, group=1)  # the kernel OOM-killed the runner group
        assert readable(fd, 2.0)
        got = w.poll()
        assert not readable(fd, 0.0)  # drained
        assert got == [MemoryEvent("smollm2", "high", 5, 5), MemoryEvent("smollm2", "oom", 1, 1),
                       MemoryEvent("smollm2", "oom_kill", 1, 1),
                       MemoryEvent("smollm2", "oom_group_kill", 1, 1)]
        assert [e.key for e in got if e.is_oom_kill] == ["oom_kill", "oom_group_kill"]
        assert got[2].describe() == "smollm2: oom_kill +1 (total 1)"
        assert w.poll() == []  # each increase is reported once
        events(f)  # counters went down: group recreated, new baseline, no event
        assert w.poll() == []
        events(f, kill=2)
        assert w.poll() == [MemoryEvent("smollm2", "oom_kill", 2, 2)]
        f.unlink()  # group removed
        assert w.poll() == [MemoryEvent("smollm2", "gone", 0, 0)]
        assert w.watched == [] and w.poll() == []
    finally:
        w.close()


def test_polling_without_inotify(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    events(a)
    events(b)
    w = EventsWatcher(use_inotify=False)
    assert w.fileno() is None
    w.watch("a", a)
    w.watch("b", b)
    events(b, kill=1)
    assert w.poll() == [MemoryEvent("b", "oom_kill", 1, 1)]
    w.unwatch("b")
    events(b, kill=5)
    assert w.poll() == [] and w.watched == ["a"]
    with pytest.raises(CgroupError, match=r"watch .*/nope: no such file. Hint: create the group"):
        w.watch("c", tmp_path / "nope")
    w.close()


def test_inotify_wrapper(tmp_path: Path) -> None:
    f = tmp_path / "x"
    f.write_text("0")
    ino = Inotify()
    try:
        wd = ino.add(f)
        assert ino.read() == []
        f.write_text("1")
        assert readable(ino.fileno(), 2.0)
        assert all(w == wd for w, _ in ino.read())
        with pytest.raises(OSError, match="inotify_add_watch"):
            ino.add(tmp_path / "missing")
    finally:
        ino.close()
