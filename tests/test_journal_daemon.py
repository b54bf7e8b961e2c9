"""The journal inside the real daemon: runner killed under load, SIGTERM keeps queued work,
sessions continue after a restart, warm tokenizer and model registry facts.

Every test but the warm start runs on both engines (the `engine` fixture), each against the
references of its own engine; the warm start is the numpy engine's (llama.cpp's vocab-only load
needs no tokenizer cache)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
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
    journal_tokens,
    kill,
    link_prepared,
    references,
    sessions_history,
    start,
    tiny_gguf,
    wait_done,
    write_config,
)

from edge_agent.journal import JournalStore, check_integrity, open_journal

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CONTEXT = 128
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


@pytest.fixture(scope="module", params=ENGINES)
def engine(request: pytest.FixtureRequest) -> str:
    """The engine of the daemons (and of the references) of the tests that take it."""
    return str(request.param)


@pytest.fixture(scope="module")
def shared(prepared_state_dir: Path) -> Iterator[dict[str, Any]]:
    base = Path(tempfile.mkdtemp(prefix="ea-jd-", dir="/tmp"))
    state = base / "state"
    link_prepared(prepared_state_dir, state)
    tiny = tiny_gguf(base / "tiny.gguf")
    yield {"base": base, "state": state, "tiny": tiny}
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def root(shared: dict[str, Any]) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="run-", dir=shared["base"]))
    yield path


def _post(d: Any, body: dict[str, Any]) -> str:
    status, reply = d.json("POST", "/v1/requests", body)
    assert status == 202, reply
    return str(reply["id"])


def _journal_row(root: Path, sql: str, args: tuple[Any, ...] = ()) -> Any:
    raw = sqlite3.connect(root / "journal.sqlite3")
    try:
        return raw.execute(sql, args).fetchone()
    finally:
        raw.close()


def test_runner_killed_under_load_loses_nothing(root: Path, shared: dict[str, Any],
                                                engine: str) -> None:
    state = shared["state"]
    max_tokens = 24
    refs = references(None, state, PROMPTS, max_tokens, CONTEXT, engine=engine)
    write_config(root, state, {"smollm2": (None, True)}, context=CONTEXT, engine=engine)
    d = start(root)
    try:
        pid0 = d.health()["pid"]
        ids = {_post(d, {"model": "smollm2", "prompt": p, "temperature": 0,
                         "max_tokens": max_tokens}): p for p in PROMPTS}
        kills = []
        for _ in range(2):  # twice: mid-prefill/step, then again on the resumed attempt
            end = time.monotonic() + 30
            while time.monotonic() < end:
                m = d.health()["models"]["smollm2"]
                toks = journal_tokens(root / "journal.sqlite3")
                if m["runner_pid"] and m["active"] and sum(map(len, toks.values())) > 3 * (
                        1 + 4 * len(kills)):
                    break
                time.sleep(0.02)
            before = journal_tokens(root / "journal.sqlite3")
            pid = d.health()["models"]["smollm2"]["runner_pid"]
            assert pid, "no runner to kill"
            os.kill(pid, signal.SIGKILL)
            kills.append((pid, before))
        results = wait_done(d, list(ids), 120)
        h = d.health()
        assert h["pid"] == pid0, "the daemon itself must not restart"
        assert h["models"]["smollm2"]["runner_pid"] not in {p for p, _ in kills}
    finally:
        kill(d)
    assert len(results) == len(ids)
    after = journal_tokens(root / "journal.sqlite3")
    for _, before in kills:
        for rid, old in before.items():
            assert after[rid][: len(old)] == old, f"journaled tokens of {rid} changed"
    for rid, prompt in ids.items():
        assert results[rid]["state"] == "done", results[rid]
        assert results[rid]["text"] == refs[prompt][1]
        assert after[rid] == refs[prompt][0]
    assert any(r["attempts"] > 1 for r in results.values()), "no request was resumed"
    assert "runner (pid" in (root / "daemon.log").read_text()


def test_sigterm_keeps_queued_requests_for_the_next_start(root: Path, shared: dict[str, Any],
                                                          engine: str) -> None:
    state = shared["state"]
    max_tokens = 40
    refs = references(None, state, PROMPTS, max_tokens, CONTEXT, engine=engine)
    write_config(root, state, {"smollm2": (None, True)}, context=CONTEXT, max_batch=1,
                 drain_s=0.5, engine=engine)
    d = start(root)
    answer: dict[str, Any] = {}
    try:
        ids = {_post(d, {"model": "smollm2", "prompt": p, "temperature": 0,
                         "max_tokens": max_tokens}): p for p in PROMPTS[:2]}

        def blocking() -> None:  # a client waiting on a request that is still queued
            answer["reply"] = d.json("POST", "/v1/completions", {
                "model": "smollm2", "prompt": PROMPTS[2], "temperature": 0,
                "max_tokens": max_tokens})

        t = threading.Thread(target=blocking)
        t.start()
        end = time.monotonic() + 60

        def accepted() -> int:  # the blocking request too must be in before SIGTERM
            return int(d.health()["queue"]["depth"])  # unfinished jobs: queued + running

        while accepted() < 3:
            assert time.monotonic() < end, "the three requests were not all accepted"
            time.sleep(0.02)
        d.proc.send_signal(signal.SIGTERM)
        t.join(30)
        assert d.proc.wait(30) == 0
    finally:
        kill(d)
    status, body = answer["reply"]
    assert status == 503 and body["error"]["code"] == "shutting_down", body
    kept = body["error"]["id"]
    assert body["error"]["message"].startswith(
        f"daemon stopping; request {kept} is kept and resumes after restart; "
        f"GET /v1/requests/{kept}")
    ids[kept] = PROMPTS[2]
    states = {rid: _journal_row(root, "SELECT state FROM requests WHERE id = ?", (rid,))[0]
              for rid in ids}
    assert states[kept] == "queued"
    assert "failed" not in states.values() and "cancelled" not in states.values(), states
    assert list(states.values()).count("queued") >= 2, states  # max_batch 1: two waited

    d = start(root)
    try:
        results = wait_done(d, list(ids), 120)
    finally:
        kill(d)
    for rid, prompt in ids.items():
        assert results[rid]["state"] == "done", results[rid]
        assert results[rid]["text"] == refs[prompt][1]


def test_session_continues_after_a_restart(root: Path, shared: dict[str, Any],
                                           engine: str) -> None:
    from edge_agent.daemon.sessions import continuation_ids
    from edge_agent.runtime.gguf import GGUFFile
    from edge_agent.runtime.tokenizer import Tokenizer

    tiny = shared["tiny"]
    tok = Tokenizer.from_metadata(GGUFFile(tiny).metadata)
    write_config(root, shared["state"], {"tiny": (tiny, True), "smollm2": (None, False)},
                 context=CONTEXT, max_batch=1, engine=engine)
    journal = root / "journal.sqlite3"
    first = [{"role": "user", "content": "Hi, I am Ada."}]
    d = start(root)
    try:
        status, r1 = d.json("POST", "/v1/chat/completions", {
            "model": "tiny", "messages": first, "session": "chat-1", "temperature": 0,
            "max_tokens": 6})
        assert status == 200, r1
        # a session belongs to one model
        status, err = d.json("POST", "/v1/chat/completions", {
            "model": "smollm2", "messages": first, "session": "chat-1"})
        assert status == 409 and err["error"]["code"] == "session_model_mismatch", err
        assert "session 'chat-1' is a conversation with model 'tiny'" in err["error"]["message"]
        # one open request per session
        _post(d, {"model": "tiny", "prompt": "x", "max_tokens": 120, "temperature": 0})
        busy = _post(d, {"model": "tiny", "messages": first, "session": "chat-2",
                         "max_tokens": 2})
        status, err = d.json("POST", "/v1/requests", {"model": "tiny", "messages": first,
                                                      "session": "chat-2"})
        assert status == 409 and err["error"]["code"] == "session_busy", err
        assert f"has request {busy} still open" in err["error"]["message"]
        assert "Hint:" in err["error"]["message"]
    finally:
        kill(d)
    rid1 = r1["id"]
    p1 = _journal_row(root, "SELECT prompt_ids FROM requests WHERE id = ?", (rid1,))[0]
    from edge_agent.journal.store import unpack_ids

    prompt1 = unpack_ids(p1)
    assert prompt1 == tok.apply_chat_template(first)
    gen1 = journal_tokens(journal)[rid1]
    im_end = tok.chat_template.im_end_id
    history = sessions_history(journal, "chat-1")
    assert history == prompt1 + gen1 + [im_end, *tok.encode("\n")]

    second = [{"role": "user", "content": "What is my name?"}]
    d = start(root)
    try:
        status, r2 = d.json("POST", "/v1/chat/completions", {
            "model": "tiny", "messages": second, "session": "chat-1", "temperature": 0,
            "max_tokens": 6})
        assert status == 200, r2
        assert r2["usage"]["prompt_tokens"] == len(history) + len(continuation_ids(tok, second))
    finally:
        kill(d)
    p2 = unpack_ids(_journal_row(root, "SELECT prompt_ids FROM requests WHERE id = ?",
                                 (r2["id"],))[0])
    assert p2 == history + continuation_ids(tok, second)  # the model saw the whole history
    assert tok.decode(p2).count("Hi, I am Ada.") == 1
    assert sessions_history(journal, "chat-1") == p2 + journal_tokens(journal)[r2["id"]] + [
        im_end, *tok.encode("\n")]
    assert _journal_row(root, "SELECT session FROM requests WHERE id = ?", (r2["id"],))[0] == (
        "chat-1")
    pending = "SELECT session_pending FROM requests WHERE id = ?"
    assert _journal_row(root, pending, (r2["id"],))[0] == 0  # saved with its session
    # a crash between the step that finished turn 2 and the session save: the next start
    # puts the turn back (simulated by rolling the session back to turn 1; the step that
    # finished turn 2 had marked it pending, the save that clears the mark did not happen)
    full = sessions_history(journal, "chat-1")
    raw = sqlite3.connect(journal)
    from edge_agent.journal.store import pack_ids

    with raw:
        raw.execute("UPDATE sessions SET history = ?, updated_at = 0 WHERE id = 'chat-1'",
                    (pack_ids(history),))
        raw.execute("UPDATE requests SET session_pending = 1 WHERE id = ?", (r2["id"],))
    raw.close()
    kill(start(root))
    assert sessions_history(journal, "chat-1") == full
    restored = "journal: session chat-1: turn " + r2["id"] + " restored"
    assert (root / "daemon.log").read_text().count(restored) == 1
    assert _journal_row(root, pending, (r2["id"],))[0] == 0
    kill(start(root))  # put back once: the next start has nothing pending
    assert (root / "daemon.log").read_text().count(restored) == 1
    assert sessions_history(journal, "chat-1") == full


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20}}, "required": ["city"],
        "additionalProperties": False}}}


def test_a_session_turn_put_back_at_start_keeps_its_tools_and_calls(
        root: Path, shared: dict[str, Any], engine: str) -> None:
    """A tool-calling turn whose session save a crash prevented is put back at the next start
    from the journaled request and tokens, with the session's tools and the name behind its
    call id: the next turn's tool result still names the function."""
    write_config(root, shared["state"], {"smollm2": (None, True)}, context=1024, max_batch=1,
                 engine=engine)
    journal = root / "journal.sqlite3"
    ask = {"model": "smollm2", "session": "tools-1", "tools": [WEATHER], "temperature": 0}
    d = start(root)
    try:
        status, r1 = d.json("POST", "/v1/chat/completions", {
            **ask, "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tool_choice": "required", "max_tokens": 60})
        assert status == 200 and r1["choices"][0]["finish_reason"] == "tool_calls", r1
    finally:
        kill(d)
    call = r1["choices"][0]["message"]["tool_calls"][0]
    row = "SELECT history, tools, calls FROM sessions WHERE id = 'tools-1'"
    saved = _journal_row(root, row)
    assert json.loads(saved[2]) == {call["id"]: "get_weather"}
    raw = sqlite3.connect(journal)
    with raw:  # the crash: turn 1 finished (pending), its session not yet saved
        raw.execute("DELETE FROM sessions WHERE id = 'tools-1'")
        raw.execute("UPDATE requests SET session_pending = 1 WHERE id = ?", (r1["id"],))
    raw.close()
    d = start(root)
    try:
        assert _journal_row(root, row) == saved  # put back whole: history, tools and calls
        status, r2 = d.json("POST", "/v1/chat/completions", {
            **ask, "messages": [{"role": "tool", "tool_call_id": call["id"],
                                 "content": "18 degrees"}], "tool_choice": "none",
            "max_tokens": 4})
        assert status == 200, r2
        from edge_agent.journal.store import unpack_ids

        p2 = unpack_ids(_journal_row(root, "SELECT prompt_ids FROM requests WHERE id = ?",
                                     (r2["id"],))[0])
        status, turn = d.json("POST", "/detokenize", {"tokens": p2[len(unpack_ids(saved[0])):]})
        assert status == 200, turn
        assert f"Result of get_weather (call {call['id']}): 18 degrees" in turn["content"]
    finally:
        kill(d)


