"""Faults the daemon must survive, in process on real SQLite files: a journal whose file system
fills up (a real, small tmpfs), a journal whose schema is not the one its user_version stands
for, and core tasks (a model loop, the memory guard's callbacks) that die.

Disk full: the step that could not be committed is kept and written once space returns, the
model loops pause meanwhile, new requests are refused at once (507 `journal_unavailable`,
Retry-After), /health says `degraded` and why; the daemon serves again by itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import shutil
import sqlite3
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from journal_harness import daemon_journal

from edge_agent.config import load_config
from edge_agent.daemon.outcome import Outcome
from edge_agent.errors import JournalNotWritable
from edge_agent.journal import JournalError, JournalStore, open_journal
from edge_agent.protocol.api import api_error, parse_generation
from edge_agent.scheduler import Job

# -- a real small file system ---------------------------------------------------------------------


@pytest.fixture
def small_fs() -> Iterator[Path]:
    """A 4 MiB tmpfs mounted for this test (root only; skipped otherwise)."""
    mnt = Path(tempfile.mkdtemp(prefix="ea-fs-", dir="/tmp"))
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        mnt.rmdir()
        pytest.skip(f"cannot mount a tmpfs on {mnt}: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
        shutil.rmtree(mnt, ignore_errors=True)


def fill(fs: Path) -> Path:
    """Fill the file system to the last page; the filler file (unlink it to free the space)."""
    filler = fs / "filler"
    with open(filler, "wb", buffering=0) as fh:
        for chunk in (1 << 16, 4096, 512, 1):
            while True:
                try:
                    fh.write(b"\0" * chunk)
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC, exc
                    break
    return filler


# -- DaemonJournal without a daemon ----------------------------------------------------------------


class _Sessions:
    def __init__(self) -> None:
        self.finished: list[tuple[str, bool]] = []

    def finished_call(self, rec: Any, done: bool) -> None:
        self.finished.append((rec.id, done))


class _Host:
    """What DaemonJournal asks of its daemon."""

    def __init__(self, state: Path, journal: Path) -> None:
        from edge_agent.config import JournalConfig

        self.config = SimpleNamespace(journal=JournalConfig(path=str(journal)))
        self.state_dir = state
        self.ready = True
        self.services: dict[str, Any] = {}
        self.sessions_seen = _Sessions()
        self.sessions = SimpleNamespace(finished=self.sessions_seen.finished_call)


class _Rec:
    """The parts of a RequestRecord the journal reads."""

    def __init__(self, rid: str, session: str | None = None) -> None:
        self.job = Job(id=rid, model="m", prompt_ids=[1, 2, 3], params={"seed": 7})
        self.request = parse_generation({"prompt": "hi", "max_tokens": 8, "session": session}
                                        if session else {"prompt": "hi", "max_tokens": 8},
                                        chat=False, max_tokens_limit=64)
        self.model = "m"
        self.tokens: list[int] = []
        self.decoder = SimpleNamespace(offset=0)
        self.outcome: Outcome | None = None

    @property
    def id(self) -> str:
        return self.job.id

    def push(self, *tokens: int) -> int:
        before = len(self.tokens)
        self.tokens += tokens
        self.decoder.offset += len(tokens)
        return before


async def _step(dj: Any, rec: _Rec, *tokens: int, start: bool = False) -> None:
    dj.begin_step()
    if start:
        dj.started([rec.id])
    dj.token(rec, rec.push(*tokens))
    await dj.commit_step()


async def _until(cond: Any, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"not within {timeout} s: {what}")
        await asyncio.sleep(0.05)


def _rows(path: Path, sql: str) -> list[tuple[Any, ...]]:
    raw = sqlite3.connect(path)
    try:
        return raw.execute(sql).fetchall()
    finally:
        raw.close()


def test_disk_full_pauses_the_step_and_writes_it_when_space_returns(
        small_fs: Path, tmp_path: Path, log_lines: list[str]) -> None:

    path = small_fs / "journal.sqlite3"
    host = _Host(tmp_path, path)

    async def scenario() -> None:
        dj = daemon_journal(host)
        dj.open()
        a, b = _Rec("req-a"), _Rec("req-b", session="s1")
        dj.accept([a])  # type: ignore[arg-type]  # _Rec: a stand-in RequestRecord
        dj.accept([b])  # type: ignore[arg-type]  # _Rec: a stand-in RequestRecord
        await _step(dj, a, 10, 11, 12, start=True)
        assert dj.writable and dj.fault is None
        filler = fill(small_fs)
        await _step(dj, a, 13, 14)  # the commit fails: kept, never raised into the model loop
        assert not dj.writable
        fault = dj.fault
        assert fault is not None and "full" in fault["reason"], fault
        assert dj.health()["fault"]["reason"] == fault["reason"]
        assert any("journal" in ln and "Hint:" in ln for ln in log_lines), log_lines
        with pytest.raises(JournalNotWritable) as refused:
            dj.check_admission()
        err = api_error(refused.value)  # the HTTP answer
        assert err.status == 507 and err.code == "journal_unavailable"
        assert "full" in err.message and "Hint:" in err.message
        retry = dict(err.headers)["retry-after"]
        assert int(retry) >= 1
        with pytest.raises(JournalError):  # a request cannot be accepted un-journaled
            dj.accept([_Rec("req-c")])
        # a turn that ends while the journal is full (outside a step): its session history is
        # saved after its end is durable, not before
        b.outcome = Outcome.cancel("cancelled by the client")
        dj.finished(b)
        assert host.sessions_seen.finished == []
        filler.unlink()
        await _until(lambda: dj.writable, 15.0, "the journal to be writable again")
        assert dj.fault is None and dj.health()["fault"] is None
        await _step(dj, a, 15)
        a.outcome = Outcome.done("length")
        dj.finished(a)
        assert host.sessions_seen.finished == [("req-b", False), ("req-a", True)]
        dj.close()

    asyncio.run(scenario())
    toks = _rows(path, "SELECT idx, token_id FROM tokens WHERE request_id = 'req-a' ORDER BY idx")
    assert toks == [(0, 10), (1, 11), (2, 12), (3, 13), (4, 14), (5, 15)]  # nothing lost
    states = dict(_rows(path, "SELECT id, state FROM requests"))
    assert states == {"req-a": "done", "req-b": "cancelled"}  # req-c was never accepted
    events = [m for (m,) in _rows(path, "SELECT message FROM events WHERE kind = 'journal_fault'")]
    assert len(events) == 1 and "full" in events[0], events
    assert any("writable again" in ln for ln in log_lines), log_lines


def test_a_full_disk_at_start_is_a_clear_error(small_fs: Path, tmp_path: Path) -> None:

    path = small_fs / "journal.sqlite3"
    _journal_with_open_request(path)
    other = sqlite3.connect(path)  # keeps the -wal and -shm in place: the open itself works
    other.execute("SELECT count(*) FROM requests").fetchall()
    filler = fill(small_fs)

    async def scenario() -> None:
        dj = daemon_journal(_Host(tmp_path, path))
        with pytest.raises(JournalError) as failed:
            dj.open()
        text = str(failed.value)
        assert str(path) in text and "full" in text and "Hint: free space" in text
        assert dj.store is None

    try:
        asyncio.run(scenario())
    finally:
        other.close()
    filler.unlink()
    assert _rows(path, "SELECT state FROM requests") == [("running",)]  # untouched


def test_a_failed_commit_leaves_no_transaction_open(small_fs: Path) -> None:
    j = open_journal(small_fs / "j.sqlite3")
    try:
        store = JournalStore(j)
        filler = fill(small_fs)
        with pytest.raises(sqlite3.OperationalError, match="full"):
            store.record_event("note", "x" * 200)
        assert not j.conn.in_transaction
        filler.unlink()
        store.record_event("note", "after")  # the connection is usable again
        assert [e["message"] for e in store.events()] == ["after"]
    finally:
        j.close()


# -- the whole daemon in process: 507 at once, /health degraded, back by itself -------------------


def _daemon(root: Path, journal: Path | None = None, env: dict[str, str] | None = None) -> Any:
    from edge_agent.daemon.app import Daemon

    overrides: dict[str, Any] = {
        "server.socket": str(root / "s.sock"), "server.state_dir": str(root / "state"),
        "cgroup.enabled": False, "models.smollm2.context": 256,
        "models.smollm2.preload": False}
    if journal is None:
        overrides["journal.enabled"] = False
    else:
        overrides["journal.path"] = str(journal)
    cfg = load_config(None, env={}, check_paths=False, overrides=overrides)
    return Daemon(cfg, env=env or {})


@pytest.fixture
def root() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="ea-f-", dir="/tmp"))  # short: AF_UNIX path limit
    yield path
    shutil.rmtree(path, ignore_errors=True)


async def _health(d: Any) -> tuple[int, dict[str, Any]]:
    """GET /health through the daemon's own HTTP handler."""
    from edge_agent.transports.http import Request

    resp = await d.http.handler(Request("GET", "/health", {}, {}, b""))
    return resp.status, json.loads(resp.body)


