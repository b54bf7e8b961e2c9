"""Policies from cgroups/*.toml: every shipped file loads, every bad input names file and key."""

from __future__ import annotations

from pathlib import Path

import pytest

from edge_agent.cgroup.policy import list_policies, load_policy, parse_policy, policy_dirs
from edge_agent.cgroup.values import Limit
from edge_agent.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted(p.stem for p in (ROOT / "cgroups").glob("*.toml"))


def test_shipped_policies_are_the_packaged_ones() -> None:
    assert {"default", "small-board", "unlimited"} <= set(SHIPPED)
    assert set(SHIPPED) <= set(list_policies())
    packaged = ROOT / "edge_agent" / "cgroup" / "policies"
    assert packaged.resolve() == (ROOT / "cgroups").resolve()


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_policy_loads_and_resolves(name: str) -> None:
    p = load_policy(name)
    assert p.name == name and p.description
    limits = p.model.limits(700 << 20)
    assert set(limits) == {"memory.high", "memory.max", "memory.swap.max", "memory.oom.group"}
    hi, mx = limits["memory.high"], limits["memory.max"]
    if hi != "max" and mx != "max":
        assert int(hi) <= int(mx) and int(hi) % 4096 == 0
    assert p.to_dict()["pressure"]["trigger"] == str(p.pressure.trigger)


def test_default_policy_values() -> None:
    p = load_policy("default")
    assert p.model.memory_high == Limit(factor=1.15) and p.model.memory_max == Limit(factor=1.4)
    # 1.15 x 1 GiB and 1.4 x 1 GiB, rounded up to whole 4 KiB pages
    assert p.model.limits(1 << 30) == {"memory.high": str(1234804736),
                                       "memory.max": str(1503240192),
                                       "memory.swap.max": "0", "memory.oom.group": "1"}
    assert p.supervisor.limits() == {"memory.min": str(32 << 20), "memory.low": str(96 << 20)}
    assert str(p.pressure.trigger) == "some 300000 2000000"
    assert p.pressure.stages.hold_s == 30


def _write(tmp_path: Path, text: str, name: str = "bad") -> Path:
    p = tmp_path / f"{name}.toml"
    p.write_text(text)
    return p


@pytest.mark.parametrize("text, needles", [
    ("[model]\nmemory_hihg = '1G'\n", ["unknown key model.memory_hihg",
                                        "memory_high, memory_max, memory_swap_max, oom_group"]),
    ("[modle]\n", ["unknown key or table 'modle'", "[model], [supervisor], [pressure]"]),
    ("[model]\nmemory_max = 'lots'\n", ["model.memory_max:", "'lots'"]),
    ("[model]\nmemory_high = '2G'\nmemory_max = '1G'\n",
     ["model.memory_high (2G) is above model.memory_max (1G)"]),
    ("[model]\nmemory_high = '1.5x'\nmemory_max = '1.2x'\n", ["is above model.memory_max"]),
    ("[model]\nmemory_high = 'max'\nmemory_max = '1G'\n", ["is above model.memory_max"]),
    ("[model]\noom_group = 1\n", ["model.oom_group: expected true or false"]),
    ("[supervisor]\nmemory_low = '1.2x'\n", ["supervisor.memory_low: '1.2x' is relative"]),
    ("[supervisor]\nmemory_min = '1G'\nmemory_low = '10M'\n",
     ["supervisor.memory_min is above supervisor.memory_low"]),
    ("[pressure]\ntrigger = 'some 1 100'\n", ["pressure.trigger: window 100 us"]),
    ("[pressure]\nhold_s = 0\n", ["pressure.hold_s: expected a number from 0.1 to 3600"]),
    ("[pressure]\nmax_stage = 4\n", ["pressure.max_stage: expected an integer from 0 to 3"]),
    ("[pressure]\nbatch_factor = 'half'\n", ["pressure.batch_factor"]),
    ("description = 3\n", ["description: expected a string"]),
    ("model = 3\n", ["model must be a table ([model]), got int 3"]),
    ("[model\n", ["not valid TOML"]),
])
def test_bad_policy_names_file_and_key(tmp_path: Path, text: str, needles: list[str]) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_policy(str(path))
    msg = str(e.value)
    assert msg.startswith(str(path)) and "Hint:" in msg
    for n in needles:
        assert n in msg
    assert e.value.exit_code == 78


def test_missing_policy_lists_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        load_policy("huge-board")
    assert "cgroup policy 'huge-board': not found" in str(e.value)
    assert "default, " in str(e.value) and "small-board" in str(e.value)
    with pytest.raises(ConfigError, match="policy file .*nope.toml: not found"):
        load_policy(str(tmp_path / "nope.toml"))


def test_policy_dir_override_wins(tmp_path: Path) -> None:
    _write(tmp_path, "description = 'mine'\n[model]\nmemory_max = '1G'\nmemory_high = '900M'\n",
           "default")
    dirs = policy_dirs({"EDGE_AGENT_CGROUP_POLICY_DIR": str(tmp_path)})
    assert dirs[0] == tmp_path
    p = load_policy("default", dirs)
    assert p.description == "mine" and p.model.limits(None)["memory.max"] == str(1 << 30)


def test_relative_limits_need_a_budget() -> None:
    p = parse_policy("x", {"model": {"memory_high": "1.1x", "memory_max": "2G"}})
    with pytest.raises(ConfigError, match=r"policy 'x': model.memory_high: 1.1x budget needs"):
        p.model.limits(None, where="policy 'x': model")
    assert p.model.limits(1 << 30)["memory.max"] == str(2 << 30)
    # resolved high above an absolute max is caught once the budget is known
    with pytest.raises(ConfigError, match="memory_high .* is above memory_max"):
        p.model.limits(4 << 30)
