"""`edge-agent doctor`: each check on other machines' answers, and the whole run on this host."""

from __future__ import annotations

import errno
import json
import resource
from pathlib import Path

import pytest
from cgroup_fake import make_tree

from edge_agent.cgroup.fs import detect
from edge_agent.cgroup.values import Trigger
from edge_agent.cli import main
from edge_agent.commands.doctor import (
    FAIL,
    OK,
    WARN,
    cap_ipc_lock,
    check_cgroup,
    check_memlock,
    check_psi,
    check_psi_trigger,
    check_serial,
    check_swap,
    check_systemd,
    parse_systemd_version,
)
from edge_agent.commands.doctor_psi import TriggerAttempt, try_trigger

INF = resource.RLIM_INFINITY


def test_cgroup_and_psi_checks(tmp_path: Path) -> None:
    good = detect(make_tree(tmp_path / "a").root)
    assert [f.status for f in check_cgroup(good)] == [OK, OK]
    assert check_psi(good).status == OK
    pi = detect(make_tree(tmp_path / "b", memory_in_kernel=False,
                          cmdline="console=serial0 cgroup_disable=memory").root)
    found = check_cgroup(pi)
    assert [f.status for f in found] == [OK, FAIL]
    assert "cgroup_disable=memory" in found[1].detail
    assert "cgroup_enable=memory" in found[1].fix and "/boot/firmware/cmdline.txt" in found[1].fix
    v1 = detect(make_tree(tmp_path / "c", mounted=False).root)
    assert [(f.check, f.status) for f in check_cgroup(v1)] == [("cgroup v2 mounted", FAIL)]
    t = make_tree(tmp_path / "d")
    (t.proc / "pressure" / "memory").unlink()
    (t.mount / t.own / "memory.pressure").unlink()
    psi = check_psi(detect(t.root))
    assert psi.status == FAIL and "psi=1" in psi.fix


def test_cap_ipc_lock_bit() -> None:
    assert cap_ipc_lock("Name:\tx\nCapEff:\t0000000000004000\n")
    assert not cap_ipc_lock("CapEff:\t0000000000003fff\n")
    assert not cap_ipc_lock("")


def test_memlock() -> None:
    assert check_memlock(8 << 20, 8 << 20, True).status == OK
    assert check_memlock(INF, INF, False).status == OK
    assert "unlimited" in check_memlock(INF, INF, False).detail
    f = check_memlock(8 << 20, 8 << 20, False, need=538_060_032)
    assert f.status == FAIL and "RLIMIT_MEMLOCK soft 8M, hard 8M and no CAP_IPC_LOCK" in f.detail
    assert "LimitMEMLOCK=infinity" in f.fix and "best-effort" in f.fix
    assert check_memlock(1 << 30, 1 << 30, False, need=1 << 29).status == OK


def test_swap() -> None:
    header = "Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority\n"
    assert check_swap(header).status == OK
    f = check_swap(header + "/dev/zram0  partition\t1048572\t0\t100\n")
    assert f.status == WARN and "/dev/zram0 (partition, 1023 MiB)" in f.detail
    assert "memory_swap_max = 0" in f.fix


def test_systemd_versions() -> None:
    assert parse_systemd_version("systemd 252 (252.38-1~deb12u1)\n+PAM") == 252
    assert parse_systemd_version("nonsense") is None
    f252 = check_systemd("systemd 252 (252.38-1~deb12u1)\n")
    assert f252.status == OK and "no DelegateSubgroup=" in f252.detail
    f256 = check_systemd("systemd 256 (256.5)\n")
    assert f256.status == OK and "$MEMORY_PRESSURE_WATCH is honoured" in f256.detail
    assert check_systemd("systemd 241\n").status == FAIL
    assert check_systemd(None).status == WARN and "Delegate=yes" in check_systemd(None).fix
    assert check_systemd("weird").status == WARN


def test_serial() -> None:
    assert check_serial([], lambda p: True, True).status == WARN
    ok = check_serial(["/dev/ttyUSB0", "/dev/ttyS0"], lambda p: p == "/dev/ttyUSB0", True)
    assert ok.status == OK and "/dev/ttyUSB0 (in group dialout)" in ok.detail
    bad = check_serial(["/dev/ttyAMA0"], lambda p: False, False)
    assert bad.status == FAIL and "not in group dialout" in bad.detail
    assert "usermod -aG dialout" in bad.fix