def test_daemon_refuses_with_507_and_says_degraded_until_space_returns(
        small_fs: Path, root: Path) -> None:
    d = _daemon(root, small_fs / "journal.sqlite3")

    async def scenario() -> None:
        serving = asyncio.ensure_future(d.serve())
        await _until(lambda: d.ready, 30.0, "READY")
        status, h = await _health(d)
        assert (status, h["status"]) == (200, "serving")
        filler = fill(small_fs)
        with pytest.raises(JournalNotWritable) as refused:
            d.submit(parse_generation({"prompt": "Hello", "max_tokens": 4}, chat=False,
                                      max_tokens_limit=64))
        err = api_error(refused.value)  # the HTTP answer
        assert err.status == 507 and err.code == "journal_unavailable"
        assert "retry-after" in dict(err.headers)
        status, h = await _health(d)
        assert (status, h["status"]) == (503, "degraded"), h
        assert any("full" in r for r in h["degraded"]), h["degraded"]
        t0 = time.monotonic()  # refused at once, not after a timeout
        with pytest.raises(JournalNotWritable):
            d.submit(parse_generation({"prompt": "Hello", "max_tokens": 4}, chat=False,
                                      max_tokens_limit=64))
        assert time.monotonic() - t0 < 0.5
        filler.unlink()
        await _until(lambda: d.journal.writable, 15.0, "the journal to be writable again")
        status, h = await _health(d)
        assert (status, h["status"]) == (200, "serving"), h
        rec = d.submit(parse_generation({"prompt": "Hello", "max_tokens": 4}, chat=False,
                                        max_tokens_limit=64))
        assert rec.id in d.records
        d.cancel(rec.id)
        d.request_exit()
        assert await asyncio.wait_for(serving, 30.0) == 0

    asyncio.run(scenario())



