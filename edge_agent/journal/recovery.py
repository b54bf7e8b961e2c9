"""Warm start: what the journal says to resume, and the tokenizer back from its cache.

Invariants this module owns:
- `recover()` runs once, after the journal was opened (integrity-checked), before the daemon
  accepts work. In ONE transaction it: fails every queued or running request whose deadline
  passed while the agent was down (state "expired", an error that says the deadline passed
  while the agent was down, by how much, and how many tokens it had), and moves running
  requests back to queued. Everything else that was queued or running is returned to resume,
  oldest first, with the tokens journaled so far and the detokenizer offset after the last one
  (so the resumed stream continues on a UTF-8 boundary and the prefill is prompt + tokens).
- Journaled tokens are returned as they are; recovery never rewrites them.
- Its cost is O(open requests) (index lookups), never O(journal): finished requests, their
  tokens and sessions are not read at start.
- A cached tokenizer whose bytes fail their checksum or do not match the requested fingerprint
  is dropped from the cache and None is returned (the caller rebuilds from GGUF metadata).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from edge_agent.journal.db import QuarantineEvent
from edge_agent.journal.store import JournaledRequest, JournalStore

if TYPE_CHECKING:
    from edge_agent.runtime.tokenizer import Tokenizer

__all__ = ["Resumable", "RecoveryPlan", "recover", "load_cached_tokenizer", "cache_tokenizer"]


@dataclass(frozen=True)
class Resumable:
    request: JournaledRequest
    tokens: list[int]
    text_offset: int
    was_running: bool

    @property
    def prefill_ids(self) -> list[int]:
        """What a runner prefills to continue: the prompt then the tokens generated so far."""
        return self.request.prompt_ids + self.tokens


@dataclass(frozen=True)
class RecoveryPlan:
    resume: list[Resumable] = field(default_factory=list)
    expired: list[JournaledRequest] = field(default_factory=list)
    quarantined: QuarantineEvent | None = None
    seconds: float = 0.0

    def summary(self) -> str:
        running = sum(1 for r in self.resume if r.was_running)
        text = (f"journal recovery: {len(self.resume)} request(s) to resume ({running} were "
                f"running, {len(self.resume) - running} queued), {len(self.expired)} expired "
                f"while down")
        if self.quarantined is not None:
            text += f"; {self.quarantined.message()}"
        return text

    def to_dict(self) -> dict[str, Any]:
        return {
            "resumed": [r.request.id for r in self.resume],
            "expired": [r.id for r in self.expired],
            "quarantined": None if self.quarantined is None else self.quarantined.to_dict(),
            "seconds": self.seconds,
        }


def _fmt(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(ts))


def recover(store: JournalStore, *, now: float | None = None) -> RecoveryPlan:
    """Decide, and journal, what happens to the work that was open when the agent stopped."""
    t0 = time.monotonic()
    now = time.time() if now is None else now
    open_reqs = store.open_requests()  # partial index: O(open), not O(journal)
    expired: list[JournaledRequest] = []
    resume_reqs: list[JournaledRequest] = []
    if open_reqs:  # nothing open (the usual start): no transaction at all
        with store.journal.transaction() as conn:
            for req in open_reqs:
                if req.deadline is not None and req.deadline <= now:
                    n = store.token_count(req.id)  # primary key (request_id, idx): O(log n)
                    error = (
                        f"deadline passed while the agent was down: deadline "
                        f"{_fmt(req.deadline)} was {now - req.deadline:.1f} s before this start "
                        f"({_fmt(now)}); the request was {req.state} with {n} token(s) "
                        "generated. Hint: resubmit it with a longer timeout_ms."
                    )
                    conn.execute("UPDATE requests SET state = 'expired', error = ?, "
                                 "finish_reason = 'deadline', finished_at = ? WHERE id = ?",
                                 (error, now, req.id))
                    expired.append(req)
                else:
                    if req.state == "running":
                        conn.execute("UPDATE requests SET state = 'queued' WHERE id = ?",
                                     (req.id,))
                    resume_reqs.append(req)
    resume = []
    for req in resume_reqs:
        toks = store.tokens(req.id)
        resume.append(Resumable(req, [t.token_id for t in toks],
                                toks[-1].text_offset if toks else 0, req.state == "running"))
    plan = RecoveryPlan(resume, expired, store.journal.quarantined, time.monotonic() - t0)
    if resume or expired:
        store.record_event("recovery", plan.summary(), now=now)
    return plan


def load_cached_tokenizer(store: JournalStore, model_sha256: str,
                          fingerprint: str | None = None) -> Tokenizer | None:
    """The model's tokenizer from the journal cache, or None (missing or unusable: dropped)."""
    from edge_agent.runtime.tokenizer import Tokenizer, TokenizerCacheError

    hit = store.get_tokenizer(model_sha256, fingerprint)
    if hit is None:
        return None
    fp, data = hit
    try:
        tokenizer = Tokenizer.from_bytes(data)
    except TokenizerCacheError as exc:
        store.drop_tokenizer(model_sha256, fp)
        store.record_event("tokenizer_cache", f"dropped a cached tokenizer of model "
                           f"{model_sha256[:12]}: {exc}")
        return None
    if tokenizer.fingerprint != fp:
        store.drop_tokenizer(model_sha256, fp)
        return None
    return tokenizer


def cache_tokenizer(store: JournalStore, model_sha256: str, tokenizer: Tokenizer) -> str:
    """Store `tokenizer` for that model; returns its fingerprint (the cache key)."""
    store.put_tokenizer(model_sha256, tokenizer.fingerprint, tokenizer.to_bytes())
    return tokenizer.fingerprint
