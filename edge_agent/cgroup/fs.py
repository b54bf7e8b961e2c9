"""cgroup v2 file access and detection: where the hierarchy is, which cgroup is ours, whether
it is delegated to us.

Invariants owned here:
- Every file access goes through one `CgroupIO` seam (read, write, mkdir, rmdir, pids). The
  default `KernelIO` talks to the real files; tests substitute a temporary tree that follows
  (and can break) the kernel's rules. Nothing else in edge_agent.cgroup touches cgroup files.
- Every path is resolved under the cgroup2 mount: `CgroupFS.path(rel)` refuses names that would
  leave it (absolute parts, `..`).
- Writes never create files (no O_CREAT): a missing interface file means a controller is not
  enabled, and that is an error with a hint, not a new file.
- OSErrors become `CgroupError` with the action, the file, the value, what the kernel said and a
  `Hint:` chosen from the errno (EACCES/EPERM, EBUSY, EINVAL, ENOENT, ESRCH, EOPNOTSUPP).
- `detect()` never raises for a host that lacks something: it returns `Detection(available=False,
  reason=..., fix=...)` naming exactly what is missing and how to fix it.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edge_agent.errors import EdgeAgentError

__all__ = [
    "CgroupError",
    "CgroupIO",
    "KernelIO",
    "CgroupFS",
    "CgroupRoot",
    "Detection",
    "detect",
    "translate",
    "errno_name",
    "parse_mountinfo",
    "parse_proc_cgroup",
    "SUPERVISOR",
    "MODELS",
    "FIX_UNIFIED",
    "FIX_MEMORY",
    "FIX_DELEGATE",
    "FIX_PSI",
]

SUPERVISOR = "supervisor"
MODELS = "models"

FIX_UNIFIED = (
    "boot with the unified hierarchy: add `systemd.unified_cgroup_hierarchy=1 cgroup_no_v1=all` "
    "to the kernel command line (/boot/firmware/cmdline.txt on Raspberry Pi OS, "
    "GRUB_CMDLINE_LINUX in /etc/default/grub then `update-grub`) and reboot"
)
FIX_MEMORY = (
    "enable the memory controller: add `cgroup_enable=memory` to the kernel command line "
    "(on Raspberry Pi OS append it to the single line in /boot/firmware/cmdline.txt) and reboot"
)
FIX_DELEGATE = (
    "run edge-agent under systemd with `Delegate=yes` (the shipped edge-agent.service has it; "
    "`edge-agent systemd install`), or for a test `systemd-run --scope -p Delegate=yes "
    "edge-agent serve`"
)
FIX_PSI = (
    "enable pressure stall information: add `psi=1` to the kernel command line "
    "(/boot/firmware/cmdline.txt on Raspberry Pi OS) and reboot; if the files are still "
    "missing the kernel was built without CONFIG_PSI=y"
)


class CgroupError(EdgeAgentError):
    """A cgroup file operation failed; `errno` is the kernel's answer (None when not an OSError)."""

    def __init__(self, message: str, *, err: int | None = None, path: Path | None = None) -> None:
        super().__init__(message)
        self.errno = err
        self.path = path


# ----- the I/O seam ---------------------------------------------------------------------------


class CgroupIO:
    """Real cgroup files. Subclass it to point tests at a temporary tree."""

    def read(self, path: Path) -> str:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read()

    def write(self, path: Path, value: str) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC)
        try:
            os.write(fd, value.encode("ascii"))
        finally:
            os.close(fd)

    def mkdir(self, path: Path) -> None:
        os.mkdir(path)

    def rmdir(self, path: Path) -> None:
        os.rmdir(path)

    def writable(self, path: Path) -> bool:
        return os.access(path, os.W_OK)


KernelIO = CgroupIO


