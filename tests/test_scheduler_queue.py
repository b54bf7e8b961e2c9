"""The scheduler's bounded queue, ordering, batching, deadlines, cancel and requeue.

Every time is explicit (`now` is a parameter); nothing sleeps.
"""

from __future__ import annotations

import random

import pytest

from edge_agent.errors import ConfigError, EdgeAgentError
from edge_agent.scheduler import (
    MAX_PRIORITY,
    Job,
    JobError,
    JobState,
    QueueFull,
    Scheduler,
    SchedulerConfig,
    UnknownJob,
)
from edge_agent.scheduler.queue import WINDOW_CAP

WINDOW_S = 0.005


def job(jid: str, model: str = "m", priority: int = 5, deadline_at: float | None = None) -> Job:
    return Job(id=jid, model=model, prompt_ids=[1, 2, 3], priority=priority,
               deadline_at=deadline_at)


def sched(**kw: object) -> Scheduler:
    base: dict[str, object] = {"batch_window_ms": 0, "default_timeout_ms": None}
    base.update(kw)
    return Scheduler(SchedulerConfig(**base))  # type: ignore[arg-type]  # SchedulerConfig's fields, mixed types


def ids(jobs: list[Job]) -> list[str]:
    return [j.id for j in jobs]


# -- the bound -------------------------------------------------------------------------------


def test_bound_counts_running_and_queued_across_models() -> None:
    # Ollama #7758: requests for an already-loaded model escaped the bound. Here they do not.
    s = sched(queue_max=3)
    s.submit(job("a1", "A"), 0.0)
    s.submit(job("a2", "A"), 0.0)
    assert ids(s.take("A", 8, 0.0)) == ["a1", "a2"]  # both running now, queue of A empty
    s.submit(job("b1", "B"), 0.1)  # waiting for model B to load
    assert s.depth == 3
    with pytest.raises(QueueFull) as info:
        s.submit(job("a3", "A"), 0.2)  # model A is loaded and has free slots: still refused
    err = info.value
    assert isinstance(err, EdgeAgentError)
    assert err.depth == 3 and err.limit == 3 and err.retry_after_s >= 1.0
    msg = str(err)
    assert "'a3'" in msg and "'A'" in msg and "3 of queue_max=3" in msg and "all models" in msg
    assert "Hint: retry after" in msg
    assert s.get("a3") is None
    s.finish("a1", 1.0, JobState.DONE)
    s.submit(job("a3", "A"), 1.0)  # a slot is free again
    assert s.depth == 3


def test_retry_after_follows_recent_finish_rate() -> None:
    s = sched(queue_max=2)
    for i in range(2):
        s.submit(job(f"j{i}"), 0.0)
    with pytest.raises(QueueFull) as info:
        s.submit(job("x"), 0.0)
    assert info.value.retry_after_s == 1.0  # no history yet: the floor
    s.take("m", 8, 0.0)
    s.finish("j0", 3.0, JobState.DONE)
    s.finish("j1", 9.0, JobState.DONE)  # one job per 6 s
    for i in range(2, 4):
        s.submit(job(f"j{i}"), 9.0)
    with pytest.raises(QueueFull) as info:
        s.submit(job("y"), 9.0)
    assert info.value.retry_after_s == pytest.approx(6.0)


def test_requeue_never_breaks_the_bound() -> None:
    s = sched(queue_max=2)
    s.submit(job("a"), 0.0)
    s.submit(job("b"), 0.0)
    s.take("m", 8, 0.0)
    assert [j.state for j in s.requeue(["a", "b"], 1.0)] == [JobState.QUEUED] * 2
    assert s.depth == 2 and s.counts()["queued"] == 2


# -- order -----------------------------------------------------------------------------------


