"""What the HTTP edge asks of the daemon: the Protocols daemon/routes.py and daemon/ollama.py
are written against, so neither knows the Daemon (daemon/app.py satisfies them structurally).

Invariants owned here:
- `ModelHost` is what the Ollama routes use: the model services as a read-only mapping of
  `ServedModel`, the request operations (`submit`, `cancel`) and embeddings (`embed`).
- `Gateway` is what the OpenAI and native routes use on top of that: a request by id, the
  /health body, the /metrics text, the default model, sessions and flash jobs. Whatever the
  daemon assembles from its own parts (scheduler, memory guard, journal) comes here whole, so
  the routes only shape replies.
- Operations raise the daemon's domain errors (edge_agent/errors.py `ServiceError`) or
  protocol/api.py's `ApiError`; routes.py's `Router.handle` turns both into HTTP answers.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from edge_agent.daemon.flashing import FlashJobRecord, FlashRequest
    from edge_agent.daemon.requests import RequestRecord
    from edge_agent.protocol.api import GenerationRequest
    from edge_agent.protocol.embeddings import EmbeddingsRequest
    from edge_agent.scheduler import ModelLifecycle

__all__ = ["Gateway", "ModelHost", "ServedModel", "FlashJobs", "SessionResets"]


class ServedModel(Protocol):
    """What the HTTP routes read and ask of one model service (daemon/service.py)."""

    # Ollama's keep_alive: (seconds or None for "stay loaded",) until the next unload
    ttl_override: tuple[float | None] | None

    @property
    def name(self) -> str: ...

    @property
    def lifecycle(self) -> ModelLifecycle: ...

    @property
    def context(self) -> int: ...

    @property
    def max_batch(self) -> int: ...

    @property
    def budget_bytes(self) -> int | None: ...

    @property
    def ttl_s(self) -> float | None: ...

    @property
    def chat_template_file(self) -> Path | None: ...  # models.NAME.chat_template_file

    def path(self) -> Path: ...

    def ensure_tokenizer(self) -> Any: ...

    def poke(self) -> None: ...

    def to_dict(self) -> dict[str, Any]: ...

    async def load_and_wait(self) -> str | None: ...  # None, or why the load failed

    async def unload_and_wait(self) -> None: ...


class FlashJobs(Protocol):
    """The flash jobs of POST/GET /v1/flash (daemon/flashing.py's FlashService)."""

    def parse(self, body: bytes) -> FlashRequest: ...

    async def submit(self, req: FlashRequest) -> FlashJobRecord: ...

    def get(self, jid: str) -> FlashJobRecord: ...

    def ports_info(self, port: str | None) -> dict[str, Any]: ...


class SessionResets(Protocol):
    """DELETE /v1/sessions/{id} (daemon/sessions.py's Sessions)."""

    def reset(self, sid: str) -> dict[str, Any]: ...


class ModelHost(Protocol):
    """What the Ollama routes ask of the daemon."""

    @property
    def services(self) -> Mapping[str, ServedModel]: ...

    async def accept(self, req: GenerationRequest) -> RequestRecord: ...

    def cancel(self, rid: str, why: str = ...) -> RequestRecord | None: ...

    async def embed(self, req: EmbeddingsRequest) -> dict[str, Any]: ...


class Gateway(ModelHost, Protocol):
    """What the HTTP routes ask of the daemon."""

    @property
    def default_model(self) -> str: ...

    @property
    def sessions(self) -> SessionResets: ...

    @property
    def flash(self) -> FlashJobs: ...

    def find_request(self, rid: str) -> RequestRecord | None: ...

    def health(self) -> dict[str, Any]: ...  # /health's body; "status" "serving" is a 200

    def metrics_text(self) -> str: ...  # /metrics in Prometheus' text format
