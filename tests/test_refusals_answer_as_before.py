"""The daemon's refusals of a request are domain errors (edge_agent/errors.py), and each edge
answers them exactly as it answered the HTTP-shaped errors the daemon raised before: the same
status, error body and Retry-After on the OpenAI routes, the same `{"error": message}` on
Ollama's (a `response_format` error naming Ollama's `format`), the same code and message on the
UART. The routes run over a small fake host (the `Gateway` of daemon/gateway.py), no daemon and
no model. The refusals of sessions, structured output and embeddings are raised by the real
code (over fakes) and compared with the ApiError each raised before, word for word."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from edge_agent.daemon.embeddings import create_embeddings
from edge_agent.daemon.gateway import FlashJobs, Gateway, SessionResets
from edge_agent.daemon.requests import RequestRecord
from edge_agent.daemon.routes import Router
from edge_agent.daemon.service import EmbeddingError
from edge_agent.daemon.sessions import Sessions, continuation_ids
from edge_agent.daemon.structured import grammar_for
from edge_agent.daemon.uart_backend import DaemonBackend, backend_error
from edge_agent.errors import (
    ContextExceeded,
    InvalidRequest,
    JournalFailed,
    JournalNotWritable,
    ModelFailed,
    ModelNotFound,
    RequestQueueFull,
    ServiceError,
    ShuttingDown,
)
from edge_agent.journal import JournalError
from edge_agent.protocol.api import ApiError, GenerationRequest, api_error, parse_generation
from edge_agent.protocol.embeddings import EmbeddingsRequest
from edge_agent.protocol.ollama import error_body as ollama_error_body
from edge_agent.protocol.ollama import renamed
from edge_agent.runtime.constrain import check_grammar, json_grammar, tool_call_grammar
from edge_agent.scheduler import ModelLifecycle
from edge_agent.transports.http import Request, Response
from edge_agent.transports.uart import BackendError, GenParams


class FakeModel:
    """One model service as the routes see it (gateway.ServedModel)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.lifecycle = ModelLifecycle(name)
        self.context = 256
        self.max_batch = 2
        self.budget_bytes: int | None = None
        self.ttl_override: tuple[float | None] | None = None
        self.ttl_s: float | None = 300.0

    def path(self) -> Path:
        return Path(f"/nonexistent/{self.name}.gguf")

    def ensure_tokenizer(self) -> Any:
        raise AssertionError("no route here needs the tokenizer")

    def poke(self) -> None:
        return None

    def to_dict(self) -> dict[str, Any]:
        return {"state": self.lifecycle.state.value}

    async def load_and_wait(self) -> str | None:
        return None

    async def unload_and_wait(self) -> None:
        return None


class FakeSessions:
    """DELETE /v1/sessions/{id}'s view of the sessions; `reset` raises `refusal`."""

    def __init__(self, refusal: Exception | None) -> None:
        self.refusal = refusal

    def reset(self, sid: str) -> dict[str, Any]:
        if self.refusal is not None:
            raise self.refusal
        raise AssertionError("only refusals are driven here")


class FakeHost:
    """The daemon as the routes see it; `submit`, `embed` and a session reset raise `refusal`
    (when set)."""

    def __init__(self, refusal: Exception | None = None, status: str = "serving") -> None:
        self.refusal = refusal
        self.status = status
        self.models = {"m": FakeModel("m")}
        self.submitted: list[GenerationRequest] = []

    @property
    def services(self) -> Mapping[str, FakeModel]:
        return self.models

    async def accept(self, req: GenerationRequest) -> RequestRecord:
        self.submitted.append(req)
        if self.refusal is not None:
            raise self.refusal
        raise AssertionError("only refusals are driven here")

    def cancel(self, rid: str, why: str = "cancelled by the client") -> RequestRecord | None:
        return None

    async def embed(self, req: EmbeddingsRequest) -> dict[str, Any]:
        if self.refusal is not None:
            raise self.refusal
        raise AssertionError("only refusals are driven here")

    @property
    def default_model(self) -> str:
        return "m"

    @property
    def sessions(self) -> SessionResets:
        return FakeSessions(self.refusal)

    @property
    def flash(self) -> FlashJobs:
        raise AssertionError("not driven here")

    def find_request(self, rid: str) -> RequestRecord | None:
        return None

    def health(self) -> dict[str, Any]:
        return {"status": self.status, "models": {"m": self.models["m"].to_dict()}}

    def metrics_text(self) -> str:
        return "edge_agent_queue_depth 0\n"


