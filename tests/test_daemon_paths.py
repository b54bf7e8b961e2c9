"""Daemon paths the main e2e module does not drive: `generate` through the daemon, TCP listener,
socket group, memory-budget eviction between two models, ttl_s=0 with a request waiting in the
batch window, socket activation, /health 503 while loading, a non-loopback TCP address refused.

Same recipe as tests/test_daemon_e2e.py (whose helpers are reused): a real daemon subprocess, a
NOTIFY_SOCKET the test owns, READY=1 awaited, never a sleep to wait for readiness.
"""

from __future__ import annotations

import grp
import http.client
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_proc import Daemon, daemon_env, serve_argv, spawn, stop
from journal_harness import link_prepared

from edge_agent.paths import default_model_path

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[1]
WINDOW_MS = 3000  # longer than a model load: a lone request waits in the batch window
PROMPT = "The capital of France is"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _group() -> str:
    """A group other than our own when we may chown to it (root), else our own."""
    if os.geteuid() == 0:
        return "nogroup"
    return grp.getgrgid(os.getgid()).gr_name


def _start(root: Path, config: str, argv: list[str] | None = None, **popen: object) -> Daemon:
    (root / "config.toml").write_text(config)
    return spawn(Daemon, root, argv or serve_argv(root / "config.toml"), **popen)


def _own_state(root: Path, prepared: Path) -> Path:
    """A state directory of the daemon's own holding the session's prepared weights (hard
    links): one daemon per state directory (it is locked), and a module-scoped daemon is alive
    while this module's other tests start theirs."""
    state = root / "state"
    link_prepared(prepared, state)
    return state


def _stop(d: Daemon) -> None:
    stop(d, grace=30)
    shutil.rmtree(d.root, ignore_errors=True)


