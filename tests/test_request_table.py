"""RequestTable: one request ends once, in one place, and every part hears of it in order.

The table is built with a real Scheduler and real RequestRecords (the default model's
tokenizer decodes), and recording fakes for the metrics and the journal (no daemon). Each
outcome kind must reach the scheduler (the job's final state), the record (outcome set,
waiters woken), the metrics and the journal exactly once, in that order; a second finish
changes nothing. The HTTP status and UART code of every code a request can end with come
from one table each.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from edge_agent.daemon.outcome import END_CODES, Outcome
from edge_agent.daemon.request_table import RequestTable
from edge_agent.daemon.requests import RequestRecord
from edge_agent.daemon.uart_backend import UART_END_CODES
from edge_agent.protocol.api import END_STATUS, end_error, parse_generation
from edge_agent.runtime.tokenizer import IncrementalDecoder, Tokenizer
from edge_agent.scheduler import Job, JobState, Scheduler, SchedulerConfig


class _Log:
    """The metrics and the journal as the table sees them: callables, recording in order."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.calls: list[tuple[str, str, str, str | None]] = []

    def count(self, rec: RequestRecord, state: str) -> None:
        job = self.sched.get(rec.id)
        assert job is not None and job.state.terminal, "the scheduler ends the job first"
        assert rec.done.is_set() and rec.outcome is not None, "the record ends before metrics"
        self.calls.append(("metrics", rec.id, state, None))

    def journal(self, rec: RequestRecord) -> None:
        assert rec.outcome is not None
        assert [c[0] for c in self.calls[-1:]] == ["metrics"], "metrics before the journal"
        self.calls.append(("journal", rec.id, rec.outcome.state, rec.outcome.code))


def _table(tokenizer: Tokenizer, keep: int = 100) -> tuple[RequestTable, Scheduler, _Log]:
    sched = Scheduler(SchedulerConfig(batch_window_ms=0, default_timeout_ms=None))
    log = _Log(sched)
    return RequestTable(sched, keep_finished=keep, count=log.count, journal=log.journal), \
        sched, log


def _add(table: RequestTable, sched: Scheduler, tokenizer: Tokenizer, rid: str, *,
         run: bool = True, deadline: float | None = None) -> RequestRecord:
    job = Job(id=rid, model="m", prompt_ids=[1, 2], deadline_at=deadline)
    sched.submit(job, 0.0)
    if run:
        assert [j.id for j in sched.take("m", 8, 0.0) if j.id == rid] == [rid]
    req = parse_generation({"prompt": "hi", "max_tokens": 4}, chat=False, max_tokens_limit=64)
    rec = RequestRecord(job=job, request=req, model="m", decoder=IncrementalDecoder(tokenizer),
                        prompt_tokens=2, stop_ids=frozenset({2}), context=64)
    table.add(rec)
    return rec


KINDS: list[tuple[Outcome, JobState]] = [
    (Outcome.done("stop"), JobState.DONE),
    (Outcome.done("length"), JobState.DONE),
    (Outcome.failed("runner_error", "runner: boom"), JobState.FAILED),
    (Outcome.failed("memory_pressure", "shed under pressure"), JobState.FAILED),
    (Outcome.cancel("cancelled by the client"), JobState.CANCELLED),
    (Outcome.expired("deadline of 1.000 s passed", 0.25, 0.75), JobState.EXPIRED),
]


@pytest.mark.parametrize(("outcome", "job_state"), KINDS,
                         ids=[f"{o.state}-{o.code or o.finish_reason}" for o, _ in KINDS])
def test_every_outcome_reaches_scheduler_record_metrics_journal_once(
        tokenizer: Tokenizer, outcome: Outcome, job_state: JobState) -> None:
    async def go() -> None:
        table, sched, log = _table(tokenizer)
        rec = _add(table, sched, tokenizer, "r1")
        waiter = asyncio.ensure_future(rec.wait_change())
        await asyncio.sleep(0)
        assert table.finish("r1", outcome, 1.0)
        await asyncio.wait_for(waiter, 1.0)  # the waiter was woken
        job = sched.get("r1")
        assert job is not None and job.state is job_state
        assert rec.outcome == outcome and rec.done.is_set()
        assert rec.finish_reason == outcome.finish_reason
        assert log.calls == [("metrics", "r1", outcome.state, None),
                             ("journal", "r1", outcome.state, outcome.code)]
        if outcome.state == "failed":
            assert job.error == outcome.message
        # a second end, of any kind, changes nothing anywhere
        for other, _ in KINDS:
            assert not table.finish("r1", other, 2.0)
        assert rec.outcome == outcome and job.state is job_state
        assert len(log.calls) == 2
        assert rec.to_dict(2.0)["error"] == (None if outcome.code is None else {
            "code": outcome.code, "message": outcome.message})

    asyncio.run(go())


