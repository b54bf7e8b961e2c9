"""The daemon's memory guard in process, on a real Daemon object (no model loaded): hosts
without a usable cgroup v2 subtree, bad policies, pressure sources that fail, and a model group's
life from creation to an attributed OOM kill on a temporary cgroup tree (tests/cgroup_fake.py)."""

from __future__ import annotations

import asyncio
import errno
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from cgroup_fake import Tree, make_tree

import edge_agent.daemon.memory_guard as guard_mod
from edge_agent import cli
from edge_agent.config import load_config
from edge_agent.daemon.app import Daemon
from edge_agent.errors import ConfigError

OWN = "system.slice/edge-agent.service"


def daemon(tmp_path: Path, env: dict[str, str] | None = None, **cgroup: Any) -> Daemon:
    overrides = {"server.socket": str(tmp_path / "s.sock"),
                 "server.state_dir": str(tmp_path / "state"), "journal.enabled": False,
                 **{f"cgroup.{k}": v for k, v in cgroup.items()}}
    config = load_config(None, env={}, overrides=overrides, check_paths=False)
    return Daemon(config, env={"MEMORY_PRESSURE_WATCH": "/dev/null"} if env is None else env)


def started(d: Daemon) -> Daemon:
    async def go() -> None:
        d.memory.start(asyncio.get_running_loop())
        d.memory.close()

    asyncio.run(go())
    return d


def test_cgroup_v1_memory_host_serves_by_accounting_and_says_why(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], stderr_log: None) -> None:
    t = make_tree(tmp_path / "t", v1_memory=True)
    d = started(daemon(tmp_path, proc_root=str(t.proc)))
    h = d.memory.health()
    assert h["available"] is False
    assert "memory controller is bound to the cgroup v1 hierarchy" in h["reason"]
    assert "systemd.unified_cgroup_hierarchy=1" in h["fix"]
    assert d.memory.runner_hook("smollm2", 1 << 20) is None
    assert d.memory.service_memory_max() is None
    assert "edge_agent_cgroup_managed 0" in d.memory.render_metrics()
    err = capsys.readouterr().err
    assert "cgroup v2: not managed, budgets by accounting only" in err and "Fix:" in err


def test_not_delegated_and_disabled(tmp_path: Path) -> None:
    t = make_tree(tmp_path / "t", delegated=False)
    h = started(daemon(tmp_path, proc_root=str(t.proc))).memory.health()
    assert h["available"] is False and "not delegated" in h["reason"]
    assert "Delegate=yes" in h["fix"]
    h = started(daemon(tmp_path, enabled=False)).memory.health()
    assert h["available"] is False
    assert h["reason"] == "disabled by configuration (cgroup.enabled = false)"


def test_bad_policies_are_config_errors_naming_file_and_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"cgroup policy 'nope': not found .*Hint: use one of: "
                       r".*default"):
        daemon(tmp_path, policy="nope")
    bad = tmp_path / "bad.toml"
    bad.write_text("[model]\nmemory_hihg = '1.2x'\n")
    with pytest.raises(ConfigError, match=r"bad\.toml: unknown key model\.memory_hihg\. Hint: "
                       r"valid keys in \[model\] are memory_high"):
        daemon(tmp_path, policy=str(bad))
    with pytest.raises(ConfigError, match=r"cgroup\.policy .*expected a non-empty string"):
        daemon(tmp_path, policy="")


def test_serve_exits_78_on_a_bad_policy(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[server]\nsocket = "{tmp_path / "s.sock"}"\n'
                   f'state_dir = "{tmp_path}"\n[cgroup]\npolicy = "{tmp_path / "x.toml"}"\n')
    assert cli.main(["serve", "--config", str(cfg)]) == 78
    err = capsys.readouterr().err
    assert f"cgroup policy file {tmp_path / 'x.toml'}: not found" in err and "Hint:" in err


