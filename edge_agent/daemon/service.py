"""One registered model in the control plane: its lifecycle, its runner and its decode loop.

Invariants owned here:
- One asyncio task per model drives everything about it; only that task talks to its runner, so
  steps are strictly ordered. Each loop turn sends ONE message: releases (finished, cancelled
  or expired sequences), prefill of the jobs `Scheduler.take` starts now, one decode step of the
  sequences already running. New sequences therefore join at the next step (continuous batching).
- The one exception: `embed` (sentence embeddings) sends its own `embed` messages. They wait
  for the runner's lock (`RunnerHandle.call`: one request outstanding) and so run between two
  steps, each of at most EMBED_MSG_TOKENS input tokens, so a long embedding request delays a
  step by one such message at most. While one runs the model is in use: no ttl unload, no
  eviction, and the shutdown drain waits for it.
- One step of lookahead: a turn sends the next message BEFORE it takes in the previous reply,
  so the runner never waits for the control plane between steps. A sequence whose token is
  still in flight is stepped ahead only when that token cannot end it by length (its KV never
  outgrows the context); one that the in-flight token ends (end-of-sequence, a stop string, a
  cancel) costs one wasted step whose token is dropped. Tokens are taken in, journaled and
  streamed in step order, exactly as without lookahead.
- A sequence is released in the first message built after its job ends for any reason (at
  most two steps later), so KV slots are freed within two steps of a cancel, a deadline or a
  disconnect.
- A runner death (EOF on its socketpair) requeues every running job through
  `Scheduler.requeue` and sets the model back to UNLOADED; the loop reloads it at once when
  jobs wait. A job that produced a token in the attempt that ended is always requeued (a
  killed runner costs no request that makes progress); `max_retries` bounds only the deaths in
  a row without one (beyond -> FAILED, answered 503). No request is left without an answer.
- Load failures fail the model's queued jobs (503 naming the reason) and leave the lifecycle in
  FAILED with that reason; the next request retries the load.
- An idle model unloads after `ttl_s` seconds: models.NAME.ttl_s, or the `keep_alive` of the
  last Ollama request (`ttl_override`, set by daemon/ollama.py) until the model unloads.
- While the journal cannot be written (`DaemonJournal.writable` false) no step runs and no job
  starts: running requests pause (their sequences stay in the runner) and continue when the
  journal pokes the loop. A loop that dies anyway is restarted by the daemon (app.py).
- Which jobs run is the scheduler's to say: `active` is read from it (its running jobs of this
  model whose request has not ended). The service keeps only what its runner holds (the
  sequences added and not released yet), so each turn releases those whose job ended.
- A service knows the daemon only through what its constructor is given (daemon/app.py wires
  them): the `ServiceHost`, the scheduler (`ModelQueue`), the request table
  (`ServiceRequests`), the journal (`ServiceJournal`), the memory guard (`RunnerMemory`), the
  metrics and the other services as `Peer`s; a load that needs their memory asks them to
  unload through `request_unload()`, as the memory guard and the `unload` command do.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from edge_agent.daemon.ipc import (
    AddSeq,
    Embed,
    Embedded,
    Message,
    Progress,
    Ready,
    Restore,
    Restored,
    RunnerGone,
    Snapshot,
    SnapshotData,
    Status,
    Step,
    StepResult,
)
from edge_agent.daemon.metrics import Metrics
from edge_agent.daemon.outcome import EndCode, Outcome
from edge_agent.daemon.prestart import runner_env
from edge_agent.daemon.requests import RequestRecord
from edge_agent.daemon.supervisor import RunnerHandle
from edge_agent.errors import EdgeAgentError, ModelFileError
from edge_agent.journal import JournalError, JournalStore
from edge_agent.scheduler import (
    RUNNER_BASE_BYTES,
    BudgetExceeded,
    Job,
    JobState,
    LoadedModel,
    ModelLifecycle,
    ModelState,
    model_budget_bytes,
    plan_load,
)

if TYPE_CHECKING:
    import socket
    import subprocess

    from edge_agent.config import RuntimeConfig

__all__ = ["ModelService", "EmbeddingError", "EvictionTimeout", "EMBED_MSG_TOKENS",
           "ServiceHost", "ModelQueue", "ServiceRequests", "ServiceJournal", "RunnerMemory",
           "Peer"]

log = logging.getLogger(__name__)

EVICT_WAIT_S = 60.0  # how long a load waits for the models it evicts to unload
EVICT_ROUNDS = 3
MAX_STEPS = 16  # decode steps in one runner message, at most (runtime.step_window_ms)
EMBED_MSG_TOKENS = 512  # input tokens of one `embed` runner message (more inputs: more messages)
KV_SNAPSHOT_BYTES = 256 << 20  # KV snapshots kept in the journal, all models (newest first)
EMBED_ATTEMPTS = 2  # runs of an embedding request's remaining messages (a runner death: one more)


class EvictionTimeout(EdgeAgentError):
    """A load could not make room: the models it evicted did not unload in time."""


class EmbeddingError(EdgeAgentError):
    """An embedding request the model cannot serve; `refused` when the model or its engine
    computes no embeddings (the request's fault, not the daemon's)."""

    def __init__(self, message: str, *, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused


class ServiceHost(Protocol):
    """What a model loop asks of the daemon around it (daemon/app.py's `Daemon` is one)."""

    @property
    def stopping(self) -> bool: ...  # shutting down: no load, no new job; unload once idle

    def reap(self, now: float) -> None: ...  # expire the jobs past their deadline (every model)

    def wait_timeout(self, now: float) -> float | None: ...  # until the scheduler's next event

    def memory_limit(self) -> int: ...  # bytes the resident models' budgets must fit in

    def notifier_extend(self, status: str) -> None: ...  # a load makes progress (sd_notify)

    def model_settled(self, svc: ModelService) -> None: ...  # loaded, failed or unloaded

    async def wait_settled(self) -> None: ...  # until the next model_settled

    # a pre-started runner with this environment (prestart.py), once; None: spawn one
    def claim_runner(self, env: Mapping[str, str]
                     ) -> tuple[subprocess.Popen[bytes], socket.socket] | None: ...


class ModelQueue(Protocol):
    """What a model loop asks of the scheduler (scheduler/queue.py), which owns every job's
    state: which of this model's jobs wait, which run, and their starts, requeues, failures."""

    def queued(self, model: str) -> int: ...

    def running_ids(self, model: str) -> list[str]: ...

    def take(self, model: str, free_slots: int, now: float) -> list[Job]: ...

    def fail_queued(self, model: str, now: float, error: str) -> list[Job]: ...

    def requeue(self, job_ids: Iterable[str], now: float, reason: str = ...,
                progressed: Collection[str] = ...) -> list[Job]: ...


class ServiceRequests(Protocol):
    """The request table (daemon/request_table.py): the records by id, and the one way a
    request ends."""

    def get(self, rid: str) -> RequestRecord | None: ...

    def finish(self, rid: str, outcome: Outcome, now: float) -> bool: ...


class ServiceJournal(Protocol):
    """What a model loop writes to and reads from the journal (daemon/durable.py)."""

    @property
    def store(self) -> JournalStore | None: ...  # None: the journal is off (KV snapshots)

    @property
    def writable(self) -> bool: ...  # False: a write was refused; no step runs meanwhile

    def cached_tokenizer(self, name: str, path: Path) -> Any: ...

    def begin_step(self) -> None: ...

    async def commit_step(self) -> None: ...

    def started(self, rids: list[str]) -> None: ...

    def token(self, rec: RequestRecord, before: int) -> None: ...

    def model_loaded(self, name: str, path: Path, ready: Ready, tokenizer: Any) -> None: ...

    def model_failed(self, name: str, reason: str) -> None: ...


class RunnerMemory(Protocol):
    """What a model loop asks of the memory guard (daemon/memory_guard.py): its runner's
    cgroup around a spawn and a reap, the batch limit under pressure, what /health shows."""

    def runner_hook(self, name: str, budget: int | None) -> Callable[[int], None] | None: ...

    def runner_exited(self, name: str) -> str | None: ...

    def batch_limit(self, max_batch: int) -> int: ...

    def model_dict(self, name: str) -> dict[str, Any]: ...


class Peer(Protocol):
    """Another model service as a load that makes room sees it (LRU eviction)."""

    @property
    def name(self) -> str: ...

    @property
    def budget_bytes(self) -> int | None: ...

    @property
    def lifecycle(self) -> ModelLifecycle: ...

    def in_use(self) -> bool: ...

    def request_unload(self) -> None: ...


class ModelService:
    def __init__(self, entry: Any, runtime: RuntimeConfig, *, state_dir: Path,
                 host: ServiceHost, scheduler: ModelQueue, requests: ServiceRequests,
                 journal: ServiceJournal, memory: RunnerMemory, metrics: Metrics,
                 peers: Callable[[], Mapping[str, Peer]]) -> None:
        """`entry`: the model's configuration (models.NAME); `runtime`: the engine settings
        every runner gets; `state_dir`: passed to the runner; `peers()`: the model services
        by name (this one included), asked to unload when a load needs their memory."""
        self.entry = entry
        self.name: str = entry.name
        self.runtime = runtime
        self.state_dir = state_dir
        self.host = host
        self.scheduler = scheduler
        self.requests = requests
        self.journal = journal
        self.memory = memory
        self.metrics = metrics
        self.peers = peers
        self.lifecycle = ModelLifecycle(self.name, time.monotonic())
        self.runner: RunnerHandle | None = None
        # the sequences the runner holds (added, not released yet), in the order they were
        # added; which jobs run is the scheduler's to say (`active`)
        self._held: dict[str, None] = {}
        self.to_release: list[str] = []
        self.to_snapshot: dict[str, list[int]] = {}  # session -> tokens of its finished turn
        self.wake = asyncio.Event()
        self.load_requested = bool(entry.preload)
        self._unload_requested = False  # request_unload(): unload once idle
        # keep_alive of the last Ollama request (daemon/ollama.py): (seconds or None for
        # "stay loaded",) in place of entry.ttl_s until the next unload; None: entry.ttl_s
        self.ttl_override: tuple[float | None] | None = None
        self.tokenizer: Any = None
        self._tokenizer_lock = threading.Lock()  # ensure_tokenizer runs in a thread at load
        self.engine: str | None = None  # resolved with the budget: "llamacpp" or "numpy"
        self.engine_info: dict[str, Any] | None = None  # the runner's describe() of its load
        self.batch_invariant: bool | None = None  # measured by the runner at warm-up
        self.tokenizer_from: str | None = None  # "journal" (warm cache) or "gguf" (built)
        self.tokenizer_s: float | None = None
        self.stop_ids: frozenset[int] = frozenset()
        self.context: int = int(entry.context)
        self.max_batch: int = int(entry.max_batch)
        self.budget_bytes: int | None = None
        self.lock: dict[str, Any] | None = None
        self.free_blocks: int | None = None
        self.total_blocks: int | None = None
        self.loaded = asyncio.Event()  # set while SERVING/IDLE
        self.task: asyncio.Task[None] | None = None
        # the step sent to the runner whose reply is not taken in yet (one step of lookahead)
        self._inflight: asyncio.Future[Message] | None = None
        self._inflight_size = 0
        self._pending: dict[str, int] = {}  # sequences with tokens in that reply: at most how many
        self._decode_s: dict[int, float] = {}  # one decode step, smoothed, by batch size
        self._long_out = False  # the last step message written runs several decode steps
        self._hurried = False  # and the runner was asked to end it early
        self._out_ids: tuple[str, ...] = ()  # the sequences that message steps
        self._built = 0  # step messages built (a message's late adds need it to be the last)
        self._load_progress: tuple[int, int] | None = None
        self.facts: Any = None  # the GGUF's ModelFacts (llamacpp engine), read with the budget
        self.embeds = 0  # embedding requests using the runner now (embed())

    # -- control-plane helpers -----------------------------------------------------------------
    def path(self) -> Path:
        return Path(self.entry.resolve_path())

    @property
    def chat_template_file(self) -> Path | None:
        path: Path | None = self.entry.chat_template_file
        return path

    def ensure_tokenizer(self) -> Any:
        """Tokenizer and memory budget from the GGUF metadata (read once, no weights). Safe
        from a worker thread (`_load` overlaps it with the runner's start); a second caller
        waits for the first."""
        with self._tokenizer_lock:
            if self.tokenizer is None:
                self.ensure_budget()
                t0 = time.perf_counter()
                if self.engine == "llamacpp":
                    from edge_agent.runtime.engines import open_tokenizer

                    self.tokenizer_from = "gguf"
                    tok = open_tokenizer("llamacpp", self.path(), checked=(
                        self.facts.stamp if self.facts is not None else ""))
                    if self.chat_template_file is not None:
                        try:
                            tok.use_template_file(self.chat_template_file)
                        except BaseException:
                            tok.close()
                            raise
                else:
                    if self.chat_template_file is not None:
                        raise ModelFileError(
                            f"models.{self.name}.chat_template_file: the numpy engine renders "
                            "ChatML itself and takes no template file. Hint: serve this "
                            'model on the llama.cpp engine (runtime.engine = "llamacpp"), or '
                            "remove the key.")
                    tok = self._numpy_tokenizer()
                self.tokenizer_s = time.perf_counter() - t0
                self.stop_ids = frozenset(getattr(tok, "eog_ids", None) or {tok.eos_id})
                self.tokenizer = tok
            return self.tokenizer

    def ensure_budget(self) -> None:
        """The engine, the context cap and the memory budget. On the llama.cpp engine from
        the GGUF's metadata alone (its dimensions: weights as stored, KV cache as llama.cpp
        sizes it, buffers), so a load can start its runner before the vocabulary is read;
        the numpy engine reads both together (ensure_tokenizer)."""
        if self.engine is not None and (self.facts is not None or self.engine != "llamacpp"):
            return
        from edge_agent.runtime.engines import (
            FACTS_CACHE,
            LLAMACPP_RUNNER_BASE_BYTES,
            cached_model_facts,
            llamacpp_budget_bytes,
            resolve_engine,
        )

        engine = resolve_engine(self.runtime.engine)
        if engine == "llamacpp":
            facts = cached_model_facts(self.path(), self.state_dir / FACTS_CACHE)
            if facts.context_length:
                self.context = min(self.context, facts.context_length)
            # a model that pools (its own pooling type, or models.NAME.pooling) creates an
            # embedding context at its first embedding request: its memory counts from the
            # start
            self.budget_bytes = llamacpp_budget_bytes(
                facts, self.max_batch, self.context, overhead_bytes=LLAMACPP_RUNNER_BASE_BYTES,
                embeddings=self._pooling(facts) is not None)
            self.facts = facts
        self.engine = engine

    def _numpy_tokenizer(self) -> Any:
        from edge_agent.runtime.gguf import GGUFFile
        from edge_agent.runtime.model import ModelConfig
        from edge_agent.runtime.prepare import prepared_size
        from edge_agent.runtime.tokenizer import Tokenizer

        g = GGUFFile(self.path())
        meta = g.metadata
        cfg = ModelConfig.from_metadata(meta, source=str(self.path()))
        self.context = min(self.context, cfg.context_length)
        dtype = self.runtime.dtype
        # the runner process itself counts too: planning and the cgroup's memory.high /
        # memory.max (policy factors of this budget) must leave it room to even load
        self.budget_bytes = model_budget_bytes(
            prepared_size(g, dtype), cfg.n_layers, cfg.n_kv_heads, cfg.head_dim,
            self.max_batch, self.context, overhead_bytes=RUNNER_BASE_BYTES,
        )
        # warm start: the tokenizer from the journal's cache when this file is known there
        tok = self.journal.cached_tokenizer(self.name, self.path())
        self.tokenizer_from = "journal" if tok is not None else "gguf"
        if tok is None:
            tok = Tokenizer.from_metadata(meta, source=str(self.path()))
        return tok

    def _pooling(self, facts: Any) -> str | None:
        from edge_agent.runtime.engines import embedding_pooling

        return embedding_pooling(facts.pooling_type, self.entry.pooling)

    def embedding_refusal(self) -> str | None:
        """Why this model computes no sentence embeddings (None: it does); after
        ensure_tokenizer() (the engine is resolved and the GGUF's metadata read with it)."""
        if self.engine != "llamacpp":
            return (f"model {self.name!r}: engine {self.engine} computes no embeddings. Hint: "
                    "use the llamacpp engine (runtime.engine = \"llamacpp\" or \"auto\" "
                    "with llama-cpp-python installed).")
        if self._pooling(self.facts) is None:
            arch = self.facts.architecture
            return (f"model {self.name!r} declares no pooling type (its GGUF has no "
                    f"{arch}.pooling_type, as generative models do not), so it has no "
                    "sentence embedding. Hint: use an embedding model; or set "
                    f"models.{self.name}.pooling = \"mean\" (or \"last\" or \"cls\") to "
                    "pool this model's hidden states anyway (vectors of a model not trained "
                    "for it rank text similarity poorly).")
        return None

    @property
    def embedding_length(self) -> int | None:
        """The length of this model's sentence vectors (its hidden size) when it embeds."""
        return None if self.facts is None else int(self.facts.embedding_length)

    async def embed(self, token_lists: list[list[int]]) -> list[list[float]]:
        """Sentence embeddings: one L2-normalized vector per token-id list, pooled as the
        model's GGUF or `models.NAME.pooling` says (docs/api.md#embeddings).

        The model is loaded on demand as for generation (a load failure raises
        EmbeddingError). The inputs go to the runner in messages of at most EMBED_MSG_TOKENS
        tokens, each between two decode steps of running generations; a runner that dies
        meanwhile is reloaded and the unfinished messages sent again (EMBED_ATTEMPTS). Inputs
        must be non-empty lists of this model's token ids of at most `context` tokens (the
        runner refuses others: EmbeddingError). Callers check `embedding_refusal()` first;
        a model that cannot embed raises EmbeddingError(refused=True). Cancelling the caller
        (a client that hung up) sends no further message."""
        self.ensure_tokenizer()
        refusal = self.embedding_refusal()
        if refusal is not None:
            raise EmbeddingError(refusal, refused=True)
        groups: list[list[list[int]]] = []
        size = EMBED_MSG_TOKENS
        for ids in token_lists:
            if size + len(ids) > EMBED_MSG_TOKENS:
                groups.append([])
                size = 0
            groups[-1].append(list(ids))
            size += len(ids)
        out: list[list[float]] = []
        done = 0  # groups answered
        self.embeds += 1
        try:
            attempt = 0
            while done < len(groups):
                if self.host.stopping and not self.lifecycle.can_serve:
                    raise EmbeddingError(f"model {self.name!r}: the daemon is shutting down "
                                         "and loads no model. Hint: retry when it is back.")
                failed = await self.load_and_wait()
                if failed is not None:
                    raise EmbeddingError(f"model {self.name!r} could not be loaded: {failed}")
                runner = self.runner
                if runner is None or runner.gone.is_set():
                    # the loop notices the loss (UNLOADED), then loads again for us
                    self.load_requested = True
                    self.poke()
                    await self.host.wait_settled()
                    continue
                self.lifecycle.use(time.monotonic())
                try:
                    while done < len(groups):
                        out.extend(await self._embed_message(runner, groups[done]))
                        done += 1
                except RunnerGone as exc:
                    attempt += 1
                    if attempt >= EMBED_ATTEMPTS:
                        raise EmbeddingError(f"model {self.name!r}: the runner died while "
                                             f"embedding ({exc}). Hint: retry the request; "
                                             "the daemon's log says why it died.") from exc
        finally:
            self.embeds -= 1
            self.poke()  # idle again: the loop restarts the ttl clock
        return out

    async def _embed_message(self, runner: RunnerHandle, group: list[list[int]]
                             ) -> list[list[float]]:
        import numpy as np

        # shielded: a cancelled caller must not leave the runner's reply unread
        reply = await asyncio.shield(asyncio.ensure_future(
            runner.call(Embed(inputs=tuple(tuple(ids) for ids in group)))))
        if not isinstance(reply, Embedded):
            raise EmbeddingError(f"model {self.name!r}: the runner answered "
                                 f"{type(reply).__name__} to an embedding. Hint: this is a "
                                 "daemon bug; report it.")
        if reply.error is not None:
            raise EmbeddingError(f"model {self.name!r}: {reply.error}")
        vectors = np.frombuffer(reply.vectors, dtype="<f4")
        rows: list[list[float]] = vectors.reshape(reply.count, reply.dim).astype(float).tolist()
        return rows

    def poke(self) -> None:
        self.wake.set()
        self._maybe_hurry()

    def _maybe_hurry(self) -> None:
        """End the runner's message of several steps at its next step boundary rather than at
        the end of its window when a request waits (the reply frees slots; the next message
        adds the request) or when one of its sequences ended here while the runner would go
        on stepping it (`_cut_here`: those tokens would be dropped)."""
        if (self._long_out and not self._hurried and self.runner is not None
                and (self.scheduler.queued(self.name) > 0
                     or any(self._cut_here(jid) for jid in self._out_ids))):
            self._hurried = True
            self.runner.hurry()

    def _cut_here(self, jid: str) -> bool:
        """Whether `jid`'s request ended here while the runner would go on stepping it:
        cancelled, expired, shed, failed, or cut at a stop string. (The runner stops by itself
        at a stop id and at the message's limit: no hurry for those.)"""
        rec = self.requests.get(jid)
        if rec is None:
            return True
        return rec.done.is_set() and (rec.ended is None or rec.stops.stopped)

    def _ended(self, jid: str) -> bool:
        """Whether the sequence `jid` has nothing more to generate: its request ended (for
        any reason) or its sequence was released."""
        if jid not in self._held:
            return True
        rec = self.requests.get(jid)
        return rec is None or rec.done.is_set()

    def _adds(self, new: list[Any]) -> list[AddSeq]:
        """The runner's adds for jobs just taken (-> running): held, journaled as started."""
        adds = []
        for job in new:
            rec = self.requests.get(job.id)
            assert rec is not None, job.id  # in the table before its job could be taken
            rec.restart()
            self._held[job.id] = None
            adds.append(AddSeq(id=job.id, prompt=tuple(job.prompt_ids), params=job.params,
                               generated=tuple(rec.tokens)))  # resume by prefill
        self.journal.started([a.id for a in adds])
        return adds

    def _at_send(self, msg: Message, built: int = 0) -> Message:
        """A step message's last look before it is written: it was built while the message
        before it ran, so requests that came meanwhile join it now (they start one step
        sooner, as they would on llama-server), it runs one decode step when requests still
        wait, and sequences whose requests ended meanwhile are not stepped (the next message
        releases them)."""
        if not isinstance(msg, Step):
            return msg
        last = built == self._built  # else a newer message is built: its counts are set
        ended = [jid for jid in msg.step if self._ended(jid)] if last else []
        if ended:
            # ended while this message waited (cancelled, expired, a stop string in the reply
            # just read): not stepped; the runner keeps its sequence until the next release
            step = tuple(jid for jid in msg.step if jid not in ended)
            msg = dataclasses.replace(
                msg, step=step, steps=msg.steps if step else 1,
                limits={jid: n for jid, n in msg.limits.items() if jid not in ended})
            self._inflight_size -= len(ended)
            for jid in ended:
                self._pending.pop(jid, None)
        late = self._late_adds() if last else []
        if late:
            msg = dataclasses.replace(msg, add=msg.add + tuple(late), steps=1, limits={})
            self._inflight_size += len(late)
            self._pending.update((a.id, 1) for a in late)
        elif msg.steps > 1 and self.scheduler.queued(self.name) > 0:
            msg = dataclasses.replace(msg, steps=1, limits={})
        self._long_out = msg.steps > 1
        self._out_ids = msg.step
        self._hurried = False
        return msg

    def _late_adds(self) -> list[AddSeq]:
        """Jobs to add to the message about to be written (see `_at_send`): as many as the
        batch and the runner's sequences have room for, counting every sequence the runner
        may still hold then (the replies not taken in yet may end some: they are counted)."""
        if (self.scheduler.queued(self.name) == 0 or self.host.stopping
                or not self.journal.writable or not self.lifecycle.can_serve):
            return []
        now = time.monotonic()
        held = len(self._held) + len(self.to_release)
        free = min(self.memory.batch_limit(self.max_batch) - len(self.active),
                   self.max_batch - held)
        new = self.scheduler.take(self.name, free, now) if free > 0 else []
        if new:
            self.lifecycle.use(now)
        return self._adds(new)

    @property
    def active(self) -> dict[str, RequestRecord]:
        """This model's running requests by id, in the order they started: the scheduler's
        running jobs of this model whose request has not ended (one answered and kept for
        the next start has). The runner may still hold an ended one's sequence until the
        loop's next message releases it."""
        out: dict[str, RequestRecord] = {}
        for jid in self.scheduler.running_ids(self.name):
            rec = self.requests.get(jid)
            if rec is not None and not rec.done.is_set():
                out[jid] = rec
        return out

    def in_use(self) -> bool:
        """Whether the model is needed now (a running, queued or embedding request, or not
        idle): a load that makes room may not evict it."""
        return (bool(self.active) or self.lifecycle.state is not ModelState.IDLE
                or self.scheduler.queued(self.name) > 0 or self.embeds > 0)

    def request_unload(self) -> None:
        """Ask the loop to unload the model once it is idle (another model's load needs
        the memory, memory pressure, the `unload` command); returns at once."""
        self._unload_requested = True
        self.poke()

    @property
    def ttl_s(self) -> float | None:
        """Idle seconds before the model unloads (None: never): an Ollama keep_alive, else
        models.NAME.ttl_s."""
        return self.entry.ttl_s if self.ttl_override is None else self.ttl_override[0]

    async def load_and_wait(self) -> str | None:
        """Ask for a load (unless it already serves) and wait until it can serve; the reason
        when the load failed instead, else None. (The HTTP and UART `load` commands.)"""
        if not self.lifecycle.can_serve:
            self.load_requested = True
            self.poke()
            while not self.lifecycle.can_serve:
                await self.host.wait_settled()
                if self.lifecycle.state is ModelState.FAILED:
                    return self.lifecycle.reason or "load failed"
        return None

    async def unload_and_wait(self) -> None:
        """Ask for an unload (when resident) and wait until the weights are gone."""
        if self.lifecycle.resident:
            self.request_unload()
            while self.lifecycle.resident:
                await self.host.wait_settled()

    def to_dict(self) -> dict[str, Any]:
        d = self.lifecycle.to_dict()
        d.update({
            "engine": self.engine or self.runtime.engine,
            "engine_info": self.engine_info,
            # false: this model's tokens may depend on what shares its batch (the runner
            # measured its kernels at warm-up); journaled tokens never change either way
            "batch_invariant": self.batch_invariant,
            "runner_pid": self.runner.pid if self.runner and not self.runner.gone.is_set()
            else None,
            "active": len(self.active), "queued": self.scheduler.queued(self.name),
            "max_batch": self.max_batch, "context": self.context,
            "budget_bytes": self.budget_bytes, "mlock": self.lock,
            "prompt_cache": self._prompt_cache(),
            "free_blocks": self.free_blocks, "total_blocks": self.total_blocks,
            "ttl_s": self.ttl_s, "priority": self.entry.priority,
            "tokenizer_from": self.tokenizer_from,
            "tokenizer_s": None if self.tokenizer_s is None else round(self.tokenizer_s, 6),
            "memory": self.memory.model_dict(self.name),  # cgroup group, OOM kills
        })
        if self._load_progress and self.lifecycle.state is ModelState.LOADING:
            d["load_progress"] = {"done": self._load_progress[0],
                                  "total": self._load_progress[1]}
        return d

    def _prompt_cache(self) -> dict[str, Any]:
        """The runner's prompt cache (None before a load: the engine decides) and what it
        saved: prompt tokens of finished requests, those the cache held, requests it hit."""
        info = (self.engine_info or {}).get("prompt_cache", False)
        m = self.metrics
        return {"enabled": None if info is False else info is not None,
                # true: a hit gives the same tokens as a full prefill (the model is
                # batch-invariant); false: they may differ, as with another batch
                "exact": info.get("exact") if info else None,
                "prompt_tokens": m.prompt_tokens.get(self.name, 0),
                "cached_tokens": m.prompt_cache_hit_tokens.get(self.name, 0),
                "hits": m.prompt_cache_hits.get(self.name, 0)}

    # -- the loop ------------------------------------------------------------------------------
    async def run(self) -> None:
        """Until the daemon stops and this model is unloaded."""
        while not (self.host.stopping and not self.lifecycle.resident):
            await self._turn()

    async def _wait(self, timeout: float | None) -> None:
        if timeout is not None and timeout <= 0:
            return
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.wake.wait(), timeout)
        self.wake.clear()

    async def _turn(self) -> None:
        sched = self.scheduler
        now = time.monotonic()
        self.host.reap(now)
        running = self.active
        for jid in [jid for jid in self._held if jid not in running]:
            self._release(jid)  # ended: cancelled, expired, shed, kept at shutdown
        state = self.lifecycle.state
        runner_ok = self.runner is not None and not self.runner.gone.is_set()
        if self.lifecycle.can_serve and not runner_ok:
            self._runner_lost(now)
            return
        if not self.lifecycle.resident:
            wanted = self.load_requested or sched.queued(self.name) > 0
            if wanted and not self.host.stopping:
                await self._load()
                return
            await self._wait(self.host.wait_timeout(now))
            return
        if not self.lifecycle.can_serve:  # loading/unloading happen inside _load/_unload
            await self._wait(0.05)
            return
        free = self.memory.batch_limit(self.max_batch) - len(running)  # PSI stage 1
        paused = not self.journal.writable  # its tokens could not be made durable
        new = [] if self.host.stopping or paused else sched.take(self.name, free, now)
        if paused and running:
            # no step until the journal takes writes again (it pokes us then)
            await self._wait(self.host.wait_timeout(now))
            return
        if (not running and not new and not self.to_release and not self.host.stopping
                and sched.queued(self.name) > 0):
            # A lone job waits for company (batch window): the model is not idle, so neither
            # mark it idle nor let a ttl or an unload request take it away from that job.
            await self._wait(self.host.wait_timeout(now))
            return
        if not running and not new and not self.to_release:
            if self._inflight is not None:  # take in the last reply (free slots) before idling
                await self._drain_inflight()
                return
            if self.embeds:  # an embedding request uses the runner: in use, not idle
                await self._wait(self.host.wait_timeout(now))
                return
            if self.to_snapshot:  # the turns' slots are released and idle: keep their KV
                await self._take_snapshots()
                return
            if state is ModelState.SERVING:
                self.lifecycle.mark_idle(now)
            if self._unload_requested or self.host.stopping or self.lifecycle.should_unload(
                    now, self.ttl_s):
                await self._unload("ttl" if not self._unload_requested else "request")
                return
            timeouts = [t for t in (self.host.wait_timeout(now),
                                    _until(self.lifecycle.unload_at(self.ttl_s), now))
                        if t is not None]
            await self._wait(min(timeouts) if timeouts else None)
            return
        if new or running:
            self.lifecycle.use(now)
        await self._step(new, now)

    async def _step(self, new: list[Any], now: float) -> None:
        journal = self.journal
        journal.begin_step()  # one journal transaction for the whole step (group commit)
        try:
            await self._step_inner(new, now)
        finally:
            await journal.commit_step()

    async def _step_inner(self, new: list[Any], now: float) -> None:
        """Send the next step, then take in the previous step's reply. The runner always has
        the next message queued before it finishes the current step (one step of lookahead),
        so the control plane's work on a reply (detokenize, stop strings, journal, streams)
        runs while the runner computes instead of between its steps."""
        assert self.runner is not None
        adds = self._adds(new)
        added = {a.id for a in adds}
        room = {jid: self._room(jid, rec) for jid, rec in self.active.items()
                if jid not in added}
        step_ids = [jid for jid, n in room.items() if n >= 1]
        steps = self._steps(adds, step_ids)
        limits = {jid: room[jid] for jid in step_ids if room[jid] < steps}
        msg = Step(release=tuple(self.to_release), add=tuple(adds), step=tuple(step_ids),
                   steps=steps, limits=limits)
        self.to_release = []
        prev, prev_size = self._inflight, self._inflight_size
        self._built += 1
        self._inflight = asyncio.ensure_future(self.runner.call(
            msg, functools.partial(self._at_send, built=self._built)))
        self._inflight_size = len(adds) + len(step_ids)
        self._pending = {a.id: 1 for a in adds}
        self._pending.update((jid, min(steps, room[jid])) for jid in step_ids)
        if prev is None:
            return  # the first step since the runner (re)started: its reply comes next turn
        try:
            reply = await prev
        except RunnerGone:
            self._runner_lost(time.monotonic())
            return
        self._take_reply(reply, prev_size)

    def _room(self, jid: str, rec: RequestRecord) -> int:
        """How many tokens `jid` may get in the message sent before the in-flight reply is
        read: its length budget less the tokens in flight, so its KV never outgrows the
        context. One that ends in flight at a stop id costs nothing more (the runner does not
        step a sequence past a stop id, in this message or the next); one that ends at a stop
        string costs the next message's steps, dropped, and is released in the one after."""
        return rec.max_new - len(rec.tokens) - self._pending.get(jid, 0)

    def _steps(self, adds: list[AddSeq], step_ids: list[str]) -> int:
        """Decode steps for the next message: as many as fit in `runtime.step_window_ms`, so
        the control plane's work per message (the journal's commit, the runner round trip,
        the wake-ups) is paid once per window, not once per token. One when sequences are
        added (their first tokens go out at once), when one asks for logprobs, or when
        requests wait for a slot (one that comes later shortens the message: `poke`,
        `_at_send`)."""
        window = self.runtime.step_window_ms / 1000
        if window <= 0 or adds or not step_ids:
            return 1
        if self.scheduler.queued(self.name) > 0:
            return 1
        if any(self.active[jid].wants_logprobs for jid in step_ids):
            return 1
        # the step time of this batch size, else of the nearest larger one measured; none:
        # one step (a smaller batch's time would overrun the window)
        known = [b for b in self._decode_s if b >= len(step_ids)]
        if not known:
            return 1
        per = self._decode_s[min(known)]
        return max(1, min(MAX_STEPS, int(window / per))) if per > 0 else 1

    def _take_reply(self, reply: Message, size: int) -> None:
        now = time.monotonic()
        if not isinstance(reply, StepResult):  # an ErrorReply: the step was not understood
            log.error("model %r: the runner answered %s to a step; the step's requests fail",
                      self.name, reply)
            reply = StepResult(tokens={}, errors={jid: f"runner: {reply}" for jid in
                                                  self._held}, free_blocks=None, step_s=0.0)
        self.free_blocks = reply.free_blocks
        ntok = len(reply.tokens) + sum(len(t) for t in reply.then.values())
        self.metrics.observe_step(self.name, size, ntok, reply.step_s, reply.steps)
        if not reply.cached and not reply.errors and size and reply.steps:  # decode only
            per = reply.step_s / reply.steps
            d = self._decode_s.get(size)
            self._decode_s[size] = per if d is None else 0.7 * d + 0.3 * per
        for jid, cached in reply.cached.items():
            rec = self._held_record(jid)
            if rec is not None:  # a resumed attempt's cache may cover generated tokens too
                rec.cached_tokens = min(cached, rec.prompt_tokens)
        for jid, message in reply.errors.items():
            rec = self._held_record(jid)
            self._release(jid)
            if rec is not None:
                self.requests.finish(jid, Outcome.failed("runner_error", message), now)
        logprobs = reply.logprobs
        cut = False  # a request ended at a stop string (the runner does not know)
        for jid, token in reply.tokens.items():
            rec = self._held_record(jid)
            if rec is None:
                continue  # finished, cancelled or failed before this reply: already released
            if rec.done.is_set():  # cancelled or expired while the step ran
                self._release(jid)
                continue
            before = len(rec.tokens)
            finished = rec.push(int(token), logprobs.get(jid))
            for more in reply.then.get(jid, ()):
                if finished:
                    break  # stepped past its end within the message: discarded
                finished = rec.push(int(more))
            self.journal.token(rec, before)
            if finished:
                self._release(jid)
                self.requests.finish(jid, Outcome.done(rec.ended or "stop"), now)
                cut = cut or rec.stops.stopped
        if cut:  # the message written meanwhile may step it on: end that message early
            self._maybe_hurry()

    def _held_record(self, jid: str) -> RequestRecord | None:
        """The request of a sequence the runner holds (None: released, or not this model's)."""
        return self.requests.get(jid) if jid in self._held else None

    def _release(self, jid: str) -> None:
        """Free `jid`'s sequence in the runner with the next message."""
        self._held.pop(jid, None)
        self.to_release.append(jid)

    async def _drain_inflight(self) -> None:
        """Wait for the in-flight step and take in its reply (no new message is sent)."""
        prev, size = self._inflight, self._inflight_size
        self._inflight = None
        self._pending = {}
        if prev is None:
            return
        try:
            reply = await prev
        except RunnerGone:
            self._runner_lost(time.monotonic())
            return
        journal = self.journal
        journal.begin_step()
        try:
            self._take_reply(reply, size)
        finally:
            await journal.commit_step()

    def _forget_inflight(self) -> None:
        """Drop the in-flight step (its runner is gone or going): nothing waits on it."""
        task, self._inflight = self._inflight, None
        self._pending = {}
        if task is not None:
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
            if not task.done():
                task.cancel()

    # -- load / unload / loss --------------------------------------------------------------------
    def _runner_args(self) -> list[str]:
        rt = self.runtime
        # auto: llama.cpp uses the cores the runner may use (it decides, inside its cgroup);
        # the numpy engine one BLAS thread (two collapsed 3-4x on a shared 2-core machine)
        threads = rt.threads or (0 if self.engine == "llamacpp" else 1)
        return ["--name", self.name, "--model", str(self.path()),
                "--engine", self.engine or rt.engine,
                "--state-dir", str(self.state_dir), "--dtype", rt.dtype,
                "--mlock", rt.mlock, "--max-batch", str(self.max_batch),
                "--context", str(self.context), "--threads", str(threads),
                "--pooling", self.entry.pooling, "--decode", rt.decode,
                "--checked", self.facts.stamp if self.facts is not None else ""]

    def _on_runner_event(self, msg: Progress | Status) -> None:
        now = time.monotonic()
        if isinstance(msg, Progress):
            self._load_progress = (msg.done, msg.total)
            self.host.notifier_extend(f"model {self.name}: preparing weights "
                                        f"{self._load_progress[0]}/{self._load_progress[1]}")
        elif msg.state == "warming" and self.lifecycle.state is ModelState.LOADING:
            self.lifecycle.start_warmup(now)
            self.host.notifier_extend(f"model {self.name}: warming up")

    def loads_before_journal(self) -> bool:
        """Whether this model's load may start before the journal opens (`Daemon.startup`): a
        preload model on the llama.cpp engine whose budget is known from its GGUF and fits
        without evicting anything. Its runner then loads in its own process while the journal
        is checked and recovered; everything after the spawn waits for the event loop, which
        the journal's opening holds, so the load ends with the journal open. The numpy
        engine's load waits for the journal: its tokenizer comes from the journal's cache."""
        if not self.entry.preload:
            return False
        try:
            self.ensure_budget()
            return self.engine == "llamacpp" and not self._plan_room()
        except Exception:  # noqa: BLE001 - the load after the journal reports it
            return False

    @property
    def spawned(self) -> bool:
        """This model's load has spawned its runner, or has failed (or its task ended)
        without one."""
        if self.runner is not None and self.runner.spawned.is_set():
            return True
        return self.lifecycle.state is ModelState.FAILED or (
            self.task is not None and self.task.done())

    def _plan_room(self) -> list[str]:
        """Idle models to evict (LRU) so this one fits; raises BudgetExceeded when it cannot."""
        assert self.budget_bytes is not None
        loaded = [LoadedModel(s.name, s.budget_bytes or 0, s.lifecycle.last_used or 0.0,
                              s.in_use())
                  for s in self.peers().values()
                  if s is not self and s.lifecycle.resident]
        return plan_load(self.name, self.budget_bytes, self.host.memory_limit(), loaded)

    async def _check_budget(self, now: float) -> None:
        """Make room before the runner starts: ask the victims to unload and wait until they
        are UNLOADED (their memory is back), then plan again; never load and hope."""
        for _ in range(EVICT_ROUNDS):
            victims = self._plan_room()
            if not victims:
                return
            log.info(f"model {self.name}: evicting idle {', '.join(victims)} "
                     f"(least recently used) to fit the memory limit")
            peers = self.peers()
            for victim in victims:
                peers[victim].request_unload()
            end = time.monotonic() + EVICT_WAIT_S
            while any(peers[v].lifecycle.resident for v in victims):
                left = end - time.monotonic()
                if left <= 0:
                    raise EvictionTimeout(
                        f"load model {self.name!r}: evicted model(s) {', '.join(victims)} did "
                        f"not unload within {EVICT_WAIT_S:.0f} s. Hint: check the daemon's log "
                        "for a stuck runner; retry the request.")
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.host.wait_settled(), min(left, 1.0))
        if self._plan_room():
            raise EvictionTimeout(
                f"load model {self.name!r}: other models kept being loaded while evicting "
                f"for it ({EVICT_ROUNDS} rounds). Hint: retry the request; lower the number of "
                "models in use at once.")

    async def _load(self) -> None:
        sched = self.scheduler
        now = time.monotonic()
        self.load_requested = False
        self._unload_requested = False
        self.lifecycle.start_load(now)
        self.host.notifier_extend(f"model {self.name}: loading")
        vocab: asyncio.Future[Any] | None = None
        try:
            self.ensure_budget()
            # llama.cpp engine: the control plane reads the vocabulary (a vocab-only load,
            # 0.4-1.5 s) in a thread while the runner starts, not before it
            if self.engine != "llamacpp" or self.tokenizer is not None:
                self.ensure_tokenizer()
            await self._check_budget(now)
            env = runner_env(self.engine or "numpy", self.runtime.threads)
            # models/<name>/ is created now; the runner joins it right after the spawn
            attach = self.memory.runner_hook(self.name, self.budget_bytes)
            runner = RunnerHandle(self.name, self._runner_args(), env=env,
                                  on_event=self._on_runner_event, on_gone=self.poke,
                                  on_spawn=attach)
            self._forget_inflight()
            self.runner = runner
            if self.tokenizer is None:
                vocab = asyncio.ensure_future(asyncio.to_thread(self.ensure_tokenizer))
            # a runner pre-started with the daemon (prestart.py) has its imports done
            ready = await runner.start(
                self.host.claim_runner(env) if self.engine == "llamacpp" else None)
            if vocab is not None:
                await vocab
        except Exception as exc:  # noqa: BLE001 - any failure must leave LOADING (FAILED)
            if vocab is not None:  # the runner failed first: let the read end, take its error
                with contextlib.suppress(Exception):
                    await vocab
            reason = str(exc) if isinstance(exc, (EdgeAgentError, OSError)) else (
                f"model {self.name!r}: load failed with {type(exc).__name__}: {exc}. "
                "Hint: this is a daemon bug; the daemon's log has the details.")
            if not isinstance(exc, (EdgeAgentError, OSError)):
                log.error(f"model {self.name}: unexpected load error: {exc!r}")
            if self.runner is not None:
                with contextlib.suppress(Exception):
                    await self.runner.stop()
                self.runner = None
            oom = self.memory.runner_exited(self.name)  # group removed, OOM attributed
            if oom:
                reason = f"{reason} (runner {oom})"
            now = time.monotonic()
            self.lifecycle.fail(now, reason)
            self.journal.model_failed(self.name, reason)
            code: EndCode = ("budget_exceeded" if isinstance(exc, BudgetExceeded)
                             else "model_failed")
            for job in sched.fail_queued(self.name, now, reason):
                self.requests.finish(job.id, Outcome.failed(code, reason), now)
            self.metrics.model_event(self.name, "load_failed")
            self.host.model_settled(self)
            return
        now = time.monotonic()
        if self.lifecycle.state is ModelState.LOADING:
            self.lifecycle.start_warmup(now)
        self.lock = ready.lock
        self.engine_info = ready.engine
        self.batch_invariant = ready.batch_invariant
        self.free_blocks = self.total_blocks = ready.free_blocks
        self.context = ready.context
        if ready.stop_ids:
            self.stop_ids = frozenset(ready.stop_ids)
        await self._restore_snapshots()
        self.lifecycle.ready(now, busy=sched.queued(self.name) > 0)
        self.journal.model_loaded(self.name, self.path(), ready, self.tokenizer)
        self.metrics.model_event(self.name, "load")
        self.host.model_settled(self)

    async def _take_snapshots(self) -> None:
        """Journal the KV of the slots the finished session turns released (between steps:
        this loop sends nothing else meanwhile), so a restart restores them."""
        store, runner = self.journal.store, self.runner
        todo, self.to_snapshot = self.to_snapshot, {}
        if store is None or runner is None:
            return
        for sid, tokens in todo.items():
            try:
                reply = await runner.call(Snapshot(tokens=tuple(tokens)))
            except RunnerGone:
                return
            if not isinstance(reply, SnapshotData) or not reply.data:
                continue
            try:
                store.save_kv_snapshot(sid, self.name, tokens[:reply.tokens], reply.identity,
                                       reply.data, max_bytes=KV_SNAPSHOT_BYTES)
            except (JournalError, sqlite3.Error) as exc:
                log.warning(f"journal: session {sid}: could not keep its KV snapshot: {exc}")

    async def _restore_snapshots(self) -> None:
        """Load the newest sessions' KV snapshots into the fresh runner's free slots (at most
        max_batch, oldest first, so the newest is evicted last); a refused one is dropped."""
        store, runner = self.journal.store, self.runner
        if store is None or runner is None or self.engine != "llamacpp":
            return
        try:
            snaps = store.kv_snapshots(self.name, self.max_batch)
        except (JournalError, sqlite3.Error) as exc:
            log.warning(f"journal: model {self.name}: could not read KV snapshots: {exc}")
            return
        restored = 0
        for _sid, tokens, blob in reversed(snaps):
            try:
                reply = await runner.call(Restore(tokens=tuple(tokens), data=blob))
            except RunnerGone:
                return
            restored += isinstance(reply, Restored) and reply.ok
        if snaps:
            log.info(f"model {self.name}: restored {restored} of {len(snaps)} session KV "
                     "snapshot(s) into the prompt cache")

    async def _unload(self, why: str) -> None:
        now = time.monotonic()
        self._unload_requested = False
        self.ttl_override = None  # a keep_alive lasts while the model stays loaded
        self.lifecycle.start_unload(now)
        if self._inflight is not None:  # nothing is active: its reply only has stale tokens
            with contextlib.suppress(RunnerGone, asyncio.CancelledError):
                await self._inflight
            self._forget_inflight()
        if self.runner is not None:
            await self.runner.stop()
            self.runner = None
        self.memory.runner_exited(self.name)  # remove models/<name>/
        self.lifecycle.unloaded(time.monotonic())
        self.lock = None
        self.free_blocks = None
        self.metrics.model_event(self.name, "unload")
        self.host.model_settled(self)

    def _runner_lost(self, now: float) -> None:
        rc = self.runner.returncode if self.runner else None
        pid = self.runner.pid if self.runner else None
        reason = f"runner (pid {pid}) exited with status {rc}"
        oom = self.memory.runner_exited(self.name)  # memory.events first, then rmdir
        if oom:
            reason = f"runner (pid {pid}) was {oom}"
        running = self.active
        ids = list(running)
        # a request that produced a token in this attempt is making progress: its runner's
        # death costs it nothing (max_retries bounds only deaths in a row without progress)
        progressed = {jid for jid, rec in running.items()
                      if len(rec.tokens) > rec.attempt_start}
        self._held.clear()
        self.to_release = []
        self._forget_inflight()
        for job in self.scheduler.requeue(ids, now, reason=reason,
                                                 progressed=progressed):
            rec = self.requests.get(job.id)
            if rec is None:
                continue
            if job.state is JobState.FAILED:
                self.requests.finish(job.id, Outcome.failed(
                    "runner_failed", job.error or reason), now)
            else:
                rec.restart()
        self.runner = None
        if self.lifecycle.can_serve:
            self.lifecycle.lost(now, reason)
        self.metrics.model_event(self.name, "runner_lost")
        log.warning(f"model {self.name}: {reason}; {len(ids)} running request(s) requeued")


def _until(t: float | None, now: float) -> float | None:
    return None if t is None else max(0.0, t - now)
