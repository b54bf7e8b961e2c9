"""A writer for the kernel's initramfs format (cpio "newc"), so no root or cpio binary is needed.

Invariants: parents are written before children (the kernel creates entries in order); entries
are sorted, so the same tree gives the same bytes; device nodes are written as headers only
(no mknod on the host); archives may be concatenated and the kernel unpacks them in turn, later
entries replacing earlier ones.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO

__all__ = ["CpioWriter", "write_tree"]


class CpioWriter:
    def __init__(self, out: BinaryIO) -> None:
        self.out = out
        self.ino = 1
        self.seen: set[str] = set()

    def _entry(self, name: str, mode: int, data: bytes = b"", *, mtime: int = 0,
               rdev: tuple[int, int] = (0, 0), nlink: int = 1) -> None:
        name = name.strip("/") or "."
        fields = [self.ino, mode, 0, 0, nlink, mtime, len(data), 0, 0, rdev[0], rdev[1],
                  len(name.encode()) + 1, 0]
        self.ino += 1
        header = b"070701" + b"".join(f"{v:08x}".encode() for v in fields)
        self.out.write(header + name.encode() + b"\0")
        self.out.write(b"\0" * ((-(len(header) + len(name.encode()) + 1)) % 4))
        self.out.write(data)
        self.out.write(b"\0" * ((-len(data)) % 4))
        self.seen.add(name)

    def mkdir(self, name: str, mode: int = 0o755) -> None:
        parts = name.strip("/").split("/")
        for i in range(1, len(parts) + 1):
            sub = "/".join(parts[:i])
            if sub and sub not in self.seen:
                self._entry(sub, stat.S_IFDIR | mode, nlink=2)

    def file(self, name: str, data: bytes, mode: int = 0o644, mtime: int = 0) -> None:
        self.mkdir(os.path.dirname(name.strip("/")))
        self._entry(name, stat.S_IFREG | mode, data, mtime=mtime)

    def symlink(self, name: str, target: str) -> None:
        self.mkdir(os.path.dirname(name.strip("/")))
        self._entry(name, stat.S_IFLNK | 0o777, target.encode())

    def chardev(self, name: str, major: int, minor: int, mode: int = 0o600) -> None:
        self.mkdir(os.path.dirname(name.strip("/")))
        self._entry(name, stat.S_IFCHR | mode, rdev=(major, minor))

    def tree(self, src: Path, prefix: str = "") -> None:
        """Add everything under src (files, dirs, symlinks) at `prefix` in the archive."""
        src = Path(src)
        for dirpath, dirnames, filenames in os.walk(src):
            dirnames.sort()
            rel = os.path.relpath(dirpath, src)
            base = "/".join(p for p in (prefix.strip("/"), "" if rel == "." else rel) if p)
            if base:
                self.mkdir(base, stat.S_IMODE(os.lstat(dirpath).st_mode))
            for name in sorted(filenames + [d for d in dirnames
                                            if os.path.islink(os.path.join(dirpath, d))]):
                path = os.path.join(dirpath, name)
                arc = f"{base}/{name}" if base else name
                st = os.lstat(path)
                if stat.S_ISLNK(st.st_mode):
                    self.symlink(arc, os.readlink(path))
                elif stat.S_ISREG(st.st_mode):
                    with open(path, "rb") as f:
                        self.file(arc, f.read(), stat.S_IMODE(st.st_mode), int(st.st_mtime))

    def close(self) -> None:
        self._entry("TRAILER!!!", 0)
        self.out.write(b"\0" * ((-self.out.tell()) % 512))


def write_tree(src: Path, out_path: Path, *, console: bool = True) -> None:
    """Write the tree at src as one initramfs archive (with /dev/console if asked)."""
    with open(out_path, "wb") as out:
        w = CpioWriter(out)
        if console:
            w.mkdir("dev")
            w.chardev("dev/console", 5, 1)
        w.tree(src)
        w.close()