def test_doctor_on_this_host(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["doctor", "--json"])
    doc = json.loads(capsys.readouterr().out)
    checks = [f["check"] for f in doc["findings"]]
    for name in ("cgroup v2 mounted", "PSI (pressure stall information)", "PSI trigger",
                 "memory locking",
                 "swap", "systemd", "serial ports"):
        assert name in checks
    failed = [f for f in doc["findings"] if f["status"] == FAIL]
    assert code == (1 if failed else 0) and doc["ok"] is (not failed)
    assert all(f["fix"] for f in failed)
    code2 = main(["doctor"])
    out, err = capsys.readouterr()
    assert code2 == code
    assert out.count("\n") >= len(doc["findings"]) and out.startswith("[")
    assert ("something is missing" if failed else "all required checks passed") in err


def test_doctor_on_a_good_tree(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    t = make_tree(tmp_path)
    main(["doctor", "--json", "--proc-root", str(t.proc)])
    doc = json.loads(capsys.readouterr().out)
    by = {f["check"]: f for f in doc["findings"]}
    assert by["cgroup v2 memory subtree"]["status"] == OK
    assert by["PSI (pressure stall information)"]["status"] == OK


TRIG = Trigger("some", 300_000, 2_000_000)


def test_psi_trigger_check_on_other_machines_answers(tmp_path: Path) -> None:
    f = tmp_path / "memory.pressure"
    armed = check_psi_trigger(TriggerAttempt(f, 0), TRIG, "6.1.0-28-arm64", True, 998)
    assert armed.status == OK and armed.check == "PSI trigger"
    assert armed.detail == (f"armed (and closed) a `some 300000 2000000` trigger on {f} (kernel "
                            "6.1.0-28-arm64, CAP_SYS_RESOURCE held, uid 998)")
    # Debian 12 under a unit without the capability: root-owned file, kernel 6.1
    deb = check_psi_trigger(TriggerAttempt(f, errno.EACCES, owner=0), TRIG, "6.1.0-28-arm64",
                            False, 998)
    assert deb.status == WARN and deb.detail.startswith(
        f"cannot arm `some 300000 2000000` on {f}: EACCES (kernel 6.1.0-28-arm64, "
        "CAP_SYS_RESOURCE not held, uid 998): the file is owned by uid 0")
    assert "Linux < 6.5 needs CAP_SYS_RESOURCE" in deb.detail
    assert deb.detail.endswith("The daemon falls back to polling avg10 every 2 s")
    assert "CapabilityBoundingSet= and AmbientCapabilities=" in deb.fix
    assert "kernel >= 6.5" in deb.fix and "multiple of 2 s" in deb.fix
    # a newer kernel without the capability and a 1 s window
    one = check_psi_trigger(TriggerAttempt(f, errno.EINVAL), Trigger("some", 100_000, 1_000_000),
                            "6.8.0", False, 998)
    assert one.status == WARN and "1000000 us is not" in one.detail
    assert "owned by" not in one.detail and "< 6.5" not in one.detail
    none = check_psi_trigger(TriggerAttempt(None, errno.ENOENT), TRIG, "6.8.0", False, 0)
    assert none.status == WARN and "psi=1" in none.fix


def test_psi_trigger_tried_on_real_kernel_files() -> None:
    psi = Path("/proc/pressure/memory")
    if not psi.exists():
        pytest.skip(f"SKIPPED LOUDLY: {psi} does not exist: kernel without PSI")
    a = try_trigger(psi, TRIG)
    if a.err in (errno.EPERM, errno.EACCES):
        pytest.skip(f"SKIPPED LOUDLY: this process cannot arm a trigger on {psi} "
                    f"({errno.errorcode[a.err]}): kernel < 6.5 without CAP_SYS_RESOURCE")
    assert (a.err, a.path) == (0, psi)
    refused = try_trigger(Path("/sys/devices/system/cpu/online"), TRIG)  # kernfs, read-only
    assert refused.err == errno.EACCES and refused.owner == 0
    assert try_trigger(None, TRIG).err == errno.ENOENT
