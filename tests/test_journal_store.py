"""The journal store on real SQLite files: requests, group-committed tokens, sessions, caches."""

from __future__ import annotations

from pathlib import Path

import pytest

from edge_agent.journal import (
    JournalConflictError,
    JournalError,
    JournalStore,
    check_integrity,
    open_journal,
)


def _add(store: JournalStore, rid: str, **kw: object) -> None:
    args: dict = {"model": "smollm2", "input": {"prompt": "hi"}, "prompt_ids": [1, 2, 3],
                  "params": {"seed": 2**64 - 1, "temperature": 0.0}}
    args.update(kw)
    store.add_request(id=rid, **args)


def test_request_round_trip_survives_reopen(tmp_path: Path, store: JournalStore) -> None:
    _add(store, "a", session="s1", priority=9, deadline=2000.5,
         input={"messages": [{"role": "user", "content": "héllo ✓"}]})
    store.close()
    again = JournalStore(open_journal(tmp_path / "j.sqlite3"))
    req = again.get_request("a")
    assert req is not None
    assert req.input == {"messages": [{"role": "user", "content": "héllo ✓"}]}
    assert req.prompt_ids == [1, 2, 3]
    assert req.params["seed"] == 2**64 - 1  # beyond SQLite's int64: kept exactly in JSON
    assert (req.session, req.priority, req.deadline, req.state) == ("s1", 9, 2000.5, "queued")
    assert req.created_at == 1000.0 and req.attempts == 0 and not req.finished
    assert again.get_request("missing") is None
    again.close()


def test_duplicate_and_bad_state(store: JournalStore) -> None:
    _add(store, "a")
    with pytest.raises(JournalConflictError, match="request a: already journaled. Hint:"):
        _add(store, "a")
    with pytest.raises(JournalError, match="cannot be added in state 'done'"):
        _add(store, "b", state="done")


def test_lifecycle_and_state_rules(store: JournalStore) -> None:
    _add(store, "a")
    store.set_running(["a"], now=1001.0)
    store.requeue(["a"])
    store.set_running(["a"], now=1002.0)
    req = store.get_request("a")
    assert req is not None and req.state == "running" and req.attempts == 2
    assert req.started_at == 1001.0
    store.finish("a", "done", finish_reason="stop", now=1003.0)
    req = store.get_request("a")
    assert req is not None and (req.state, req.finished_at, req.finish_reason) == (
        "done", 1003.0, "stop")
    with pytest.raises(JournalConflictError, match="cannot finish as failed: it is already done"):
        store.finish("a", "failed", error="x")
    with pytest.raises(JournalConflictError, match="cannot start: it is not journaled"):
        store.set_running(["nope"])
    with pytest.raises(JournalError, match="'running' is not a final state"):
        store.finish("a", "running")


def test_append_tokens_is_one_transaction_per_step(store: JournalStore) -> None:
    ids = [f"r{i}" for i in range(8)]
    for rid in ids:
        _add(store, rid)
    statements: list[str] = []
    store.conn.set_trace_callback(statements.append)
    for step in range(5):
        n = store.append_tokens([(rid, step, 100 + step, step * 3) for rid in ids])
        assert n == 8
    store.conn.set_trace_callback(None)
    # one BEGIN and one COMMIT per decode step for all 8 sequences: group commit
    assert sum(s.startswith("BEGIN") for s in statements) == 5
    assert sum(s == "COMMIT" for s in statements) == 5
    assert [t.token_id for t in store.tokens("r3")] == [100, 101, 102, 103, 104]
    assert store.text_offset("r3") == 12 and store.token_count("r3") == 5
    assert [t.index for t in store.tokens("r3", start=3)] == [3, 4]


def test_finish_in_the_same_step(store: JournalStore) -> None:
    _add(store, "a")
    _add(store, "b")
    store.append_tokens([("a", 0, 5, 1), ("b", 0, 6, 1)],
                        finish=[("a", "done", None, "length")], now=1005.0)
    a, b = store.get_request("a"), store.get_request("b")
    assert a is not None and b is not None
    assert (a.state, a.finished_at) == ("done", 1005.0) and b.state == "queued"
    with pytest.raises(JournalConflictError, match="request a is already done; its tokens"):
        store.append_tokens([("a", 1, 7, 2)])


def test_step_marks_started_requests_running(store: JournalStore) -> None:
    _add(store, "a")
    _add(store, "gone")
    store.finish("gone", "cancelled")
    store.append_tokens([("a", 0, 5, 1)], running=["a", "gone"], now=1001.0)
    a, gone = store.get_request("a"), store.get_request("gone")
    assert a is not None and (a.state, a.attempts, a.started_at) == ("running", 1, 1001.0)
    assert gone is not None and gone.state == "cancelled"  # a finished request stays finished


def test_journaled_tokens_never_change(store: JournalStore) -> None:
    _add(store, "a")
    _add(store, "b")
    store.append_tokens([("a", 0, 5, 1), ("a", 1, 6, 2)])
    # a replay of the same tokens is accepted and ignored
    assert store.append_tokens([("a", 0, 5, 1), ("a", 1, 6, 2), ("a", 2, 7, 3)]) == 1
    with pytest.raises(JournalConflictError) as err:
        store.append_tokens([("b", 0, 1, 1), ("a", 1, 99, 2)])
    msg = str(err.value)
    assert "request a token 1 is journaled as 6, the step sends 99" in msg and "Hint:" in msg
    # the whole step was rolled back: b's token is not there either
    assert store.tokens("b") == []
    with pytest.raises(JournalConflictError, match="token 5 leaves a gap \\(next index is 3\\)"):
        store.append_tokens([("a", 5, 1, 9)])
    with pytest.raises(JournalConflictError, match="request ghost is not journaled"):
        store.append_tokens([("ghost", 0, 1, 1)])
    assert [t.token_id for t in store.tokens("a")] == [5, 6, 7]
    assert store.append_tokens([]) == 0


