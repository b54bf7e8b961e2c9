"""Warm start does not grow with the journal: what a start reads is bounded by the open work.

On real SQLite files: every statement of the start path (recovery, pending session turns) is
planned as an index lookup, never a table scan; pending session turns are marked and cleared
with their writes; batched retention ends where one unbounded pass ends; migration 2 marks
the turns the old start would have put back.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path

import pytest
from journal_harness import daemon_journal, fill_journal

from edge_agent.journal import (
    MIGRATIONS,
    Journal,
    JournalError,
    JournalStore,
    check_integrity,
    open_journal,
    recover,
)
from edge_agent.journal.migrations import Migrations, initial


def _turn(store: JournalStore, rid: str, *, session: str | None, state: str = "done",
          now: float = 1000.0, tokens: int = 3) -> None:
    store.add_request(id=rid, model="m", input={"prompt": rid}, prompt_ids=[1, 2],
                      params={"seed": 1}, session=session, now=now)
    store.append_tokens([(rid, k, 10 + k, k + 1) for k in range(tokens)],
                        finish=[(rid, state, None if state == "done" else "why", "length")],
                        now=now)


def _fill(store: JournalStore, finished: int, sessions: int) -> None:
    with store.journal.transaction() as conn:
        conn.executemany(
            "INSERT INTO sessions (id, model, history, n_tokens, turns, created_at, updated_at) "
            "VALUES (?, 'm', ?, 16, 1, 1.0, 2000.0)",
            [(f"s{i}", bytes(64)) for i in range(sessions)])
    for i in range(finished):
        _turn(store, f"f{i}", session=f"s{i}" if i < sessions else None, now=1000.0 + i)
        if i < sessions:
            store.save_session(f"s{i}", "m", [1, 2, 10, 11, 12], turn=f"f{i}", now=1000.0 + i)


def _vm_steps(conn: sqlite3.Connection, fn: Callable[[], object]) -> int:
    """SQLite virtual-machine instructions `fn` makes `conn` execute (deterministic: the work
    a query does, in rows visited, independent of the machine's speed)."""
    count = 0

    def tick() -> int:
        nonlocal count
        count += 1
        return 0

    conn.set_progress_handler(tick, 1)
    try:
        fn()
    finally:
        conn.set_progress_handler(None, 1)
    return count


def _journal_of(tmp_path: Path, name: str, finished: int, sessions: int) -> JournalStore:
    """`finished` done turns (the first `sessions` of them saved in their session) plus the
    same open work in every journal: a queued request, a running one whose deadline passed
    with 2 tokens, and a done turn whose session save did not happen."""
    # synchronous OFF: only filling it fast (durability is not what this measures)
    store = JournalStore(open_journal(tmp_path / name, synchronous="OFF"), clock=lambda: 1000.0)
    _fill(store, finished, sessions)
    store.add_request(id="open-q", model="m", input={"prompt": "q"}, prompt_ids=[1],
                      params={"seed": 1}, now=3000.0)
    store.add_request(id="open-late", model="m", input={"prompt": "l"}, prompt_ids=[1],
                      params={"seed": 1}, deadline=3050.0, now=3000.0)
    store.set_running(["open-late"], now=3001.0)
    store.append_tokens([("open-late", 0, 5, 1), ("open-late", 1, 6, 2)], now=3002.0)
    _turn(store, "unsaved", session="s0", now=3003.0)
    store.conn.execute("ANALYZE")  # plans as on a long-lived file
    return store


OLD_RECONCILE = (
    "SELECT r.id FROM requests r LEFT JOIN sessions s ON s.id = r.session WHERE "
    "r.session IS NOT NULL AND r.state = 'done' AND (s.updated_at IS NULL OR "
    "r.finished_at > s.updated_at) ORDER BY r.finished_at, r.rowid")
OLD_COUNTS = (
    "SELECT t.request_id, max(t.idx) + 1 FROM tokens t JOIN requests r ON r.id = "
    "t.request_id WHERE r.state NOT IN ('done', 'failed', 'cancelled', 'expired') "
    "GROUP BY t.request_id")


def test_start_work_does_not_grow_with_the_journal(tmp_path: Path) -> None:
    small = _journal_of(tmp_path, "small.sqlite3", finished=20, sessions=10)
    big = _journal_of(tmp_path, "big.sqlite3", finished=600, sessions=400)
    steps = {}
    for name, store in (("small", small), ("big", big)):
        # the control: the queries of the previous start path do grow with the journal
        old = _vm_steps(store.conn, lambda s=store: (s.conn.execute(OLD_RECONCILE).fetchall(),
                                                     s.conn.execute(OLD_COUNTS).fetchall()))
        plans: list[object] = []
        new = _vm_steps(store.conn, lambda s=store, p=plans: p.extend(
            [recover(s, now=4000.0), s.pending_turns()]))
        steps[name] = (old, new)
        plan, pending = plans
        assert [r.request.id for r in plan.resume] == ["open-q"]  # type: ignore[attr-defined]  # plans[0] is the RecoveryPlan
        assert [r.id for r in plan.expired] == ["open-late"]  # type: ignore[attr-defined]  # plans[0] is the RecoveryPlan
        assert "with 2 token(s) generated" in (store.get_request("open-late").error or "")
        assert pending == ["unsaved"]
        store.close()
    (old_small, new_small), (old_big, new_big) = steps["small"], steps["big"]
    assert old_big > 10 * old_small, steps
    assert new_big <= new_small * 1.05 + 50, steps  # O(open work), not O(journal)


def test_recover_with_nothing_open_writes_nothing(store: JournalStore) -> None:
    _fill(store, finished=5, sessions=2)
    before = store.conn.total_changes
    plan = recover(store, now=5000.0)
    assert (plan.resume, plan.expired) == ([], [])
    assert store.conn.total_changes == before
    assert store.events() == []  # no recovery event when there was nothing to recover


def test_session_turns_are_pending_until_their_history_is_saved(store: JournalStore) -> None:
    _turn(store, "done-1", session="a")
    _turn(store, "failed-1", session="b", state="failed")
    _turn(store, "cancelled-1", session="c", state="cancelled")
    _turn(store, "plain", session=None)
    assert store.pending_turns() == ["done-1"]  # only done turns of a session
    store.save_session("a", "m", [1, 2, 10], turn="done-1")
    assert store.pending_turns() == []
    _turn(store, "done-2", session="a", now=1001.0)
    _turn(store, "done-3", session="d", now=1002.0)
    assert store.pending_turns() == ["done-2", "done-3"]  # oldest first
    store.save_session("a", "m", [1], now=1003.0)  # no turn named: nothing cleared
    assert store.pending_turns() == ["done-2", "done-3"]
    assert store.delete_session("d") is False  # never saved, but its pending turn is dropped
    assert store.pending_turns() == ["done-2"]
    # a failed save leaves the mark: the transaction is all or nothing
    with pytest.raises(sqlite3.IntegrityError):
        store.save_session("a", None, [1], turn="done-2")  # type: ignore[arg-type]  # on purpose: no model
    assert store.pending_turns() == ["done-2"]


def test_batched_prune_ends_like_one_pass(tmp_path: Path) -> None:
    def world(name: str) -> JournalStore:
        s = JournalStore(open_journal(tmp_path / name), clock=lambda: 10_000.0)
        for i in range(45):
            _turn(s, f"f{i}", session=None, now=float(i), tokens=20)
        for i in range(30):
            s.record_event("note", f"e{i}", now=float(i))
        s.add_request(id="open", model="m", input={"prompt": "o"}, prompt_ids=[1],
                      params={"seed": 1})
        return s

    one, batched = world("one.sqlite3"), world("batched.sqlite3")
    kw = {"max_age_s": 10_000.0 - 5.0, "max_finished": 12, "max_events": 7}
    whole = one.prune(**kw)
    assert (whole.requests, whole.events) == (45 - 12, 30 - 7)
    totals = {"requests": 0, "events": 0}
    passes = 0
    while True:
        res = batched.prune(**kw, limit=4)
        assert res.requests <= 8 and res.events <= 4  # two request rules, 4 rows each
        passes += 1
        totals["requests"] += res.requests
        totals["events"] += res.events
        if res.total == 0:
            break
    assert passes >= 8
    assert totals == {"requests": whole.requests, "events": whole.events}
    ids = [sorted(r.id for r in s.requests()) for s in (one, batched)]
    assert ids[0] == ids[1] and "open" in ids[0] and len(ids[0]) == 13
    for s in (one, batched):
        assert s.conn.execute("SELECT count(*) FROM tokens").fetchone()[0] == 12 * 20
        assert check_integrity(s.conn, full=True) == []
        s.close()


@pytest.mark.parametrize("limit", [0, -3, 2.5, "all", True])
def test_prune_limit_must_be_a_positive_count(store: JournalStore, limit: object) -> None:
    with pytest.raises(JournalError) as err:
        store.prune(max_finished=1, limit=limit)  # type: ignore[arg-type]  # on purpose: a bad limit
    assert str(err.value) == (
        f"prune: limit {limit!r} is not a positive whole number of rows. Hint: pass e.g. "
        "limit=200, or None for one unbounded pass.")


def test_migration_2_marks_the_turns_the_old_start_put_back(tmp_path: Path) -> None:
    path = tmp_path / "v1.sqlite3"
    v1 = Migrations()
    v1(1)(initial)
    store = JournalStore(open_journal(path, migrations=v1))
    assert store.journal.schema_version == 1
    conn = store.conn
    with store.journal.transaction():
        conn.executemany(
            "INSERT INTO sessions (id, model, history, created_at, updated_at) VALUES "
            "(?, 'm', x'', 0, ?)", [("saved", 50.0), ("behind", 10.0)])
        for rid, session, state, fin in [("t-saved", "saved", "done", 40.0),
                                         ("t-behind", "behind", "done", 20.0),
                                         ("t-nosession-row", "gone", "done", 30.0),
                                         ("t-failed", "behind", "failed", 25.0),
                                         ("t-plain", None, "done", 60.0)]:
            conn.execute(
                "INSERT INTO requests (id, session, model, input, prompt_ids, params, state, "
                "created_at, finished_at) VALUES (?, ?, 'm', '{}', x'', '{}', ?, 0, ?)",
                (rid, session, state, fin))
    store.close()
    store = JournalStore(open_journal(path))
    assert store.journal.schema_version == MIGRATIONS.latest == 4
    assert store.pending_turns() == ["t-behind", "t-nosession-row"]
    saved = store.get_session("saved")  # migration 4: a session from before keeps no tools
    assert saved is not None and (saved.tools, saved.calls) == (None, {})
    names = {r[0] for r in store.conn.execute("SELECT name FROM sqlite_master WHERE type = "
                                              "'index'")}
    assert "requests_session_pending" in names
    store.close()


def test_check_leaves_no_memory_map(tmp_path: Path) -> None:
    j = open_journal(tmp_path / "j.sqlite3")
    try:
        assert check_integrity(j.conn) == [] and check_integrity(j.conn, full=True) == []
        assert j.pragma("mmap_size") == 0
        assert 0.0 <= j.check_seconds <= j.open_seconds
    finally:
        j.close()
    j = open_journal(tmp_path / "j.sqlite3", check="none")
    try:
        assert j.check_seconds < 0.001 and j.pragma("mmap_size") == 0
    finally:
        j.close()


class _Host:
    """What DaemonJournal asks of its daemon: config, state_dir, log, ready, services."""

    def __init__(self, tmp_path: Path, max_finished: int,
                 session_max_age_s: float | None = 2592000.0) -> None:
        from types import SimpleNamespace

        from edge_agent.config import JournalConfig

        self.config = SimpleNamespace(journal=JournalConfig(
            path=str(tmp_path / "j.sqlite3"), max_finished=max_finished,
            session_max_age_s=session_max_age_s))
        self.state_dir = tmp_path
        self.ready = False
        self.services: dict[str, object] = {}  # no models: nothing to warm during the check


def test_daemon_retention_runs_after_ready_in_batches(tmp_path: Path,
                                                     log_lines: list[str]) -> None:
    import asyncio
    import time

    from edge_agent.daemon.durable import PRUNE_BATCH

    n = 2 * PRUNE_BATCH + 30
    store = JournalStore(open_journal(tmp_path / "j.sqlite3", synchronous="OFF"))  # fast fill
    for i in range(n):
        _turn(store, f"f{i}", session=None, now=time.time() - 100 + i / 1000, tokens=2)
    store.close()
    host = _Host(tmp_path, max_finished=7)

    async def scenario() -> tuple[int, dict[str, object] | None, int]:
        dj = daemon_journal(host)
        plan = dj.open()
        assert plan is not None and plan.resume == []
        assert set(dj.start_s) == {"open", "check", "warm", "checked_while", "recover", "total"}
        await asyncio.sleep(0.5)
        assert dj.retention is None  # not before READY
        assert dj.store is not None
        assert dj.store.conn.execute("SELECT count(*) FROM requests").fetchone()[0] == n
        turns = 0

        async def other_work() -> None:  # the event loop keeps running between batches
            nonlocal turns
            while True:
                turns += 1
                await asyncio.sleep(0)

        bystander = asyncio.ensure_future(other_work())
        host.ready = True
        while dj.retention is None:
            await asyncio.sleep(0.05)
        bystander.cancel()
        left = dj.store.conn.execute("SELECT count(*) FROM requests").fetchone()[0]
        first = dj.retention
        # a failing pass is logged with a hint, never raised into the loop
        dj.store.conn.execute("PRAGMA query_only=ON")
        failed = await dj.prune_now()
        assert failed["batches"] == 0 and "readonly database" in str(failed["error"])
        dj.close()
        assert dj.store is None and dj._retention is None
        return left, first, turns

    left, summary, turns = asyncio.run(scenario())
    assert left == 7
    assert summary is not None and summary["requests"] == n - 7 and summary["error"] is None
    assert summary["batches"] == 4  # 200 + 200 + 53, then an empty one
    assert turns >= 3  # other tasks ran between the batches
    assert f"journal: retention pruned {n - 7} finished request(s) in 4 batch(es)" in (
        " ".join(log_lines))
    failed = [ln for ln in log_lines if ln.startswith("journal: retention pass failed:")]
    assert len(failed) == 1 and "readonly database" in failed[0]
    assert failed[0].endswith("next pass in 3600 s.") and "Hint: check the journal's" in failed[0]


def test_work_overlaps_the_check_and_cannot_write(tmp_path: Path) -> None:
    import threading

    path = tmp_path / "j.sqlite3"
    fill_journal(path, synchronous="OFF")
    seen: dict[str, object] = {}

    def work(peek: Journal) -> None:
        # runs in the opening thread; the check runs in its own (it may already be done: the
        # overlap is shown by check_seconds <= overlap_seconds below, not by timing here)
        seen["here"] = threading.current_thread() is threading.main_thread()
        seen["rows"] = JournalStore(peek).get_request("r7") is not None  # reads are fine
        with pytest.raises(sqlite3.OperationalError, match="readonly database"):
            JournalStore(peek).record_event("note", "written before the check passed")

    j = open_journal(path, while_checking=work)
    try:
        assert seen == {"here": True, "rows": True}
        assert j.quarantined is None and 0 < j.check_seconds <= j.overlap_seconds
        assert j.pragma("query_only") == 0
        store = JournalStore(j)
        store.record_event("note", "after the check")  # writable once it passed
        assert [e["message"] for e in store.events()] == ["after the check"]
    finally:
        j.close()


def test_work_is_skipped_for_a_new_file_and_pending_migrations(tmp_path: Path) -> None:
    calls: list[str] = []
    open_journal(tmp_path / "new.sqlite3", while_checking=lambda _: calls.append("new")).close()
    v1 = Migrations()
    v1(1)(initial)
    open_journal(tmp_path / "old.sqlite3", migrations=v1).close()
    j = open_journal(tmp_path / "old.sqlite3", while_checking=lambda _: calls.append("old"))
    assert j.schema_version == MIGRATIONS.latest  # migrated after a check alone
    j.close()
    j = open_journal(tmp_path / "old.sqlite3", while_checking=lambda _: calls.append("again"))
    j.close()
    assert calls == ["again"]


def test_corrupt_file_found_while_working_is_quarantined(tmp_path: Path) -> None:
    path = tmp_path / "j.sqlite3"
    fill_journal(path, synchronous="OFF")
    with open(path, "r+b") as fh:  # a page's cell area, header intact: only a check finds it
        fh.seek(4096 * 5 + 100)
        fh.write(bytes((i * 37 + 11) % 256 for i in range(3000)))
    original = path.read_bytes()
    calls: list[int] = []

    def work(peek: Journal) -> None:
        calls.append(1)
        raise RuntimeError("the work failed too")  # the corrupt file's verdict wins

    j = open_journal(path, while_checking=work, now=lambda: 1_800_000_000.0)
    try:
        assert calls == [1]
        event = j.quarantined
        assert event is not None and "quick_check" in event.reason
        assert Path(event.moved_to).read_bytes() == original
        assert JournalStore(j).requests() == []
        assert [e["kind"] for e in JournalStore(j).events()] == ["quarantine"]
    finally:
        j.close()


def test_work_failing_on_a_good_file_is_raised_after_the_check(tmp_path: Path) -> None:
    path = tmp_path / "j.sqlite3"
    fill_journal(path, 20, synchronous="OFF")

    def work(peek: Journal) -> None:
        raise KeyError("from the overlapped work")

    with pytest.raises(KeyError, match="from the overlapped work"):
        open_journal(path, while_checking=work)
    j = open_journal(path)  # the file was left as it was, and closed
    try:
        assert j.quarantined is None and len(JournalStore(j).requests()) == 20
    finally:
        j.close()


@pytest.mark.parametrize("max_age", [3600.0, None])
def test_daemon_retention_forgets_idle_sessions(tmp_path: Path, max_age: float | None) -> None:
    """journal.session_max_age_s: sessions unused for longer are dropped by the daemon's
    retention pass (so the file stays bounded); "never" (None) keeps them all."""
    import asyncio
    import time


    store = JournalStore(open_journal(tmp_path / "j.sqlite3", synchronous="OFF"))
    now = time.time()
    store.save_session("old", "m", [1, 2, 3], now=now - 7200)
    store.save_session("fresh", "m", [4, 5], now=now - 60)
    store.close()
    host = _Host(tmp_path, max_finished=10, session_max_age_s=max_age)

    async def scenario() -> tuple[dict[str, object], list[str]]:
        dj = daemon_journal(host)
        dj.open()
        summary = await dj.prune_now()
        assert dj.store is not None
        kept = [s for s in ("old", "fresh") if dj.store.get_session(s) is not None]
        dj.close()
        return summary, kept

    summary, kept = asyncio.run(scenario())
    if max_age is None:
        assert kept == ["old", "fresh"] and summary["sessions"] == 0
    else:
        assert kept == ["fresh"] and summary["sessions"] == 1
