"""End to end: `python -m edge_agent serve` as a subprocess with the real default model.

Recipe (launcher in tests/daemon_proc.py): short temp dir under /tmp, NOTIFY_SOCKET
bound to a datagram socket the test owns, block until READY=1 (no sleeps), drive the API over the
Unix socket, SIGTERM last, kill in `finally`. One daemon per module; tests run in file order and
leave it idle for the next one.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon_proc import REPO, Daemon, launch, serve_argv

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

QUEUE_MAX = 6
MAX_BATCH = 4
CONTEXT = 512
MAX_BODY = 64 * 1024
PROMPTS = ["The capital of France is", "def fibonacci(n):"]
CHAT = [{"role": "user", "content": "Name three colours."}]


def sse_events(data: bytes) -> list[str]:
    return [line[len("data: "):] for line in data.decode().split("\n")
            if line.startswith("data: ")]


@pytest.fixture(scope="module", params=["llamacpp", "numpy"])
def engine(request: pytest.FixtureRequest) -> str:
    """Every test of this module runs against a daemon on each engine."""
    return str(request.param)


@pytest.fixture(scope="module")
def expected(prepared_state_dir: Path, engine: str) -> dict[str, str]:
    """Temperature-0 outputs of the same engine in process (the reference for the daemon)."""
    from edge_agent.paths import default_model_path
    from edge_agent.runtime.engines import load_engine
    from edge_agent.runtime.sampling import SamplingParams

    loaded = load_engine(engine, default_model_path(), state_dir=prepared_state_dir,
                         mlock="off", max_batch=1, context=CONTEXT, threads=1)
    try:
        tok = loaded.tokenizer
        out = {}
        for p in PROMPTS:
            out[p] = "".join(loaded.stream_text(tok.encode(p), SamplingParams(max_tokens=12)))
        out["long"] = "".join(loaded.stream_text(tok.encode(PROMPTS[0]),
                                                 SamplingParams(max_tokens=40)))
        out["chat"] = "".join(loaded.stream_text(tok.apply_chat_template(CHAT),
                                                 SamplingParams(max_tokens=16)))
        return out
    finally:
        loaded.close()


@pytest.fixture(scope="module")
def daemon(prepared_state_dir: Path, engine: str) -> Iterator[Daemon]:
    root = Path(tempfile.mkdtemp(prefix="ea-", dir="/tmp"))
    cfg = root / "config.toml"
    cfg.write_text(
        f'[server]\nsocket = "{root / "ea.sock"}"\nstate_dir = "{prepared_state_dir}"\n'
        f"max_body_bytes = {MAX_BODY}\ndrain_timeout_s = 10\n"
        f"[scheduler]\nqueue_max = {QUEUE_MAX}\nmax_batch_size = {MAX_BATCH}\n"
        f"[runtime]\nengine = \"{engine}\"\nmlock = \"best-effort\"\nthreads = 1\n"
        f"[models.smollm2]\ncontext = {CONTEXT}\nmax_batch = {MAX_BATCH}\npreload = true\n"
    )
    with launch(Daemon, root, serve_argv(cfg), env={"WATCHDOG_USEC": "1000000"}) as d:
        yield d


def test_the_control_plane_leaves_the_computing_to_the_runner(daemon: Daemon,
                                                                engine: str) -> None:
    """After a streamed completion and a chat, the llama.cpp engine's control plane has mapped
    neither numpy nor the `tokenizers` library (10 MiB and more of its memory, for nothing it
    computes: it tokenizes and decodes through the model's own vocabulary); its runner has
    numpy (its sampling)."""
    if engine != "llamacpp":
        pytest.skip("the numpy engine's control plane tokenizes with numpy and tokenizers")
    status, _, body = daemon.call("POST", "/v1/completions",
                                  {"prompt": PROMPTS[0], "max_tokens": 4, "stream": True})
    assert status == 200 and sse_events(body)[-1] == "[DONE]"
    status, reply = daemon.json("POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
    assert status == 200 and reply["choices"][0]["message"]["content"]
    runner = daemon.health()["models"]["smollm2"]["runner_pid"]
    maps = Path(f"/proc/{daemon.proc.pid}/maps").read_text()
    assert "_multiarray_umath" not in maps and "tokenizers.abi3" not in maps
    assert "_multiarray_umath" in Path(f"/proc/{runner}/maps").read_text()


def test_health_models_and_socket_mode(daemon: Daemon, engine: str) -> None:
    assert stat.S_IMODE(daemon.sock.stat().st_mode) == 0o660
    status, h = daemon.json("GET", "/health")
    assert status == 200 and h["status"] == "serving"
    m = h["models"]["smollm2"]
    assert m["state"] in ("idle", "serving") and m["runner_pid"] > 0
    assert m["engine"] == engine and m["engine_info"]["engine"] == engine
    if engine == "numpy":  # the prepared f32 copy
        assert m["mlock"]["weight_bytes"] == 538_060_032
    else:  # the GGUF's tensors as stored (the gguf package sums them independently)
        import gguf

        from edge_agent.paths import default_model_path

        stored = sum(int(t.n_bytes) for t in gguf.GGUFReader(default_model_path()).tensors)
        assert m["mlock"]["weight_bytes"] == stored
    assert m["mlock"]["locked"] and m["mlock"]["vmlck_bytes"] >= m["mlock"]["weight_bytes"]
    assert h["queue"] == {**h["queue"], "depth": 0, "queue_max": QUEUE_MAX}
    assert "cgroup" in h
    status, models = daemon.json("GET", "/v1/models")
    assert status == 200 and [x["id"] for x in models["data"]] == ["smollm2"]
    with daemon.changed:
        lines = [m.split("\n") for m in daemon.messages]
    ready = next(i for i, m in enumerate(lines) if "READY=1" in m)
    assert any(ln.startswith("STATUS=serving") for ln in lines[ready])
    # the load asked systemd for more time before READY=1
    assert any(ln.startswith("EXTEND_TIMEOUT_USEC=") for m in lines[:ready] for ln in m)
    daemon.wait_notify("WATCHDOG=1", 3)  # pings every WATCHDOG_USEC / 2 from the main loop


def test_status_command_reads_the_live_daemon(daemon: Daemon,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    from edge_agent import cli

    assert cli.main(["status", "--socket", str(daemon.sock)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("edge-agent: serving (pid "), out
    assert lines[1].startswith(f"queue:     depth 0 of {QUEUE_MAX} ("), out
    assert "models:" in lines and "{" not in out, out
    row = next(ln for ln in lines if ln.startswith("  smollm2 ")).split()
    assert row[1] in ("idle", "serving") and row[5:7] == [str(MAX_BATCH), str(CONTEXT)], out
    # The /health capture the client tests render (tests/data/health_serving.json) has no
    # section or key a live daemon lacks. The cgroup section depends on the host; skipped.
    _, live = daemon.json("GET", "/health")
    capture = json.loads((REPO / "tests" / "data" / "health_serving.json").read_text())
    assert set(capture) <= set(live)
    for section in ("queue", "pressure", "journal"):
        assert set(capture[section]) <= set(live[section]), section
    assert set(capture["models"]["smollm2"]) <= set(live["models"]["smollm2"])
    assert set(capture["models"]["smollm2"]["mlock"]) <= set(live["models"]["smollm2"]["mlock"])


def test_completion_equals_in_process_engine(daemon: Daemon, expected: dict[str, str]) -> None:
    for p in PROMPTS:
        status, r = daemon.json("POST", "/v1/completions",
                                {"prompt": p, "max_tokens": 12, "temperature": 0})
        assert status == 200, r
        assert r["choices"][0]["text"] == expected[p]
        assert r["usage"]["completion_tokens"] <= 12
    status, r = daemon.json("POST", "/v1/chat/completions",
                            {"messages": CHAT, "max_tokens": 16, "temperature": 0})
    assert status == 200, r
    assert r["object"] == "chat.completion"
    assert r["choices"][0]["message"] == {"role": "assistant", "content": expected["chat"]}


def test_streaming_sse(daemon: Daemon, expected: dict[str, str]) -> None:
    status, headers, data = daemon.call("POST", "/v1/chat/completions", {
        "messages": CHAT, "max_tokens": 16, "temperature": 0, "stream": True})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = sse_events(data)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == expected["chat"]
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_streamed_reply_with_a_stop_list_equals_the_whole_reply(daemon: Daemon) -> None:
    """A stop list that never matches holds text back until the model's end-of-sequence
    token: the SSE stream and the native event stream still carry every character."""
    body = {"messages": CHAT, "max_tokens": 200, "temperature": 0, "stop": ["ZZZZZZZZZZ"]}
    status, whole = daemon.json("POST", "/v1/chat/completions", body)
    assert status == 200 and whole["choices"][0]["finish_reason"] == "stop", whole
    text = whole["choices"][0]["message"]["content"]
    assert len(text) > 10
    status, _, data = daemon.call("POST", "/v1/chat/completions", {**body, "stream": True})
    chunks = [json.loads(e) for e in sse_events(data)[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == text
    status, r = daemon.json("POST", "/v1/requests", body)
    assert status == 202
    status, _, data = daemon.call("GET", f"/v1/requests/{r['id']}/events?from=0")
    events = [json.loads(e) for e in sse_events(data)]
    assert "".join(e["text"] for e in events[:-1]) == text == events[-1]["text"]


def test_malformed_and_bad_fields_are_400_naming_the_field(daemon: Daemon) -> None:
    status, _, data = daemon.call("POST", "/v1/completions", raw=b'{"prompt": "x",')
    err = json.loads(data)["error"]
    assert status == 400 and err["code"] == "malformed_json" and "line 1" in err["message"]
    cases = [
        ({"prompt": "x", "max_tokens": "ten"}, "'max_tokens'"),
        ({"prompt": "x", "temperature": 9}, "'temperature'"),
        ({"prompt": 5}, "'prompt'"),
        ({"prompt": "x", "stream": "yes"}, "'stream'"),
        ({"prompt": "x", "priority": 11}, "'priority'"),
        ({"prompt": "x", "stop": [1]}, "'stop'"),
    ]
    for body, field in cases:
        status, r = daemon.json("POST", "/v1/completions", body)
        assert status == 400 and field in r["error"]["message"], (body, r)
    status, r = daemon.json("POST", "/v1/chat/completions",
                            {"messages": [{"role": "robot", "content": "x"}]})
    assert status == 400 and "'messages[0].role'" in r["error"]["message"]
    status, r = daemon.json("POST", "/v1/completions", {"prompt": "x", "model": "nope"})
    assert status == 404 and r["error"]["code"] == "model_not_found"
    status, r = daemon.json("GET", "/v2/nothing")
    assert status == 404 and r["error"]["code"] == "not_found"
    status, headers, _ = daemon.call("GET", "/v1/completions")
    assert status == 405 and headers["allow"] == "POST"
    # HEAD /health: the status line only, for probes that send HEAD
    status, headers, data = daemon.call("HEAD", "/health")
    assert (status, data) == (200, b"")
    status, r = daemon.json("POST", "/v1/completions", {"prompt": "word " * 600})
    assert status == 400 and "context" in r["error"]["message"]


def test_oversized_body_is_413(daemon: Daemon) -> None:
    status, _, data = daemon.call("POST", "/v1/completions",
                                  raw=json.dumps({"prompt": "x" * (MAX_BODY + 1)}).encode())
    assert status == 413
    assert json.loads(data)["error"]["code"] == "body_too_large"
    # under /api/ the same refusal speaks Ollama's shape, as every error there does
    status, _, data = daemon.call("POST", "/api/generate",
                                  raw=json.dumps({"prompt": "x" * (MAX_BODY + 1)}).encode())
    assert status == 413
    error = json.loads(data)["error"]
    assert isinstance(error, str) and f"limit of {MAX_BODY} bytes" in error
    # a malformed chunked body too
    status, _, data = daemon.call("POST", "/api/generate", raw=b"zz\r\nnot-a-chunk\r\n0\r\n\r\n",
                                  headers={"Transfer-Encoding": "chunked"})
    assert status == 400 and isinstance(json.loads(data)["error"], str), data


def test_deadline_of_1ms_is_504_with_durations(daemon: Daemon) -> None:
    status, r = daemon.json("POST", "/v1/completions",
                            {"prompt": "x", "max_tokens": 16, "timeout_ms": 1})
    assert status == 504, r
    err = r["error"]
    assert err["code"] == "deadline_exceeded"
    assert "queued" in err["message"] and "ran" in err["message"]
    assert err["queued_s"] >= 0 and err["ran_s"] >= 0
    daemon.wait_quiet()


def test_full_queue_is_503_and_cancel_frees_blocks(daemon: Daemon) -> None:
    ids = []
    for i in range(QUEUE_MAX):
        status, r = daemon.json("POST", "/v1/requests",
                                {"prompt": f"Story {i}:", "max_tokens": 400, "temperature": 0})
        assert status == 202, r
        ids.append(r["id"])
    status, headers, data = daemon.call("POST", "/v1/completions", {"prompt": "x"})
    assert status == 503 and int(headers["retry-after"]) >= 1
    assert json.loads(data)["error"]["code"] == "queue_full"
    for rid in ids:
        status, r = daemon.json("DELETE", f"/v1/requests/{rid}")
        assert status == 200 and r["state"] == "cancelled"
    daemon.wait_quiet()
    status, r = daemon.json("GET", f"/v1/requests/{ids[0]}")
    assert r["state"] == "cancelled" and r["completion_tokens"] < 400
    status, r = daemon.json("DELETE", "/v1/requests/req-unknown")
    assert status == 404


def test_disconnect_mid_stream_stops_generation(daemon: Daemon) -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    s.connect(str(daemon.sock))
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0,
                       "stream": True}).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    buf = b""
    while b'"id": "' not in buf:
        chunk = s.recv(4096)
        assert chunk, buf
        buf += chunk
    rid = buf.split(b'"id": "')[1].split(b'"')[0].decode()
    s.close()
    daemon.wait_quiet()
    status, r = daemon.json("GET", f"/v1/requests/{rid}")
    assert r["state"] == "cancelled" and r["completion_tokens"] < 400


def test_native_request_events_resume(daemon: Daemon, expected: dict[str, str]) -> None:
    status, r = daemon.json("POST", "/v1/requests",
                            {"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0})
    assert status == 202
    rid = r["id"]
    status, _, data = daemon.call("GET", f"/v1/requests/{rid}/events?from=0")
    events = [json.loads(e) for e in sse_events(data)]
    assert events[-1]["state"] == "done" and events[-1]["text"] == expected[PROMPTS[0]]
    pieces = events[:-1]
    assert [e["index"] for e in pieces] == list(range(len(pieces)))
    assert "".join(e["text"] for e in pieces) == expected[PROMPTS[0]]
    status, _, data = daemon.call("GET", f"/v1/requests/{rid}/events?from=5")
    later = [json.loads(e) for e in sse_events(data)][:-1]
    assert "".join(e["text"] for e in later) == "".join(e["text"] for e in pieces[5:])
    status, _, _ = daemon.call("GET", f"/v1/requests/{rid}/events?from=x")
    assert status == 400


def test_runner_killed_mid_generation_requests_complete(
        daemon: Daemon, expected: dict[str, str]) -> None:
    before = daemon.health()["models"]["smollm2"]
    results: dict[int, tuple[int, Any]] = {}

    def run(i: int) -> None:
        results[i] = daemon.json("POST", "/v1/completions",
                                 {"prompt": PROMPTS[0], "max_tokens": 40, "temperature": 0})

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    end = time.monotonic() + 60
    while daemon.health()["models"]["smollm2"]["active"] < 2:  # both are generating
        assert time.monotonic() < end
        time.sleep(0.01)
    os.kill(before["runner_pid"], signal.SIGKILL)
    for t in threads:
        t.join(120)
    for i in range(2):
        status, r = results[i]
        assert status == 200, r
        assert r["choices"][0]["text"] == expected["long"]
    after = daemon.wait_quiet()["models"]["smollm2"]
    assert after["runner_pid"] not in (None, before["runner_pid"])
    assert after["losses"] == before["losses"] + 1
    status, _, data = daemon.call("GET", "/metrics")
    text = data.decode()
    assert 'edge_agent_model_events_total{model="smollm2",event="runner_lost"} 1' in text
    assert "edge_agent_batch_size_bucket" in text


def test_unload_then_load_on_demand(daemon: Daemon, expected: dict[str, str]) -> None:
    status, m = daemon.json("POST", "/v1/models/smollm2/unload")
    assert status == 200 and m["state"] == "unloaded" and m["runner_pid"] is None
    status, r = daemon.json("POST", "/v1/completions",
                            {"prompt": PROMPTS[1], "max_tokens": 12, "temperature": 0})
    assert status == 200 and r["choices"][0]["text"] == expected[PROMPTS[1]]
    status, m = daemon.json("POST", "/v1/models/smollm2/load")
    assert status == 200 and m["state"] in ("idle", "serving") and m["loads"] >= 3
    status, r = daemon.json("POST", "/v1/models/nope/load")
    assert status == 404


def test_sigterm_drains_running_request_and_stops_cleanly(
        daemon: Daemon, expected: dict[str, str]) -> None:
    result: list[tuple[int, Any]] = []
    t = threading.Thread(target=lambda: result.append(daemon.json(
        "POST", "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 40, "temperature": 0})))
    t.start()
    end = time.monotonic() + 60
    while daemon.health()["models"]["smollm2"]["active"] < 1:
        assert time.monotonic() < end
        time.sleep(0.01)
    daemon.proc.send_signal(signal.SIGTERM)
    daemon.wait_notify("STOPPING=1", 30)
    t.join(60)
    status, r = result[0]
    assert status == 200 and r["choices"][0]["text"] == expected["long"]  # drained, not cut
    assert daemon.proc.wait(30) == 0
    assert not daemon.sock.exists()
    # The watchdog is still fed while draining (systemd would abort a drain > WatchdogSec).
    with daemon.changed:
        after = daemon.messages[next(i for i, m in enumerate(daemon.messages)
                                     if "STOPPING=1" in m.split("\n")):]
    assert any("WATCHDOG=1" in m.split("\n") for m in after), after
    # Over this module's whole run (bad bodies, a full queue, cancels, disconnects mid-stream,
    # a runner killed): errors were answered and logged as such, never as a stray traceback.
    log = daemon.log.read_text(errors="replace")
    assert "Traceback" not in log and "never retrieved" not in log, log[-3000:]


def test_bad_config_exits_78(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text("[scheduler]\nqueue_maks = 3\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("EDGE_AGENT_")}
    r = subprocess.run([sys.executable, "-m", "edge_agent", "serve", "--config", str(cfg)],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 78, r.stderr
    assert "queue_maks" in r.stderr and str(cfg) in r.stderr
    r = subprocess.run([sys.executable, "-m", "edge_agent", "serve", "--config",
                        str(tmp_path / "missing.toml")], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 78 and "missing.toml" in r.stderr


def test_make_run_in_a_checkout_no_flags_then_ctrl_c(prepared_state_dir: Path) -> None:
    """`make run` as the Makefile runs it, in a checkout: status, models, journal, model info
    and generate find it from the checkout with no flags; /health and status give wall-clock
    times; Ctrl-C (SIGINT to the terminal's process group: daemon and runner) stops it with
    exit 0 and no traceback."""
    from datetime import datetime

    from daemon_proc import daemon_env
    from journal_harness import link_prepared

    root = Path(tempfile.mkdtemp(prefix="ea-co-", dir="/tmp"))
    co = root / "co"
    (co / "docs").mkdir(parents=True)
    (co / "edge_agent").symlink_to(REPO / "edge_agent")  # `python -m` imports it from the cwd
    (co / "pyproject.toml").write_text('[project]\nname = "edge-agent"\n')
    link_prepared(prepared_state_dir, co / ".state")
    env = daemon_env(root, {"EDGE_AGENT_MODELS__SMOLLM2__PRELOAD": "true",
                            "EDGE_AGENT_MODELS__SMOLLM2__CONTEXT": str(CONTEXT),
                            "EDGE_AGENT_MODELS__SMOLLM2__MAX_BATCH": "2",
                            "EDGE_AGENT_RUNTIME__MLOCK": "off"})
    cli_env = {k: v for k, v in os.environ.items()
               if not k.startswith("EDGE_AGENT_") and k not in ("NOTIFY_SOCKET",)}
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(root / "notify.sock"))
    log = root / "daemon.log"
    with log.open("wb") as fh:  # the Makefile's `run` recipe, a session of its own like a shell
        proc = subprocess.Popen([sys.executable, "-m", "edge_agent", "--state-dir", ".state",
                                 "serve", "--socket", ".state/edge-agent.sock"], cwd=co,
                                env=env, stdout=fh, stderr=fh, start_new_session=True)
    d = Daemon(root, proc, notify, log)

    def ea(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "edge_agent", *argv], cwd=co / "docs",
                              env=cli_env, capture_output=True, text=True, timeout=120)

    try:
        d.wait_notify("READY=1", 180)
        st = ea("status")
        assert st.returncode == 0, st.stderr
        head = st.stdout.splitlines()[0]
        assert f"socket {co / '.state' / 'edge-agent.sock'})" in head, st.stdout
        since = head.split(" since ")[1].split(",")[0]
        started = datetime.fromisoformat(since)
        assert started.utcoffset() is not None and abs(started.timestamp() - time.time()) < 300
        health = json.loads(ea("status", "--json").stdout)["health"]
        assert isinstance(health["uptime_s"], float)
        for key in ("since", "last_used"):
            assert datetime.fromisoformat(health["models"]["smollm2"][key]).utcoffset() \
                is not None
        models = ea("models")
        assert models.returncode == 0 and models.stdout.split()[4] == "smollm2", models
        gen = ea("generate", "--max-tokens", "6", PROMPTS[0])
        assert gen.returncode == 0 and gen.stdout.strip(), gen.stderr
        assert "generating through the daemon on " + str(co / ".state" / "edge-agent.sock") \
            in gen.stderr
        journal = ea("journal", "stats", "--json")
        assert journal.returncode == 0, journal.stderr
        assert str(co / ".state" / "journal.sqlite3") in journal.stdout + journal.stderr
        info = ea("model", "info", "--json")
        assert info.returncode == 0, info.stderr
        f32 = next(e for e in json.loads(info.stdout)["prepared"] if e["dtype"] == "f32")
        assert f32["exists"] and f32["path"].startswith(str(co / ".state")), info.stdout
        # Ctrl-C: the terminal sends SIGINT to every process of the foreground group
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(60) == 0, d.log_tail()
        text = log.read_text(errors="replace")
        assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        notify.close()
        shutil.rmtree(root, ignore_errors=True)


def test_make_run_from_a_fresh_checkout_makes_its_state_and_serial_console(
        tmp_path: Path) -> None:
    """The Makefile's own `run` recipe where no state directory exists yet (a fresh clone):
    socat's pty pair is made inside it, the daemon serves with the serial console on the pty,
    and Ctrl-C stops the daemon, then socat (no link lost while the daemon drains, no link left
    behind)."""
    from daemon_proc import daemon_env
    from interrupt import foreground

    assert shutil.which("make") and shutil.which("socat"), "make test installs both"
    state = tmp_path / "clone" / ".state"  # absent, as in a fresh clone
    venv = Path(sys.executable).parent.parent
    env = daemon_env(tmp_path, {"EDGE_AGENT_MODELS__SMOLLM2__CONTEXT": str(CONTEXT),
                                "EDGE_AGENT_MODELS__SMOLLM2__MAX_BATCH": "2",
                                "EDGE_AGENT_RUNTIME__MLOCK": "off", "PYTHONFAULTHANDLER": "1"})
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify.sock"))
    log = tmp_path / "make-run.log"
    with log.open("wb") as fh:  # `-o venv`: this test's interpreter is the installation
        proc = subprocess.Popen(["make", "--no-print-directory", "-C", str(REPO), "-o", "venv",
                                 "run", f"STATE={state}", f"VENV={venv}"], env=env,
                                stdout=fh, stderr=fh, preexec_fn=foreground,
                                start_new_session=True)
    d = Daemon(tmp_path, proc, notify, log)
    d.sock = state / "edge-agent.sock"  # the recipe's socket
    try:
        d.wait_notify("READY=1", 180)
        health = d.health()
        assert health["status"] == "serving", health
        assert health["serial"] == [{"url": str(state / "uart"), "up": True, "link_lost": 0,
                                     "reopens": 0, "open_failures": 0}], health["serial"]
        assert (state / "console").is_symlink()
        status, out = d.json("POST", "/v1/completions", {"prompt": "Once", "max_tokens": 4})
        assert status == 200, out  # a model loaded: the drain outlasts a Ctrl-C'd socat
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the whole foreground group
        proc.wait(60)
        text = log.read_text(errors="replace")
        assert "serial console on a pty: picocom -b 115200 " + str(state / "console") in text
        assert "edge-agent: stopped" in text and "Traceback" not in text, text[-3000:]
        # socat has its own session: the terminal's Ctrl-C is not its, it goes after the daemon
        assert "link lost" not in text, text[-3000:]
        assert not (state / "console").is_symlink() and not (state / "uart").is_symlink()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        notify.close()


def test_make_run_without_socat_serves_without_the_serial_console(tmp_path: Path) -> None:
    """`make run` where socat is not installed (PATH has every command but socat): the recipe
    says how to get the console, the daemon serves without a serial port, and Ctrl-C stops
    it."""
    from daemon_proc import daemon_env
    from interrupt import foreground

    bin_dir = tmp_path / "bin"  # the caller's PATH, socat left out
    bin_dir.mkdir()
    for folder in os.environ["PATH"].split(os.pathsep):
        with contextlib.suppress(OSError):
            for entry in os.scandir(folder):
                target = bin_dir / entry.name
                if entry.name != "socat" and not target.exists():
                    target.symlink_to(entry.path)
    state = tmp_path / "clone" / ".state"
    venv = Path(sys.executable).parent.parent
    env = daemon_env(tmp_path, {"EDGE_AGENT_MODELS__SMOLLM2__CONTEXT": str(CONTEXT),
                                "EDGE_AGENT_MODELS__SMOLLM2__MAX_BATCH": "2",
                                "EDGE_AGENT_RUNTIME__MLOCK": "off", "PATH": str(bin_dir)})
    assert shutil.which("socat", path=env["PATH"]) is None and shutil.which("make")
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify.sock"))
    log = tmp_path / "make-run.log"
    with log.open("wb") as fh:
        proc = subprocess.Popen([str(shutil.which("make")), "--no-print-directory", "-C",
                                 str(REPO), "-o", "venv", "run", f"STATE={state}",
                                 f"VENV={venv}"], env=env, stdout=fh, stderr=fh,
                                preexec_fn=foreground, start_new_session=True)
    d = Daemon(tmp_path, proc, notify, log)
    d.sock = state / "edge-agent.sock"
    try:
        d.wait_notify("READY=1", 180)
        health = d.health()
        assert health["status"] == "serving" and "serial" not in health, health  # no port
        assert not (state / "console").exists() and not (state / "uart").exists()
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(60)
        text = log.read_text(errors="replace")
        assert "(install socat to get the serial console on a pty)" in text, text[-3000:]
        assert "edge-agent: stopped" in text and "Traceback" not in text, text[-3000:]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        notify.close()