def test_sessions(store: JournalStore) -> None:
    assert store.get_session("s") is None
    store.save_session("s", "smollm2", [1, 2, 3], now=10.0)
    store.save_session("s", "smollm2", [1, 2, 3, 4, 5], now=20.0)
    s = store.get_session("s")
    assert s is not None
    assert (s.history, s.turns, s.created_at, s.updated_at) == ([1, 2, 3, 4, 5], 2, 10.0, 20.0)
    assert (s.tools, s.calls) == (None, {})
    store.save_session("s", "smollm2", [1, 2, 3, 4, 5, 6], now=30.0, tools='[{"name": "f"}]',
                       calls={"call_1_0": "f", "call_2_0": "f"})
    s = store.get_session("s")
    assert s is not None and (s.turns, s.tools, s.calls) == (
        3, '[{"name": "f"}]', {"call_1_0": "f", "call_2_0": "f"})
    assert store.delete_session("s") and not store.delete_session("s")


def test_models_registry(store: JournalStore) -> None:
    store.record_model("smollm2", path="/m.gguf", sha256="ab" * 32, size=10, mtime_ns=5)
    store.record_model("smollm2", last_load_at=50.0, last_load_s=1.5)
    store.record_model("smollm2", last_failure="oom", last_failure_at=60.0)
    m = store.get_model("smollm2")
    assert m is not None
    assert (m["sha256"], m["size"], m["last_load_s"], m["last_failure"]) == (
        "ab" * 32, 10, 1.5, "oom")
    assert [x["name"] for x in store.models()] == ["smollm2"]
    assert store.get_model("other") is None
    with pytest.raises(JournalError, match="unknown registry fact\\(s\\) colour. Hint: use"):
        store.record_model("smollm2", colour="red")


def test_flash_jobs(store: JournalStore) -> None:
    job = store.flash.create("cd" * 32, "stm32f405", "/dev/ttyUSB0",
                             [(0, 0x08000000, 16384), (1, 0x08004000, 16384)])
    store.flash.mark(job, [0, 1], "erased")
    store.flash.mark(job, [0], "verified")
    got = store.flash.resumable("cd" * 32, "stm32f405", "/dev/ttyUSB0")
    assert got is not None and got.id == job
    assert [(s.sector, s.address, s.state) for s in got.sectors] == [
        (0, 0x08000000, "verified"), (1, 0x08004000, "erased")]
    assert got.count("erased") == 1
    with pytest.raises(JournalConflictError, match="sector 0 is verified, cannot go back to "
                       "erased"):
        store.flash.mark(job, [0], "erased")
    with pytest.raises(JournalConflictError, match="sector 7 is not part of the job"):
        store.flash.mark(job, [7], "written")
    with pytest.raises(JournalError, match="sector state 'shiny' is not one of"):
        store.flash.mark(job, [1], "shiny")
    store.flash.finish(job, "done")
    assert store.flash.resumable("cd" * 32, "stm32f405", "/dev/ttyUSB0") is None
    with pytest.raises(JournalConflictError, match="not running"):
        store.flash.finish(job, "failed")
    with pytest.raises(JournalError, match="final state 'ok' is not done or failed"):
        store.flash.finish(job, "ok")
    assert store.flash.get(999) is None


def test_prune_by_age_and_count_keeps_open_requests(store: JournalStore) -> None:
    for i in range(30):
        _add(store, f"f{i}")
        store.append_tokens([(f"f{i}", k, k, k) for k in range(50)])
        store.finish(f"f{i}", "done", now=float(i))
    _add(store, "open")
    store.append_tokens([("open", 0, 1, 1)])
    res = store.prune(max_age_s=10.0, now=30.0)  # finished before t=20 go
    assert res.requests == 20
    res = store.prune(max_finished=4, now=30.0)
    assert res.requests == 6
    left = sorted(r.id for r in store.requests())
    assert left == ["f26", "f27", "f28", "f29", "open"]
    # tokens of pruned requests went with them (foreign key cascade)
    assert store.conn.execute("SELECT count(*) FROM tokens").fetchone()[0] == 4 * 50 + 1
    store.save_session("old", "m", [1], now=0.0)
    store.save_session("new", "m", [1], now=29.0)
    assert store.prune(session_max_age_s=5.0, now=30.0).sessions == 1
    assert check_integrity(store.conn, full=True) == []


def test_file_size_stays_bounded_under_retention(tmp_path: Path) -> None:
    store = JournalStore(open_journal(tmp_path / "j.sqlite3"))
    sizes = []
    for rnd in range(6):
        for i in range(40):
            rid = f"r{rnd}-{i}"
            _add(store, rid)
            store.append_tokens([(rid, k, k, k) for k in range(100)])
            store.finish(rid, "done")
        store.prune(max_finished=40)
        store.checkpoint()
        sizes.append(store.file_bytes())
    assert max(sizes[2:]) <= sizes[1] * 1.2, sizes  # freed pages are reused / returned
    before, after = store.vacuum()
    assert after <= before
    stats = store.stats()
    assert stats["requests"]["done"] == 40 and stats["synchronous"] == "FULL"
    store.close()


def test_events_and_export(store: JournalStore) -> None:
    store.record_event("note", "hello", now=5.0)
    assert store.events()[0]["message"] == "hello"
    _add(store, "a")
    store.append_tokens([("a", 0, 9, 2)])
    (row,) = list(store.export())
    assert row["id"] == "a" and row["tokens"] == [9] and row["text_offset"] == 2
    assert list(store.export(["done"])) == []