def _hint(action: str, path: Path, err: int) -> str:
    name = path.name
    if err in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"this user (uid {os.getuid()}) may not change it; {FIX_DELEGATE}."
    if err == errno.EBUSY and name == "cgroup.subtree_control":
        return ("the cgroup still holds processes (the kernel's no-internal-process rule): move "
                f"them into a leaf such as {SUPERVISOR}/ first.")
    if err == errno.EBUSY and action == "rmdir":
        return "the cgroup still holds processes or child groups: stop its runner first."
    if err == errno.EINVAL:
        return "the kernel rejected the value; check the policy file (cgroups/*.toml)."
    if err == errno.ENOENT and name.startswith("memory."):
        return ("the memory controller is not enabled for this group: `+memory` must be in the "
                "parent's cgroup.subtree_control (`edge-agent doctor` explains why not).")
    if err == errno.ENOENT:
        return "the cgroup is gone (removed, or its last process exited); re-run setup."
    if err == errno.ESRCH:
        return "the process has already exited."
    if err == errno.EOPNOTSUPP and name.endswith(".pressure"):
        return FIX_PSI + "."
    if err == errno.EOPNOTSUPP:
        return ("the cgroup is threaded or the controller cannot be used here; "
                "see `edge-agent doctor`.")
    return "see `edge-agent doctor`."


def errno_name(err: int) -> str:
    """EOPNOTSUPP rather than Linux's alias ENOTSUP: the name the kernel documentation uses."""
    return "EOPNOTSUPP" if err == errno.EOPNOTSUPP else errno.errorcode.get(err, str(err))


def translate(exc: OSError, action: str, path: Path, value: str | None = None) -> CgroupError:
    """An OSError from a cgroup file as a CgroupError naming action, file, value and a hint."""
    err = exc.errno or 0
    what = f"{action} {path}" + (f" <- {value!r}" if value is not None else "")
    said = os.strerror(err) if err else str(exc)
    code = errno_name(err)
    return CgroupError(f"{what}: {said} ({code}). Hint: {_hint(action, path, err)}",
                       err=err, path=path)


# ----- proc parsing (pure) --------------------------------------------------------------------


@dataclass(frozen=True)
class Mount:
    point: Path
    root: str  # the mounted subtree ("/" unless bind-mounted or namespaced)
    fstype: str
    super_options: tuple[str, ...]


def parse_mountinfo(text: str) -> list[Mount]:
    """Mounts from /proc/self/mountinfo (octal escapes such as \\040 decoded)."""
    mounts = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 2:
            continue

        def unescape(s: str) -> str:
            return s.encode().decode("unicode_escape") if "\\" in s else s

        opts = tuple(tail[2].split(",")) if len(tail) > 2 else ()
        mounts.append(Mount(Path(unescape(fields[4])), unescape(fields[3]), tail[0], opts))
    return mounts


def parse_proc_cgroup(text: str) -> tuple[str | None, list[str]]:
    """(the `0::` path or None, v1 controllers bound on this process's hierarchies)."""
    unified: str | None = None
    v1: list[str] = []
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hid, ctrls, path = parts
        if hid == "0" and ctrls == "":
            unified = path.strip()
        elif ctrls:
            v1.extend(c for c in ctrls.split(",") if c and not c.startswith("name="))
    return unified, v1


# ----- the file system under the cgroup2 mount ------------------------------------------------


