"""The daemon's memory guard in process, built as daemon/app.py wires it but over small fakes
of the model services (tests/guard_host.py): hosts without a usable cgroup v2 subtree, bad
policies, pressure sources that fail, a model group's life from creation to an attributed OOM
kill on a temporary cgroup tree (tests/cgroup_fake.py), and what each pressure stage asks of the
models, with the refusal mapped to its HTTP answer and its UART code."""

from __future__ import annotations

import asyncio
import errno
import subprocess
import sys
from pathlib import Path

import pytest
from cgroup_fake import Tree, make_tree
from guard_host import FakeModel, Host, make_guard

from edge_agent import cli
from edge_agent.daemon.memory_guard import MemoryGuard
from edge_agent.daemon.uart_backend import backend_error
from edge_agent.errors import AdmissionRefused, ConfigError
from edge_agent.protocol.api import api_error

OWN = "system.slice/edge-agent.service"


def started(g: MemoryGuard) -> MemoryGuard:
    async def go() -> None:
        g.start(asyncio.get_running_loop())
        g.close()

    asyncio.run(go())
    return g


def test_cgroup_v1_memory_host_serves_by_accounting_and_says_why(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], stderr_log: None) -> None:
    t = make_tree(tmp_path / "t", v1_memory=True)
    g = started(make_guard(tmp_path, proc_root=str(t.proc)))
    h = g.health()
    assert h["available"] is False
    assert "memory controller is bound to the cgroup v1 hierarchy" in h["reason"]
    assert "systemd.unified_cgroup_hierarchy=1" in h["fix"]
    assert g.runner_hook("smollm2", 1 << 20) is None
    assert g.service_memory_max() is None
    assert "edge_agent_cgroup_managed 0" in g.render_metrics()
    err = capsys.readouterr().err
    assert "cgroup v2: not managed, budgets by accounting only" in err and "Fix:" in err


def test_not_delegated_and_disabled(tmp_path: Path) -> None:
    t = make_tree(tmp_path / "t", delegated=False)
    h = started(make_guard(tmp_path, proc_root=str(t.proc))).health()
    assert h["available"] is False and "not delegated" in h["reason"]
    assert "Delegate=yes" in h["fix"]
    h = started(make_guard(tmp_path, enabled=False)).health()
    assert h["available"] is False
    assert h["reason"] == "disabled by configuration (cgroup.enabled = false)"


def test_bad_policies_are_config_errors_naming_file_and_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"cgroup policy 'nope': not found .*Hint: use one of: "
                       r".*default"):
        make_guard(tmp_path, policy="nope")
    bad = tmp_path / "bad.toml"
    bad.write_text("[model]\nmemory_hihg = '1.2x'\n")
    with pytest.raises(ConfigError, match=r"bad\.toml: unknown key model\.memory_hihg\. Hint: "
                       r"valid keys in \[model\] are memory_high"):
        make_guard(tmp_path, policy=str(bad))
    with pytest.raises(ConfigError, match=r"cgroup\.policy .*expected a non-empty string"):
        make_guard(tmp_path, policy="")


def test_serve_exits_78_on_a_bad_policy(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[server]\nsocket = "{tmp_path / "s.sock"}"\n'
                   f'state_dir = "{tmp_path}"\n[cgroup]\npolicy = "{tmp_path / "x.toml"}"\n')
    assert cli.main(["serve", "--config", str(cfg)]) == 78
    err = capsys.readouterr().err
    assert f"cgroup policy file {tmp_path / 'x.toml'}: not found" in err and "Hint:" in err


def test_pressure_sources_that_fail_are_explained(tmp_path: Path) -> None:
    g = started(make_guard(tmp_path, env={"MEMORY_PRESSURE_WATCH": str(tmp_path / "missing")},
                           enabled=False))
    p = g.pressure_dict()
    assert p["source"] is None and p["stage"] == 0
    assert f"open {tmp_path / 'missing'}" in p["error"] and "Hint:" in p["error"]
    g = started(make_guard(tmp_path, env={"MEMORY_PRESSURE_WATCH": "/dev/null"}))
    assert g.pressure_dict()["error"] == "off ($MEMORY_PRESSURE_WATCH=/dev/null)"
    # a bad unit environment is a configuration error: exit 78 stops a restart loop
    with pytest.raises(ConfigError, match=r"\$MEMORY_PRESSURE_WRITE='%%%': not valid base64\. "
                       "Hint:"):
        started(make_guard(tmp_path, env={"MEMORY_PRESSURE_WATCH": str(tmp_path),
                                          "MEMORY_PRESSURE_WRITE": "%%%"}, enabled=False))


