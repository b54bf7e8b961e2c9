"""Conversation sessions: the token history behind the API's `session` field.

A request with `"session": S` is prefixed with S's history (the exact token ids the model saw in
the earlier turns), so a chat continues, after a restart too, without the client resending it.

Invariants owned here:
- A session's history is what the model has seen, token for token: each finished turn's prompt
  ids, its generated tokens and, for chat, the template's turn end (`<|im_end|>` + newline for
  ChatML, `<end_of_turn>` + newline for Gemma). Turn N+1's prompt is history + the ids of the
  new messages only (no second BOS or default system prompt).
- Tools: the first turn's prompt lists its tools as a request without a session would
  (daemon/structured.py), so every later turn must send the same `tools` (`InvalidRequest`
  naming the field otherwise); the session keeps them and the function name behind each call
  id its turns made, so a later turn's tool result names the function it answers.
- At most one request per session is open at a time (another is refused with `SessionBusy`,
  HTTP 409 `session_busy`), so the history only grows by whole finished turns; a turn that
  fails or is cancelled leaves the history as it was.
- The history lives in the journal (`sessions` table) when it is enabled, in memory otherwise;
  a session belongs to one model (using it with another is `SessionModelMismatch`, HTTP 409
  `session_model_mismatch`).
- Refusals are domain errors (edge_agent/errors.py); the edges map them to HTTP and UART.
- Histories are read on use, one primary-key lookup by session id; nothing about sessions is
  loaded at start, so a start does not slow down with the number of sessions kept.
- Saving a turn's history and clearing that turn's `session_pending` mark are one transaction,
  so a start re-applies exactly the done turns whose save did not happen.
"""

from __future__ import annotations

import json
import logging
import sqlite3
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from edge_agent.daemon import reasoning, structured
from edge_agent.errors import (
    InvalidRequest,
    JournalFailed,
    SessionBusy,
    SessionModelMismatch,
    SessionNotContinuable,
    SessionNotFound,
)
from edge_agent.journal import JournalError, JournalStore
from edge_agent.protocol.api import GenerationRequest

if TYPE_CHECKING:
    from edge_agent.daemon.requests import RequestRecord

__all__ = ["Sessions", "continuation_ids"]

log = logging.getLogger(__name__)


def continuation_ids(tok: Any, messages: list[dict[str, Any]], **extra: Any) -> list[int]:
    """The chat-template ids of `messages` as a later turn of a conversation: what the template
    appends after an earlier exchange (no second BOS or default system prompt), the generation
    prompt at the end; `extra`: the template's keyword arguments (`tools`), the same for both
    renders. Works for any template that renders a longer conversation as an extension of a
    shorter one (ChatML, Gemma, Llama 3, Phi-3, ...); SessionNotContinuable for one that does
    not."""
    earlier = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    skip = list(tok.apply_chat_template(earlier, add_generation_prompt=False, **extra))
    full = list(tok.apply_chat_template(earlier + messages, **extra))
    if full[: len(skip)] != skip:
        raise SessionNotContinuable("field 'session': this model's chat template does not "
                                    "render a later turn as an extension of the conversation, "
                                    "so its history cannot be continued token for token. Hint: "
                                    "send the whole conversation in `messages` without "
                                    "`session`.")
    return full[len(skip):]


class _Kept(NamedTuple):
    """What a session keeps: its model, token history, tools (`structured.tools_key` of its
    first turn) and {call id: function name} of the calls its turns made."""

    model: str
    history: list[int]
    tools: str | None
    calls: dict[str, str]


def _listed(tools: str | None) -> str:
    if tools is None:
        return "no tools"
    return "the tools " + ", ".join(str(f.get("name")) for f in json.loads(tools))


class SessionJournal(Protocol):
    """What sessions need of the journal: its store while open (None: journal off), and the
    admission check that refuses a write the storage cannot take."""

    @property
    def store(self) -> JournalStore | None: ...

    def check_admission(self) -> None: ...


class SessionModel(Protocol):
    """What sessions need of a model service: its vocabulary (the chat turn's end), its engine
    and the snapshot queue of its prompt cache."""

    engine: str | None
    to_snapshot: dict[str, list[int]]

    def ensure_tokenizer(self) -> Any: ...

    def poke(self) -> None: ...