def test_warm_start_takes_the_tokenizer_from_the_journal(root: Path,
                                                         shared: dict[str, Any]) -> None:
    tiny = shared["tiny"]
    broken = root / "broken.gguf"
    broken.write_bytes(b"not a gguf file at all")
    # the numpy engine's tokenizer is built from the GGUF's metadata (a second or more for a
    # large vocabulary) and cached in the journal; llama.cpp's vocab-only load needs no cache
    write_config(root, shared["state"], {"tiny": (tiny, True), "broken": (broken, False)},
                 context=CONTEXT, engine="numpy")
    sha = hashlib.sha256(tiny.read_bytes()).hexdigest()
    d = start(root)
    try:
        assert d.health()["models"]["tiny"]["tokenizer_from"] == "gguf"
        status, body = d.json("POST", "/v1/models/broken/load")
        assert status == 503, body
    finally:
        kill(d)
    j = open_journal(root / "journal.sqlite3", readonly=True)
    try:
        store = JournalStore(j)
        facts = store.get_model("tiny")
        assert facts is not None and facts["sha256"] == sha
        assert facts["path"] == str(tiny) and facts["size"] == tiny.stat().st_size
        assert Path(facts["prepared_path"]).is_file()
        assert facts["last_load_at"] > 0 and facts["last_load_s"] > 0
        assert store.get_tokenizer(sha) is not None
        failed = store.get_model("broken")
        assert failed is not None and failed["last_failure"] and failed["last_failure_at"] > 0
        assert check_integrity(j.conn) == []
    finally:
        j.close()
    d = start(root)
    try:
        h = d.health()
        assert h["models"]["tiny"]["tokenizer_from"] == "journal"
        status, body = d.json("POST", "/v1/completions", {"model": "tiny", "prompt": "Hello",
                                                          "max_tokens": 3})
        assert status == 200, body
    finally:
        kill(d)
    # the file changed: the registry's sha256 no longer applies, the tokenizer is rebuilt
    from qemu.tiny_model import write_tiny_llama

    write_tiny_llama(root / "other.gguf", seed=1)
    write_config(root, shared["state"], {"tiny": (root / "other.gguf", True)}, context=CONTEXT)
    d = start(root)
    try:
        assert d.health()["models"]["tiny"]["tokenizer_from"] == "gguf"
    finally:
        kill(d)


