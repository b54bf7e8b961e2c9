"""`systemctl start edge-agent` in the systemd guest (amd64 under TCG, systemd 252 as PID 1).

One boot, several facts (tests/qemu/guest_systemd_agent.py prints them, the tests below assert):
the units come from `edge-agent systemd install` (then sysusers, tmpfiles, daemon-reload, as
the installer tells a user); the unit stays `activating` while the daemon answers /health 503
"loading" and turns `active (running)` only after READY=1; `systemctl status` shows our STATUS=
text; the daemon and its runner sit in their cgroup leaves; the UART console on ttyS2 (group
dialout, reached through the unit's SupplementaryGroups=) answers on the null modem's far end;
PSI triggers are armed on the groups the daemon owns and a stall under models/ fires one; a
frozen main loop (SIGSTOP) is caught by the watchdog and the service restarted; `systemctl
stop` drains a running request.
The model is a tiny random llama with the default model's tokenizer (tests/qemu/tiny_model.py),
so the boot measures the service, not TCG matrix products.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest
from qemu.build_systemd_guest import SystemdImage
from qemu.skips import systemd_image_or_skip
from qemu.systemd_guest import SystemdGuest
from qemu.tiny_model import write_tiny_llama

pytestmark = [pytest.mark.qemu, pytest.mark.timeout(600)]

CONFIG = b"""\
default_model = "tiny"

[models.tiny]
path = "/usr/local/share/edge-agent/tiny.gguf"
preload = true
context = 512
max_batch = 4

[server]
drain_timeout_s = 45  # below TimeoutStopSec=60: systemd must never have to kill

[cgroup]
policy = "tiny-board"

[serial]
port = "/dev/ttyS2"  # the harness's null modem; the guest script types into ttyS3
"""

# Absolute limits: the shipped policies are relative to the model's computed budget (weights +
# KV cache), which for a 13 MB model is far below the runner's own Python + numpy footprint.
POLICY = b"""\
description = "test guest: absolute limits for the tiny model"

[model]
memory_high = "160M"
memory_max = "192M"
memory_swap_max = 0
oom_group = true

[supervisor]
memory_min = "16M"
memory_low = "48M"

