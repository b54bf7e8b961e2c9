"""`edge-agent doctor [--json]`: what this board needs, each finding with its fix.

Checks: cgroup v2 mounted, our memory subtree (memory controller, delegation), PSI, whether a
PSI trigger can be armed (doctor_psi.py), memory locking (RLIMIT_MEMLOCK / CAP_IPC_LOCK), swap,
systemd features, serial port access.
Each check is a pure function of what it reads, so tests feed it other machines' answers.
Exit 0 when nothing fails (warnings allowed), 1 when something is missing.
"""

from __future__ import annotations

import argparse
import glob
import grp
import json
import os
import re
import resource
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TextIO

from edge_agent.cgroup.fs import FIX_DELEGATE, FIX_UNIFIED, CgroupRoot, Detection, detect
from edge_agent.cgroup.psi import has_cap_sys_resource
from edge_agent.cgroup.values import Trigger
from edge_agent.commands import doctor_psi
from edge_agent.sizes import format_size

__all__ = ["register", "run", "Finding", "check_cgroup", "check_psi", "check_psi_trigger",
           "check_memlock",
           "check_swap", "check_systemd", "check_serial", "parse_systemd_version",
           "cap_ipc_lock", "gather", "SERIAL_GLOBS"]

OK, WARN, FAIL = "ok", "warn", "fail"
CAP_IPC_LOCK = 14
DEFAULT_PIN_BYTES = 538_060_032  # SmolLM2-135M's prepared f32 weights file, in bytes
SERIAL_GLOBS = ("/dev/ttyS[0-9]*", "/dev/ttyUSB*", "/dev/ttyACM*", "/dev/ttyAMA*")
FIX_MEMLOCK = ("run under the shipped unit (`LimitMEMLOCK=infinity`, "
               "`AmbientCapabilities=CAP_IPC_LOCK`), or raise the limit for this user in "
               "/etc/security/limits.d/edge-agent.conf (`USER - memlock unlimited`), or set "
               "runtime.mlock = \"best-effort\"")


@dataclass(frozen=True)
class Finding:
    check: str
    status: str  # ok | warn | fail
    detail: str
    fix: str = ""


def check_cgroup(d: Detection) -> list[Finding]:
    mounted = Finding("cgroup v2 mounted", OK if d.mount else FAIL,
                      f"cgroup2 at {d.mount}" if d.mount else d.reason,
                      "" if d.mount else FIX_UNIFIED)
    if d.available:
        sub = Finding("cgroup v2 memory subtree", OK,
                      f"{d.mount}/{d.base}: memory controller delegated, writable"
                      + (" (already set up)" if d.already_set_up else ""))
    else:
        sub = Finding("cgroup v2 memory subtree", FAIL, d.reason, d.fix)
    return [mounted] if not d.mount else [mounted, sub]


def check_psi(d: Detection) -> Finding:
    if d.psi == "enabled":
        return Finding("PSI (pressure stall information)", OK, d.psi_detail)
    from edge_agent.cgroup.fs import FIX_PSI

    return Finding("PSI (pressure stall information)", FAIL, d.psi_detail, FIX_PSI)


def check_psi_trigger(attempt: doctor_psi.TriggerAttempt, trigger: Trigger, release: str,
                      has_cap: bool, uid: int) -> Finding:
    return Finding(doctor_psi.CHECK, *doctor_psi.check_psi_trigger(attempt, trigger, release,
                                                                   has_cap, uid))


def _default_trigger() -> Trigger:
    from edge_agent.cgroup.policy import load_policy
    from edge_agent.errors import EdgeAgentError

    try:
        return load_policy().pressure.trigger
    except EdgeAgentError:
        return Trigger("some", 300_000, 2_000_000)


def cap_ipc_lock(status_text: str) -> bool:
    m = re.search(r"^CapEff:\s*([0-9a-fA-F]+)", status_text, re.M)
    return bool(m and int(m.group(1), 16) >> CAP_IPC_LOCK & 1)


def check_memlock(soft: int, hard: int, has_cap: bool,
                  need: int = DEFAULT_PIN_BYTES) -> Finding:
    def show(n: int) -> str:
        return "unlimited" if n == resource.RLIM_INFINITY else format_size(n)

    limits = f"RLIMIT_MEMLOCK soft {show(soft)}, hard {show(hard)}"
    if has_cap:
        return Finding("memory locking", OK, f"CAP_IPC_LOCK held ({limits} does not apply)")
    if soft == resource.RLIM_INFINITY or soft >= need:
        return Finding("memory locking", OK, f"{limits}: enough for {format_size(need)}")
    return Finding("memory locking", FAIL,
                   f"{limits} and no CAP_IPC_LOCK: pinning {need} bytes of weights would fail",
                   FIX_MEMLOCK)


