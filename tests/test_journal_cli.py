"""`edge-agent journal stats|tail|export|vacuum` on real journal files."""

from __future__ import annotations

import json
import os
import sqlite3
import time
from pathlib import Path

import pytest

from edge_agent.cli import main
from edge_agent.journal import JournalStore, open_journal


def _journal(state: Path) -> Path:
    path = state / "journal.sqlite3"
    store = JournalStore(open_journal(path))
    for i in range(5):
        rid = f"req-{i}"
        store.add_request(id=rid, model="smollm2", input={"prompt": "p"}, prompt_ids=[1, 2],
                          params={"seed": i}, now=100.0 + i)
        store.append_tokens([(rid, k, 10 + k, k + 1) for k in range(3)])
        if i < 4:
            store.finish(rid, "done" if i else "failed", error=None if i else "runner died",
                         finish_reason="length" if i else None, now=200.0 + i)
    store.close()
    return path


def test_stats_json_and_text(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _journal(tmp_path)
    assert main(["--state-dir", str(tmp_path), "journal", "stats", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["requests"]["done"] == 3 and stats["requests"]["failed"] == 1
    assert stats["requests"]["queued"] == 1 and stats["tokens"] == 15
    assert stats["journal_mode"] == "wal"
    assert main(["--state-dir", str(tmp_path), "journal", "stats"]) == 0
    out = capsys.readouterr().out
    assert "done 3" in out and "tokens         15" in out


def test_the_daemons_configured_journal_is_the_one_read(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    # server.state_dir and journal.path from the configuration (here its environment layer)
    # name the daemon's journal; the CLI used to read STATE_DIR's by the paths rule only
    for key in [k for k in os.environ if k.startswith("EDGE_AGENT_")]:
        monkeypatch.delenv(key)
    monkeypatch.chdir(tmp_path)
    state = tmp_path / "state"
    _journal(state)
    monkeypatch.setenv("EDGE_AGENT_SERVER__STATE_DIR", str(state))
    assert main(["journal", "stats", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["path"] == str(state / "journal.sqlite3")
    elsewhere = tmp_path / "elsewhere"
    _journal(elsewhere)
    (elsewhere / "journal.sqlite3").rename(tmp_path / "j.sqlite3")
    monkeypatch.setenv("EDGE_AGENT_JOURNAL__PATH", str(tmp_path / "j.sqlite3"))
    assert main(["journal", "stats", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["path"] == str(tmp_path / "j.sqlite3")
    # --journal still wins, and --state-dir wins over server.state_dir (not over journal.path)
    assert main(["journal", "--journal", str(state / "journal.sqlite3"), "stats", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["path"] == str(state / "journal.sqlite3")
    monkeypatch.delenv("EDGE_AGENT_JOURNAL__PATH")
    other = tmp_path / "other"
    _journal(other)
    assert main(["--state-dir", str(other), "journal", "stats", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["path"] == str(other / "journal.sqlite3")


def test_tail(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _journal(tmp_path)
    assert main(["journal", "--journal", str(path), "tail", "-n", "2", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["id"] for r in rows] == ["req-4", "req-3"]
    assert rows[0]["tokens"] == 3 and rows[0]["state"] == "queued"
    assert main(["journal", "--journal", str(path), "tail", "-n", "5"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 5 and "error: runner died" in out[-1]
    assert main(["journal", "--journal", str(path), "tail", "-n", "0"]) == 2
    assert "-n 0 must be at least 1" in capsys.readouterr().err


def test_export(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _journal(tmp_path)
    assert main(["journal", "--journal", str(path), "export", "--state", "done"]) == 0
    captured = capsys.readouterr()
    rows = [json.loads(line) for line in captured.out.splitlines()]
    assert [r["id"] for r in rows] == ["req-1", "req-2", "req-3"]
    assert rows[0]["tokens"] == [10, 11, 12] and rows[0]["text_offset"] == 3
    assert "exported 3 request(s)" in captured.err
    assert main(["journal", "--journal", str(path), "export", "--state", "bogus"]) == 2
    assert "unknown state 'bogus'. Hint: use one of queued" in capsys.readouterr().err


def test_vacuum(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _journal(tmp_path)
    assert main(["journal", "--journal", str(path), "vacuum", "--keep", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["pruned_requests"] == 3 and result["bytes_after"] <= result["bytes_before"]
    store = JournalStore(open_journal(path, readonly=True))
    assert sorted(r.id for r in store.requests()) == ["req-3", "req-4"]
    store.close()
    assert main(["journal", "--journal", str(path), "vacuum", "--max-age", "-1"]) == 2
    assert "--max-age -1.0 must be >= 0" in capsys.readouterr().err


def test_vacuum_forgets_idle_sessions(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _journal(tmp_path)
    store = JournalStore(open_journal(path))
    store.save_session("old", "smollm2", [1, 2], now=1000.0)
    store.save_session("new", "smollm2", [3], now=time.time())
    store.close()
    assert main(["journal", "--journal", str(path), "vacuum", "--session-max-age", "3600"]) == 0
    out = capsys.readouterr().out
    assert "pruned 0 finished request(s) and 1 session(s)" in out
    store = JournalStore(open_journal(path, readonly=True))
    assert store.get_session("old") is None and store.get_session("new") is not None
    store.close()
    assert main(["journal", "--journal", str(path), "vacuum", "--session-max-age", "-5"]) == 2
    assert "--session-max-age -5.0 must be >= 0" in capsys.readouterr().err


def test_missing_and_corrupt_journal(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.sqlite3"
    for action in ("stats", "vacuum"):
        assert main(["journal", "--journal", str(missing), action]) == 1
        err = capsys.readouterr().err
        assert f"no journal at {missing}" in err and "Hint:" in err
    assert not missing.exists()  # a reader never creates the file
    bad = tmp_path / "bad.sqlite3"
    bad.write_bytes(b"garbage!" * 600)
    assert main(["journal", "--journal", str(bad), "stats"]) == 1
    assert "cannot read it (file is not a database)" in capsys.readouterr().err
    assert main(["journal", "--journal", str(bad), "vacuum"]) == 1
    assert "is corrupt" in capsys.readouterr().err
    assert bad.read_bytes() == b"garbage!" * 600  # the CLI never moves a file aside
    # an empty file, or another program's SQLite database, is not read or written as a journal
    empty = tmp_path / "empty.db"
    empty.touch()
    other = tmp_path / "other.db"
    db = sqlite3.connect(other)
    db.execute("CREATE TABLE notes (x)")
    db.commit()
    db.close()
    before = other.read_bytes()
    for path, what in ((empty, "no tables"), (other, "tables notes")):
        for action in ("stats", "tail", "export", "vacuum"):
            assert main(["journal", "--journal", str(path), action]) == 1, (path, action)
            err = capsys.readouterr().err
            assert f"{path} is not an edge-agent journal (SQLite schema version 0, {what})" \
                in err and "Hint: point --journal at the daemon's journal" in err, err
    assert empty.stat().st_size == 0 and other.read_bytes() == before


def test_help_lists_the_actions(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["journal", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for action in ("stats", "tail", "export", "vacuum"):
        assert action in out