def test_priority_higher_first_fifo_within_level() -> None:
    s = sched()
    for jid, prio in [("l1", 1), ("h1", 9), ("m1", 5), ("h2", 9), ("l2", 1), ("m2", 5)]:
        s.submit(job(jid, priority=prio), 0.0)
    assert ids(s.peek("m", 0.0)) == ["h1", "h2", "m1", "m2", "l1", "l2"]
    assert ids(s.take("m", 3, 0.0)) == ["h1", "h2", "m1"]
    s.submit(job("h3", priority=9), 0.5)
    assert ids(s.take("m", 3, 0.5)) == ["h3", "m2", "l1"]


def test_fifo_uses_submission_time_then_order() -> None:
    s = sched()
    s.submit(job("second"), 2.0)
    resumed = job("resumed")
    resumed.submitted_at = 1.0  # resumed from the journal: keeps its original place
    s.submit(resumed, 2.0)
    s.submit(job("third"), 2.0)
    assert ids(s.take("m", 8, 2.0)) == ["resumed", "second", "third"]


def test_aging_no_starvation_beyond_starvation_age() -> None:
    s = sched(starvation_age_s=10.0)
    s.submit(job("low", priority=0), 0.0)
    s.submit(job("high-old", priority=10), 1.0)
    s.submit(job("high-new", priority=10), 9.0)
    # before the age, priority wins
    assert ids(s.peek("m", 9.99)) == ["high-old", "high-new", "low"]
    # at the age, the starved job goes ahead of every level
    assert ids(s.peek("m", 10.0)) == ["low", "high-old", "high-new"]
    # starved jobs among themselves: oldest first, whatever their priority
    assert ids(s.peek("m", 11.0)) == ["low", "high-old", "high-new"]
    assert ids(s.take("m", 1, 10.0)) == ["low"]


def test_low_priority_starts_within_starvation_age_under_overload() -> None:
    # batch of 1, jobs last 1 s, a high-priority job arrives every 0.5 s (overload forever).
    age = 10.0
    s = sched(max_batch_size=1, queue_max=1000, starvation_age_s=age)
    t, n, running = 0.0, 0, None
    s.submit(job("h0", priority=10), 0.0)
    s.submit(job("low", priority=0), 0.25)
    low_started = None
    while t < 30.0:
        if running is not None and running.started_at is not None and \
                t >= running.started_at + 1.0:
            s.finish(running.id, t, JobState.DONE)
            running = None
        if t > 0 and t % 0.5 == 0:
            n += 1
            s.submit(job(f"h{n}", priority=10), t)
        if running is None:
            started = s.take("m", 1, t)
            if started:
                running = started[0]
                if running.id == "low":
                    low_started = t
        t = round(t + 0.25, 2)
    assert low_started is not None
    assert age <= low_started - 0.25 <= age + 1.0  # starved, then no longer than one job
    assert s.get("h30") is not None  # newer high-priority jobs kept coming meanwhile


def test_pending_models_orders_by_best_job() -> None:
    s = sched()
    s.submit(job("a", "A", priority=2), 0.0)
    s.submit(job("b", "B", priority=7), 1.0)
    s.submit(job("c", "C", priority=7), 0.5)
    assert s.pending_models(1.0) == ["C", "B", "A"]
    assert s.pending_models(20.0) == ["A", "C", "B"]  # all starved: oldest first


# -- batching --------------------------------------------------------------------------------


def test_lone_job_waits_at_most_the_batch_window_when_nothing_runs() -> None:
    s = sched(batch_window_ms=5)
    s.submit(job("a"), 100.0)
    assert s.take("m", 8, 100.0) == []
    assert s.next_wakeup(100.0) == pytest.approx(100.0 + WINDOW_S)
    assert s.take("m", 8, 100.004) == []
    s.submit(job("b"), 100.002)  # company arrives within the window: still waiting for more
    assert s.take("m", 8, 100.005) == []  # each arrival extends the wait by one window...
    assert s.next_wakeup(100.005) == pytest.approx(100.007)
    assert ids(s.take("m", 8, 100.007)) == ["a", "b"]  # ...and no one came in that window
    assert s.next_wakeup(100.007) is None


