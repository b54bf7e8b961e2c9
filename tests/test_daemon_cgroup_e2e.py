"""The daemon on a cgroup v2 tree (tests/cgroup_fake.py, through tests/cgroup_daemon.py) with
systemd's memory pressure protocol on a FIFO this test writes to, and the real default model.

Asserted on files: the daemon in supervisor/ with the policy's protection, +memory delegated,
models/smollm2/ with memory.high/max/swap.max/oom.group from the model's budget and the
runner's pid in cgroup.procs. An OOM group kill (memory.events written as the kernel would,
then the runner SIGKILLed) is attributed, journaled, shown in /health and /metrics, and the
running request completes after the reload. Pressure walks the stages 1 -> 2 -> 3 (batch
limit, 503 + Retry-After, lowest priority failed) and back after the hold time. The module
runs twice, on a daemon of each engine (the `engine` fixture).
"""

from __future__ import annotations

import json
import math
import os
import signal
import sqlite3
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cgroup_fake import Tree, make_tree
from daemon_proc import REPO, Daemon, launch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

OWN = "system.slice/edge-agent.service"
MAX_BATCH = 4
HOLD_S = 2.0
ESCALATE_S = 0.3
RETRY_AFTER = 7
POLICY = f"""\
description = "test: short hold and escalation"
[model]
memory_high = "1.15x"
memory_max = "1.4x"
memory_swap_max = 0
oom_group = true
[supervisor]
memory_min = "32M"
memory_low = "96M"
[pressure]
trigger = "some 300000 2000000"
escalate_interval_s = {ESCALATE_S}
hold_s = {HOLD_S}
max_stage = 3
batch_factor = 0.5
retry_after_s = {RETRY_AFTER}
"""


class CgDaemon(Daemon):
    tree: Tree
    fifo: Path
    journal: Path

    def group(self, rel: str = "") -> Path:
        return self.tree.mount / OWN / rel

    def read(self, rel: str, name: str) -> str:
        return (self.group(rel) / name).read_text().strip()

    def pressure(self) -> None:
        fd = os.open(self.fifo, os.O_WRONLY | os.O_NONBLOCK)
        try:
            os.write(fd, b"\0")
        finally:
            os.close(fd)

    def stage(self) -> int:
        return int(self.health()["pressure"]["stage"])

    def wait_for(self, what: str, probe: Any, timeout: float = 30.0) -> Any:
        end = time.monotonic() + timeout
        while True:
            got = probe()
            if got:
                return got
            if time.monotonic() > end:
                pytest.fail(f"{what}: not within {timeout} s; health: "
                            f"{json.dumps(self.health())[:3000]}\nlog: "
                            f"{self.log.read_text()[-3000:]}")
            time.sleep(0.05)

    def metrics(self) -> str:
        return self.call("GET", "/metrics")[2].decode()


@pytest.fixture(scope="module", params=["llamacpp", "numpy"])
def engine(request: pytest.FixtureRequest) -> str:
    """Every test of this module runs against a daemon on each engine."""
    return str(request.param)


@pytest.fixture(scope="module")
def daemon(prepared_state_dir: Path, engine: str) -> Iterator[CgDaemon]:
    root = Path(tempfile.mkdtemp(prefix="eacg-", dir="/tmp"))
    tree = make_tree(root, own=OWN, pids=())
    (root / "policy.toml").write_text(POLICY)
    fifo = root / "pressure.fifo"
    os.mkfifo(fifo)
    cfg = root / "config.toml"
    cfg.write_text(
        f'[server]\nsocket = "{root / "ea.sock"}"\nstate_dir = "{prepared_state_dir}"\n'
        f"drain_timeout_s = 10\n"
        f"[scheduler]\nmax_batch_size = {MAX_BATCH}\nbatch_window_ms = 0\n"
        f'[runtime]\nengine = "{engine}"\nmlock = "best-effort"\nthreads = 1\n'
        f'[journal]\npath = "{root / "journal.sqlite3"}"\n'
        f'[cgroup]\npolicy = "{root / "policy.toml"}"\nproc_root = "{tree.proc}"\n'
        f"[models.smollm2]\ncontext = 512\nmax_batch = {MAX_BATCH}\npreload = true\n"
    )
    argv = [str(REPO / "tests" / "cgroup_daemon.py"), str(tree.mount), OWN, "--", "serve",
            "--config", str(cfg)]
    with launch(CgDaemon, root, argv, env={"MEMORY_PRESSURE_WATCH": str(fifo)}) as d:
        d.tree, d.fifo, d.journal = tree, fifo, root / "journal.sqlite3"
        yield d


def pages(x: float) -> int:
    return math.ceil(x / 4096) * 4096


