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
- Log-probabilities (when the request asks): `logprobs[i]` belongs to token i (None: not known,
  the token was restored from the journal after a daemon restart). Token i's entry is released
  once some of its text is (its text starts before the end of `text`), or when the request
  ends without a stop string; a stop string's cut drops the entries of the tokens whose text
  starts at or after the cut. `piece_logprobs[k]` is how many entries were released when
  piece k was appended, so a stream sends with each piece the entries released with it, and
  the entries of a stream are those of the non-streamed reply.
- `push` only says that the output reached its end (`ended`: "stop" or "length"); the
  request ends in daemon/request_table.py's `RequestTable.finish`, which calls `end(outcome)`
  once; afterwards the record never changes and `done` is set. Waiters are woken through one
  `asyncio.Condition`-like version counter (no lost wake-ups).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from edge_agent.daemon.outcome import Outcome
from edge_agent.protocol.api import GenerationRequest
from edge_agent.runtime.stops import StopText
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
        self.stops = StopText(request.stop)  # holds back text that could start a stop string
        self.wants_logprobs = request.logprobs is not None
        # per token: (logprob, [(id, logprob), ...]) or None; where its text starts
        self.logprobs: list[tuple[float, list[tuple[int, float]]] | None] = []
        self.starts: list[int] = []
        self.logprobs_released = 0  # entries released (see the invariants)
        self.piece_logprobs: list[int] = []  # logprobs_released when piece k was appended
        self.text = ""  # released text
        self.replay = 0  # generated-token index of the current attempt
        self.attempt_start = 0  # len(tokens) when the current attempt began
        self.ended: str | None = None  # the output reached its end: "stop" | "length"
        self.outcome: Outcome | None = None  # how the request ended (RequestTable.finish)
        self.done = asyncio.Event()
        self.first_token_at: float | None = None
        self.submitted_mono = time.monotonic()
        self._changed = asyncio.Event()

    @property
    def id(self) -> str:
        return self.job.id

    @property
    def finish_reason(self) -> str | None:
        return None if self.outcome is None else self.outcome.finish_reason

    # -- producer side (the model service) ---------------------------------------------------
    def restart(self) -> None:
        """A new attempt begins (after a requeue): it resumes at generation index len(tokens)
        (the runner prefills prompt + tokens)."""
        self.replay = self.attempt_start = len(self.tokens)

    def push(self, token: int, logprobs: Any = None) -> bool:
        """Route one generated token (with the runner's `[logprob, [[id, logprob], ...]]` when
        the request asked for them); True when the output is complete (`ended` says why; the
        caller ends the request)."""
        if self.done.is_set() or self.ended is not None:
            return True
        index = self.replay
        self.replay += 1
        if index < len(self.tokens):
            return False  # regenerated during a replay: already emitted
        if token in self.stop_ids:
            out = self.stops.end(self.decoder.flush())
            self._release(out, final=not self.stops.stopped)
            self.ended = "stop"
            return True
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()
        if self.wants_logprobs:
            self.starts.append(len(self.text) + len(self.stops.held))
            self.logprobs.append(None if logprobs is None else (
                float(logprobs[0]), [(int(i), float(v)) for i, v in logprobs[1]]))
        self.tokens.append(token)
        out = self.stops.push(self.decoder.push(token))
        if not self.stops.stopped and len(self.tokens) >= self.max_new:
            out += self.stops.end(self.decoder.flush())
            if not self.stops.stopped:
                self._release(out, final=True)
                self.ended = "length"
                return True
        self._release(out)
        if self.stops.stopped:
            self.ended = "stop"
        return self.stops.stopped

    def _release(self, out: str, *, final: bool = False) -> None:
        """Release `out`; `final`: the request ends here without a stop string's cut."""
        self.text += out
        if self.wants_logprobs:
            n = self.logprobs_released
            if final:
                n = len(self.tokens)
            while n < len(self.tokens) and self.starts[n] < len(self.text):
                n += 1
            self.logprobs_released = n
        if len(self.pieces) < len(self.tokens):  # the piece of the newest token
            while len(self.pieces) < len(self.tokens) - 1:
                self._piece("")
            self._piece(out)
        elif out:
            # Text released with no new token (held back until an end-of-sequence token or a
            # stop check): a piece of its own. The newest token's piece may already have been
            # streamed, so appending to it would lose this text on every live stream.
            self._piece(out)
        self._notify()

    def _piece(self, text: str) -> None:
        self.pieces.append(text)
        self.piece_logprobs.append(self.logprobs_released)

    def logprob_entries(self, start: int, end: int) -> list[tuple[Any, ...]]:
        """Entries [start, end) as protocol.api's TokenLogprob tuples."""
        out = []
        for i in range(start, end):
            lp = self.logprobs[i]
            out.append((self.tokens[i], None if lp is None else lp[0],
                        () if lp is None else lp[1], self.starts[i]))
        return out

    def end(self, outcome: Outcome) -> None:
        """Set how the request ended and wake the waiters (RequestTable.finish calls this)."""
        if self.done.is_set():
            return
        self.outcome = outcome
        self.done.set()
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
        async for batch in self.follow_batches(start):
            for item in batch:
                yield item

    async def follow_batches(self, start: int = 0) -> AsyncIterator[list[tuple[int, str]]]:
        """Like `follow`, but the pieces there are at each wake-up come as one list (a runner
        message brings several tokens: a stream writes them to its client at once)."""
        i = start
        while True:
            changed = self._changed
            n = len(self.pieces)
            if i < n:
                yield [(j, self.pieces[j]) for j in range(i, n)]
                i = n
                continue
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
            "error": None if self.outcome is None or self.outcome.code is None else {
                "code": self.outcome.code, "message": self.outcome.message},
        }
        return out