# -- the routes' accepts: one transaction per burst, ids out only after it ------------------------


def _gen(prompt: str = "Hello", **extra: Any) -> Any:
    body = {"messages": [{"role": "user", "content": prompt}]} if "session" in extra else {
        "prompt": prompt}
    return parse_generation({**body, "max_tokens": 4, **extra}, chat="session" in extra,
                            max_tokens_limit=64)


@contextlib.asynccontextmanager
async def _serving(d: Any) -> AsyncIterator[None]:
    """`d` serving (READY) for the block; asked to exit after it, and exits 0."""
    serving = asyncio.ensure_future(d.serve())
    await _until(lambda: d.ready, 30.0, "READY")
    yield
    d.request_exit()
    assert await asyncio.wait_for(serving, 30.0) == 0


def _writes(d: Any) -> list[str]:
    """The write transactions the daemon's journal connection begins from now on."""
    begun: list[str] = []
    d.journal.store.journal.conn.set_trace_callback(
        lambda sql: begun.append(sql) if sql.startswith("BEGIN") else None)
    return begun


def test_a_burst_of_requests_is_journaled_in_one_transaction_before_any_id_goes_out(
        root: Path) -> None:
    path = root / "journal.sqlite3"
    d = _daemon(root, path)

    async def scenario() -> None:
        async with _serving(d):
            begun = _writes(d)
            seen: dict[str, int] = {}

            async def client(i: int) -> Any:
                rec = await d.accept(_gen(f"Hello {i}"))
                # the id goes out now: another connection must already see the row
                seen[rec.id] = len(_rows(path, f"SELECT id FROM requests WHERE id = '{rec.id}'"))
                return rec

            t0 = time.time()
            recs = await asyncio.gather(*(client(i) for i in range(8)))
            assert len(begun) == 1, begun  # eight requests, one fsync
            assert seen == {r.id: 1 for r in recs}
            # journaled with the deadline the queue gave them (scheduler.default_timeout_ms)
            cap = d.config.scheduler.default_timeout_ms / 1000.0
            for (deadline,) in _rows(path, "SELECT deadline FROM requests"):
                assert deadline is not None and t0 + cap - 5 < deadline < time.time() + cap + 5
            for rec in recs:
                await asyncio.wait_for(rec.done.wait(), 60.0)
                assert rec.outcome is not None and rec.outcome.state == "done", rec.outcome
            one = await d.accept(_gen("alone"))  # a lone request is not held back for company
            await asyncio.wait_for(one.done.wait(), 60.0)

    asyncio.run(scenario())
    assert len(_rows(path, "SELECT id FROM requests WHERE state = 'done'")) == 9