def test_layout_written_to_the_tree(daemon: CgDaemon, engine: str) -> None:
    h = daemon.health()
    cg, m = h["cgroup"], h["models"]["smollm2"]
    assert cg["available"] is True and cg["base"] == OWN and cg["policy"] == "policy", cg
    assert daemon.read("supervisor", "cgroup.procs").split() == [str(daemon.proc.pid)]
    assert daemon.read("", "cgroup.procs") == ""  # no processes in inner nodes
    assert "memory" in daemon.read("", "cgroup.subtree_control").split()
    assert daemon.read("supervisor", "memory.min") == str(32 << 20)
    assert daemon.read("supervisor", "memory.low") == str(96 << 20)
    assert "memory" in daemon.read("models", "cgroup.subtree_control").split()
    budget = m["budget_bytes"]
    assert m["engine"] == engine
    # the weights (as stored; numpy: the prepared f32 copy) + KV cache + buffers
    assert budget > m["mlock"]["weight_bytes"]
    high, mx = int(daemon.read("models/smollm2", "memory.high")), int(
        daemon.read("models/smollm2", "memory.max"))
    assert pages(1.15 * budget) - 4096 <= high <= pages(1.15 * budget)
    assert pages(1.4 * budget) - 4096 <= mx <= pages(1.4 * budget)
    assert daemon.read("models/smollm2", "memory.swap.max") == "0"
    assert daemon.read("models/smollm2", "memory.oom.group") == "1"
    assert daemon.read("models/smollm2", "cgroup.procs").split() == [str(m["runner_pid"])]
    assert m["memory"]["group"] == str(daemon.group("models/smollm2"))
    assert m["memory"]["oom_kills"] == 0
    assert h["pressure"]["stage"] == 0 and h["pressure"]["kind"] == "fifo"
    text = daemon.metrics()
    assert "edge_agent_cgroup_managed 1" in text
    assert 'edge_agent_oom_kills_total{model="smollm2"} 0' in text


def test_oom_group_kill_is_attributed_and_the_request_completes(daemon: CgDaemon) -> None:
    body = {"prompt": "The capital of France is", "max_tokens": 24, "temperature": 0}
    status, ref = daemon.json("POST", "/v1/completions", body)
    assert status == 200, ref
    before = daemon.health()["models"]["smollm2"]
    result: list[tuple[int, Any]] = []
    t = threading.Thread(target=lambda: result.append(daemon.json("POST", "/v1/completions",
                                                                  body)))
    t.start()
    daemon.wait_for("request running", lambda: daemon.health()["models"]["smollm2"]["active"])
    # what the kernel does at memory.max with memory.oom.group=1: count, then kill the group
    events = daemon.group("models/smollm2") / "memory.events"
    counts = dict(line.split() for line in events.read_text().splitlines())
    counts.update(max="1", oom="1", oom_kill="1", oom_group_kill="1")
    events.write_text("".join(f"{k} {v}\n" for k, v in counts.items()))
    os.kill(before["runner_pid"], signal.SIGKILL)
    t.join(120)
    status, r = result[0]
    assert status == 200, r
    assert r["choices"][0]["text"] == ref["choices"][0]["text"]  # retried after the reload
    m = daemon.wait_for("reloaded", lambda: (lambda x: x if x["runner_pid"] not in (
        None, before["runner_pid"]) else None)(daemon.health()["models"]["smollm2"]))
    assert m["losses"] == before["losses"] + 1
    assert m["memory"]["oom_kills"] == 1
    last = m["memory"]["last_oom"]
    assert last["event"] == "oom_group_kill" and last["limit"] == daemon.read(
        "models/smollm2", "memory.max")
    assert "OOM-killed by the kernel" in last["reason"] and "Hint:" in last["reason"]
    # the new runner has a fresh group with its pid; the old counters are gone with the old group
    assert daemon.read("models/smollm2", "cgroup.procs").split() == [str(m["runner_pid"])]
    assert "oom_group_kill 0" in daemon.read("models/smollm2", "memory.events")
    text = daemon.metrics()
    assert 'edge_agent_oom_kills_total{model="smollm2"} 1' in text
    assert ('edge_agent_cgroup_memory_events_total{model="smollm2",event="oom_group_kill"} 1'
            in text)
    assert "OOM-killed by the kernel" in daemon.log.read_text()
    with sqlite3.connect(daemon.journal) as db:
        rows = db.execute("SELECT kind, message FROM events WHERE kind = 'oom_kill'").fetchall()
    assert len(rows) == 1 and "model smollm2" in rows[0][1], rows


