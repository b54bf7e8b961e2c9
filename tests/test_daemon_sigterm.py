"""SIGTERM keeps its promise to the clients still waiting when the drain runs out.

A real daemon (default model, journal on, `drain_timeout_s` = 1 s) with a plain and a streamed
completion still running when SIGTERM comes and still running when the drain ends:
- the plain client gets 503 `shutting_down` naming its request id (never zero bytes);
- the stream gets a final `error` event naming its id and the reason, then `data: [DONE]`, and
  the chunked body ends properly (never cut mid-chunk);
- both stay open in the journal (not `cancelled`), and the next start finishes them with the
  text an uninterrupted run gives.
With the journal off the two clients get the same kind of answer (saying it cannot resume).
Both tests run on both engines (the `engine` fixture), against their own engine's references.
"""

from __future__ import annotations

import http.client
import json
import shutil
import signal
import socket
import sqlite3
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from journal_harness import (
    ENGINES,
    kill,
    link_prepared,
    references,
    start,
    wait_done,
    write_config,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

CONTEXT = 512
# far more than 1 s of decoding on this machine, on either engine (numpy's f32 steps of two
# sequences are ~3x llama.cpp's: fewer tokens take as long, and its references cost less)
MAX_TOKENS = {"llamacpp": 160, "numpy": 80}
# both run past MAX_TOKENS on both engines (numpy ends "The capital of France is" after 29
# tokens, which a 1 s drain could see finish: the SIGTERM would then find nothing waiting)
PROMPTS = ["The history of the Roman empire", "Once upon a time"]


@pytest.fixture(scope="module", params=ENGINES)
def engine(request: pytest.FixtureRequest) -> str:
    """The engine of the daemons (and of the references) of every test here."""
    return str(request.param)


@pytest.fixture(scope="module")
def shared(prepared_state_dir: Path) -> Iterator[dict[str, Any]]:
    base = Path(tempfile.mkdtemp(prefix="ea-st-", dir="/tmp"))
    state = base / "state"
    link_prepared(prepared_state_dir, state)
    yield {"base": base, "state": state}
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def root(shared: dict[str, Any]) -> Path:
    return Path(tempfile.mkdtemp(prefix="run-", dir=shared["base"]))


class _Unix(http.client.HTTPConnection):
    def __init__(self, path: Path) -> None:
        super().__init__("localhost", timeout=60)
        self.path = str(path)

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(60)
        self.sock.connect(self.path)


def _plain(sock: Path, out: dict[str, Any], max_tokens: int) -> None:
    conn = _Unix(sock)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps({
            "model": "smollm2", "prompt": PROMPTS[0], "temperature": 0,
            "max_tokens": max_tokens}), headers={"content-type": "application/json"})
        resp = conn.getresponse()
        out["plain"] = (resp.status, resp.read())
    except Exception as exc:  # noqa: BLE001 - the test reports it
        out["plain"] = ("error", repr(exc))
    finally:
        conn.close()


def _stream(sock: Path, out: dict[str, Any], started: threading.Event, max_tokens: int
            ) -> None:
    conn = _Unix(sock)
    lines: list[str] = []
    out["stream"] = lines
    try:
        conn.request("POST", "/v1/completions", body=json.dumps({
            "model": "smollm2", "prompt": PROMPTS[1], "temperature": 0,
            "max_tokens": max_tokens, "stream": True}),
            headers={"content-type": "application/json"})
        resp = conn.getresponse()
        out["stream_status"] = resp.status
        while True:
            line = resp.readline()  # http.client raises IncompleteRead on a cut chunk
            if not line:
                break
            text = line.decode().rstrip("\n")
            if text.startswith("data: "):
                lines.append(text[6:])
                started.set()
        out["stream_end"] = "complete"
    except Exception as exc:  # noqa: BLE001 - the test reports it
        out["stream_end"] = repr(exc)
    finally:
        started.set()
        conn.close()


def _states(root: Path) -> dict[str, str]:
    raw = sqlite3.connect(root / "journal.sqlite3")
    try:
        return dict(raw.execute("SELECT id, state FROM requests").fetchall())
    finally:
        raw.close()


