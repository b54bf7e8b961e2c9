"""Our cgroup subtree: the supervisor leaf, models/<name>/ per runner, and their limits.

Layout under the delegated group B (the unit's cgroup, e.g. system.slice/edge-agent.service):

    B/                      cgroup.subtree_control = +memory   (the only file of B we write)
    B/supervisor/           the daemon; memory.min / memory.low from the policy
    B/models/               cgroup.subtree_control = +memory
    B/models/<name>/        one runner: memory.high, memory.max, memory.swap.max, memory.oom.group

Invariants owned here:
- Every change is an `Op` from a plan; `setup` and `--dry-run` use the same plan, so what the
  dry run prints is what setup does.
- Processes leave B before `+memory` is written to B's subtree_control (the kernel's
  no-internal-process rule); we never write B's own attributes (systemd owns them): a write to B
  other than cgroup.subtree_control is refused.
- A model group is created and limited before its runner is attached. Values are checked
  (values.check_write) before the write. Groups are removed on unload and by `teardown()`.
- Without a usable subtree nothing is written: `setup()` returns a Status with available=False
  and the reason, and `model_group()` returns None (budgets are then enforced by accounting).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edge_agent.cgroup.fs import (
    MODELS,
    SUPERVISOR,
    CgroupError,
    CgroupFS,
    CgroupIO,
    CgroupRoot,
    Detection,
    detect,
)
from edge_agent.cgroup.policy import Policy
from edge_agent.cgroup.values import check_write

__all__ = ["Op", "Status", "CgroupManager", "ModelGroup", "join_cgroup", "GROUP_NAME_RE"]

GROUP_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
_OPTIONAL = ("memory.swap.max",)  # absent without swap accounting: skipped with a warning
_PLACEHOLDER = "<our cgroup>"


@dataclass(frozen=True)
class Op:
    kind: str  # "mkdir" | "write" | "rmdir"
    path: str  # relative to the cgroup2 mount
    file: str | None = None
    value: str | None = None
    why: str = ""

    def describe(self, mount: Path | str) -> str:
        target = str(Path(mount) / self.path) if self.path else str(mount)
        if self.file:
            target += f"/{self.file}"
        text = f"{self.kind:<6} {target}"
        if self.value is not None:
            text += f" <- {self.value}"
        return f"{text}  # {self.why}" if self.why else text

    def to_dict(self) -> dict[str, Any]:
        return {"op": self.kind, "path": self.path, "file": self.file, "value": self.value,
                "why": self.why}


@dataclass
class Status:
    available: bool
    reason: str = ""
    fix: str = ""
    base: str | None = None
    policy: str | None = None
    models: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"available": self.available, "reason": self.reason or None,
                "fix": self.fix or None, "base": self.base, "policy": self.policy,
                "models": dict(self.models), "warnings": list(self.warnings)}


def join_cgroup(procs_file: str | os.PathLike[str]) -> None:
    """Move the calling process into a group (async-signal-safe enough for preexec_fn)."""
    fd = os.open(procs_file, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, b"0")
    finally:
        os.close(fd)


class ModelGroup:
    """models/<name>/ of one runner."""

    def __init__(self, fs: CgroupFS, rel: str, name: str) -> None:
        self.fs, self.rel, self.name = fs, rel, name

    @property
    def path(self) -> Path:
        return self.fs.path(self.rel)

    @property
    def procs_file(self) -> Path:
        return self.fs.path(self.rel, "cgroup.procs")

    @property
    def events_file(self) -> Path:
        return self.fs.path(self.rel, "memory.events")

    def attach(self, pid: int) -> None:
        """Move process `pid` (a runner just spawned) into this group."""
        check_write("cgroup.procs", str(pid))
        self.fs.write(self.rel, "cgroup.procs", str(pid))

    def pids(self) -> list[int]:
        return self.fs.pids(self.rel)

    def values(self) -> dict[str, str | None]:
        names = ("memory.current", "memory.peak", "memory.high", "memory.max",
                 "memory.swap.max", "memory.oom.group")
        out = {}
        for n in names:
            text = self.fs.read_optional(self.rel, n)
            out[n] = text.strip() if text is not None else None
        return out


class CgroupManager:
    def __init__(self, detection: Detection, io: CgroupIO | None = None) -> None:
        self.detection = detection
        self.io = io or CgroupIO()
        self.fs = CgroupFS(detection.mount or Path("/sys/fs/cgroup"), self.io)
        self.base = detection.base if detection.base not in (None, "/") else _PLACEHOLDER
        self.policy: Policy | None = None
        self.status = Status(detection.available, detection.reason, detection.fix,
                             detection.base)
        self.groups: dict[str, ModelGroup] = {}
        self._ready = False

    @classmethod
    def detect(cls, root: CgroupRoot | None = None) -> CgroupManager:
        root = root or CgroupRoot()
        return cls(detect(root), root.io)

    @property
    def available(self) -> bool:
        return self.status.available and self._ready

    def _rel(self, *parts: str) -> str:
        return "/".join(p for p in (self.base, *parts) if p)

    def file(self, *parts: str, name: str) -> Path:
        """File `name` of the group PARTS under our base (e.g. supervisor/memory.pressure)."""
        return self.fs.path(self._rel(*parts), name)

    # ----- plans ------------------------------------------------------------------------------

    def plan_setup(self, policy: Policy) -> list[Op]:
        sup, models = self._rel(SUPERVISOR), self._rel(MODELS)
        ops = [Op("mkdir", sup, why="leaf for the control plane")]
        pids = [] if self.base == _PLACEHOLDER else self.fs.pids(self.base)
        for pid in pids or ([] if self.base != _PLACEHOLDER else [os.getpid()]):
            ops.append(Op("write", sup, "cgroup.procs", str(pid),
                          why="no processes in inner nodes"))
        if "memory" not in self.detection.subtree_control:
            ops.append(Op("write", self.base, "cgroup.subtree_control", "+memory",
                          why="hand the memory controller to our children"))
        for f, v in policy.supervisor.limits().items():
            ops.append(Op("write", sup, f, v, why=f"protect the control plane ({policy.name})"))
        ops.append(Op("mkdir", models, why="parent of the runner groups"))
        ops.append(Op("write", models, "cgroup.subtree_control", "+memory",
                      why="limits per runner"))
        return ops

    def plan_model(self, name: str, budget: int | None, policy: Policy) -> list[Op]:
        if not GROUP_NAME_RE.match(name):
            raise CgroupError(f"model group {name!r}: not a valid name (lowercase letters, "
                              "digits, '.', '_', '-'; 64 at most). Hint: rename the model.")
        rel = self._rel(MODELS, name)
        where = f"{policy.path or policy.name}: model"
        ops = [Op("mkdir", rel, why=f"runner of model {name}")]
        budget_s = f"budget {budget} bytes" if budget is not None else "no budget"
        for f, v in policy.model.limits(budget, where=where).items():
            ops.append(Op("write", rel, f, v, why=f"{policy.name}, {budget_s}"))
        return ops

    def plan_remove(self, name: str) -> list[Op]:
        return [Op("rmdir", self._rel(MODELS, name), why=f"model {name} unloaded")]

    # ----- applying ---------------------------------------------------------------------------

    def _apply(self, op: Op) -> None:
        if op.path == self.base and op.kind == "write" and op.file != "cgroup.subtree_control":
            raise CgroupError(f"write {self.fs.path(op.path, op.file)}: refused, that is an "
                              "attribute of our own unit, owned by systemd. Hint: set it in the "
                              "unit file (MemoryMax=...) instead.")
        if op.kind == "mkdir":
            self.fs.mkdir(op.path)
        elif op.kind == "rmdir":
            self.fs.rmdir(op.path)
        else:
            assert op.file is not None and op.value is not None
            check_write(op.file, op.value)
            try:
                self.fs.write(op.path, op.file, op.value)
            except CgroupError as exc:
                if op.file in _OPTIONAL and exc.errno == 2:
                    self.status.warnings.append(f"{op.file} missing in {op.path} (no swap "
                                                "accounting in this kernel): not limited")
                    return
                raise

    def setup(self, policy: Policy) -> Status:
        """Create the layout; returns the Status (available=False with the reason on failure)."""
        self.policy = policy
        self.status.policy = policy.name
        if not self.detection.available:
            return self.status
        try:
            for op in self.plan_setup(policy):
                if op.file == "cgroup.subtree_control" and op.path == self.base:
                    self._move_stragglers()
                self._apply(op)
            self._clean_stale()
        except CgroupError as exc:
            self.status.available = False
            self.status.reason = f"setting up {self.fs.path(self.base)} failed: {exc}"
            self.status.fix = "see `edge-agent doctor`"
            return self.status
        self._ready = True
        return self.status

    def _move_stragglers(self) -> None:
        """Processes that appeared in the base since planning go to the supervisor leaf too."""
        for pid in self.fs.pids(self.base):
            try:
                self.fs.write(self._rel(SUPERVISOR), "cgroup.procs", str(pid))
            except CgroupError as exc:
                if exc.errno != 3:  # ESRCH: it exited meanwhile
                    raise

    def _clean_stale(self) -> None:
        for name in self.fs.children(self._rel(MODELS)):
            if name in self.groups:
                continue
            rel = self._rel(MODELS, name)
            pids = self.fs.pids(rel)
            if pids:
                self.status.warnings.append(f"stale group {rel} still holds pids {pids} from an "
                                            "earlier run; left in place")
            else:
                self.fs.rmdir(rel)

    def model_group(self, name: str, budget: int | None) -> ModelGroup | None:
        """Create models/<name>/ with the policy's limits; None without a usable subtree.

        Attach the runner right after spawning it: `group.attach(proc.pid)` (or pass
        `preexec_fn=lambda: join_cgroup(group.procs_file)`)."""
        if not self.available or self.policy is None:
            return None
        ops = self.plan_model(name, budget, self.policy)
        rel = ops[0].path
        if self.fs.exists(rel) and self.fs.pids(rel):
            raise CgroupError(f"model group {self.fs.path(rel)}: already holds pids "
                              f"{self.fs.pids(rel)}. Hint: unload the model first.")
        for op in ops:
            self._apply(op)
        group = ModelGroup(self.fs, rel, name)
        self.groups[name] = group
        self.status.models[name] = rel
        return group

    def remove(self, name: str) -> None:
        """Remove models/<name>/ (its runner must have exited). Missing groups are fine."""
        self.groups.pop(name, None)
        self.status.models.pop(name, None)
        if not self.available:
            return
        for op in self.plan_remove(name):
            self._apply(op)

    def teardown(self) -> list[str]:
        """At exit: remove every model group and models/; returns the errors (never raises)."""
        errors: list[str] = []
        if not self.available:
            return errors
        for name in [*self.groups, *self.fs.children(self._rel(MODELS))]:
            try:
                self.remove(name)
            except CgroupError as exc:
                errors.append(str(exc))
        try:
            self.fs.rmdir(self._rel(MODELS))
        except CgroupError as exc:
            errors.append(str(exc))
        self._ready = False
        return errors

    # ----- reading ----------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """Current values of our subtree (for `edge-agent cgroup show` and /health)."""
        out: dict[str, Any] = {"detection": self.detection.to_dict(),
                               "status": self.status.to_dict(), "groups": {}}
        if self.detection.mount is None or self.base == _PLACEHOLDER:
            return out
        names = ("memory.current", "memory.peak", "memory.min", "memory.low", "memory.high",
                 "memory.max", "memory.swap.max", "memory.oom.group", "memory.events")
        rels = [self.base, self._rel(SUPERVISOR), self._rel(MODELS)]
        rels += [self._rel(MODELS, n) for n in self.fs.children(self._rel(MODELS))]
        for rel in rels:
            if not self.fs.exists(rel):
                continue
            vals: dict[str, Any] = {"pids": self.fs.pids(rel)}
            for n in names:
                text = self.fs.read_optional(rel, n)
                if text is not None:
                    vals[n] = (dict(line.split() for line in text.splitlines() if line.strip())
                               if n == "memory.events" else text.strip())
            out["groups"][rel] = vals
        return out