def test_pressure_walks_the_stages_and_back(daemon: CgDaemon) -> None:
    def start(prio: int, tokens: int) -> str:
        status, r = daemon.json("POST", "/v1/requests", {
            "prompt": "Count: 1, 2, 3, 4, 5, 6, 7,", "max_tokens": tokens, "temperature": 0,
            "priority": prio})
        assert status == 202, r
        return str(r["id"])

    def req(rid: str) -> dict[str, Any]:
        return daemon.json("GET", f"/v1/requests/{rid}")[1]

    low, high = start(1, 400), start(9, 400)
    daemon.wait_for("both running",
                    lambda: daemon.health()["models"]["smollm2"]["active"] == 2)
    # stage 1: new batches limited to max_batch x 0.5 = 2, so a third request waits
    daemon.pressure()
    daemon.wait_for("stage 1", lambda: daemon.stage() == 1)
    assert daemon.health()["pressure"]["batch_limits"] == {"smollm2": MAX_BATCH // 2}
    third = start(5, 8)
    time.sleep(0.5)
    m = daemon.health()["models"]["smollm2"]
    assert m["active"] == 2 and m["queued"] == 1 and req(third)["state"] == "queued"
    # stage 2: no admission, 503 with the stage's Retry-After
    time.sleep(ESCALATE_S + 0.05)
    daemon.pressure()
    daemon.wait_for("stage 2", lambda: daemon.stage() == 2)
    status, headers, data = daemon.call("POST", "/v1/completions", {"prompt": "x"})
    err = json.loads(data)["error"]
    assert status == 503 and headers["retry-after"] == str(RETRY_AFTER), err
    assert err["code"] == "memory_pressure" and "stage 2" in err["message"]
    assert "Hint:" in err["message"]
    # stage 3: the lowest-priority running request fails with the reason; the rest go on
    time.sleep(ESCALATE_S + 0.05)
    daemon.pressure()
    daemon.wait_for("stage 3", lambda: daemon.stage() == 3)
    r = daemon.wait_for("low failed", lambda: (lambda x: x if x["state"] == "failed" else None)(
        req(low)))
    assert r["error"]["code"] == "memory_pressure"
    assert "priority 1" in r["error"]["message"] and "memory pressure" in r["error"]["message"]
    assert r["completion_tokens"] < 400
    assert req(high)["state"] in ("running", "done")
    done = daemon.wait_for("third done", lambda: (lambda x: x if x["state"] == "done" else None)(
        req(third)))
    assert done["completion_tokens"] > 0  # it took the freed slot
    daemon.json("DELETE", f"/v1/requests/{high}")
    # walk back: one stage per hold_s of calm
    daemon.wait_for("stage 0", lambda: daemon.stage() == 0, timeout=4 * HOLD_S + 10)
    history = daemon.health()["pressure"]["history"][-6:]
    hist = [(x["from"], x["to"]) for x in history]
    assert hist == [(0, 1), (1, 2), (2, 3), (3, 2), (2, 1), (1, 0)]
    at = [x["at"] for x in history]
    assert all(ESCALATE_S <= at[i + 1] - at[i] < 2 for i in (0, 1))  # escalations
    assert all(HOLD_S <= at[i + 1] - at[i] < HOLD_S + 2 for i in (2, 3, 4))  # one hold each
    status, r = daemon.json("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 4})
    assert status == 200, r
    text = daemon.metrics()
    assert "edge_agent_memory_pressure_stage 0" in text
    for a, b in hist[-6:]:
        assert f'edge_agent_memory_pressure_transitions_total{{from="{a}",to="{b}"}} 1' in text
    assert 'edge_agent_requests_shed_total{model="smollm2"} 1' in text
    log = daemon.log.read_text()
    assert "escalated stage 2 (stop-admitting) -> 3 (cancel-lowest)" in log
    assert "released stage 1 (shrink-batches) -> 0 (normal)" in log


def test_stage_2_unloads_an_idle_model_and_removes_its_group(daemon: CgDaemon) -> None:
    daemon.wait_for("idle", lambda: daemon.health()["models"]["smollm2"]["state"] == "idle")
    daemon.pressure()
    daemon.wait_for("stage 1", lambda: daemon.stage() == 1)
    time.sleep(ESCALATE_S + 0.05)
    daemon.pressure()
    daemon.wait_for("unloaded",
                    lambda: daemon.health()["models"]["smollm2"]["state"] == "unloaded")
    assert not daemon.group("models/smollm2").exists()
    assert "unloading idle model smollm2" in daemon.log.read_text()
    daemon.wait_for("stage 0", lambda: daemon.stage() == 0, timeout=3 * HOLD_S + 10)
    status, r = daemon.json("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 4})
    assert status == 200, r  # loaded again on demand, in a new group
    pid = daemon.health()["models"]["smollm2"]["runner_pid"]
    assert daemon.read("models/smollm2", "cgroup.procs").split() == [str(pid)]


def test_sigterm_tears_the_model_groups_down(daemon: CgDaemon) -> None:
    daemon.proc.send_signal(signal.SIGTERM)
    assert daemon.proc.wait(60) == 0, daemon.log.read_text()[-3000:]
    assert not daemon.group("models").exists()
    assert daemon.group("supervisor").is_dir()  # the daemon's own leaf stays (it lives there)
