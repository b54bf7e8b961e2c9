"""The UART console's backend alone, over small fakes of the daemon's operations: a domain error
from the submit path becomes the UART error code of UART_CODES (the same word the HTTP API
uses), and an unknown model is `model_not_found` naming the registered ones."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from edge_agent.daemon.uart_backend import DaemonBackend
from edge_agent.errors import AdmissionRefused, ServiceError, ShuttingDown
from edge_agent.protocol.api import api_error
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
