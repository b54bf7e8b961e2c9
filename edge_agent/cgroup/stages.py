"""The staged response to memory pressure: a pure state machine, time is a parameter.

Stages (each one includes the ones below it):
  0 normal;
  1 shrink batch sizes (max batch x `batch_factor`);
  2 stop admitting new requests (503 with Retry-After) and unload idle models;
  3 cancel the lowest-priority running requests (journaled, clearly failed).

Invariants owned here:
- A pressure event at stage 0 escalates to 1 at once; at a higher stage it escalates one step
  only if at least `escalate_interval_s` passed since the last change (the previous step had its
  chance to help). The stage never exceeds `max_stage`.
- Release is one stage at a time: only when no pressure event came for `hold_s` since the later
  of the last event and the last change, and the caller does not report pressure as still high.
  So the walk back is hysteretic: 3 -> 0 takes at least 3 x hold_s of calm.
- Every change is returned as a `Transition` (and kept in `history`, bounded) for logs, /health
  and /metrics; calls that change nothing return None.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

__all__ = ["StageConfig", "StageActions", "Transition", "Stages", "STAGE_NAMES", "actions_for"]

STAGE_NAMES = ("normal", "shrink-batches", "stop-admitting", "cancel-lowest")


@dataclass(frozen=True)
class StageConfig:
    hold_s: float = 30.0
    escalate_interval_s: float = 5.0
    max_stage: int = 3
    batch_factor: float = 0.5
    retry_after_s: int = 5

    def __post_init__(self) -> None:
        if not 0 <= self.max_stage <= 3:
            raise ValueError(f"max_stage must be 0..3, got {self.max_stage}")
        if self.hold_s <= 0 or self.escalate_interval_s < 0:
            raise ValueError("hold_s must be > 0 and escalate_interval_s >= 0")
        if not 0 < self.batch_factor <= 1:
            raise ValueError(f"batch_factor must be in (0, 1], got {self.batch_factor}")


@dataclass(frozen=True)
class StageActions:
    """What the daemon does at a stage."""

    stage: int
    batch_factor: float  # multiply each model's max batch (at least 1 remains)
    admit: bool  # False: refuse new requests with 503 + Retry-After
    unload_idle: bool
    cancel_lowest: bool
    retry_after_s: int

    def batch_limit(self, max_batch: int) -> int:
        return max(1, int(max_batch * self.batch_factor))


def actions_for(stage: int, config: StageConfig) -> StageActions:
    return StageActions(
        stage=stage,
        batch_factor=config.batch_factor if stage >= 1 else 1.0,
        admit=stage < 2,
        unload_idle=stage >= 2,
        cancel_lowest=stage >= 3,
        retry_after_s=config.retry_after_s,
    )


@dataclass(frozen=True)
class Transition:
    at: float
    from_stage: int
    to_stage: int
    reason: str

    def describe(self) -> str:
        verb = "escalated" if self.to_stage > self.from_stage else "released"
        return (f"memory pressure: {verb} stage {self.from_stage} ({STAGE_NAMES[self.from_stage]})"
                f" -> {self.to_stage} ({STAGE_NAMES[self.to_stage]}): {self.reason}")

    def to_dict(self) -> dict[str, object]:
        return {"at": self.at, "from": self.from_stage, "to": self.to_stage,
                "name": STAGE_NAMES[self.to_stage], "reason": self.reason}


@dataclass
class Stages:
    config: StageConfig = field(default_factory=StageConfig)
    stage: int = 0
    events: int = 0
    last_event: float | None = None
    last_change: float | None = None
    history: deque[Transition] = field(default_factory=lambda: deque(maxlen=32))

    @property
    def actions(self) -> StageActions:
        return actions_for(self.stage, self.config)

    @property
    def name(self) -> str:
        return STAGE_NAMES[self.stage]

    def _move(self, now: float, to: int, reason: str) -> Transition:
        t = Transition(now, self.stage, to, reason)
        self.stage, self.last_change = to, now
        self.history.append(t)
        return t

    def on_pressure(self, now: float, detail: str = "PSI trigger fired") -> Transition | None:
        """A pressure event at `now`; returns the escalation, if any."""
        self.events += 1
        self.last_event = now
        if self.stage >= self.config.max_stage:
            return None
        if self.stage == 0:
            return self._move(now, 1, detail)
        assert self.last_change is not None
        waited = now - self.last_change
        if waited >= self.config.escalate_interval_s:
            return self._move(now, self.stage + 1,
                              f"{detail}; still under pressure {waited:.1f} s after stage "
                              f"{self.stage}")
        return None

    def _calm_since(self) -> float | None:
        marks = [t for t in (self.last_event, self.last_change) if t is not None]
        return max(marks) if marks else None

    def tick(self, now: float, *, still_high: bool = False) -> Transition | None:
        """Release one stage if calm for hold_s. `still_high`: a reading (e.g. avg10 above the
        release threshold) says pressure is not over, so the hold restarts."""
        if self.stage == 0:
            return None
        if still_high:
            self.last_change = now  # restart the hold without changing stage
            return None
        since = self._calm_since()
        if since is not None and now - since >= self.config.hold_s:
            return self._move(now, self.stage - 1,
                              f"no pressure event for {now - since:.1f} s "
                              f"(hold {self.config.hold_s:g} s)")
        return None

    def next_wakeup(self, now: float) -> float | None:
        """When `tick` could next release a stage (None at stage 0)."""
        since = self._calm_since()
        if self.stage == 0 or since is None:
            return None
        return max(now, since + self.config.hold_s)

    def to_dict(self) -> dict[str, object]:
        a = self.actions
        return {"stage": self.stage, "name": self.name, "events": self.events,
                "admitting": a.admit, "batch_factor": a.batch_factor,
                "last_event": self.last_event, "last_change": self.last_change,
                "history": [t.to_dict() for t in self.history]}
