"""`edge-agent doctor`: each check on other machines' answers, and the whole run on this host."""

from __future__ import annotations

import json
import resource
from pathlib import Path

import pytest
from cgroup_fake import make_tree

from edge_agent.cgroup.fs import detect
from edge_agent.cli import main
from edge_agent.commands.doctor import (
    FAIL,
    OK,
    WARN,
    cap_ipc_lock,
    check_cgroup,
    check_memlock,
    check_psi,
    check_serial,
    check_swap,
    check_systemd,
    parse_systemd_version,
)

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
    for name in ("cgroup v2 mounted", "PSI (pressure stall information)", "memory locking",
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
