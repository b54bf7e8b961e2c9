"""A guest disk that really loses unflushed writes: a raw image served over NBD by nbdkit.

    with NbdDisk(image, mode="writeback") as disk, Arm64Guest(cmd, disks=[disk.qemu_file]) as g:
        g.wait_output("SYNCED")
        power_cut(g, disk)          # nbdkit dies first, then QEMU: nothing more reaches the file

Modes (filters are listed closest-to-the-guest first; their options follow the plugin name):
- "writeback": `--filter=cache file IMG cache=writeback`. Writes are held in nbdkit's cache
  and reach IMG only when the guest flushes (fsync, journal commit). Killing nbdkit loses exactly
  what the guest has not flushed, as a power cut loses a disk's volatile write cache.
- "discard-flush": `--filter=fua --filter=cache file IMG fuamode=discard cache=writeback`, the
  control: flushes and FUA are dropped before the cache, so nothing written since boot reaches
  IMG. A test that passes in this mode proves nothing; the harness must see data lost here.
- "plain": `file IMG`, every write goes to the host file at once (no loss on a cut).

Invariants: nbdkit runs with --exit-with-parent and is SIGKILLed on close; its cache file lives
in a private temporary folder removed on close; QEMU must be killed *after* nbdkit for a cut
(QEMU alive after nbdkit's death cannot flush anything any more).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Protocol

from .disks import require_tool
from .errors import HarnessError

__all__ = ["MODES", "NbdDisk", "power_cut"]

MODES = {
    "writeback": (["--filter=cache"], ["cache=writeback"]),
    "discard-flush": (["--filter=fua", "--filter=cache"], ["fuamode=discard", "cache=writeback"]),
    "plain": ([], []),
}


class _Killable(Protocol):
    def kill(self) -> None: ...


class NbdDisk:
    def __init__(self, image: Path, mode: str = "writeback") -> None:
        if mode not in MODES:
            raise HarnessError(f"NbdDisk mode {mode!r}: unknown. Hint: use one of "
                               f"{', '.join(MODES)}.")
        self.image = Path(image).resolve()
        self.mode = mode
        self.proc: subprocess.Popen[bytes] | None = None
        self.tmp: Path | None = None

    @property
    def socket(self) -> Path:
        assert self.tmp is not None, "start() first"
        return self.tmp / "nbd.sock"

    @property
    def qemu_file(self) -> str:
        """The `file=` value for QEMU's -drive (a raw NBD export on a Unix socket)."""
        return f"nbd+unix:///?socket={self.socket}"

    def start(self, timeout: float = 10.0) -> NbdDisk:
        nbdkit = require_tool("nbdkit", "nbdkit")
        filters, options = MODES[self.mode]
        self.tmp = Path(tempfile.mkdtemp(prefix="ea-nbd-"))
        cmd = [nbdkit, "--foreground", "--exit-with-parent", "--unix", str(self.socket),
               *filters, "file", str(self.image), *options]
        log = open(self.tmp / "nbdkit.log", "wb")  # noqa: SIM115 - closed with the process
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                     env=dict(os.environ, TMPDIR=str(self.tmp)),
                                     start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout
        while not self.socket.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                said = (self.tmp / "nbdkit.log").read_text(errors="replace")[-800:]
                self.close()
                raise HarnessError(f"nbdkit {' '.join(cmd[1:])}: no socket after "
                                   f"{timeout:.0f} s; it said {said!r}. Hint: check that "
                                   "the nbdkit package has the cache and fua filters.")
            time.sleep(0.02)
        return self

    def kill(self) -> None:
        """SIGKILL nbdkit: its cache (the unflushed writes) is gone."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=30)

    def close(self) -> None:
        self.kill()
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> NbdDisk:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def power_cut(guest: _Killable, disk: NbdDisk) -> None:
    """Cut power: the disk's volatile cache first, then the machine."""
    disk.kill()
    guest.kill()
