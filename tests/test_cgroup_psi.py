"""PSI: systemd's memory pressure protocol over a real FIFO and a real AF_UNIX socket, the
epoll wrapper under asyncio, triggers on this machine's real /proc/pressure/memory, why the
kernel refuses one (a child without CAP_SYS_RESOURCE), and dropping an ambient capability."""

from __future__ import annotations

import asyncio
import base64
import errno
import os
import select
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from edge_agent.cgroup.caps import CAP_SYS_RESOURCE, cap_sets, drop_ambient, holds
from edge_agent.cgroup.psi import (
    PressureError,
    PressureWatcher,
    _error,
    has_cap_sys_resource,
    parse_pressure,
    permission_hint,
    read_pressure,
    unprivileged_triggers,
    window_hint,
)
from edge_agent.cgroup.values import Trigger
from edge_agent.errors import ConfigError

TRIGGER = Trigger("some", 150000, 1000000)
PSI = Path("/proc/pressure/memory")


def test_parse_pressure() -> None:
    s = parse_pressure("some avg10=1.50 avg60=0.25 avg300=0.00 total=1234\n"
                       "full avg10=0.10 avg60=0.00 avg300=0.00 total=99\n")
    assert (s.some_avg10, s.some_avg60, s.some_total_us, s.full_avg10, s.full_total_us) == (
        1.5, 0.25, 1234, 0.1, 99)
    with pytest.raises(Exception, match=r"memory.pressure: cannot parse.*Hint: expected"):
        parse_pressure("nonsense")


def test_from_env() -> None:
    assert PressureWatcher.from_env({"MEMORY_PRESSURE_WATCH": "/dev/null"}, Path("/x"),
                                    TRIGGER) is None
    w = PressureWatcher.from_env({}, Path("/cg/memory.pressure"), TRIGGER)
    assert w is not None and w.path == Path("/cg/memory.pressure")
    assert w.payload == b"some 150000 1000000\0"
    payload = b"some 200000 2000000\0"
    env = {"MEMORY_PRESSURE_WATCH": "/run/p", "MEMORY_PRESSURE_WRITE":
           base64.b64encode(payload).decode()}
    w = PressureWatcher.from_env(env, Path("/cg/memory.pressure"), TRIGGER)
    assert w is not None and (w.path, w.payload) == (Path("/run/p"), payload)
    assert PressureWatcher.from_env({}, None, TRIGGER) is None
    with pytest.raises(ConfigError, match=r"\$MEMORY_PRESSURE_WRITE='\*\*\*': not valid base64"):
        PressureWatcher.from_env({"MEMORY_PRESSURE_WATCH": "/p", "MEMORY_PRESSURE_WRITE": "***"},
                                 None, TRIGGER)


def test_fifo_source(tmp_path: Path) -> None:
    fifo = tmp_path / "pressure.fifo"
    os.mkfifo(fifo)
    with PressureWatcher(fifo, b"some 1 2\0") as w:
        assert w.kind == "fifo"
        assert w.wait(0.05) is False  # our own payload is not an event
        writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        try:
            os.write(writer, b"x")
            assert w.wait(2.0) is True and w.events == 1
            assert w.wait(0.05) is False  # drained
        finally:
            os.close(writer)
        assert w.wait(0.05) is False  # the writer left: no HUP storm


def test_socket_source_gets_the_payload_and_its_events(tmp_path: Path) -> None:
    path = tmp_path / "p.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)
    try:
        w = PressureWatcher(path, b"some 150000 1000000\0").open()
        conn, _ = server.accept()
        assert w.kind == "socket"
        assert conn.recv(100) == b"some 150000 1000000\0"
        assert w.wait(0.05) is False
        conn.sendall(b"pressure!")
        assert w.wait(2.0) is True and w.events == 1 and not w.closed
        conn.close()
        w.wait(2.0)
        assert w.closed
        w.close()
    finally:
        server.close()


def test_asyncio_add_reader_on_the_epoll_fd(tmp_path: Path) -> None:
    fifo = tmp_path / "f"
    os.mkfifo(fifo)
    w = PressureWatcher(fifo).open()

    async def main() -> int:
        loop = asyncio.get_running_loop()
        hits: list[bool] = []
        got = asyncio.Event()

        def ready() -> None:
            hits.append(w.handle_ready())
            got.set()

        loop.add_reader(w.fileno(), ready)
        def poke() -> None:
            fd = os.open(fifo, os.O_WRONLY)
            os.write(fd, b"1")
            os.close(fd)

        threading.Timer(0.05, poke).start()
        await asyncio.wait_for(got.wait(), 5)
        await asyncio.sleep(0.1)  # no further callbacks once drained
        loop.remove_reader(w.fileno())
        return hits.count(True)

    try:
        assert asyncio.run(main()) == 1 and w.events == 1
    finally:
        w.close()


