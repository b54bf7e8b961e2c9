"""sd_notify datagrams to sockets the test owns, watchdog interval, socket activation fds."""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from edge_agent.daemon.sdnotify import Notifier, NotifyError, listen_fds, watchdog_interval

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def short_dir() -> Iterator[Path]:
    # AF_UNIX paths are limited to ~108 bytes; pytest's tmp_path can be longer.
    d = Path(f"/tmp/ea-sd-{uuid.uuid4().hex[:8]}")
    d.mkdir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _receiver(address: str | bytes) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(address)
    sock.settimeout(5)
    return sock


def test_path_socket_messages(short_dir: Path) -> None:
    path = str(short_dir / "notify")
    with _receiver(path) as rx, Notifier.from_env({"NOTIFY_SOCKET": path}) as n:
        assert n.enabled
        assert n.ready("serving smollm2") is True
        assert rx.recv(4096) == (
            f"READY=1\nMAINPID={os.getpid()}\nSTATUS=serving smollm2".encode()
        )
        n.status("loading smollm2:\n  pinning weights")
        assert rx.recv(4096) == b"STATUS=loading smollm2: pinning weights"
        n.extend_timeout(30_000_000)
        assert rx.recv(4096) == b"EXTEND_TIMEOUT_USEC=30000000"
        n.watchdog()
        assert rx.recv(4096) == b"WATCHDOG=1"
        n.stopping("draining 2 requests")
        assert rx.recv(4096) == b"STOPPING=1\nSTATUS=draining 2 requests"


def test_abstract_namespace_socket() -> None:
    name = f"edge-agent-test-{uuid.uuid4().hex}"
    env = {"NOTIFY_SOCKET": "@" + name}
    with _receiver(b"\0" + name.encode()) as rx, Notifier.from_env(env) as n:
        n.watchdog()
        assert rx.recv(4096) == b"WATCHDOG=1"


def test_without_notify_socket_nothing_is_sent() -> None:
    n = Notifier.from_env({})
    assert not n.enabled
    assert n.ready() is False and n.watchdog() is False and n.stopping() is False


def test_bad_notify_socket_and_dead_receiver(short_dir: Path) -> None:
    with pytest.raises(NotifyError, match=r"NOTIFY_SOCKET='relative/x': expected an absolute "
                       r"path or '@'.*Hint:"):
        Notifier.from_env({"NOTIFY_SOCKET": "relative/x"})
    logged: list[str] = []
    n = Notifier(str(short_dir / "gone"), logged.append)
    assert n.ready() is False  # a failed send is logged, not raised
    assert n.watchdog() is False and n.dropped == 2
    assert len(logged) == 1  # the same failure is reported once
    assert re.search(r"sd_notify b'READY=1.*No such file.*dropped.*Hint:", logged[0]), logged
    rx = _receiver(str(short_dir / "gone"))
    with rx:
        assert n.watchdog() is True and rx.recv(4096) == b"WATCHDOG=1"
    n.close()
    with pytest.raises(ValueError, match="usec must be > 0"):
        Notifier(None).extend_timeout(0)


def test_full_manager_queue_never_blocks(short_dir: Path) -> None:
    """A receiver that does not read: sends would block; they are dropped and logged."""
    path = str(short_dir / "full")
    logged: list[str] = []
    with _receiver(path) as rx, Notifier(path, logged.append) as n:
        results = [n.watchdog() for _ in range(2000)]  # would hang with a blocking socket
        assert results[0] is True and results[-1] is False
        assert n.dropped == results.count(False) > 0
        assert len(logged) == 1 and "would block" in logged[0] and "Hint:" in logged[0]
        assert rx.recv(4096) == b"WATCHDOG=1"


def test_watchdog_interval() -> None:
    me = os.getpid()
    assert watchdog_interval({}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "30000000"}) == 15.0
    assert watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(me)}) == 15.0
    assert watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(me + 1)}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "1000", "WATCHDOG_PID": "7"}, pid=7) == 0.0005
    with pytest.raises(NotifyError, match=r"WATCHDOG_USEC='soon': expected a positive number"):
        watchdog_interval({"WATCHDOG_USEC": "soon"})
    with pytest.raises(NotifyError, match=r"WATCHDOG_USEC='0'"):
        watchdog_interval({"WATCHDOG_USEC": "0"})
    with pytest.raises(NotifyError, match=r"WATCHDOG_PID='me': expected a process id"):
        watchdog_interval({"WATCHDOG_USEC": "10", "WATCHDOG_PID": "me"})


