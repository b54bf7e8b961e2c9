"""A real runner OOM-killed as a group on a real kernel, and the request that survives it.

tests/test_qemu_cgroup.py drives the memory guard with hogs standing in for runners; here the
whole daemon runs (`python3 -m edge_agent serve` on the arm64 guest, the tiny llama, a policy
with memory.high = memory.max = 160 MiB, the shell moved into its own delegated group the way
systemd's Delegate=yes would). While a request generates, a process joins the runner's group
(models/tiny/) and allocates past memory.max: the kernel kills the group (memory.oom.group=1),
runner included. The control plane lives (same pid, /health answers), attributes the kill, loads
the model again, and the request completes with every token it was asked for.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from qemu.build_arm64_guest import GuestImage
from qemu.guest import run_arm64
from qemu.skips import arm64_image_or_skip
from qemu.tiny_model import write_tiny_llama

pytestmark = [pytest.mark.qemu, pytest.mark.timeout(600)]

POLICY = """\
description = "test: the runner group may use 160 MiB, then the kernel kills it"
[model]
memory_high = "160M"
memory_max = "160M"
memory_swap_max = 0
oom_group = true
[supervisor]
memory_min = "16M"
memory_low = "32M"
[pressure]
trigger = "some 300000 2000000"
escalate_interval_s = 5
hold_s = 30
max_stage = 3
batch_factor = 0.5
retry_after_s = 5
"""

# Joins the runner's group first, then allocates well past its memory.max.
HOG = r"""
import sys
open(sys.argv[1] + "/cgroup.procs", "w").write("0")
keep = []
for i in range(512):
    b = bytearray(1 << 20)
    b[::4096] = b"x" * 256
    keep.append(b)
print("hog survived", flush=True)
"""

COMMAND = """\
mkdir /sys/fs/cgroup/ea
echo +memory > /sys/fs/cgroup/cgroup.subtree_control
echo $$ > /sys/fs/cgroup/ea/cgroup.procs
export EDGE_AGENT_DEFAULT_MODEL=tiny
export EDGE_AGENT_MODELS__TINY__PATH=/ea/tiny.gguf
export EDGE_AGENT_MODELS__TINY__PRELOAD=true
export EDGE_AGENT_MODELS__TINY__CONTEXT=512
export EDGE_AGENT_MODELS__TINY__MAX_BATCH=2
export EDGE_AGENT_CGROUP__POLICY=/ea/policy.toml
python3 -m edge_agent --state-dir /tmp/state serve --socket /run/ea.sock 2>/tmp/serve.log &
echo "$!" > /tmp/serve.pid
python3 /ea/drive.py
kill -TERM "$(cat /tmp/serve.pid)"; wait "$(cat /tmp/serve.pid)"; echo "SERVE-RC $?"
echo "---- serve.log"
tail -c 3000 /tmp/serve.log
"""

DRIVER = r"""
import json, os, subprocess, sys, time
sys.path.insert(0, "/opt/edge-agent")
from edge_agent.client import DaemonClient

c = DaemonClient("/run/ea.sock", timeout=60)
out = {}
t0 = time.monotonic()
while time.monotonic() - t0 < 300:
    try:
        if c.health_status()[0] == 200:
            break
    except Exception:
        pass
    time.sleep(0.3)
h = c.health()
out["pid"] = h["pid"]
out["runner_before"] = h["models"]["tiny"]["runner_pid"]
group = "/sys/fs/cgroup/ea/models/tiny"
out["limits"] = {f: open(f"{group}/{f}").read().strip()
                 for f in ("memory.high", "memory.max", "memory.oom.group")}
rid = c.submit("Once upon a time", max_tokens=300, temperature=0.8, seed=7)
while c.get_request(rid)["completion_tokens"] < 3 and time.monotonic() - t0 < 400:
    time.sleep(0.05)
out["tokens_at_kill"] = c.get_request(rid)["completion_tokens"]
hog = subprocess.run([sys.executable, "/ea/hog.py", group], capture_output=True, text=True,
                     timeout=120)