[pressure]
trigger = "some 300000 2000000"
escalate_interval_s = 5
hold_s = 30
max_stage = 3
batch_factor = 0.5
retry_after_s = 5
"""

# The shipped WatchdogSec=30 would make the freeze test wait 30 s under emulation.
WATCHDOG_DROPIN = b"""\
[Service]
WatchdogSec=10
"""

SCRIPT = Path(__file__).parent / "qemu" / "guest_systemd_agent.py"



@pytest.fixture(scope="module")
def facts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    image: SystemdImage = systemd_image_or_skip("systemd QEMU tests")
    tiny = write_tiny_llama(tmp_path_factory.mktemp("model") / "tiny.gguf")
    files = {"drive.py": SCRIPT.read_bytes(), "config.toml": CONFIG,
             "tiny.gguf": tiny.read_bytes(), "watchdog.conf": WATCHDOG_DROPIN,
             "policy.toml": POLICY}
    t0 = time.monotonic()
    with SystemdGuest("python3 /ea/drive.py", image=image, files=files,
                      null_modem=True) as guest:
        r = guest.wait(timeout=480)
    out: dict[str, Any] = {"_wall": time.monotonic() - t0, "_rc": r.rc, "_output": r.output}
    for line in r.output.splitlines():
        if line.startswith("{"):
            fact = json.loads(line)
            out[fact["step"]] = fact
    print(f"systemd guest: {out['_wall']:.1f} s wall; boot {r.boot_seconds} s")
    return out


def _ctx(facts: dict[str, Any]) -> str:
    return facts["_output"][-6000:]


def test_installed_like_a_user_does(facts: dict[str, Any]) -> None:
    assert facts["boot"]["state"] == "running", _ctx(facts)
    inst = facts["install"]
    assert inst["rc"] == 0, inst
    assert "wrote /etc/systemd/system/edge-agent.service" in inst["stderr"]
    assert "systemd-sysusers" in inst["stderr"]  # the installer says what to run next
    steps = [facts["sysusers"], facts["tmpfiles"], facts["daemon-reload"]]
    assert all(s["rc"] == 0 for s in steps), steps
    assert "Creating user 'edge-agent'" in facts["sysusers"]["out"]
    unit = facts["unit"]["text"]
    assert "ExecStart=/usr/bin/python3 -m edge_agent serve" in unit
    assert "Type=notify" in unit and "Delegate=yes" in unit


def test_active_only_after_ready(facts: dict[str, Any]) -> None:
    start = facts["start"]
    assert start["show"]["ActiveState"] == "active", _ctx(facts)
    assert start["show"]["SubState"] == "running"
    observed = start["observed"]
    # While the model loaded, systemd held the unit in `activating` and the daemon itself,
    # already answering on the activated socket, said "loading" (503): READY=1 not yet sent.
    loading = [o for o in observed if o[0] == "activating" and o[2] == 503]
    assert loading and all(o[3] == "loading" for o in loading), observed
    # No observation has the unit active while the daemon was not serving.
    assert not [o for o in observed if o[0] == "active" and o[3] != "serving"], observed
    assert start["health_after"] == [200, "serving"]
    print(f"systemctl start -> active: {start['seconds']} s (observed {observed})")


def test_status_shows_our_status_text(facts: dict[str, Any]) -> None:
    text = facts["status"]["text"]
    assert "Active: active (running)" in text, text
    status_line = next(ln for ln in text.splitlines() if "Status:" in ln)
    # The daemon's READY=1 status: where it serves and each model's state (tiny loaded).
    assert re.search(r'Status: "serving on 1 activated socket\(s\); models: .*tiny '
                     r'(idle|serving)', status_line), text
    assert facts["start"]["show"]["StatusText"].startswith("serving on 1 activated socket(s)")


def test_health_and_a_completion(facts: dict[str, Any]) -> None:
    reply = facts["completion"]["reply"]
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "length" and choice["text"], reply
    assert reply["usage"]["completion_tokens"] == 6


def test_weights_locked_under_the_hardened_unit(facts: dict[str, Any]) -> None:
    """The unit's hardening (system-call filter, no new privileges, MemoryDenyWriteExecute, ...)
    leaves mlock working: CAP_IPC_LOCK and LimitMEMLOCK=infinity reach the runner."""
    lock = facts["cgroups"]["mlock"]["tiny"]
    assert lock is not None and lock["locked"] is True, lock
    assert lock["error"] is None and lock["vmlck_bytes"] >= lock["weight_bytes"] > 0, lock


def test_serial_console_answers_under_the_hardened_unit(facts: dict[str, Any]) -> None:
    """No PrivateDevices=, SupplementaryGroups=dialout and a system-call filter that keeps the
    tty ioctls and flock: the daemon, user edge-agent, opens ttyS2 (udev's root:dialout 0660)
    and its console answers `status` typed on the other end of the wire."""
    ser = facts["serial"]
    assert "error" not in ser, ser
    assert ser["device"] == {"path": "/dev/ttyS2", "group": "dialout", "mode": "0o660"}, ser
    assert ser["main_uid"] != 0 and ser["dialout_gid"] in ser["main_groups"], ser
    assert ser["held_fds"], ser  # the daemon itself holds the port open
    assert any("serial /dev/ttyS2: open" in ln for ln in ser["serial_log"]), ser
    assert ser["prompt"].endswith("edge> "), ser
    status = ser["status"]
    assert "state: serving" in status and "tiny" in status, ser
    assert status.endswith("\r\nedge> "), ser  # CRLF line ends, then the prompt again
    print(f"UART console: prompt and status in {ser['seconds']} s")


def test_daemon_and_runner_cgroup_leaves(facts: dict[str, Any]) -> None:
    cg = facts["cgroups"]
    svc = cg["control_group"]
    assert svc == "/system.slice/edge-agent.service"
    assert cg["main_cgroup"] == svc + "/supervisor", cg
    pid, runner_cg = cg["runners"]["tiny"]
    assert pid and runner_cg == svc + "/models/tiny", cg
    leaf = cg["tree"][svc + "/models/tiny"]
    assert leaf["cgroup.procs"].split() == [str(pid)]
    assert leaf["memory.oom.group"] == "1"
    assert (leaf["memory.high"], leaf["memory.max"]) == (str(160 << 20), str(192 << 20)), leaf
    assert leaf["memory.swap.max"] == "0"
    sup = cg["tree"][svc + "/supervisor"]
    assert sup["cgroup.procs"].split() == [str(cg["main_pid"])], sup
    assert (sup["memory.min"], sup["memory.low"]) == (str(16 << 20), str(48 << 20)), sup
    assert cg["tree"][svc]["cgroup.procs"] == "", "the delegated root must hold no process"


def test_watchdog_restarts_a_frozen_daemon(facts: dict[str, Any]) -> None:
    wd = facts["watchdog"]
    before, after = wd["before"], wd["after"]
    assert before["WatchdogUSec"] == "10s"
    assert int(after["NRestarts"]) == int(before["NRestarts"]) + 1, wd
    assert after["MainPID"] not in ("0", str(wd["frozen_pid"])), wd
    assert after["ActiveState"] == "active" and wd["health_after"] == [200, "serving"], wd
    assert any("Watchdog timeout" in ln for ln in wd["watchdog_lines"]), wd
    print(f"watchdog: frozen -> restarted and serving in {wd['seconds']} s ({wd['observed']})")


def test_memory_pressure_is_watched_under_the_shipped_unit(facts: dict[str, Any]) -> None:
    """Debian 12 (systemd 252, kernel 6.1): the service's own memory.pressure stays root-owned,
    so the daemon arms PSI triggers on the supervisor/ and models/ groups it owns, with the
    unit's CAP_SYS_RESOURCE (6.1 wants it to open a pressure file for writing), then drops it."""
    cg = facts["cgroups"]
    svc = "/sys/fs/cgroup" + cg["control_group"]
    p = cg["pressure"]
    kinds = {s["file"]: s["kind"] for s in p["sources"]}
    assert kinds == {f"{svc}/supervisor/memory.pressure": "psi",
                     f"{svc}/models/memory.pressure": "psi"}, p
    assert p["triggers_armed"] == 2 and p["error"] is None, p
    assert all(s["trigger"] == "some 300000 2000000" for s in p["sources"]), p
    owners = cg["pressure_file_owners"]
    assert owners["supervisor"] == owners["models"] == cg["service_uid"] != 0, owners
    if owners["."] != cg["service_uid"]:  # systemd < 254: the service's file stays root's
        (refused,) = p["refused"]
        assert refused["file"] == f"{svc}/memory.pressure" and refused["role"] == "service"
        assert "(EACCES)" in refused["error"] and "Hint:" in refused["error"], refused
    # CAP_SYS_RESOURCE came from the unit, was used to arm, and is gone from the daemon and
    # its runner; CAP_IPC_LOCK (mlock) stays.
    assert p["cap_sys_resource"] == "dropped after arming", p
    for name, c in [("daemon", cg["main_caps"]), *cg["runner_caps"].items()]:
        assert not int(c["CapEff"], 16) >> 24 & 1, (name, c)
        assert not int(c["CapAmb"], 16) >> 24 & 1, (name, c)
        assert int(c["CapEff"], 16) >> 14 & 1, (name, c)
    metrics = "\n".join(cg["metrics"])
    for leaf in ("supervisor", "models"):
        assert (f'edge_agent_memory_pressure_source{{file="{svc}/{leaf}/memory.pressure",'
                f'kind="psi",role="{leaf}"}} 1') in metrics, metrics
    assert "edge_agent_memory_pressure_triggers_armed 2" in metrics, metrics
    assert not [ln for ln in cg["pressure_log"] if "polling" in ln], cg["pressure_log"]
    print(f"kernel {cg['kernel']}: {cg['pressure_log']}")


def test_a_stall_under_models_fires_the_trigger(facts: dict[str, Any]) -> None:
    """A hog in models/probe (memory.high 16M) stalls; the trigger on models/ wakes the loop
    (not polling) and the stall counts as a pressure event: stage 1, shrink-batches."""
    probe = facts["pressure_probe"]
    before, after = probe["before"], probe["after"]
    assert after["events"] > before["events"], probe
    src = {s["role"]: s for s in after["sources"]}
    assert src["models"]["kind"] == "psi" and src["models"]["events"] >= 1, after
    assert after["stage"] >= 1 and after["history"], after
    models = src["models"]["file"]
    assert any(f"PSI trigger fired on {models}" in h["reason"] for h in after["history"]), after
    assert any(ln.startswith("edge_agent_memory_pressure_source_events_total")
               and 'role="models"' in ln and not ln.endswith(" 0")
               for ln in probe["metrics"]), probe["metrics"]
    assert probe["probe_removed"], probe
    print(f"hog -> pressure event in {probe['seconds']} s; models/memory.pressure: "
          f"{probe['models_pressure']!r}")


def test_stop_drains_a_running_request(facts: dict[str, Any]) -> None:
    stop = facts["stop"]
    assert stop["rc"] == 0 and stop["request_was_running"], stop
    assert "reply" in stop["request"], stop  # answered, not cut off
    assert stop["request"]["reply"]["choices"][0]["finish_reason"] in ("length", "stop"), stop
    show = stop["show"]
    assert show["ActiveState"] == "inactive" and show["Result"] == "success", show
    assert show["ExecMainStatus"] == "0", show
    log = "\n".join(stop["log_tail"])
    assert "stopping: draining" in log and "edge-agent: stopped" in log, log
    print(f"systemctl stop with a request running: {stop['seconds']} s")
