"""Runs INSIDE the systemd guest (python3, as root): install edge-agent the way a user does, start
it with systemctl, type into its UART console (serial.port = ttyS2, wired to ttyS3 by the
harness's null modem), make a memory hog stall under models/ so the daemon's PSI trigger fires,
freeze it for the watchdog, stop it while a request runs. Prints one JSON object per fact
(`{"step": ..., ...}`) on stdout; the host test asserts on them.

Inputs on the payload disk (/ea): config.toml (-> /etc/edge-agent/config.toml, its serial.port
is ttyS2), policy.toml
(the cgroup policy it names), tiny.gguf (the model it names), watchdog.conf (a drop-in for
edge-agent.service). Invariants: never waits without a bound; every systemctl call's output
is reported, not interpreted here; the hog's group (models/probe) is gone before the watchdog
step restarts the daemon.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["main"]

UNIT = "edge-agent.service"
UART = "/dev/ttyS2"       # the daemon's serial.port (config.toml)
UART_PEER = "/dev/ttyS3"  # the other end of the null modem
SOCK = "/run/edge-agent/edge-agent.sock"
PROPS = ["ActiveState", "SubState", "MainPID", "NRestarts", "StatusText", "Result",
         "ExecMainStatus", "ExecMainCode", "ControlGroup", "WatchdogUSec",
         "ActiveEnterTimestampMonotonic", "ExecMainStartTimestampMonotonic"]


def emit(step: str, **data: Any) -> None:
    print(json.dumps({"step": step, **data}), flush=True)


def sh(*cmd: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)


def uptime() -> float:
    return float(Path("/proc/uptime").read_text().split()[0])


def show() -> dict[str, str]:
    out = sh("systemctl", "show", UNIT, *(f"--property={p}" for p in PROPS)).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def client(timeout: float = 5.0) -> Any:
    from edge_agent.client import DaemonClient

    return DaemonClient(SOCK, timeout=timeout)


def health() -> tuple[int | None, str]:
    try:
        status, body = client(2.0).health_status()
        return status, str(body.get("status"))
    except Exception as exc:  # noqa: BLE001 - reported, the host decides
        return None, type(exc).__name__


def cgroup_of(pid: int) -> str:
    text = Path(f"/proc/{pid}/cgroup").read_text()
    return next(ln[3:] for ln in text.splitlines() if ln.startswith("0::"))


def cgroup_tree(top: str) -> dict[str, dict[str, str]]:
    root = Path("/sys/fs/cgroup") / top.lstrip("/")
    tree = {}
    for d in sorted([root, *(p for p in root.rglob("*") if p.is_dir())]):
        entry = {}
        for name in ("cgroup.procs", "memory.high", "memory.max", "memory.oom.group",
                     "memory.min", "memory.low", "memory.swap.max", "cgroup.subtree_control"):
            f = d / name
            if f.exists():
                entry[name] = f.read_text().strip().replace("\n", " ")
        tree["/" + str(d.relative_to("/sys/fs/cgroup"))] = entry
    return tree


def caps(pid: int) -> dict[str, str]:
    text = Path(f"/proc/{pid}/status").read_text()
    return dict(ln.split(":\t", 1) for ln in text.splitlines() if ln.startswith("Cap"))


def pressure_metrics() -> list[str]:
    return [ln for ln in client(10.0).metrics().splitlines()
            if ln.startswith("edge_agent_memory_pressure")]


def install() -> None:
    r = sh(sys.executable, "-m", "edge_agent", "systemd", "install")
    emit("install", rc=r.returncode, stderr=r.stderr)
    for step, cmd in (("sysusers", ["systemd-sysusers", "/etc/sysusers.d/edge-agent.conf"]),
                      ("tmpfiles", ["systemd-tmpfiles", "--create",
                                    "/etc/tmpfiles.d/edge-agent.conf"])):
        r = sh(*cmd)
        emit(step, cmd=cmd, rc=r.returncode, out=r.stdout + r.stderr)
    Path("/etc/edge-agent").mkdir(exist_ok=True)
    shutil.copy("/ea/config.toml", "/etc/edge-agent/config.toml")
    Path("/etc/edge-agent/cgroups").mkdir(exist_ok=True)
    shutil.copy("/ea/policy.toml", "/etc/edge-agent/cgroups/tiny-board.toml")
    share = Path("/usr/local/share/edge-agent")
    share.mkdir(parents=True, exist_ok=True)
    shutil.copy("/ea/tiny.gguf", share / "tiny.gguf")
    dropin = Path("/etc/systemd/system/edge-agent.service.d")
    dropin.mkdir(parents=True, exist_ok=True)
    shutil.copy("/ea/watchdog.conf", dropin / "watchdog.conf")
    r = sh("systemctl", "daemon-reload")
    emit("daemon-reload", rc=r.returncode, out=r.stdout + r.stderr)
    emit("unit", text=Path(f"/etc/systemd/system/{UNIT}").read_text())


def start() -> None:
    """`systemctl start --no-block`, then watch systemd's state and the daemon's /health."""
    t0 = uptime()
    r = sh("systemctl", "start", "--no-block", UNIT)
    seen: list[list[Any]] = []
    deadline = time.monotonic() + 240
    state: dict[str, str] = {}
    while time.monotonic() < deadline:
        state = show()
        code, status = health()
        obs = [state.get("ActiveState"), state.get("SubState"), code, status]
        if not seen or seen[-1][:4] != obs:
            seen.append([*obs, round(uptime() - t0, 2)])
        if state.get("ActiveState") in ("active", "failed"):
            break
        time.sleep(0.1)
    code, status = health()
    emit("start", rc=r.returncode, observed=seen, show=state, health_after=[code, status],
         seconds=round(uptime() - t0, 2))
    st = sh("systemctl", "status", "--no-pager", "--lines=0", UNIT)
    emit("status", rc=st.returncode, text=st.stdout)


def serve_and_cgroups() -> None:
    c = client(120.0)
    h = c.health()
    t0 = time.monotonic()
    reply = c.complete("Once upon a time", max_tokens=6)
    emit("completion", reply=reply, seconds=round(time.monotonic() - t0, 2))
    h = c.health()
    state = show()
    main = int(state["MainPID"])
    runners = {n: m.get("runner_pid") for n, m in h["models"].items()}
    svc = Path(f"/sys/fs/cgroup{state['ControlGroup']}")
    owners = {str(d.relative_to(svc)) or ".": os.stat(d / "memory.pressure").st_uid
              for d in (svc, svc / "supervisor", svc / "models")}
    log = sh("journalctl", "--no-pager", "-o", "cat", "-u", UNIT).stdout
    emit("cgroups", main_pid=main, main_cgroup=cgroup_of(main), control_group=state[
        "ControlGroup"], runners={n: [p, cgroup_of(p) if p else None] for n, p in runners.items()},
        health_cgroup=h.get("cgroup"), pressure=h.get("pressure"),
        mlock={n: m.get("mlock") for n, m in h["models"].items()},
        pressure_file_owners=owners, service_uid=os.stat(f"/proc/{main}").st_uid,
        kernel=os.uname().release, main_caps=caps(main),
        runner_caps={n: caps(p) for n, p in runners.items() if p},
        metrics=pressure_metrics(),
        pressure_log=[ln for ln in log.splitlines() if "memory pressure" in ln],
        tree=cgroup_tree(state["ControlGroup"]))


def serial_console() -> None:
    """The daemon (user edge-agent, SupplementaryGroups=dialout) holds ttyS2; typed into ttyS3,
    Enter gives the prompt and `status` answers."""
    import grp

    import serial

    main = int(show()["MainPID"])
    st = os.stat(UART)
    held = []
    for fd in Path(f"/proc/{main}/fd").iterdir():
        try:
            if os.readlink(fd) == UART:
                held.append(int(fd.name))
        except OSError:
            pass
    groups = next(ln.split(":", 1)[1].split() for ln in Path(f"/proc/{main}/status")
                  .read_text().splitlines() if ln.startswith("Groups:"))
    log = sh("journalctl", "--no-pager", "-o", "cat", "-u", UNIT).stdout
    transcript = bytearray()
    prompt = status = b""
    t0 = time.monotonic()
    with serial.Serial(UART_PEER, 115200, timeout=0.2) as port:

        def expect(needle: bytes, until: float) -> bytes:
            start = len(transcript)
            while needle not in transcript[start:] and time.monotonic() < until:
                transcript.extend(port.read(4096))
            return bytes(transcript[start:])

        deadline = time.monotonic() + 60
        while b"edge> " not in prompt and time.monotonic() < deadline:
            port.write(b"\r")
            prompt = expect(b"edge> ", min(deadline, time.monotonic() + 3))
        if b"edge> " in prompt:
            port.write(b"status\r")
            status = expect(b"edge> ", time.monotonic() + 60)
    emit("serial", device={"path": UART, "group": grp.getgrgid(st.st_gid).gr_name,
                           "mode": oct(st.st_mode & 0o777)},
         dialout_gid=grp.getgrnam("dialout").gr_gid, main_pid=main,
         main_uid=os.stat(f"/proc/{main}").st_uid, main_groups=[int(g) for g in groups],
         held_fds=held, serial_log=[ln for ln in log.splitlines() if "serial" in ln],
         prompt=prompt.decode("utf-8", "replace"), status=status.decode("utf-8", "replace"),
         seconds=round(time.monotonic() - t0, 2))


HOG = """
import time
end = time.monotonic() + 45
while time.monotonic() < end:
    x = b"x" * (48 << 20)
    del x
