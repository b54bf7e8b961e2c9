"""The QEMU harness boots real guests built from Debian packages (tests/qemu/).

The arm64 guest: aarch64 Python with numpy and sqlite3, the project importable, cgroup v2 with
the memory controller and PSI, a disk read back on the host, a UART on a host pty. Power cuts:
an fsynced file survives nbdkit's writeback cache being killed; with flushes discarded (the
control) it is lost, which proves the harness can fail. The systemd guest: systemd as PID 1
runs a Type=notify service. Images are cached under tests/.cache/qemu/ (cold build ~20 s for
arm64, ~90 s for systemd); tests skip, loudly, only when packages cannot be downloaded.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import serial
from qemu.build_arm64_guest import GuestImage
from qemu.build_systemd_guest import SystemdImage
from qemu.disks import make_ext4, read_file
from qemu.errors import GuestTimeout, HarnessError
from qemu.guest import Arm64Guest, run_arm64
from qemu.nbd import NbdDisk, power_cut
from qemu.powercut import RECORD, check_records, run_cut
from qemu.skips import arm64_image_or_skip, require_tool, systemd_image_or_skip
from qemu.systemd_guest import SystemdGuest

pytestmark = pytest.mark.qemu


@pytest.fixture(scope="session")
def arm64() -> GuestImage:
    return arm64_image_or_skip("QEMU guest tests")




PROBE = r"""
import json, os, platform, sqlite3, sys
import numpy as np
a = np.arange(12, dtype=np.float32).reshape(3, 4)
db = sqlite3.connect("/tmp/probe.db")
db.execute("PRAGMA journal_mode=WAL")
db.execute("CREATE TABLE t (x)")
db.executemany("INSERT INTO t VALUES (?)", [(i,) for i in range(10)])
db.commit()
import edge_agent, firmware_tools, sqlite_utils, tokenizers, serial, h11, elftools
print(json.dumps({
    "machine": platform.machine(), "python": sys.version_info[:2], "numpy": np.__version__,
    "matmul": (a @ a.T).tolist(), "sqlite": db.execute("SELECT sum(x) FROM t").fetchone()[0],
    "wal": db.execute("PRAGMA journal_mode").fetchone()[0],
    "edge_agent": edge_agent.__file__, "pid": os.getpid(),
}))
"""


def test_arm64_python_numpy_sqlite_and_project(arm64: GuestImage) -> None:
    # The probe travels as a file in the initramfs; the command is long enough to be passed as
    # a file too (arm64's kernel command line holds 2048 bytes).
    padding = "# " + "x" * 1300
    r = run_arm64(f"python3 /ea/probe.py && python3 -m edge_agent --help\n{padding}\n",
                  files={"/ea/probe.py": PROBE.encode()}, timeout=120, image=arm64)
    assert r.rc == 0, r.output
    first, _, rest = r.output.partition("\n")
    probe = json.loads(first)
    a = [[float(4 * i + k) for k in range(4)] for i in range(3)]
    assert probe["machine"] == "aarch64"
    assert probe["python"] == [3, 11]
    assert probe["numpy"].startswith("2.")
    gram = [[sum(x * y for x, y in zip(r1, r2, strict=True)) for r2 in a] for r1 in a]
    assert probe["matmul"] == gram
    assert probe["sqlite"] == 45 and probe["wal"] == "wal"
    assert probe["edge_agent"] == "/opt/edge-agent/edge_agent/__init__.py"
    assert "usage: edge-agent" in rest
    assert r.boot_seconds is not None and r.boot_seconds < 30


CGROUP_PROBE = r"""
set -e
grep -q '^cgroup2 /sys/fs/cgroup cgroup2' /proc/mounts && echo "mounted cgroup2"
echo "controllers: $(cat /sys/fs/cgroup/cgroup.controllers)"
echo "psi: $(head -1 /proc/pressure/memory)"
echo +memory > /sys/fs/cgroup/cgroup.subtree_control
mkdir /sys/fs/cgroup/hog
echo 32M > /sys/fs/cgroup/hog/memory.max
echo 1 > /sys/fs/cgroup/hog/memory.oom.group
echo "child psi: $(head -1 /sys/fs/cgroup/hog/memory.pressure)"
sh -c 'echo $$ > /sys/fs/cgroup/hog/cgroup.procs; \
       exec python3 -c "b = bytearray(200 << 20); print(\"survived\")"' || echo "hog rc=$?"
