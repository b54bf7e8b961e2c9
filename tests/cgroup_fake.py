"""A temporary directory laid out like a cgroup v2 tree, with a CgroupIO that follows the
kernel's rules for the files edge-agent writes, and can be told to fail like the kernel does.

Rules kept: interface files appear on mkdir (memory.* only when the parent's subtree_control has
+memory); writes never create files (ENOENT); memory limits take digits or "max", oom.group 0/1
(EINVAL otherwise); cgroup.procs moves a pid that exists (ESRCH otherwise) and refuses a group
with controllers enabled for children (EBUSY); subtree_control refuses a non-root group that
holds processes (EBUSY: no-internal-process rule) and controllers the group lacks (ENOENT);
rmdir refuses a group with processes or children (EBUSY). `fail[(rel, file)] = errno` makes one
operation fail with that errno; `log` records every successful write/mkdir/rmdir.
"""

from __future__ import annotations

import errno
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from edge_agent.cgroup.fs import CgroupIO, CgroupRoot

MEMORY_FILES = {"memory.current": "0", "memory.peak": "0", "memory.min": "0", "memory.low": "0",
                "memory.high": "max", "memory.max": "max", "memory.swap.max": "max",
                "memory.oom.group": "0",
                "memory.events": "low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\noom_group_kill 0\n"}


def _err(code: int, path: Path) -> OSError:
    return OSError(code, os.strerror(code), str(path))


class FakeKernel(CgroupIO):
    def __init__(self, mount: Path) -> None:
        self.mount = mount
        self.fail: dict[tuple[str, str | None], int] = {}
        self.readonly: set[str] = set()  # rel paths of groups this user may not write
        self.log: list[tuple[str, str, str | None, str | None]] = []
        self.swap_accounting = True

    # helpers
    def rel(self, path: Path) -> str:
        """Path relative to the mount ("" for the mount itself; absolute if outside it)."""
        path = Path(path)
        if path == self.mount:
            return ""
        try:
            return str(path.relative_to(self.mount))
        except ValueError:
            return str(path)

    def _check_fail(self, path: Path, name: str | None) -> None:
        d = path.parent if name else path
        key = (self.rel(d), name)
        if key in self.fail:
            raise _err(self.fail[key], path)

    def words(self, d: Path, name: str) -> list[str]:
        p = d / name
        return p.read_text().split() if p.exists() else []

    def populate(self, d: Path, *, root: bool = False) -> None:
        d.mkdir(parents=True, exist_ok=True)
        parent_sub = [] if root else self.words(d.parent, "cgroup.subtree_control")
        ctrls = ("cpu io memory pids" if root else " ".join(parent_sub))
        for name, value in {"cgroup.procs": "", "cgroup.controllers": ctrls,
                            "cgroup.subtree_control": "", "cgroup.kill": "",
                            "memory.pressure": "some avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
                            "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"}.items():
            if not (d / name).exists():
                (d / name).write_text(value)
        if "memory" in parent_sub:
            self._add_memory(d)

    def _add_memory(self, d: Path) -> None:
        for name, value in MEMORY_FILES.items():
            if name == "memory.swap.max" and not self.swap_accounting:
                continue
            if not (d / name).exists():
                (d / name).write_text(value)

    def all_pids(self) -> dict[int, Path]:
        out = {}
        for procs in self.mount.rglob("cgroup.procs"):
            for w in procs.read_text().split():
                out[int(w)] = procs.parent
        return out

    def add_pid(self, rel: str, pid: int) -> None:
        p = self.mount / rel / "cgroup.procs"
        p.write_text(p.read_text() + f"{pid}\n")

    # CgroupIO
    def read(self, path: Path) -> str:
        self._check_fail(path, path.name)
        return super().read(path)

    def writable(self, path: Path) -> bool:
        d = path if path.is_dir() else path.parent
        return self.rel(d) not in self.readonly

    def mkdir(self, path: Path) -> None:
        self._check_fail(path, None)
        os.mkdir(path)  # FileExistsError / FileNotFoundError like the kernel
        self.populate(path)
        self.log.append(("mkdir", self.rel(path), None, None))

    def rmdir(self, path: Path) -> None:
        self._check_fail(path, None)
        if not path.is_dir():
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(path))
        if self.words(path, "cgroup.procs") or any(e.is_dir() for e in path.iterdir()):
            raise _err(errno.EBUSY, path)
        shutil.rmtree(path)
        self.log.append(("rmdir", self.rel(path), None, None))

    def write(self, path: Path, value: str) -> None:
        self._check_fail(path, path.name)
        d, name, v = path.parent, path.name, value.strip()
        if not path.exists():
            raise _err(errno.ENOENT, path)
        if self.rel(d) in self.readonly:
            raise _err(errno.EACCES, path)
        if name == "cgroup.procs":
            if not v.isdigit():
                raise _err(errno.EINVAL, path)
            where = self.all_pids()
            if int(v) not in where:
                raise _err(errno.ESRCH, path)
            if self.words(d, "cgroup.subtree_control") and d != self.mount:
                raise _err(errno.EBUSY, path)
            old = where[int(v)] / "cgroup.procs"
            old.write_text("".join(f"{w}\n" for w in old.read_text().split() if w != v))
            self.add_pid(self.rel(d), int(v))
        elif name == "cgroup.subtree_control":
            enabled = self.words(d, name)
            for tok in v.split():
                ctrl = tok[1:]
                if tok[0] not in "+-" or ctrl not in self.words(d, "cgroup.controllers"):
                    raise _err(errno.ENOENT if tok[0] in "+-" else errno.EINVAL, path)
                if d != self.mount and self.words(d, "cgroup.procs"):
                    raise _err(errno.EBUSY, path)
                if tok[0] == "+" and ctrl not in enabled:
                    enabled.append(ctrl)
                elif tok[0] == "-" and ctrl in enabled:
                    enabled.remove(ctrl)
            path.write_text(" ".join(enabled) + "\n")
            for child in (e for e in d.iterdir() if e.is_dir()):
                (child / "cgroup.controllers").write_text(" ".join(enabled) + "\n")
                if "memory" in enabled:
                    self._add_memory(child)
        elif name in ("memory.min", "memory.low", "memory.high", "memory.max",
                      "memory.swap.max"):
            if not (v == "max" or v.isdigit()):
                raise _err(errno.EINVAL, path)
            path.write_text(v + "\n")
        elif name == "memory.oom.group":
            if v not in ("0", "1"):
                raise _err(errno.EINVAL, path)
            path.write_text(v + "\n")
        elif name == "cgroup.kill":
            (d / "cgroup.procs").write_text("")
        else:
            raise _err(errno.EACCES, path)
        self.log.append(("write", self.rel(d), name, v))