class CgroupFS:
    """Reads and writes under one cgroup2 mount through a CgroupIO, translating errors."""

    def __init__(self, mount: Path, io: CgroupIO | None = None) -> None:
        self.mount = Path(mount)
        self.io = io or CgroupIO()

    def path(self, rel: str | Path, name: str | None = None) -> Path:
        parts = [p for p in Path(str(rel)).parts if p not in ("/", "")]
        if name is not None:
            parts.append(name)
        if any(p in (".", "..") or "/" in p for p in parts):
            raise CgroupError(f"cgroup path {str(rel)!r} {name or ''}: leaves the cgroup mount "
                              f"{self.mount}. Hint: use plain names.")
        return self.mount.joinpath(*parts)

    def read(self, rel: str | Path, name: str) -> str:
        p = self.path(rel, name)
        try:
            return self.io.read(p)
        except OSError as exc:
            raise translate(exc, "read", p) from exc

    def read_optional(self, rel: str | Path, name: str) -> str | None:
        try:
            return self.read(rel, name)
        except CgroupError:
            return None

    def write(self, rel: str | Path, name: str, value: str) -> None:
        p = self.path(rel, name)
        try:
            self.io.write(p, value)
        except OSError as exc:
            raise translate(exc, "write", p, value) from exc

    def mkdir(self, rel: str | Path) -> bool:
        """Create the group; False when it already existed."""
        p = self.path(rel)
        try:
            self.io.mkdir(p)
        except FileExistsError:
            return False
        except OSError as exc:
            raise translate(exc, "mkdir", p) from exc
        return True

    def rmdir(self, rel: str | Path) -> bool:
        """Remove the group; False when it did not exist."""
        p = self.path(rel)
        try:
            self.io.rmdir(p)
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise translate(exc, "rmdir", p) from exc
        return True

    def exists(self, rel: str | Path) -> bool:
        return self.path(rel).is_dir()

    def children(self, rel: str | Path) -> list[str]:
        p = self.path(rel)
        try:
            return sorted(e.name for e in os.scandir(p) if e.is_dir(follow_symlinks=False))
        except FileNotFoundError:
            return []

    def words(self, rel: str | Path, name: str) -> list[str]:
        text = self.read_optional(rel, name)
        return text.split() if text else []

    def pids(self, rel: str | Path) -> list[int]:
        return [int(w) for w in self.words(rel, "cgroup.procs") if w.isdigit()]

    def writable(self, rel: str | Path) -> bool:
        d = self.path(rel)
        return all(self.io.writable(p) for p in
                   (d, d / "cgroup.procs", d / "cgroup.subtree_control"))


# ----- detection ------------------------------------------------------------------------------


@dataclass(frozen=True)
class CgroupRoot:
    """The seam for detection: where /proc is and how cgroup files are accessed."""

    proc: Path = Path("/proc")
    io: CgroupIO = field(default_factory=CgroupIO)


@dataclass(frozen=True)
class Detection:
    available: bool
    reason: str  # "" when available
    fix: str  # "" when available
    mount: Path | None = None
    cgroup: str | None = None  # our cgroup as /proc/self/cgroup names it
    base: str | None = None  # the delegated group we manage, relative to the mount
    controllers: tuple[str, ...] = ()
    subtree_control: tuple[str, ...] = ()
    writable: bool | None = None  # None: not checked
    already_set_up: bool = False
    psi: str = "unknown"  # "enabled" | "disabled" | "missing" | "unknown"
    psi_detail: str = ""
    pressure_file: Path | None = None

    def fs(self, io: CgroupIO | None = None) -> CgroupFS:
        if self.mount is None:
            raise CgroupError(f"cgroup v2: not available ({self.reason}). Hint: {self.fix}.")
        return CgroupFS(self.mount, io)

    def to_dict(self) -> dict[str, Any]:
        return {
            "available": self.available, "reason": self.reason or None, "fix": self.fix or None,
            "mount": str(self.mount) if self.mount else None, "cgroup": self.cgroup,
            "base": self.base, "controllers": list(self.controllers),
            "subtree_control": list(self.subtree_control), "writable": self.writable,
            "already_set_up": self.already_set_up,
            "psi": self.psi, "psi_detail": self.psi_detail or None,
            "pressure_file": str(self.pressure_file) if self.pressure_file else None,
        }


def _psi(io: CgroupIO, candidates: list[Path]) -> tuple[str, str, Path | None]:
    missing = []
    for p in candidates:
        try:
            io.read(p)
        except FileNotFoundError:
            missing.append(str(p))
            continue
        except OSError as exc:
            if exc.errno == errno.EOPNOTSUPP:
                return ("disabled", f"reading {p} failed with EOPNOTSUPP: PSI is compiled in but "
                        "disabled at boot (psi=1 missing from the kernel command line)", p)
            return "unknown", f"reading {p} failed: {exc.strerror}", p
        return "enabled", f"{p} is readable", p
    return "missing", f"no PSI files ({', '.join(missing)} do not exist)", None


