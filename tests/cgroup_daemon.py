"""Run `edge-agent` with every cgroup file access going through the fake kernel of
cgroup_fake.py, over a tree made by `make_tree` (a test launcher, not a test module).

    python tests/cgroup_daemon.py MOUNT OWN_GROUP -- serve --config CONFIG

The config's `cgroup.proc_root` points detection at the tree's fake /proc. On top of
FakeKernel's rules, processes come and go as with the kernel: this process starts in OWN_GROUP
(as systemd starts a unit's main process), a process spawned later (a runner) is born in its
parent's group, and a process that exited disappears from cgroup.procs.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cgroup_fake import FakeKernel  # noqa: E402


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def parent_of(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


class LiveKernel(FakeKernel):
    def _prune(self, procs: Path) -> None:
        words = procs.read_text().split()
        live = [w for w in words if alive(int(w))]
        if live != words:
            procs.write_text("".join(f"{w}\n" for w in live))

    def read(self, path: Path) -> str:
        if path.name == "cgroup.procs" and path.exists():
            self._prune(path)
        return super().read(path)

    def rmdir(self, path: Path) -> None:
        if (path / "cgroup.procs").exists():
            self._prune(path / "cgroup.procs")
        super().rmdir(path)

    def write(self, path: Path, value: str) -> None:
        v = value.strip()
        if path.name == "cgroup.procs" and v.isdigit() and int(v) not in self.all_pids():
            born_in = self.all_pids().get(parent_of(int(v)))
            if born_in is not None and alive(int(v)):
                self.add_pid(self.rel(born_in), int(v))
        super().write(path, value)


def main(argv: list[str]) -> int:
    mount, own, sep, *rest = argv
    if sep != "--":
        raise SystemExit("usage: cgroup_daemon.py MOUNT OWN_GROUP -- ARGS...")
    kernel = LiveKernel(Path(mount))
    kernel.add_pid(own, os.getpid())
    import edge_agent.daemon.app as app
    from edge_agent.cli import main as cli_main

    class FakeKernelDaemon(app.Daemon):
        """The daemon `serve` builds, with every cgroup file access through the fake kernel."""

        def __init__(self, config: Any, **kw: Any) -> None:
            super().__init__(config, cgroup_io=lambda: kernel, **kw)

    # `serve` looks the class up when it runs; this launcher process is the test's composition
    app.Daemon = FakeKernelDaemon  # type: ignore[misc]  # replacing a class on purpose, here only

    return cli_main(rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
