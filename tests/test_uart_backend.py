"""The UART console's backend alone, over small fakes of the daemon's operations: a domain error
from the submit path becomes the UART error code of UART_CODES (the same word the HTTP API
uses), and an unknown model is `model_not_found` naming the registered ones."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from edge_agent.daemon.uart_backend import DaemonBackend
from edge_agent.errors import AdmissionRefused, ServiceError, ShuttingDown
from edge_agent.protocol.api import MAX_TOKENS_LIMIT, GenerationRequest, api_error, parse_generation
from edge_agent.scheduler import ModelLifecycle
from edge_agent.transports.uart import BackendError, GenParams


class FakeModel:
    lifecycle = ModelLifecycle("m")
    context = 256
    max_batch = 2

    async def load_and_wait(self) -> str | None:
        return None

    async def unload_and_wait(self) -> None:
        return None


def backend(refusal: Exception) -> DaemonBackend:
    def submit(req: Any) -> Any:
        raise refusal

    return DaemonBackend(submit=submit, cancel=lambda rid, why: None, records={},
                         models={"m": FakeModel()}, state=lambda: "serving",
                         queue=lambda: {"depth": 0, "queue_max": 4}, last_flash=lambda: None,
                         started=0.0)


@pytest.mark.parametrize("refusal", [
    AdmissionRefused("not admitting new requests: memory pressure stage 2 (stop-admitting). "
                     "Hint: retry after 5 s.", retry_after_s=5, stage=2),
    ShuttingDown("the daemon is shutting down. Hint: retry.", retry_after_s=5),
    ServiceError("something else refused. Hint: retry."),
])
def test_domain_errors_get_the_same_code_as_on_http(refusal: ServiceError) -> None:
    with pytest.raises(BackendError) as info:
        backend(refusal).submit("hi", GenParams(4, 0.0, None), None, None, "uart0")
    assert str(info.value) == refusal.message
    assert info.value.code == api_error(refusal).code  # memory_pressure, shutting_down, ...


def test_unknown_model_names_the_registered_ones() -> None:
    b = backend(RuntimeError("not called"))
    with pytest.raises(BackendError) as info:
        asyncio.run(b.load("nope"))
    assert info.value.code == "model_not_found"
    assert str(info.value) == "no model named 'nope' (registered: m). Hint: `models` lists them."
    assert b.status()["queue"] == {"depth": 0, "queue_max": 4}
    assert b.models() == [{"name": "m", "state": "unloaded", "context": 256, "max_batch": 2}]


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}},
          "required": ["name"], "additionalProperties": False}


def test_sampling_controls_and_schema_reach_the_request_as_the_http_api_parses_them() -> None:
    """The UART's GenParams become the same GenerationRequest an HTTP body with the same
    fields gives (parse_generation is the oracle)."""
    seen: list[GenerationRequest] = []

    def submit(req: GenerationRequest) -> Any:
        seen.append(req)
        raise ShuttingDown("stop here. Hint: none.", retry_after_s=1)

    b = backend(RuntimeError())
    b._submit = submit
    fmt = {"type": "json_schema", "json_schema": {"name": "schema_3", "schema": PERSON,
                                                  "strict": True}}
    params = GenParams(12, 0.5, 7, top_k=3, top_p=0.9, min_p=0.05, presence_penalty=-1.0,
                       frequency_penalty=0.5, repeat_penalty=1.3, repeat_last_n=-1,
                       stop=("\n", "END"), logit_bias=((5, -100.0), (9, 2.5)),
                       response_format=fmt)
    with pytest.raises(BackendError):
        b.submit("A person:", params, 4, 9000, "uart0")
    http = parse_generation({
        "prompt": "A person:", "max_tokens": 12, "temperature": 0.5, "seed": 7, "top_k": 3,
        "top_p": 0.9, "min_p": 0.05, "presence_penalty": -1.0, "frequency_penalty": 0.5,
        "repeat_penalty": 1.3, "repeat_last_n": -1, "stop": ["\n", "END"],
        "logit_bias": {"5": -100, "9": 2.5}, "response_format": fmt, "priority": 4,
        "timeout_ms": 9000}, chat=None, max_tokens_limit=MAX_TOKENS_LIMIT)
    assert seen == [http]
    assert http.response_format == fmt and http.sampling_dict(0)["top_k"] == 3
    # unset fields are the HTTP API's defaults
    with pytest.raises(BackendError):
        b.submit("x", GenParams(4, 0.0, None), None, None, "uart0")
    assert seen[1] == parse_generation({"prompt": "x", "max_tokens": 4, "temperature": 0.0},
                                       chat=None, max_tokens_limit=MAX_TOKENS_LIMIT)


def test_a_schema_llguidance_cannot_compile_is_refused_naming_response_format() -> None:
    b = backend(RuntimeError("not called"))
    b.check_format({"type": "json_object"})
    b.check_format({"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
    with pytest.raises(BackendError) as info:
        b.check_format({"type": "json_schema", "json_schema": {"name": "bad", "schema": {
            "type": "object", "properties": {"a": {"$ref": "#/definitions/missing"}}}}})
    assert info.value.code == "invalid_request"
    assert str(info.value).startswith("field 'response_format': the JSON schema cannot be used "
                                      "for constrained decoding: ")
    assert "missing" in str(info.value) and "Hint:" in str(info.value)
    with pytest.raises(BackendError) as info:  # a name the HTTP API refuses too
        b.check_format({"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}})
    assert "response_format.json_schema.name" in str(info.value)
    with pytest.raises(BackendError) as info:  # a submit with a bad value: the HTTP words
        b.submit("x", GenParams(4, top_p=0.0), None, None, "uart0")
    assert info.value.code == "invalid_request" and "field 'top_p'" in str(info.value)