def _metric(text: str, name: str, labels: str) -> float:
    m = re.search(rf"^{re.escape(name)}\{{{re.escape(labels)}\}} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


@pytest.fixture(scope="module")
def two_models(prepared_state_dir: Path) -> Iterator[tuple[Daemon, int]]:
    root = Path(tempfile.mkdtemp(prefix="ea-p-", dir="/tmp"))
    port = _free_port()
    config = (
        f'[server]\nsocket = "{root / "ea.sock"}"\n'
        f'state_dir = "{_own_state(root, prepared_state_dir)}"\n'
        f'tcp = "127.0.0.1:{port}"\nsocket_group = "{_group()}"\n'
        f"[scheduler]\nbatch_window_ms = {WINDOW_MS}\n"
        # one runner fits (~200 MiB on the llama.cpp engine at this context), two do not
        f'[runtime]\nmlock = "best-effort"\nthreads = 1\nmemory_budget_bytes = "300M"\n'
        f'[journal]\npath = "{root / "journal.sqlite3"}"\n'
        f"[models.smollm2]\ncontext = 256\nmax_batch = 2\npreload = true\n"
        f'[models.other]\npath = "{default_model_path()}"\ncontext = 256\nmax_batch = 2\n'
        f"ttl_s = 0\n"
    )
    d = _start(root, config)
    try:
        d.wait_notify("READY=1", 180)
        yield d, port
    finally:
        _stop(d)


def test_tcp_listener_on_loopback_and_socket_group(two_models: tuple[Daemon, int]) -> None:
    d, port = two_models
    assert d.sock.stat().st_gid == grp.getgrnam(_group()).gr_gid
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", "/health")
        resp = conn.getresponse()
        body = json.loads(resp.read())
    finally:
        conn.close()
    assert resp.status == 200 and body["status"] == "serving"
    assert f"tcp 127.0.0.1:{port}" in d.log.read_text()


def test_generate_goes_through_the_daemon_and_equals_local(
        two_models: tuple[Daemon, int], prepared_state_dir: Path) -> None:
    d, _ = two_models
    before = _metric(d.call("GET", "/metrics")[2].decode(), "edge_agent_requests_total",
                     'model="smollm2",outcome="done"')
    env = {k: v for k, v in os.environ.items() if not k.startswith("EDGE_AGENT_")}
    env["EDGE_AGENT_STATE_DIR"] = str(prepared_state_dir)
    cmd = [sys.executable, "-m", "edge_agent", "generate", PROMPT, "--max-tokens", "12",
           "--socket", str(d.sock)]
    via = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert via.returncode == 0, via.stderr
    assert "through the daemon" in via.stderr
    after = _metric(d.call("GET", "/metrics")[2].decode(), "edge_agent_requests_total",
                    'model="smollm2",outcome="done"')
    assert after == before + 1  # the daemon served it
    local = subprocess.run(cmd + ["--local"], cwd=REPO, env=env, capture_output=True,
                           text=True, timeout=120)
    assert local.returncode == 0, local.stderr
    assert "through the daemon" not in local.stderr
    assert via.stdout == local.stdout and via.stdout.strip()
    # no daemon on the socket: refused, never a second copy of the model in this process
    absent = subprocess.run(cmd[:-1] + [str(d.root / "none.sock")], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=120)
    assert absent.returncode == 1 and absent.stdout == "", absent.stderr
    assert "no daemon" in absent.stderr and "--local" in absent.stderr
    bad = subprocess.run(cmd + ["--local", "--daemon-model", "x"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--daemon-model" in bad.stderr


def test_load_evicts_idle_model_first_and_ttl0_waits_for_batch_window(
        two_models: tuple[Daemon, int]) -> None:
    d, _ = two_models
    h = d.health()
    assert h["models"]["smollm2"]["state"] in ("idle", "serving")
    assert h["models"]["other"]["state"] == "unloaded"
    t0 = time.monotonic()
    status, r = d.json("POST", "/v1/completions",
                       {"model": "other", "prompt": PROMPT, "max_tokens": 4, "temperature": 0})
    assert status == 200, r
    assert time.monotonic() - t0 >= WINDOW_MS / 1000 - 0.1  # it waited in the window
    metrics = d.call("GET", "/metrics")[2].decode()
    name = "edge_agent_model_events_total"
    # ttl_s = 0 did not unload "other" while its request waited: loaded exactly once
    assert _metric(metrics, name, 'model="other",event="load"') == 1
    assert _metric(metrics, name, 'model="smollm2",event="unload"') == 1
    log = d.log.read_text()
    evict = log.index("model other: evicting idle smollm2")
    unloaded = log.index("model smollm2: unloaded")
    ready = min(log.index(f"model other: {s}") for s in ("serving", "idle")
                if f"model other: {s}" in log)
    assert evict < unloaded < ready  # the victim was gone before the new runner started
    end = time.monotonic() + 30
    while d.health()["models"]["other"]["state"] != "unloaded":  # ttl 0 once idle
        assert time.monotonic() < end
        time.sleep(0.05)


def test_budget_too_small_for_any_model_is_503(tmp_path: Path,
                                               prepared_state_dir: Path) -> None:
    root = Path(tempfile.mkdtemp(prefix="ea-b-", dir="/tmp"))
    d = _start(root, f'[server]\nsocket = "{root / "ea.sock"}"\nstate_dir = '
               f'"{_own_state(root, prepared_state_dir)}"\n'
               f'[runtime]\nmemory_budget_bytes = "100M"\n'
               f'[journal]\nenabled = false\n[models.smollm2]\ncontext = 256\n')
    try:
        d.wait_notify("READY=1", 60)
        status, r = d.json("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert status == 503 and r["error"]["code"] == "budget_exceeded"
        assert "memory limit" in r["error"]["message"] and "Hint:" in r["error"]["message"]
        assert d.health()["models"]["smollm2"]["state"] == "failed"
    finally:
        _stop(d)


def test_socket_activation_and_health_503_while_loading(tmp_path: Path) -> None:
    """A pre-bound listening socket as fd 3 (LISTEN_FDS=1, LISTEN_PID = the daemon's pid via
    `exec`), and a fresh state dir: preparing the weights keeps /health at 503 "loading"."""
    root = Path(tempfile.mkdtemp(prefix="ea-a-", dir="/tmp"))
    path = root / "act.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(16)
    config = (f'[server]\nsocket = "{root / "unused.sock"}"\nstate_dir = "{root / "state"}"\n'
              f"[journal]\nenabled = false\n[runtime]\nthreads = 1\n"
              f"[models.smollm2]\ncontext = 256\nmax_batch = 1\npreload = true\n")
    env = daemon_env(root, {"LISTEN_FDS": "1"})
    script = ('os.dup2(int(sys.argv[1]), 3); os.environ["LISTEN_PID"] = str(os.getpid()); '
              'os.execv(sys.executable, [sys.executable, "-m", "edge_agent", *sys.argv[2:]])')
    argv = ["-c", f"import os, sys; {script}", str(listener.fileno()),
            "serve", "--config", str(root / "config.toml")]
    d = _start(root, config, argv, env=env, pass_fds=(listener.fileno(),))
    listener.close()
    d.sock = path  # talk over the activated socket
    try:
        seen_loading = None
        end = time.monotonic() + 180
        while not any("READY=1" in m.split("\n") for m in d.messages):
            status, _, body = d.call("GET", "/health")
            if status == 503:
                seen_loading = json.loads(body)
                break
            assert time.monotonic() < end and d.proc.poll() is None
        assert seen_loading is not None, "READY=1 came before /health answered 503"
        assert seen_loading["status"] == "loading"
        assert seen_loading["models"]["smollm2"]["state"] in ("loading", "warming")
        d.wait_notify("READY=1", 180)
        status, _, body = d.call("GET", "/health")
        assert status == 200 and json.loads(body)["status"] == "serving"
        assert not (root / "unused.sock").exists()  # activated: no socket of its own
        assert "1 activated socket(s)" in d.log.read_text()
    finally:
        _stop(d)


def test_non_loopback_tcp_is_refused_unless_allowed(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[server]\nsocket = "{tmp_path / "s.sock"}"\ntcp = "0.0.0.0:8089"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("EDGE_AGENT_")}
    r = subprocess.run([sys.executable, "-m", "edge_agent", "serve", "--config", str(cfg),
                        "--print-config"], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 78, r.stderr
    assert "server.tcp" in r.stderr and "tcp_allow_remote" in r.stderr
    cfg.write_text(cfg.read_text() + "tcp_allow_remote = true\n")
    r = subprocess.run([sys.executable, "-m", "edge_agent", "serve", "--config", str(cfg),
                        "--print-config"], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