def test_a_group_the_storage_refuses_is_refused_whole_and_nothing_of_it_is_queued(
        small_fs: Path, root: Path) -> None:
    d = _daemon(root, small_fs / "journal.sqlite3")

    async def scenario() -> None:
        async with _serving(d):
            filler = fill(small_fs)
            got = await asyncio.gather(d.accept(_gen("a")), d.accept(_gen("b")),
                                       d.accept(_gen("c", session="s1")), return_exceptions=True)
            assert all(isinstance(e, JournalNotWritable) for e in got), got
            assert all(api_error(e).status == 507 for e in got)  # type: ignore[arg-type]
            assert not d.records and d.scheduler.depth == 0
            assert not d.sessions.busy  # the session's claim is given back
            assert not d._accepting
            filler.unlink()
            await _until(lambda: d.journal.writable, 15.0, "the journal to be writable again")
            rec = await d.accept(_gen("c", session="s1"))  # the same session is free again
            await asyncio.wait_for(rec.done.wait(), 60.0)

    asyncio.run(scenario())


def test_a_client_that_leaves_before_the_commit_is_not_journaled_and_after_it_is_cancelled(
        root: Path) -> None:
    path = root / "journal.sqlite3"
    d = _daemon(root, path)

    async def scenario() -> None:
        async with _serving(d):
            early = asyncio.ensure_future(d.accept(_gen("gone early", session="s2")))
            await asyncio.sleep(0)  # its handler ran: prepared, the commit is due next turn
            assert len(d._accepting) == 1
            early.cancel()
            with pytest.raises(asyncio.CancelledError):
                await early
            assert not d._accepting and not d.records and not d.sessions.busy
            late = asyncio.ensure_future(d.accept(_gen("gone late")))
            await asyncio.sleep(0)  # prepared
            await asyncio.sleep(0)  # committed: the waiter is answered, the handler not yet back
            assert len(d.records) == 1 and not late.done()
            late.cancel()
            with pytest.raises(asyncio.CancelledError):
                await late
            (rec,) = d.records.values()
            await asyncio.wait_for(rec.done.wait(), 10.0)
            assert rec.outcome is not None and rec.outcome.state == "cancelled", rec.outcome
            assert rec.outcome.cancelled == "client disconnected"

    asyncio.run(scenario())
    assert _rows(path, "SELECT state FROM requests") == [("cancelled",)]


# -- schema damage: quarantined like corruption ----------------------------------------------------

DAMAGE = {
    "missing table": "DROP TABLE tokens",
    "missing column": "ALTER TABLE tokens DROP COLUMN text_offset",
    "user_version 0": "PRAGMA user_version = 0",
    "user_version 1": "PRAGMA user_version = 1",
}


def _journal_with_open_request(path: Path) -> None:
    store = JournalStore(open_journal(path))
    store.add_request(id="r1", model="m", input={"prompt": "x"}, prompt_ids=[1, 2],
                      params={"seed": 1})
    store.append_tokens([("r1", 0, 5, 1), ("r1", 1, 6, 2)], running=["r1"])
    store.close()


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_schema_damage_is_quarantined(tmp_path: Path, kind: str) -> None:
    from edge_agent.journal import recover

    path = tmp_path / "j.sqlite3"
    _journal_with_open_request(path)
    raw = sqlite3.connect(path)
    raw.execute(DAMAGE[kind])
    raw.commit()
    raw.close()
    j = open_journal(path, now=lambda: 1_800_000_000.0)
    try:
        event = j.quarantined
        assert event is not None, f"{kind}: not quarantined"
        assert "schema" in event.reason, event.reason
        assert Path(event.moved_to).exists()
        store = JournalStore(j)
        plan = recover(store)  # a fresh journal: nothing to resume, nothing raised
        assert plan.resume == [] and store.requests() == []
    finally:
        j.close()


