"""The memory guard in process: the per-model budget includes the runner process (on a real
Daemon object, no runner); on a guard over small fakes (tests/guard_host.py), memory.events log
lines are rate limited, and a PSI trigger the kernel refuses (EACCES before Linux 6.5) is
explained correctly and replaced by polling."""

from __future__ import annotations

import asyncio
import errno
from pathlib import Path

import pytest
from guard_host import make_guard

import edge_agent.daemon.pressure_sources as sources_mod
from edge_agent.cgroup import MemoryEvent, PressureWatcher
from edge_agent.cgroup.psi import _error, permission_hint
from edge_agent.config import load_config
from edge_agent.daemon.app import Daemon
from edge_agent.scheduler import RUNNER_BASE_BYTES, model_budget_bytes


def daemon_on(tmp_path: Path, engine: str) -> Daemon:
    config = load_config(None, env={}, check_paths=False, overrides={
        "server.socket": str(tmp_path / "s.sock"), "server.state_dir": str(tmp_path / "state"),
        "journal.enabled": False, "cgroup.enabled": False, "models.smollm2.context": 256,
        "runtime.engine": engine})
    return Daemon(config, env={"MEMORY_PRESSURE_WATCH": "/dev/null"})


def test_model_budget_counts_the_runner_process(tmp_path: Path) -> None:
    from edge_agent.runtime.gguf import GGUFFile
    from edge_agent.runtime.model import ModelConfig
    from edge_agent.runtime.prepare import prepared_size

    d = daemon_on(tmp_path, "numpy")
    svc = d.services["smollm2"]
    svc.ensure_tokenizer()
    g = GGUFFile(svc.path())
    cfg = ModelConfig.from_metadata(g.metadata, source=str(svc.path()))
    bare = model_budget_bytes(prepared_size(g, d.config.runtime.dtype), cfg.n_layers,
                              cfg.n_kv_heads, cfg.head_dim, svc.max_batch, svc.context)
    assert svc.budget_bytes == bare + RUNNER_BASE_BYTES
    assert svc.to_dict()["budget_bytes"] == svc.budget_bytes  # what load planning uses too


def test_llamacpp_budget_counts_weights_as_stored_kv_buffers_and_process(tmp_path: Path) -> None:
    pytest.importorskip("llama_cpp")
    from edge_agent.runtime.engines import (
        LLAMACPP_RUNNER_BASE_BYTES,
        llamacpp_budget_bytes,
        model_facts,
    )

    d = daemon_on(tmp_path, "llamacpp")
    svc = d.services["smollm2"]
    svc.ensure_tokenizer()
    facts = model_facts(svc.path())
    assert facts.tensor_bytes < svc.path().stat().st_size  # the GGUF's tensors, no f32 copy
    assert svc.budget_bytes == llamacpp_budget_bytes(
        facts, svc.max_batch, svc.context, overhead_bytes=LLAMACPP_RUNNER_BASE_BYTES)
    assert svc.to_dict()["engine"] == "llamacpp"


def _ev(key: str, delta: int, total: int, group: str = "smollm2") -> MemoryEvent:
    return MemoryEvent(group, key, delta, total)


def test_memory_events_are_logged_at_most_every_30_s(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], stderr_log: None) -> None:
    g = make_guard(tmp_path, enabled=False)
    now = [1000.0]
    g.clock = lambda: now[0]
    g._record([_ev("high", 1, 1)])  # the first one is logged at once
    for i in range(2, 2001):  # a throttled runner: thousands of increases
        now[0] += 0.01
        g._record([_ev("high", 1, i)])
    g._record([_ev("max", 2, 2)])  # another key has its own budget of lines
    lines = [x for x in capsys.readouterr().err.splitlines() if "memory: smollm2" in x]
    assert len(lines) == 2, lines
    assert "smollm2: high +1 (total 1); logged at most every 30 s" in lines[0]
    assert "smollm2: max +2 (total 2)" in lines[1]
    assert g.memory_events[("smollm2", "high")] == 2000  # counting is not rate limited
    now[0] = 1030.0
    g._record([_ev("high", 5, 2005)])
    (line,) = capsys.readouterr().err.splitlines()
    assert "smollm2: high +2004 in the last 30 s (total 2005)" in line  # the summed delta
    now[0] = 1031.0
    g._record([_ev("high", 3, 2008), _ev("oom_kill", 1, 1), _ev("oom_kill", 1, 2)])
    err = capsys.readouterr().err
    assert err.count("the kernel killed the runner of model smollm2") == 2  # always logged
    assert "high +3" not in err
    g.runner_exited("smollm2")  # what was held back is logged when the runner goes
    assert "smollm2: high +3 (total 2008) since the last line" in capsys.readouterr().err


def test_eacces_hint_names_kernel_capability_and_systemd(tmp_path: Path) -> None:
    psi = tmp_path / "memory.pressure"
    psi.write_text("some avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")
    hint = permission_hint(psi, release="6.1.0-28-arm64", uid=psi.stat().st_uid + 1)
    for needle in ("kernel 6.1.0-28-arm64", "Before Linux 6.5", "CAP_SYS_RESOURCE",
                   "multiple of 2 s", "systemd >= 254", "$MEMORY_PRESSURE_WATCH",
                   f"owned by uid {psi.stat().st_uid}", "systemd < 254"):
        assert needle in hint, needle
    assert "owned by" not in permission_hint(psi, uid=psi.stat().st_uid)
    for code in (errno.EACCES, errno.EPERM):
        msg = str(_error("write trigger to", psi, OSError(code, "x"), b"some 300000 2000000\0"))
        assert "CAP_SYS_RESOURCE" in msg and "Hint: not allowed to create a PSI trigger" in msg
        assert "systemd-run" not in msg and "`Delegate=yes`" not in msg  # not the cause


def test_refused_trigger_falls_back_to_polling_avg10(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str], stderr_log: None) -> None:
    psi = tmp_path / "memory.pressure"
    psi.write_text("some avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
                   "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")

    def refused(self: PressureWatcher) -> None:  # what Linux 6.1 answers an unprivileged write
        raise OSError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(PressureWatcher, "_arm", refused)
    monkeypatch.setattr(sources_mod, "PSI_POLL_S", 0.02)
    g = make_guard(tmp_path, env={"MEMORY_PRESSURE_WATCH": str(psi)}, enabled=False)

    async def go() -> tuple[int, int]:
        g.start(asyncio.get_running_loop())
        await asyncio.sleep(0.1)
        quiet = g.stages.stage
        # the default trigger is 300 ms in 2 s: 15 %; 14.99 is below it
        psi.write_text("some avg10=14.99 avg60=0.00 avg300=0.00 total=1\n")
        await asyncio.sleep(0.1)
        assert g.stages.stage == 0
        psi.write_text("some avg10=15.00 avg60=0.00 avg300=0.00 total=2\n")
        for _ in range(100):
            await asyncio.sleep(0.02)
            if g.stages.stage:
                break
        stage = g.stages.stage
        g.close()
        return quiet, stage

    quiet, stage = asyncio.run(go())
    assert quiet == 0 and stage >= 1
    p = g.pressure_dict()
    assert p["kind"] == "poll" and p["source"] == str(psi)
    assert "EACCES" in p["error"] and "CAP_SYS_RESOURCE" in p["error"]
    err = capsys.readouterr().err
    assert f"memory pressure: polling {psi} (some avg10 >= 15%) every 0.02 s" in err
