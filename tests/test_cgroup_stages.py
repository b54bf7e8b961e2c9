"""The staged pressure response: escalation, caps, hysteretic release. Time is a parameter."""

from __future__ import annotations

import pytest

from edge_agent.cgroup.stages import StageConfig, Stages, actions_for

CFG = StageConfig(hold_s=10, escalate_interval_s=2, max_stage=3, batch_factor=0.5,
                  retry_after_s=7)


def test_escalates_one_step_per_interval_up_to_the_cap() -> None:
    s = Stages(CFG)
    t = s.on_pressure(100.0)
    assert t is not None and (t.from_stage, t.to_stage) == (0, 1) and s.name == "shrink-batches"
    assert s.on_pressure(101.0) is None  # too soon: stage 1 gets its chance
    t = s.on_pressure(102.0)
    assert t is not None and t.to_stage == 2
    assert "still under pressure 2.0 s after stage 1" in t.reason
    assert s.on_pressure(104.5).to_stage == 3  # type: ignore[union-attr]  # a transition is due here
    assert s.on_pressure(110.0) is None and s.stage == 3  # capped
    assert s.events == 5


def test_release_is_one_stage_per_calm_hold() -> None:
    s = Stages(CFG)
    for now in (0.0, 2.0, 4.0):
        s.on_pressure(now)
    assert s.stage == 3
    assert s.tick(13.9) is None  # only 9.9 s calm since the last event
    assert s.next_wakeup(13.9) == 14.0
    t = s.tick(14.0)
    assert t is not None and (t.from_stage, t.to_stage) == (3, 2)
    assert t.describe().startswith("memory pressure: released stage 3 (cancel-lowest) -> 2 "
                                   "(stop-admitting): no pressure event for 10.0 s")
    assert s.tick(20.0) is None  # the hold restarts at each release
    assert s.tick(24.0).to_stage == 1  # type: ignore[union-attr]  # a transition is due here
    s.on_pressure(25.0)  # pressure again at stage 1: escalation needs the interval (1 s < 2)
    assert s.stage == 1
    assert s.tick(34.9) is None and s.tick(35.0).to_stage == 0  # type: ignore[union-attr]  # a transition is due here
    assert s.tick(100.0) is None and s.next_wakeup(100.0) is None
    assert [h.to_stage for h in s.history] == [1, 2, 3, 2, 1, 0]


def test_still_high_reading_restarts_the_hold() -> None:
    s = Stages(CFG)
    s.on_pressure(0.0)
    assert s.tick(10.0, still_high=True) is None and s.stage == 1
    assert s.tick(19.0) is None
    assert s.tick(20.0).to_stage == 0  # type: ignore[union-attr]  # a transition is due here


def test_actions() -> None:
    a0, a1, a2, a3 = (actions_for(i, CFG) for i in range(4))
    assert (a0.admit, a0.batch_limit(8), a0.unload_idle, a0.cancel_lowest) == (True, 8, False,
                                                                              False)
    assert (a1.admit, a1.batch_limit(8), a1.batch_limit(1)) == (True, 4, 1)
    assert (a2.admit, a2.unload_idle, a2.cancel_lowest, a2.retry_after_s) == (False, True,
                                                                             False, 7)
    assert (a3.admit, a3.unload_idle, a3.cancel_lowest) == (False, True, True)
    s = Stages(CFG)
    s.on_pressure(1.0)
    d = s.to_dict()
    assert d["stage"] == 1 and d["admitting"] is True and d["history"][0]["name"] == \
        "shrink-batches"


def test_max_stage_limits_the_response() -> None:
    s = Stages(StageConfig(hold_s=1, escalate_interval_s=0, max_stage=1))
    s.on_pressure(0)
    assert s.on_pressure(5) is None and s.stage == 1
    assert Stages(StageConfig(max_stage=0)).on_pressure(0) is None


@pytest.mark.parametrize("kw", [{"max_stage": 4}, {"hold_s": 0}, {"batch_factor": 0},
                                {"escalate_interval_s": -1}])
def test_config_validation(kw: dict) -> None:
    with pytest.raises(ValueError):
        StageConfig(**kw)
