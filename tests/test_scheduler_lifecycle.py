"""The model lifecycle state machine: valid and invalid transitions, reasons, idle TTL."""

from __future__ import annotations

import random

import pytest

from edge_agent.errors import EdgeAgentError
from edge_agent.scheduler import ALLOWED, InvalidTransition, ModelLifecycle, ModelState

S = ModelState


def serving(now: float = 0.0) -> ModelLifecycle:
    m = ModelLifecycle("smollm2", now)
    m.start_load(now)
    m.start_warmup(now + 1)
    m.ready(now + 2, busy=True)
    return m


def test_full_life_records_history_and_times() -> None:
    m = ModelLifecycle("smollm2", 0.0)
    assert m.state is S.UNLOADED and not m.resident and not m.can_serve
    m.start_load(1.0)
    assert m.state is S.LOADING and m.resident and m.loads == 1 and m.since == 1.0
    m.start_warmup(2.0)
    m.ready(3.0, busy=True)
    assert m.state is S.SERVING and m.can_serve and m.last_used == 3.0
    m.use(4.0)
    assert m.state is S.SERVING and m.last_used == 4.0 and m.since == 3.0  # refresh only
    m.mark_idle(5.0)
    assert m.state is S.IDLE and m.idle_since == 5.0 and m.last_used == 5.0
    m.mark_idle(6.0)
    assert m.idle_since == 5.0  # already idle: unchanged
    m.use(7.0)
    assert m.state is S.SERVING and m.idle_since is None
    m.mark_idle(8.0)
    m.start_unload(9.0)
    assert m.state is S.UNLOADING and m.resident and m.idle_since is None
    m.unloaded(10.0)
    assert m.state is S.UNLOADED and m.reason is None and m.losses == 0
    assert [(t, a.value, b.value) for t, a, b in m.history] == [
        (1.0, "unloaded", "loading"),
        (2.0, "loading", "warming"),
        (3.0, "warming", "serving"),
        (5.0, "serving", "idle"),
        (7.0, "idle", "serving"),
        (8.0, "serving", "idle"),
        (9.0, "idle", "unloading"),
        (10.0, "unloading", "unloaded"),
    ]
    assert m.to_dict()["state"] == "unloaded" and m.to_dict()["loads"] == 1


def test_preloaded_model_goes_idle_after_warmup() -> None:
    m = ModelLifecycle("a")
    m.start_load(0.0)
    m.start_warmup(1.0)
    m.ready(2.0)
    assert m.state is S.IDLE and m.idle_since == 2.0


@pytest.mark.parametrize(
    ("frm", "to"),
    [(a, b) for a in S for b in S if b not in ALLOWED[a]],
    ids=lambda s: s.value,
)
def test_every_invalid_transition_raises_and_changes_nothing(
    frm: ModelState, to: ModelState
) -> None:
    m = ModelLifecycle("tiny", 0.0)
    m.state = frm  # place the machine directly in the state under test
    with pytest.raises(InvalidTransition) as info:
        m.transition(to, 5.0, reason="x")
    err = info.value
    assert issubclass(type(err), EdgeAgentError)
    assert (err.model, err.from_state, err.to_state) == ("tiny", frm.value, to.value)
    msg = str(err)
    assert f"model 'tiny': cannot go from {frm.value} to {to.value}" in msg
    for allowed in ALLOWED[frm]:
        assert allowed.value in msg.split("only: ")[1]
    assert "Hint:" in msg
    assert m.state is frm and m.since == 0.0 and not m.history


def test_valid_transition_table_is_what_the_issue_names() -> None:
    assert ALLOWED[S.UNLOADED] == {S.LOADING}
    assert S.WARMING in ALLOWED[S.LOADING] and S.SERVING in ALLOWED[S.WARMING]
    assert ALLOWED[S.UNLOADING] == {S.UNLOADED, S.FAILED}
    for st in (S.LOADING, S.WARMING, S.SERVING, S.IDLE, S.UNLOADING):
        assert S.FAILED in ALLOWED[st]  # failed is reachable from every resident state
    assert ALLOWED[S.FAILED] == {S.LOADING, S.UNLOADED}


def test_failed_needs_a_reason_and_keeps_it_until_next_load() -> None:
    m = ModelLifecycle("big")
    m.start_load(0.0)
    with pytest.raises(InvalidTransition, match=r"going to failed needs a reason.*Hint:"):
        m.transition(S.FAILED, 1.0)
    assert m.state is S.LOADING
    m.fail(1.0, "weights do not fit: 3 GiB over a 2 GiB limit")
    assert m.state is S.FAILED and m.reason == "weights do not fit: 3 GiB over a 2 GiB limit"
    assert not m.resident and not m.can_serve
    m.start_load(2.0)  # retry on demand
    assert m.state is S.LOADING and m.reason is None and m.loads == 2


def test_runner_lost_goes_back_to_unloaded_with_reason() -> None:
    m = serving()
    m.lost(5.0, "runner killed by signal 9")
    assert m.state is S.UNLOADED and m.reason == "runner killed by signal 9" and m.losses == 1
    m.start_load(6.0)
    assert m.reason is None


def test_idle_ttl() -> None:
    m = serving()
    assert not m.should_unload(100.0, 0.0)  # serving: never
    assert m.unload_at(30.0) is None
    m.mark_idle(10.0)
    assert m.unload_at(30.0) == 40.0
    assert not m.should_unload(39.999, 30.0)
    assert m.should_unload(40.0, 30.0)
    assert m.should_unload(10.0, 0.0)
    assert not m.should_unload(1e9, None) and m.unload_at(None) is None  # no TTL: keep
    m.use(41.0)
    assert not m.should_unload(1000.0, 30.0)


@pytest.mark.parametrize("seed", range(4))
def test_random_walks_keep_invariants(seed: int) -> None:
    rng = random.Random(seed)
    m = ModelLifecycle("walk")
    now = 0.0
    for _ in range(800):
        now += rng.random()
        to = rng.choice(list(S))
        before = m.state
        reason = rng.choice([None, "boom"])
        try:
            m.transition(to, now, reason)
        except InvalidTransition:
            assert (to not in ALLOWED[before]) or (to is S.FAILED and not reason)
            assert m.state is before
            continue
        assert to in ALLOWED[before] and m.state is to and m.since == now
        assert (m.idle_since is not None) == (m.state is S.IDLE)
        if m.state is S.FAILED:
            assert m.reason
        if m.state is S.LOADING:
            assert m.reason is None
        assert m.history[-1] == (now, before, to)
