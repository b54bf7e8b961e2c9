"""The runner `edge-agent serve` starts before its daemon is set up (daemon/prestart.py): a
runner started with `--prestarted` imports the engine, then waits for its command line; the
first llama.cpp load claims it (the same process serves the model), one nobody claims is ended
and reaped, and a claimed runner that dies is reaped and replaced like a spawned one."""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
from daemon_proc import REPO, Daemon, launch, serve_argv

from edge_agent.config import load_config
from edge_agent.daemon.ipc import MAX_FRAME, Ready, Status, decode, encode_frame, recv_frame
from edge_agent.daemon.prestart import prestart, runner_env
from edge_agent.paths import default_model_path
from edge_agent.runtime.llama_vocab import llama_available

pytestmark = [pytest.mark.timeout(300)]
needs_llama = pytest.mark.skipif(not llama_available(), reason="llama-cpp-python not installed")


def _prestarted() -> tuple[subprocess.Popen[bytes], socket.socket]:
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with child:
        proc = subprocess.Popen(
            [sys.executable, "-m", "edge_agent.daemon.runner", "--fd", str(child.fileno()),
             "--prestarted"], pass_fds=(child.fileno(),), cwd=REPO, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env=runner_env("llamacpp", None))
    return proc, parent


def _children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")


def _gone(pid: int) -> bool:
    """Neither running nor a zombie: reaped."""
    return not Path(f"/proc/{pid}").exists()


@needs_llama
def test_a_prestarted_runner_loads_what_its_argv_frame_names(tmp_path: Path) -> None:
    proc, sock = _prestarted()
    try:
        sock.sendall(encode_frame({"argv": [
            "--name", "smollm2", "--model", str(default_model_path()), "--engine", "llamacpp",
            "--state-dir", str(tmp_path), "--max-batch", "1", "--context", "64",
            "--threads", "1", "--mlock", "off", "--log-level", "WARNING"]}))
        seen = []
        while not seen or not isinstance(seen[-1], Ready):
            seen.append(decode(recv_frame(sock)))
        assert isinstance(seen[0], Status) and seen[0].state == "loading"
        assert seen[0].pid == proc.pid and seen[-1].pid == proc.pid
        assert seen[-1].engine["engine"] == "llamacpp"
    finally:
        sock.close()  # EOF: a loaded runner ends too
        proc.communicate(timeout=60)
    assert proc.returncode == 0


def test_a_prestarted_runner_nobody_claims_exits_without_loading() -> None:
    proc, sock = _prestarted()
    sock.close()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and err == b""


@pytest.mark.parametrize("frame", [{"argv": 5}, {"argv": ["--name", 3]}, {"args": []}])
def test_a_bad_argv_frame_is_refused_by_name(frame: dict[str, Any]) -> None:
    proc, sock = _prestarted()
    with sock:
        sock.sendall(encode_frame(frame))
        _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert b"argv frame holds" in err and repr(frame).encode() in err


@pytest.mark.parametrize("raw, said", [
    (b"\x00\x00\x00\x05argv[", b"argv frame is refused: Expecting value"),  # not JSON
    (b"\x00\x00\x00\x02[]", b"argv frame is refused: frame holds a JSON list"),
    (struct.pack(">I", MAX_FRAME + 1), b"argv frame is refused: a frame of 67108865 bytes"),
])
def test_an_argv_frame_that_cannot_be_read_is_refused_not_taken_for_eof(
        raw: bytes, said: bytes) -> None:
    """Unlike EOF (nobody claimed the runner: exit 0), a frame the runner cannot read is our
    own bug: exit 1 with the reason, nothing loaded."""
    proc, sock = _prestarted()
    with sock:
        sock.sendall(raw)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, err
    assert said in err and b"expected {\"argv\": [strings]}" in err, err
    assert b"Traceback" not in err


@pytest.mark.parametrize("overrides, wanted", [
    ({"runtime.engine": "llamacpp"}, True),
    ({"runtime.engine": "numpy"}, False),  # a numpy runner has nothing to import early
    ({"runtime.engine": "llamacpp", "models.smollm2.preload": False}, False),  # no load at start
])
def test_prestart_only_when_a_llamacpp_load_starts_with_the_daemon(
        tmp_path: Path, overrides: dict[str, Any], wanted: bool) -> None:
    cfg = load_config(None, env={}, check_paths=False, overrides={
        "server.state_dir": str(tmp_path), "models.smollm2.preload": True, **overrides})
    pre = prestart(cfg)
    if not wanted:
        assert pre is None
        return
    assert pre is not None
    env = runner_env("llamacpp", cfg.runtime.threads)
    claimed = None
    try:
        assert pre.claim({**env, "EXTRA": "1"}) is None  # another environment: spawn one
        claimed = pre.claim(env)
        assert claimed is not None and claimed[0] is pre.proc
        assert pre.claim(env) is None  # once
    finally:
        if claimed is not None:
            claimed[1].close()  # EOF: it exits
        pre.discard()
        assert pre.proc.wait(60) == 0


def _config(root: Path, model: Path, engine: str = "llamacpp") -> Path:
    cfg = root / "config.toml"
    cfg.write_text(
        f'[server]\nsocket = "{root / "ea.sock"}"\nstate_dir = "{root / "state"}"\n'
        f'[runtime]\nengine = "{engine}"\nthreads = 1\nmlock = "off"\n'
        f'[models.smollm2]\npath = "{model}"\ncontext = 128\nmax_batch = 2\npreload = true\n')
    return cfg


@needs_llama
def test_the_daemon_serves_with_the_runner_it_prestarted_and_replaces_it_when_it_dies() -> None:
    root = Path(tempfile.mkdtemp(prefix="ea-", dir="/tmp"))
    with launch(Daemon, root, serve_argv(_config(root, default_model_path())), grace=30) as d:
        first = d.health()["models"]["smollm2"]["runner_pid"]
        assert _children(d.proc.pid) == [first]
        assert "--prestarted" in _cmdline(first)  # claimed, not spawned
        status, reply = d.json("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
        assert status == 200, reply
        os.kill(first, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while not _gone(first) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(first)  # reaped (through its pidfd), not left a zombie
        status, reply = d.json("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
        assert status == 200, reply  # loaded again, on demand
        second = d.health()["models"]["smollm2"]["runner_pid"]
        assert second != first and "--prestarted" not in _cmdline(second)  # spawned
        assert f"runner (pid {first}) exited with status -9" in d.log_tail()
    assert d.proc.returncode == 0 and _gone(second)


@needs_llama
def test_a_prestarted_runner_nobody_claims_is_reaped_by_ready() -> None:
    """The model's file is no GGUF: its load fails before any runner is claimed."""
    root = Path(tempfile.mkdtemp(prefix="ea-", dir="/tmp"))
    bad = root / "bad.gguf"
    bad.write_bytes(b"not a gguf at all" * 64)
    with launch(Daemon, root, serve_argv(_config(root, bad)), grace=30) as d:
        assert d.health()["models"]["smollm2"]["state"] == "failed"
        assert _children(d.proc.pid) == []