def test_a_burst_of_arrivals_waits_at_most_window_cap_windows() -> None:
    s = sched(batch_window_ms=5)
    for i in range(6):  # one every 4 ms: each within a window of the previous
        s.submit(job(f"j{i}"), 100.0 + 0.004 * i)
    assert s.take("m", 8, 100.0199) == []
    assert s.next_wakeup(100.0199) == pytest.approx(100.0 + WINDOW_CAP * WINDOW_S)
    assert ids(s.take("m", 8, 100.020)) == [f"j{i}" for i in range(6)]


def test_job_joins_at_once_when_a_batch_is_running() -> None:
    s = sched(batch_window_ms=5)
    s.submit(job("a"), 0.0)
    s.take("m", 8, 0.01)
    s.submit(job("b"), 1.0)
    assert ids(s.take("m", 7, 1.0)) == ["b"]  # no window: joins the next step


def test_job_starts_at_once_when_enough_are_queued_to_fill_the_slots() -> None:
    s = sched(batch_window_ms=5)
    s.submit(job("a"), 0.0)
    s.submit(job("b"), 0.0)
    assert ids(s.take("m", 2, 0.0)) == ["a", "b"]
    s2 = sched(batch_window_ms=5, max_batch_size=1)
    s2.submit(job("a"), 0.0)
    assert ids(s2.take("m", 8, 0.0)) == ["a"]  # a batch of one is already full


def test_zero_window_never_waits() -> None:
    s = sched(batch_window_ms=0)
    s.submit(job("a"), 0.0)
    assert ids(s.take("m", 8, 0.0)) == ["a"]


def test_max_batch_size_and_free_slots_bound_each_take() -> None:
    s = sched(max_batch_size=4)
    for i in range(10):
        s.submit(job(f"j{i}"), 0.0)
    assert ids(s.take("m", 100, 0.0)) == ["j0", "j1", "j2", "j3"]
    assert s.take("m", 100, 0.1) == []  # the batch is full
    assert s.take("m", 0, 0.1) == [] and s.take("m", -1, 0.1) == []
    s.finish("j0", 1.0, JobState.DONE)
    s.finish("j1", 1.0, JobState.DONE)
    assert ids(s.take("m", 1, 1.0)) == ["j4"]  # free_slots (runner's view) binds first
    assert ids(s.take("m", 5, 1.0)) == ["j5"]  # then max_batch_size
    assert len(s.running("m")) == 4 and s.queued("m") == 4


def test_running_ids_are_in_start_order_and_a_requeued_job_starts_again_last() -> None:
    s = sched()
    s.submit(job("low", priority=1), 0.0)
    s.submit(job("high", priority=9), 0.0)
    assert ids(s.take("m", 2, 0.0)) == ["high", "low"]
    assert s.running_ids("m") == ["high", "low"]  # as started (running() is by submission)
    assert ids(s.running("m")) == ["low", "high"]
    s.submit(job("next"), 0.5)
    assert ids(s.take("m", 1, 0.5)) == ["next"]
    s.requeue(["high"], 1.0)
    s.finish("low", 1.0, JobState.DONE)
    assert s.running_ids("m") == ["next"] and s.running_ids("other") == []
    assert ids(s.take("m", 1, 1.0)) == ["high"]
    assert s.running_ids("m") == ["next", "high"]


def test_take_other_model_is_independent() -> None:
    s = sched(max_batch_size=1)
    s.submit(job("a", "A"), 0.0)
    s.submit(job("b", "B"), 0.0)
    assert ids(s.take("A", 1, 0.0)) == ["a"]
    assert ids(s.take("B", 1, 0.0)) == ["b"]
    assert s.take("C", 1, 0.0) == []


# -- deadlines -------------------------------------------------------------------------------


def test_default_timeout_sets_and_caps_deadline() -> None:
    s = sched(default_timeout_ms=2000)
    a = s.submit(job("a"), 10.0)
    b = s.submit(job("b", deadline_at=10.5), 10.0)  # the request lowers it: kept
    c = s.submit(job("c", deadline_at=99.0), 10.0)  # the request raises it: capped
    assert (a.deadline_at, b.deadline_at, c.deadline_at) == (12.0, 10.5, 12.0)
    assert sched().submit(job("d"), 0.0).deadline_at is None  # no default configured


