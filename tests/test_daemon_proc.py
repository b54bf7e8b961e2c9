"""tests/daemon_proc.py, the launcher every daemon test and bench uses: environment, READY=1,
the errors it reports (with the daemon's log), and that stop() leaves no process behind.

A real `edge-agent serve` with no model configured to preload (ready in about a second), plus
small real Python processes where a daemon cannot misbehave on demand (silent, forking).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_proc import Daemon, DaemonError, daemon_env, launch, serve_argv, spawn, stop

pytestmark = [pytest.mark.timeout(120)]


@pytest.fixture
def root() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="ea-dp-", dir="/tmp"))  # short: AF_UNIX paths
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _config(root: Path, extra: str = "") -> Path:
    cfg = root / "config.toml"
    cfg.write_text(f'[server]\nsocket = "{root / "ea.sock"}"\nstate_dir = "{root / "state"}"\n'
                   f"[journal]\nenabled = false\n{extra}")
    return cfg


def _gone(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def _wait_gone(pid: int, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while not _gone(pid):
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


def test_env_drops_edge_agent_variables_and_owns_the_notify_socket(
        root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGE_AGENT_STATE_DIR", "/nowhere")
    monkeypatch.setenv("NOTIFY_SOCKET", "/run/systemd/notify")
    env = daemon_env(root, {"WATCHDOG_USEC": "1000000"})
    assert not [k for k in env if k.startswith("EDGE_AGENT_")]
    assert env["NOTIFY_SOCKET"] == str(root / "notify.sock")
    assert env["PYTHONUNBUFFERED"] == "1" and env["WATCHDOG_USEC"] == "1000000"
    assert env["PATH"] == os.environ["PATH"]
    assert serve_argv(root / "c.toml") == ["-m", "edge_agent", "serve", "--config",
                                           str(root / "c.toml")]


def test_launch_waits_for_ready_and_stop_ends_it_cleanly(root: Path) -> None:
    with launch(Daemon, root, serve_argv(_config(root)), ready_timeout=60, grace=30) as d:
        assert any("READY=1" in m.split("\n") for m in d.messages)
        status, health = d.json("GET", "/health")
        assert status == 200 and health["status"] == "serving", health
        assert d.log == root / "daemon.log" and d.sock == root / "ea.sock"
        assert stop(d, grace=30) == 0  # SIGTERM: drains and exits 0
        assert any("STOPPING=1" in m.split("\n") for m in d.messages)
        assert not d.reader.is_alive() and d.notify.fileno() == -1
        assert not d.sock.exists()
        assert stop(d, grace=30) == 0  # again (launch's finally does): harmless
    assert not root.exists()


def test_daemon_that_exits_before_ready_is_an_error_with_its_log(root: Path) -> None:
    cfg = _config(root, "[scheduler]\nqueue_maks = 3\n")
    with pytest.raises(DaemonError, match=r"daemon exited 78 before READY=1: (.|\n)*"
                                          r"queue_maks"):
        with launch(Daemon, root, serve_argv(cfg), ready_timeout=60):
            pytest.fail("launch yielded a daemon that never sent READY=1")
    assert not root.exists()


def test_silent_process_times_out_and_is_killed(root: Path) -> None:
    d = spawn(Daemon, root, ["-c", "import sys, time; print('starting', flush=True); "
                             "time.sleep(60)"])
    try:
        with pytest.raises(DaemonError, match=r"no READY=1 within 0.5 s: starting"):
            d.wait_notify("READY=1", 0.5)
    finally:
        rc = stop(d)
    assert rc == -9 and not d.reader.is_alive()


def test_log_is_appended_when_asked(root: Path) -> None:
    (root / "daemon.log").write_text("earlier run\n")
    d = spawn(Daemon, root, ["-c", "print('second run')"], append_log=True)
    d.proc.wait(30)
    assert stop(d) == 0
    assert (root / "daemon.log").read_text() == "earlier run\nsecond run\n"
    d = spawn(Daemon, root, ["-c", "print('third run')"])
    d.proc.wait(30)
    stop(d)
    assert (root / "daemon.log").read_text() == "third run\n"


FORKS = ("import subprocess, sys, time\n"
         "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
         "open(sys.argv[1], 'w').write(str(p.pid))\n"
         "if sys.argv[2] == 'stay':\n"
         "    time.sleep(60)\n")


@pytest.mark.parametrize("main", ["stay", "exit"])
def test_stop_with_group_kills_the_runner_too(root: Path, main: str) -> None:
    """Like a power cut (journal tests): the daemon and its runner die together, also when
    the daemon already exited and left its runner behind."""
    pidfile = root / "child.pid"
    d = spawn(Daemon, root, ["-c", FORKS, str(pidfile), main], start_new_session=True)
    end = time.monotonic() + 30
    while not pidfile.exists() or not pidfile.read_text():
        assert time.monotonic() < end and (main == "exit" or d.proc.poll() is None)
        time.sleep(0.02)
    child = int(pidfile.read_text())
    if main == "exit":
        assert d.proc.wait(30) == 0 and not _gone(child)
    stop(d, group=True)
    assert _wait_gone(child), f"pid {child} of the daemon's group outlived stop(group=True)"
