"""Kernel modules for a guest: the dependency closure of a few named modules, in load order.

Invariants: dependencies come from `depmod -b` run on the host over the unpacked kernel package
(works for a foreign architecture); a module built into the kernel (modules.builtin) is skipped;
the returned order loads every module after all of its dependencies, so busybox `insmod` suffices.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from .errors import HarnessError

__all__ = ["copy_modules", "module_closure"]


def _kernel_version(root: Path) -> str:
    versions = sorted(p.name for p in (root / "lib" / "modules").iterdir() if p.is_dir())
    if len(versions) != 1:
        raise HarnessError(f"{root}/lib/modules: expected one kernel version, found {versions}. "
                           "Hint: unpack exactly one linux-image package.")
    return versions[0]


def module_closure(root: Path, names: list[str]) -> tuple[str, list[str]]:
    """(kernel version, module paths relative to lib/modules/<ver>/) in load order."""
    version = _kernel_version(root)
    moddir = root / "lib" / "modules" / version
    depmod = shutil.which("depmod") or "/usr/sbin/depmod"
    p = subprocess.run([depmod, "-b", str(root), version], capture_output=True, text=True,
                       timeout=120)
    if p.returncode != 0:
        raise HarnessError(f"depmod -b {root} {version}: exited {p.returncode}: "
                           f"{p.stderr.strip()}. Hint: install the Debian package kmod.")
    deps: dict[str, list[str]] = {}
    for line in (moddir / "modules.dep").read_text().splitlines():
        mod, _, rest = line.partition(":")
        deps[mod] = rest.split()
    by_name = {Path(m).name.split(".ko")[0].replace("-", "_"): m for m in deps}
    builtin = {Path(m).name.split(".ko")[0].replace("-", "_")
               for m in (moddir / "modules.builtin").read_text().split()}
    order: list[str] = []

    def visit(mod: str) -> None:
        if mod in order:
            return
        # modules.dep lists the full closure, deepest dependency last.
        for dep in reversed(deps[mod]):
            visit(dep)
        order.append(mod)

    for name in names:
        key = name.replace("-", "_")
        if key in builtin:
            continue
        if key not in by_name:
            raise HarnessError(f"kernel {version}: no module {name!r}. Hint: check the name "
                               f"against {moddir}/modules.dep.")
        visit(by_name[key])
    return version, order


def copy_modules(src_root: Path, dest_root: Path, names: list[str]) -> list[str]:
    """Copy the closure of `names` into dest_root/lib/modules/<ver>/; return the load order as
    absolute guest paths."""
    version, order = module_closure(src_root, names)
    guest_paths = []
    for rel in order:
        src = src_root / "lib" / "modules" / version / rel
        dst = dest_root / "lib" / "modules" / version / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)
        guest_paths.append(f"/lib/modules/{version}/{rel}")
    return guest_paths