class Sessions:
    def __init__(self, journal: SessionJournal, models: Mapping[str, SessionModel]) -> None:
        self.journal = journal
        self.models = models
        self.busy: dict[str, str] = {}  # session -> id of its open request
        self._memory: dict[str, _Kept] = {}  # when the journal is off

    def _kept(self, sid: str, model: str) -> _Kept:
        store = self.journal.store
        if store is not None:
            s = store.get_session(sid)
            found = None if s is None else _Kept(s.model, s.history, s.tools, s.calls)
        else:
            found = self._memory.get(sid)
        if found is None:
            return _Kept(model, [], None, {})
        if found.model != model:
            raise SessionModelMismatch(f"field 'session': session {sid!r} is a conversation "
                                       f"with model {found.model!r}, this request is for "
                                       f"{model!r}. Hint: use that model, or a new session id.",
                                       session=sid, session_model=found.model, model=model)
        return found

    def prompt_ids(self, req: GenerationRequest, model: str, tok: Any) -> list[int]:
        """History + the new turn's ids (the whole prompt when there is no history yet)."""
        assert req.session is not None
        sid = req.session
        if sid in self.busy:
            rid = self.busy[sid]
            raise SessionBusy(f"field 'session': session {sid!r} has request {rid} still "
                              f"open. Hint: wait for it (GET /v1/requests/{rid}) before the "
                              "next turn.", session=sid, request_id=rid)
        kept = self._kept(sid, model)
        hist = list(kept.history)
        if not req.chat:
            return hist + list(tok.encode(req.prompt or ""))
        if not hist:
            return structured.chat_prompt(req, tok)
        tools = structured.tools_key(req)
        if tools != kept.tools:
            first, now = _listed(kept.tools), _listed(tools)
            raise InvalidRequest(f"field 'tools': session {sid!r} began with {first}; this "
                                 f"turn has {now}{' defined otherwise' if first == now else ''}"
                                 ". The history lists the first turn's tools to the model, so "
                                 "every turn of a session sends the same ones. Hint: send the "
                                 "first turn's tools again (tool_choice may change), or start a "
                                 f"new session id (DELETE /v1/sessions/{sid} forgets this one).")
        msgs, extra = structured.template_messages(req, tok, names=kept.calls, listing=False)
        return hist + continuation_ids(tok, msgs, **extra)

    def reset(self, sid: str) -> dict[str, Any]:
        """Forget a session's history (DELETE /v1/sessions/{id}): the way out of a session
        that outgrew its model's context. SessionBusy while a turn is open, SessionNotFound
        when unknown, JournalNotWritable / JournalFailed when the journal refuses."""
        if sid in self.busy:
            rid = self.busy[sid]
            raise SessionBusy(f"session {sid!r} has request {rid} still open. Hint: wait for "
                              f"it (GET /v1/requests/{rid}) or cancel it, then reset.",
                              session=sid, request_id=rid)
        store = self.journal.store
        if store is not None:
            self.journal.check_admission()  # 507 while the journal cannot be written
            s = store.get_session(sid)
            found = None if s is None else (s.model, len(s.history))
            if found is not None:
                try:
                    store.delete_session(sid)
                except (JournalError, sqlite3.Error) as exc:
                    raise JournalFailed(f"session {sid!r}: could not be reset: {exc}",
                                        retry_after_s=5) from exc
        else:
            mem = self._memory.pop(sid, None)
            found = None if mem is None else (mem.model, len(mem.history))
        if found is None:
            raise SessionNotFound(f"no session {sid!r} (never used, already reset, or "
                                  "forgotten after journal.session_max_age_s). Hint: a new "
                                  "turn with this id starts it afresh.", session=sid)
        return {"id": sid, "model": found[0], "forgotten_tokens": found[1], "reset": True}

    def claim(self, sid: str, rid: str) -> None:
        self.busy[sid] = rid

    def release(self, sid: str, rid: str) -> None:
        if self.busy.get(sid) == rid:
            del self.busy[sid]

    def finished(self, rec: RequestRecord, done: bool) -> None:
        """A turn ended: free the session; when it is done, its history grows by the turn."""
        sid = rec.request.session
        if sid is None:
            return
        self.release(sid, rec.id)
        if not done:
            return
        history = list(rec.job.prompt_ids) + list(rec.tokens)
        req = rec.request
        tools, calls = None, {}
        if req.chat:
            history += self._turn_end(rec.model)
            before = self._kept_quietly(sid, rec.model)
            tools = structured.tools_key(req)
            tok = self.models[rec.model].ensure_tokenizer()
            answer = reasoning.reply_parts(rec.text, reasoning.thought_of(rec, tok))[1]
            calls = {**before.calls, **structured.call_names(req, answer, rec.id)}
        store = self.journal.store
        if store is None:
            self._memory[sid] = _Kept(rec.model, history, tools, calls)
            return
        try:
            store.save_session(sid, rec.model, history, turn=rec.id, tools=tools, calls=calls)
        except JournalError as exc:
            log.warning(f"journal: session {sid}: could not save turn {rec.id}: {exc}")
            return
        svc = self.models.get(rec.model)
        if svc is not None and svc.engine == "llamacpp":  # its prompt cache survives a restart
            svc.to_snapshot[sid] = history
            svc.poke()

    def _kept_quietly(self, sid: str, model: str) -> _Kept:
        """What is kept of `sid` before the turn that just ended (nothing when it cannot be
        read: the turn's own names are then the only ones kept)."""
        try:
            return self._kept(sid, model)
        except (SessionModelMismatch, JournalError, sqlite3.Error) as exc:
            log.warning(f"journal: session {sid}: could not read its earlier calls: {exc}")
            return _Kept(model, [], None, {})

    def _turn_end(self, model: str) -> list[int]:
        return list(self.models[model].ensure_tokenizer().turn_end_ids())