def call(host: Gateway, method: str, path: str, body: Any = None) -> Response:
    raw = b"" if body is None else json.dumps(body).encode()
    reply = asyncio.run(Router(host).handle(Request(method, path, {}, {}, raw)))
    assert isinstance(reply, Response), reply
    return reply


# Each domain error submit raises now, and the ApiError it raised before for the same refusal.
CASES: list[tuple[ServiceError, ApiError]] = [
    (ShuttingDown("the daemon is shutting down. Hint: retry when it is back (systemd restarts "
                  "it).", retry_after_s=5),
     ApiError(503, "shutting_down", "the daemon is shutting down. Hint: retry when it is back "
              "(systemd restarts it).", headers=[("retry-after", "5")])),
    (ModelNotFound("field 'model': no model named 'x' (registered: m). Hint: GET /v1/models "
                   "lists them; add a [models.NAME] table.", name="x"),
     ApiError(404, "model_not_found", "field 'model': no model named 'x' (registered: m). "
              "Hint: GET /v1/models lists them; add a [models.NAME] table.")),
    (InvalidRequest("field 'logit_bias.999': token id 999 is outside the vocabulary 0..9 of "
                    "model 'm'. Hint: use ids this model's POST /tokenize returns."),
     ApiError(400, "invalid_request", "field 'logit_bias.999': token id 999 is outside the "
              "vocabulary 0..9 of model 'm'. Hint: use ids this model's POST /tokenize "
              "returns.")),
    (ContextExceeded("field 'messages': 300 tokens do not fit the context of 256 tokens of "
                     "model 'm'. Hint: shorten the prompt or raise the model's context."),
     ApiError(400, "context_exceeded", "field 'messages': 300 tokens do not fit the context "
              "of 256 tokens of model 'm'. Hint: shorten the prompt or raise the model's "
              "context.")),
    (RequestQueueFull("queue full (4 requests). Hint: retry after 2 s.", retry_after_s=2),
     ApiError(503, "queue_full", "queue full (4 requests). Hint: retry after 2 s.",
              headers=[("retry-after", "2")])),
    (JournalFailed("the request could not be journaled: disk I/O error", retry_after_s=5),
     ApiError(503, "journal_failed", "the request could not be journaled: disk I/O error",
              headers=[("retry-after", "5")])),
    (JournalNotWritable("the journal cannot be written (full). Hint: free space.",
                        retry_after_s=7),
     ApiError(507, "journal_unavailable", "the journal cannot be written (full). Hint: free "
              "space.", headers=[("retry-after", "7")])),
    (ModelFailed("model 'm' cannot be used: bad magic. Hint: check the file.", name="m"),
     ApiError(503, "model_failed", "model 'm' cannot be used: bad magic. Hint: check the "
              "file.")),
]
# -- the refusals of sessions, structured output and embeddings, raised by the real code -------
# Each is paired with the ApiError the same code raised before for the same refusal (copied
# from it), so the comparisons below hold the HTTP and UART answers to what they were.


def raised(fn: Callable[[], object]) -> ServiceError:
    """The domain error `fn` refuses with."""
    try:
        fn()
    except ServiceError as exc:
        return exc
    raise AssertionError(f"{fn} did not refuse")


class FakeStore:
    """The journal's sessions table, (model, history) by id (no tools); deleting one fails."""

    def __init__(self, stored: Mapping[str, tuple[str, list[int]]]) -> None:
        self.stored = dict(stored)

    def get_session(self, sid: str) -> SimpleNamespace | None:
        found = self.stored.get(sid)
        return None if found is None else SimpleNamespace(model=found[0], history=found[1],
                                                          tools=None, calls={})

    def delete_session(self, sid: str) -> bool:
        raise JournalError("disk I/O error")


class FakeJournal:
    """What Sessions asks of the journal: its store (None: journal off), write admission."""

    def __init__(self, store: FakeStore | None = None) -> None:
        self.store = store

    def check_admission(self) -> None:
        return None


class NotExtendingTemplate:
    """A chat template that renders a longer conversation as other tokens than the shorter
    one's (its first token counts the messages), so a session cannot continue over it."""

    chat_template = None

    def apply_chat_template(self, messages: Sequence[Any], add_generation_prompt: bool = True,
                            **kw: Any) -> list[int]:
        return [len(messages)] + [1] * len(messages)