def _sigterm_mid_generation(root: Path, max_tokens: int) -> dict[str, Any]:
    """Start the daemon on root/config.toml, a plain and a streamed request of `max_tokens`,
    SIGTERM once the stream has sent tokens; the two clients' outcomes and the daemon's exit
    status."""
    d = start(root)
    out: dict[str, Any] = {}
    started = threading.Event()
    try:
        threads = [threading.Thread(target=_plain, args=(d.sock, out, max_tokens)),
                   threading.Thread(target=_stream, args=(d.sock, out, started, max_tokens))]
        for t in threads:
            t.start()
        assert started.wait(120), "the stream sent nothing"
        end = time.monotonic() + 60
        while d.health()["models"]["smollm2"]["active"] < 2:  # both generating
            assert time.monotonic() < end, "the two requests did not both start"
            time.sleep(0.02)
        time.sleep(0.3)
        d.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(60)
        out["exit"] = d.proc.wait(60)
        out["log"] = d.log_tail()
    finally:
        kill(d)
    return out


def _stream_events(out: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The stream's request id (from its chunks) and its final error event."""
    lines = out["stream"]
    assert out["stream_end"] == "complete", out  # the chunked body ended properly
    assert lines and lines[-1] == "[DONE]", lines[-3:]
    last = json.loads(lines[-2])
    assert "error" in last, lines[-3:]
    rid = json.loads(lines[0])["id"]
    return rid, last["error"]


def test_sigterm_answers_waiting_clients_and_keeps_their_requests(
        root: Path, shared: dict[str, Any], engine: str) -> None:
    state = shared["state"]
    write_config(root, state, {"smollm2": (None, True)}, context=CONTEXT, drain_s=1,
                 engine=engine)
    out = _sigterm_mid_generation(root, MAX_TOKENS[engine])
    assert out["exit"] == 0, out["log"]

    status, body = out["plain"]
    assert status == 503, out["plain"]
    err = json.loads(body)["error"]
    rid_plain = err["id"]
    assert err["code"] == "shutting_down"
    assert err["message"].startswith(f"daemon stopping; request {rid_plain} is kept and "
                                     "resumes after restart"), err
    assert "Hint:" in err["message"]

    rid_stream, serr = _stream_events(out)
    assert serr["code"] == "shutting_down" and serr["status"] == 503, serr
    assert serr["id"] == rid_stream and rid_stream in serr["message"], serr
    assert len(out["stream"]) > 3, "the stream was stopped before it generated"

    states = _states(root)
    assert states[rid_plain] in ("queued", "running"), states
    assert states[rid_stream] in ("queued", "running"), states  # not cancelled: resumable

    refs = references(None, state, PROMPTS, MAX_TOKENS[engine], CONTEXT, engine=engine)
    d = start(root)
    try:
        results = wait_done(d, [rid_plain, rid_stream], 240)
    finally:
        kill(d)
    assert results[rid_plain]["state"] == "done", results
    assert results[rid_stream]["state"] == "done", results
    assert results[rid_plain]["attempts"] >= 1
    assert results[rid_plain]["text"] == refs[PROMPTS[0]][1]
    assert results[rid_stream]["text"] == refs[PROMPTS[1]][1]


def test_sigterm_without_journal_still_answers_every_client(
        root: Path, shared: dict[str, Any], engine: str) -> None:
    write_config(root, shared["state"], {"smollm2": (None, True)}, context=CONTEXT,
                 drain_s=1, journal=False, engine=engine)
    out = _sigterm_mid_generation(root, MAX_TOKENS[engine])
    assert out["exit"] == 0, out["log"]
    status, body = out["plain"]
    assert status == 503, out["plain"]
    err = json.loads(body)["error"]
    assert err["code"] == "shutting_down" and err["id"].startswith("req-"), err
    assert "journal is off" in err["message"] and "Hint:" in err["message"], err
    rid_stream, serr = _stream_events(out)
    assert serr["code"] == "shutting_down" and serr["id"] == rid_stream, serr
