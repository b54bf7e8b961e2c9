"""One launcher for `edge-agent serve` subprocesses, shared by the tests and bench/.

Recipe: a short directory under /tmp (AF_UNIX paths are limited to ~108 bytes), a
NOTIFY_SOCKET the caller owns (`ROOT/notify.sock`), block until READY=1 instead of sleeping,
always kill in `finally`.

Invariants this module owns:
- a daemon runs `sys.executable ARGV` from the repository root with the caller's environment
  minus every `EDGE_AGENT_*` variable, plus NOTIFY_SOCKET and PYTHONUNBUFFERED=1; its stdout
  and stderr go to `ROOT/daemon.log`, never to the caller's terminal;
- every notification is read as it comes by a thread (like systemd: an unread datagram queue
  would fill up and block the daemon's sd_notify) and kept in `Daemon.messages`, in order;
- `stop()` leaves no process behind (SIGKILL after the grace time, to the whole process group
  when asked) and closes the notify socket, which ends the reader thread;
- a daemon that exits or stays silent is reported as `DaemonError` (an AssertionError, so a
  test fails with it) carrying the tail of the daemon's log.

Benches import it with `tests/` on sys.path (as bench/journal.py imports journal_harness): it
is a test helper, not part of the installed package.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

__all__ = ["REPO", "Daemon", "DaemonError", "daemon_env", "launch", "serve_argv", "spawn",
           "stop"]

REPO = Path(__file__).resolve().parents[1]
LOG_TAIL = 3000


class DaemonError(AssertionError):
    """The daemon did not do what the harness waited for (exited, stayed silent, not quiet)."""


class Daemon:
    """A running daemon: its process, notify socket, log, and an HTTP client on ROOT/ea.sock."""

    def __init__(self, root: Path, proc: subprocess.Popen[bytes], notify: socket.socket,
                 log: Path) -> None:
        self.root = root
        self.sock = root / "ea.sock"
        self.proc = proc
        self.notify = notify
        self.log = log
        self.messages: list[str] = []
        self.changed = threading.Condition()
        self.reader = threading.Thread(target=self._read_notify, daemon=True)
        self.reader.start()

    def _read_notify(self) -> None:
        while True:
            try:
                msg = self.notify.recv(4096).decode()
            except OSError:
                return
            if not msg:  # shut down: recv returns at once from now on
                return
            with self.changed:
                self.messages.append(msg)
                self.changed.notify_all()

    def log_tail(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-LOG_TAIL:]
        except OSError as exc:
            return f"(no log: {exc})"

    def wait_notify(self, key: str, timeout: float) -> str:
        """The first notification holding the line `key` (e.g. READY=1), waiting up to
        `timeout` s; DaemonError if the daemon exits first or the time runs out."""
        end = time.monotonic() + timeout
        with self.changed:
            while time.monotonic() < end:
                for m in self.messages:
                    if key in m.split("\n"):
                        return m
                if self.proc.poll() is not None:
                    raise DaemonError(f"daemon exited {self.proc.returncode} before {key}: "
                                      f"{self.log_tail()}")
                self.changed.wait(min(1.0, max(0.01, end - time.monotonic())))
        raise DaemonError(f"no {key} within {timeout} s: {self.log_tail()}")

    def call(self, method: str, path: str, body: Any = None, *, raw: bytes | None = None,
             headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
        """One HTTP request over the Unix socket: (status, lower-cased headers, body)."""
        from edge_agent.client import UnixHTTPConnection

        conn = UnixHTTPConnection(str(self.sock))
        try:
            data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
            hdrs = {"Content-Type": "application/json", **(headers or {})}
            conn.request(method, path, body=data, headers=hdrs)
            resp = conn.getresponse()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
        finally:
            conn.close()

    def json(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        status, _, data = self.call(method, path, body)
        return status, json.loads(data)

    def health(self) -> dict[str, Any]:
        return self.json("GET", "/health")[1]

    def wait_quiet(self, timeout: float = 30.0, *, model: str = "smollm2",
                   free_blocks: bool = True) -> dict[str, Any]:
        """Poll /health until nothing runs or waits (and, with free_blocks, every KV block of
        `model` is free); the last health document."""
        end = time.monotonic() + timeout
        while True:
            h = self.health()
            m = h["models"][model]
            if (h["queue"]["depth"] == 0 and m["active"] == 0
                    and (not free_blocks or m["free_blocks"] == m["total_blocks"])):
                return h
            if time.monotonic() > end:
                raise DaemonError(f"daemon not quiet after {timeout} s: {json.dumps(h)[:2000]}")
            time.sleep(0.05)


D = TypeVar("D", bound=Daemon)


def serve_argv(config: Path) -> list[str]:
    """`python -m edge_agent serve --config CONFIG` (the arguments after the interpreter)."""
    return ["-m", "edge_agent", "serve", "--config", str(config)]


def daemon_env(root: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The caller's environment without EDGE_AGENT_*, with NOTIFY_SOCKET=ROOT/notify.sock,
    PYTHONUNBUFFERED=1 and `extra` on top."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EDGE_AGENT_")}
    env.update(NOTIFY_SOCKET=str(root / "notify.sock"), PYTHONUNBUFFERED="1", **(extra or {}))
    return env


def spawn(cls: type[D], root: Path, argv: list[str], *, env: dict[str, str] | None = None,
          append_log: bool = False, **popen: Any) -> D:
    """Bind ROOT/notify.sock (afresh) and start `python ARGV` (see daemon_env; `env` replaces it
    whole); the log is ROOT/daemon.log (appended to with append_log). Does not wait: call
    `wait_notify("READY=1", ...)`. `popen` goes to subprocess.Popen (start_new_session, ...)."""
    (root / "notify.sock").unlink(missing_ok=True)  # a previous daemon's, in the same root
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        notify.bind(str(root / "notify.sock"))
        log = root / "daemon.log"
        with log.open("ab" if append_log else "wb") as fh:
            proc = subprocess.Popen([sys.executable, *argv], cwd=REPO,
                                    env=daemon_env(root) if env is None else env,
                                    stdout=fh, stderr=fh, **popen)
    except BaseException:
        notify.close()
        raise
    return cls(root, proc, notify, log)


def stop(d: Daemon, *, grace: float = 0.0, group: bool = False) -> int | None:
    """End the daemon: SIGTERM and up to `grace` s to exit (grace 0: no SIGTERM), then
    SIGKILL (with group, to its whole process group, its runner too, even when the daemon
    already exited); close the notify socket. The daemon's exit status."""
    proc = d.proc
    if grace > 0 and proc.poll() is None:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(grace)
    if group:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    elif proc.poll() is None:
        proc.kill()
    if proc.returncode is None:
        proc.wait(10)
    with contextlib.suppress(OSError):
        d.notify.shutdown(socket.SHUT_RDWR)  # wakes the reader thread's recv() at once
    d.notify.close()
    d.reader.join(5)
    return proc.returncode


@contextlib.contextmanager
def launch(cls: type[D], root: Path, argv: list[str], *, env: dict[str, str] | None = None,
           ready_timeout: float = 180.0, grace: float = 0.0, **popen: Any) -> Iterator[D]:
    """Run `python ARGV` with a NOTIFY_SOCKET the caller owns (extra variables in `env`),
    wait for READY=1, and always stop it (see stop) and remove `root` afterwards."""
    d: D | None = None
    try:
        d = spawn(cls, root, argv, env=daemon_env(root, env), **popen)
        d.wait_notify("READY=1", ready_timeout)
        yield d
    finally:
        if d is not None:
            stop(d, grace=grace)
        shutil.rmtree(root, ignore_errors=True)