def test_expire_while_queued_names_durations() -> None:
    s = sched(default_timeout_ms=1500)
    s.submit(job("a"), 0.0)
    s.submit(job("b"), 0.5)
    assert s.next_wakeup(0.0) == 1.5
    assert s.expire(1.4999) == []
    (gone,) = s.expire(1.5)
    assert gone.id == "a" and gone.state is JobState.EXPIRED and gone.started_at is None
    assert gone.error is not None
    assert "while queued: queued 1.500 s and ran 0.000 s" in gone.error
    assert "deadline of 1.500 s" in gone.error and "Hint:" in gone.error
    assert s.depth == 1 and s.counts()["expired"] == 1


def test_expire_while_running_frees_the_slot() -> None:
    s = sched(max_batch_size=1, default_timeout_ms=30000)
    s.submit(job("a", deadline_at=3.0), 0.0)
    s.submit(job("b"), 0.0)
    assert ids(s.take("m", 1, 0.5)) == ["a"]
    assert s.take("m", 1, 1.0) == []
    (gone,) = s.expire(3.0)
    assert gone.started_at == 0.5  # was running: the caller releases its sequence
    assert gone.error is not None
    assert "deadline of 3.000 s passed while running: queued 0.500 s and ran 2.500 s" in gone.error
    assert gone.finished_at == 3.0 and gone.running_s(99.0) == 2.5
    assert ids(s.take("m", 1, 3.0)) == ["b"]  # its slot is free at once


def test_take_skips_jobs_past_their_deadline() -> None:
    s = sched()
    s.submit(job("late", deadline_at=1.0), 0.0)
    s.submit(job("ok"), 0.0)
    assert ids(s.take("m", 8, 2.0)) == ["ok"]
    assert ids(s.expire(2.0)) == ["late"]


def test_next_wakeup_is_earliest_of_deadlines_and_windows() -> None:
    s = sched(batch_window_ms=5)
    assert s.next_wakeup(0.0) is None
    s.submit(job("a", deadline_at=7.0), 0.0)
    assert s.next_wakeup(0.0) == pytest.approx(WINDOW_S)
    assert s.next_wakeup(1.0) == 7.0  # window over: only the deadline is left
    assert s.next_wakeup(8.0) == 7.0  # overdue deadline is reported: expire at once


# -- cancel, finish, requeue -----------------------------------------------------------------


def test_cancel_queued_and_running() -> None:
    s = sched()
    s.submit(job("q"), 0.0)
    s.submit(job("r"), 0.0)
    s.take("m", 1, 0.0)
    c_run = s.cancel("q", 1.0)
    assert c_run is not None and c_run.started_at == 0.0  # q was first: it was running
    c_q = s.cancel("r", 1.0)
    assert c_q is not None and c_q.started_at is None
    assert c_q.state is JobState.CANCELLED and c_q.finished_at == 1.0
    assert s.cancel("r", 2.0) is None  # already ended
    assert s.cancel("nope", 2.0) is None
    assert s.depth == 0 and s.counts()["cancelled"] == 2
    assert s.get("r") is c_q


def test_finish_rules() -> None:
    s = sched()
    s.submit(job("a"), 0.0)
    with pytest.raises(JobError, match=r"finish job 'a' as done: it is queued, it never ran"):
        s.finish("a", 1.0, JobState.DONE)
    with pytest.raises(JobError, match=r"'running' is not a final state.*Hint: use one of"):
        s.finish("a", 1.0, JobState.RUNNING)
    with pytest.raises(UnknownJob, match=r"job 'zz': no such job.*Hint: check the request id"):
        s.finish("zz", 1.0, JobState.DONE)
    s.take("m", 1, 0.0)
    s.cancel("a", 1.0)
    assert s.finish("a", 2.0, JobState.DONE) is None  # late done after cancel: first end wins
    assert s.get("a") is not None and s.get("a").state is JobState.CANCELLED  # type: ignore[union-attr]  # not None: checked first
    s.submit(job("b"), 3.0)
    failed = s.finish("b", 3.5, JobState.FAILED, "model failed to load")
    assert failed is not None and failed.error == "model failed to load"


