"""HTTP routes of the daemon: map API requests onto the daemon's operations.

Invariants owned here:
- The routes know the daemon only as a `Gateway` (daemon/gateway.py): what they ask of it and
  nothing more; daemon/app.py's Daemon satisfies it.
- A refusal is an HTTP answer in one place, `Router.handle`: a domain error (ServiceError)
  through protocol/api.py's `api_error` (HTTP_ERRORS), an ApiError as it is.
- Every reply is JSON (`{"error": {"message", "type", "param", "code"}}` for errors, OpenAI's
  shape) except /metrics (Prometheus text) and streams (server-sent events, ending with
  `data: [DONE]` on the OpenAI routes). docs/api.md is the reference of every route.
- Under /api/ (Ollama's API, daemon/ollama.py) errors are Ollama's `{"error": message}` and
  streams NDJSON; `/` answers GET and HEAD as Ollama's does.
- /tokenize and /detokenize use the model's own tokenizer, the one generation requests are
  encoded with (`ModelService.ensure_tokenizer`); no runner is needed for them.
- A client that goes away (the transport cancels the handler or closes the stream) cancels its
  request: generation stops at the next step and its KV blocks are released.
- Unknown paths are 404, known paths with another method 405 (with Allow).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypedDict

from edge_agent.daemon import reasoning, structured
from edge_agent.daemon.gateway import Gateway, ServedModel
from edge_agent.daemon.ollama import OllamaRoutes
from edge_agent.daemon.requests import RequestRecord
from edge_agent.errors import EdgeAgentError, ServiceError
from edge_agent.protocol.api import (
    END_STATUS,
    MAX_TOKENS_LIMIT,
    SSE_DONE,
    ApiError,
    api_error,
    chat_logprobs,
    check_query,
    completion_chunk,
    completion_logprobs,
    completion_response,
    end_error,
    parse_detokenize,
    parse_generation,
    parse_tokenize,
    query_int,
    sse_event,
    usage_chunk,
)
from edge_agent.protocol.embeddings import parse_embeddings
from edge_agent.protocol.ollama import error_body as ollama_error_body
from edge_agent.protocol.ollama import is_ollama_path
from edge_agent.transports.http import Request, Response, StreamResponse

__all__ = ["Router", "transport_error_body"]

OLLAMA_ROUTES = ("Ollama's API here is GET /api/tags, /api/ps, /api/version, POST /api/chat, "
                 "/api/generate, /api/show, /api/embed, /api/embeddings (docs/api.md).")
QUERY_KEYS = {"events": ("from",), "flash_ports": ("port",)}  # other routes take no query
Reply = Response | StreamResponse


class _ChunkIds(TypedDict):
    """The `completion_chunk` arguments every chunk of one stream shares."""

    rid: str
    model: str
    created: int
    chat: bool


def _json(status: int, obj: Any, headers: tuple[tuple[str, str], ...] = ()) -> Response:
    return Response(status, json.dumps(obj, ensure_ascii=False).encode(), headers=headers)



def transport_error_body(path: str, status: int, code: str, message: str) -> bytes | None:
    """The HTTP server's own refusals (a body over the limit, a malformed body, a handler's
    internal error) in the shape of the API they interrupt: `{"error": message}` under /api/
    for Ollama's clients; None elsewhere (OpenAI's shape, the server's default)."""
    return ollama_error_body(message) if is_ollama_path(path) else None

