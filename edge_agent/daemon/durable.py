"""The daemon's side of the journal: what the control plane writes, and warm start from it.

Invariants owned here:
- The control plane (this process, its event loop thread) is the only writer.
- `accept()` journals new requests before their ids are returned to the clients, in one
  transaction for a group (Daemon.accept: those the routes took in one turn of the event
  loop, so a burst costs one fsync); a write failure refuses every request of the group
  with 503/507, none is ever accepted un-journaled.
- One decode step of a model is ONE journal transaction: the new token of every sequence of
  the batch, the sequences that started in it, and every request that finished while the step
  was open (`begin_step` .. `commit_step`). With ack "durable" the step is committed before the
  event loop can run a stream writer (no await between the runner's reply and the commit), so a
  token is on disk before it is sent; with "fast" the step is committed after one loop turn,
  so streams may send first.
- A finish outside a step (cancel, deadline, shutdown, runner retries exhausted) is journaled
  at once, in its own transaction.
- A write the storage refuses (disk full, I/O error: any sqlite3 error but a conflict) is
  never raised into the model loop and never dropped: the step (or finish) is kept, in order,
  with the session saves that must follow it, and the journal is *faulted*. While faulted:
  /health says "degraded" with the reason; new requests are refused at once (507
  `journal_unavailable`, the reason, Retry-After), since none can be accepted un-journaled;
  running requests are PAUSED, not failed (the model loops take no new step and no new job,
  see `writable`), so no more tokens are produced that could not be journaled; a retry task
  writes the kept steps every RETRY_FIRST_S..RETRY_MAX_S s (doubling), then a
  `journal_fault` event (the probe: it proves a write went through), clears the fault and
  wakes the model loops: the daemon serves again without a restart. The one exception to
  "on disk before it is sent" is the step whose commit failed: its tokens were already in
  the records, so a stream may send them before they are durable (as with ack "fast"); if the
  daemon dies before the retry succeeds, the next start continues from the last journaled
  token and samples the same tokens again (same seed, same position), so no client sees
  different text. `close()` tries the kept steps once more and logs what could not be written.
- A done turn of a `session` extends the session's history right after the step that finished
  it is committed; a start re-applies every done turn still marked `session_pending` (a crash
  in between).
- Start path (before READY) costs O(open requests + pending session turns), plus the
  integrity check (db.py), which runs in a thread while this one builds the preload models'
  tokenizers (the journal is query_only meanwhile: nothing is written before the check
  passes): recovery and the pending-turn query are index lookups; sessions are
  read on first use, by id; retention (pruning finished requests, old events) runs after READY
  and then hourly, in short transactions on the event loop thread (still the only writer),
  yielding between them.
- Warm start: the records of journaled requests are rebuilt by pushing their journaled tokens
  through a fresh RequestRecord (the same code that produced the text), so text, pieces and the
  detokenizer state equal what they were; a resumed request then continues by prefill: the
  runner prefills prompt + journaled tokens and samples generation index len(tokens) with the
  same (seed, position) randomness (Engine.add(..., generated=...)); nothing is regenerated.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import os
import sqlite3
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

from edge_agent.daemon.ipc import Ready
from edge_agent.daemon.outcome import Outcome
from edge_agent.daemon.requests import RequestRecord
from edge_agent.errors import JournalNotWritable
from edge_agent.journal import (
    JournalConflictError,
    JournalError,
    JournalStore,
    JournalUnavailableError,
    RecoveryPlan,
    cache_tokenizer,
    load_cached_tokenizer,
    open_journal,
    recover,
)
from edge_agent.protocol.api import ChatMessage, GenerationRequest
from edge_agent.scheduler import Job, JobState, QueueFull

if TYPE_CHECKING:
    from edge_agent.config import JournalConfig
    from edge_agent.daemon.service import ModelService

__all__ = ["DaemonJournal", "final_state", "PRUNE_BATCH", "RETENTION_INTERVAL_S", "RETRY_FIRST_S",
           "RETRY_MAX_S"]

log = logging.getLogger(__name__)

PRUNE_BATCH = 200  # rows per retention transaction (a few ms: one decode step waits at most that)
RETENTION_INTERVAL_S = 3600.0  # retention passes after the first one (right after READY)
RETRY_FIRST_S = 0.5  # a faulted journal is tried again after this, then twice as long each time
RETRY_MAX_S = 5.0  # ... up to this

Row = tuple[str, int, int, int]
End = tuple[str, str, str | None, str | None]


def final_state(rec: RequestRecord) -> str:
    """The journal state of a finished record: its outcome's state."""
    assert rec.outcome is not None, f"request {rec.id} has not ended"
    return rec.outcome.state


