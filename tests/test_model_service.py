"""ModelService over small fakes (no daemon, no runner process): what a model loop does with
the collaborators its constructor takes.

The scheduler and the request table are the real ones (a request ends in one place); the
daemon around the loop (`ServiceHost`), the journal, the memory guard and the other model
services (`Peer`s) are recording fakes. Loads here fail before a runner would be spawned: at
the model file, at the memory budget, or at the cgroup after evicting an idle peer.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edge_agent.config import ModelConfigEntry, RuntimeConfig
from edge_agent.daemon.metrics import Metrics
from edge_agent.daemon.outcome import Outcome
from edge_agent.daemon.request_table import RequestTable
from edge_agent.daemon.requests import RequestRecord
from edge_agent.daemon.service import ModelService
from edge_agent.protocol.api import parse_generation
from edge_agent.scheduler import Job, JobState, ModelLifecycle, ModelState, Scheduler
from edge_agent.scheduler.jobs import SchedulerConfig


class Host:
    """The daemon as a model loop sees it: a shutdown flag, deadlines, settle events."""

    def __init__(self, limit: int = 1 << 40) -> None:
        self.stopping = False
        self.limit = limit
        self.settled: list[tuple[str, ModelState]] = []
        self.status: list[str] = []
        self._settled = asyncio.Event()

    def reap(self, now: float) -> None:
        pass  # no deadlines in these tests

    def wait_timeout(self, now: float) -> float | None:
        return None

    def memory_limit(self) -> int:
        return self.limit

    def notifier_extend(self, status: str) -> None:
        self.status.append(status)

    def claim_runner(self, env: object) -> None:
        return None  # nothing pre-started: every load spawns its runner

    def model_settled(self, svc: ModelService) -> None:
        self.settled.append((svc.name, svc.lifecycle.state))
        self._settled.set()
        self._settled = asyncio.Event()

    async def wait_settled(self) -> None:
        await self._settled.wait()


class Journal:
    """The journal off (no store), recording the model rows it is asked to write."""

    store = None
    writable = True

    def __init__(self) -> None:
        self.failed: list[tuple[str, str]] = []

    def cached_tokenizer(self, name: str, path: Path) -> Any:
        return None

    def begin_step(self) -> None:
        pass

    async def commit_step(self) -> None:
        pass

    def started(self, rids: list[str]) -> None:
        pass

    def token(self, rec: RequestRecord, before: int) -> None:
        pass

    def model_loaded(self, name: str, path: Path, ready: Any, tokenizer: Any) -> None:
        raise AssertionError("no load succeeds in these tests")

    def model_failed(self, name: str, reason: str) -> None:
        self.failed.append((name, reason))


class Memory:
    """The memory guard: no cgroups; `refuse` makes creating the runner's group fail."""

    def __init__(self, refuse: str | None = None) -> None:
        self.refuse = refuse
        self.exited: list[str] = []

    def runner_hook(self, name: str, budget: int | None) -> None:
        if self.refuse is not None:
            raise OSError(self.refuse)

    def runner_exited(self, name: str) -> str | None:
        self.exited.append(name)
        return None

    def batch_limit(self, max_batch: int) -> int:
        return max_batch

    def model_dict(self, name: str) -> dict[str, Any]:
        return {}


@dataclass
class FakePeer:
    """Another model, resident and idle; it unloads as soon as it is asked to."""

    name: str
    budget_bytes: int
    host: Host
    busy: bool = False
    unload_requests: int = 0
    lifecycle: ModelLifecycle = field(init=False)

    def __post_init__(self) -> None:
        self.lifecycle = ModelLifecycle(self.name, 0.0)
        self.lifecycle.state = ModelState.IDLE  # a fake: no load happened

    def in_use(self) -> bool:
        return self.busy

    def request_unload(self) -> None:
        self.unload_requests += 1
        asyncio.get_running_loop().call_soon(self._unloaded)  # its loop unloads it later

    def _unloaded(self) -> None:
        self.lifecycle.state = ModelState.UNLOADED
        self.host.model_settled(self)