def test_a_good_journal_passes_the_schema_check(tmp_path: Path) -> None:
    path = tmp_path / "j.sqlite3"
    _journal_with_open_request(path)
    raw = sqlite3.connect(path)
    raw.execute("ANALYZE")  # sqlite_stat1 is SQLite's own table, not a schema change
    raw.commit()
    raw.close()
    j = open_journal(path)
    try:
        assert j.quarantined is None
        assert [r.id for r in JournalStore(j).requests()] == ["r1"]
    finally:
        j.close()


# -- core tasks: restarted, or the daemon goes down; the watchdog only while all are alive --------


def test_a_model_loop_that_dies_is_restarted_and_starves_the_watchdog_meanwhile(
        root: Path, monkeypatch: pytest.MonkeyPatch, log_lines: list[str]) -> None:
    d = _daemon(root, env={"WATCHDOG_USEC": "100000"})  # a ping due every 50 ms
    lines = log_lines
    pings: list[float] = []
    monkeypatch.setattr(d.notifier, "watchdog", lambda: pings.append(time.monotonic()))
    svc = d.services["smollm2"]
    turns: list[float] = []
    real_turn = svc._turn

    async def turn() -> None:
        turns.append(time.monotonic())
        if len(turns) == 3:
            raise RuntimeError("a bug in the model loop")
        await real_turn()

    monkeypatch.setattr(svc, "_turn", turn)

    async def scenario() -> None:
        serving = asyncio.ensure_future(d.serve())
        await _until(lambda: d.ready, 30.0, "READY")
        svc.poke()
        await asyncio.sleep(0.1)
        svc.poke()
        await _until(lambda: len(turns) >= 4, 10.0, "the model loop to run again")
        first = svc.task
        assert first is not None and not first.done()
        await asyncio.sleep(0.3)
        d.request_exit()
        assert await asyncio.wait_for(serving, 30.0) == 0

    asyncio.run(scenario())
    died, back = turns[2], turns[3]
    assert back - died >= 0.15, "restarted without a pause"
    # (a ping right before `back` is the restarted task's: created, about to run its turn)
    dead = [p for p in pings if died + 0.02 < p < back - 0.02]
    assert not dead, "watchdog fed while a core task was dead"
    assert [p for p in pings if p > back], "watchdog not fed again after the restart"
    text = "\n".join(lines)
    assert "model-smollm2" in text and "a bug in the model loop" in text and "restart" in text


def test_a_model_loop_that_keeps_dying_takes_the_daemon_down(
        root: Path, monkeypatch: pytest.MonkeyPatch, log_lines: list[str]) -> None:
    d = _daemon(root)
    lines = log_lines
    svc = d.services["smollm2"]

    async def turn() -> None:
        await asyncio.sleep(0.01)
        raise RuntimeError("always broken")

    monkeypatch.setattr(svc, "_turn", turn)

    async def scenario() -> int:
        return await asyncio.wait_for(d.serve(), 60.0)

    assert asyncio.run(scenario()) == 1
    fatal = [ln for ln in lines if "always broken" in ln and "Hint:" in ln]
    assert fatal, lines


def test_a_memory_guard_callback_that_raises_takes_the_daemon_down(
        root: Path, monkeypatch: pytest.MonkeyPatch, log_lines: list[str]) -> None:
    d = _daemon(root)
    lines = log_lines

    def broken(now: float, still_high: bool = False) -> None:
        raise RuntimeError("stage bookkeeping broke")

    async def scenario() -> int:
        serving = asyncio.ensure_future(d.serve())
        await _until(lambda: d.ready, 30.0, "READY")
        monkeypatch.setattr(d.memory.stages, "tick", broken)
        asyncio.get_running_loop().call_soon(d.memory._tick)  # a release timer firing
        try:
            return await asyncio.wait_for(asyncio.shield(serving), 10.0)
        finally:
            if not serving.done():
                d.request_exit()
                with contextlib.suppress(Exception):
                    await serving

    assert asyncio.run(scenario()) == 1
    assert any("memory guard" in ln and "stage bookkeeping broke" in ln for ln in lines), lines
