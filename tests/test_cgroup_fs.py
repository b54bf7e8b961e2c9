"""Detection and file access: fake trees for every host shape, this machine read-only, and the
translation of real OSErrors into messages with hints."""

from __future__ import annotations

import errno
import json
import shutil
import subprocess
from pathlib import Path

import pytest
from cgroup_fake import make_tree

from edge_agent.cgroup.fs import (
    FIX_DELEGATE,
    FIX_MEMORY,
    FIX_PSI,
    FIX_UNIFIED,
    CgroupError,
    CgroupFS,
    detect,
    parse_mountinfo,
    parse_proc_cgroup,
    translate,
)


def test_parse_mountinfo_and_proc_cgroup() -> None:
    text = ("31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
            "41 31 0:38 /sub /mnt/with\\040space rw - cgroup2 cgroup2 rw,nsdelegate\n"
            "garbage line\n")
    mounts = parse_mountinfo(text)
    assert [(m.point, m.root, m.fstype) for m in mounts] == [
        (Path("/sys/fs/cgroup"), "/", "tmpfs"), (Path("/mnt/with space"), "/sub", "cgroup2")]
    assert mounts[1].super_options == ("rw", "nsdelegate")
    assert parse_proc_cgroup("0::/system.slice/x.service\n") == ("/system.slice/x.service", [])
    assert parse_proc_cgroup("4:memory:/a\n3:cpu,cpuacct:/\n1:name=systemd:/\n0::/\n") == (
        "/", ["memory", "cpu", "cpuacct"])
    assert parse_proc_cgroup("12:memory:/user.slice\n") == (None, ["memory"])


def test_available_delegated_subtree(tmp_path: Path) -> None:
    t = make_tree(tmp_path)
    d = detect(t.root)
    assert d.available, d.reason
    assert (d.mount, d.cgroup, d.base) == (t.mount, "/system.slice/edge-agent.service",
                                           "system.slice/edge-agent.service")
    assert "memory" in d.controllers and d.writable is True and not d.already_set_up
    assert d.psi == "enabled" and d.pressure_file == t.mount / t.own / "memory.pressure"
    assert json.loads(json.dumps(d.to_dict()))["available"] is True


@pytest.mark.parametrize("shape, reason, fix", [
    ({"mounted": False}, "cgroup v2 is not mounted", FIX_UNIFIED),
    ({"v1_memory": True}, "memory controller is bound to the cgroup v1 hierarchy", FIX_UNIFIED),
    ({"own": ""}, "runs in the root cgroup", FIX_DELEGATE),
    ({"memory_in_kernel": False}, "the kernel offers no memory controller to cgroup v2",
     FIX_MEMORY),
    ({"memory_in_kernel": False, "cmdline": "console=tty1 cgroup_disable=memory"},
     "(booted with cgroup_disable=memory)", FIX_MEMORY),
    ({"delegated": False}, "the memory controller is not delegated to our cgroup", FIX_DELEGATE),
])
def test_each_missing_piece_is_named_with_its_fix(tmp_path: Path, shape: dict, reason: str,
                                                  fix: str) -> None:
    d = detect(make_tree(tmp_path, **shape).root)
    assert not d.available
    assert reason in d.reason and d.fix == fix


def test_not_writable_means_not_delegated(tmp_path: Path) -> None:
    t = make_tree(tmp_path)
    t.kernel.readonly.add(t.own)
    d = detect(t.root)
    assert not d.available and d.writable is False
    assert "is not delegated to this user" in d.reason and d.fix == FIX_DELEGATE
    assert "Delegate=yes" in FIX_DELEGATE and "cgroup_enable=memory" in FIX_MEMORY
    assert "systemd.unified_cgroup_hierarchy=1" in FIX_UNIFIED and "psi=1" in FIX_PSI


def test_restart_inside_supervisor_finds_the_unit_group(tmp_path: Path) -> None:
    own = "system.slice/edge-agent.service/supervisor"
    t = make_tree(tmp_path, own=own)
    d = detect(t.root)
    assert d.available and d.already_set_up and d.base == "system.slice/edge-agent.service"


