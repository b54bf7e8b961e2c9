"""Smaller edges of the daemon, on a real daemon subprocess (tiny models, a few seconds each):

- a bad GGUF reached through a request marks the model `failed` with the reason (as a load by
  hand does) and answers 503 `model_failed` naming it, not a generic `unavailable`;
- a configured context above the model's own is capped with the reason said (log, /health);
- `/v1/completions` refuses a chat session; a session that outgrows the context says how to
  get out (DELETE /v1/sessions/{id}), and after the reset the same turn goes through;
- a runner killed again and again while its request makes progress costs no request
  (max_retries bounds only deaths in a row without a token).
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from journal_harness import journal_tokens, kill, link_prepared, start, tiny_gguf, wait_done

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def world(prepared_state_dir: Path) -> Iterator[dict[str, Any]]:
    base = Path(tempfile.mkdtemp(prefix="ea-ed-", dir="/tmp"))
    state = base / "state"
    link_prepared(prepared_state_dir, state)
    tiny = tiny_gguf(base / "tiny.gguf")
    bad = base / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64)  # header, then garbage
    root = base / "run"
    root.mkdir()
    (root / "config.toml").write_text(
        f'default_model = "tiny"\n'
        f'[server]\nsocket = "{root / "ea.sock"}"\nstate_dir = "{state}"\n'
        f"drain_timeout_s = 1\n"
        f"[scheduler]\nbatch_window_ms = 0\n"
        f'[runtime]\nmlock = "off"\nthreads = 1\n'
        f'[journal]\npath = "{root / "journal.sqlite3"}"\n'
        f'[models.tiny]\npath = "{tiny}"\ncontext = 1048576\nmax_batch = 2\npreload = true\n'
        f'ttl_s = "never"\n'
        f'[models.small]\npath = "{tiny}"\ncontext = 64\nmax_batch = 1\npreload = false\n'
        f'[models.bad]\npath = "{bad}"\npreload = false\n'
        f"[models.smollm2]\ncontext = 256\nmax_batch = 1\npreload = false\n")
    d = start(root)
    try:
        yield {"d": d, "root": root, "bad": bad, "tiny": tiny, "state": state}
    finally:
        kill(d)
        shutil.rmtree(base, ignore_errors=True)


def test_bad_gguf_through_a_request_marks_the_model_failed(world: dict[str, Any]) -> None:
    d, bad = world["d"], world["bad"]
    status, body = d.json("POST", "/v1/completions", {"model": "bad", "prompt": "Hi"})
    assert status == 503, body
    err = body["error"]
    assert err["code"] == "model_failed", err  # not the generic "unavailable"
    assert err["message"].startswith("model 'bad' cannot be used: ") and str(bad) in \
        err["message"] and "Hint:" in err["message"], err
    m = d.health()["models"]["bad"]
    assert m["state"] == "failed" and str(bad) in (m["reason"] or ""), m
    status, body = d.json("POST", "/v1/models/bad/load")  # a load by hand: the same reason
    assert status == 503 and body["error"]["code"] == "model_failed", body
    assert d.health()["models"]["tiny"]["state"] in ("idle", "serving")  # the rest serves


def test_oversized_context_is_capped_with_the_reason_said(world: dict[str, Any]) -> None:
    d, root = world["d"], world["root"]
    m = d.health()["models"]["tiny"]
    assert m["context"] == 512, m
    note = m.get("context_note") or ""
    assert "models.tiny.context = 1048576 is more than model 'tiny' was trained for; capped " \
        "to its context length of 512 tokens" in note and "Hint:" in note, m
    assert "warning: models.tiny.context = 1048576" in (root / "daemon.log").read_text()


def test_completions_refuses_a_chat_session(world: dict[str, Any]) -> None:
    d = world["d"]
    status, body = d.json("POST", "/v1/completions", {"prompt": "Hi", "session": "c-1",
                                                      "max_tokens": 2})
    assert status == 400 and body["error"]["code"] == "invalid_request", body
    msg = body["error"]["message"]
    assert msg.startswith("field 'session': session 'c-1' is a conversation of chat messages")
    assert "Hint: send it to /v1/chat/completions" in msg


def test_a_session_that_outgrows_the_context_can_be_reset(world: dict[str, Any]) -> None:
    d = world["d"]
    turn = {"model": "small", "session": "grow", "temperature": 0, "max_tokens": 8,
            "messages": [{"role": "user", "content": "Tell me a story about a cat."}]}
    status, body = d.json("POST", "/v1/chat/completions", turn)
    assert status == 200, body
    for _ in range(10):  # each turn adds its prompt and reply to the history
        status, body = d.json("POST", "/v1/chat/completions", turn)
        if status != 200:
            break
    assert status == 400 and body["error"]["code"] == "context_exceeded", body
    msg = body["error"]["message"]
    assert "session 'grow' has outgrown the context" in msg and "is 64" in msg, msg
    assert "Hint: reset it (DELETE /v1/sessions/grow" in msg, msg
    status, again = d.json("POST", "/v1/chat/completions", turn)
    assert status == 400, again  # still full: nothing was dropped silently
    status, reset = d.json("DELETE", "/v1/sessions/grow")
    assert status == 200 and reset["reset"] and reset["forgotten_tokens"] > 40, reset
    status, body = d.json("POST", "/v1/chat/completions", turn)
    assert status == 200, body  # a fresh history
    status, body = d.json("DELETE", "/v1/sessions/never-used")
    assert status == 404 and body["error"]["code"] == "session_not_found", body


def test_runner_killed_repeatedly_costs_no_request_that_progresses(
        world: dict[str, Any]) -> None:
    d, root = world["d"], world["root"]
    status, body = d.json("POST", "/v1/requests", {
        "model": "smollm2", "prompt": "Once upon a time", "temperature": 0,
        "max_tokens": 48})
    assert status == 202, body
    rid = body["id"]
    journal = root / "journal.sqlite3"
    killed: list[int] = []
    seen = 0
    for _ in range(4):  # max_retries is 2: four deaths used to fail the request
        end = time.monotonic() + 120
        while True:
            m = d.health()["models"]["smollm2"]
            n = len(journal_tokens(journal).get(rid, []))
            if m["runner_pid"] and m["active"] and m["runner_pid"] not in killed and n > seen:
                break
            st = d.json("GET", f"/v1/requests/{rid}")[1]
            assert st["state"] in ("queued", "running"), f"after {len(killed)} kill(s): {st}"
            assert time.monotonic() < end, f"no progress after {len(killed)} kill(s): {m}"
            time.sleep(0.02)
        seen = n
        os.kill(m["runner_pid"], signal.SIGKILL)
        killed.append(m["runner_pid"])
    result = wait_done(d, [rid], 180)[rid]
    assert result["state"] == "done", result
    assert result["completion_tokens"] == 48 and result["attempts"] >= 5, result


_MDWE_EXEC = """\
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
if libc.prctl(65, 1, 0, 0, 0) != 0:  # PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN
    sys.exit(f"PR_SET_MDWE failed: errno {ctypes.get_errno()}")
