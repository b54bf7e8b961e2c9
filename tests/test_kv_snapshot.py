"""A session's prompt cache survives a restart: llama.cpp KV snapshots.

Engine level (SmolLM2, batch-invariant, so exact reuse): the slot a finished turn released is
snapshotted, a fresh engine (another process's view: nothing shared) restores it, and the
session's next prompt hits the restored cells and gives the tokens a cold prefill gives (the
oracle: the same engine with its cache cleared). A blob from another model, or for other
tokens, is refused and changes nothing. Gemma 3 restores every held cell; decoded alone
(`runtime.decode = "alone"`) its restored turn is exact too.

Daemon level (a real `edge-agent serve`, the openai SDK): a session's turn, SIGTERM, a new
daemon on the same state dir: the next turn reports cached prompt tokens.
"""

from __future__ import annotations

import shutil
import sqlite3
import tempfile
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from edge_agent.journal.store import JournalStore
from edge_agent.paths import default_model_path
from edge_agent.runtime.prefill_groups import NewSeq
from edge_agent.runtime.sampling import SamplingParams

pytest.importorskip("llama_cpp", reason="KV snapshots are the llama.cpp engine's")

from edge_agent.runtime.llamacpp import BATCH_TOKENS, LlamaCppEngine  # noqa: E402

pytestmark = pytest.mark.timeout(900)

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


def _text(topic: str, n: int) -> str:
    return " ".join(f"Note {i} about {topic}: it changes with the season and the hour."
                    for i in range(n))


def _load() -> LlamaCppEngine:
    e = LlamaCppEngine.load(default_model_path(), max_batch=2, context=2048, threads=2)
    assert e.batch_invariance(())  # what the runner does at warm-up
    return e


def _steps(e: LlamaCppEngine, seqs: dict[str, list[int]], params: SamplingParams = GREEDY,
           n: int = 8) -> tuple[list[tuple[int, object]], int]:
    """Add `seqs` together, step them to `n` tokens, release: the first one's (token, its
    log-probabilities or None) and its cached prompt tokens."""
    first, errors = e.add_many([NewSeq(sid, ids, params) for sid, ids in seqs.items()])
    assert not errors, errors
    sid = next(iter(seqs))
    out = [(first[sid], e.last_logprobs.get(sid))]
    cached = e.cached_tokens(sid)
    for _ in range(n - 1):
        out.append((e.step(list(seqs))[sid], e.last_logprobs.get(sid)))
    for s in seqs:
        e.release(s)
    return out, cached


def _turn(e: LlamaCppEngine, sid: str, ids: list[int], n: int = 8) -> tuple[list[int], int]:
    """Add `ids`, step to `n` tokens, release: (tokens, cached prompt tokens)."""
    out, cached = _steps(e, {sid: ids}, n=n)
    return [tok for tok, _ in out], cached


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[LlamaCppEngine, LlamaCppEngine]]:
    a = _load()
    try:
        b = _load()
        try:
            yield a, b
        finally:
            b.close()
    finally:
        a.close()


def test_a_restored_snapshot_serves_the_next_turn_like_a_cold_prefill(
        engines: tuple[LlamaCppEngine, LlamaCppEngine]) -> None:
    a, b = engines
    a.clear_cache()
    b.clear_cache()
    prompt = a.tokenizer.encode(_text("the lighthouse keeper", 70))
    assert len(prompt) > BATCH_TOKENS
    reply, _ = _turn(a, "t1", prompt)
    history = prompt + reply  # what the session journals (the KV holds all but the last)
    blob = a.snapshot(history)
    assert blob is not None
    assert a.snapshot(a.tokenizer.encode("Something else entirely.")) is None
    nxt = history + a.tokenizer.encode(" Shorter, please.")
    a.clear_cache()
    cold, cached = _turn(a, "cold", nxt)
    assert cached == 0
    assert b.restore(history, blob)
    warm, cached = _turn(b, "warm", nxt)
    assert cached == len(prompt) // BATCH_TOKENS * BATCH_TOKENS > 0
    assert warm == cold