def test_start_reads_only_open_work_and_prunes_after_ready(root: Path, shared: dict[str, Any],
                                                            engine: str) -> None:
    """Finished requests beyond `max_finished` are pruned after READY (in batches, reported
    in /health), not before; the start path reports its steps."""
    from edge_agent.daemon.durable import PRUNE_BATCH

    write_config(root, shared["state"], {"tiny": (shared["tiny"], True)}, context=CONTEXT,
                 engine=engine)
    text = (root / "config.toml").read_text().replace(
        'ack = "durable"\n', 'ack = "durable"\nmax_finished = 10\n')
    (root / "config.toml").write_text(text)
    journal = root / "journal.sqlite3"
    store = JournalStore(open_journal(journal))
    n = PRUNE_BATCH + 50  # more than one batch
    t0 = time.time() - 1000.0  # recent: max_age_s (a week) prunes none of them
    for i in range(n):
        rid = f"old-{i}"
        store.add_request(id=rid, model="tiny", input={"prompt": "x"}, prompt_ids=[1, 2],
                          params={"seed": i}, session=f"s{i}", now=t0 + i)
        store.append_tokens([(rid, 0, 5, 1)], finish=[(rid, "done", None, "length")],
                            now=t0 + i)
        store.save_session(f"s{i}", "tiny", [1, 2, 5], turn=rid, now=t0 + i)
    store.close()
    d = start(root)
    try:
        h = d.health()["journal"]
        assert set(h["start_s"]) == {"open", "check", "warm", "checked_while", "recover",
                                     "reconcile", "total"}
        assert h["start_s"]["warm"] > 0  # the preload model's tokenizer, during the check
        assert h["recovery"]["resumed"] == []
        deadline = time.monotonic() + 30
        while h["retention"] is None and time.monotonic() < deadline:
            time.sleep(0.1)
            h = d.health()["journal"]
        assert h["retention"] is not None, "no retention pass after READY"
        assert h["retention"]["requests"] == n - 10  # the newest 10 finished are kept
        assert h["retention"]["batches"] >= 3
    finally:
        kill(d)
    assert _journal_row(root, "SELECT count(*) FROM requests WHERE state = 'done'")[0] == 10
    assert _journal_row(root, "SELECT count(*) FROM tokens WHERE request_id LIKE 'old-%'")[0] == 10
    assert _journal_row(root, "SELECT count(*) FROM sessions")[0] == n  # sessions stay
    log = (root / "daemon.log").read_text()
    pruned = f"journal: retention pruned {n - 10} finished request(s)"
    assert pruned in log and log.index("ready: models:") < log.index(pruned)  # after READY