@dataclass
class World:
    svc: ModelService
    host: Host
    sched: Scheduler
    table: RequestTable
    journal: Journal
    memory: Memory
    metrics: Metrics
    peers: dict[str, Any]


def make_world(path: Path, *, limit: int = 1 << 40, memory: Memory | None = None) -> World:
    host, journal, metrics, memory = Host(limit), Journal(), Metrics(), memory or Memory()
    sched = Scheduler(SchedulerConfig(batch_window_ms=0, default_timeout_ms=None))
    table = RequestTable(sched, keep_finished=100, count=metrics.request_done,
                         journal=lambda rec: None)
    peers: dict[str, Any] = {}
    svc = ModelService(
        ModelConfigEntry(name="m", path=path, context=256, max_batch=2),
        RuntimeConfig(engine="numpy"), state_dir=path.parent, host=host, scheduler=sched,
        requests=table, journal=journal, memory=memory, metrics=metrics,
        peers=lambda: peers)
    peers["m"] = svc
    return World(svc, host, sched, table, journal, memory, metrics, peers)


def submit(w: World, rid: str) -> RequestRecord:
    """A request for model m, queued as the daemon's submit leaves it."""
    job = Job(id=rid, model="m", prompt_ids=[1, 2, 3])
    w.sched.submit(job, 0.0)
    req = parse_generation({"prompt": "hi", "max_tokens": 4}, chat=False, max_tokens_limit=64)
    rec = RequestRecord(job=job, request=req, model="m", decoder=None, prompt_tokens=3,
                        stop_ids=frozenset({2}), context=256)
    w.table.add(rec)
    return rec


async def run_until_settled(w: World) -> None:
    """Run the model's loop until it settles once, then stop it (it is not resident)."""
    task = asyncio.create_task(w.svc.run())
    try:
        for _ in range(1000):  # 10 s
            if any(name == w.svc.name for name, _ in w.host.settled):
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError(f"model {w.svc.name} did not settle within 10 s")
    finally:
        w.host.stopping = True
        w.svc.poke()
        await asyncio.wait_for(task, 10.0)


def test_a_load_failing_at_the_model_file_ends_every_queued_request(tmp_path: Path) -> None:
    w = make_world(tmp_path / "missing.gguf")
    recs = [submit(w, "r1"), submit(w, "r2")]

    asyncio.run(run_until_settled(w))

    reason = w.svc.lifecycle.reason
    assert w.svc.lifecycle.state is ModelState.FAILED and reason
    assert w.host.settled == [("m", ModelState.FAILED)]
    assert w.journal.failed == [("m", reason)]
    for rec in recs:
        assert rec.done.is_set() and rec.outcome == Outcome.failed("model_failed", reason)
        assert rec.job.state is JobState.FAILED
    assert w.sched.queued("m") == 0 and w.svc.active == {}
    assert w.metrics.model_events[("m", "load_failed")] == 1
    assert w.metrics.requests[("m", "failed")] == 2
    assert w.memory.exited == ["m"]  # the failed load's cgroup is cleaned up


def test_a_model_over_the_memory_limit_ends_its_requests_budget_exceeded(
        model_path: Path) -> None:
    w = make_world(model_path, limit=1 << 20)  # 1 MiB: no model fits
    rec = submit(w, "r1")

    asyncio.run(run_until_settled(w))

    assert w.svc.lifecycle.state is ModelState.FAILED
    assert rec.outcome is not None and rec.outcome.code == "budget_exceeded"
    assert "memory limit" in (rec.outcome.message or "")