def detect(root: CgroupRoot | None = None) -> Detection:
    """Find the cgroup2 mount, our cgroup and whether we may manage a subtree of it."""
    root = root or CgroupRoot()
    io = root.io

    def text(name: str) -> str:
        try:
            return io.read(root.proc / name)
        except OSError:
            return ""

    mounts = parse_mountinfo(text("self/mountinfo"))
    unified, v1 = parse_proc_cgroup(text("self/cgroup"))
    v2 = next((m for m in mounts if m.fstype == "cgroup2"), None)
    psi, psi_detail, pfile = _psi(io, [root.proc / "pressure" / "memory"])

    def missing(reason: str, fix: str, **kw: Any) -> Detection:
        return Detection(False, reason, fix, psi=psi, psi_detail=psi_detail, pressure_file=pfile,
                         **kw)

    if v2 is None:
        return missing("cgroup v2 is not mounted (no cgroup2 line in /proc/self/mountinfo: a "
                       "cgroup v1 host)", FIX_UNIFIED)
    if unified is None:
        return missing("this process has no cgroup v2 membership (no `0::` line in "
                       "/proc/self/cgroup)", FIX_UNIFIED, mount=v2.point)
    if "memory" in v1:
        return missing(f"the memory controller is bound to the cgroup v1 hierarchy (hybrid "
                       f"mode; cgroup v2 at {v2.point} cannot use it)", FIX_UNIFIED,
                       mount=v2.point, cgroup=unified)
    rel = unified
    if v2.root not in ("/", "") and rel.startswith(v2.root):
        rel = rel[len(v2.root):] or "/"
    rel = rel.strip("/")
    fs = CgroupFS(v2.point, io)
    top_controllers = fs.words("", "cgroup.controllers")
    already = False
    if rel and Path(rel).name == SUPERVISOR:
        parent = str(Path(rel).parent).strip(".").strip("/")
        ours = "memory" in fs.words(parent, "cgroup.subtree_control") if parent else False
        if parent and ours and not fs.pids(parent):
            rel, already = parent, True
    common: dict[str, Any] = {"mount": v2.point, "cgroup": unified, "base": rel or "/"}
    cand = [fs.path(rel, "memory.pressure"), root.proc / "pressure" / "memory"]
    psi, psi_detail, pfile = _psi(io, cand)
    if not rel:
        return missing("this process runs in the root cgroup; edge-agent manages only a "
                       "delegated subtree", FIX_DELEGATE, **common)
    if not fs.exists(rel):
        return missing(f"our cgroup {fs.path(rel)} does not exist under the cgroup2 mount",
                       FIX_DELEGATE, **common)
    controllers = tuple(fs.words(rel, "cgroup.controllers"))
    subtree = tuple(fs.words(rel, "cgroup.subtree_control"))
    writable = fs.writable(rel)
    common.update(controllers=controllers, subtree_control=subtree, writable=writable)
    if "memory" not in top_controllers:
        cmdline = text("cmdline")
        why = " (booted with cgroup_disable=memory)" if "cgroup_disable=memory" in cmdline else ""
        return missing(f"the kernel offers no memory controller to cgroup v2{why}: "
                       f"{fs.path('', 'cgroup.controllers')} lists "
                       f"{' '.join(top_controllers) or 'nothing'}", FIX_MEMORY, **common)
    if not writable:
        return missing(f"our cgroup {fs.path(rel)} is not delegated to this user (uid "
                       f"{os.getuid()} cannot write cgroup.procs / cgroup.subtree_control)",
                       FIX_DELEGATE, **common)
    if "memory" not in controllers:
        return missing(f"the memory controller is not delegated to our cgroup {fs.path(rel)} "
                       f"(its cgroup.controllers lists {' '.join(controllers) or 'nothing'})",
                       FIX_DELEGATE, **common)
    return Detection(True, "", "", already_set_up=already, psi=psi, psi_detail=psi_detail,
                     pressure_file=pfile, **common)
