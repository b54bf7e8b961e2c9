"""A session's prompt cache survives a restart: llama.cpp KV snapshots.

Engine level (SmolLM2, batch-invariant, so exact reuse): the slot a finished turn released is
snapshotted, a fresh engine (another process's view: nothing shared) restores it, and the
session's next prompt hits the restored cells and gives the tokens a cold prefill gives (the
oracle: the same engine with its cache cleared). A blob from another model, or for other
tokens, is refused and changes nothing.

Daemon level (a real `edge-agent serve`, the openai SDK): a session's turn, SIGTERM, a new
daemon on the same state dir: the next turn reports cached prompt tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

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
    assert e.batch_invariance(e.warmup_ids())  # what the runner does at warm-up
    return e


def _turn(e: LlamaCppEngine, sid: str, ids: list[int], n: int = 8) -> tuple[list[int], int]:
    """Add `ids`, step to `n` tokens, release: (tokens, cached prompt tokens)."""
    first, errors = e.add_many([NewSeq(sid, ids, GREEDY)])
    assert not errors, errors
    out = [first[sid]]
    cached = e.cached_tokens(sid)
    for _ in range(n - 1):
        out.append(e.step([sid])[sid])
    e.release(sid)
    return out, cached


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
        assert g.free_blocks == 2 and not g._held
    finally:
        g.close()
    other = list(prompt)
    other[3] = other[4]
    assert not b.restore(other, blob)  # another session's tokens
    assert not b.restore(prompt + reply, b"not a snapshot")
    assert not b._held
    c = LlamaCppEngine.load(default_model_path(), max_batch=2, context=1024, threads=2)
    try:
        assert not c.restore(prompt + reply, blob)  # another context per sequence
    finally:
        c.close()
