"""Prometheus text for the memory guard: pressure stage and transitions, OOM kills, memory.events
of the model groups, requests shed. Appended to /metrics after the daemon's own families.

Invariants owned here: counters only go up (they live in MemoryGuard and are only incremented);
every registered model has an `edge_agent_oom_kills_total` and `edge_agent_requests_shed_total`
sample, 0 included, so an alert can be written before the first kill.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from edge_agent.daemon.memory_guard import MemoryGuard

__all__ = ["render"]


def render(g: MemoryGuard) -> str:
    lines: list[str] = []

    def family(name: str, kind: str, help_: str) -> None:
        lines.extend((f"# HELP {name} {help_}", f"# TYPE {name} {kind}"))

    family("edge_agent_memory_pressure_stage", "gauge",
           "Memory pressure stage: 0 normal, 1 shrink-batches, 2 stop-admitting, "
           "3 cancel-lowest.")
    lines.append(f"edge_agent_memory_pressure_stage {g.stages.stage}")
    family("edge_agent_memory_pressure_events_total", "counter", "Pressure events seen.")
    lines.append(f"edge_agent_memory_pressure_events_total {g.stages.events}")
    family("edge_agent_memory_pressure_transitions_total", "counter", "Stage changes.")
    for (a, b), n in sorted(g.transitions.items()):
        lines.append(f'edge_agent_memory_pressure_transitions_total{{from="{a}",to="{b}"}} {n}')
    family("edge_agent_oom_kills_total", "counter", "Runner deaths attributed to the kernel's "
           "OOM killer (oom_kill / oom_group_kill in the model group's memory.events).")
    for name in g.models():
        lines.append(f'edge_agent_oom_kills_total{{model="{name}"}} '
                     f'{g.model_dict(name)["oom_kills"]}')
    family("edge_agent_cgroup_memory_events_total", "counter",
           "memory.events counter increases of the model groups.")
    for (name, key), n in sorted(g.memory_events.items()):
        lines.append(f'edge_agent_cgroup_memory_events_total{{model="{name}",event="{key}"}}'
                     f" {n}")
    family("edge_agent_requests_shed_total", "counter",
           "Running requests cancelled at pressure stage 3.")
    for name in g.models():
        lines.append(f'edge_agent_requests_shed_total{{model="{name}"}} {g.shed[name]}')
    family("edge_agent_cgroup_managed", "gauge", "1 when the cgroup v2 layout is managed.")
    lines.append(f"edge_agent_cgroup_managed {int(bool(g.mgr and g.mgr.available))}")
    return "\n".join(lines) + "\n"
