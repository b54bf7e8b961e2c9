"""cgroup v2 memory management for edge-agent: detection and delegation (fs), limit values
(values), policies from cgroups/*.toml (policy), the supervisor/models layout (layout),
memory.events watching (events), PSI triggers (psi) and the staged pressure response (stages).

A small module of our own: cgroupspy and similar libraries speak cgroup v1 only (no
memory.high, memory.events or memory.pressure, and "max" is not a number to them).
"""

from __future__ import annotations

from edge_agent.cgroup.events import EventsWatcher, MemoryEvent, parse_memory_events
from edge_agent.cgroup.fs import CgroupError, CgroupFS, CgroupIO, CgroupRoot, Detection, detect
from edge_agent.cgroup.layout import CgroupManager, ModelGroup, Op, Status, join_cgroup
from edge_agent.cgroup.policy import Policy, list_policies, load_policy
from edge_agent.cgroup.psi import PressureError, PressureStats, PressureWatcher, read_pressure
from edge_agent.cgroup.stages import StageActions, StageConfig, Stages, Transition
from edge_agent.cgroup.values import CgroupValueError, Trigger, parse_limit, parse_trigger

__all__ = [
    "CgroupError", "CgroupFS", "CgroupIO", "CgroupRoot", "Detection", "detect",
    "CgroupManager", "ModelGroup", "Op", "Status", "join_cgroup",
    "Policy", "load_policy", "list_policies",
    "EventsWatcher", "MemoryEvent", "parse_memory_events",
    "PressureWatcher", "PressureError", "PressureStats", "read_pressure",
    "Stages", "StageConfig", "StageActions", "Transition",
    "CgroupValueError", "Trigger", "parse_limit", "parse_trigger",
]