def test_pressure_sources_that_fail_are_explained(tmp_path: Path) -> None:
    d = started(daemon(tmp_path, env={"MEMORY_PRESSURE_WATCH": str(tmp_path / "missing")},
                       enabled=False))
    p = d.memory.pressure_dict()
    assert p["source"] is None and p["stage"] == 0
    assert f"open {tmp_path / 'missing'}" in p["error"] and "Hint:" in p["error"]
    d = started(daemon(tmp_path, env={"MEMORY_PRESSURE_WATCH": "/dev/null"}))
    assert d.memory.pressure_dict()["error"] == "off ($MEMORY_PRESSURE_WATCH=/dev/null)"
    # a bad unit environment is a configuration error: exit 78 stops a restart loop
    with pytest.raises(ConfigError, match=r"\$MEMORY_PRESSURE_WRITE='%%%': not valid base64\. "
                       "Hint:"):
        started(daemon(tmp_path, env={"MEMORY_PRESSURE_WATCH": str(tmp_path),
                                      "MEMORY_PRESSURE_WRITE": "%%%"}, enabled=False))


@pytest.fixture
def tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Tree:
    import os

    t = make_tree(tmp_path / "t", own=OWN, pids=(os.getpid(),))
    monkeypatch.setattr(guard_mod, "IO_FACTORY", lambda: t.kernel)
    return t


def test_model_group_life_and_an_attributed_oom_kill(tmp_path: Path, tree: Tree) -> None:
    d = daemon(tmp_path, proc_root=str(tree.proc))
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])

    async def go() -> str | None:
        g = d.memory
        g.start(asyncio.get_running_loop())
        assert g.status.available, g.status.reason
        (tree.mount / OWN / "memory.max").write_text("2147483648\n")  # the unit's MemoryMax=
        assert g.service_memory_max() == 2 << 30
        attach = g.runner_hook("smollm2", 700 << 20)
        assert attach is not None
        models = tree.mount / OWN / "models" / "smollm2"
        assert (models / "memory.max").read_text().strip() == str(980 << 20)  # 1.4x
        tree.kernel.add_pid(f"{OWN}/supervisor", child.pid)  # born in its parent's group
        attach(child.pid)
        assert (models / "cgroup.procs").read_text().split() == [str(child.pid)]
        (models / "memory.events").write_text(
            "low 0\nhigh 2\nmax 1\noom 1\noom_kill 1\noom_group_kill 1\n")
        await asyncio.sleep(0.05)  # inotify -> _on_events
        child.kill()
        child.wait()
        (models / "cgroup.procs").write_text("")  # the kernel drops a dead process
        reason = g.runner_exited("smollm2")
        assert not models.exists()
        g.close()
        assert not (tree.mount / OWN / "models").exists()
        return reason

    try:
        reason = asyncio.run(go())
    finally:
        child.kill()
        child.wait()
    assert reason is not None
    assert reason.startswith(f"OOM-killed by the kernel (oom_group_kill +1 in {OWN}/models/"
                             f"smollm2/memory.events, memory.max {980 << 20})")
    assert "Hint: raise the policy's model.memory_max" in reason
    m = d.memory.model_dict("smollm2")
    assert m["oom_kills"] == 1 and m["last_oom"]["event"] == "oom_group_kill"
    text = d.memory.render_metrics()
    assert 'edge_agent_oom_kills_total{model="smollm2"} 1' in text
    assert 'edge_agent_cgroup_memory_events_total{model="smollm2",event="high"} 2' in text
    assert d.memory.runner_exited("smollm2") is None  # once only


def test_a_group_that_cannot_be_created_leaves_the_runner_outside_with_a_warning(
        tmp_path: Path, tree: Tree) -> None:
    d = daemon(tmp_path, proc_root=str(tree.proc))

    async def go() -> None:
        d.memory.start(asyncio.get_running_loop())
        tree.kernel.fail[(f"{OWN}/models/smollm2", None)] = errno.EACCES
        assert d.memory.runner_hook("smollm2", 700 << 20) is None
        assert d.memory.runner_exited("smollm2") is None
        d.memory.close()

    asyncio.run(go())
    (w,) = d.memory.health()["warnings"]
    assert w.startswith("model smollm2: runner will run outside its own group: mkdir ")
    assert "Permission denied (EACCES). Hint:" in w
