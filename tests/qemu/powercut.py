"""One power cut of the arm64 guest during a write workload, and the check of what survived.

The workload (until the journal exists): a Python loop in the guest appends fixed-size records
to /mnt/disk/records.bin, fsyncs after each, and prints `ACK <n>` only after the fsync returned.
The host waits for the first ACK, sleeps `delay` seconds, cuts power (nbdkit, then QEMU), replays
the ext4 journal on the image and reads the file back with debugfs. Every record the host saw
acknowledged must be on disk, intact and in order; a record after the last ACK may be missing or
torn (it was never acknowledged).

Invariants: a record is (index u32, crc32 u32, 56 payload bytes derived from the index), so a
torn or stale record is detected without trusting the file size; the acknowledged count is read
from the guest's output *before* the cut, so nothing the guest says afterwards can count.
"""

from __future__ import annotations

import re
import struct
import tempfile
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

from .build_arm64_guest import GuestImage
from .disks import make_ext4, read_file
from .guest import Arm64Guest
from .nbd import NbdDisk, power_cut

__all__ = ["RECORD", "CutResult", "check_records", "run_cut"]

RECORD = 64
WORKLOAD = r"""
python3 -c '
import os, struct, zlib
fd = os.open("/mnt/disk/records.bin", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
d = os.open("/mnt/disk", os.O_RDONLY)
os.fsync(d)
for n in range(1000000):
    payload = (b"%08d" % n) * 7
    os.write(fd, struct.pack("<II", n, zlib.crc32(payload)) + payload)
    os.fsync(fd)
    print("ACK", n, flush=True)
'
"""


def _payload(n: int) -> bytes:
    return (b"%08d" % n) * 7


def check_records(data: bytes | None) -> int:
    """Number of leading records that are intact and in order (0 if the file is absent)."""
    if not data:
        return 0
    good = 0
    for off in range(0, len(data) - RECORD + 1, RECORD):
        index, crc = struct.unpack_from("<II", data, off)
        payload = data[off + 8: off + RECORD]
        if index != good or crc != zlib.crc32(payload) or payload != _payload(index):
            break
        good += 1
    return good


@dataclass(frozen=True)
class CutResult:
    mode: str
    delay: float
    acked: int           # records the host saw acknowledged before the cut
    on_disk: int         # intact leading records found after the cut
    boot_seconds: float | None

    @property
    def lost_acked(self) -> int:
        return max(0, self.acked - self.on_disk)


def run_cut(image: GuestImage, mode: str, delay: float, *, disk_mb: int = 64,
            timeout: float = 120.0) -> CutResult:
    """Boot with a fresh disk served in `mode`, cut `delay` s after the first ACK, check."""
    with tempfile.TemporaryDirectory(prefix="ea-cut-") as tmp:
        img = make_ext4(Path(tmp) / "disk.img", disk_mb)
        with NbdDisk(img, mode) as disk, Arm64Guest(WORKLOAD, disks=[disk.qemu_file],
                                                     image=image, with_source=False) as guest:
            guest.wait_output(r"ACK 0\n", timeout=timeout)
            time.sleep(delay)
            seen = guest.output  # read before the cut: only this counts as acknowledged
            power_cut(guest, disk)
            boot = guest.result().boot_seconds
        acks = [int(m) for m in re.findall(r"^ACK (\d+)$", seen, re.M)]
        acked = max(acks) + 1 if acks else 0
        on_disk = check_records(read_file(img, "/records.bin", replay=True))
    return CutResult(mode, delay, acked, on_disk, boot)