out["hog_rc"], out["hog_out"] = hog.returncode, hog.stdout
t1 = time.monotonic()
while time.monotonic() - t1 < 300:
    r = c.get_request(rid)
    if r["state"] in ("done", "failed", "cancelled", "expired"):
        break
    time.sleep(0.3)
out["request"] = r
out["recovered_s"] = round(time.monotonic() - t1, 1)
h = c.health()
out["pid_after"] = h["pid"]
out["runner_after"] = h["models"]["tiny"]["runner_pid"]
out["state_after"] = h["models"]["tiny"]["state"]
out["oom_kills"] = h["cgroup"].get("oom_kills")
out["runner_group_after"] = open(f"{group}/cgroup.procs").read().split()
st = subprocess.run([sys.executable, "-m", "edge_agent", "status", "--socket", "/run/ea.sock"],
                    capture_output=True, text=True, timeout=60,
                    env={**os.environ, "PYTHONPATH": "/opt/edge-agent"})
out["status_rc"], out["status_text"] = st.returncode, st.stdout + st.stderr
print("RESULT " + json.dumps(out), flush=True)
"""


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    image: GuestImage = arm64_image_or_skip("runner OOM test")
    tiny = write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny.gguf")
    files = {"/ea/drive.py": DRIVER.encode(), "/ea/hog.py": HOG.encode(),
             "/ea/policy.toml": POLICY.encode(), "/ea/tiny.gguf": Path(tiny).read_bytes()}
    r = run_arm64(COMMAND, timeout=540, image=image, mount="none", files=files)
    line = next((ln for ln in r.output.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, f"rc {r.rc}\n{r.output[-4000:]}\n{r.console[-2000:]}"
    out = dict(json.loads(line[len("RESULT "):]))
    out["_output"], out["_console"] = r.output, r.console
    print(f"\nrunner OOM: recovered and finished in {out['recovered_s']} s; {r.wall_seconds:.0f} s"
          " wall")
    return out


def test_the_runner_group_has_the_policy_limits(result: dict[str, Any]) -> None:
    assert result["limits"] == {"memory.high": str(160 << 20), "memory.max": str(160 << 20),
                                "memory.oom.group": "1"}


def test_the_kernel_kills_the_whole_runner_group(result: dict[str, Any]) -> None:
    assert result["hog_rc"] == -9 and "survived" not in result["hog_out"], result
    assert result["runner_after"] not in (None, result["runner_before"]), result
    assert "oom" in result["_console"].lower()  # the kernel's own report


def test_the_control_plane_lives_and_attributes_the_kill(result: dict[str, Any]) -> None:
    assert result["pid_after"] == result["pid"]
    assert result["oom_kills"]["tiny"] == 1, result["oom_kills"]
    log = result["_output"].split("---- serve.log")[-1]
    assert "the kernel killed the runner of model tiny" in log, log


def test_the_request_completes_after_the_reload(result: dict[str, Any]) -> None:
    req = result["request"]
    assert result["tokens_at_kill"] >= 3
    assert req["state"] == "done" and req["finish_reason"] in ("length", "stop"), req
    assert req["attempts"] >= 2, req  # it ran again on the reloaded runner
    assert req["finish_reason"] == "stop" or req["completion_tokens"] == 300, req
    assert result["runner_group_after"] == [str(result["runner_after"])], result
    assert "SERVE-RC 0" in result["_output"], result["_output"][-3000:]


def test_status_shows_the_group_and_the_kill(result: dict[str, Any]) -> None:
    """`edge-agent status` (the human text) on a host where the cgroup is ours."""
    text = result["status_text"]
    assert result["status_rc"] == 0, text
    lines = text.splitlines()
    cgroup = next(ln for ln in lines if ln.startswith("cgroup:"))
    assert "not available" not in cgroup and "OOM kills 1)" in cgroup, text
    row = next(ln for ln in lines if ln.startswith("  tiny ")).split()
    assert row[1] in ("idle", "serving") and row[2] == "2", text  # loaded, killed, loaded again