def _request_input(req: GenerationRequest) -> dict[str, Any]:
    return dataclasses.asdict(req)


def _request_from(data: dict[str, Any]) -> GenerationRequest:
    d = dict(data)
    if d.get("messages") is not None:
        d["messages"] = tuple(ChatMessage(**m) for m in d["messages"])
    d["stop"] = tuple(d.get("stop") or ())
    d["logit_bias"] = tuple((int(i), float(b)) for i, b in d.get("logit_bias") or ())
    return GenerationRequest(**d)


class JournalSessions(Protocol):
    """What the journal needs of the sessions: a turn ended (its history grows when done), and
    a resumed turn holds its session again."""

    def finished(self, rec: RequestRecord, done: bool) -> None: ...

    def claim(self, sid: str, rid: str) -> None: ...


class DaemonJournal:
    def __init__(self, cfg: JournalConfig, state_dir: Path, *,
                 services: Mapping[str, ModelService], submit: Callable[[Job, float], object],
                 add_record: Callable[[RequestRecord], object],
                 ready: Callable[[], bool]) -> None:
        """`submit` queues a resumed job in the scheduler (QueueFull when it is full),
        `add_record` puts its record in the request table, `ready` says the daemon serves;
        `sessions` is wired after construction (they need the journal too)."""
        self.services = services
        self._submit = submit
        self._add_record = add_record
        self._ready = ready
        self.sessions: JournalSessions | None = None
        self.cfg = cfg
        self.path = cfg.resolve_path(state_dir)
        self.store: JournalStore | None = None
        self.plan: RecoveryPlan | None = None
        self._step_depth = 0
        self._rows: list[tuple[str, int, int, int]] = []
        self._running: list[str] = []
        self._finishes: dict[str, tuple[str, str, str | None, str | None]] = {}
        self._after: list[RequestRecord] = []  # finished in the open step: sessions to save
        self.steps = 0
        self.write_s = 0.0  # time spent in step/finish transactions (fsync included)
        # seconds: open, check, warm (preload tokenizers, beside the check), checked_while (the
        # two side by side), recover, reconcile, total
        self.start_s: dict[str, float] = {}
        self.retention: dict[str, Any] | None = None  # the last retention pass
        self._retention: asyncio.Task[None] | None = None
        self._warming = False  # in _warm: the journal is query_only
        # writes the storage refused, oldest first: (rows, running, ends, records whose
        # session is saved once those are durable); non-empty only while faulted
        self._kept: list[tuple[list[Row], list[str], list[End], list[RequestRecord]]] = []
        self.fault: dict[str, Any] | None = None  # reason, since (wall clock), failures
        self._retry: asyncio.Task[None] | None = None
        self._next_try = 0.0  # monotonic time of the next retry

    @property
    def enabled(self) -> bool:
        return self.store is not None

    def open(self) -> RecoveryPlan | None:
        """Open (integrity check, migrations) and recover; retention runs later, after READY.

        Must be called from the running event loop (it schedules the retention task)."""
        if not self.cfg.enabled:
            return None
        t0 = time.perf_counter()
        warmed: list[Any] = []
        self.store = JournalStore(open_journal(
            self.path, synchronous=self.cfg.sync.upper(),
            while_checking=lambda peek: self._warm(peek, warmed)))
        j = self.store.journal
        self.start_s.update(open=j.open_seconds - (j.overlap_seconds or j.check_seconds),
                            check=j.check_seconds, checked_while=j.overlap_seconds)
        if j.quarantined is not None:
            log.warning(j.quarantined.message())
            for svc in warmed:  # its cached tokenizer came from the file moved aside
                svc.tokenizer = None
        t1 = time.perf_counter()
        try:
            self.plan = recover(self.store)
        except sqlite3.OperationalError as exc:  # disk full, I/O error: not the file's fault
            self.close()
            raise JournalUnavailableError(
                f"journal {self.path}: recovering the open requests at start failed ({exc}); "
                "nothing was changed. Hint: free space on the file system of "
                f"{self.path.parent} (df -h {self.path.parent}) or check the device (dmesg), "
                "then start again.") from exc
        self.start_s["recover"] = time.perf_counter() - t1
        if self.plan.resume or self.plan.expired:
            log.info(self.plan.summary())
        self.start_s["total"] = time.perf_counter() - t0
        self._retention = asyncio.get_running_loop().create_task(
            self._retain(), name="journal-retention")
        return self.plan

    def _warm(self, peek: Any, warmed: list[Any]) -> None:
        """While the integrity check runs (another thread): the preload models' tokenizers,
        from the journal's cache when it has them. `peek` is query_only, so a cache entry
        that would need dropping fails here and is dealt with at load; any error is left for
        the model's load to report."""
        t0 = time.perf_counter()
        self.store = JournalStore(peek)  # cached_tokenizer() reads through it
        self._warming = True
        try:
            for svc in self.services.values():
                if svc.entry.preload and svc.tokenizer is None:
                    try:
                        svc.ensure_tokenizer()
                    except Exception:  # noqa: BLE001 - the load reports it
                        continue
                    warmed.append(svc)
        finally:
            self.store = None
            self._warming = False
            self.start_s["warm"] = time.perf_counter() - t0

    def close(self) -> None:
        for task in (self._retention, self._retry):
            if task is not None:
                task.cancel()
        self._retention = self._retry = None
        if self.store is not None:
            if self._kept and not self._flush():
                self._log_unwritten()
            self.store.close()
            self.store = None

    def tasks(self) -> dict[str, asyncio.Task[None]]:
        """The journal's running tasks, by name (the daemon supervises them)."""
        return {t.get_name(): t for t in (self._retention, self._retry) if t is not None}

    # -- retention, off the start path ------------------------------------------------------------
    async def _retain(self) -> None:
        """Once READY, then every RETENTION_INTERVAL_S: prune in short transactions
        (PRUNE_BATCH rows each), yielding to the event loop between them."""
        while not self._ready():
            await asyncio.sleep(0.2)
        while self.store is not None:
            await self.prune_now()
            await asyncio.sleep(RETENTION_INTERVAL_S)

    async def prune_now(self) -> dict[str, Any]:
        """One retention pass (batches, yielding between them); its summary, also in /health."""
        t0 = time.perf_counter()
        busy = 0.0
        totals = {"requests": 0, "sessions": 0, "events": 0, "batches": 0}
        error = None
        while self.store is not None:
            t1 = time.perf_counter()
            try:
                res = self.store.prune(max_age_s=self.cfg.max_age_s,
                                       max_finished=self.cfg.max_finished,
                                       session_max_age_s=self.cfg.session_max_age_s,
                                       limit=PRUNE_BATCH)
            except (JournalError, sqlite3.Error) as exc:
                error = str(exc)
                log.error(f"journal: retention pass failed: {exc}. Hint: check the "
                          f"journal's file system (free space, dmesg); next pass in "
                          f"{RETENTION_INTERVAL_S:.0f} s.")
                break
            busy += time.perf_counter() - t1
            totals["requests"] += res.requests
            totals["sessions"] += res.sessions
            totals["events"] += res.events
            totals["batches"] += 1
            if res.total == 0:
                break
            await asyncio.sleep(0)  # decode steps and requests run between batches
        self.retention = dict(totals, busy_s=round(busy, 6), error=error,
                              wall_s=round(time.perf_counter() - t0, 6), at=time.time())
        if totals["requests"] or totals["sessions"]:
            log.info(f"journal: retention pruned {totals['requests']} finished "
                     f"request(s) in {totals['batches']} batch(es), {busy:.3f} s")
        return self.retention

    def health(self) -> dict[str, Any]:
        if self.store is None:
            return {"enabled": False}
        j = self.store.journal
        fault = None if self.fault is None else dict(
            self.fault, kept_writes=len(self._kept),
            next_try_s=round(max(0.0, self._next_try - time.monotonic()), 3))
        return {
            "enabled": True, "path": str(self.path), "synchronous": j.synchronous,
            "writable": self.fault is None, "fault": fault,
            "ack": self.cfg.ack, "open_s": round(j.open_seconds, 6), "steps": self.steps,
            "write_s": round(self.write_s, 6),
            "start_s": {k: round(v, 6) for k, v in self.start_s.items()},
            "retention": self.retention,
            "quarantined": None if j.quarantined is None else j.quarantined.to_dict(),
            "recovery": None if self.plan is None else self.plan.to_dict(),
        }

    # -- faults: the storage refuses writes -------------------------------------------------
    @property
    def writable(self) -> bool:
        """False while a write was refused and not yet retried successfully: the model loops
        pause (no new step, no new job) and new requests are refused."""
        return self.fault is None

    def unavailable(self) -> JournalNotWritable:
        """The refusal a new request gets while the journal is faulted (507 on HTTP)."""
        fault = self.fault or {"reason": "not writable", "since": time.time(), "failures": 0}
        retry = max(1, math.ceil(self._next_try - time.monotonic()))
        since = time.strftime("%H:%M:%SZ", time.gmtime(fault["since"]))
        return JournalNotWritable(
            f"the journal cannot be written ({fault['reason']}; since {since}, "
            f"{fault['failures']} failed write(s)): a request cannot be accepted without being "
            "journaled; running requests are paused and continue once a write succeeds. Hint: "
            f"free space on the file system of {self.path.parent} (df -h {self.path.parent}) "
            "or check the device (dmesg); the daemon retries by itself, retry the request "
            f"in {retry} s.", retry_after_s=retry)

    def check_admission(self) -> None:
        """Raise the 507 while the journal is faulted (before anything else is done)."""
        if self.fault is not None:
            raise self.unavailable()

    def _failed(self, exc: BaseException) -> None:
        """A write was refused: fault the journal (once), start retrying."""
        reason = f"journal {self.path}: {exc}"
        if self.fault is not None:
            self.fault["failures"] += 1
            self.fault["reason"] = reason
            return
        self.fault = {"reason": reason, "since": time.time(), "failures": 1}
        log.error(
            f"journal: a write to {self.path} failed ({exc}); new requests are refused (507) "
            "and running ones paused until a write succeeds; nothing acknowledged is dropped "
            f"(retrying every {RETRY_FIRST_S:g}..{RETRY_MAX_S:g} s). Hint: free space on the "
            f"file system of {self.path.parent} (df -h {self.path.parent}) or check the device "
            "(dmesg); the daemon serves again by itself.")
        self._next_try = time.monotonic() + RETRY_FIRST_S
        if self._retry is None:
            with contextlib.suppress(RuntimeError):  # no running loop: close() tries again
                self._retry = asyncio.get_running_loop().create_task(
                    self._retry_writes(), name="journal-retry")

    async def _retry_writes(self) -> None:
        """Until a write goes through: the kept writes, then a `journal_fault` event."""
        delay = RETRY_FIRST_S
        try:
            while self.fault is not None and self.store is not None:
                self._next_try = time.monotonic() + delay
                await asyncio.sleep(delay)
                if self._flush() and self._probe():
                    break
                delay = min(delay * 2, RETRY_MAX_S)
        finally:
            self._retry = None

    def _probe(self) -> bool:
        """Record the outage as an event; when that write goes through, the fault is over."""
        assert self.store is not None and self.fault is not None
        f = self.fault
        took = time.time() - f["since"]
        text = (f"journal writes failed for {took:.1f} s from "
                f"{time.strftime('%Y-%m-%d %H:%M:%SZ', time.gmtime(f['since']))} "
                f"({f['failures']} failed write(s); last: {f['reason']}); requests were "
                "refused with 507 and running ones paused meanwhile")
        try:
            self.store.record_event("journal_fault", text)
        except (JournalError, sqlite3.Error) as exc:
            self._failed(exc)
            return False
        self.fault = None
        log.info(f"journal: {self.path} is writable again after {took:.1f} s "
                 f"({f['failures']} failed write(s)); serving again")
        for svc in self.services.values():
            svc.poke()
        return True

    def _flush(self) -> bool:
        """Write the kept writes in order (each in its own transaction), then the session
        saves that wait for them; False (and faulted) at the first refusal."""
        assert self.store is not None
        while self._kept:
            rows, running, ends, after = self._kept[0]
            if rows or running or ends:
                t0 = time.perf_counter()
                try:
                    self.store.append_tokens(rows, finish=ends, running=running)
                except JournalConflictError as exc:  # a bug: trying again cannot help
                    log.error(f"journal: write dropped: {exc}")
                except (JournalError, sqlite3.Error) as exc:
                    self._failed(exc)
                    return False
                finally:
                    self.write_s += time.perf_counter() - t0  # the loop waited for it
                self._kept[0] = ([], [], [], after)
            while after:
                rec = after[0]
                try:
                    self._session_finished(rec, final_state(rec) == "done")
                except (JournalError, sqlite3.Error) as exc:
                    self._failed(exc)
                    return False
                after.pop(0)
            self._kept.pop(0)
        return True

    def _log_unwritten(self) -> None:
        ids = sorted({r[0] for rows, _, _, _ in self._kept for r in rows}
                     | {e[0] for _, _, ends, _ in self._kept for e in ends})
        log.warning(
            f"journal: {len(self._kept)} write(s) of request(s) {', '.join(ids[:10])} could not "
            f"be written before exit ({self.fault['reason'] if self.fault else 'refused'}); "
            "those requests stay open in the journal and the next start continues them from "
            "their last journaled token (the same tokens again: same seed, same position). "
            f"Hint: free space on the file system of {self.path.parent} before restarting.")

    # -- writes -----------------------------------------------------------------------------
    def accept(self, recs: Sequence[RequestRecord]) -> None:
        """Journal new requests in one transaction (before their ids go out);
        JournalUnavailableError when the storage refuses (the journal is faulted then), and
        then none of them is journaled."""
        if self.store is None or not recs:
            return
        if self.fault is not None:
            raise JournalUnavailableError(self.unavailable().message)
        rows = []
        for rec in recs:
            job = rec.job
            deadline = None
            if job.deadline_at is not None:
                deadline = time.time() + (job.deadline_at - time.monotonic())
            # the scheduler keeps params opaque; the daemon's jobs carry sampling_dict()'s dict
            params = cast(dict[str, Any], job.params)
            rows.append(dict(id=job.id, model=rec.model, input=_request_input(rec.request),
                             prompt_ids=list(job.prompt_ids), params=dict(params),
                             priority=job.priority, deadline=deadline,
                             session=rec.request.session))
        try:
            self.store.add_requests(rows)
        except JournalConflictError:
            raise
        except (JournalError, sqlite3.Error) as exc:
            self._failed(exc)
            raise JournalUnavailableError(self.unavailable().message) from exc

    def begin_step(self) -> None:
        self._step_depth += 1

    def started(self, rids: list[str]) -> None:
        self._running.extend(rids)

    def token(self, rec: RequestRecord, before: int) -> None:
        """After rec.push: journal the tokens it appended (none on a replay or a stop id)."""
        for i in range(before, len(rec.tokens)):
            self._rows.append((rec.id, i, rec.tokens[i], rec.decoder.offset))

    def finished(self, rec: RequestRecord) -> None:
        """Journal the end of `rec` (RequestTable.finish calls this, once per request)."""
        end = rec.outcome
        assert end is not None, f"request {rec.id} has not ended"
        entry = (rec.id, end.state, None if end.code is None else end.message,
                 end.finish_reason)
        if self._step_depth:  # the session grows once the step (its last tokens) is durable
            self._finishes[rec.id] = entry
            self._after.append(rec)
        else:
            self._write([], [], [entry], [rec])

    async def commit_step(self) -> None:
        if self.cfg.ack == "fast":
            await asyncio.sleep(0)  # let stream writers send first
        self._step_depth -= 1
        if self._step_depth:
            return
        rows, running, ends = self._rows, self._running, list(self._finishes.values())
        after, self._after = self._after, []
        self._rows, self._running, self._finishes = [], [], {}
        self._write(rows, running, ends, after)
        self.steps += 1

    def _write(self, rows: list[Row], running: list[str], ends: list[End],
               after: list[RequestRecord]) -> None:
        """One step (or finish) in one transaction, then the session saves of the turns that
        ended in it; kept for the retry task instead when the storage refuses (or already
        refused: order is kept)."""
        if self.store is None:
            for rec in after:
                self._session_finished(rec, final_state(rec) == "done")
            return
        if not (rows or running or ends or after):
            return
        self._kept.append((rows, running, ends, list(after)))
        if self.fault is None:
            self._flush()

    # -- model registry and tokenizer cache -----------------------------------------------------
    def cached_tokenizer(self, name: str, path: Path) -> Any:
        """The model's tokenizer from the journal cache when the registry knows this very file
        (same path, size and mtime, so its recorded sha256 still holds); None otherwise."""
        if self.store is None:
            return None
        try:
            facts = self.store.get_model(name)
            st = os.stat(path)
            if (not facts or not facts.get("sha256") or facts.get("path") != str(path)
                    or facts.get("size") != st.st_size or facts.get("mtime_ns") != st.st_mtime_ns):
                return None
            return load_cached_tokenizer(self.store, str(facts["sha256"]))
        except (OSError, JournalError, sqlite3.Error) as exc:
            if self._warming and isinstance(exc, sqlite3.Error):
                raise  # e.g. dropping a bad entry: a write, left to the load (after the check)
            log.warning(f"journal: tokenizer cache of model {name} unusable: {exc}")
            return None

    def model_loaded(self, name: str, path: Path, ready: Ready, tokenizer: Any) -> None:
        """Registry facts after a load; the tokenizer cached under the source's sha256, which
        the numpy engine's runner read from the prepared file's header (no re-hash). The
        llama.cpp engine reads the GGUF itself (no prepared file, no sha256): nothing to cache,
        its vocabulary loads from the GGUF in milliseconds."""
        engine = ready.engine
        sha = engine.get("source_sha256")
        if self.store is None or not sha:
            return
        try:
            st = os.stat(path)
            self.store.record_model(
                name, path=str(path), sha256=str(sha), size=st.st_size,
                mtime_ns=st.st_mtime_ns, prepared_path=engine.get("prepared"),
                last_load_at=time.time(), last_load_s=ready.load_s)
            if tokenizer is not None and self.store.get_tokenizer(
                    str(sha), tokenizer.fingerprint) is None:
                cache_tokenizer(self.store, str(sha), tokenizer)
        except (OSError, JournalError, sqlite3.Error) as exc:
            log.warning(f"journal: could not record model {name}: {exc}")
            if isinstance(exc, sqlite3.Error):
                self._failed(exc)

    def model_failed(self, name: str, reason: str) -> None:
        if self.store is None:
            return
        try:
            self.store.record_model(name, last_failure=reason, last_failure_at=time.time())
        except (JournalError, sqlite3.Error) as exc:
            log.warning(f"journal: could not record the failure of model {name}: {exc}")
            if isinstance(exc, sqlite3.Error):
                self._failed(exc)

    # -- reads and warm start -----------------------------------------------------------------
    def rebuild(self, rid: str) -> RequestRecord | None:
        """A RequestRecord of a journaled request (text and pieces recomputed from its tokens)."""
        if self.store is None:
            return None
        jreq = self.store.get_request(rid)
        svc = None if jreq is None else self.services.get(jreq.model)
        if jreq is None or svc is None:
            return None
        tokens = [t.token_id for t in self.store.tokens(rid)]
        return self._record(jreq, tokens, svc)

    def _record(self, jreq: Any, tokens: list[int], svc: Any) -> RequestRecord:
        from edge_agent.runtime.detokenizer import IncrementalDecoder

        tok = svc.ensure_tokenizer()
        state = JobState(jreq.state) if jreq.state != "running" else JobState.QUEUED
        job = Job(id=jreq.id, model=jreq.model, prompt_ids=list(jreq.prompt_ids),
                  params=dict(jreq.params), priority=int(jreq.priority), state=state,
                  attempts=int(jreq.attempts))
        rec = RequestRecord(job=job, request=_request_from(jreq.input), model=jreq.model,
                            decoder=IncrementalDecoder(tok), prompt_tokens=len(jreq.prompt_ids),
                            stop_ids=svc.stop_ids, context=svc.context)
        for t in tokens:
            rec.push(t)
        rec.restart()
        if jreq.finished:  # read back as it ended (this record is not in the request table)
            message = jreq.error or ""
            if jreq.state == "expired":
                end = Outcome("expired", "deadline_exceeded", message)
            elif jreq.state == "failed":
                end = Outcome.failed("failed", message)
            elif jreq.state == "cancelled":
                end = Outcome("cancelled", finish_reason="cancelled")
            else:
                end = Outcome.done(jreq.finish_reason)
            rec.end(end)
        return rec

    def _reconcile_sessions(self) -> None:
        """A turn's session history is saved right after the step that finished it commits;
        a crash between the two leaves a done turn pending (`session_pending`, a partial
        index: O(pending) however big the journal is): add it back."""
        assert self.store is not None
        t0 = time.perf_counter()
        for rid in self.store.pending_turns():
            rec = self.rebuild(rid)
            if rec is not None:
                self._session_finished(rec, True)
                log.info(f"journal: session {rec.request.session}: turn {rid} restored")
        self.start_s["reconcile"] = time.perf_counter() - t0

    def _session_finished(self, rec: RequestRecord, done: bool) -> None:
        if self.sessions is not None:
            self.sessions.finished(rec, done)

    def resume(self) -> int:
        """Re-queue what recovery returned; returns how many requests were resumed."""
        if self.store is None or self.plan is None:
            return 0
        self._reconcile_sessions()
        n = 0
        for item in self.plan.resume:
            req = item.request
            svc = self.services.get(req.model)
            if svc is None:
                self.store.finish(req.id, "failed", error=f"model {req.model!r} is no longer "
                                  "configured. Hint: add its [models.NAME] table back.")
                continue
            rec = self._record(req, item.tokens, svc)
            now = time.monotonic()
            job = rec.job
            if req.deadline is not None:
                job.deadline_at = now + (req.deadline - time.time())
            # Keep the original submission time, so a deadline message counts from the request's
            # acceptance (not from this restart) and the job keeps its age in the queue.
            job.submitted_at = now - max(0.0, time.time() - req.created_at)
            try:
                self._submit(job, now)
            except QueueFull as exc:
                self.store.finish(req.id, "failed", error=f"could not be re-queued after a "
                                  f"restart: {exc}")
                continue
            self._add_record(rec)
            if rec.request.session is not None and self.sessions is not None:
                self.sessions.claim(rec.request.session, job.id)
            svc.poke()
            n += 1
        return n