def test_open_errors_say_why(tmp_path: Path) -> None:
    with pytest.raises(PressureError) as e:
        PressureWatcher(tmp_path / "missing").open()
    assert e.value.errno == errno.ENOENT and "psi=1" in str(e.value)
    plain = tmp_path / "plain"
    plain.write_text("")
    with pytest.raises(PressureError, match=r"cannot be polled.*not a PSI file, FIFO or socket"):
        PressureWatcher(plain, b"some 1 2\0").open()
    with pytest.raises(PressureError, match="not open"):
        PressureWatcher(plain).fileno()
    for code, needle in ((errno.EOPNOTSUPP, "compiled into this kernel but disabled at boot"),
                         (errno.EINVAL, "the kernel rejected the trigger"),
                         (errno.EACCES, "multiple of 2 s")):
        msg = str(_error("write trigger to", PSI, OSError(code, "x"), b"some 1 2\0"))
        assert msg.startswith(f"write trigger to {PSI} <- 'some 1 2': ") and needle in msg


# ----- the real kernel, when this machine lets us arm a trigger ------------------------------


def _arm(payload: bytes) -> PressureWatcher:
    if not PSI.exists():
        pytest.skip(f"{PSI} does not exist: kernel without PSI (see `edge-agent doctor`)")
    try:
        return PressureWatcher(PSI, payload).open()
    except PressureError as exc:
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EOPNOTSUPP):
            pytest.skip(f"cannot arm a PSI trigger on {PSI} here: {exc}")
        raise


def test_real_trigger_arms_and_stays_quiet_under_asyncio() -> None:
    w = _arm(b"some 500000 2000000")  # NUL appended: the kernel eats the last byte
    try:
        assert w.kind == "psi" and w.payload == b"some 500000 2000000\0" and w.note == ""
        raw = os.open(PSI, os.O_RDONLY)
        try:  # why the epoll wrapper exists: a PSI fd always polls readable
            assert select.select([raw], [], [], 0)[0] == [raw]
        finally:
            os.close(raw)
        assert w.wait(0.05) is False  # no memory stall on this machine right now

        async def main() -> int:
            calls = 0

            def ready() -> None:
                nonlocal calls
                calls += 1

            loop = asyncio.get_running_loop()
            loop.add_reader(w.fileno(), ready)
            await asyncio.sleep(0.3)
            loop.remove_reader(w.fileno())
            return calls

        assert asyncio.run(main()) == 0  # not a busy loop
        assert read_pressure(PSI).some_avg10 >= 0
    finally:
        w.close()


def test_real_kernel_rejects_a_bad_trigger() -> None:
    if not PSI.exists():
        pytest.skip(f"{PSI} does not exist")
    try:
        PressureWatcher(PSI, b"some 1 100\0").open()
    except PressureError as exc:
        if exc.errno in (errno.EACCES, errno.EPERM):
            pytest.skip(f"cannot arm a PSI trigger here: {exc}")
        assert exc.errno == errno.EINVAL
        assert "<- 'some 1 100': Invalid argument (EINVAL)" in str(exc)
        assert "window of 500000..10000000 us" in str(exc)
    else:
        pytest.fail("the kernel accepted a 100 us window")


def test_real_kernel_one_second_window_is_widened_when_unprivileged() -> None:
    w = _arm(b"some 150000 1000000\0")
    try:
        if w.note:  # no CAP_SYS_RESOURCE on a kernel >= 6.5: 1 s windows are EINVAL
            assert w.payload == b"some 300000 2000000\0"
            assert "armed 'some 300000 2000000' instead" in w.note
        else:  # privileged, or an older kernel: armed as asked
            assert w.payload == b"some 150000 1000000\0"
        assert w.wait(0.05) is False
    finally:
        w.close()


# ----- why a trigger is refused: kernel release, capability, window ----------------------------


def test_kernel_and_window_rules() -> None:
    assert not unprivileged_triggers("6.1.0-28-arm64") and not unprivileged_triggers("5.15.0")
    assert unprivileged_triggers("6.5.0") and unprivileged_triggers("6.18.44-fc")
    assert unprivileged_triggers("7.0") and not unprivileged_triggers("unknown")
    msg = window_hint("6.8.0", False, 1_000_000)
    assert msg is not None
    for needle in ("lacks CAP_SYS_RESOURCE", "Linux 6.8.0 (>= 6.5)", "1000000 us is not",
                   "Fix: use a window of 2000000, 4000000", "AmbientCapabilities="):
        assert needle in msg, needle
    assert window_hint("6.8.0", True, 1_000_000) is None  # the capability lifts the rule
    assert window_hint("6.1.0", False, 1_000_000) is None  # before 6.5: no unprivileged rule
    assert window_hint("6.8.0", False, 4_000_000) is None
    assert window_hint("6.8.0", False, 100) is None  # out of range for everyone
    assert has_cap_sys_resource("CapEff:\t0000000001000000\n")
    assert not has_cap_sys_resource("CapEff:\t000001fffeffffff\n") and not has_cap_sys_resource("")


