"""Opening the journal: durability pragmas on every open, migrations, corrupt files quarantined."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import pytest
from journal_harness import fill_journal

from edge_agent.errors import EXIT_CONFIG
from edge_agent.journal import (
    MIGRATIONS,
    JournalError,
    JournalMissingError,
    JournalStore,
    JournalVersionError,
    Migrations,
    check_integrity,
    open_journal,
)


def test_every_open_sets_wal_and_synchronous_full(tmp_path: Path) -> None:
    path = tmp_path / "j.sqlite3"
    for _ in range(2):
        j = open_journal(path)
        assert j.pragma("journal_mode") == "wal"
        assert j.pragma("synchronous") == 2  # FULL
        assert j.pragma("foreign_keys") == 1
        assert j.synchronous == "FULL"
        assert j.schema_version == MIGRATIONS.latest
        j.close()
    # SQLite does not persist `synchronous`: a plain connection in WAL mode gets the default,
    # which is why open_journal issues it every time.
    raw = sqlite3.connect(path)
    raw.execute("PRAGMA synchronous=OFF")
    raw.close()
    j = open_journal(path)
    assert j.pragma("synchronous") == 2
    j.close()


def test_synchronous_is_configurable_and_checked(tmp_path: Path) -> None:
    j = open_journal(tmp_path / "j.sqlite3", synchronous="normal")
    assert j.pragma("synchronous") == 1 and j.synchronous == "NORMAL"
    j.close()
    with pytest.raises(JournalError) as err:
        open_journal(tmp_path / "j.sqlite3", synchronous="fast")
    msg = str(err.value)
    assert "'fast' is not one of OFF, NORMAL, FULL, EXTRA" in msg and "Hint: use FULL" in msg


def test_injectable_connection_and_tracer(tmp_path: Path) -> None:
    made: list[str] = []
    traced: list[str] = []

    def connect(p: str) -> sqlite3.Connection:
        made.append(p)
        return sqlite3.connect(p, isolation_level=None)

    j = open_journal(tmp_path / "j.sqlite3", connect=connect,
                     tracer=lambda sql, params: traced.append(sql))
    assert made == [str(tmp_path / "j.sqlite3")]
    assert j.db.conn is j.conn
    assert j.pragma("synchronous") == 2
    list(j.db.query("SELECT 1"))
    assert "SELECT 1" in traced
    j.close()


def test_bad_check_option(tmp_path: Path) -> None:
    with pytest.raises(JournalError, match="journal check 'slow' is not quick, full or none"):
        open_journal(tmp_path / "j.sqlite3", check="slow")


def test_unwritable_directory(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(JournalError) as err:
        open_journal(tmp_path / "file" / "sub" / "j.sqlite3")
    assert "cannot create it" in str(err.value) and "Hint:" in str(err.value)


def _assert_quarantined(tmp_path: Path, path: Path, original: bytes, reason: str) -> None:
    j = open_journal(path, now=lambda: 1_800_000_000.0)
    event = j.quarantined
    assert event is not None
    assert reason in event.reason
    moved = Path(event.moved_to)
    assert moved.name == "j.sqlite3.corrupt-20270115T080000Z"
    assert moved.read_bytes() == original  # kept as it was, for inspection
    assert check_integrity(j.conn, full=True) == []
    store = JournalStore(j)
    assert store.requests() == []
    (ev,) = store.events()
    assert ev["kind"] == "quarantine" and str(moved) in ev["message"]
    assert "Hint:" in event.message()
    assert event.to_dict()["moved_to"] == str(moved)
    j.close()
    # the new file is healthy: a second open quarantines nothing
    again = open_journal(path)
    assert again.quarantined is None
    again.close()


def test_garbage_file_is_quarantined(tmp_path: Path) -> None:
    path = tmp_path / "j.sqlite3"
    garbage = bytes(range(256)) * 40
    path.write_bytes(garbage)
    _assert_quarantined(tmp_path, path, garbage, "file is not a database")


def test_truncated_file_is_quarantined(tmp_path: Path) -> None:
    path = tmp_path / "j.sqlite3"
    fill_journal(path)
    data = path.read_bytes()[: os.path.getsize(path) // 2]
    path.write_bytes(data)
    _assert_quarantined(tmp_path, path, data, "malformed")


def test_damaged_page_is_quarantined(tmp_path: Path) -> None:
    path = tmp_path / "j.sqlite3"
    fill_journal(path)
    raw = sqlite3.connect(path)
    root = raw.execute("SELECT rootpage FROM sqlite_master WHERE name = 'tokens'").fetchone()[0]
    page_size = raw.execute("PRAGMA page_size").fetchone()[0]
    raw.close()
    with open(path, "r+b") as fh:  # scribble over the tokens table's root b-tree page header
        fh.seek((root - 1) * page_size)
        fh.write(b"\xa5" * 64)
    _assert_quarantined(tmp_path, path, path.read_bytes(), "malformed")


def test_damaged_cells_found_by_quick_check(tmp_path: Path) -> None:
    path = tmp_path / "j.sqlite3"
    fill_journal(path)
    with open(path, "r+b") as fh:  # a page's cell area, header intact: only a check finds it
        fh.seek(4096 * 5 + 100)
        fh.write(bytes((i * 37 + 11) % 256 for i in range(3000)))
    data = path.read_bytes()
    _assert_quarantined(tmp_path, path, data, "quick_check")


def test_wal_moves_with_the_file(tmp_path: Path) -> None:
    path = tmp_path / "j.sqlite3"
    path.write_bytes(b"not sqlite at all" * 100)
    (tmp_path / "j.sqlite3-wal").write_bytes(b"wal")
    (tmp_path / "j.sqlite3-shm").write_bytes(b"shm")
    j = open_journal(path)
    assert j.quarantined is not None
    moved = Path(j.quarantined.moved_to)
    assert Path(str(moved) + "-wal").read_bytes() == b"wal"
    # (-shm is only an index of the -wal, rebuilt from it; SQLite may drop it on close)
    assert not (tmp_path / "j.sqlite3-wal.found").exists()
    j.close()


def test_second_quarantine_same_second_gets_a_new_name(tmp_path: Path) -> None:
    path = tmp_path / "j.sqlite3"
    names = set()
    for _ in range(2):
        path.write_bytes(b"\x00garbage" * 600)
        j = open_journal(path, now=lambda: 1_800_000_000.0)
        assert j.quarantined is not None
        names.add(j.quarantined.moved_to)
        j.close()
    assert len(names) == 2


def test_corrupt_file_with_raise_policy_is_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "j.sqlite3"
    path.write_bytes(b"garbage!" * 600)
    with pytest.raises(JournalError) as err:
        open_journal(path, on_corrupt="raise")
    assert "is corrupt (file is not a database)" in str(err.value)
    assert "Hint: stop the daemon and start it again" in str(err.value)
    assert path.read_bytes() == b"garbage!" * 600
    assert [p.name for p in tmp_path.iterdir()] == ["j.sqlite3"]


def test_fresh_file_failing_too_is_an_error_not_a_loop(tmp_path: Path) -> None:
    path = tmp_path / "j.sqlite3"
    path.write_bytes(b"garbage!" * 600)
    calls = []

    def connect(p: str) -> sqlite3.Connection:
        calls.append(p)
        Path(p).write_bytes(b"garbage!" * 600)  # storage that keeps returning garbage
        return sqlite3.connect(p, isolation_level=None)

    with pytest.raises(JournalError) as err:
        open_journal(path, connect=connect)
    assert len(calls) == 2
    assert "a freshly started journal failed too" in str(err.value)
    assert "Hint: check the storage device" in str(err.value)


def test_newer_schema_is_refused_and_untouched(tmp_path: Path) -> None:
    path = tmp_path / "j.sqlite3"
    open_journal(path).close()
    raw = sqlite3.connect(path)
    raw.execute(f"PRAGMA user_version={MIGRATIONS.latest + 5}")
    raw.close()
    before = path.read_bytes()
    with pytest.raises(JournalVersionError) as err:
        open_journal(path)
    assert err.value.exit_code == EXIT_CONFIG
    assert f"schema version {MIGRATIONS.latest + 5}" in str(err.value)
    assert "left untouched" in str(err.value) and "Hint:" in str(err.value)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir() if "corrupt" in p.name) == []


def test_readonly_open(tmp_path: Path) -> None:
    path = tmp_path / "j.sqlite3"
    with pytest.raises(JournalMissingError) as err:
        open_journal(path, readonly=True)
    assert f"no journal at {path}" in str(err.value) and "Hint:" in str(err.value)
    assert not path.exists()
    fill_journal(path, 3)
    j = open_journal(path, readonly=True)
    assert j.readonly
    assert JournalStore(j).get_request("r1") is not None
    with pytest.raises(sqlite3.OperationalError, match="readonly|query_only"):
        j.conn.execute("DELETE FROM requests")
    j.close()


def test_migrations_registry_is_ordered_and_atomic(tmp_path: Path) -> None:
    reg = Migrations()

    @reg(1)
    def one(db):
        db.execute("CREATE TABLE a (x INTEGER)")

    @reg(2)
    def two(db):
        db.execute("CREATE TABLE b (x INTEGER)")
        raise RuntimeError("boom")

    with pytest.raises(ValueError, match="migration 2 registered twice"):
        reg(2)(one)
    with pytest.raises(ValueError, match="migration 4 out of order; next is 3"):
        reg(4)(one)
    assert reg.names() == ["0001_one", "0002_two"]
    with pytest.raises(RuntimeError, match="boom"):
        open_journal(tmp_path / "j.sqlite3", migrations=reg)
    raw = sqlite3.connect(tmp_path / "j.sqlite3")
    assert raw.execute("PRAGMA user_version").fetchone()[0] == 1  # whole version, not between
    tables = {r[0] for r in raw.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert "a" in tables and "b" not in tables
    raw.close()


def test_transaction_rolls_back_on_error(tmp_path: Path) -> None:
    j = open_journal(tmp_path / "j.sqlite3")
    with pytest.raises(RuntimeError), j.transaction() as conn:
        conn.execute("INSERT INTO events (at, kind, message) VALUES (1, 'k', 'm')")
        raise RuntimeError
    assert j.conn.execute("SELECT count(*) FROM events").fetchone()[0] == 0
    with j.transaction(), pytest.raises(JournalError, match="already open"), j.transaction():
        pass
    j.close()


def test_journal_files_are_private_whatever_the_umask(tmp_path: Path) -> None:
    """0600 at creation (SQLite gives -wal and -shm the main file's mode), also for the fresh
    file after a quarantine; an existing file readable by others loses that."""
    old = os.umask(0o022)
    try:
        path = tmp_path / "j.sqlite3"
        store = JournalStore(open_journal(path))
        store.add_request(id="a", model="m", input={}, prompt_ids=[1], params={})
        for p in (path, tmp_path / "j.sqlite3-wal", tmp_path / "j.sqlite3-shm"):
            assert p.stat().st_mode & 0o777 == 0o600, p
        store.close()
        os.chmod(path, 0o644)
        open_journal(path).close()
        assert path.stat().st_mode & 0o777 == 0o640  # other bits gone, group kept
        bad = tmp_path / "bad.sqlite3"
        bad.write_bytes(b"not a database at all" * 100)
        j = open_journal(bad)  # quarantined, a fresh file started
        assert j.quarantined is not None and bad.stat().st_mode & 0o777 == 0o600
        j.close()
    finally:
        os.umask(old)