def test_a_blob_for_another_model_or_other_tokens_is_refused(
        engines: tuple[LlamaCppEngine, LlamaCppEngine], gemma_path: Path) -> None:
    a, b = engines
    a.clear_cache()
    b.clear_cache()
    prompt = a.tokenizer.encode(_text("the harbour", 70))
    reply, _ = _turn(a, "t2", prompt)
    blob = a.snapshot(prompt + reply)
    assert blob is not None
    g = LlamaCppEngine.load(gemma_path, max_batch=2, context=2048, threads=2)
    try:
        assert not g.restore(prompt + reply, blob)
        assert g.free_blocks == 2
    finally:
        g.close()
    other = list(prompt)
    other[3] = other[4]
    assert not b.restore(other, blob)  # another session's tokens
    assert not b.restore(prompt + reply, b"not a snapshot")
    _, cached = _turn(b, "t3", prompt + reply + b.tokenizer.encode(" Again."), n=1)
    assert cached == 0  # nothing was loaded
    c = LlamaCppEngine.load(default_model_path(), max_batch=2, context=1024, threads=2)
    try:
        assert not c.restore(prompt + reply, blob)  # another context per sequence
    finally:
        c.close()


def test_a_sliding_window_model_restores_every_held_cell(gemma_path: Path) -> None:
    """Gemma 3 (not batch-invariant, sliding-window layers): the snapshot keeps every held
    cell, and the restored slot serves the next turn as the slot the turn left would."""
    a = LlamaCppEngine.load(gemma_path, max_batch=2, context=2048, threads=2)
    b = LlamaCppEngine.load(gemma_path, max_batch=2, context=2048, threads=2)
    try:
        # the mode the warm-up's probe picks for Gemma 3 (set directly, as a 2-slot probe
        # may not see it; tests/test_prompt_cache.py does the same)
        a.exact_reuse = b.exact_reuse = False
        prompt = a.tokenizer.encode(_text("the orchard", 20))
        reply, _ = _turn(a, "g1", prompt)
        history = prompt + reply
        blob = a.snapshot(history)
        assert blob is not None
        nxt = history + a.tokenizer.encode(" Shorter, please.")
        assert b.restore(history, blob)
        warm, cached = _turn(b, "g2", nxt)
        live, live_cached = _turn(a, "g3", nxt)  # the slot the turn left, never restarted
        assert cached == live_cached == len(history) - 1  # prompt + fed tokens
        assert warm == live
    finally:
        b.close()
        a.close()


def test_gemma_decoded_alone_restores_like_a_cold_prefill(gemma_path: Path) -> None:
    """`decode = "alone"` makes Gemma 3 batch-invariant (exact reuse): a snapshot restored in
    a fresh engine serves the session's next turn, next to another new sequence, with the
    tokens and log-probabilities a cold prefill of it alone gives."""
    params = replace(GREEDY, logprobs=3)
    a = LlamaCppEngine.load(gemma_path, max_batch=2, context=2048, threads=2, decode="alone")
    b = LlamaCppEngine.load(gemma_path, max_batch=2, context=2048, threads=2, decode="alone")
    try:
        assert a.batch_invariance(()) and b.batch_invariance(())  # the warm-up's probe
        prompt = a.tokenizer.encode(_text("the lighthouse keeper", 50))
        assert len(prompt) > BATCH_TOKENS
        reply, _ = _turn(a, "t1", prompt)
        history = prompt + reply
        blob = a.snapshot(history)
        assert blob is not None
        nxt = history + a.tokenizer.encode(" Shorter, please.")
        a.clear_cache()
        cold, cached = _steps(a, {"cold": nxt}, params)
        assert cached == 0
        assert all(lp is not None for _, lp in cold)  # log-probabilities are compared too
        assert b.restore(history, blob)
        warm, cached = _steps(b, {"warm": nxt, "o": b.tokenizer.encode("The moon rose.")},
                              params)
        assert cached == len(prompt) // BATCH_TOKENS * BATCH_TOKENS > 0
        assert warm == cold
    finally:
        b.close()
        a.close()

# ---- the journal -------------------------------------------------------------------------------

