"""Ollama's API routes (`/api/*` and `GET /`): protocol/ollama.py's requests onto the daemon.

Invariants owned here:
- The handlers know the daemon only as a `ModelHost` (daemon/gateway.py): the model services,
  submit, cancel and embed.
- Generation goes through the same daemon operations as the OpenAI routes (`submit`, `cancel`,
  `RequestRecord.follow`): the same tokenizer and chat template, scheduler, journal and
  sampling, so a request gives the same tokens through either API.
- `keep_alive` sets the model's idle unload (`ModelService.ttl_override`) for as long as it
  stays loaded; every Ollama generation request sets it (absent: the configured ttl_s), as
  Ollama's server does. An empty prompt (or no messages) loads the model, or with
  `keep_alive` 0 unloads it, and answers once that is done.
- Streams are NDJSON: one object per released text piece, then a final object with
  `done: true` and the statistics, or `{"error": ...}` when the request failed after the
  stream began. A client that goes away cancels its request (as on the OpenAI routes).
- A chat that offers `tools` is answered as on the OpenAI route (daemon/structured.py parses
  the calls out of the reply): `message.tool_calls` in Ollama's shape and `content` the text
  before the calls ("" if none); a call whose arguments are not a JSON object (cut short, or
  malformed) is left out, as Ollama's calls carry an object. Its stream sends the text that
  can no longer be part of a call as it comes (structured.CallGate), each call in an object of
  its own once its arguments are whole, then the text held back (if any), then the final
  object.
- A model's card (GGUF metadata, parameter count, sha256 of the file) is read off the event
  loop and kept while the file is unchanged (same device, inode, size and mtime).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edge_agent.daemon import reasoning, structured
from edge_agent.daemon.gateway import ModelHost, ServedModel
from edge_agent.daemon.requests import RequestRecord
from edge_agent.errors import EdgeAgentError, ServiceError
from edge_agent.protocol.api import ApiError, api_error, end_error
from edge_agent.protocol.ollama import (
    API_VERSION,
    FOREVER_EPOCH,
    KeepAlive,
    OllamaEmbed,
    OllamaRequest,
    Stats,
    chunk,
    final,
    model_details,
    model_name,
    ndjson,
    ollama_tool_calls,
    parse_chat,
    parse_embed,
    parse_generate,
    parse_show,
    renamed,
    rfc3339,
    show_body,
)
from edge_agent.scheduler import ModelState
from edge_agent.transports.http import Request, Response, StreamResponse

__all__ = ["OllamaRoutes", "load_seconds"]

NDJSON = "application/x-ndjson"
_LOADED = (ModelState.SERVING, ModelState.IDLE, ModelState.FAILED, ModelState.UNLOADING,
           ModelState.UNLOADED)  # a load ends when the model enters one of these
Reply = Response | StreamResponse


@dataclass(frozen=True)
class _Card:
    meta: dict[str, Any]  # the GGUF's metadata without its arrays (vocabulary, merges)
    parameters: int
    dominant: str | None  # the tensor type holding the most bytes
    sha256: str
    size: int
    mtime: float


def _read_card(path: Path) -> _Card:
    from edge_agent.runtime.gguf import GGUFFile
    from edge_agent.runtime.prepare import source_sha256

    with GGUFFile(path) as g:
        meta = {k: v for k, v in g.metadata.items() if not isinstance(v, (list, tuple))}
        parameters = sum(t.n_elements for t in g.tensors.values())
        nbytes: Counter[str] = Counter()
        for t in g.tensors.values():
            nbytes[t.type_name] += t.nbytes
    st = path.stat()
    dominant = nbytes.most_common(1)[0][0] if nbytes else None
    return _Card(meta, parameters, dominant, source_sha256(path), st.st_size, st.st_mtime)


def load_seconds(history: Iterable[tuple[float, ModelState, ModelState]], t0: float,
                 t1: float) -> float:
    """Time within [t0, t1] the model spent loading (LOADING and WARMING), from its
    lifecycle's transition history."""
    total, start = 0.0, None
    for at, _frm, to in history:
        if to is ModelState.LOADING:
            start = at
        elif start is not None and to in _LOADED:
            total += max(0.0, min(at, t1) - max(start, t0))
            start = None
    if start is not None:
        total += max(0.0, t1 - max(start, t0))
    return total


