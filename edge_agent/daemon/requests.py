"""The daemon's view of one request: output accumulation, stop handling, waiting and streaming.

Invariants owned here:
- `pieces[i]` is the text released after generated token i (possibly ""), so the concatenation
  of `pieces` is the output so far and `GET /v1/requests/{id}/events?from=N` can resume at any
  token index. A piece, once appended, never changes (a stream may have sent it): text released
  when the request ends without a new token (held back for a stop string, then the model's
  end-of-sequence token) is one more piece, at index len(tokens). Text is released only as
  whole UTF-8 characters (IncrementalDecoder) and is held back only while it could still be
  the start of a stop string.
- A new attempt (after a runner death or a restart) resumes by prefill: the runner is given
  prompt + `tokens` and its first token is generation index len(tokens) (sampling is keyed by
  (seed, generation index)), so nothing is regenerated; a token routed for an index below
  `len(tokens)` would be skipped, never re-emitted.
- `finish()` happens once; afterwards the record never changes and `done` is set. Waiters are
  woken through one `asyncio.Condition`-like version counter (no lost wake-ups).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from edge_agent.protocol.api import GenerationRequest
from edge_agent.scheduler import Job

__all__ = ["RequestRecord"]


class RequestRecord:
    def __init__(self, *, job: Job, request: GenerationRequest, model: str, decoder: Any,
                 prompt_tokens: int, stop_ids: frozenset[int], context: int) -> None:
        self.job = job
        self.request = request
        self.model = model
        self.created = int(time.time())
        self.decoder = decoder
        self.prompt_tokens = prompt_tokens
        self.cached_tokens = 0  # of prompt_tokens, held by the runner's prompt cache
        self.stop_ids = stop_ids
        self.max_new = max(1, min(request.max_tokens, context - prompt_tokens))
        self.tokens: list[int] = []
        self.pieces: list[str] = []
        self.pending = ""  # decoded text held back (could start a stop string)
        self.text = ""  # released text
        self.hold = max((len(s) for s in request.stop), default=1) - 1
        self.replay = 0  # generated-token index of the current attempt
        self.attempt_start = 0  # len(tokens) when the current attempt began
        self.finish_reason: str | None = None
        self.error: tuple[int, str, str] | None = None  # (http status, code, message)
        self.extra: dict[str, Any] = {}
        self.done = asyncio.Event()
        self.first_token_at: float | None = None
        self.submitted_mono = time.monotonic()
        self._changed = asyncio.Event()
        self.on_finish: Any = None  # called once with this record when it finishes (journal)

    @property
    def id(self) -> str:
        return self.job.id

    # -- producer side (the model service) ---------------------------------------------------
    def restart(self) -> None:
        """A new attempt begins (after a requeue): it resumes at generation index len(tokens)
        (the runner prefills prompt + tokens)."""
        self.replay = self.attempt_start = len(self.tokens)

    def push(self, token: int) -> bool:
        """Route one generated token; True when the request is complete."""
        if self.done.is_set():
            return True
        index = self.replay
        self.replay += 1
        if index < len(self.tokens):
            return False  # regenerated during a replay: already emitted
        if token in self.stop_ids:
            self.pending += self.decoder.flush()
            if self._check_stop():
                return True
            self._release(final=True)
            self.finish("stop")
            return True
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()
        self.tokens.append(token)
        self.pending += self.decoder.push(token)
        if self._check_stop():
            return True
        if len(self.tokens) >= self.max_new:
            self.pending += self.decoder.flush()
            if self._check_stop():
                return True
            self._release(final=True)
            self.finish("length")
            return True
        self._release(final=False)
        return False

    def _check_stop(self) -> bool:
        found = [i for i in (self.pending.find(s) for s in self.request.stop) if i >= 0]
        if not found:
            return False
        self.pending = self.pending[: min(found)]
        self._release(final=True)
        self.finish("stop")
        return True

    def _release(self, *, final: bool) -> None:
        keep = 0 if final else min(self.hold, len(self.pending))
        out = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(self.pending) - keep:]
        self.text += out
        if len(self.pieces) < len(self.tokens):  # the piece of the newest token
            while len(self.pieces) < len(self.tokens) - 1:
                self.pieces.append("")
            self.pieces.append(out)
        elif out:
            # Text released with no new token (held back until an end-of-sequence token or a
            # stop check): a piece of its own. The newest token's piece may already have been
            # streamed, so appending to it would lose this text on every live stream.
            self.pieces.append(out)
        self._notify()

    def finish(self, reason: str | None, error: tuple[int, str, str] | None = None,
               **extra: Any) -> None:
        if self.done.is_set():
            return
        self.finish_reason = reason
        self.error = error
        self.extra.update(extra)
        self.done.set()
        if self.on_finish is not None:
            self.on_finish(self)
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    # -- consumer side (HTTP handlers) -------------------------------------------------------
    async def wait_change(self) -> None:
        if not self.done.is_set():
            await self._changed.wait()

    async def follow(self, start: int = 0) -> AsyncIterator[tuple[int, str]]:
        """Yield (token index, text piece) from token `start` on, until the request ends."""
        i = start
        while True:
            changed = self._changed
            while i < len(self.pieces):
                yield i, self.pieces[i]
                i += 1
            if self.done.is_set():
                return
            await changed.wait()

    def to_dict(self, now: float) -> dict[str, Any]:
        job = self.job
        out: dict[str, Any] = {
            "id": self.id, "model": self.model, "state": job.state.value,
            "priority": job.priority, "attempts": job.attempts,
            "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
            "completion_tokens": len(self.tokens),
            "text": self.text, "finish_reason": self.finish_reason,
            "queued_s": round(job.queued_s(now), 6), "ran_s": round(job.running_s(now), 6),
            "error": None if self.error is None else {"code": self.error[1],
                                                       "message": self.error[2]},
        }
        return out
