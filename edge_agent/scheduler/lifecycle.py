"""Model lifecycle: the state machine of one registered model.

    UNLOADED -> LOADING -> WARMING -> SERVING <-> IDLE -> UNLOADING -> UNLOADED
                   any of LOADING..UNLOADING -> FAILED (with the reason) -> LOADING | UNLOADED
                   SERVING | IDLE -> UNLOADED (runner lost: reason kept, reload on demand)
                   LOADING | WARMING -> UNLOADING (load aborted)

Invariants owned here:
- `state` changes only through `transition` (or the named helpers that call it); a move not in
  ALLOWED raises InvalidTransition naming both states and the allowed targets; on error nothing
  changes.
- `idle_since` is set exactly while the state is IDLE (the time it became idle); `should_unload`
  is true only for an IDLE model idle for at least `ttl_s` (`ttl_s=None` never unloads).
- `reason` is set when entering FAILED (required) or when a runner is lost, and cleared when a
  new load starts. `since` is the time of the last transition; `last_used` the last time the
  model went idle or was used; `loads` counts load attempts.
- Pure: times are parameters.
"""

from __future__ import annotations

import enum
from collections import deque
from typing import Any

from edge_agent.scheduler.errors import InvalidTransition

__all__ = ["ModelState", "ALLOWED", "ModelLifecycle"]


class ModelState(str, enum.Enum):
    UNLOADED = "unloaded"
    LOADING = "loading"
    WARMING = "warming"
    SERVING = "serving"
    IDLE = "idle"
    UNLOADING = "unloading"
    FAILED = "failed"


_S = ModelState
ALLOWED: dict[ModelState, frozenset[ModelState]] = {
    _S.UNLOADED: frozenset({_S.LOADING}),
    _S.LOADING: frozenset({_S.WARMING, _S.FAILED, _S.UNLOADING}),
    _S.WARMING: frozenset({_S.SERVING, _S.IDLE, _S.FAILED, _S.UNLOADING}),
    _S.SERVING: frozenset({_S.IDLE, _S.UNLOADING, _S.FAILED, _S.UNLOADED}),
    _S.IDLE: frozenset({_S.SERVING, _S.UNLOADING, _S.FAILED, _S.UNLOADED}),
    _S.UNLOADING: frozenset({_S.UNLOADED, _S.FAILED}),
    _S.FAILED: frozenset({_S.LOADING, _S.UNLOADED}),
}

# States in which a runner process exists and holds (or is acquiring) the model's memory.
_RESIDENT = frozenset({_S.LOADING, _S.WARMING, _S.SERVING, _S.IDLE, _S.UNLOADING})
_HISTORY = 32


class ModelLifecycle:
    """State of one model; the daemon drives it as its runner loads, serves and exits."""

    def __init__(self, name: str, now: float = 0.0) -> None:
        self.name = name
        self.state = ModelState.UNLOADED
        self.reason: str | None = None
        self.since = now
        self.idle_since: float | None = None
        self.last_used: float | None = None
        self.loads = 0
        self.losses = 0
        self.history: deque[tuple[float, ModelState, ModelState]] = deque(maxlen=_HISTORY)

    # -- the one mutator ------------------------------------------------------------------

    def transition(self, to: ModelState, now: float, reason: str | None = None) -> None:
        """Move to `to` or raise InvalidTransition (and change nothing)."""
        frm = self.state
        if to not in ALLOWED[frm]:
            allowed = ", ".join(sorted(s.value for s in ALLOWED[frm]))
            raise InvalidTransition(
                f"model {self.name!r}: cannot go from {frm.value} to {to.value} "
                f"(from {frm.value} only: {allowed}). Hint: this is a daemon bug or a race; "
                "check the order of runner events.",
                model=self.name,
                from_state=frm.value,
                to_state=to.value,
            )
        if to is ModelState.FAILED and not reason:
            raise InvalidTransition(
                f"model {self.name!r}: going to failed needs a reason. "
                "Hint: pass the error that made the load or runner fail.",
                model=self.name,
                from_state=frm.value,
                to_state=to.value,
            )
        if to is ModelState.LOADING:
            self.loads += 1
            self.reason = None
        elif to is ModelState.FAILED:
            self.reason = reason
        elif to is ModelState.UNLOADED and frm in (ModelState.SERVING, ModelState.IDLE):
            self.losses += 1
            self.reason = reason or "runner exited unexpectedly"
        if to is ModelState.IDLE:
            self.idle_since = now
            self.last_used = now
        else:
            self.idle_since = None
        if to is ModelState.SERVING:
            self.last_used = now
        self.state = to
        self.since = now
        self.history.append((now, frm, to))

    # -- named steps ----------------------------------------------------------------------

    def start_load(self, now: float) -> None:
        self.transition(ModelState.LOADING, now)

    def start_warmup(self, now: float) -> None:
        self.transition(ModelState.WARMING, now)

    def ready(self, now: float, busy: bool = False) -> None:
        """Warm-up done: SERVING if jobs wait for it, else IDLE."""
        self.transition(ModelState.SERVING if busy else ModelState.IDLE, now)

    def use(self, now: float) -> None:
        """Jobs run on the model: IDLE -> SERVING; on SERVING only refreshes `last_used`."""
        if self.state is ModelState.SERVING:
            self.last_used = now
            return
        self.transition(ModelState.SERVING, now)

    def mark_idle(self, now: float) -> None:
        """Nothing runs or waits: SERVING -> IDLE (idle already: unchanged)."""
        if self.state is not ModelState.IDLE:
            self.transition(ModelState.IDLE, now)

    def start_unload(self, now: float) -> None:
        self.transition(ModelState.UNLOADING, now)

    def unloaded(self, now: float) -> None:
        self.transition(ModelState.UNLOADED, now)

    def lost(self, now: float, reason: str) -> None:
        """The runner died while serving or idle: back to UNLOADED, reload on demand."""
        self.transition(ModelState.UNLOADED, now, reason)

    def fail(self, now: float, reason: str) -> None:
        self.transition(ModelState.FAILED, now, reason)

    # -- questions ------------------------------------------------------------------------

    @property
    def resident(self) -> bool:
        """A runner holds (or is acquiring) this model's memory budget."""
        return self.state in _RESIDENT

    @property
    def can_serve(self) -> bool:
        return self.state in (ModelState.SERVING, ModelState.IDLE)

    def should_unload(self, now: float, ttl_s: float | None) -> bool:
        """True when IDLE for at least `ttl_s` seconds (None: never)."""
        return (
            ttl_s is not None
            and self.state is ModelState.IDLE
            and self.idle_since is not None
            and now - self.idle_since >= ttl_s
        )

    def unload_at(self, ttl_s: float | None) -> float | None:
        """When `should_unload` becomes true if nothing changes (for the daemon's wakeup)."""
        if ttl_s is None or self.state is not ModelState.IDLE or self.idle_since is None:
            return None
        return self.idle_since + ttl_s

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "state": self.state.value,
            "reason": self.reason,
            "since": self.since,
            "idle_since": self.idle_since,
            "last_used": self.last_used,
            "loads": self.loads,
            "losses": self.losses,
        }
