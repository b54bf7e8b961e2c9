"""Unix socket paths that can never work, told apart before a bind() or connect() fails.

Invariants owned here:
- `check_socket_path` raises `SocketPathError` (a ConfigError: exit 78, one line, a `Hint:`)
  for a path no socket can ever live at, whatever runs: longer than the 107 bytes AF_UNIX
  allows (sun_path is 108 bytes with its NUL), under something that is not a directory (a
  regular file, a device), or on a kernel pseudo-filesystem (/proc, /sys, cgroup2, ...) where
  no file can be created. It reads only the path's ancestors (lstat/stat) and
  /proc/self/mountinfo; it never creates anything.
- `bind_error` turns the OSError of creating the socket (mkdir of its directory, bind) into a
  SocketPathError saying what the path is and what to do; nothing else reaches the user as a
  traceback.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from edge_agent.errors import ConfigError
from edge_agent.filekind import file_kind

__all__ = ["SUN_PATH_MAX", "SocketPathError", "bind_error", "check_socket_path"]

SUN_PATH_MAX = 107  # bytes of a socket path: sizeof(sockaddr_un.sun_path) - 1 (Linux)
# file systems of the kernel's own objects: nothing can be created there
PSEUDO_FS = frozenset({"proc", "sysfs", "cgroup", "cgroup2", "debugfs", "tracefs", "securityfs",
                       "configfs", "pstore", "bpf", "efivarfs", "fusectl", "binfmt_misc",
                       "devpts", "mqueue", "hugetlbfs", "autofs", "nsfs"})


class SocketPathError(ConfigError):
    """A socket path that cannot work (too long, under a file, on /proc...)."""


def _hint(role: str) -> str:
    if role == "serve":
        return ("Hint: set --socket (or server.socket) to a path in a directory this user may "
                "write, e.g. /run/edge-agent/edge-agent.sock (systemd) or "
                "$XDG_RUNTIME_DIR/edge-agent.sock.")
    return ("Hint: pass --socket with the path the daemon listens on (its log says "
            "'listening on PATH'; `edge-agent serve --print-config` shows server.socket).")


def _mount_fs(path: Path) -> tuple[str, str] | None:
    """(mount point, file system type) of the mount holding `path`, from mountinfo."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    best: tuple[str, str] | None = None
    target = str(path)
    for line in lines:
        left, sep, right = line.partition(" - ")
        fields = left.split()
        if not sep or len(fields) < 5 or not right.split():
            continue
        point = fields[4].replace("\\040", " ")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best[0])):
            best = (point, right.split()[0])
    return best


def check_socket_path(path: str | os.PathLike[str], *, role: str = "client") -> Path:
    """The path, when a socket could be there; SocketPathError otherwise. role: "serve"
    (the daemon creates it) or "client" (a command connects to it)."""
    p = Path(path)
    size = len(os.fsencode(p))
    if size == 0:
        raise SocketPathError(f"socket path is empty. {_hint(role)}")
    if size > SUN_PATH_MAX:
        raise SocketPathError(
            f"socket path {str(p)[:60]}... is {size} bytes long; a Unix socket path may have "
            f"at most {SUN_PATH_MAX} bytes (AF_UNIX). {_hint(role)}")
    absolute = Path(os.path.abspath(p))
    for parent in absolute.parents:
        try:
            st = os.stat(parent)
        except FileNotFoundError:
            continue
        except OSError:
            break  # no permission to look: bind/connect report it
        if not stat.S_ISDIR(st.st_mode):
            raise SocketPathError(
                f"socket path {p}: {parent} is {file_kind(st.st_mode)}, not a directory, so "
                f"nothing can be created under it. {_hint(role)}")
        break
    mount = _mount_fs(absolute.parent)
    if mount is not None and mount[1] in PSEUDO_FS:
        where = (f"{mount[0]} is" if str(absolute.parent) == mount[0]
                 else f"{absolute.parent} is on {mount[0]},")
        raise SocketPathError(
            f"socket path {p}: {where} a kernel pseudo-filesystem ({mount[1]}) where no "
            f"socket can be created. {_hint(role)}")
    return p


def bind_error(path: str | os.PathLike[str], exc: OSError) -> SocketPathError:
    """Creating the socket (its directory, the bind) failed: why, in one line."""
    why = {errno.EACCES: "permission denied (this user may not create files there)",
           errno.EPERM: "operation not permitted",
           errno.EROFS: "the file system is read-only",
           errno.ENOSPC: "no space left on the device",
           errno.ENOTDIR: "a component of the path is not a directory",
           errno.ENOENT: "the directory does not exist and cannot be created there",
           errno.EADDRINUSE: "the address is in use"}.get(exc.errno or 0,
                                                           exc.strerror or str(exc))
    return SocketPathError(f"socket path {path}: cannot create the socket: {why}. "
                           f"{_hint('serve')}")