def test_the_journal_keeps_the_newest_snapshots_within_the_bound(store: JournalStore) -> None:
    for k, sid in enumerate(["s1", "s2", "s3"]):
        store.save_session(sid, "m", [1, 2, 3], now=float(k))
        assert store.save_kv_snapshot(sid, "m", [1, 2], "id", bytes(40), max_bytes=100,
                                      now=float(k)) == (1 if sid == "s3" else 0)
    assert [(sid, toks) for sid, toks, _ in store.kv_snapshots("m", 8)] == [
        ("s3", [1, 2]), ("s2", [1, 2])]  # newest first; s1 dropped for the bound
    assert store.kv_snapshots("other", 8) == [] and len(store.kv_snapshots("m", 1)) == 1
    store.save_kv_snapshot("s2", "m", [1, 2, 3], "id", bytes(30), max_bytes=100, now=5.0)
    assert [sid for sid, _, _ in store.kv_snapshots("m", 8)] == ["s2", "s3"]  # replaced
    assert store.delete_session("s2")  # DELETE /v1/sessions/s2
    assert [sid for sid, _, _ in store.kv_snapshots("m", 8)] == ["s3"]
    assert store.prune(session_max_age_s=1.0, now=10.0).sessions == 2
    assert store.kv_snapshots("m", 8) == []  # went with its session


# ---- the daemon --------------------------------------------------------------------------------

def _client(sock: Path) -> object:
    import openai

    try:
        import httpx2 as httpx  # the HTTP library of openai 3
    except ImportError:
        import httpx
    transport = httpx.HTTPTransport(uds=str(sock))
    return openai.OpenAI(base_url="http://localhost/v1", api_key="unused", max_retries=0,
                         timeout=240, http_client=openai.DefaultHttpxClient(transport=transport))


def _snapshots(db: Path) -> list[tuple[str, int, int]]:
    conn = sqlite3.connect(db)
    try:
        return conn.execute("SELECT session, n_tokens, bytes FROM kv_snapshots").fetchall()
    finally:
        conn.close()


@pytest.mark.slow
def test_a_sessions_cache_survives_a_daemon_restart() -> None:
    from daemon_proc import Daemon, daemon_env, serve_argv, spawn, stop

    root = Path(tempfile.mkdtemp(prefix="ea-kv-", dir="/tmp"))
    cfg = root / "config.toml"
    cfg.write_text(
        f'[server]\nsocket = "{root / "ea.sock"}"\nstate_dir = "{root / "state"}"\n'
        "drain_timeout_s = 5\n"
        '[runtime]\nmlock = "best-effort"\nengine = "llamacpp"\nthreads = 2\n'
        "[models.smollm2]\ncontext = 2048\nmax_batch = 2\npreload = true\n"
    )
    story = _text("the lighthouse keeper", 70)
    d = spawn(Daemon, root, serve_argv(cfg), env=daemon_env(root))
    try:
        d.wait_notify("READY=1", 180.0)
        client = _client(d.sock)
        one = client.chat.completions.create(  # type: ignore[attr-defined]
            model="smollm2", max_tokens=8, temperature=0,
            messages=[{"role": "user", "content": f"{story}\nSummarise."}],
            extra_body={"session": "kv-1"})
        client.close()  # type: ignore[attr-defined]
        db = next((root / "state").rglob("journal.sqlite3"))
        end = time.monotonic() + 60
        while not _snapshots(db):  # taken when the model is idle, after the reply
            assert time.monotonic() < end, "no KV snapshot was journaled"
            time.sleep(0.2)
        assert stop(d, grace=60.0) == 0  # SIGTERM
        [(sid, n, size)] = _snapshots(db)
        assert sid == "kv-1" and n == one.usage.prompt_tokens // BATCH_TOKENS * BATCH_TOKENS
        print(f"\nKV snapshot: {n} tokens, {size} bytes ({size * 1000 // n} bytes per 1,000)")
        d = spawn(Daemon, root, serve_argv(cfg), env=daemon_env(root), append_log=True)
        d.wait_notify("READY=1", 180.0)
        client = _client(d.sock)
        two = client.chat.completions.create(  # type: ignore[attr-defined]
            model="smollm2", max_tokens=8, temperature=0,
            messages=[{"role": "user", "content": "Shorter, please."}],
            extra_body={"session": "kv-1"})
        client.close()  # type: ignore[attr-defined]
        assert two.usage.prompt_tokens > one.usage.prompt_tokens
        assert two.usage.prompt_tokens_details.cached_tokens == n > 0
    finally:
        stop(d, grace=30.0)
        shutil.rmtree(root, ignore_errors=True)