def test_psi_disabled_and_missing(tmp_path: Path) -> None:
    t = make_tree(tmp_path)
    t.kernel.fail[(t.own, "memory.pressure")] = errno.EOPNOTSUPP
    d = detect(t.root)
    assert d.available and d.psi == "disabled"
    assert "EOPNOTSUPP" in d.psi_detail and "psi=1 missing" in d.psi_detail
    del t.kernel.fail[(t.own, "memory.pressure")]
    (t.mount / t.own / "memory.pressure").unlink()
    (t.proc / "pressure" / "memory").unlink()
    d = detect(t.root)
    assert d.psi == "missing" and "memory.pressure" in d.psi_detail


def test_paths_cannot_leave_the_mount(tmp_path: Path) -> None:
    fs = CgroupFS(tmp_path)
    assert fs.path("a/b", "memory.max") == tmp_path / "a" / "b" / "memory.max"
    for bad in ("../etc", "a/../../b"):
        with pytest.raises(CgroupError, match="leaves the cgroup mount"):
            fs.path(bad)


@pytest.mark.parametrize("code, action, name, value, needles", [
    (errno.EACCES, "write", "cgroup.procs", "12", ["Permission denied (EACCES)", "Delegate=yes"]),
    (errno.EBUSY, "write", "cgroup.subtree_control", "+memory",
     ["(EBUSY)", "no-internal-process rule", "supervisor/"]),
    (errno.EBUSY, "rmdir", "", None, ["(EBUSY)", "stop its runner first"]),
    (errno.EINVAL, "write", "memory.max", "abc", ["Invalid argument (EINVAL)", "cgroups/*.toml"]),
    (errno.ENOENT, "write", "memory.high", "1", ["(ENOENT)", "+memory` must be in the parent"]),
    (errno.ESRCH, "write", "cgroup.procs", "999999", ["(ESRCH)", "already exited"]),
    (errno.EOPNOTSUPP, "read", "memory.pressure", None, ["(EOPNOTSUPP)", "psi=1"]),
])
def test_oserrors_become_messages_with_hints(tmp_path: Path, code: int, action: str, name: str,
                                             value: str | None, needles: list[str]) -> None:
    path = tmp_path / "grp" / name if name else tmp_path / "grp"
    err = translate(OSError(code, "x"), action, path, value)
    msg = str(err)
    assert msg.startswith(f"{action} {path}" + (f" <- {value!r}" if value else ""))
    assert err.errno == code and "Hint:" in msg
    for n in needles:
        assert n in msg


def test_errors_raised_through_the_seam_are_translated(tmp_path: Path) -> None:
    t = make_tree(tmp_path)
    fs = CgroupFS(t.mount, t.kernel)
    t.kernel.fail[(t.own, "cgroup.subtree_control")] = errno.EBUSY
    with pytest.raises(CgroupError) as e:
        fs.write(t.own, "cgroup.subtree_control", "+memory")
    assert e.value.errno == errno.EBUSY and "no-internal-process" in str(e.value)
    with pytest.raises(CgroupError, match=r"write .*/memory.max <- 'abc'.*EINVAL"):
        fs.write(t.own, "memory.max", "abc")
    # a child of a group without +memory in subtree_control has no memory files (ENOENT)
    assert fs.mkdir(f"{t.own}/x") is True and fs.mkdir(f"{t.own}/x") is False
    with pytest.raises(CgroupError, match=r"memory.max <- '1'.*ENOENT.*`\+memory` must be"):
        fs.write(f"{t.own}/x", "memory.max", "1")
    assert fs.read_optional(t.own, "no.such.file") is None
    assert fs.pids(t.own) == [4242]


# ----- this machine, read-only ----------------------------------------------------------------


def test_detection_on_this_host_is_consistent() -> None:
    d = detect()
    info = json.loads(json.dumps(d.to_dict()))
    assert isinstance(info["available"], bool)
    if not d.available:
        assert d.reason and d.fix
    findmnt = shutil.which("findmnt")
    if findmnt:  # oracle: util-linux's view of the cgroup2 mount
        out = subprocess.run([findmnt, "-n", "-t", "cgroup2", "-o", "TARGET"],
                             capture_output=True, text=True).stdout.split()
        assert (str(d.mount) if d.mount else None) == (out[0] if out else None)
    if d.mount is not None:
        assert (d.mount / "cgroup.controllers").is_file()
    if d.available:
        assert d.base and (d.mount / d.base / "cgroup.procs").is_file()
        assert "memory" in d.controllers
    pressure = Path("/proc/pressure/memory")
    if pressure.exists():
        assert d.psi in ("enabled", "disabled")