def _json(status: int, obj: Any) -> Response:
    return Response(status, json.dumps(obj, ensure_ascii=False).encode())


class OllamaRoutes:
    """The handlers; `table()` gives their rows for the Router's route table."""

    def __init__(self, host: ModelHost, *, max_tokens_limit: int) -> None:
        self.host = host
        self.max_tokens_limit = max_tokens_limit
        self._cards: dict[tuple[str, int, int, int, int], _Card] = {}

    def table(self) -> list[tuple[re.Pattern[str], dict[str, Callable[..., Awaitable[Reply]]]]]:
        return [
            (re.compile(r"/"), {"GET": self.root, "HEAD": self.root}),
            (re.compile(r"/api/version"), {"GET": self.version}),
            (re.compile(r"/api/tags"), {"GET": self.tags}),
            (re.compile(r"/api/ps"), {"GET": self.ps}),
            (re.compile(r"/api/show"), {"POST": self.show}),
            (re.compile(r"/api/chat"), {"POST": self.chat}),
            (re.compile(r"/api/generate"), {"POST": self.generate}),
            (re.compile(r"/api/embed"), {"POST": self.embed}),
            (re.compile(r"/api/embeddings"), {"POST": self.embeddings}),
        ]

    # -- helpers -------------------------------------------------------------------------------
    def _service(self, model: str) -> ServedModel:
        svc = self.host.services.get(model_name(model))
        if svc is None:
            raise ApiError(404, "model_not_found", f"model {model!r} not found (models here: "
                           f"{', '.join(sorted(self.host.services))}). Hint: GET /api/tags lists "
                           "them; a [models.NAME] table in the configuration adds a GGUF.")
        return svc

    async def _card(self, svc: ServedModel) -> _Card:
        path = svc.path()
        try:
            st = os.stat(path)
        except OSError as exc:
            raise ApiError(503, "model_failed", f"model {svc.name!r}: cannot read {path}: "
                           f"{exc.strerror or exc}. Hint: check models.{svc.name}.path.") from exc
        key = (str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        card = self._cards.get(key)
        if card is None:
            card = await asyncio.to_thread(_read_card, path)
            self._cards = {k: v for k, v in self._cards.items() if k[0] != key[0]}
            self._cards[key] = card
        return card

    @staticmethod
    def _keep_alive(svc: ServedModel, ka: KeepAlive | None) -> None:
        svc.ttl_override = None if ka is None else (ka.seconds,)
        svc.poke()  # its loop recomputes when the idle model unloads

    # -- status ----------------------------------------------------------------------------------
    async def root(self, req: Request) -> Reply:
        body = b"" if req.method == "HEAD" else b"Ollama is running"
        return Response(200, body, content_type="text/plain; charset=utf-8")

    # -- embeddings ------------------------------------------------------------------------------
    async def embed(self, req: Request) -> Reply:
        return await self._embed(parse_embed(req.body))

    async def embeddings(self, req: Request) -> Reply:
        return await self._embed(parse_embed(req.body, legacy=True))

    async def _embed(self, oreq: OllamaEmbed) -> Reply:
        """The OpenAI route's path (admission, tokenization, the runner), Ollama's shapes."""
        svc = self._service(oreq.model)
        t0 = time.monotonic()
        loaded = svc.lifecycle.state in (ModelState.SERVING, ModelState.IDLE)
        body = await self.host.embed(dataclasses.replace(oreq.request, model=svc.name))
        self._keep_alive(svc, oreq.keep_alive)
        vectors = [item["embedding"] for item in body["data"]]
        if oreq.legacy:
            return _json(200, {"embedding": vectors[0]})
        total = time.monotonic() - t0
        return _json(200, {"model": oreq.model, "embeddings": vectors,
                           "total_duration": int(total * 1e9),
                           "load_duration": 0 if loaded else int(total * 1e9),
                           "prompt_eval_count": body["usage"]["prompt_tokens"]})

    async def version(self, req: Request) -> Reply:
        return _json(200, {"version": API_VERSION})

    async def tags(self, req: Request) -> Reply:
        models = []
        for name, svc in self.host.services.items():
            entry: dict[str, Any] = {"name": name, "model": name}
            try:
                card = await self._card(svc)
            except (EdgeAgentError, OSError, ValueError):
                models.append({**entry, "size": 0, "digest": "", "details": {"format": "gguf"}})
                continue  # listed all the same: POST /api/show says what is wrong
            models.append({**entry, "modified_at": rfc3339(card.mtime), "size": card.size,
                           "digest": card.sha256,
                           "details": model_details(card.meta, card.parameters, card.dominant)})
        return _json(200, {"models": models})

    async def ps(self, req: Request) -> Reply:
        models = []
        now, wall = time.monotonic(), time.time()
        for name, svc in self.host.services.items():
            st = svc.lifecycle
            if not st.resident:
                continue
            ttl = svc.ttl_s
            if ttl is None:
                expires = FOREVER_EPOCH
            elif st.idle_since is not None:
                expires = wall + (st.idle_since + ttl - now)
            else:  # in use: the countdown starts when it goes idle
                expires = wall + ttl
            card = await self._card(svc)
            models.append({"name": name, "model": name,
                           "size": svc.budget_bytes or card.size, "digest": card.sha256,
                           "details": model_details(card.meta, card.parameters, card.dominant),
                           "expires_at": rfc3339(expires), "size_vram": 0,
                           "context_length": svc.context})
        return _json(200, {"models": models})

    async def show(self, req: Request) -> Reply:
        svc = self._service(parse_show(req.body))
        card = await self._card(svc)
        template = None  # the GGUF's own, unless models.NAME.chat_template_file replaces it
        if svc.chat_template_file is not None:
            try:
                tok = await asyncio.to_thread(svc.ensure_tokenizer)
            except (EdgeAgentError, OSError) as exc:
                raise ApiError(503, "model_failed", f"model {svc.name!r} cannot be used: "
                               f"{exc}") from exc
            template = tok.chat_template.template
        return _json(200, show_body(meta=card.meta, parameters=card.parameters,
                                    dominant=card.dominant, path=str(svc.path()),
                                    context=svc.context, modified=card.mtime,
                                    template=template))

    # -- generation ----------------------------------------------------------------------------
    async def chat(self, req: Request) -> Reply:
        return await self._run(parse_chat(req.body, max_tokens_limit=self.max_tokens_limit))

    async def generate(self, req: Request) -> Reply:
        return await self._run(parse_generate(req.body, max_tokens_limit=self.max_tokens_limit))

    async def _run(self, oreq: OllamaRequest) -> Reply:
        svc = self._service(oreq.model)
        if oreq.generation is None:
            return await self._load_or_unload(svc, oreq)
        t0 = time.monotonic()
        if oreq.think and oreq.generation.chat:
            await self._check_thinks(svc)
        try:  # the schema in `format` is compiled at submission
            rec = await self.host.accept(dataclasses.replace(oreq.generation, model=svc.name))
        except (ApiError, ServiceError) as exc:  # named as Ollama's field (format)
            raise renamed(exc if isinstance(exc, ApiError) else api_error(exc)) from None
        self._keep_alive(svc, oreq.keep_alive)  # queued already: it applies once idle again
        if oreq.stream:
            return StreamResponse(self._stream(rec, oreq, svc, t0), content_type=NDJSON)
        try:
            await rec.done.wait()
        finally:
            if not rec.done.is_set():  # the client hung up: the transport cancelled us
                self.host.cancel(rec.id, why="client disconnected")
        end = rec.outcome
        if end is not None and end.code is not None:
            raise end_error(end.code, end.message)
        thought, answer = reasoning.reply_parts(rec.text, self._thought(rec, svc))
        text, calls = structured.split_reply(rec.request, answer, rec.id)
        return _json(200, final(chat=oreq.chat, model=oreq.model, now=time.time(), text=text,
                                done_reason=rec.finish_reason or "stop",
                                stats=self._stats(rec, svc, t0),
                                tool_calls=ollama_tool_calls(calls or ()) or None,
                                thinking=thought if oreq.think is not False else None))

    @staticmethod
    def _thought(rec: RequestRecord, svc: ServedModel) -> bool | None:
        """How `rec`'s reply is parsed for a thinking model's reasoning (reasoning.py)."""
        if not rec.request.chat:
            return None
        return reasoning.thought_of(rec, svc.ensure_tokenizer())

    @staticmethod
    async def _check_thinks(svc: ServedModel) -> None:
        """`think: true` for a model that does not think is a 400 (as Ollama answers it)."""
        try:
            tok = await asyncio.to_thread(svc.ensure_tokenizer)
        except (EdgeAgentError, OSError):
            return  # the submission reports the model file's fault
        if not reasoning.model_thinks(tok):
            raise ApiError(400, "invalid_request", f"field 'think': model {svc.name!r} does "
                           "not think (its chat template has no </think>). Hint: leave "
                           '"think" out, or use a thinking model (DeepSeek-R1 distills, Qwen3).',
                           param="think")

    async def _load_or_unload(self, svc: ServedModel, oreq: OllamaRequest) -> Reply:
        ka = oreq.keep_alive
        self._keep_alive(svc, ka)
        if ka is not None and ka.seconds == 0:
            await svc.unload_and_wait()
            reason = "unload"
        else:
            failed = await svc.load_and_wait()
            if failed is not None:
                raise ApiError(503, "model_failed", failed)
            reason = "load"
        return _json(200, final(chat=oreq.chat, model=oreq.model, now=time.time(), text="",
                                done_reason=reason, stats=None))

    async def _stream(self, rec: RequestRecord, oreq: OllamaRequest, svc: ServedModel,
                      t0: float) -> AsyncIterator[bytes]:
        # a thinking model's reasoning streams apart from its answer (`thinking`, left out
        # with think: false); a reply that may call tools streams its text up to a call, then
        # each call once its arguments are whole
        thought, names = self._thought(rec, svc), structured.offered_names(rec.request)
        gate = reasoning.ReplyGate(thought, names) if thought is not None or names else None
        shown = oreq.think is not False
        made = kept = 0  # calls read (whole); calls sent (those left out not counted)

        def whole() -> list[dict[str, Any]] | None:
            nonlocal made, kept
            assert gate is not None
            done = [c for c in gate.calls[made:] if c.closed]  # calls close in order
            made += len(done)
            calls = ollama_tool_calls(structured.openai_calls(done, rec.id), start=kept)
            kept += len(calls)
            return calls or None

        try:
            async for batch in rec.follow_batches(0):
                pieces = [("", piece) for _, piece in batch]
                calls = None
                if gate is not None:
                    fed = [gate.feed(piece) for _, piece in pieces]
                    pieces = [("".join(r for r, _ in fed) if shown else "",
                               "".join(a for _, a in fed))]
                    calls = whole()
                out = [ndjson(chunk(chat=oreq.chat, model=oreq.model, now=time.time(),
                                    text=text, thinking=said))
                       for said, text in pieces if said or text]
                if calls:
                    out.append(ndjson(chunk(chat=oreq.chat, model=oreq.model, now=time.time(),
                                            text="", tool_calls=calls)))
                if out:
                    yield b"".join(out)
            end = rec.outcome
            if end is not None and end.code is not None:
                yield ndjson({"error": end.message})
            else:
                calls = None
                said = text = ""
                if gate is not None:
                    said, text = gate.rest()
                    said = said if shown else ""
                    calls = whole()
                if calls or text or said:
                    yield ndjson(chunk(chat=oreq.chat, model=oreq.model, now=time.time(),
                                       text=text, tool_calls=calls, thinking=said))
                yield ndjson(final(chat=oreq.chat, model=oreq.model, now=time.time(), text="",
                                   done_reason=rec.finish_reason or "stop",
                                   stats=self._stats(rec, svc, t0)))
        finally:
            if not rec.done.is_set():
                self.host.cancel(rec.id, why="client disconnected")

    @staticmethod
    def _stats(rec: RequestRecord, svc: ServedModel, t0: float) -> Stats:
        end = time.monotonic()
        first, started = rec.first_token_at, rec.job.started_at
        prompt_s = first - started if first is not None and started is not None else 0.0
        return Stats(total_s=end - t0, load_s=load_seconds(svc.lifecycle.history, t0, end),
                     prompt_tokens=rec.prompt_tokens, prompt_s=max(0.0, prompt_s),
                     eval_tokens=len(rec.tokens),
                     eval_s=end - first if first is not None else 0.0)
