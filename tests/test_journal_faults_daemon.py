"""Faults the real `edge-agent serve` must survive (subprocesses, the tiny model):

- the journal's file system fills up while a request runs (a real tmpfs): /health says
  degraded, new requests get 507 at once, the running one pauses and then completes with the
  same text as an uninterrupted run once space returns, without a restart;
- a damaged journal of every kind is started on three times in a row and each start serves
  (never a crash loop);
- a second daemon on the same state directory exits 75 naming the holder, and leaves the first
  one's work alone.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sqlite3
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from journal_harness import (
    journal_tokens,
    kill,
    link_prepared,
    references,
    start,
    tiny_gguf,
    wait_done,
    write_config,
)
from test_journal_faults import fill

from edge_agent.journal import JournalStore, open_journal
from edge_agent.protocol.api import parse_generation

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

CONTEXT = 512


@pytest.fixture(scope="module")
def shared(prepared_state_dir: Path) -> Iterator[dict[str, Any]]:
    base = Path(tempfile.mkdtemp(prefix="ea-jf-", dir="/tmp"))
    state = base / "state"
    link_prepared(prepared_state_dir, state)
    tiny = tiny_gguf(base / "tiny.gguf")
    yield {"base": base, "state": state, "tiny": tiny}
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def root(shared: dict[str, Any]) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="run-", dir=shared["base"]))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _post(d: Any, body: dict[str, Any]) -> tuple[int, dict[str, str], Any]:
    import json

    status, headers, data = d.call("POST", "/v1/requests", body)
    return status, headers, json.loads(data)


# -- disk full -------------------------------------------------------------------------------------


@pytest.fixture
def journal_fs(root: Path) -> Iterator[Path]:
    mnt = root / "jfs"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs on {mnt}: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_disk_full_pauses_and_the_daemon_serves_again_by_itself(
        root: Path, shared: dict[str, Any], journal_fs: Path) -> None:
    state, tiny = shared["state"], shared["tiny"]
    prompt, max_tokens = "Once upon a time", 300
    ref_ids, ref_text = references(tiny, state, [prompt], max_tokens, CONTEXT)[prompt]
    assert len(ref_ids) > 60, "the reference must run long enough to be paused"
    cfg = write_config(root, state, {"tiny": (tiny, True)}, context=CONTEXT)
    journal = journal_fs / "journal.sqlite3"
    cfg.write_text(cfg.read_text().replace(str(root / "journal.sqlite3"), str(journal)))
    d = start(root)
    try:
        pid = d.health()["pid"]
        filler = fill(journal_fs)
        os.truncate(filler, max(0, filler.stat().st_size - 96 * 1024))  # room for ~20 steps
        status, _, body = _post(d, {"model": "tiny", "prompt": prompt, "temperature": 0,
                                    "max_tokens": max_tokens})
        assert status == 202, body
        rid = body["id"]
        end = time.monotonic() + 60
        while True:  # the request fills the file system itself
            status, h = d.json("GET", "/health")
            if h["status"] == "degraded":
                break
            assert time.monotonic() < end, f"never degraded: {h}"
            time.sleep(0.05)
        assert status == 503 and any("full" in r for r in h["degraded"]), h
        assert h["journal"]["fault"] is not None
        t0 = time.monotonic()
        status, headers, body = _post(d, {"model": "tiny", "prompt": "Hi", "max_tokens": 4})
        assert time.monotonic() - t0 < 2.0, "a new request must be refused at once"
        assert status == 507 and body["error"]["code"] == "journal_unavailable", body
        assert "full" in body["error"]["message"] and "Hint:" in body["error"]["message"]
        assert int(headers["retry-after"]) >= 1
        status, paused = d.json("GET", f"/v1/requests/{rid}")
        assert paused["state"] == "running" and 0 < paused["completion_tokens"] < len(ref_ids)
        time.sleep(1.0)
        status, still = d.json("GET", f"/v1/requests/{rid}")
        assert still["completion_tokens"] == paused["completion_tokens"], "not paused"
        filler.unlink()
        result = wait_done(d, [rid], 120)[rid]
        assert result["state"] == "done" and result["text"] == ref_text
        h = d.health()
        assert h["status"] == "serving" and h["pid"] == pid and h["journal"]["fault"] is None
        status, _, body = _post(d, {"model": "tiny", "prompt": "Hi", "temperature": 0,
                                    "max_tokens": 4})
        assert status == 202, body
        assert wait_done(d, [body["id"]], 60)[body["id"]]["state"] == "done"
    finally:
        kill(d)
    assert journal_tokens(journal)[rid] == ref_ids  # every token journaled, none changed
    log = (root / "daemon.log").read_text()
    assert "Traceback" not in log, log[-3000:]
    assert "writable again" in log


# -- damaged journals: three starts each, every one serves -----------------------------------------


def _damage(path: Path, kind: str) -> None:
    if kind in ("missing table", "missing column", "user_version 0", "user_version 1"):
        sql = {"missing table": "DROP TABLE tokens",
               "missing column": "ALTER TABLE tokens DROP COLUMN text_offset",
               "user_version 0": "PRAGMA user_version = 0",
               "user_version 1": "PRAGMA user_version = 1"}[kind]
        raw = sqlite3.connect(path)
        raw.execute(sql)
        raw.commit()
        raw.close()
    elif kind == "garbage bytes":
        path.write_bytes(bytes((i * 131 + 7) % 251 for i in range(64 * 1024)))
    elif kind == "truncated file":
        size = path.stat().st_size
        with open(path, "r+b") as fh:
            fh.truncate(size // 2)
    elif kind == "zero-length file":
        path.write_bytes(b"")
    else:
        raise AssertionError(kind)


KINDS = ["missing table", "missing column", "user_version 0", "user_version 1",
         "garbage bytes", "truncated file", "zero-length file"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_damaged_journal_never_makes_a_crash_loop(root: Path, shared: dict[str, Any],
                                                    kind: str) -> None:
    state, tiny = shared["state"], shared["tiny"]
    write_config(root, state, {"tiny": (tiny, False)}, context=CONTEXT)
    journal = root / "journal.sqlite3"
    store = JournalStore(open_journal(journal))
    greq = parse_generation({"prompt": "x" * 100, "max_tokens": 16, "temperature": 0},
                            chat=False, max_tokens_limit=64)
    req = dataclasses.asdict(greq)
    for i in range(200):  # open requests (what made every start die) over many pages
        store.add_request(id=f"old-{i}", model="tiny", input=req, prompt_ids=[1, 2, 3],
                          params=greq.sampling_dict(i))
        store.append_tokens([(f"old-{i}", k, 100 + k, k) for k in range(10)],
                            running=[f"old-{i}"])
    store.checkpoint()
    store.close()
    for side in ("-wal", "-shm"):
        Path(str(journal) + side).unlink(missing_ok=True)
    _damage(journal, kind)
    quarantined = []
    for n in range(3):
        d = start(root, timeout=60)
        try:
            status, h = d.json("GET", "/health")
            assert (status, h["status"]) == (200, "serving"), f"start {n + 1}: {h}"
            quarantined.append(h["journal"]["quarantined"] is not None)
            if n == 2:  # and it does generate
                status, _, body = _post(d, {"model": "tiny", "prompt": "Hi",
                                            "temperature": 0, "max_tokens": 4})
                assert status == 202, body
                assert wait_done(d, [body["id"]], 60)[body["id"]]["state"] == "done"
        finally:
            kill(d)
    expected = kind not in ("zero-length file",)  # an empty file is simply a new journal
    assert quarantined == [expected, False, False], quarantined
    moved = sorted(root.glob("journal.sqlite3.corrupt-*"))
    assert len([m for m in moved if not m.name.endswith(("-wal", "-shm"))]) == int(expected)


# -- one daemon per state directory ----------------------------------------------------------------


def test_a_second_daemon_on_the_same_state_dir_exits_75(root: Path,
                                                         shared: dict[str, Any]) -> None:
    state, tiny = shared["state"], shared["tiny"]
    cfg = write_config(root, state, {"tiny": (tiny, False)}, context=CONTEXT)
    other = root / "b"
    other.mkdir()
    (other / "config.toml").write_text(
        cfg.read_text().replace(str(root / "ea.sock"), str(other / "ea.sock")))
    a = start(root)
    try:
        b = start(other, wait_ready=False)
        try:
            rc = b.proc.wait(60)
        finally:
            kill(b)
        log = (other / "daemon.log").read_text()
        assert rc == 75, log
        assert f"pid {a.proc.pid}" in log and str(state) in log and "Hint:" in log, log
        assert not (other / "ea.sock").exists()
        assert a.health()["status"] == "serving"  # the first one is untouched
    finally:
        kill(a)
    b = start(other)  # the holder died (SIGKILL): its lock went with it
    try:
        assert b.health()["status"] == "serving"
    finally:
        kill(b)