def check_swap(swaps_text: str) -> Finding:
    rows = [ln.split() for ln in swaps_text.splitlines()[1:] if ln.strip()]
    if not rows:
        return Finding("swap", OK, "no swap: memory.max is a hard wall, pinned weights stay put")
    names = ", ".join(f"{r[0]} ({r[1]}, {int(r[2]) // 1024} MiB)" for r in rows if len(r) >= 3)
    return Finding("swap", WARN, f"swap active: {names}; unpinned memory of a runner could be "
                   "swapped, which stalls decoding",
                   "keep memory_swap_max = 0 in the cgroup policy (the shipped policies do), "
                   "or `swapoff -a` on a dedicated board")


def parse_systemd_version(text: str) -> int | None:
    m = re.match(r"\s*systemd\s+(\d+)", text)
    return int(m.group(1)) if m else None


def check_systemd(version_text: str | None) -> Finding:
    if version_text is None:
        return Finding("systemd", WARN, "systemctl not found: not a systemd host; no "
                       "Delegate=yes, so no cgroup subtree of our own", FIX_DELEGATE)
    v = parse_systemd_version(version_text)
    if v is None:
        return Finding("systemd", WARN, f"cannot parse `systemctl --version`: "
                       f"{version_text[:60]!r}")
    if v < 244:
        return Finding("systemd", FAIL, f"systemd {v}: too old for cgroup v2 delegation of "
                       "the memory controller as edge-agent uses it",
                       "upgrade to Debian 12 (systemd 252) or newer")
    if v < 254:
        return Finding("systemd", OK, f"systemd {v}: no DelegateSubgroup= (edge-agent makes its "
                       "own supervisor/ leaf) and no $MEMORY_PRESSURE_WATCH (edge-agent arms "
                       "its own PSI trigger); both need 254")
    return Finding("systemd", OK, f"systemd {v}: DelegateSubgroup= and MemoryPressureWatch= "
                   "available ($MEMORY_PRESSURE_WATCH is honoured)")


def check_serial(ports: Iterable[str], access: Callable[[str], bool],
                 in_dialout: bool | None) -> Finding:
    ports = sorted(ports)
    if not ports:
        return Finding("serial ports", WARN, "no /dev/ttyS*, ttyUSB*, ttyACM* or ttyAMA* device",
                       "plug in the USB-serial adapter, or enable the UART "
                       "(`dtparam=uart0` in /boot/firmware/config.txt on a Raspberry Pi 5)")
    usable = [p for p in ports if access(p)]
    group = {True: "in group dialout", False: "not in group dialout",
             None: "no dialout group"}[in_dialout]
    if usable:
        shown = ", ".join(usable[:6]) + (" ..." if len(usable) > 6 else "")
        return Finding("serial ports", OK, f"read/write access to {shown} ({group})")
    return Finding("serial ports", FAIL, f"no read/write access to {', '.join(ports[:6])} "
                   f"({group})", "`sudo usermod -aG dialout $USER` and log in again (the "
                   "shipped unit has SupplementaryGroups=dialout)")


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _dialout() -> bool | None:
    try:
        gid = grp.getgrnam("dialout").gr_gid
    except KeyError:
        return None
    return gid in os.getgroups() or gid == os.getgid()


def _systemctl_version() -> str | None:
    exe = shutil.which("systemctl")
    if exe is None:
        return None
    try:
        return subprocess.run([exe, "--version"], capture_output=True, text=True,
                              timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None


def gather(proc: Path = Path("/proc")) -> list[Finding]:
    d = detect(CgroupRoot(proc=proc))
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    ports = [p for g in SERIAL_GLOBS for p in glob.glob(g)]
    trigger = _default_trigger()
    status = _read(proc / "self" / "status")
    return [
        *check_cgroup(d),
        check_psi(d),
        check_psi_trigger(doctor_psi.try_trigger(d.pressure_file, trigger), trigger,
                          os.uname().release, has_cap_sys_resource(status), os.geteuid()),
        check_memlock(soft, hard, cap_ipc_lock(status)),
        check_swap(_read(proc / "swaps")),
        check_systemd(_systemctl_version()),
        check_serial(ports, lambda p: os.access(p, os.R_OK | os.W_OK), _dialout()),
    ]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("doctor", help="check what this board needs (exit 1 if missing)",
                            description="Check cgroup v2, delegation, the memory controller, "
                            "PSI and whether a PSI trigger can be armed, memory locking, swap, "
                            "systemd and serial ports; print each finding with its fix. Exit 0 "
                            "when nothing is missing, 1 otherwise.")
    parser.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    parser.add_argument("--proc-root", default="/proc", help=argparse.SUPPRESS)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    findings = gather(Path(args.proc_root))
    failed = any(f.status == FAIL for f in findings)
    if args.json:
        print(json.dumps({"ok": not failed, "findings": [asdict(f) for f in findings]},
                         indent=2), file=out)
    else:
        for f in findings:
            print(f"[{f.status:<4}] {f.check}: {f.detail}", file=out)
            if f.fix and f.status != OK:
                print(f"       fix: {f.fix}", file=out)
        print("edge-agent doctor: " + ("something is missing (see fix lines above)" if failed
                                        else "all required checks passed"), file=sys.stderr)
    return 1 if failed else 0