def test_requeue_keeps_place_and_fails_after_max_retries() -> None:
    s = sched(max_retries=2, max_batch_size=1)
    s.submit(job("old"), 0.0)
    s.submit(job("new"), 1.0)
    for attempt in (1, 2):
        assert ids(s.take("m", 1, 10.0 * attempt)) == ["old"]
        (back,) = s.requeue(["old", "unknown-id"], 10.0 * attempt + 2)
        assert back.state is JobState.QUEUED and back.attempts == attempt
        assert back.started_at is None and back.ran_s == pytest.approx(2.0 * attempt)
    assert ids(s.take("m", 1, 30.0)) == ["old"]
    (dead,) = s.requeue(["old"], 31.0, reason="runner killed by SIGKILL")
    assert dead.state is JobState.FAILED and dead.attempts == 3
    assert dead.error is not None
    assert "runner killed by SIGKILL while running this request, 3 time(s)" in dead.error
    assert "max_retries=2" in dead.error and "Hint:" in dead.error
    assert s.requeue(["old"], 32.0) == []  # finished: skipped
    assert ids(s.take("m", 1, 32.0)) == ["new"]


def test_expire_after_requeue_counts_every_attempt() -> None:
    s = sched(default_timeout_ms=10000)
    s.submit(job("a"), 0.0)
    s.take("m", 1, 1.0)
    s.requeue(["a"], 3.0)  # ran 2 s
    s.take("m", 1, 4.0)  # queued 1 + 1 s
    (gone,) = s.expire(10.0)  # ran 2 + 6 s
    assert gone.error is not None
    assert "queued 2.000 s and ran 8.000 s" in gone.error and "2 attempt(s)" in gone.error


def test_fail_queued_fails_only_queued_jobs_of_that_model() -> None:
    s = sched()
    s.submit(job("a1", "A"), 0.0)
    s.submit(job("a2", "A"), 0.0)
    s.submit(job("b1", "B"), 0.0)
    s.take("A", 1, 0.0)
    failed = s.fail_queued("A", 1.0, "load of model 'A' failed")
    assert ids(failed) == ["a2"] and failed[0].state is JobState.FAILED
    assert s.counts() == {"queued": 1, "running": 1, "done": 0, "failed": 1,
                          "cancelled": 0, "expired": 0}


def test_finished_jobs_are_forgotten_after_keep_finished() -> None:
    s = sched(keep_finished=2)
    for i in range(3):
        s.submit(job(f"j{i}"), 0.0)
        s.cancel(f"j{i}", 0.0)
    assert s.get("j0") is None and s.get("j2") is not None
    s.submit(job("j0"), 1.0)  # an id forgotten can be reused


# -- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize("prio", [-1, 11, True, 5.0, "5"])
def test_submit_rejects_bad_priority(prio: object) -> None:
    s = sched()
    bad = job("p")
    bad.priority = prio  # type: ignore[assignment]  # on purpose: a bad priority
    with pytest.raises(JobError, match=r"submit job 'p': priority .* out of range.*from 0 to 10"):
        s.submit(bad, 0.0)
    assert s.depth == 0