def test_listen_fds_not_ours_or_absent() -> None:
    assert listen_fds({}) == []
    assert listen_fds({"LISTEN_FDS": "1", "LISTEN_PID": str(os.getpid() + 1)}) == []
    assert listen_fds({"LISTEN_FDS": "1"}) == []  # LISTEN_PID is required
    with pytest.raises(NotifyError, match=r"LISTEN_FDS='x': expected a count"):
        listen_fds({"LISTEN_FDS": "x", "LISTEN_PID": str(os.getpid())})


CHILD = """
import json, sys
from edge_agent.daemon.sdnotify import listen_fds_with_names
got = listen_fds_with_names()
print(json.dumps([[n, s.fileno(), int(s.family), int(s.type), s.get_inheritable()]
                  for n, s in got]), flush=True)
for _, s in got:
    conn, _ = s.accept()
    conn.sendall(b"hello from fd %d" % s.fileno())
    conn.close()
"""


LAUNCHER = """
import os, sys
# What systemd does before exec: the socket becomes fd 3, LISTEN_PID is the process's own pid.
child, fd, pid = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
os.dup2(fd, 3)
os.environ["LISTEN_PID"] = pid[0] if pid else str(os.getpid())
os.execv(sys.executable, [sys.executable, "-c", child])
"""


def _activated_child(listener: socket.socket, env_extra: dict[str, str],
                     listen_pid: str | None = None) -> subprocess.Popen[bytes]:
    fd = listener.fileno()
    env = {**os.environ, **env_extra, "PYTHONPATH": str(REPO)}
    argv = [sys.executable, "-c", LAUNCHER, CHILD, str(fd)]
    if listen_pid is not None:
        argv.append(listen_pid)
    return subprocess.Popen(argv, env=env, pass_fds=(fd,), stdout=subprocess.PIPE,
                            cwd=str(REPO))


def _reap(child: subprocess.Popen[bytes]) -> None:
    child.kill()
    child.wait()
    if child.stdout is not None:
        child.stdout.close()


def test_listen_fds_real_socket_passed_to_a_child(short_dir: Path) -> None:
    path = str(short_dir / "api.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(path)
        listener.listen()
        child = _activated_child(listener, {"LISTEN_FDS": "1", "LISTEN_FDNAMES": "api"})
        try:
            assert child.stdout is not None
            line = json.loads(child.stdout.readline())
            assert line == [["api", 3, int(socket.AF_UNIX), int(socket.SOCK_STREAM), False]]
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
                c.settimeout(10)
                c.connect(path)
                assert c.recv(100) == b"hello from fd 3"
            assert child.wait(timeout=30) == 0
        finally:
            _reap(child)


def test_listen_fds_for_another_pid_are_ignored(short_dir: Path) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(short_dir / "api.sock"))
        listener.listen()
        child = _activated_child(listener, {"LISTEN_FDS": "1"}, listen_pid="1")
        try:
            out, _ = child.communicate(timeout=30)
            assert json.loads(out) == [] and child.returncode == 0
        finally:
            _reap(child)


def test_listen_fds_from_systemd_socket_activate(short_dir: Path) -> None:
    tool = shutil.which("systemd-socket-activate")
    if tool is None:
        pytest.skip("SKIPPED LOUDLY: systemd-socket-activate not installed (Debian package "
                    "systemd); the systemd-side oracle for socket activation did not run")
    path = str(short_dir / "act.sock")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    child = subprocess.Popen([tool, "-l", path, "--fdname=api", sys.executable, "-c", CHILD],
                             env=env, stdout=subprocess.PIPE, cwd=str(REPO))
    try:
        assert child.stdout is not None
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
            c.settimeout(10)
            for _ in range(500):  # the tool binds, then starts the program on first connection
                try:
                    c.connect(path)
                    break
                except (FileNotFoundError, ConnectionRefusedError):
                    assert child.poll() is None, "systemd-socket-activate exited early"
                    select.select([], [], [], 0.02)
            line = json.loads(child.stdout.readline())
            assert line == [["api", 3, int(socket.AF_UNIX), int(socket.SOCK_STREAM), False]]
            assert c.recv(100) == b"hello from fd 3"
        assert child.wait(timeout=30) == 0
    finally:
        _reap(child)