os.execv(sys.argv[1], sys.argv[1:])
"""


def _system_service_calls(tool: str) -> set[str]:
    import subprocess

    out = subprocess.run([tool, "syscall-filter"], capture_output=True, text=True,
                         timeout=60).stdout
    groups: dict[str, list[str]] = {}
    cur = ""
    for line in out.splitlines():
        if line.startswith("@"):
            cur = line.strip()
            groups[cur] = []
        elif cur and line.strip() and not line.strip().startswith("#"):
            groups[cur].append(line.strip())

    def expand(name: str, seen: set[str]) -> set[str]:
        calls: set[str] = set()
        for item in groups.get(name, []):
            if item.startswith("@"):
                if item not in seen:
                    seen.add(item)
                    calls |= expand(item, seen)
            else:
                calls.add(item)
        return calls

    return expand("@system-service", set())


@pytest.mark.parametrize("engine", ["numpy", "llamacpp"])
def test_unit_hardening_holds_for_the_daemon_and_its_runners(
        world: dict[str, Any], engine: str) -> None:
    """MemoryDenyWriteExecute=yes and SystemCallFilter=@system-service (systemd/): the daemon
    and its runners serve under the kernel's own W^X lock (PR_SET_MDWE, what systemd >= 254
    uses for MemoryDenyWriteExecute=) and every system call they make is in @system-service."""
    import platform
    import shutil as sh

    from daemon_proc import Daemon, spawn
    from daemon_proc import stop as stop_daemon

    strace, analyze = sh.which("strace"), sh.which("systemd-analyze")
    if not strace or not analyze:
        pytest.skip("SKIPPED LOUDLY: strace and systemd-analyze are needed to check the unit's "
                    "syscall filter against the daemon")
    major, minor = (int(x) for x in platform.release().split(".")[:2])
    if (major, minor) < (6, 3):
        pytest.skip("SKIPPED LOUDLY: PR_SET_MDWE needs Linux >= 6.3")
    from edge_agent.config import RuntimeConfig

    has_engines = "engine" in RuntimeConfig.__dataclass_fields__  # runtime.engine exists
    if engine == "llamacpp":
        if not has_engines:
            pytest.skip("SKIPPED LOUDLY: this build has no runtime.engine (numpy only)")
        pytest.importorskip("llama_cpp")
    root = Path(tempfile.mkdtemp(prefix="hd-", dir="/tmp"))
    try:
        (root / "mdwe.py").write_text(_MDWE_EXEC)
        cfg = world["root"] / "config.toml"
        link_prepared(world["state"], root / "state")  # a state dir of its own (one daemon each)
        text = cfg.read_text().replace(str(world["root"]), str(root)).replace(
            f'state_dir = "{world["state"]}"', f'state_dir = "{root / "state"}"')
        if has_engines:
            text = text.replace('threads = 1\n', f'threads = 1\nengine = "{engine}"\n', 1)
        (root / "config.toml").write_text(text)
        out = root / "strace.txt"
        d = spawn(Daemon, root, [str(root / "mdwe.py"), strace, "-f", "-qq", "-c", "-o",
                                 str(out), "--", sys.executable, "-m", "edge_agent", "serve",
                                 "--config", str(root / "config.toml")])
        try:
            d.wait_notify("READY=1", 120)
            status, body = d.json("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 4})
            assert status == 200, body
            status, body = d.json("POST", "/v1/chat/completions", {
                "model": "smollm2", "max_tokens": 4,
                "messages": [{"role": "user", "content": "Hi"}]})
            assert status == 200, body
            os.kill(d.health()["pid"], signal.SIGTERM)  # the daemon, strace's child
            assert d.proc.wait(60) == 0
        finally:
            stop_daemon(d)
        used = {ln.split()[-1] for ln in out.read_text().splitlines()
                if len(ln.split()) >= 5 and ln.split()[-1] not in ("syscall", "total")
                and not ln.startswith("-")}
        assert len(used) > 30, out.read_text()
        outside = used - _system_service_calls(analyze)
        assert not outside, f"system calls outside @system-service: {sorted(outside)}"
        log = (root / "daemon.log").read_text()
        assert "Traceback" not in log and "edge-agent: stopped" in log, log[-3000:]
    finally:
        shutil.rmtree(root, ignore_errors=True)