echo "events: $(tr '\n' ' ' < /sys/fs/cgroup/hog/memory.events)"
"""


def test_arm64_cgroup2_memory_controller_psi_and_oom(arm64: GuestImage) -> None:
    r = run_arm64(CGROUP_PROBE, timeout=120, image=arm64)
    assert r.rc == 0, r.output
    assert "mounted cgroup2" in r.output
    controllers = r.output.split("controllers: ")[1].split("\n")[0].split()
    assert "memory" in controllers and "cpu" in controllers
    assert r.output.split("psi: ")[1].startswith("some avg10=")
    assert "child psi: some avg10=" in r.output
    # A process over memory.max in its group is OOM-killed by the kernel (SIGKILL: 137).
    assert "survived" not in r.output and "hog rc=137" in r.output
    events = dict(zip(*[iter(r.output.split("events: ")[1].split())] * 2, strict=True))
    assert int(events["oom_kill"]) >= 1 and int(events["oom_group_kill"]) >= 1


def test_arm64_disk_and_uart_on_a_host_pty(arm64: GuestImage, tmp_path: Path) -> None:
    content = tmp_path / "content"
    content.mkdir()
    (content / "from-host.txt").write_text("written on the host\n")
    image = make_ext4(tmp_path / "state.img", 32, content)
    # The UART is opened (fd 3) before "ready": bytes that arrive while no process has the
    # tty open can be lost, and the host writes as soon as it sees "ready".
    cmd = ("cat /mnt/disk/from-host.txt; echo from-guest > /mnt/disk/from-guest.txt; "
           "exec 3< /dev/ttyAMA0; echo ready; read -r line <&3; echo \"uart said $line\"; "
           "echo pong > /dev/ttyAMA0")
    with Arm64Guest(cmd, disks=[image], uart=True, image=arm64, with_source=False) as guest:
        assert guest.uart_path is not None and guest.uart_path.startswith("/dev/pts/")
        with serial.Serial(guest.uart_path, 115200, timeout=30) as port:
            guest.wait_output("ready", timeout=60)
            port.write(b"ping\n")
            assert port.read_until(b"pong").endswith(b"pong")
        r = guest.wait(timeout=60)
    assert r.rc == 0
    assert r.output.splitlines()[:3] == ["written on the host", "ready", "uart said ping"]
    assert "EA-EXIT 0" in r.console
    assert read_file(image, "/from-guest.txt") == b"from-guest\n"
    assert read_file(image, "/absent.txt") is None


def test_arm64_exit_status_and_timeout_kill_qemu(arm64: GuestImage) -> None:
    r = run_arm64("echo failing >&2; exit 3", image=arm64, with_source=False, timeout=60)
    assert (r.rc, r.output) == (3, "failing\n")
    with Arm64Guest("echo started; sleep 600", image=arm64, with_source=False) as guest:
        guest.wait_output("started", timeout=60)
        with pytest.raises(GuestTimeout, match=r"did not finish in 1 s; QEMU killed.*Hint:"):
            guest.wait(timeout=1)
        assert guest.proc is not None and guest.proc.poll() is not None
    with Arm64Guest("true", image=arm64, with_source=False) as guest:
        with pytest.raises(GuestTimeout, match=r"output matching 'never'.*Hint:"):
            guest.wait_output("never", timeout=0.5)
        assert guest.proc is not None and guest.proc.poll() is not None


FSYNC_THEN_WAIT = r"""
python3 -c '
import os
data = bytes(range(256)) * 4096
fd = os.open("/mnt/disk/acked.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
os.write(fd, data)
os.fsync(fd)
os.close(fd)
d = os.open("/mnt/disk", os.O_RDONLY)
os.fsync(d)
os.close(d)
print("SYNCED", flush=True)
'
sleep 600
"""


@pytest.mark.parametrize("mode, survives", [("writeback", True), ("discard-flush", False)])
def test_power_cut_keeps_only_flushed_writes(arm64: GuestImage, tmp_path: Path, mode: str,
                                             survives: bool) -> None:
    require_tool("nbdkit", "nbdkit", "QEMU power-cut test")
    image = make_ext4(tmp_path / "disk.img", 64)
    with NbdDisk(image, mode) as disk, Arm64Guest(FSYNC_THEN_WAIT, disks=[disk.qemu_file],
                                                   image=arm64, with_source=False) as guest:
        guest.wait_output("SYNCED", timeout=90)
        power_cut(guest, disk)
        assert disk.proc is not None and disk.proc.poll() is not None
        assert guest.proc is not None and guest.proc.poll() is not None
    got = read_file(image, "/acked.bin", replay=True)
    if survives:
        assert got == bytes(range(256)) * 4096
    else:
        assert got is None, "the control run kept data whose flush was discarded"
    fsck = subprocess.run(["e2fsck", "-f", "-n", str(image)], capture_output=True, text=True)
    assert fsck.returncode == 0, fsck.stdout + fsck.stderr


@pytest.mark.parametrize("mode", ["writeback", "discard-flush"])
def test_power_cut_during_fsync_loop(arm64: GuestImage, mode: str) -> None:
    require_tool("nbdkit", "nbdkit", "QEMU power-cut test")
    cut = run_cut(arm64, mode, delay=1.5)
    assert cut.acked >= 3, cut  # the workload ran long enough to mean something
    if mode == "writeback":
        assert cut.lost_acked == 0, cut
    else:
        assert cut.on_disk == 0 and cut.lost_acked == cut.acked, cut


def test_record_checker_stops_at_the_first_bad_record() -> None:
    import struct
    import zlib

    def rec(n: int, payload: bytes | None = None) -> bytes:
        payload = payload if payload is not None else (b"%08d" % n) * 7
        return struct.pack("<II", n, zlib.crc32(payload)) + payload

    assert check_records(None) == 0 and check_records(b"") == 0
    assert check_records(rec(0) + rec(1) + rec(2)) == 3
    assert check_records(rec(0) + rec(1) + rec(2)[: RECORD - 1]) == 2  # torn tail
    assert check_records(rec(0) + rec(2)) == 1  # a gap
    assert check_records(rec(0) + bytes(RECORD)) == 1  # zeros where a record should be
    assert check_records(rec(0) + rec(1, b"x" * 56)) == 1  # right crc, wrong content


def test_bad_inputs_have_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(HarnessError, match=r"mode 'lossy': unknown\. Hint: use one of "
                                           r"writeback, discard-flush, plain"):
        NbdDisk(tmp_path / "x.img", "lossy")
    not_ext4 = tmp_path / "zeros.img"
    not_ext4.write_bytes(bytes(1 << 20))
    with pytest.raises(HarnessError, match=r"debugfs dump /x from .*zeros\.img.*magic.*"
                                           r"Hint: is it an ext4"):
        read_file(not_ext4, "/x")
    big = tmp_path / "big"
    big.mkdir()
    (big / "blob").write_bytes(os.urandom(4 << 20))
    with pytest.raises(HarnessError, match=r"(?s)mkfs\.ext4 .*\(2 MiB, content=.*"
                                           r"Could not allocate.*Hint: make the image larger"):
        make_ext4(tmp_path / "small.img", 2, big)


# ---- the systemd guest (amd64 under TCG): systemd as PID 1, a Type=notify service ----------

NOTIFY_SERVICE = b"""#!/usr/bin/python3
import os, socket, time
time.sleep(2)  # systemctl start must block until READY=1
addr = os.environ["NOTIFY_SOCKET"]
addr = "\\0" + addr[1:] if addr.startswith("@") else addr
sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
sock.sendto(b"READY=1\\nSTATUS=ea-notify-test serving", addr)
while True:
    time.sleep(3600)
"""

NOTIFY_UNIT = b"""[Unit]
Description=edge-agent harness Type=notify test service

[Service]
Type=notify
Delegate=yes
ExecStart=/usr/bin/python3 /ea/notify_service.py
"""

SYSTEMD_PROBE = r"""
echo "state: $(systemctl is-system-running --wait)"
systemctl --failed --no-legend
cp /ea/ea-notify-test.service /etc/systemd/system/
systemctl daemon-reload
t0=$(cut -d' ' -f1 /proc/uptime)
systemctl start ea-notify-test.service
t1=$(cut -d' ' -f1 /proc/uptime)
echo "start took: $t0 $t1"
systemctl show -p ActiveState -p SubState -p StatusText -p Delegate ea-notify-test.service
cg=/sys/fs/cgroup/system.slice/ea-notify-test.service
echo "delegated: $(stat -c %U $cg/cgroup.procs) $(cat $cg/cgroup.controllers)"
python3 -c "import edge_agent; print('edge_agent at', edge_agent.__file__)"
systemctl stop ea-notify-test.service
echo "after stop: $(systemctl is-active ea-notify-test.service)"
"""


@pytest.fixture(scope="session")
def systemd_guest_image() -> SystemdImage:
    return systemd_image_or_skip("systemd QEMU test")


def test_systemd_guest_runs_a_type_notify_service(systemd_guest_image: SystemdImage) -> None:
    files = {"notify_service.py": NOTIFY_SERVICE, "ea-notify-test.service": NOTIFY_UNIT}
    with SystemdGuest(SYSTEMD_PROBE, image=systemd_guest_image, files=files) as guest:
        r = guest.wait(timeout=240)
        assert guest.read_payload("rc") == b"0\n"
    assert r.rc == 0, r.output
    out = r.output
    assert "state: running" in out, out
    assert "ActiveState=active" in out and "SubState=running" in out, out
    assert "StatusText=ea-notify-test serving" in out and "Delegate=yes" in out
    t0, t1 = map(float, out.split("start took: ")[1].split()[:2])
    assert t1 - t0 >= 2.0, "systemctl start returned before the service sent READY=1"
    assert "memory" in out.split("delegated: ")[1].split("\n")[0].split()
    assert "edge_agent at /opt/edge-agent/edge_agent/__init__.py" in out
    assert "after stop: inactive" in out
