"""The daemon's refusals of a request are domain errors (edge_agent/errors.py), and each edge
answers them exactly as it answered the HTTP-shaped errors the submit path raised before: the
same status, error body and Retry-After on the OpenAI routes, the same `{"error": message}` on
Ollama's, the same code and message on the UART. The routes run over a small fake host (the
`Gateway` of daemon/gateway.py), no daemon and no model."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from edge_agent.daemon.gateway import FlashJobs, Gateway, SessionResets
from edge_agent.daemon.requests import RequestRecord
from edge_agent.daemon.routes import Router
from edge_agent.daemon.uart_backend import DaemonBackend
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
from edge_agent.protocol.api import ApiError, GenerationRequest
from edge_agent.protocol.embeddings import EmbeddingsRequest
from edge_agent.protocol.ollama import error_body as ollama_error_body
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


class FakeHost:
    """The daemon as the routes see it; `submit` raises `refusal` (when set)."""

    def __init__(self, refusal: Exception | None = None, status: str = "serving") -> None:
        self.refusal = refusal
        self.status = status
        self.models = {"m": FakeModel("m")}
        self.submitted: list[GenerationRequest] = []

    @property
    def services(self) -> Mapping[str, FakeModel]:
        return self.models

    def submit(self, req: GenerationRequest) -> RequestRecord:
        self.submitted.append(req)
        if self.refusal is not None:
            raise self.refusal
        raise AssertionError("only refusals are driven here")

    def cancel(self, rid: str, why: str = "cancelled by the client") -> RequestRecord | None:
        return None

    async def embed(self, req: EmbeddingsRequest) -> dict[str, Any]:
        raise AssertionError("not driven here")

    @property
    def default_model(self) -> str:
        return "m"

    @property
    def sessions(self) -> SessionResets:
        raise AssertionError("not driven here")

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

