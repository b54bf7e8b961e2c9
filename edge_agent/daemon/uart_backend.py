"""The UART transports' view of the daemon: a `Backend` over the daemon's operations, the one
mapping of domain errors to UART error codes, and the transports of `serial.port` (`Uarts`).

Invariants owned here:
- `DaemonBackend` gets only what it uses (the composition root, daemon/app.py, wires it):
  `submit`, `cancel`, the request records, the model services (`ConsoleModel`), the daemon's
  state, the queue's depth and the newest flash job.
- A UART request is validated by the same `parse_generation` and submitted through the same
  `Daemon.submit` as an HTTP one: same scheduler, priorities, deadlines, queue limit, records.
  Its sampling controls and `response_format` go into that body under the HTTP API's names, so
  `_response_format` shapes the format and `structured.grammar_for` compiles it as for HTTP;
  `check_format` runs those two alone (a schema registered on a port is checked at once).
- A domain error (edge_agent/errors.py `ServiceError`) becomes a `BackendError` here only
  (`backend_error`, codes from UART_CODES: the same words as the HTTP API's `code`).
- `events(id, from)` is `RequestRecord.follow(from)`: token indices are the same ones
  `GET /v1/requests/{id}/events?from=N` uses, so RESUME after a line drop loses nothing the
  daemon still holds (`scheduler.keep_finished` finished requests).
- A UART port that cannot open yet does not stop the daemon (it is retried with backoff); a port
  setting that can never work is a ConfigError (exit 78) at startup. A transport paused for a
  flash job (`Uarts.pause`) is started again by `Uarts.resume`, whatever the job's outcome.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from edge_agent.daemon.structured import grammar_for
from edge_agent.errors import (
    AdmissionRefused,
    ContextExceeded,
    EmbeddingFailed,
    InvalidRequest,
    JournalFailed,
    JournalNotWritable,
    ModelFailed,
    ModelNotEmbedding,
    ModelNotFound,
    RequestQueueFull,
    ServiceError,
    SessionBusy,
    SessionModelMismatch,
    SessionNotContinuable,
    SessionNotFound,
    ShuttingDown,
)
from edge_agent.protocol.api import MAX_TOKENS_LIMIT, ApiError, GenerationRequest, parse_generation
from edge_agent.protocol.frame_ext import SAMPLING_EXTRAS
from edge_agent.transports.backend import Backend
from edge_agent.transports.serial_link import LinkSettings
from edge_agent.transports.uart import (
    BackendError,
    Done,
    Failed,
    GenParams,
    StreamEvent,
    Token,
    UartTransport,
)

if TYPE_CHECKING:
    from edge_agent.config import SerialConfig
    from edge_agent.daemon.requests import RequestRecord
    from edge_agent.scheduler import ModelLifecycle

__all__ = ["DaemonBackend", "ConsoleModel", "Uarts", "UART_CODES", "UART_END_CODES",
           "backend_error", "serial_ports"]

log = logging.getLogger(__name__)

# The one place the daemon's domain errors (edge_agent/errors.py) get a UART error code;
# protocol/api.py's HTTP_ERRORS is the HTTP counterpart (same words as its `code`).
UART_CODES: dict[type[ServiceError], str] = {
    ShuttingDown: "shutting_down",
    AdmissionRefused: "memory_pressure",
    ModelNotFound: "model_not_found",
    ModelFailed: "model_failed",
    InvalidRequest: "invalid_request",
    ContextExceeded: "context_exceeded",
    RequestQueueFull: "queue_full",
    JournalFailed: "journal_failed",
    JournalNotWritable: "journal_unavailable",
    SessionBusy: "session_busy",
    SessionModelMismatch: "session_model_mismatch",
    SessionNotContinuable: "session_template",
    SessionNotFound: "session_not_found",
    ModelNotEmbedding: "model_not_embedding",
    EmbeddingFailed: "embedding_failed",
}

# The UART error code of each code a request can end with (daemon/outcome.py's EndCode; the
# same words as the HTTP API's `code`, whose status is protocol/api.py's END_STATUS).
UART_END_CODES: dict[str, str] = {
    "deadline_exceeded": "deadline_exceeded",
    "memory_pressure": "memory_pressure",
    "shutting_down": "shutting_down",
    "runner_error": "runner_error",
    "runner_failed": "runner_failed",
    "model_failed": "model_failed",
    "budget_exceeded": "budget_exceeded",
    "failed": "failed",
}


def backend_error(exc: ServiceError) -> BackendError:
    """The UART answer to a domain error: the code of its nearest class in UART_CODES
    (`unavailable` if none) and its message as is."""
    code = next((UART_CODES[c] for c in type(exc).__mro__ if c in UART_CODES), "unavailable")
    return BackendError(code, exc.message)


class ConsoleModel(Protocol):
    """What the console reads and asks of one model service (daemon/service.py)."""

    @property
    def lifecycle(self) -> ModelLifecycle: ...

    @property
    def context(self) -> int: ...

    @property
    def max_batch(self) -> int: ...

    async def load_and_wait(self) -> str | None: ...  # None, or why the load failed

    async def unload_and_wait(self) -> None: ...


def _sampling(params: GenParams) -> list[tuple[str, Any]]:
    """The request-body fields of `params` beyond max_tokens / temperature / seed (None: unset,
    the daemon's default)."""
    out: list[tuple[str, Any]] = [(k, getattr(params, k)) for k in SAMPLING_EXTRAS
                                  if k not in ("stop", "logit_bias")]
    return [*out, ("stop", list(params.stop) or None),
            ("logit_bias", {str(t): b for t, b in params.logit_bias} or None),
            ("response_format", None if params.response_format is None
             else json.loads(json.dumps(params.response_format)))]


class DaemonBackend:
    def __init__(self, *, submit: Callable[[GenerationRequest], RequestRecord],
                 cancel: Callable[[str, str], object], records: Mapping[str, RequestRecord],
                 models: Mapping[str, ConsoleModel], state: Callable[[], str],
                 queue: Callable[[], dict[str, int]],
                 last_flash: Callable[[], dict[str, Any] | None],
                 started: float) -> None:
        """`submit` / `cancel(id, why)`: the daemon's request operations; `records`: requests by
        id; `models`: services by name; `state()`: loading / serving / stopping; `queue()`:
        depth and queue_max; `last_flash()`: the newest flash job's summary or None."""
        self._submit = submit
        self._cancel = cancel
        self.records = records
        self.services = models
        self.state = state
        self.queue = queue
        self.last_flash = last_flash
        self.started = started

    def submit(self, prompt: str | Sequence[Mapping[str, str]], params: GenParams,
               priority: int | None, timeout_ms: int | None, session: str) -> str:
        body: dict[str, Any] = {"max_tokens": params.max_tokens,
                                "temperature": params.temperature}
        if isinstance(prompt, str):
            body["prompt"] = prompt
        else:
            body["messages"] = [dict(m) for m in prompt]
        for key, value in (("seed", params.seed), ("priority", priority),
                           ("timeout_ms", timeout_ms), *_sampling(params)):
            if value is not None:
                body[key] = value
        try:
            greq = parse_generation(body, chat=None, max_tokens_limit=MAX_TOKENS_LIMIT)
        except ApiError as exc:  # a body the HTTP API's parser refuses, in its words
            raise BackendError(exc.code, exc.message) from exc
        try:
            rec = self._submit(greq)
        except ServiceError as exc:
            raise backend_error(exc) from exc
        log.info(f"{session}: request {rec.id} accepted (priority {rec.job.priority})")
        return rec.id

    def check_format(self, response_format: Mapping[str, Any]) -> None:
        """BackendError (code invalid_request, naming response_format) when a request with
        this format would be refused: the same parse and grammar check as a submit."""
        try:
            req = parse_generation({"prompt": "-", "response_format": dict(response_format)},
                                   chat=False, max_tokens_limit=MAX_TOKENS_LIMIT)
        except ApiError as exc:  # a body the HTTP API's parser refuses, in its words
            raise BackendError(exc.code, exc.message) from exc
        try:
            grammar_for(req, None)  # no tools: the tokenizer is not consulted
        except ServiceError as exc:  # a schema that cannot be compiled: InvalidRequest
            raise backend_error(exc) from exc

    async def events(self, request_id: str, from_index: int = 0) -> AsyncIterator[StreamEvent]:
        rec = self.records.get(request_id)
        if rec is None:
            yield Failed("not_found", f"request {request_id} is unknown or forgotten. Hint: "
                         "the daemon keeps scheduler.keep_finished finished requests.")
            return
        async for index, piece in rec.follow(from_index):
            yield Token(index, piece)
        end = rec.outcome
        if end is not None and end.code is not None:
            yield Failed(UART_END_CODES[end.code], end.message)
        else:
            yield Done(rec.finish_reason or "stop", len(rec.tokens))

    def cancel(self, request_id: str) -> bool:
        rec = self.records.get(request_id)
        if rec is None or rec.done.is_set():
            return False
        self._cancel(request_id, "cancelled on the serial console / by the MCU")
        return True

    def status(self) -> dict[str, Any]:
        return {
            "state": self.state(),
            "uptime_s": round(time.monotonic() - self.started, 1),
            "models": {n: s.lifecycle.state.value for n, s in self.services.items()},
            "queue": self.queue(),
            "flash": self.last_flash(),
        }

    def models(self) -> list[dict[str, Any]]:
        return [{"name": n, "state": s.lifecycle.state.value, "context": s.context,
                 "max_batch": s.max_batch} for n, s in self.services.items()]

    def _service(self, name: str) -> ConsoleModel:
        svc = self.services.get(name)
        if svc is None:
            raise backend_error(ModelNotFound(
                f"no model named {name!r} (registered: {', '.join(sorted(self.services))}). "
                "Hint: `models` lists them.", name=name))
        return svc

    async def load(self, name: str) -> str:
        svc = self._service(name)
        failed = await svc.load_and_wait()
        if failed is not None:
            raise BackendError("model_failed", f"model {name}: {failed}")
        return f"{name}: {svc.lifecycle.state.value}"

    async def unload(self, name: str) -> str:
        svc = self._service(name)
        await svc.unload_and_wait()
        return f"{name}: {svc.lifecycle.state.value}"

    def jobs(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        out = []
        for rec in self.records.values():
            if rec.done.is_set():
                continue
            job = rec.job
            out.append({"id": rec.id, "model": rec.model, "state": job.state.value,
                        "priority": job.priority, "tokens": len(rec.tokens),
                        "queued_s": round(job.queued_s(now), 1)})
        return out


def serial_ports(config: Any) -> list[str]:
    """`serial.port` may name several ports, comma-separated."""
    return [p.strip() for p in str(config.serial.port or "").split(",") if p.strip()]


class Uarts:
    """The UART transports of `serial.port` (one per port), all over one backend."""

    def __init__(self, cfg: SerialConfig, ports: Sequence[str], backend: Backend) -> None:
        self.cfg = cfg
        self.ports = list(ports)
        self.backend = backend
        self.transports: list[UartTransport] = []

    def _transport(self, settings: LinkSettings) -> UartTransport:
        return UartTransport(settings, self.backend, echo=self.cfg.echo,
                             max_line=self.cfg.max_line, mode=self.cfg.mode)

    async def start(self) -> None:
        cfg = self.cfg
        for url in self.ports:
            settings = LinkSettings(url, baudrate=cfg.baudrate, parity=cfg.parity,
                                    stopbits=cfg.stopbits, rtscts=cfg.rtscts, dtr=cfg.dtr,
                                    rts=cfg.rts)
            t = self._transport(settings)
            try:
                await t.start()
            except BaseException:
                self.transports.append(t)
                await self.close()
                raise
            self.transports.append(t)
            log.info(f"serial {url}: {'open' if t.link.up else 'not present yet, retrying'} "
                     f"({settings.baudrate} baud, {t.session.mode} mode)")

    def health(self) -> list[dict[str, Any]]:
        """/health's `serial`: each port's link, up or not, and how often it was lost."""
        keep = ("url", "up", "link_lost", "reopens", "open_failures")
        return [{k: s[k] for k in keep if k in s} for s in (t.link.stats()
                                                           for t in self.transports)]

    async def close(self) -> None:
        transports, self.transports = self.transports, []
        for t in transports:
            await t.close()

    async def pause(self, same_board: Callable[[str], bool]) -> list[LinkSettings]:
        """Close the transports on ports `same_board(url)` accepts (a flash job takes the
        board); what `resume` needs to start them again."""
        paused = []
        for t in list(self.transports):
            settings = t.link.settings
            if same_board(settings.url):
                log.info(f"flash: closing the UART transport on {settings.url} for the job")
                await t.close()
                self.transports.remove(t)
                paused.append(settings)
        return paused

    async def resume(self, paused: Sequence[LinkSettings]) -> None:
        for settings in paused:
            t = self._transport(settings)
            try:
                await t.start()
            except Exception as exc:  # noqa: BLE001 - the daemon keeps running without it
                log.warning(f"UART transport on {settings.url} did not restart after "
                            f"flashing: {exc}")
                continue
            self.transports.append(t)