def test_submit_rejects_duplicate_and_used_jobs() -> None:
    s = sched()
    s.submit(job("a"), 0.0)
    with pytest.raises(JobError, match=r"'a': a job with this id is already known \(queued\)"):
        s.submit(job("a"), 0.0)
    s.take("m", 1, 0.0)
    s.finish("a", 1.0, JobState.DONE)
    with pytest.raises(JobError, match=r"already known \(done\).*Hint: use a fresh request id"):
        s.submit(job("a"), 2.0)
    used = job("u")
    used.state = JobState.RUNNING
    with pytest.raises(JobError, match=r"'u': it is running, expected a new queued job"):
        s.submit(used, 0.0)
    with pytest.raises(JobError, match=r"'x': no model named"):
        s.submit(job("x", model=""), 0.0)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("queue_max", 0),
        ("queue_max", 2.5),
        ("max_batch_size", 0),
        ("batch_window_ms", -1),
        ("default_timeout_ms", 0),
        ("starvation_age_s", 0),
        ("starvation_age_s", float("nan")),
        ("max_retries", -1),
        ("max_retries", True),
        ("keep_finished", -5),
    ],
)
def test_config_rejects_bad_values(key: str, value: object) -> None:
    with pytest.raises(ConfigError, match=rf"scheduler\.{key} = .*expected .*Hint: fix"):
        SchedulerConfig(**{key: value})  # type: ignore[arg-type]  # on purpose: a bad value


def test_config_defaults() -> None:
    c = SchedulerConfig()
    assert (c.queue_max, c.max_batch_size, c.batch_window_ms, c.default_timeout_ms,
            c.starvation_age_s, c.max_retries) == (64, 8, 5, 120000, 10.0, 2)


# -- random operation sequences checked against the invariants --------------------------------


def _ref_key(j: Job, now: float, age: float) -> tuple[int, float, int]:
    assert j.submitted_at is not None
    starved = now - j.submitted_at >= age
    return (-(MAX_PRIORITY + 1) if starved else -j.priority, j.submitted_at, j.seq)


@pytest.mark.parametrize("seed", range(6))
def test_random_operations_keep_invariants(seed: int) -> None:
    rng = random.Random(seed)
    cfg = SchedulerConfig(
        queue_max=rng.choice([3, 8, 20]),
        max_batch_size=rng.choice([1, 2, 4]),
        batch_window_ms=rng.choice([0, 5, 50]),
        default_timeout_ms=rng.choice([None, 800, 3000]),
        starvation_age_s=rng.choice([0.5, 2.0]),
        max_retries=rng.choice([0, 1, 2]),
        keep_finished=10_000,
    )
    s = Scheduler(cfg)
    models = ["A", "B", "C"]
    now = 0.0
    accepted: dict[str, Job] = {}
    final: dict[str, JobState] = {}
    n = 0
    for _ in range(1500):
        op = rng.random()
        if op < 0.30:
            n += 1
            j = job(f"j{n}", rng.choice(models), rng.randint(0, 10),
                    deadline_at=now + rng.uniform(0, 4) if rng.random() < 0.3 else None)
            before = s.depth
            try:
                s.submit(j, now)
                accepted[j.id] = j
            except QueueFull as e:
                assert before == cfg.queue_max and e.retry_after_s >= 1.0
        elif op < 0.55:
            m, free = rng.choice(models), rng.randint(0, 5)
            running_before = len(s.running(m))
            order = sorted(
                (j for j in s.peek(m, now) if j.deadline_at is None or j.deadline_at > now),
                key=lambda j: _ref_key(j, now, cfg.starvation_age_s),
            )
            got = s.take(m, free, now)
            room = min(free, cfg.max_batch_size - running_before)
            assert len(got) <= max(0, room)
            if got:
                assert got == order[: len(got)]  # a prefix of the reference order
                assert len(got) == min(room, len(order))
            elif room > 0 and order:  # waiting only for the batch window
                assert running_before == 0 and len(order) < room
                arrived = [j.queued_at or 0.0 for j in s.peek(m, now)]
                window = cfg.batch_window_ms / 1000
                assert now < min(max(arrived) + window, min(arrived) + WINDOW_CAP * window)
            assert all(j.state is JobState.RUNNING and j.started_at == now for j in got)
        elif op < 0.65:
            live = [j for j in accepted.values() if not j.finished]
            if live:
                j = rng.choice(live)
                if j.state is JobState.RUNNING:
                    s.finish(j.id, now, rng.choice([JobState.DONE, JobState.FAILED]))
                else:
                    s.cancel(j.id, now)
        elif op < 0.72:
            m = rng.choice(models)
            for j in s.requeue([x.id for x in s.running(m)], now):
                assert j.state in (JobState.QUEUED, JobState.FAILED)
                assert j.attempts <= cfg.max_retries + 1
                if j.state is JobState.FAILED:
                    assert j.attempts == cfg.max_retries + 1
        elif op < 0.80:
            for j in s.expire(now):
                assert j.state is JobState.EXPIRED and j.deadline_at is not None
                assert j.deadline_at <= now and j.error and "queued" in j.error
        else:
            wake = s.next_wakeup(now)
            step = rng.choice([0.001, 0.003, 0.05, 0.3, 1.0])
            if wake is not None and wake > now and rng.random() < 0.5:
                step = wake - now
            now += step
        # invariants after every operation
        counts = s.counts()
        assert s.depth == counts["queued"] + counts["running"] <= cfg.queue_max
        for m in models:
            assert len(s.running(m)) <= cfg.max_batch_size
            assert all(j.state is JobState.QUEUED for j in s.peek(m, now))
        for jid, st in final.items():
            assert accepted[jid].state is st  # terminal states are final
        for jid, j in accepted.items():
            if j.finished:
                final.setdefault(jid, j.state)
                assert j.finished_at is not None
                assert j.queued_s(now) >= -1e-9 and j.running_s(now) >= 0
            assert j.attempts <= cfg.max_retries + 1
            assert s.get(jid) is j
        assert sum(counts.values()) == len(accepted)
        if cfg.default_timeout_ms is not None:
            assert all(j.deadline_at is not None for j in accepted.values())


