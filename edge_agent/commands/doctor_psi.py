"""`edge-agent doctor`'s PSI trigger check: can this process arm a trigger, and if not, why.

Invariants owned here:
- `try_trigger` really arms a trigger on the file and closes it at once (nothing stays armed);
  `check_psi_trigger` is a pure function of what was tried (errno, kernel release, capability,
  file owner), so tests feed it other machines' answers.
- A trigger that cannot be armed is a warning, not a failure: the daemon then polls avg10.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from edge_agent.cgroup.fs import errno_name
from edge_agent.cgroup.psi import (
    FIX_TRIGGER,
    PressureError,
    PressureWatcher,
    unprivileged_triggers,
    window_hint,
)
from edge_agent.cgroup.values import Trigger

__all__ = ["TriggerAttempt", "try_trigger", "check_psi_trigger", "CHECK"]

CHECK = "PSI trigger"
OK, WARN = "ok", "warn"


class TriggerAttempt:
    """What arming a trigger on `path` gave: errno 0 when armed; `note` when widened."""

    def __init__(self, path: Path | None, err: int = 0, note: str = "",
                 owner: int | None = None) -> None:
        self.path, self.err, self.note, self.owner = path, err, note, owner


def try_trigger(path: Path | None, trigger: Trigger) -> TriggerAttempt:
    if path is None:
        return TriggerAttempt(None, errno.ENOENT)
    try:
        owner: int | None = os.stat(path).st_uid
    except OSError:
        owner = None
    w = PressureWatcher(path, str(trigger).encode() + b"\0")
    try:
        w.open()
    except PressureError as exc:
        return TriggerAttempt(path, exc.errno or errno.EIO, owner=owner)
    note = w.note
    w.close()
    return TriggerAttempt(path, 0, note, owner)


def check_psi_trigger(a: TriggerAttempt, trigger: Trigger, release: str, has_cap: bool,
                      uid: int) -> tuple[str, str, str]:
    """(status, detail, fix) for the doctor's Finding."""
    cap = f"kernel {release}, CAP_SYS_RESOURCE {'held' if has_cap else 'not held'}, uid {uid}"
    if a.path is None:
        return (WARN, "no memory.pressure file to arm a trigger on (see the PSI check); the "
                "daemon would poll nothing", "enable PSI (psi=1 on the kernel command line)")
    if a.err == 0:
        how = f"; {a.note}" if a.note else ""
        return (OK, f"armed (and closed) a `{trigger}` trigger on {a.path} ({cap}){how}", "")
    what = f"cannot arm `{trigger}` on {a.path}: {errno_name(a.err)} ({cap})"
    why: list[str] = []
    if a.owner is not None and a.owner != uid:
        why.append(f"the file is owned by uid {a.owner} (systemd < 254 leaves the service's "
                   "file root-owned; the daemon then uses the supervisor/ and models/ groups "
                   "it creates and owns)")
    if not unprivileged_triggers(release) and not has_cap:
        why.append("Linux < 6.5 needs CAP_SYS_RESOURCE to open a pressure file for writing")
    rule = window_hint(release, has_cap, trigger.window_us)
    if rule:
        why.append(rule.split(". Fix:")[0])
    detail = what + (": " + "; ".join(why) if why else "") + (
        ". The daemon falls back to polling avg10 every 2 s")
    return WARN, detail, FIX_TRIGGER