class Router:
    def __init__(self, host: Gateway) -> None:
        self.host = host
        R = Callable[..., Awaitable[Reply]]
        self.routes: list[tuple[re.Pattern[str], dict[str, R]]] = [
            (re.compile(r"/health"), {"GET": self.health, "HEAD": self.health}),
            (re.compile(r"/metrics"), {"GET": self.metrics}),
            (re.compile(r"/v1/models"), {"GET": self.models}),
            (re.compile(r"/v1/models/(?P<name>[^/]+)"), {"GET": self.model}),
            (re.compile(r"/v1/models/(?P<name>[^/]+)/(?P<action>load|unload)"),
             {"POST": self.model_action}),
            (re.compile(r"/v1/completions"), {"POST": self.completions}),
            (re.compile(r"/v1/chat/completions"), {"POST": self.chat}),
            (re.compile(r"/v1/embeddings"), {"POST": self.embeddings}),
            (re.compile(r"/v1/requests"), {"POST": self.create_request}),
            (re.compile(r"/v1/requests/(?P<rid>[^/]+)"),
             {"GET": self.get_request, "DELETE": self.delete_request}),
            (re.compile(r"/v1/requests/(?P<rid>[^/]+)/events"), {"GET": self.events}),
            (re.compile(r"/v1/sessions/(?P<sid>[^/]+)"), {"DELETE": self.delete_session}),
            (re.compile(r"/v1/flash"), {"POST": self.flash_create}),
            (re.compile(r"/v1/flash/ports"), {"GET": self.flash_ports}),
            (re.compile(r"/v1/flash/(?P<fid>[^/]+)"), {"GET": self.flash_get}),
            (re.compile(r"/tokenize"), {"POST": self.tokenize}),
            (re.compile(r"/detokenize"), {"POST": self.detokenize}),
            *OllamaRoutes(host, max_tokens_limit=MAX_TOKENS_LIMIT).table(),  # / and /api/*
        ]

    async def handle(self, req: Request) -> Reply:
        path = req.path.rstrip("/") or "/"
        try:
            for pattern, methods in self.routes:
                m = pattern.fullmatch(path)
                if m is None:
                    continue
                fn = methods.get(req.method)
                if fn is None:
                    allow = ", ".join(sorted(methods))
                    raise ApiError(405, "method_not_allowed", f"{req.method} {path}: method not "
                                   f"allowed. Hint: use {allow}.", headers=[("allow", allow)])
                check_query(req.query, QUERY_KEYS.get(fn.__name__, ()))
                return await fn(req, **m.groupdict())
            if is_ollama_path(path):
                raise ApiError(404, "not_found", f"{req.method} {path}: no such endpoint. "
                               f"Hint: {OLLAMA_ROUTES}")
            raise ApiError(404, "not_found", f"{req.method} {path}: no such endpoint. Hint: "
                           "see GET /health, /metrics, /v1/models, /v1/models/{id}, POST "
                           "/v1/completions, /v1/chat/completions, /v1/embeddings, "
                           "/v1/requests, /tokenize, /detokenize (docs/api.md).")
        except (ApiError, ServiceError) as exc:
            err = exc if isinstance(exc, ApiError) else api_error(exc)  # a domain error's status
            if is_ollama_path(path):  # Ollama's shape: {"error": message}
                return Response(err.status, ollama_error_body(err.message), headers=err.headers)
            return Response(err.status, err.body(), headers=err.headers)
        except EdgeAgentError as exc:
            if is_ollama_path(path):
                return Response(503, ollama_error_body(str(exc)))
            return Response(503, ApiError(503, "unavailable", str(exc)).body())

    # -- status --------------------------------------------------------------------------------
    async def health(self, req: Request) -> Response:
        body = self.host.health()
        status = 200 if body["status"] == "serving" else 503
        if req.method == "HEAD":  # a probe that reads the status line only
            return Response(status, b"")
        return _json(status, body)

    async def metrics(self, req: Request) -> Reply:
        return Response(200, self.host.metrics_text().encode(),
                        content_type="text/plain; version=0.0.4; charset=utf-8")

    @staticmethod
    def _model_object(name: str, svc: ServedModel) -> dict[str, Any]:
        return {"id": name, "object": "model", "owned_by": "edge-agent", "created": 0,
                "state": svc.lifecycle.state.value, "context": svc.context,
                "max_batch": svc.max_batch}

    async def models(self, req: Request) -> Reply:
        data = [self._model_object(n, s) for n, s in self.host.services.items()]
        return _json(200, {"object": "list", "data": data})

    async def model(self, req: Request, name: str) -> Reply:
        svc = self.host.services.get(name)
        if svc is None:
            raise ApiError(404, "model_not_found", f"the model {name!r} does not exist (models: "
                           f"{', '.join(sorted(self.host.services))}). Hint: GET /v1/models "
                           "lists them.")
        return _json(200, self._model_object(name, svc))

    async def model_action(self, req: Request, name: str, action: str) -> Reply:
        svc = self.host.services.get(name)
        if svc is None:
            raise ApiError(404, "model_not_found", f"no model named {name!r}. Hint: GET "
                           "/v1/models lists them.")
        if action == "load":
            failed = await svc.load_and_wait()
            if failed is not None:
                raise ApiError(503, "model_failed", failed)
        else:
            await svc.unload_and_wait()
        return _json(200, svc.to_dict())

    # -- generation ----------------------------------------------------------------------------
    def _parse(self, req: Request, chat: bool | None) -> Any:
        # no limit given: chat runs to end-of-sequence or the context, completions stop at 16
        return parse_generation(req.body, chat=chat, max_tokens_limit=MAX_TOKENS_LIMIT)

    async def completions(self, req: Request) -> Reply:
        return await self._generate(self._parse(req, False))

    async def chat(self, req: Request) -> Reply:
        return await self._generate(self._parse(req, True))

    async def _generate(self, greq: Any) -> Reply:
        rec = await self.host.accept(greq)
        if greq.stream:
            return StreamResponse(self._openai_stream(rec))
        try:
            await rec.done.wait()
        finally:
            if not rec.done.is_set():  # the client hung up: the transport cancelled us
                self.host.cancel(rec.id, why="client disconnected")
        return self._final(rec)

    async def embeddings(self, req: Request) -> Reply:
        return _json(200, await self.host.embed(parse_embeddings(req.body)))

    def _final(self, rec: RequestRecord) -> Response:
        end = rec.outcome
        if end is not None and end.code is not None:
            err = end_error(end.code, end.message, {"id": rec.id, **end.extra()})
            return Response(err.status, err.body())
        thought, answer = reasoning.reply_parts(rec.text, self._thought(rec))
        text, calls = structured.split_reply(rec.request, answer, rec.id)
        body = completion_response(
            rid=rec.id, model=rec.model, created=rec.created, chat=rec.request.chat,
            text=text,
            finish_reason=rec.finish_reason, prompt_tokens=rec.prompt_tokens,
            completion_tokens=len(rec.tokens), tool_calls=calls,
            logprobs=self._logprobs(rec, 0, rec.logprobs_released),
            cached_tokens=rec.cached_tokens, reasoning=thought)
        return _json(200, body)

    def _thought(self, rec: RequestRecord) -> bool | None:
        """How `rec`'s reply is parsed for a thinking model's reasoning (reasoning.py)."""
        if not rec.request.chat:
            return None
        return reasoning.thought_of(rec, self.host.services[rec.model].ensure_tokenizer())

    def _logprobs(self, rec: RequestRecord, start: int, end: int) -> dict[str, Any] | None:
        """OpenAI's logprobs object for tokens [start, end) of `rec` (None: not asked)."""
        if not rec.wants_logprobs:
            return None
        tok = self.host.services[rec.model].ensure_tokenizer()
        render = chat_logprobs if rec.request.chat else completion_logprobs
        return render(rec.logprob_entries(start, end), tok.token_bytes)

    async def _openai_stream(self, rec: RequestRecord) -> AsyncIterator[bytes]:
        usage = rec.request.include_usage
        common: _ChunkIds = {"rid": rec.id, "model": rec.model, "created": rec.created,
                             "chat": rec.request.chat}
        # a thinking model's reasoning streams apart from its answer; a reply that may call
        # tools streams its text up to a call, then each call as it is written
        thought, names = self._thought(rec), structured.offered_names(rec.request)
        gate = reasoning.ReplyGate(thought, names) if thought is not None or names else None
        try:
            first = True
            sent = 0  # logprob entries sent (each piece carries those released with it)
            whole = 0  # pieces whose text has all been sent
            ends: list[int] = []  # where each piece's text ends in the reply (with a gate)
            async for batch in rec.follow_batches(0):
                out = []  # one write for the pieces of one runner message
                if gate is not None:
                    text = thinking = ""
                    for _, piece in batch:
                        said, answered = gate.feed(piece)
                        thinking += said
                        text += answered
                        ends.append(len(gate.text))
                    while whole < len(ends) and ends[whole] <= gate.sent:
                        whole += 1
                    upto = rec.piece_logprobs[whole - 1] if whole else 0
                    calls = _call_deltas(gate.take(), rec.id)
                    if text or thinking or calls or upto > sent:
                        out.append(sse_event(completion_chunk(
                            text=text, reasoning=thinking, tool_calls=calls,
                            finish_reason=None, first=first, include_usage=usage,
                            logprobs=self._logprobs(rec, sent, upto), **common)))
                        first, sent = False, upto
                else:
                    for i, piece in batch:
                        upto = rec.piece_logprobs[i]
                        if piece or upto > sent or (first and rec.request.chat):
                            out.append(sse_event(completion_chunk(
                                text=piece, finish_reason=None, first=first,
                                include_usage=usage,
                                logprobs=self._logprobs(rec, sent, upto), **common)))
                            first = False
                            sent = upto
                if out:
                    yield b"".join(out)
            end = rec.outcome
            if end is not None and end.code is not None:
                extra = {"status": END_STATUS[end.code], "id": rec.id, **end.extra()}
                yield sse_event(json.loads(end_error(end.code, end.message, extra).body()))
            else:
                finish = rec.finish_reason
                if gate is not None:
                    thinking, text = gate.rest()
                    calls = _call_deltas(gate.take(), rec.id)
                    if gate.calls and finish != "length":  # a call cut short keeps "length"
                        finish = "tool_calls"
                    if calls or text or thinking or first or rec.logprobs_released > sent:
                        yield sse_event(completion_chunk(
                            text=text, reasoning=thinking, tool_calls=calls,
                            finish_reason=None, first=first, include_usage=usage,
                            logprobs=self._logprobs(rec, sent, rec.logprobs_released), **common))
                        first, sent = False, rec.logprobs_released
                yield sse_event(completion_chunk(
                    text=None, finish_reason=finish, first=first,
                    include_usage=usage,
                    logprobs=self._logprobs(rec, sent, rec.logprobs_released), **common))
                if usage:
                    yield sse_event(usage_chunk(prompt_tokens=rec.prompt_tokens,
                                                completion_tokens=len(rec.tokens),
                                                cached_tokens=rec.cached_tokens, **common))
            yield SSE_DONE
        finally:
            if not rec.done.is_set():
                self.host.cancel(rec.id, why="client disconnected")

    # -- tokenizer (llama-server's /tokenize and /detokenize) -----------------------------------
    def _tokenizer(self, model: str | None) -> tuple[str, Any]:
        name = model or self.host.default_model
        svc = self.host.services.get(name)
        if svc is None:
            raise ApiError(404, "model_not_found", f"field 'model': no model named {name!r} "
                           f"(registered: {', '.join(sorted(self.host.services))}). Hint: GET "
                           "/v1/models lists them.")
        return name, svc.ensure_tokenizer()

    async def tokenize(self, req: Request) -> Reply:
        treq = parse_tokenize(req.body)
        _, tok = self._tokenizer(treq.model)
        add_bos = treq.add_special and bool(tok.add_bos)
        ids = [int(i) for i in tok.tokenize(treq.content, add_bos=add_bos,
                                            parse_special=treq.parse_special)]
        if not treq.with_pieces:
            return _json(200, {"tokens": ids})
        return _json(200, {"tokens": [{"id": i, "piece": _piece(tok.token_bytes(i))}
                                      for i in ids]})

    async def detokenize(self, req: Request) -> Reply:
        dreq = parse_detokenize(req.body)
        name, tok = self._tokenizer(dreq.model)
        size = int(tok.vocab_size)
        for i, t in enumerate(dreq.tokens):
            if t >= size:
                raise ApiError(400, "invalid_request", f"field 'tokens[{i}]': token id {t} is "
                               f"outside the vocabulary 0..{size - 1} of model {name!r}. Hint: "
                               "send ids this model's POST /tokenize returned.")
        return _json(200, {"content": tok.detokenize(list(dreq.tokens))})

    # -- native requests -----------------------------------------------------------------------
    def _record(self, rid: str) -> RequestRecord:
        rec = self.host.find_request(rid)  # live, or finished earlier / before a restart
        if rec is None:
            raise ApiError(404, "request_not_found", f"no request with id {rid!r} (unknown, or "
                           "forgotten after it finished). Hint: use the id POST /v1/requests "
                           "returned.")
        return rec

    async def create_request(self, req: Request) -> Reply:
        greq = self._parse(req, None)
        if greq.logprobs is not None or greq.include_usage:
            field = "logprobs" if greq.logprobs is not None else "stream_options.include_usage"
            raise ApiError(400, "unsupported_parameter", f"field {field!r}: is reported on "
                           "/v1/chat/completions and /v1/completions only, not by "
                           "/v1/requests. Hint: send the request to one of those, or remove "
                           f"{field!r}.")
        rec = await self.host.accept(greq)
        return _json(202, rec.to_dict(time.monotonic()),
                     headers=(("location", f"/v1/requests/{rec.id}"),))

    async def get_request(self, req: Request, rid: str) -> Reply:
        return _json(200, self._record(rid).to_dict(time.monotonic()))

    async def delete_request(self, req: Request, rid: str) -> Reply:
        self._record(rid)
        rec = self.host.cancel(rid)
        assert rec is not None
        await asyncio.sleep(0)
        return _json(200, rec.to_dict(time.monotonic()))

    async def events(self, req: Request, rid: str) -> Reply:
        start = query_int(req.query, "from", 0, hint="use from=N with N >= 0 (the number of "
                          "tokens already seen)")
        return StreamResponse(self._native_stream(self._record(rid), start))

    async def _native_stream(self, rec: RequestRecord, start: int) -> AsyncIterator[bytes]:
        async for batch in rec.follow_batches(start):
            yield b"".join(sse_event({"index": i, "text": piece}, event="token", event_id=i)
                           for i, piece in batch)
        yield sse_event(rec.to_dict(time.monotonic()), event="end")

    async def delete_session(self, req: Request, sid: str) -> Reply:
        return _json(200, self.host.sessions.reset(sid))

    # -- flash jobs (daemon/flashing.py) ---------------------------------------------------------
    async def flash_create(self, req: Request) -> Reply:
        job = await self.host.flash.submit(self.host.flash.parse(req.body))
        return _json(202, job.to_dict(), headers=(("location", f"/v1/flash/{job.id}"),))

    async def flash_ports(self, req: Request) -> Reply:
        port = req.query.get("port", [None])[0]
        return _json(200, self.host.flash.ports_info(port))

    async def flash_get(self, req: Request, fid: str) -> Reply:
        return _json(200, self.host.flash.get(fid).to_dict())


def _piece(raw: bytes) -> str | list[int]:
    """A token's text, or its bytes when they are not UTF-8 on their own (llama-server's rule)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


def _call_deltas(parts: list[tuple[int, str | None, str]], rid: str) -> list[dict[str, Any]]:
    """A `CallGate`'s call parts as OpenAI streams them: a new call with its index, id, type,
    name and first arguments' text, then more of its arguments' text under its index."""
    return [{"index": i, "id": structured.call_id(rid, i), "type": "function",
             "function": {"name": name, "arguments": args}} if name is not None
            else {"index": i, "function": {"arguments": args}} for i, name, args in parts]