def sessions(stored: Mapping[str, tuple[str, list[int]]] | None = None,
             busy: Mapping[str, str] = {}) -> Sessions:  # noqa: B006 - read only
    s = Sessions(FakeJournal(None if stored is None else FakeStore(stored)), {})
    for sid, rid in busy.items():
        s.claim(sid, rid)
    return s


def chat(**body: Any) -> GenerationRequest:
    return parse_generation({"messages": [{"role": "user", "content": "Hi"}], **body},
                            chat=True, max_tokens_limit=64)


BAD_SCHEMA = {"type": "object", "minProperties": "x"}
SCHEMA_FAULT = check_grammar(json_grammar(BAD_SCHEMA))
TOOL_FAULT = check_grammar(tool_call_grammar([{"name": "f", "parameters": BAD_SCHEMA}],
                                             tags=False))
assert SCHEMA_FAULT is not None and TOOL_FAULT is not None

# Refused by Daemon.submit's helpers: they reach every edge through submit.
SUBMIT_CASES: list[tuple[ServiceError, ApiError]] = [
    (raised(lambda: sessions(busy={"s1": "req-1"}).prompt_ids(chat(session="s1"), "m", None)),
     ApiError(409, "session_busy", "field 'session': session 's1' has request req-1 still "
              "open. Hint: wait for it (GET /v1/requests/req-1) before the next turn.")),
    (raised(lambda: sessions({"s1": ("other", [1, 2])}).prompt_ids(chat(session="s1"), "m",
                                                                   None)),
     ApiError(409, "session_model_mismatch", "field 'session': session 's1' is a "
              "conversation with model 'other', this request is for 'm'. Hint: use that "
              "model, or a new session id.")),
    (raised(lambda: continuation_ids(NotExtendingTemplate(),
                                     [{"role": "user", "content": "Hi"}])),
     ApiError(400, "session_template", "field 'session': this model's chat template does not "
              "render a later turn as an extension of the conversation, so its history cannot "
              "be continued token for token. Hint: send the whole conversation in `messages` "
              "without `session`.")),
    (raised(lambda: grammar_for(chat(tools=[{"type": "function", "function": {"name": "f"}}],
                                     tool_choice="required",
                                     response_format={"type": "json_object"}), None)),
     ApiError(400, "invalid_request", "field 'response_format': cannot be combined with "
              'tool_choice "required" (the reply is a tool call). Hint: drop response_format, '
              'or use tool_choice "auto".', param="response_format")),
    (raised(lambda: grammar_for(chat(response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": BAD_SCHEMA}}), None)),
     ApiError(400, "invalid_request", "field 'response_format': the JSON schema cannot be "
              f"used for constrained decoding: {SCHEMA_FAULT}. Hint: fix the schema; "
              "docs/api.md lists the JSON Schema keywords supported.",
              param="response_format")),
    (raised(lambda: grammar_for(chat(tools=[{"type": "function", "function": {
        "name": "f", "parameters": BAD_SCHEMA}}], tool_choice="required"),
        SimpleNamespace(chat_template=None))),
     ApiError(400, "invalid_request", "field 'tools': a function's parameters cannot be used "
              f"for constrained decoding: {TOOL_FAULT}. Hint: fix the schema; docs/api.md "
              "lists the JSON Schema keywords supported.", param="tools")),
]
CASES += SUBMIT_CASES

# Refused by DELETE /v1/sessions/{id}.
RESET_CASES: list[tuple[ServiceError, ApiError]] = [
    (raised(lambda: sessions(busy={"s1": "req-1"}).reset("s1")),
     ApiError(409, "session_busy", "session 's1' has request req-1 still open. Hint: wait for "
              "it (GET /v1/requests/req-1) or cancel it, then reset.")),
    (raised(lambda: sessions({"s1": ("m", [1])}).reset("s1")),
     ApiError(503, "journal_failed", "session 's1': could not be reset: disk I/O error",
              headers=[("retry-after", "5")])),
    (raised(lambda: sessions({}).reset("s1")),
     ApiError(404, "session_not_found", "no session 's1' (never used, already reset, or "
              "forgotten after journal.session_max_age_s). Hint: a new turn with this id "
              "starts it afresh.")),
]


class FakeEmbedder:
    """A model service as create_embeddings uses it: vectors of 4, a context of 8."""

    context = 8
    embedding_length = 4

    def __init__(self, refusal: str | None = None,
                 failure: EmbeddingError | None = None) -> None:
        self.refusal = refusal
        self.failure = failure

    def embedding_refusal(self) -> str | None:
        return self.refusal

    async def embed(self, lists: list[list[int]]) -> list[list[float]]:
        if self.failure is not None:
            raise self.failure
        return [[0.0] * 4 for _ in lists]


class FakeVocab:
    """A vocabulary of 10 ids: one token per character."""

    vocab_size = 10

    def tokenize(self, text: str, add_bos: bool, parse_special: bool) -> list[int]:
        return [1] * len(text)


def embedding_refusal(inputs: Sequence[str | tuple[int, ...]] = ("hi",), *, single: bool = True,
                      model: str | None = None, dimensions: int | None = None,
                      stopping: bool = False, svc: FakeEmbedder | None = None) -> ServiceError:
    req = EmbeddingsRequest(inputs=tuple(inputs), single=single, model=model,
                            encoding_format="float", dimensions=dimensions)
    services: Any = {"e": svc or FakeEmbedder()}
    return raised(lambda: asyncio.run(create_embeddings(
        req, stopping=stopping, check_admission=lambda: None, services=services,
        default_model="e", tokenizer=lambda svc: FakeVocab())))


# Refused by POST /v1/embeddings (and Ollama's /api/embed).
EMBED_CASES: list[tuple[ServiceError, ApiError]] = [
    (embedding_refusal(stopping=True),
     ApiError(503, "shutting_down", "the daemon is shutting down. Hint: retry when it is back "
              "(systemd restarts it).", headers=[("retry-after", "5")])),
    (embedding_refusal(model="x"),
     ApiError(404, "model_not_found", "field 'model': no model named 'x' (registered: e). "
              "Hint: GET /v1/models lists them; add a [models.NAME] table.")),
    (embedding_refusal(svc=FakeEmbedder(refusal="model 'e' declares no pooling type. Hint: "
                                                "set models.e.pooling.")),
     ApiError(400, "model_not_embedding", "field 'model': model 'e' declares no pooling type. "
              "Hint: set models.e.pooling.")),
    (embedding_refusal(dimensions=3),
     ApiError(400, "invalid_request", "field 'dimensions': 3, but model 'e' gives vectors of "
              "4. Hint: leave dimensions out or send 4; vectors are not shortened.")),
    (embedding_refusal([(1, 12)]),
     ApiError(400, "invalid_request", "field 'input[1]': token id 12 is outside the "
              "vocabulary 0..9 of model 'e'. Hint: send ids this model's POST /tokenize "
              "returned.")),
    (embedding_refusal(["hi", ""], single=False),
     ApiError(400, "invalid_request", "field 'input[1]': encodes to no tokens. Hint: send "
              "some text.")),
    (embedding_refusal(["x" * 9]),
     ApiError(400, "context_exceeded", "field 'input': input 0 is 9 tokens, more than the "
              "context of 8 tokens of model 'e'. Hint: split it into shorter pieces, or raise "
              "models.e.context.")),
    (embedding_refusal(svc=FakeEmbedder(failure=EmbeddingError(
        "model 'e': the engine computes no embeddings.", refused=True))),
     ApiError(400, "model_not_embedding", "field 'model': model 'e': the engine computes no "
              "embeddings.")),
    (embedding_refusal(svc=FakeEmbedder(failure=EmbeddingError(
        "model 'e': the runner died (exit 9). Hint: see the log."))),
     ApiError(503, "embedding_failed", "model 'e': the runner died (exit 9). Hint: see the "
              "log.")),
]

IDS = [before.code for _, before in CASES]


@pytest.mark.parametrize(("refusal", "before"), CASES, ids=IDS)
def test_an_openai_route_answers_a_refusal_byte_for_byte_as_before(
        refusal: ServiceError, before: ApiError) -> None:
    host = FakeHost(refusal)
    reply = call(host, "POST", "/v1/chat/completions",
                 {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
    assert host.submitted, "the route submitted the request"
    assert reply == Response(before.status, before.body(), headers=before.headers)


@pytest.mark.parametrize(("refusal", "before"), CASES, ids=IDS)
def test_ollama_routes_answer_a_refusal_as_before(refusal: ServiceError,
                                                  before: ApiError) -> None:
    reply = call(FakeHost(refusal), "POST", "/api/chat",
                 {"model": "m", "messages": [{"role": "user", "content": "Hi"}],
                  "stream": False})
    before = renamed(before)  # the Ollama route named response_format as its `format`
    assert reply == Response(before.status, ollama_error_body(before.message),
                             headers=before.headers)


@pytest.mark.parametrize(("refusal", "before"), CASES, ids=IDS)
def test_the_uart_answers_a_refusal_with_the_code_and_message_of_before(
        refusal: ServiceError, before: ApiError) -> None:
    def submit(req: GenerationRequest) -> RequestRecord:
        raise refusal

    backend = DaemonBackend(submit=submit, cancel=lambda rid, why: None, records={},
                            models={}, state=lambda: "serving",
                            queue=lambda: {"depth": 0, "queue_max": 4},
                            last_flash=lambda: None, started=0.0)
    with pytest.raises(BackendError) as info:
        backend.submit("hi", GenParams(4, 0.0, None), None, None, "uart0")
    assert (info.value.code, str(info.value)) == (before.code, before.message)


@pytest.mark.parametrize(("refusal", "before"), SUBMIT_CASES + RESET_CASES + EMBED_CASES,
                         ids=[b.code for _, b in SUBMIT_CASES + RESET_CASES + EMBED_CASES])
def test_sessions_structured_output_and_embeddings_refuse_as_before(
        refusal: ServiceError, before: ApiError) -> None:
    """The domain error each raises maps to the ApiError it raised before (status, body,
    headers) and to the UART code and message that ApiError gave."""
    assert not isinstance(refusal, ApiError)
    after = api_error(refusal)
    assert (after.status, after.body(), after.headers) == (before.status, before.body(),
                                                            before.headers)
    uart = backend_error(refusal)
    assert (uart.code, str(uart)) == (before.code, before.message)


def test_the_schema_refusal_names_format_on_ollama_routes() -> None:
    refusal, before = SUBMIT_CASES[4]
    reply = call(FakeHost(refusal), "POST", "/api/chat",
                 {"model": "m", "messages": [{"role": "user", "content": "Hi"}],
                  "format": {"type": "object"}, "stream": False})
    assert json.loads(reply.body)["error"].startswith("field 'format': the JSON schema")
    assert reply.body == ollama_error_body(before.message.replace("'response_format'",
                                                                  "'format'"))


@pytest.mark.parametrize(("refusal", "before"), RESET_CASES,
                         ids=[b.code for _, b in RESET_CASES])
def test_a_session_reset_refusal_answers_as_before(refusal: ServiceError,
                                                   before: ApiError) -> None:
    reply = call(FakeHost(refusal), "DELETE", "/v1/sessions/s1")
    assert reply == Response(before.status, before.body(), headers=before.headers)


@pytest.mark.parametrize(("refusal", "before"), EMBED_CASES,
                         ids=[b.code for _, b in EMBED_CASES])
def test_the_embeddings_routes_answer_a_refusal_as_before(refusal: ServiceError,
                                                          before: ApiError) -> None:
    reply = call(FakeHost(refusal), "POST", "/v1/embeddings", {"input": "hi"})
    assert reply == Response(before.status, before.body(), headers=before.headers)
    reply = call(FakeHost(refusal), "POST", "/api/embed", {"model": "m", "input": "hi"})
    assert reply == Response(before.status, ollama_error_body(before.message),
                             headers=before.headers)


def test_health_is_200_only_while_serving_and_passes_the_body_through() -> None:
    ok = call(FakeHost(status="serving"), "GET", "/health")
    assert ok.status == 200
    assert json.loads(ok.body) == {"status": "serving", "models": {"m": {"state": "unloaded"}}}
    for status in ("loading", "degraded", "stopping"):
        assert call(FakeHost(status=status), "GET", "/health").status == 503, status


def test_model_routes_read_the_services_and_unknown_ids_are_404() -> None:
    host = FakeHost()
    listed = json.loads(call(host, "GET", "/v1/models").body)
    assert [m["id"] for m in listed["data"]] == ["m"]
    assert listed["data"][0]["context"] == 256
    missing = call(host, "GET", "/v1/models/nope")
    assert missing.status == 404 and json.loads(missing.body)["error"]["code"] == (
        "model_not_found")
    gone = call(host, "GET", "/v1/requests/req-x")
    assert gone.status == 404 and json.loads(gone.body)["error"]["code"] == "request_not_found"
    metrics = call(host, "GET", "/metrics")
    assert metrics.body == b"edge_agent_queue_depth 0\n"
    assert metrics.content_type.startswith("text/plain")