"""


def pressure_probe() -> None:
    """A hog in models/probe (memory.high 16M, no swap) stalls on reclaim and throttling; the
    stall reaches models/memory.pressure, where the daemon armed its trigger."""
    cg = Path("/sys/fs/cgroup") / show()["ControlGroup"].lstrip("/") / "models"
    probe = cg / "probe"
    probe.mkdir()
    (probe / "memory.max").write_text(str(128 << 20))
    (probe / "memory.high").write_text(str(16 << 20))
    (probe / "memory.swap.max").write_text("0")
    procs = str(probe / "cgroup.procs")

    def join() -> None:
        with open(procs, "w") as f:
            f.write("0")

    before = client(10.0).health()["pressure"]
    t0 = time.monotonic()
    hog = subprocess.Popen([sys.executable, "-c", HOG], preexec_fn=join)
    seen: dict[str, Any] = before
    try:
        while time.monotonic() - t0 < 60 and hog.poll() is None:
            seen = client(10.0).health()["pressure"]
            if seen["events"] > before["events"]:
                break
            time.sleep(0.25)
    finally:
        hog.kill()
        hog.wait(timeout=30)
    took = round(time.monotonic() - t0, 2)
    for _ in range(100):
        try:
            probe.rmdir()
            break
        except OSError:
            time.sleep(0.1)
    log = sh("journalctl", "--no-pager", "-o", "cat", "-u", UNIT).stdout
    emit("pressure_probe", before=before, after=seen, seconds=took, metrics=pressure_metrics(),
         models_pressure=(cg / "memory.pressure").read_text(), probe_removed=not probe.exists(),
         pressure_log=[ln for ln in log.splitlines() if "memory pressure" in ln][-10:])


def watchdog() -> None:
    before = show()
    pid = int(before["MainPID"])
    t0 = uptime()
    os.kill(pid, signal.SIGSTOP)
    seen = []
    after = before
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        after = show()
        obs = [after.get("ActiveState"), after.get("SubState"), after.get("MainPID")]
        if not seen or seen[-1][:3] != obs:
            seen.append([*obs, round(uptime() - t0, 2)])
        if (after.get("NRestarts") != before.get("NRestarts") and after.get("ActiveState")
                == "active" and after.get("MainPID") not in ("0", str(pid))):
            break
        time.sleep(0.2)
    code, status = health()
    log = sh("journalctl", "--no-pager", "-o", "cat", "-u", UNIT).stdout
    emit("watchdog", before=before, after=after, frozen_pid=pid, observed=seen,
         health_after=[code, status], seconds=round(uptime() - t0, 2),
         watchdog_lines=[ln for ln in log.splitlines() if "atchdog" in ln])


def stop_while_running() -> None:
    result: dict[str, Any] = {}

    def long_request() -> None:
        try:
            result["reply"] = client(120.0).complete("Tell me a long story", max_tokens=200)
        except Exception as exc:  # noqa: BLE001 - reported
            result["error"] = f"{type(exc).__name__}: {exc}"

    th = threading.Thread(target=long_request)
    th.start()
    running = False
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not running:
        try:
            running = any(m.get("active") for m in client(5.0).health()["models"].values())
        except Exception:  # noqa: BLE001 - not up yet
            pass
        time.sleep(0.05)
    t0 = uptime()
    r = sh("systemctl", "stop", UNIT, timeout=180)
    took = round(uptime() - t0, 2)
    th.join(timeout=120)
    log = sh("journalctl", "--no-pager", "-o", "cat", "-u", UNIT).stdout
    emit("stop", rc=r.returncode, seconds=took, request_was_running=running, request=result,
         show=show(), log_tail=log.splitlines()[-25:])


def main() -> int:
    r = sh("systemctl", "is-system-running", "--wait", timeout=120)
    emit("boot", state=r.stdout.strip(), uptime=uptime())
    install()
    start()
    if show().get("ActiveState") != "active":
        log = sh("journalctl", "--no-pager", "-o", "cat", "-u", UNIT).stdout
        emit("journal", text=log[-6000:])
        return 1
    serve_and_cgroups()
    try:
        serial_console()
    except Exception as exc:  # noqa: BLE001 - reported; the steps after it still run
        emit("serial", error=f"{type(exc).__name__}: {exc}")
    pressure_probe()
    watchdog()
    stop_while_running()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
