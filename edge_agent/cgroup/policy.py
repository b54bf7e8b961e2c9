"""Memory policies from cgroups/*.toml, and the writes they imply for a model's group.

Invariants owned here:
- A policy file has exactly the tables and keys in `SCHEMA`; an unknown table or key, or a bad
  value, is a ConfigError naming the file, the key and the valid choices.
- Model limits may be absolute or relative to the model's computed budget ("1.25x", "125%");
  supervisor protection is absolute. When memory.high and memory.max are comparable (both
  absolute or both relative) high <= max is checked at load time, and always after resolving.
- Policies are found by name in `policy_dirs()` (first match wins): /etc/edge-agent/cgroups,
  then the policies shipped with the package (`edge_agent/cgroup/policies`, a link to the
  checkout's `cgroups/`). A name containing "/" or ending in .toml is a file path.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edge_agent.cgroup.stages import StageConfig
from edge_agent.cgroup.values import Limit, Trigger, parse_limit, parse_trigger, resolve, to_kernel
from edge_agent.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib

__all__ = ["Policy", "ModelPolicy", "SupervisorPolicy", "PressurePolicy", "load_policy",
           "list_policies", "policy_dirs", "DEFAULT_POLICY", "SCHEMA"]

DEFAULT_POLICY = "default"
SCHEMA: dict[str, tuple[str, ...]] = {
    "": ("description",),
    "model": ("memory_high", "memory_max", "memory_swap_max", "oom_group"),
    "supervisor": ("memory_min", "memory_low"),
    "pressure": ("trigger", "hold_s", "escalate_interval_s", "max_stage", "batch_factor",
                 "retry_after_s"),
}


@dataclass(frozen=True)
class ModelPolicy:
    memory_high: Limit = Limit(factor=1.1)
    memory_max: Limit = Limit(factor=1.3)
    memory_swap_max: Limit = Limit(bytes=0)
    oom_group: bool = True

    def limits(self, budget: int | None, where: str = "model") -> dict[str, str]:
        """File -> value to write for a model whose computed budget is `budget` bytes."""
        high = resolve(self.memory_high, budget, where=f"{where}.memory_high")
        mx = resolve(self.memory_max, budget, where=f"{where}.memory_max")
        if high is not None and mx is not None and high > mx:
            raise ConfigError(f"{where}: memory_high ({high} bytes) is above memory_max ({mx} "
                              "bytes). Hint: make memory_high <= memory_max in the policy.")
        out = {"memory.high": to_kernel(high), "memory.max": to_kernel(mx),
               "memory.swap.max": to_kernel(resolve(self.memory_swap_max, budget,
                                                    where=f"{where}.memory_swap_max"))}
        out["memory.oom.group"] = "1" if self.oom_group else "0"
        return out


@dataclass(frozen=True)
class SupervisorPolicy:
    memory_min: int | None = 0
    memory_low: int | None = 64 << 20

    def limits(self) -> dict[str, str]:
        return {"memory.min": to_kernel(self.memory_min), "memory.low": to_kernel(self.memory_low)}


@dataclass(frozen=True)
class PressurePolicy:
    trigger: Trigger = Trigger("some", 300_000, 2_000_000)
    stages: StageConfig = field(default_factory=StageConfig)


@dataclass(frozen=True)
class Policy:
    name: str
    path: Path | None = None
    description: str = ""
    model: ModelPolicy = field(default_factory=ModelPolicy)
    supervisor: SupervisorPolicy = field(default_factory=SupervisorPolicy)
    pressure: PressurePolicy = field(default_factory=PressurePolicy)

    def to_dict(self) -> dict[str, Any]:
        m, s, p = self.model, self.supervisor, self.pressure
        return {
            "name": self.name, "path": str(self.path) if self.path else None,
            "description": self.description,
            "model": {"memory_high": str(m.memory_high), "memory_max": str(m.memory_max),
                      "memory_swap_max": str(m.memory_swap_max), "oom_group": m.oom_group},
            "supervisor": s.limits(),
            "pressure": {"trigger": str(p.trigger), "hold_s": p.stages.hold_s,
                         "escalate_interval_s": p.stages.escalate_interval_s,
                         "max_stage": p.stages.max_stage, "batch_factor": p.stages.batch_factor,
                         "retry_after_s": p.stages.retry_after_s},
        }


def policy_dirs(env: Mapping[str, str] | None = None) -> list[Path]:
    env = os.environ if env is None else env
    dirs = [Path(p) for p in env.get("EDGE_AGENT_CGROUP_POLICY_DIR", "").split(":") if p]
    here = Path(__file__).resolve().parent
    return [*dirs, Path("/etc/edge-agent/cgroups"), here / "policies", here.parents[1] / "cgroups"]


def list_policies(dirs: list[Path] | None = None) -> list[str]:
    names: set[str] = set()
    for d in dirs if dirs is not None else policy_dirs():
        if d.is_dir():
            names.update(p.stem for p in d.glob("*.toml"))
    return sorted(names)


def _find(name: str, dirs: list[Path]) -> Path:
    if "/" in name or name.endswith(".toml"):
        p = Path(name)
        if not p.is_file():
            raise ConfigError(f"cgroup policy file {p}: not found. Hint: give an existing .toml "
                              "file or a policy name.")
        return p
    for d in dirs:
        p = d / f"{name}.toml"
        if p.is_file():
            return p
    known = ", ".join(list_policies(dirs)) or "(none found)"
    raise ConfigError(f"cgroup policy {name!r}: not found in {', '.join(map(str, dirs))}. "
                      f"Hint: use one of: {known}.")


def _num(value: Any, where: str, lo: float, hi: float, integer: bool = False) -> Any:
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or not lo <= value <= hi:
        what = "an integer" if integer else "a number"
        raise ConfigError(f"{where}: expected {what} from {lo:g} to {hi:g}, got {value!r}. "
                          "Hint: fix the value in the policy file.")
    return value


def _check_keys(data: Mapping[str, Any], where: str) -> None:
    for key, value in data.items():
        if key in SCHEMA and key and not isinstance(value, dict):
            raise ConfigError(f"{where}: {key} must be a table ([{key}]), got "
                              f"{type(value).__name__} {value!r}. Hint: write [{key}] on its "
                              "own line followed by its keys.")
        if isinstance(value, dict) and key in SCHEMA and key:
            for sub in value:
                if sub not in SCHEMA[key]:
                    raise ConfigError(f"{where}: unknown key {key}.{sub}. Hint: valid keys in "
                                      f"[{key}] are {', '.join(SCHEMA[key])}.")
        elif key not in SCHEMA[""]:
            tables = ", ".join(f"[{t}]" for t in SCHEMA if t)
            raise ConfigError(f"{where}: unknown key or table {key!r}. Hint: a policy has "
                              f"description and the tables {tables}.")


def parse_policy(name: str, data: Mapping[str, Any], path: Path | None = None) -> Policy:
    where = str(path) if path else f"policy {name!r}"
    _check_keys(data, where)
    m, s, p = (data.get(k, {}) for k in ("model", "supervisor", "pressure"))
    dm, ds, dp = ModelPolicy(), SupervisorPolicy(), StageConfig()

    def lim(table: Mapping[str, Any], tname: str, key: str, default: Limit, rel: bool) -> Limit:
        if key not in table:
            return default
        return parse_limit(table[key], where=f"{where}: {tname}.{key}", relative=rel)

    oom = m.get("oom_group", dm.oom_group)
    if not isinstance(oom, bool):
        raise ConfigError(f"{where}: model.oom_group: expected true or false, got {oom!r}. "
                          "Hint: true kills the whole runner group on OOM (recommended).")
    model = ModelPolicy(lim(m, "model", "memory_high", dm.memory_high, True),
                        lim(m, "model", "memory_max", dm.memory_max, True),
                        lim(m, "model", "memory_swap_max", dm.memory_swap_max, True), oom)
    hi, mx = model.memory_high, model.memory_max
    if (hi.factor is not None and mx.factor is not None and hi.factor > mx.factor) or (
        hi.bytes is not None and mx.bytes is not None and hi.bytes > mx.bytes
    ) or (hi.is_max and not mx.is_max):
        raise ConfigError(f"{where}: model.memory_high ({hi}) is above model.memory_max ({mx}). "
                          "Hint: memory_high throttles before memory_max kills: keep high <= max.")
    sup = SupervisorPolicy(
        *(ds_val if k not in s else parse_limit(s[k], where=f"{where}: supervisor.{k}",
                                                 relative=False).bytes
          for k, ds_val in (("memory_min", ds.memory_min), ("memory_low", ds.memory_low))))
    lo, mn = sup.memory_low, sup.memory_min
    if mn is not None and lo is not None and mn > lo:
        raise ConfigError(f"{where}: supervisor.memory_min is above supervisor.memory_low. "
                          "Hint: memory_min (hard protection) <= memory_low (best effort).")
    trigger = parse_trigger(p.get("trigger", str(PressurePolicy().trigger)), where=f"{where}: "
                            "pressure.trigger")
    stages = StageConfig(
        hold_s=float(_num(p.get("hold_s", dp.hold_s), f"{where}: pressure.hold_s", 0.1, 3600)),
        escalate_interval_s=float(_num(p.get("escalate_interval_s", dp.escalate_interval_s),
                                       f"{where}: pressure.escalate_interval_s", 0, 600)),
        max_stage=_num(p.get("max_stage", dp.max_stage), f"{where}: pressure.max_stage", 0, 3,
                       True),
        batch_factor=float(_num(p.get("batch_factor", dp.batch_factor),
                                f"{where}: pressure.batch_factor", 0.01, 1)),
        retry_after_s=_num(p.get("retry_after_s", dp.retry_after_s),
                           f"{where}: pressure.retry_after_s", 1, 3600, True),
    )
    desc = data.get("description", "")
    if not isinstance(desc, str):
        raise ConfigError(f"{where}: description: expected a string. Hint: quote it.")
    return Policy(name, path, desc, model, sup, PressurePolicy(trigger, stages))


def load_policy(name: str = DEFAULT_POLICY, dirs: list[Path] | None = None) -> Policy:
    """The named policy (or a .toml path); ConfigError naming file and key when invalid."""
    path = _find(name, dirs if dirs is not None else policy_dirs())
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML ({exc}). Hint: fix the syntax.") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror}). "
                          "Hint: check permissions.") from None
    return parse_policy(path.stem, data, path)
