"""Raw ext4 disk images for guests, made and read on the host without mounting.

Invariants: images are raw (never qcow2: crash tests need what the guest flushed to be exactly
what the file holds); reading uses debugfs on the image, after `e2fsck -E journal_only` has
replayed the journal when asked (a power cut leaves committed metadata only in the journal,
which debugfs alone does not apply).
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

from .errors import HarnessError

__all__ = ["make_ext4", "read_file", "replay_journal", "require_tool"]


def require_tool(name: str, package: str) -> str:
    path = shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")
    if not path:
        raise HarnessError(f"{name}: not found on PATH. Hint: install the Debian package "
                           f"{package} (see tests/qemu/README.md).")
    return path


def make_ext4(path: Path, size_mb: int = 64, content: Path | None = None,
              label: str = "ea-state") -> Path:
    """A raw ext4 image of size_mb, filled from the folder `content` if given (mkfs.ext4 -d)."""
    mkfs = require_tool("mkfs.ext4", "e2fsprogs")
    path = Path(path)
    with open(path, "wb") as f:
        f.truncate(size_mb * 1024 * 1024)
    cmd = [mkfs, "-F", "-q", "-L", label, "-E", "lazy_itable_init=0,lazy_journal_init=0"]
    if content is not None:
        cmd += ["-d", str(content)]
    p = subprocess.run([*cmd, str(path)], capture_output=True, text=True, timeout=120)
    if p.returncode != 0:
        raise HarnessError(f"mkfs.ext4 {path} ({size_mb} MiB, content={content}): exited "
                           f"{p.returncode}: {p.stderr.strip()}. Hint: make the image larger.")
    return path


def replay_journal(image: Path) -> str:
    """Apply the ext4 journal of `image` in place (what a mount would do); returns e2fsck's
    report. Exit codes 0-1 are success (1: the journal was replayed / fixed)."""
    e2fsck = require_tool("e2fsck", "e2fsprogs")
    p = subprocess.run([e2fsck, "-f", "-y", "-E", "journal_only", str(image)],
                       capture_output=True, text=True, timeout=120)
    if p.returncode > 1:
        raise HarnessError(f"e2fsck -E journal_only {image}: exited {p.returncode}: "
                           f"{(p.stdout + p.stderr).strip()[-800:]}. Hint: the image is "
                           "damaged beyond a journal replay; keep it for inspection.")
    return p.stdout + p.stderr


def read_file(image: Path, guest_path: str, *, replay: bool = False) -> bytes | None:
    """Bytes of `guest_path` (absolute in the file system) in the ext4 image, or None if it
    does not exist. With replay=True the journal is applied first (modifies the image)."""
    if replay:
        replay_journal(image)
    debugfs = require_tool("debugfs", "e2fsprogs")
    with tempfile.TemporaryDirectory(prefix="ea-debugfs-") as tmp:
        out = Path(tmp) / "out"
        p = subprocess.run([debugfs, "-R", f"dump -p {guest_path} {out}", str(image)],
                           capture_output=True, text=True, timeout=60)
        if p.returncode != 0 or "while trying to open" in p.stderr:
            said = " ".join(p.stderr.split("\n")[1:]).strip()
            raise HarnessError(f"debugfs dump {guest_path} from {image}: exited "
                               f"{p.returncode}: {said}. Hint: is it an ext4 image?")
        if "not found" in p.stderr or not out.exists():
            return None
        return out.read_bytes()
