"""The daemon's memory guard on a real kernel: the arm64 QEMU guest (tests/qemu/, cgroup2 with
the memory controller and PSI), a real Daemon object and its MemoryGuard wired to an asyncio
loop, and memory hogs standing in for runners (the model is not loaded: under TCG it would take
minutes). What the guest proves, on the kernel's own files:

- memory.high throttles a runner group that exceeds it (memory.events `high` counts, the hog
  is far slower than the same hog unconstrained) and the throttling stalls raise the service's
  memory.pressure: the PSI trigger fires and the guard walks its stages up, then back down one
  hold at a time once the hog is gone;
- a runner pushed past memory.max is OOM-killed as a group (memory.oom.group=1) while the
  control plane lives, and the guard attributes the kill (oom_group_kill) before removing the
  group.
"""

from __future__ import annotations

import json

import pytest
from qemu.build_arm64_guest import GuestImage
from qemu.guest import run_arm64
from qemu.skips import arm64_image_or_skip

pytestmark = [pytest.mark.qemu, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def arm64() -> GuestImage:
    return arm64_image_or_skip("real-kernel cgroup tests")

POLICY = """\
[model]
memory_high = "1.0x"
memory_max = "4.0x"
memory_swap_max = 0
oom_group = true
[supervisor]
memory_min = "16M"
memory_low = "32M"
[pressure]
trigger = "some 50000 1000000"
escalate_interval_s = 0.5
hold_s = 2
max_stage = 3
"""

HOG = r"""
import sys, time
n = int(sys.argv[1])
keep = []
t0 = time.monotonic()
for i in range(n):
    b = bytearray(1 << 20)
    b[::4096] = b"x" * 256  # touch every page
    keep.append(b)
print(f"allocated {n} MiB in {time.monotonic() - t0:.3f} s", flush=True)
time.sleep(600)
"""

GUEST = r"""
import asyncio, json, os, select, subprocess, sys, time
from pathlib import Path

CG = Path("/sys/fs/cgroup")
HOG = Path("/opt/ea-test/hog.py").read_text()


def hog(mib):
    return subprocess.Popen([sys.executable, "-c", HOG, str(mib)], stdout=subprocess.PIPE)


def timed(p, limit):
    # seconds until the hog says it has allocated everything (None: not within limit)
    t0 = time.monotonic()
    buf = b""
    while b"allocated" not in buf:
        left = limit - (time.monotonic() - t0)
        if left <= 0 or not select.select([p.stdout], [], [], left)[0]:
            return None
        chunk = os.read(p.stdout.fileno(), 4096)
        if not chunk:
            return None
        buf += chunk
    return time.monotonic() - t0


# systemd's Delegate=yes, by hand: our own group, memory controller handed down to it
(CG / "ea").mkdir()
(CG / "cgroup.subtree_control").write_text("+memory")
(CG / "ea" / "cgroup.procs").write_text(str(os.getpid()))

out = {}
p = hog(64)
out["free_s"] = timed(p, 120)  # the same hog, unconstrained
p.kill(); p.wait()

from edge_agent.config import load_config
from edge_agent.daemon.app import Daemon



def guard(policy):
    cfg = load_config(None, env={}, check_paths=False, overrides={
        "server.socket": "/tmp/ea.sock", "server.state_dir": "/tmp/state",
        "journal.enabled": False, "cgroup.policy": policy})
    return Daemon(cfg, env={}).memory


async def until(pred, limit):
    end = time.monotonic() + limit
    while not pred() and time.monotonic() < end:
        await asyncio.sleep(0.1)
    return pred()


async def main():
    g = guard("/opt/ea-test/policy.toml")
    g.start(asyncio.get_running_loop())
    h = g.health()
    out["health"] = {k: h[k] for k in ("available", "reason", "base", "policy")}
    out["pressure_source"] = g.pressure_dict()["source"]
    out["supervisor_pids"] = (CG / "ea/supervisor/cgroup.procs").read_text().split()
    out["pid"] = os.getpid()
    # 1. memory.high = 32 MiB, the hog wants 64 MiB (no swap): throttled, pressure rises
    attach = g.runner_hook("hog", 32 << 20)
    grp = CG / "ea/models/hog"
    out["limits"] = {f: (grp / f).read_text().strip() for f in
                     ("memory.high", "memory.max", "memory.swap.max", "memory.oom.group")}
    p = hog(64)
    attach(p.pid)
    out["procs"] = (grp / "cgroup.procs").read_text().split() == [str(p.pid)]
    out["escalated"] = await until(lambda: g.stages.stage >= 2, 90)
    out["throttled_s"] = timed(p, 2 * (out["free_s"] or 1) + 5)
    ev = dict(l.split() for l in (grp / "memory.events").read_text().splitlines())
    out["events_high"] = int(ev["high"])
    out["pressure"] = (CG / "ea/memory.pressure").read_text()
    p.kill(); p.wait()
    out["kill_reason"] = g.runner_exited("hog")
    out["group_removed"] = not grp.exists()
    out["released"] = await until(lambda: g.stages.stage == 0, 120)
    out["history"] = [(t["from"], t["to"], round(t["at"], 3)) for t in
                      g.stages.to_dict()["history"]]
    g.close()
    # 2. memory.high = memory.max = 128 MiB (else high throttles the hog for ever before it
    # reaches max), the hog wants 256 MiB: the kernel kills the group
    g = guard("/opt/ea-test/oom.toml")
    g.start(asyncio.get_running_loop())
    attach = g.runner_hook("hog", 32 << 20)
    p = hog(256)
    attach(p.pid)
    try:
        out["oom_rc"] = p.wait(120)
    except subprocess.TimeoutExpired:
        p.kill(); p.wait()
        out["oom_rc"] = "timeout"
    out["oom_reason"] = g.runner_exited("hog")
    out["oom_kills"] = g.model_dict("hog")["oom_kills"]
    out["alive"] = True
    g.close()
    out["models_removed"] = not (CG / "ea/models").exists()


asyncio.run(main())
print("RESULT " + json.dumps(out), flush=True)
"""



@pytest.fixture(scope="module")
def result(arm64: GuestImage) -> dict:
    files = {"guard.py": GUEST, "hog.py": HOG, "policy.toml": POLICY,
             "oom.toml": POLICY.replace('memory_high = "1.0x"', 'memory_high = "4.0x"')}
    r = run_arm64("python3 /opt/ea-test/guard.py", timeout=540, image=arm64, mount="none",
                  files={f"/opt/ea-test/{k}": v.encode() for k, v in files.items()})
    line = next((ln for ln in r.output.splitlines() if ln.startswith("RESULT ")), None)
    assert r.rc == 0 and line is not None, f"rc {r.rc}\n{r.output[-4000:]}\n{r.console[-2000:]}"
    return dict(json.loads(line[len("RESULT "):]))


def test_layout_on_the_real_kernel(result: dict) -> None:
    assert result["health"] == {"available": True, "reason": None, "base": "ea",
                                "policy": "policy"}
    assert result["supervisor_pids"] == [str(result["pid"])]
    assert result["limits"] == {"memory.high": str(32 << 20), "memory.max": str(128 << 20),
                                "memory.swap.max": "0", "memory.oom.group": "1"}
    assert result["procs"] is True
    assert result["pressure_source"] == "/sys/fs/cgroup/ea/memory.pressure"


def test_memory_high_throttles_and_pressure_walks_the_stages_and_back(result: dict) -> None:
    assert result["free_s"] is not None
    assert result["events_high"] > 0
    assert result["throttled_s"] is None, result  # not done in 2x the free time (+5 s)
    assert result["escalated"] is True, result["pressure"]
    assert result["kill_reason"] is None  # we killed it, not the kernel
    assert result["group_removed"] is True
    assert result["released"] is True
    steps = [(a, b) for a, b, _ in result["history"]]
    peak = max(b for _, b in steps)
    assert steps == [(s, s + 1) for s in range(peak)] + [(s, s - 1) for s in range(peak, 0, -1)]
    at = [t for _, _, t in result["history"]][peak:]
    assert all(b - a >= 2.0 for a, b in zip(at, at[1:], strict=False))  # a hold per release


def test_memory_max_oom_kills_the_group_and_the_control_plane_lives(result: dict) -> None:
    assert result["oom_rc"] == -9
    reason = result["oom_reason"]
    assert reason is not None, result
    assert reason.startswith("OOM-killed by the kernel (oom_group_kill +1"), reason
    assert f"memory.max {128 << 20}" in reason
    assert result["oom_kills"] == 1
    assert result["alive"] is True and result["models_removed"] is True
