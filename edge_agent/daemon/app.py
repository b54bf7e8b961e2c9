"""Composition root: startup, main loop, shutdown of `edge-agent serve` (uvicorn's shape).

Invariants owned here:
- Signal handlers only set flags (`request_exit`); all work happens in the main loop.
- The socket listens before models load (so /health can answer 503 "loading"); READY=1 is sent
  only when every `preload = true` model has settled (serving, or failed with its reason in
  STATUS= and /health). EXTEND_TIMEOUT_USEC is sent while a load makes progress.
- WATCHDOG=1 is sent from the main loop at half of WATCHDOG_USEC, so a stuck loop is caught,
  and only while every core task is alive (`_supervise`).
- One daemon per state directory: `serve()` takes the state directory's flock
  (journal/statelock.py) before anything touches the socket or the journal; a second daemon
  exits 75 (EX_TEMPFAIL) naming the holder's pid.
- Core tasks never die silently. A model loop that ends (an exception, or returning before
  shutdown) is logged with its traceback and restarted after CORE_RESTART_DELAYS_S (the
  watchdog is not fed meanwhile); one more death within CORE_RESTART_WINDOW_S takes the daemon
  down. A journal task (journal-retention, journal-retry) that ends, or a memory-guard callback
  (cgroup events, PSI, pressure-stage timers) that raises, takes the daemon down at once:
  the reason is logged, the shutdown drains as on SIGTERM (open work stays journaled) and
  `serve()` returns 1, so Restart=on-failure brings it back with a fresh state.
- /health is "degraded" (503) with the reasons (`degraded()`) while the journal cannot be
  written or a core task waits for its restart.
- Every accepted request ends with an answer: done, cancelled, expired (504 naming queued and
  ran time), failed (503/500). On SIGTERM: STOPPING=1, running requests get up to
  `server.drain_timeout_s` to finish; with the journal on, the queued ones and those still
  running at the drain bound stay open in the journal (their clients get 503 "daemon stopping;
  request ID is kept and resumes after restart") and the next start resumes them; with it off
  they are answered 503 `shutting_down` saying they cannot resume. Either way every waiting
  client gets its answer before its connection closes (connections get the drain plus
  ANSWER_GRACE_S): a plain one the 503 with its id, a stream an `error` event naming its id,
  then `[DONE]` (tests/test_daemon_sigterm.py). Runners are stopped and reaped; the socket
  file is removed; `serve()` returns 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
import socket
import subprocess
import time
import traceback
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from edge_agent.cgroup import CgroupIO
from edge_agent.daemon import structured
from edge_agent.daemon.durable import DaemonJournal
from edge_agent.daemon.embeddings import create_embeddings
from edge_agent.daemon.flashing import FlashService
from edge_agent.daemon.health import cgroup_info, health_body, model_gauges
from edge_agent.daemon.memory_guard import MemoryGuard
from edge_agent.daemon.metrics import Metrics
from edge_agent.daemon.outcome import Outcome
from edge_agent.daemon.prestart import Prestarted
from edge_agent.daemon.request_table import RequestTable
from edge_agent.daemon.requests import RequestRecord
from edge_agent.daemon.routes import Router, transport_error_body
from edge_agent.daemon.sdnotify import Notifier, listen_fds, watchdog_interval
from edge_agent.daemon.service import ModelService
from edge_agent.daemon.sessions import Sessions
from edge_agent.daemon.uart_backend import DaemonBackend, Uarts, serial_ports
from edge_agent.errors import (
    EXIT_ERROR,
    ConfigError,
    ContextExceeded,
    EdgeAgentError,
    InvalidRequest,
    JournalFailed,
    ModelFailed,
    ModelFileError,
    ModelNotFound,
    RequestQueueFull,
    ShuttingDown,
)
from edge_agent.journal import StateDirLock
from edge_agent.protocol.api import GenerationRequest
from edge_agent.protocol.embeddings import EmbeddingsRequest
from edge_agent.runtime.chat import ChatMessageError
from edge_agent.scheduler import Job, ModelState, QueueFull, Scheduler
from edge_agent.transports.http import HttpServer

__all__ = ["Daemon"]

EXTEND_USEC = 30_000_000
ANSWER_GRACE_S = 5.0  # after the drain: time for connections to deliver their final answers
CORE_RESTART_DELAYS_S = (0.2, 1.0, 3.0)  # pauses before restarting a model loop, per death
CORE_RESTART_WINDOW_S = 600.0  # deaths counted within this; one more than the delays: exit 1
EARLY_SPAWN_WAIT_S = 2.0  # startup: longest wait for the early runners to be spawned
FLASH_GRACE_S = 10.0  # shutdown: a running flash job's time beyond the drain (and the answers)

log = logging.getLogger(__name__)
# a callback from these modules raising means the memory guard stopped working
_GUARD_MODULES = ("edge_agent.daemon.memory_guard", "edge_agent.daemon.pressure_sources",
                  "edge_agent.cgroup")


class _Accepting:
    """A request checked and waiting for its group's journal commit (Daemon.accept)."""

    __slots__ = ("svc", "rec", "now", "waiter", "error")

    def __init__(self, svc: ModelService, rec: RequestRecord, now: float) -> None:
        self.svc, self.rec, self.now = svc, rec, now
        self.waiter: asyncio.Future[None] | None = None  # accept's; None for submit
        self.error: EdgeAgentError | None = None

    def settle(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def fail(self, error: EdgeAgentError) -> None:
        self.error = error
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(error)


class Daemon:
    def __init__(self, config: Any, *, env: Mapping[str, str] = os.environ,
                 cgroup_io: Callable[[], CgroupIO] = CgroupIO,
                 prestarted: Prestarted | None = None) -> None:
        """`cgroup_io`: how cgroup files are accessed (tests pass a fake kernel's);
        `prestarted`: a runner started with the process (prestart.py) for the first llama.cpp
        load to claim; the caller discards it at exit, the daemon once READY."""
        self.config = config
        self.prestarted = prestarted
        self.env = dict(env)
        self.ready = False  # every preloaded model settled: READY=1 sent
        self.stopping = False  # SIGTERM: draining
        self.state_dir = Path(config.server.state_dir)
        self.scheduler = Scheduler(config.scheduler)
        self.metrics = Metrics()
        # the requests by id; every request ends in self.requests.finish (request_table.py)
        self.requests = RequestTable(
            self.scheduler, keep_finished=int(config.scheduler.keep_finished),
            count=self.metrics.request_done, journal=lambda rec: self.journal.finished(rec))
        self.memory = MemoryGuard(  # cgroup v2 groups, OOM kills, PSI stages
            config.cgroup, env=self.env, models=lambda: self.services,
            queued=self.scheduler.queued, stopping=lambda: self.stopping,
            shed=lambda rec, now, msg: self.requests.finish(
                rec.id, Outcome.failed("memory_pressure", msg), now),
            record_event=self._record_event, io_factory=cgroup_io)
        # filled once the journal exists: the journal and the services each use the other
        self.services: dict[str, ModelService] = {}
        # non-blocking; a failed send is logged, never raised (sdnotify.py)
        self.notifier = Notifier.from_env(self.env)
        self.journal = DaemonJournal(  # what the control plane writes; warm start from it
            config.journal, self.state_dir, services=self.services,
            submit=self.scheduler.submit, add_record=self.requests.add,
            ready=lambda: self.ready)
        self.services.update({name: ModelService(  # one loop per model (service.py)
            entry, config.runtime, state_dir=self.state_dir, host=self,
            scheduler=self.scheduler, requests=self.requests, journal=self.journal,
            memory=self.memory, metrics=self.metrics, peers=lambda: self.services)
            for name, entry in config.models.items()})
        self.sessions = Sessions(self.journal, self.services)  # `session` histories
        self.journal.sessions = self.sessions
        self.started = time.monotonic()
        self.uarts = Uarts(config.serial, serial_ports(config), DaemonBackend(  # the UART console
            submit=self.submit, cancel=self.cancel, records=self.records, models=self.services,
            state=self.status, queue=lambda: {"depth": self.scheduler.depth,
                                              "queue_max": self.scheduler.config.queue_max},
            last_flash=lambda: self.flash.newest(), started=self.started))
        self.flash = FlashService(  # POST /v1/flash on owned ports (daemon/flashing.py)
            self.state_dir, ports=[*config.flash.port_list(), *serial_ports(config)],
            max_body_bytes=int(config.server.max_body_bytes), stopping=lambda: self.stopping,
            store=lambda: self.journal.store.flash if self.journal.store is not None else None,
            port_users=self.uarts)
        self._exit = asyncio.Event()
        self._tick = asyncio.Event()
        self._accepting: list[_Accepting] = []  # prepared, waiting for their group's commit
        self._commit_soon: asyncio.Handle | None = None
        self._settled = asyncio.Event()
        self._last_extend = 0.0
        self.state_lock = StateDirLock(self.state_dir)
        self.fatal: str | None = None  # why the daemon takes itself down (serve() returns 1)
        self.context_notes: dict[str, str] = {}  # model -> why its context was capped
        self._dead: dict[str, float] = {}  # core task -> when it is restarted (monotonic)
        self._deaths: dict[str, list[float]] = {}
        self.http = HttpServer(Router(self).handle, max_body_bytes=config.server.max_body_bytes,
                               drain_timeout_s=config.server.drain_timeout_s,
                               body_limit=self._body_limit, error_body=transport_error_body)

    def _body_limit(self, method: str, path: str) -> int | None:
        """POST /v1/flash takes a whole firmware ELF (FlashService.body_limit); the rest of
        the API server.max_body_bytes."""
        return self.flash.body_limit() if (method, path) == ("POST", "/v1/flash") else None

    @property
    def records(self) -> Mapping[str, RequestRecord]:
        """The requests by id (read-only: they are added and ended through `requests`)."""
        return self.requests.records

    @property
    def default_model(self) -> str:
        """The model a request that names none goes to (`default_model` of the config)."""
        return str(self.config.default_model)

    def find_request(self, rid: str) -> RequestRecord | None:
        """A request by id: a live or recently finished one, else one the journal still holds
        (finished earlier, or before a restart); None when neither knows it."""
        rec = self.records.get(rid)
        return rec if rec is not None else self.journal.rebuild(rid)

    # -- small services for the model loops and routes -----------------------------------------
    def request_exit(self) -> None:
        self._exit.set()

    def claim_runner(self, env: Mapping[str, str]
                     ) -> tuple[subprocess.Popen[bytes], socket.socket] | None:
        return self.prestarted.claim(env) if self.prestarted is not None else None

    def _record_event(self, kind: str, message: str) -> None:
        """An entry in the journal's event log, when the journal is open."""
        if self.journal.store is not None:
            self.journal.store.record_event(kind, message)

    def status(self) -> str:
        """What /health and the UART `status` say the daemon is doing."""
        return "stopping" if self.stopping else ("serving" if self.ready else "loading")

    def notifier_extend(self, status: str) -> None:
        now = time.monotonic()
        self.notifier.status(status)
        if not self.ready and now - self._last_extend > 1.0:
            self._last_extend = now
            self.notifier.extend_timeout(EXTEND_USEC)

    def model_settled(self, svc: ModelService) -> None:
        if svc.tokenizer is not None:
            self._note_context(svc)  # a preloaded model's capped context, said at its load
        self._settled.set()
        self._settled = asyncio.Event()
        st = svc.lifecycle
        log.log(logging.WARNING if st.state is ModelState.FAILED else logging.INFO,
                f"model {svc.name}: {st.state.value}" + (f" ({st.reason})" if st.reason else ""))

    async def wait_settled(self) -> None:
        await self._settled.wait()

    def memory_limit(self) -> int:
        # the service cgroup's memory.max (ours when managed), capped by a configured budget
        limits = [int(b) for b in (self.config.runtime.memory_budget_bytes,) if b]
        cg = self.memory.service_memory_max()
        if cg is None:
            own = cgroup_info().get("memory_max")
            cg = own if isinstance(own, int) else None
        if cg is not None:
            limits.append(cg)
        if limits:
            return min(limits)
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def wait_timeout(self, now: float) -> float | None:
        nxt = self.scheduler.next_wakeup(now)
        return None if nxt is None else max(0.0, nxt - now)

    def reap(self, now: float) -> None:
        """Expire jobs past their deadline: answer 504 at once, poke their model loops."""
        for job in self.scheduler.expire(now):
            self.requests.finish(job.id, Outcome.expired(
                job.error or "deadline passed", job.queued_s(now), job.running_s(now)), now)
            svc = self.services.get(job.model)
            if svc is not None:
                svc.poke()

    def cancel(self, rid: str, why: str = "cancelled by the client") -> RequestRecord | None:
        rec = self.records.get(rid)
        if rec is None:
            return None
        if self.requests.finish(rid, Outcome.cancel(why), time.monotonic()):
            svc = self.services.get(rec.model)
            if svc is not None:
                svc.poke()
        return rec

    def health(self) -> dict[str, Any]:
        """/health's body (daemon/health.py): "serving" only when nothing degrades it."""
        return health_body(
            status=self.status(), started=self.started, services=self.services,
            queue={"depth": self.scheduler.depth, "queue_max": self.scheduler.config.queue_max,
                   **self.scheduler.counts()},
            cgroup=self.memory.health(), pressure=self.memory.pressure_dict(),
            socket=str(self.config.server.socket), journal=self.journal.health(),
            degraded=self.degraded(), context_notes=self.context_notes,
            serial=self.uarts.health())

    def metrics_text(self) -> str:
        """/metrics: the daemon's counters and model gauges, then the memory guard's."""
        return self.metrics.render(lambda: model_gauges(
            self.services.values(), depth=self.scheduler.depth, queued=self.scheduler.queued)
        ) + self.memory.render_metrics()

    async def embed(self, req: EmbeddingsRequest) -> dict[str, Any]:
        """POST /v1/embeddings (daemon/embeddings.py): admitted as a generation is, not
        journaled; OpenAI's reply body."""
        return await create_embeddings(
            req, stopping=self.stopping, check_admission=self.memory.check_admission,
            services=self.services, default_model=self.config.default_model,
            tokenizer=self._tokenizer)

    def degraded(self) -> list[str]:
        """Why the daemon cannot serve fully right now ([] when it can)."""
        reasons = []
        if self.journal.fault is not None:
            reasons.append(f"{self.journal.fault['reason']}: new requests are refused (507) "
                           "and running ones paused until a journal write succeeds")
        for name, at in self._dead.items():
            reasons.append(f"core task {name} died; restarting in "
                           f"{max(0.0, at - time.monotonic()):.1f} s")
        return reasons

    def submit(self, req: GenerationRequest) -> RequestRecord:
        """Accept `req`: journaled before this returns (in one transaction with any requests
        still waiting for their group's commit, see `accept`), or refused with the reason."""
        entry = self._prepare(req)
        self._commit_accepts()
        if entry.error is not None:
            raise entry.error
        return entry.rec

    async def accept(self, req: GenerationRequest) -> RequestRecord:
        """`submit` for the HTTP routes, journaled as a group: the requests whose handlers
        run in the same turn of the event loop are journaled in ONE transaction at the next
        turn (one fsync: a burst of 16 clients waited for 16 fsyncs, one after another, before
        the last was even queued), then queued; the id goes out only after the commit. A
        client that leaves before the commit is not journaled; one that leaves after it is
        cancelled as a client that hangs up mid-request is."""
        loop = asyncio.get_running_loop()
        entry = self._prepare(req)
        entry.waiter = loop.create_future()
        if self._commit_soon is None:
            self._commit_soon = loop.call_soon(self._commit_accepts)
        try:
            await entry.waiter
        except asyncio.CancelledError:
            if entry.rec.id in self.records:
                self.cancel(entry.rec.id, why="client disconnected")
            raise
        return entry.rec

    def _prepare(self, req: GenerationRequest) -> _Accepting:
        """Everything that may refuse `req` but its journaling: the request, its job and its
        record, waiting in `_accepting` for the group's commit (its session claimed)."""
        if self.stopping:
            raise ShuttingDown.new_request()
        self.journal.check_admission()  # 507 + Retry-After while the journal cannot be written
        self.memory.check_admission()  # 503 + Retry-After from pressure stage 2 on
        name = req.model or self.config.default_model
        svc = self.services.get(name)
        if svc is None:
            raise ModelNotFound.in_request(name, self.services)
        if req.session is not None and not req.chat:
            raise InvalidRequest(f"field 'session': session "
                                 f"{req.session!r} is a conversation of chat messages; a plain "
                                 "prompt cannot continue it. Hint: send it to "
                                 "/v1/chat/completions (or POST /v1/requests) with "
                                 "\"messages\", or drop \"session\" and send the whole prompt.")
        tok = self._tokenizer(svc)
        size = int(tok.vocab_size)
        for tid, _ in req.logit_bias:
            if tid >= size:
                raise InvalidRequest(f"field 'logit_bias.{tid}': token id "
                                     f"{tid} is outside the vocabulary 0..{size - 1} of model "
                                     f"{name!r}. Hint: use ids this model's POST /tokenize "
                                     "returns.")
        try:
            if req.session is not None:  # history + the new turn (daemon/sessions.py)
                prompt_ids = self.sessions.prompt_ids(req, name, tok)
            elif req.chat:
                prompt_ids = structured.chat_prompt(req, tok)  # tools and tool turns included
            else:
                prompt_ids = list(tok.encode(req.prompt or ""))
        except ModelFileError as exc:  # no chat template in the GGUF (or not one of Jinja)
            raw = (" On /api/generate, \"raw\": true sends the prompt as is, without the "
                   "template." if req.messages_field == "prompt" else "")
            raise InvalidRequest(f"field {req.messages_field!r}: model {name!r} cannot take "
                                 f"chat messages: {exc}{raw}") from exc
        except ChatMessageError as exc:  # the template refused them, or its render's bounds
            names = ", ".join(sorted(req.template_vars or ()))
            given = f" (rendered with the template variables {names} the request set)" \
                if names else ""
            raise InvalidRequest(f"field {req.messages_field!r}: {exc}{given}") from exc
        field = req.messages_field if req.chat else "prompt"
        if not prompt_ids:
            raise InvalidRequest(f"field {field!r}: encodes to no tokens. "
                                 "Hint: send some text.")
        if len(prompt_ids) >= svc.context and req.session is not None:
            sid = req.session
            raise ContextExceeded(f"field {field!r}: session {sid!r} has "
                                  f"outgrown the context: its history and this turn are "
                                  f"{len(prompt_ids)} tokens, the context of model {name!r} is "
                                  f"{svc.context}; the session's history is kept as it was. "
                                  f"Hint: reset it (DELETE /v1/sessions/{sid} forgets its "
                                  "history; then send this turn again, with whatever earlier "
                                  "context it needs) or continue under a new session id.")
        if len(prompt_ids) >= svc.context:
            raise ContextExceeded(f"field {field!r}: {len(prompt_ids)} tokens "
                                  f"do not fit the context of {svc.context} tokens of model "
                                  f"{name!r}. Hint: shorten the prompt or raise the model's "
                                  "context.")
        params = req.sampling_dict(secrets.randbits(32))
        grammar = structured.grammar_for(req, tok)  # 400 when the schema cannot be used
        if grammar is not None:
            params["grammar"] = grammar  # journaled with the params: a resume keeps it
        now = time.monotonic()
        job = Job(
            id=f"req-{uuid.uuid4().hex[:20]}", model=name, prompt_ids=prompt_ids,
            params=params,
            priority=req.priority if req.priority is not None else int(svc.entry.priority),
            deadline_at=None if req.timeout_ms is None else now + req.timeout_ms / 1000.0,
        )
        try:
            self.scheduler.check(job, pending=len(self._accepting))
        except QueueFull as exc:
            self.metrics.requests[(name, "rejected")] += 1
            raise RequestQueueFull(str(exc), retry_after_s=int(exc.retry_after_s + 0.999)
                                   ) from exc
        rec = RequestRecord(job=job, request=req, model=name, decoder=_decoder(tok),
                            prompt_tokens=len(prompt_ids), stop_ids=svc.stop_ids,
                            context=svc.context)
        if req.session is not None:
            self.sessions.claim(req.session, job.id)
        entry = _Accepting(svc, rec, now)
        self._accepting.append(entry)
        return entry

    def _commit_accepts(self) -> None:
        """Queue every request waiting in `_accepting`, journal them in one transaction and
        answer their waiters; on a refusal, each gets it and is taken off the queue (no await
        in between: no model loop saw them). Nothing else queues a job between their
        `_prepare` and this (queue room was checked with them counted), so
        `scheduler.submit` cannot refuse one here."""
        if self._commit_soon is not None:
            self._commit_soon.cancel()
            self._commit_soon = None
        waiting, self._accepting = self._accepting, []
        group = []
        for entry in waiting:
            if entry.waiter is not None and entry.waiter.cancelled():  # the client left
                self._release(entry)
            else:
                group.append(entry)
        if not group:
            return
        for entry in group:  # queued first: the journal keeps the deadline the queue caps
            self.scheduler.submit(entry.rec.job, entry.now)
        try:
            if self.stopping:
                raise ShuttingDown.new_request()
            self.journal.accept([e.rec for e in group])
        except EdgeAgentError as exc:
            for entry in group:
                self.scheduler.cancel(entry.rec.job.id, time.monotonic())
                self._release(entry)
                entry.fail(self._refusal(exc))
            return
        for entry in group:
            self.requests.add(entry.rec)
            entry.svc.poke()
            entry.settle()
        self._tick.set()

    def _refusal(self, exc: EdgeAgentError) -> EdgeAgentError:
        """What each request of a group the journal (or a shutdown) refused is answered."""
        if isinstance(exc, ShuttingDown):
            err: EdgeAgentError = ShuttingDown.new_request()
        elif not self.journal.writable:  # the storage refused: 507, as for the next ones
            err = self.journal.unavailable()
        else:
            err = JournalFailed(f"the request could not be journaled: {exc}", retry_after_s=5)
        err.__cause__ = exc
        return err

    def _release(self, entry: _Accepting) -> None:
        if entry.rec.request.session is not None:
            self.sessions.release(entry.rec.request.session, entry.rec.id)

    def _tokenizer(self, svc: ModelService) -> Any:
        """The model's tokenizer; a model file that cannot give one (a bad GGUF) marks the
        model FAILED with the reason, as a load would, and is 503 `model_failed` naming it."""
        try:
            tok = svc.ensure_tokenizer()
        except (EdgeAgentError, OSError, ValueError) as exc:
            reason = str(exc) if isinstance(exc, EdgeAgentError) else (
                f"model {svc.name!r}: reading {svc.entry.path or 'the model file'} failed: "
                f"{type(exc).__name__}: {exc}. Hint: check the file (edge-agent model info).")
            now = time.monotonic()
            st = svc.lifecycle
            if not st.resident and (st.state is not ModelState.FAILED or st.reason != reason):
                st.start_load(now)  # a load attempt that failed at the model file
                st.fail(now, reason)
                self.journal.model_failed(svc.name, reason)
                self.metrics.model_event(svc.name, "load_failed")
                self.model_settled(svc)
            raise ModelFailed(f"model {svc.name!r} cannot be used: {reason}", name=svc.name
                              ) from exc
        self._note_context(svc)
        return tok

    def _note_context(self, svc: ModelService) -> None:
        """Say once (log, /health) when the configured context is above what the model was
        trained for and was capped to it."""
        wanted = int(svc.entry.context)
        if svc.context < wanted and svc.name not in self.context_notes:
            note = (f"models.{svc.name}.context = {wanted} is more than model {svc.name!r} was "
                    f"trained for; capped to its context length of {svc.context} tokens (the "
                    "GGUF's context_length). Hint: set context to at most "
                    f"{svc.context} to silence this.")
            self.context_notes[svc.name] = note
            log.warning(note)

    # -- lifecycle -----------------------------------------------------------------------------
    async def serve(self) -> int:
        """Run until asked to stop: 0, or 1 when the daemon took itself down (`fatal`)."""
        self._make_state_dir()
        self.state_lock.acquire()  # before the socket and the journal: one daemon per dir
        try:
            try:
                await self.startup()
                await self.main_loop()
            finally:
                await self.shutdown()
        finally:
            self.state_lock.release()
        if self.fatal is not None:
            log.error(f"exiting with status {EXIT_ERROR}: {self.fatal}")
            return EXIT_ERROR
        return 0

    def _make_state_dir(self) -> None:
        try:
            self.state_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(
                f"server.state_dir {self.state_dir}: cannot create the state directory "
                f"({exc.strerror or exc}). Hint: point --state-dir (or server.state_dir) at a "
                "directory this user may write, e.g. /var/lib/edge-agent.") from exc

    async def startup(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_exit)
        loop.set_exception_handler(self._loop_exception)
        self._make_state_dir()
        self.memory.start(loop)  # before any runner: into supervisor/, PSI watched
        await self._load_before_journal()
        if self.journal.open() is not None:
            resumed = self.journal.resume()
            if resumed:
                log.info(f"journal: {resumed} request(s) re-queued")
        srv = self.config.server
        self.flash.check_ports(self.config.flash.port_list())  # before clients can connect
        activated = listen_fds(self.env)
        for sock in activated:
            await self.http.adopt(sock)
        if not activated:
            await self.http.listen_unix(Path(srv.socket), mode=srv.socket_mode,
                                        group=srv.socket_group or None)
        where = [str(srv.socket) if not activated else f"{len(activated)} activated socket(s)"]
        if srv.tcp:
            host, _, port = srv.tcp.rpartition(":")
            bound = await self.http.listen_tcp(host or "127.0.0.1", int(port))
            where.append(f"tcp {host or '127.0.0.1'}:{bound}")
        log.info(f"listening on {', '.join(where)}")
        await self.uarts.start()
        for svc in self.services.values():
            if svc.task is None:
                self._start_model_task(svc)
        preload = [s for s in self.services.values() if s.entry.preload]
        while not all(s.lifecycle.state in (ModelState.IDLE, ModelState.SERVING,
                                            ModelState.FAILED) for s in preload):
            self._supervise(time.monotonic())
            if self._exit.is_set():
                return
            waiter = asyncio.ensure_future(self.wait_settled())
            ex = asyncio.ensure_future(self._exit.wait())
            await asyncio.wait({waiter, ex}, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            ex.cancel()
        self.ready = True
        if self.prestarted is not None:  # nobody claimed it (e.g. its load failed first)
            await asyncio.to_thread(self.prestarted.discard)
        states = ", ".join(f"{s.name} {s.lifecycle.state.value}" for s in self.services.values())
        self.notifier.ready(f"serving on {where[0]}; models: {states}")
        log.info(f"ready: models: {states}")
        if not activated:
            sock = srv.socket
            log.info(f"try: curl --unix-socket {sock} http://localhost/health ; "
                     f"curl --unix-socket {sock} http://localhost/v1/chat/completions "
                     """-d '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 32}'""")

    async def _load_before_journal(self) -> None:
        """Start the loads that may start before the journal opens (see
        `ModelService.loads_before_journal`), and wait until their runners are spawned: each
        runner's start, model load and warm-up (0.5 s and more, in its own process) then
        overlap the journal's integrity check and recovery instead of following them."""
        early = [s for s in self.services.values() if s.loads_before_journal()]
        for svc in early:
            self._start_model_task(svc)
        end = time.monotonic() + EARLY_SPAWN_WAIT_S
        while not all(s.spawned for s in early) and time.monotonic() < end:
            await asyncio.sleep(0.005)

    async def main_loop(self) -> None:
        wd = watchdog_interval(self.env)
        while not self._exit.is_set():
            now = time.monotonic()
            self.reap(now)
            restarts = [max(0.0, at - now) for at in self._dead.values()]
            timeouts = [t for t in (wd, self.wait_timeout(now), 1.0, *restarts) if t is not None]
            self._tick.clear()
            tick = asyncio.ensure_future(self._tick.wait())
            ex = asyncio.ensure_future(self._exit.wait())
            await asyncio.wait({tick, ex}, timeout=min(timeouts),
                               return_when=asyncio.FIRST_COMPLETED)
            tick.cancel()
            ex.cancel()
            alive = self._supervise(time.monotonic())
            if wd is not None and alive and not self._exit.is_set():
                self.notifier.watchdog()

    # -- core task supervision -------------------------------------------------------------------
    def _start_model_task(self, svc: ModelService) -> None:
        svc.task = asyncio.create_task(svc.run(), name=f"model-{svc.name}")
        svc.task.add_done_callback(lambda _t: self._tick.set())  # the main loop looks at once

    def core_tasks(self) -> dict[str, asyncio.Task[None] | None]:
        tasks: dict[str, asyncio.Task[None] | None] = {
            f"model-{n}": s.task for n, s in self.services.items()}
        tasks.update(self.journal.tasks())
        return tasks

    def _supervise(self, now: float) -> bool:
        """Restart the model loops that died (when their restart is due), take the daemon down
        for any other dead core task; True when every core task is alive."""
        if self.stopping or self.fatal is not None:
            return self.fatal is None
        for name, task in self.core_tasks().items():
            if task is None or not task.done() or name in self._dead:
                continue
            if task.cancelled():
                why, exc = "was cancelled", None
            else:
                exc = task.exception()
                why = "returned" if exc is None else f"raised {type(exc).__name__}: {exc}"
            if exc is not None:
                log.error("".join(traceback.format_exception(exc)).rstrip())
            if not name.startswith("model-"):
                self.die(f"core task {name} {why}; it cannot be restarted in place. Hint: "
                         "this is a daemon bug (report it with the traceback above); the "
                         "service manager restarts the daemon and open requests resume from "
                         "the journal.")
                return False
            deaths = [t for t in self._deaths.get(name, []) if now - t < CORE_RESTART_WINDOW_S]
            deaths.append(now)
            self._deaths[name] = deaths
            if len(deaths) > len(CORE_RESTART_DELAYS_S):
                self.die(f"core task {name} {why}, its {len(deaths)}th death within "
                         f"{CORE_RESTART_WINDOW_S:.0f} s. Hint: this is a daemon bug (report "
                         "it with the traceback above); the service manager restarts the "
                         "daemon and open requests resume from the journal.")
                return False
            delay = CORE_RESTART_DELAYS_S[len(deaths) - 1]
            self._dead[name] = now + delay
            log.error(f"core task {name} {why}; restarting it in {delay:g} s (restart "
                      f"{len(deaths)} of {len(CORE_RESTART_DELAYS_S)} allowed within "
                      f"{CORE_RESTART_WINDOW_S:.0f} s); its requests continue from where they "
                      "are. Hint: this is a daemon bug: report it with the traceback above.")
        for name, at in list(self._dead.items()):
            if now >= at:
                del self._dead[name]
                self._start_model_task(self.services[name.removeprefix("model-")])
                log.info(f"core task {name}: restarted")
        return not self._dead

    def die(self, reason: str) -> None:
        """Take the daemon down: log why, drain as on SIGTERM, `serve()` returns 1."""
        if self.fatal is None:
            self.fatal = reason
            log.critical(reason)
            self.notifier.status(f"failed: {reason}"[:200])
        self.request_exit()

    def _loop_exception(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        """The event loop's error handler: logged as usual; a memory-guard callback that
        raised takes the daemon down (it would otherwise stop watching silently)."""
        loop.default_exception_handler(context)
        callback = getattr(context.get("handle"), "_callback", None)
        owner = getattr(callback, "__self__", None)
        module = type(owner).__module__ if owner is not None else str(
            getattr(callback, "__module__", "") or "")
        if callback is None or not module.startswith(_GUARD_MODULES):
            return
        exc = context.get("exception")
        what = getattr(callback, "__qualname__", repr(callback))
        self.die(f"the memory guard's callback {what} raised "
                 f"{type(exc).__name__ if exc else 'an error'}: {exc or context.get('message')}; "
                 "memory pressure and OOM kills would no longer be watched. Hint: this is a "
                 "daemon bug (report it with the traceback above); the service manager "
                 "restarts the daemon.")

    def _keep(self, rec: RequestRecord) -> None:
        """Answer a waiting client 503 while the request stays open in the journal."""
        # kept: not journaled as failed, it stays queued/running there
        self.requests.finish(rec.id, Outcome.failed(
            "shutting_down", f"daemon stopping; request {rec.id} is kept and resumes after "
            f"restart; GET /v1/requests/{rec.id}. Hint: read it there once the daemon is back.",
            kept=True), time.monotonic())

    async def _watchdog_while_stopping(self, interval: float) -> None:
        """The main loop has ended: keep proving the event loop is alive while draining, so
        systemd's watchdog does not abort a drain that takes longer than WatchdogSec."""
        while True:
            self.notifier.watchdog()
            await asyncio.sleep(interval)

    async def shutdown(self) -> None:
        wd = watchdog_interval(self.env)
        pinger = asyncio.ensure_future(self._watchdog_while_stopping(wd)) if wd else None
        try:
            await self._shutdown()
        finally:
            if pinger is not None:
                pinger.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await pinger
            self.notifier.close()

    async def _shutdown(self) -> None:
        self.stopping = True
        self.notifier.stopping("draining: finishing running requests")
        log.info("stopping: draining")
        now = time.monotonic()
        kept = self.journal.enabled  # queued work stays journaled and resumes at the next start
        for svc in self.services.values():
            for job in self.scheduler.fail_queued(svc.name, now, "daemon shutting down"):
                rec = self.records.get(job.id)
                if rec is not None and kept:
                    self._keep(rec)
                elif rec is not None:
                    self.requests.finish(rec.id, Outcome.failed(
                        "shutting_down", "the daemon is shutting down before this request "
                        "started. Hint: resubmit."), now)
            svc.poke()
        drain = float(self.config.server.drain_timeout_s)
        deadline = now + drain
        # The connections get the drain plus ANSWER_GRACE_S: every request still open at the
        # drain bound is answered first (below), then its connection delivers that answer
        # (a 503 naming the id, or a stream's error event and [DONE]); never cut before.
        http_close = asyncio.ensure_future(self.http.close(timeout=drain + ANSWER_GRACE_S))
        while (any(s.active or s.embeds for s in self.services.values())
               and time.monotonic() < deadline):
            await asyncio.sleep(0.05)
        for rec in list(self.records.values()):
            if not rec.done.is_set() and kept:
                self._keep(rec)  # its journaled tokens stay; the next start continues them
            elif not rec.done.is_set():
                self.requests.finish(rec.id, Outcome.failed("shutting_down", (
                    f"daemon stopping: request {rec.id} did not finish within the drain "
                    f"(server.drain_timeout_s = {drain:g} s) and the journal is off, so it "
                    "cannot resume. Hint: resubmit it once the daemon is back; with "
                    "[journal] enabled such requests are kept and resume after a restart.")),
                    time.monotonic())
        with contextlib.suppress(Exception):
            await asyncio.wait_for(http_close, max(1.0, deadline - time.monotonic())
                                   + ANSWER_GRACE_S + 1.0)
        # a flash job gets the drain and FLASH_GRACE_S more (a cut flash must be resumed), then
        # stops at a block boundary; all within the unit's TimeoutStopSec (60 s)
        await self.flash.wait(max(1.0, deadline - time.monotonic()) + FLASH_GRACE_S)
        await self.uarts.close()
        for svc in self.services.values():
            svc.poke()
            if svc.task is not None:
                with contextlib.suppress(BaseException):
                    await asyncio.wait_for(asyncio.shield(svc.task), 15.0)
                if not svc.task.done():
                    svc.task.cancel()
                    with contextlib.suppress(BaseException):
                        await svc.task
            if svc.runner is not None:
                await svc.runner.stop()
        self.memory.close()  # runners are reaped: remove models/*, stop watching
        self.journal.close()
        log.info("stopped")


def _decoder(tok: Any) -> Any:
    from edge_agent.runtime.detokenizer import IncrementalDecoder

    return IncrementalDecoder(tok)