def test_a_load_asks_the_idle_peer_to_unload_and_keeps_the_busy_one(model_path: Path) -> None:
    w = make_world(model_path, memory=Memory(refuse="models/m: cgroup refused (test)"))
    w.svc.ensure_tokenizer()  # the budget, from the GGUF's metadata
    need = w.svc.budget_bytes
    assert need is not None
    idle = FakePeer("idle", need, w.host)
    busy = FakePeer("busy", need, w.host, busy=True)
    w.peers.update(idle=idle, busy=busy)
    w.host.limit = 2 * need + need // 2  # m fits beside one of them, not beside both
    rec = submit(w, "r1")

    asyncio.run(run_until_settled(w))

    assert idle.unload_requests == 1 and busy.unload_requests == 0
    assert busy.lifecycle.state is ModelState.IDLE
    # the load went on past the eviction and failed at the runner's cgroup, with that reason
    assert w.svc.lifecycle.reason == "models/m: cgroup refused (test)"
    assert rec.outcome == Outcome.failed("model_failed", "models/m: cgroup refused (test)")


def test_the_running_requests_are_the_schedulers(tmp_path: Path) -> None:
    async def go() -> None:
        w = make_world(tmp_path / "m.gguf")
        a, b, c = submit(w, "a"), submit(w, "b"), submit(w, "c")
        assert w.svc.active == {} and w.svc.in_use()  # queued: in use, none running
        assert [j.id for j in w.sched.take("m", 2, 1.0)] == ["a", "b"]
        assert w.svc.active == {"a": a, "b": b}
        w.table.finish("a", Outcome.cancel("cancelled by the client"), 2.0)
        assert w.svc.active == {"b": b}  # at once, not at the loop's next turn
        # answered and kept for the next start: no longer running here, still in the queue's
        w.table.finish("b", Outcome.failed("shutting_down", "kept", kept=True), 3.0)
        assert w.svc.active == {} and w.sched.running_ids("m") == ["b"]
        assert c.job.state is JobState.QUEUED

    asyncio.run(go())


def test_the_step_window_counts_steps_by_the_batch_measured(tmp_path: Path) -> None:
    """`runtime.step_window_ms`: as many decode steps per message as fit in the window, from
    the step time measured for that batch size (or a larger one); one step before any such
    measurement, while sequences are added or requests wait, and for logprobs."""
    from edge_agent.daemon.ipc import AddSeq, StepResult

    w = make_world(tmp_path / "m.gguf")
    svc = w.svc
    assert svc.runtime.step_window_ms == 50  # the default
    recs = [submit(w, f"r{i}") for i in range(3)]
    taken = w.sched.take("m", 2, 0.0)
    assert [j.id for j in taken] == ["r0", "r1"] and list(svc.active) == ["r0", "r1"]
    both, one = ["r0", "r1"], ["r0"]
    assert svc._steps([], both) == 1  # nothing measured

    def decoded(size: int, step_s: float, steps: int) -> None:
        svc._take_reply(StepResult(tokens={}, errors={}, free_blocks=None, step_s=step_s,
                                   steps=steps), size)

    decoded(1, 0.030, 3)  # 10 ms a step, one sequence
    w.sched.cancel("r2", 0.0)  # nobody waits for a slot any more
    assert svc._steps([], one) == 5
    assert svc._steps([], both) == 1  # a batch of 1's time would overrun the window
    decoded(2, 0.040, 2)  # 20 ms a step, two sequences
    assert svc._steps([], both) == 2
    decoded(2, 0.080, 2)  # slower now: smoothed, 26 ms
    assert svc._steps([], both) == 1
    add = AddSeq(id="r9", prompt=(1,), params={})
    assert svc._steps([add], one) == 1  # its first token goes out at once
    submit(w, "r3")  # waits for a slot: joins at the next message
    assert svc._steps([], one) == 1
    w.sched.cancel("r3", 0.0)
    assert svc._steps([], one) == 5
    recs[0].wants_logprobs = True
    assert svc._steps([], one) == 1
    svc.runtime = RuntimeConfig(engine="numpy", step_window_ms=0)
    recs[0].wants_logprobs = False
    assert svc._steps([], one) == 1


