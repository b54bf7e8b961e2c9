"""The narrow seam between the UART transport and the daemon: `Backend` and its stream events.

Invariants owned here:
- A transport needs only these nine calls; the daemon's adapter (daemon/uart_backend.py) maps
  them onto the same scheduler, priorities, deadlines and request records as the HTTP API.
- `GenParams` fields left at None / () are the daemon's defaults; `response_format` is the HTTP
  API's object ({"type": "json_object"} or {"type": "json_schema", "json_schema": {...}}).
- `check_format(response_format)` raises BackendError when the daemon could not decode with it
  (the same check a GENERATE with it would meet), so a schema is refused when registered.
- `events(id, from_index)` yields `Token(index, text)` (index = generated-token index, text =
  whole UTF-8 characters, possibly "") and ends with exactly one `Done` or `Failed`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from edge_agent.errors import EdgeAgentError
from edge_agent.protocol.frame_ext import SamplingExtras

__all__ = ["GenParams", "Token", "Done", "Failed", "StreamEvent", "Backend", "BackendError"]


@dataclass(frozen=True)
class GenParams(SamplingExtras):
    max_tokens: int = 64
    temperature: float = 0.0
    seed: int | None = None
    response_format: Mapping[str, Any] | None = None  # None: free text


@dataclass(frozen=True)
class Token:
    index: int
    text: str


@dataclass(frozen=True)
class Done:
    reason: str  # stop | length | cancelled
    tokens: int


@dataclass(frozen=True)
class Failed:
    code: str  # queue_full | deadline_exceeded | not_found | shutting_down | failed | ...
    message: str


StreamEvent = Token | Done | Failed


class BackendError(EdgeAgentError):
    """A request the backend refused; `code` is a short machine word (e.g. queue_full)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class Backend(Protocol):
    def submit(self, prompt: str | Sequence[Mapping[str, str]], params: GenParams,
               priority: int | None, timeout_ms: int | None, session: str) -> str: ...

    def check_format(self, response_format: Mapping[str, Any]) -> None: ...

    def events(self, request_id: str, from_index: int = 0) -> AsyncIterator[StreamEvent]: ...

    def cancel(self, request_id: str) -> bool: ...

    def status(self) -> dict[str, Any]: ...

    def models(self) -> list[dict[str, Any]]: ...

    async def load(self, name: str) -> str: ...

    async def unload(self, name: str) -> str: ...

    def jobs(self) -> list[dict[str, Any]]: ...
