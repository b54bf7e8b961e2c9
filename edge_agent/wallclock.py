"""Wall-clock timestamps for people: ISO 8601 with the local UTC offset.

The daemon keeps points in time on the monotonic clock (immune to clock steps) and some on the
epoch clock; neither means anything to a person reading /health. `health_times` turns the
points in time of a /health document into ISO 8601 strings with milliseconds and offset
("2025-06-01T14:03:07.412+02:00"); durations (uptime_s, *_s) stay numbers of seconds.
"""

from __future__ import annotations

import copy
import time
from datetime import datetime, timezone
from typing import Any

__all__ = ["MONOTONIC_KEYS", "health_times", "iso", "iso_from_monotonic"]

# /health keys holding a time.monotonic() point, by section.
MONOTONIC_KEYS = {"models": ("since", "idle_since", "last_used"),
                  "pressure": ("last_event", "last_change")}


def iso(epoch: float) -> str:
    """An epoch time as ISO 8601 in the local zone, with milliseconds and the UTC offset."""
    return datetime.fromtimestamp(epoch, tz=timezone.utc).astimezone().isoformat(
        timespec="milliseconds")


def iso_from_monotonic(mono: float, *, wall: float | None = None,
                       now: float | None = None) -> str:
    """A time.monotonic() point as wall-clock ISO 8601 (`wall`/`now`: a pair read together)."""
    wall = time.time() if wall is None else wall
    now = time.monotonic() if now is None else now
    return iso(wall - (now - mono))


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def health_times(body: dict[str, Any], *, started: float | None = None,
                 wall: float | None = None, now: float | None = None) -> dict[str, Any]:
    """A copy of a /health body (its tables may be live state of the daemon's parts, so they are
    not touched) with the points in time rewritten: monotonic ones
    (MONOTONIC_KEYS; a pressure transition keeps its monotonic `at` and gains an ISO
    `time`) and epoch ones (journal retention `at`, a model's
    last OOM `at`) become ISO 8601; `started` (monotonic) adds `started_at`. Values that are
    not numbers (None, already strings) are left alone."""
    body = copy.deepcopy(body)
    wall = time.time() if wall is None else wall
    now = time.monotonic() if now is None else now

    def mono(table: Any, key: str) -> None:
        if isinstance(table, dict) and _number(table.get(key)):
            table[key] = iso_from_monotonic(table[key], wall=wall, now=now)

    def epoch(table: Any, key: str) -> None:
        if isinstance(table, dict) and _number(table.get(key)):
            table[key] = iso(table[key])

    if started is not None:
        body["started_at"] = iso_from_monotonic(started, wall=wall, now=now)
    models = body.get("models")
    for m in models.values() if isinstance(models, dict) else ():
        for key in MONOTONIC_KEYS["models"]:
            mono(m, key)
        if isinstance(m, dict) and isinstance(m.get("memory"), dict):
            epoch(m["memory"].get("last_oom"), "at")
    pressure = body.get("pressure")
    if isinstance(pressure, dict):
        for key in MONOTONIC_KEYS["pressure"]:
            mono(pressure, key)
        for t in pressure.get("history") or ():
            # `at` stays on the monotonic clock (intervals between transitions are computed
            # from it); `time` is the same point for people
            if isinstance(t, dict) and _number(t.get("at")):
                t["time"] = iso_from_monotonic(t["at"], wall=wall, now=now)
    journal = body.get("journal")
    if isinstance(journal, dict):
        epoch(journal.get("retention"), "at")
    return body