def test_scheduler_package_stays_in_its_room() -> None:
    # docs/architecture.md: scheduler/ never imports asyncio, sockets, serial, SQLite or a clock.
    import ast
    from pathlib import Path

    import edge_agent.scheduler as pkg

    forbidden = {"asyncio", "socket", "serial", "sqlite3", "sqlite_utils", "time", "selectors"}
    files = sorted(Path(pkg.__file__).parent.glob("*.py"))
    assert len(files) >= 5
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                assert name.split(".")[0] not in forbidden, f"{path.name} imports {name}"
                if name.startswith("edge_agent."):
                    assert name.startswith(("edge_agent.scheduler", "edge_agent.errors")), name


def test_retry_after_is_whole_seconds_the_message_agrees_with() -> None:
    """Retry-After is the ceiling of the rate estimate and the message says the same number
    (it said 8 s while the header said 9)."""
    s = sched(queue_max=2)
    for i in range(2):
        s.submit(job(f"j{i}"), 0.0)
    s.take("m", 8, 0.0)
    s.finish("j0", 1.0, JobState.DONE)
    s.finish("j1", 9.4, JobState.DONE)  # one job per 8.4 s
    for i in range(2, 4):
        s.submit(job(f"j{i}"), 9.4)
    with pytest.raises(QueueFull) as info:
        s.submit(job("y"), 9.4)
    assert info.value.retry_after_s == 9.0
    assert "Hint: retry after 9 s" in str(info.value)


def test_requeue_of_a_job_that_progresses_never_gives_up() -> None:
    """max_retries bounds runner deaths in a row without a token; a job that produced one in
    the attempt that ended starts counting again (a killed runner costs no request)."""
    s = sched(max_retries=2, max_batch_size=1)
    s.submit(job("a"), 0.0)
    for attempt in range(1, 7):
        assert ids(s.take("m", 1, float(attempt))) == ["a"]
        (back,) = s.requeue(["a"], attempt + 0.5, progressed={"a"})
        assert back.state is JobState.QUEUED and back.attempts == attempt and back.stalls == 0
    for stall in (1, 2):
        s.take("m", 1, 10.0 + stall)
        (back,) = s.requeue(["a"], 10.5 + stall)
        assert back.state is JobState.QUEUED and back.stalls == stall
    s.take("m", 1, 20.0)
    (dead,) = s.requeue(["a"], 20.5, reason="runner killed")
    assert dead.state is JobState.FAILED and dead.error is not None
    assert "3 time(s) in a row without it producing a token" in dead.error