def test_an_end_the_scheduler_made_itself_is_still_told_everyone(tokenizer: Tokenizer) -> None:
    """Expiry, a failed load's queued jobs, retries exhausted: the scheduler ends the job in
    bulk; the table then ends the record, the metrics and the journal (not the job again)."""
    table, sched, log = _table(tokenizer)
    _add(table, sched, tokenizer, "late", deadline=0.5)
    _add(table, sched, tokenizer, "queued", run=False)
    [expired] = sched.expire(1.0)
    assert table.finish("late", Outcome.expired(expired.error or "", expired.queued_s(1.0),
                                                expired.running_s(1.0)), 1.0)
    [failed] = sched.fail_queued("m", 1.0, "load failed")
    assert table.finish("queued", Outcome.failed("model_failed", "load failed"), 1.0)
    assert failed.state is JobState.FAILED and expired.state is JobState.EXPIRED
    assert [c[:3] for c in log.calls] == [("metrics", "late", "expired"),
                                          ("journal", "late", "expired"),
                                          ("metrics", "queued", "failed"),
                                          ("journal", "queued", "failed")]


def test_a_late_end_after_cancel_is_ignored_and_unknown_ids_too(tokenizer: Tokenizer) -> None:
    table, sched, log = _table(tokenizer)
    rec = _add(table, sched, tokenizer, "r1")
    assert table.finish("r1", Outcome.cancel("client went away"), 1.0)
    assert not table.finish("r1", Outcome.done("stop"), 1.5)  # its last token came late
    assert rec.outcome is not None and rec.outcome.cancelled == "client went away"
    assert not table.finish("nope", Outcome.done("stop"), 1.0)
    assert len(log.calls) == 2


def test_a_kept_request_answers_its_client_only(tokenizer: Tokenizer) -> None:
    """Daemon stopping with the journal on: the client gets 503 shutting_down, the job stays
    running and nothing is counted or journaled (it resumes at the next start)."""
    table, sched, log = _table(tokenizer)
    rec = _add(table, sched, tokenizer, "r1")
    kept = Outcome.failed("shutting_down", "daemon stopping; kept", kept=True)
    assert table.finish("r1", kept, 1.0)
    assert rec.done.is_set() and rec.outcome == kept
    job = sched.get("r1")
    assert job is not None and job.state is JobState.RUNNING
    assert log.calls == []
    assert not table.finish("r1", Outcome.done("stop"), 2.0)


def test_finished_records_beyond_keep_finished_are_forgotten_open_ones_kept(
        tokenizer: Tokenizer) -> None:
    table, sched, _ = _table(tokenizer, keep=2)
    _add(table, sched, tokenizer, "a")
    table.finish("a", Outcome.done("stop"), 1.0)
    _add(table, sched, tokenizer, "b")
    _add(table, sched, tokenizer, "c")  # a is done and the oldest: forgotten
    assert list(table) == ["b", "c"]
    _add(table, sched, tokenizer, "d")  # b is still open: nothing is forgotten
    assert list(table) == ["b", "c", "d"] and "a" not in table and len(table) == 3


def test_the_record_only_says_its_output_ended(tokenizer: Tokenizer) -> None:
    """push() reports the end of the output (`ended`); the request ends in the table."""
    table, sched, log = _table(tokenizer)
    rec = _add(table, sched, tokenizer, "r1")
    assert rec.push(2)  # the end-of-sequence id
    assert rec.ended == "stop" and not rec.done.is_set() and rec.outcome is None
    assert rec.push(5)  # nothing after the end
    assert table.finish("r1", Outcome.done(rec.ended), 1.0)
    assert rec.finish_reason == "stop" and log.calls[-1] == ("journal", "r1", "done", None)


EXPECTED_STATUS = {"deadline_exceeded": 504, "memory_pressure": 503, "shutting_down": 503,
                   "runner_error": 500, "runner_failed": 503, "model_failed": 503,
                   "budget_exceeded": 503, "failed": 503}


@pytest.mark.parametrize("code", END_CODES)
def test_every_end_code_has_one_http_status_and_one_uart_code(code: str) -> None:
    assert END_STATUS[code] == EXPECTED_STATUS[code]
    assert UART_END_CODES[code] == code  # the UART speaks the HTTP API's code words
    err = end_error(code, "why. Hint: what to do.", {"id": "req-1"})
    body: Any = json.loads(err.body())
    assert err.status == EXPECTED_STATUS[code]
    assert body["error"]["code"] == code and body["error"]["id"] == "req-1"
    assert body["error"]["message"] == "why. Hint: what to do."


def test_the_tables_list_exactly_the_end_codes() -> None:
    assert set(END_STATUS) == set(END_CODES) == set(UART_END_CODES) == set(EXPECTED_STATUS)