@dataclass
class Tree:
    root: CgroupRoot
    kernel: FakeKernel
    mount: Path
    proc: Path
    own: str

    def group(self, rel: str) -> Path:
        return self.mount / rel


def make_tree(tmp: Path, *, own: str = "system.slice/edge-agent.service",
              pids: tuple[int, ...] = (4242,), v1_memory: bool = False,
              mounted: bool = True, memory_in_kernel: bool = True, delegated: bool = True,
              cmdline: str = "console=ttyS0") -> Tree:
    mount, proc = tmp / "cg", tmp / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "pressure").mkdir()
    (proc / "pressure" / "memory").write_text(
        "some avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
        "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")
    (proc / "cmdline").write_text(cmdline + "\n")
    lines = ["22 1 259:1 / / rw,relatime shared:1 - ext4 /dev/root rw"]
    if mounted:
        lines.append(f"30 22 0:26 / {mount} rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 "
                     "cgroup2 rw,nsdelegate,memory_recursiveprot")
    (proc / "self" / "mountinfo").write_text("\n".join(lines) + "\n")
    cg = [f"0::/{own}"] if mounted else []
    if v1_memory:
        cg.insert(0, "4:memory:/")
    if not mounted:
        cg = ["12:memory:/user.slice", "1:name=systemd:/user.slice"]
    (proc / "self" / "cgroup").write_text("\n".join(cg) + "\n")
    kernel = FakeKernel(mount)
    kernel.populate(mount, root=True)
    if not memory_in_kernel:
        (mount / "cgroup.controllers").write_text("cpu io pids\n")
    # every inner node on the way enables what it has (as systemd does for a delegated unit)
    d = mount
    for part in Path(own).parts:
        ctrls = kernel.words(d, "cgroup.controllers")
        if not delegated and part == Path(own).parts[-1]:
            ctrls = [c for c in ctrls if c != "memory"]
        (d / "cgroup.subtree_control").write_text(" ".join(ctrls) + "\n")
        d = d / part
        kernel.populate(d)
    for pid in pids:
        kernel.add_pid(own, pid)
    return Tree(CgroupRoot(proc=proc, io=kernel), kernel, mount, proc, own)
