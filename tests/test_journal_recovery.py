"""Warm start from a real journal file: what is resumed, what expired while down, tokenizer."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from edge_agent.journal import (
    JournalStore,
    cache_tokenizer,
    load_cached_tokenizer,
    open_journal,
    recover,
)
from edge_agent.runtime.tokenizer import IncrementalDecoder, Tokenizer


def _add(store: JournalStore, rid: str, deadline: float | None, now: float) -> None:
    store.add_request(id=rid, model="m", input={"prompt": rid}, prompt_ids=[1, 2],
                      params={"seed": 3}, deadline=deadline, now=now)


def test_recover_resumes_requeues_and_expires(tmp_path: Path) -> None:
    path = tmp_path / "j.sqlite3"
    store = JournalStore(open_journal(path))
    _add(store, "queued", None, 100.0)
    _add(store, "running", 500.0, 101.0)
    _add(store, "late", 200.0, 102.0)
    _add(store, "finished", None, 103.0)
    store.set_running(["running", "late", "finished"], now=104.0)
    store.append_tokens([("running", 0, 7, 1), ("running", 1, 8, 3), ("late", 0, 9, 1),
                         ("finished", 0, 4, 1)])
    store.finish("finished", "done", now=105.0)
    store.close()  # the agent goes down; it comes back at t=300

    store = JournalStore(open_journal(path))
    plan = recover(store, now=300.0)
    assert [r.request.id for r in plan.resume] == ["queued", "running"]
    q, r = plan.resume
    assert (q.tokens, q.text_offset, q.was_running) == ([], 0, False)
    assert (r.tokens, r.text_offset, r.was_running) == ([7, 8], 3, True)
    assert r.prefill_ids == [1, 2, 7, 8]
    assert [x.id for x in plan.expired] == ["late"]
    late = store.get_request("late")
    assert late is not None and late.state == "expired" and late.finish_reason == "deadline"
    assert late.error is not None
    assert "deadline passed while the agent was down" in late.error
    assert "100.0 s before this start" in late.error and "with 1 token(s)" in late.error
    assert "Hint:" in late.error
    running = store.get_request("running")
    assert running is not None and running.state == "queued"  # back in the queue
    assert [t.token_id for t in store.tokens("running")] == [7, 8]  # never rewritten
    assert "2 request(s) to resume (1 were running, 1 queued), 1 expired" in plan.summary()
    assert store.events()[0]["kind"] == "recovery"
    assert plan.to_dict()["expired"] == ["late"]
    store.close()

    # recovery is idempotent: nothing changes on a second start
    store = JournalStore(open_journal(path))
    again = recover(store, now=301.0)
    assert [x.request.id for x in again.resume] == ["queued", "running"] and not again.expired
    store.close()


def test_recover_reports_a_quarantine(tmp_path: Path) -> None:
    path = tmp_path / "j.sqlite3"
    path.write_bytes(b"\x01" * 5000)
    store = JournalStore(open_journal(path))
    plan = recover(store)
    assert plan.quarantined is not None and not plan.resume
    assert "was corrupt" in plan.summary()
    store.close()


def test_tokenizer_cache_round_trip_and_corruption(tmp_path: Path, tokenizer: Tokenizer) -> None:
    path = tmp_path / "j.sqlite3"
    store = JournalStore(open_journal(path))
    sha = "ef" * 32
    assert load_cached_tokenizer(store, sha) is None
    fp = cache_tokenizer(store, sha, tokenizer)
    store.close()

    store = JournalStore(open_journal(path))
    warm = load_cached_tokenizer(store, sha)
    assert warm is not None and warm.fingerprint == fp == tokenizer.fingerprint
    text = "Résumé: 3 naïve 🤖 emoji, 東京, code `x += 1`"
    assert warm.encode(text) == tokenizer.encode(text)
    assert load_cached_tokenizer(store, sha, "00" * 32) is None  # other fingerprint: a miss
    store.close()

    raw = sqlite3.connect(path)  # flip a byte inside the cached blob
    data = bytearray(raw.execute("SELECT data FROM tokenizer_cache").fetchone()[0])
    data[len(data) // 2] ^= 0xFF
    raw.execute("UPDATE tokenizer_cache SET data = ?", (bytes(data),))
    raw.commit()
    raw.close()
    store = JournalStore(open_journal(path))
    assert load_cached_tokenizer(store, sha) is None  # checksum caught it...
    assert store.get_tokenizer(sha) is None  # ...and the entry was dropped
    assert "checksum mismatch" in store.events()[0]["message"]
    store.close()


def test_text_offset_resumes_stream_on_utf8_boundary(tmp_path: Path,
                                                     tokenizer: Tokenizer) -> None:
    """Offsets journaled with each token let a resumed stream continue byte-exactly."""
    text = "naïve 🤖 東京 done"
    ids = tokenizer.encode(text)
    store = JournalStore(open_journal(tmp_path / "j.sqlite3"))
    store.add_request(id="a", model="m", input={"prompt": "x"}, prompt_ids=[1], params={})
    dec = IncrementalDecoder(tokenizer)
    sent = ""
    cut = len(ids) // 2
    for i, t in enumerate(ids[:cut]):
        sent += dec.push(t)
        store.append_tokens([("a", i, t, dec.offset)])
    # crash; resume from the journal
    toks = store.tokens("a")
    resumed = IncrementalDecoder(tokenizer, tokens=[t.token_id for t in toks],
                                 offset=store.text_offset("a"))
    rest = "".join(resumed.push(t) for t in ids[cut:]) + resumed.flush()
    assert sent + rest == text
    store.close()