def test_a_message_written_after_a_request_came_takes_it_in(tmp_path: Path) -> None:
    """`_at_send`: a step message is built while the one before it runs and written when that
    one is answered; a request that came in between joins it then (one step sooner), within
    the room the batch and the runner's held sequences leave; with none to add it still drops
    to one step while requests wait; a message that is not the last built takes nobody."""
    from edge_agent.daemon.ipc import Step

    w = make_world(tmp_path / "m.gguf")
    svc = w.svc
    svc.lifecycle.start_load(0.0)
    svc.lifecycle.start_warmup(0.0)
    svc.lifecycle.ready(0.0, busy=True)
    submit(w, "r0")
    (job,) = w.sched.take("m", 2, 0.0)
    svc._held["r0"] = None  # running in the runner
    built = Step(step=("r0",), steps=4)
    svc._built, svc._inflight_size, svc._pending = 7, 1, {"r0": 4}

    assert svc._at_send(built, built=7) == built  # nobody came: as built
    assert svc._long_out and not svc._hurried

    submit(w, "r1")
    submit(w, "r2")  # max_batch 2: one of the two fits
    assert svc._at_send(built, built=6) == dataclasses.replace(built, steps=1, limits={})
    assert w.sched.queued("m") == 2  # an older message takes nobody

    sent = svc._at_send(built, built=7)
    assert isinstance(sent, Step) and sent.steps == 1 and sent.step == ("r0",)
    assert [a.id for a in sent.add] == ["r1"] and sent.add[0].prompt == (1, 2, 3)
    assert list(svc._held) == ["r0", "r1"] and list(svc.active) == ["r0", "r1"]
    assert svc._inflight_size == 2 and svc._pending == {"r0": 4, "r1": 1}
    assert w.sched.queued("m") == 1 and not svc._long_out

    svc.to_release.append("r0")  # ended, not yet released: its sequence still counts
    w.table.finish("r0", Outcome.failed("cancelled", "gone"), 1.0)
    del svc._held["r0"]
    # r0 ended meanwhile: not stepped (released with the next message); r2 still finds no room
    assert svc._at_send(built, built=7) == dataclasses.replace(built, step=(), steps=1,
                                                                limits={})
    assert w.sched.queued("m") == 1
    assert svc._inflight_size == 1 and "r0" not in svc._pending


def test_a_sequence_that_ends_here_is_not_stepped_on(tmp_path: Path) -> None:
    """A request that ends in the control plane while the runner would go on stepping it
    (cancelled, expired, cut at a stop string) hurries the message of several steps that runs
    it and is left out of the message written next; one that ended at a stop id or its length
    (the runner stops those by itself) hurries nothing."""
    from edge_agent.daemon.ipc import Step

    class Runner:
        hurries = 0

        def hurry(self) -> None:
            self.hurries += 1

    w = make_world(tmp_path / "m.gguf")
    svc = w.svc
    runner = Runner()
    svc.runner = runner  # type: ignore[assignment]
    recs = {jid: submit(w, jid) for jid in ("a", "b", "c")}
    w.sched.take("m", 3, 0.0)
    svc._held.update(dict.fromkeys(recs))
    built = Step(step=("a", "b", "c"), steps=8, limits={"b": 3})
    svc._built, svc._inflight_size, svc._pending = 3, 3, {"a": 8, "b": 3, "c": 8}
    assert svc._at_send(built, built=3) == built and svc._long_out
    svc.poke()
    assert runner.hurries == 0  # nothing waits, nothing ended

    recs["a"].ended = "length"  # the runner stops it at its limit by itself
    w.table.finish("a", Outcome.done("length"), 1.0)
    svc.poke()
    assert runner.hurries == 0
    w.table.finish("b", Outcome.cancel("cancelled by the client"), 1.0)
    svc.poke()
    svc.poke()
    assert runner.hurries == 1 and svc._hurried  # once per message

    sent = svc._at_send(built, built=3)  # the next message, built before the cancel
    assert sent == dataclasses.replace(built, step=("c",), limits={})
    assert svc._long_out and not svc._hurried and svc._out_ids == ("c",)
    assert svc._inflight_size == 1 and svc._pending == {"c": 8}
    svc.poke()
    assert runner.hurries == 1  # what it steps has not ended
