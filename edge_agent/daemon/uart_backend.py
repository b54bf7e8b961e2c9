"""The UART transports' view of the daemon: a `Backend` over `Daemon`, and starting the ports.

Invariants owned here:
- A UART request is validated by the same `parse_generation` and submitted through the same
  `Daemon.submit` as an HTTP one: same scheduler, priorities, deadlines, queue limit, records.
- `events(id, from)` is `RequestRecord.follow(from)`: token indices are the same ones
  `GET /v1/requests/{id}/events?from=N` uses, so RESUME after a line drop loses nothing the
  daemon still holds (`scheduler.keep_finished` finished requests).
- A UART port that cannot open yet does not stop the daemon (it is retried with backoff); a port
  setting that can never work is a ConfigError (exit 78) at startup.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from edge_agent.protocol.api import MAX_TOKENS_LIMIT, ApiError, parse_generation
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
    from edge_agent.daemon.app import Daemon

__all__ = ["DaemonBackend", "start_uarts", "close_uarts", "serial_ports"]

log = logging.getLogger(__name__)


class DaemonBackend:
    def __init__(self, daemon: Daemon) -> None:
        self.d = daemon

    def submit(self, prompt: str | Sequence[Mapping[str, str]], params: GenParams,
               priority: int | None, timeout_ms: int | None, session: str) -> str:
        body: dict[str, Any] = {"max_tokens": params.max_tokens,
                                "temperature": params.temperature}
        if isinstance(prompt, str):
            body["prompt"] = prompt
        else:
            body["messages"] = [dict(m) for m in prompt]
        for key, value in (("seed", params.seed), ("priority", priority),
                           ("timeout_ms", timeout_ms)):
            if value is not None:
                body[key] = value
        try:
            greq = parse_generation(body, chat=None, max_tokens_limit=MAX_TOKENS_LIMIT)
            rec = self.d.submit(greq)
        except ApiError as exc:
            raise BackendError(exc.code, exc.message) from exc
        log.info(f"{session}: request {rec.id} accepted (priority {rec.job.priority})")
        return rec.id

    async def events(self, request_id: str, from_index: int = 0) -> AsyncIterator[StreamEvent]:
        rec = self.d.records.get(request_id)
        if rec is None:
            yield Failed("not_found", f"request {request_id} is unknown or forgotten. Hint: "
                         "the daemon keeps scheduler.keep_finished finished requests.")
            return
        async for index, piece in rec.follow(from_index):
            yield Token(index, piece)
        if rec.error is not None:
            _, code, message = rec.error
            yield Failed(code, message)
        else:
            yield Done(rec.finish_reason or "stop", len(rec.tokens))

    def cancel(self, request_id: str) -> bool:
        rec = self.d.records.get(request_id)
        if rec is None or rec.done.is_set():
            return False
        self.d.cancel(request_id, why="cancelled on the serial console / by the MCU")
        return True

    def status(self) -> dict[str, Any]:
        d = self.d
        return {
            "state": d.status(),
            "uptime_s": round(time.monotonic() - d.started, 1),
            "models": {n: s.lifecycle.state.value for n, s in d.services.items()},
            "queue": {"depth": d.scheduler.depth, "queue_max": d.scheduler.config.queue_max},
            "flash": self._last_flash(),
        }

    def _last_flash(self) -> dict[str, Any] | None:
        """The newest flash job the daemon ran (daemon/flashing.py), or None."""
        jobs = getattr(getattr(self.d, "flash", None), "jobs", None)
        if not jobs:
            return None
        job = next(reversed(jobs.values())).to_dict()
        keep = ("id", "board", "port", "state", "phase", "progress", "error")
        return {k: job.get(k) for k in keep if job.get(k) is not None}

    def models(self) -> list[dict[str, Any]]:
        return [{"name": n, "state": s.lifecycle.state.value, "context": s.context,
                 "max_batch": s.max_batch} for n, s in self.d.services.items()]

    def _service(self, name: str) -> Any:
        svc = self.d.services.get(name)
        if svc is None:
            raise BackendError("model_not_found", f"no model named {name!r} (registered: "
                               f"{', '.join(sorted(self.d.services))}). Hint: `models` lists "
                               "them.")
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
        for rec in self.d.records.values():
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


async def start_uarts(daemon: Daemon) -> list[UartTransport]:
    cfg = daemon.config.serial
    backend = DaemonBackend(daemon)
    started: list[UartTransport] = []
    for url in serial_ports(daemon.config):
        settings = LinkSettings(url, baudrate=cfg.baudrate, parity=cfg.parity,
                                stopbits=cfg.stopbits, rtscts=cfg.rtscts)
        t = UartTransport(settings, backend, echo=cfg.echo, max_line=cfg.max_line,
                          mode=cfg.mode)
        try:
            await t.start()
        except BaseException:
            await close_uarts(started + [t])
            raise
        started.append(t)
        log.info(f"serial {url}: {'open' if t.link.up else 'not present yet, retrying'} "
                 f"({settings.baudrate} baud, {t.session.mode} mode)")
    return started


async def close_uarts(uarts: Sequence[UartTransport]) -> None:
    for t in uarts:
        await t.close()