@pytest.fixture
def tree(tmp_path: Path) -> Tree:
    import os

    return make_tree(tmp_path / "t", own=OWN, pids=(os.getpid(),))


def on_tree(tmp_path: Path, tree: Tree) -> MemoryGuard:
    """A guard over model smollm2 whose cgroup file access goes through the tree's fake kernel."""
    host = Host(models={"smollm2": FakeModel("smollm2")})
    return make_guard(tmp_path, host=host, proc_root=str(tree.proc),
                      io_factory=lambda: tree.kernel)


def test_model_group_life_and_an_attributed_oom_kill(tmp_path: Path, tree: Tree) -> None:
    guard = on_tree(tmp_path, tree)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])

    async def go() -> str | None:
        g = guard
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
    m = guard.model_dict("smollm2")
    assert m["oom_kills"] == 1 and m["last_oom"]["event"] == "oom_group_kill"
    text = guard.render_metrics()
    assert 'edge_agent_oom_kills_total{model="smollm2"} 1' in text
    assert 'edge_agent_cgroup_memory_events_total{model="smollm2",event="high"} 2' in text
    assert guard.runner_exited("smollm2") is None  # once only


def test_a_group_that_cannot_be_created_leaves_the_runner_outside_with_a_warning(
        tmp_path: Path, tree: Tree) -> None:
    g = on_tree(tmp_path, tree)

    async def go() -> None:
        g.start(asyncio.get_running_loop())
        tree.kernel.fail[(f"{OWN}/models/smollm2", None)] = errno.EACCES
        assert g.runner_hook("smollm2", 700 << 20) is None
        assert g.runner_exited("smollm2") is None
        g.close()

    asyncio.run(go())
    (w,) = g.health()["warnings"]
    assert w.startswith("model smollm2: runner will run outside its own group: mkdir ")
    assert "Permission denied (EACCES). Hint:" in w


def test_each_stage_asks_the_models_and_refusals_map_to_http_and_uart(tmp_path: Path) -> None:
    policy = tmp_path / "eager.toml"  # every pressure event escalates one stage
    policy.write_text("[pressure]\nescalate_interval_s = 0\nretry_after_s = 7\n")
    idle, busy, queued = FakeModel("idle").idle(), FakeModel("busy", max_batch=8), \
        FakeModel("queued").idle()
    host = Host(models={m.name: m for m in (idle, busy, queued)}, queue={"queued": 1})
    low = busy.run("req-low", priority=0, started_at=1.0)
    high = busy.run("req-high", priority=5, started_at=2.0)
    g = make_guard(tmp_path, host=host, enabled=False, policy=str(policy))

    g._pressure_hit("test")  # stage 1: batches shrink, every model loop is woken
    assert g.stages.stage == 1 and g.batch_limit(8) == 4
    assert g.pressure_dict()["batch_limits"] == {"idle": 2, "busy": 4, "queued": 2}
    assert [m.pokes for m in (idle, busy, queued)] == [1, 1, 1]
    g.check_admission()  # still admitting

    g._pressure_hit("test")  # stage 2: refuse new requests, unload the idle models
    assert g.stages.stage == 2
    assert idle.unload_requested and not queued.unload_requested  # a queued one stays
    assert not busy.unload_requested and host.shed == []
    with pytest.raises(AdmissionRefused) as info:
        g.check_admission()
    refused = info.value
    assert refused.retry_after_s == 7 and refused.stage == 2
    http = api_error(refused)
    assert (http.status, http.code, http.headers) == (503, "memory_pressure",
                                                      (("retry-after", "7"),))
    assert http.message.startswith("not admitting new requests: memory pressure stage 2 "
                                   "(stop-admitting). Hint: retry after 7 s")
    uart = backend_error(refused)
    assert (uart.code, str(uart)) == ("memory_pressure", http.message)

    g._pressure_hit("test")  # stage 3: the lowest-priority running request is shed
    assert g.stages.stage == 3
    ((rid, why),) = host.shed
    assert rid == low.id and not high.done.is_set()
    assert why.startswith("request req-low (model busy, priority 0) cancelled under memory "
                          "pressure: stage 3 (cancel-lowest)") and "Hint: retry later" in why
    assert "(running: 1 at priority 0, 1 at priority 5)" in why  # what it chose among
    assert g.shed == {"busy": 1}
    kinds = [kind for kind, _ in host.events]
    assert kinds == ["memory_pressure"] * 4  # three stage changes and the shed request
    assert 'edge_agent_requests_shed_total{model="busy"} 1' in g.render_metrics()