def test_permission_hint_names_what_applies(tmp_path: Path) -> None:
    f = tmp_path / "memory.pressure"
    f.write_text("")
    owner = f.stat().st_uid
    old = permission_hint(f, release="6.1.0-28-arm64", uid=owner + 1, has_cap=False)
    assert "kernel 6.1.0-28-arm64; this process lacks CAP_SYS_RESOURCE" in old
    assert f"owned by uid {owner}, not by this process (uid {owner + 1})" in old
    assert "Linux 6.1.0-28-arm64 (< 6.5) opens a pressure file for writing only with" in old
    assert "CapabilityBoundingSet= and AmbientCapabilities=" in old
    new = permission_hint(f, release="6.8.0", uid=owner, has_cap=False, window_us=1_000_000)
    assert "owned by" not in new and "(< 6.5)" not in new and "1000000 us is not" in new
    held = permission_hint(f, release="6.1.0", uid=owner, has_cap=True)
    assert "this process holds CAP_SYS_RESOURCE): no known rule explains it" in held


_CHILD = """
import errno, os, sys
from pathlib import Path
from edge_agent.cgroup.psi import _error
path = Path("/proc/pressure/memory")
payload = b"some 150000 1000000\\0"
try:
    fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)
    try:
        os.write(fd, payload)
    finally:
        os.close(fd)
except OSError as exc:
    print(str(_error("write trigger to", path, exc, payload)))
else:
    print("ARMED")
"""


def test_real_kernel_refuses_a_1_s_window_without_cap_sys_resource_and_says_why() -> None:
    """The kernel's own answer to a process without CAP_SYS_RESOURCE: EINVAL for a 1 s window
    on Linux >= 6.5, EPERM when opening the file for writing before 6.5."""
    if not PSI.exists():
        pytest.skip(f"SKIPPED LOUDLY: {PSI} does not exist: kernel without PSI")
    cmd = [sys.executable, "-c", _CHILD]
    if has_cap_sys_resource():
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("SKIPPED LOUDLY: this process holds CAP_SYS_RESOURCE and `setpriv` "
                        "(util-linux) is missing to drop it for the child")
        cmd = [setpriv, "--bounding-set=-sys_resource", "--inh-caps=-sys_resource", *cmd]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).resolve().parent.parent).stdout.strip()
    release = os.uname().release
    if unprivileged_triggers(release):
        assert "<- 'some 150000 1000000': Invalid argument (EINVAL). Hint: this process " \
            "lacks CAP_SYS_RESOURCE" in out, out
        assert "1000000 us is not" in out and "multiple of 2 s" in out, out
    else:
        assert "(EPERM). Hint: not allowed to create a PSI trigger" in out, out
        assert "(< 6.5) opens a pressure file for writing only with CAP_SYS_RESOURCE" in out, out


def test_cap_sets_and_drop_ambient() -> None:
    sets = cap_sets("CapInh:\t0000000000004000\nCapAmb:\t0000000001004000\nCapEff:\tff\n")
    assert sets["CapAmb"] == 0x1004000 and sets["CapEff"] == 0xFF and sets["CapBnd"] == 0
    assert holds(24, "CapAmb:\t0000000001000000\n", "CapAmb")
    if not holds(CAP_SYS_RESOURCE, which="CapAmb"):
        assert drop_ambient(CAP_SYS_RESOURCE) is False  # not granted by a unit: kept as is


_DROP = """
from edge_agent.cgroup.caps import cap_sets, drop_ambient
before = cap_sets()
dropped = drop_ambient(14)
after = cap_sets()
print(dropped, before["CapAmb"] >> 14 & 1, after["CapAmb"] >> 14 & 1, after["CapEff"] >> 14 & 1,
      after["CapPrm"] >> 14 & 1, after["CapEff"] >> 21 & 1)
"""


def test_drop_ambient_really_drops_an_ambient_capability() -> None:
    """capset(2) on a child given CAP_IPC_LOCK ambiently (as AmbientCapabilities= does): it
    leaves the effective, permitted and ambient sets; other capabilities stay."""
    setpriv = shutil.which("setpriv")
    if setpriv is None or os.geteuid() != 0 or not holds(21):  # CAP_SYS_ADMIN: a full root
        pytest.skip("SKIPPED LOUDLY: needs root and `setpriv` (util-linux) to hand a child an "
                    "ambient capability")
    r = subprocess.run([setpriv, "--inh-caps=+ipc_lock", "--ambient-caps=+ipc_lock",
                        sys.executable, "-c", _DROP], capture_output=True, text=True,
                       timeout=60, cwd=Path(__file__).resolve().parent.parent)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "1", "0", "0", "0", "1"], r.stdout
