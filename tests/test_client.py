"""DaemonClient and `edge-agent status|models|chat` against a small real HTTP server on a Unix
socket (stdlib http.server in a thread): real sockets, real HTTP framing (chunked and
close-delimited streams), real SSE bytes."""

from __future__ import annotations

import copy
import io
import json
import shutil
import socket
import socketserver
import threading
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest

from edge_agent import cli
from edge_agent.client import DaemonClient, DaemonError, DaemonUnavailable
from edge_agent.commands.client import render_health
from edge_agent.errors import EdgeAgentError

# /health as a real daemon gave it (`make run`, the default model preloaded and idle, on a host
# whose memory controller sits on cgroup v1); test_daemon_e2e checks that a live daemon's
# /health still has every section and key this capture has.
HEALTH_FILE = Path(__file__).parent / "data" / "health_serving.json"
HEALTH = json.loads(HEALTH_FILE.read_text())


class FakeDaemon(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

    def __init__(self, path: str) -> None:
        self.requests: list[tuple[str, str, Any]] = []
        self.health_code = 200
        super().__init__(path, Handler)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: FakeDaemon

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass

    def _json(self, code: int, body: Any, headers: dict[str, str] | None = None) -> None:
        raw = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(raw)

    def _body(self) -> Any:
        n = int(self.headers.get("Content-Length") or 0)
        return json.loads(self.rfile.read(n)) if n else None

    def do_GET(self) -> None:  # noqa: N802 - stdlib name
        self.server.requests.append(("GET", self.path, None))
        if self.path == "/health":
            self._json(self.server.health_code, HEALTH)
        elif self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [  # as edge_agent/daemon/routes.py
                {"id": "smollm2", "object": "model", "owned_by": "edge-agent", "created": 0,
                 "state": "serving", "context": 2048, "max_batch": 8},
                {"id": "coder", "object": "model", "owned_by": "edge-agent", "created": 0,
                 "state": "unloaded", "context": 4096, "max_batch": 16}]})
        elif self.path == "/metrics":
            raw = b"boom"
            self.send_response(500)
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)
        elif self.path.startswith("/v1/requests/"):
            self._json(200, {"id": self.path.split("/")[3], "state": "running"})
        else:
            self._json(404, {"error": {"code": "not_found", "message": f"no route {self.path}"}})

    def do_DELETE(self) -> None:  # noqa: N802
        self.server.requests.append(("DELETE", self.path, None))
        self._json(200, {"id": self.path.split("/")[-1], "state": "cancelled"})

    def do_POST(self) -> None:  # noqa: N802
        body = self._body()
        self.server.requests.append(("POST", self.path, body))
        if self.path == "/v1/requests":
            self._json(202, {"id": "req-1", "state": "queued"})
        elif self.path == "/v1/chat/completions" and body.get("stream"):
            reply = "Echo: " + body["messages"][-1]["content"]
            self._sse_chunked([{"choices": [{"index": 0, "delta": {"role": "assistant"}}]}]
                              + [{"choices": [{"index": 0, "delta": {"content": reply[i:i + 4]}}]}
                                 for i in range(0, len(reply), 4)])
        elif self.path == "/v1/completions" and body.get("prompt") == "full":
            self._json(503, {"error": {"code": "queue_full", "message": "queue full (64/64). "
                                       "Hint: retry after 2 s"}}, {"Retry-After": "2"})
        elif self.path == "/v1/completions" and body.get("stream"):
            if body["prompt"] == "fail":
                events = [{"choices": [{"text": "par"}]},
                          {"error": {"code": "deadline_exceeded", "message": "queued 1 ms"}}]
            else:
                events = [{"choices": [{"text": "Once"}]}, {"choices": [{"text": " upon"}]}]
            self._sse_close_delimited(events)
        elif self.path == "/v1/completions":
            self._json(200, {"choices": [{"text": "ok", "index": 0}]})
        else:
            self._json(400, {"error": {"code": "invalid_request", "message": "field 'x'"}})

    def _sse_chunked(self, events: list[dict[str, Any]]) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for i, ev in enumerate(events):
            data = f": keep-alive\nid: {i}\ndata: {json.dumps(ev)}\n\n".encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        done = b"data: [DONE]\n\n"
        self.wfile.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))

    def _sse_close_delimited(self, events: list[dict[str, Any]]) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        for ev in events:
            self.wfile.write(f"data: {json.dumps(ev)}\r\n\r\n".encode())
        self.close_connection = True


@pytest.fixture
def short_dir() -> Iterator[Path]:
    d = Path(f"/tmp/ea-cl-{uuid.uuid4().hex[:8]}")
    d.mkdir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def daemon(short_dir: Path) -> Iterator[FakeDaemon]:
    server = FakeDaemon(str(short_dir / "api.sock"))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def client(server: FakeDaemon) -> DaemonClient:
    return DaemonClient(server.server_address, timeout=10)  # type: ignore[arg-type]  # a unix server's address is its path (str)


# ----- the library -----------------------------------------------------------------------------


def test_health_models_and_requests(daemon: FakeDaemon) -> None:
    c = client(daemon)
    assert c.available()
    assert c.health() == HEALTH
    assert [m["id"] for m in c.models()] == ["smollm2", "coder"]
    assert c.submit("hi", max_tokens=4) == "req-1"
    assert daemon.requests[-1] == ("POST", "/v1/requests", {"max_tokens": 4, "prompt": "hi"})
    assert c.get_request("a/b")["id"] == "a%2Fb"  # ids are quoted into the path
    assert c.cancel("req-1") == {"id": "req-1", "state": "cancelled"}
    assert c.complete("x")["choices"][0]["text"] == "ok"


def test_stream_chat_chunked(daemon: FakeDaemon) -> None:
    pieces = list(client(daemon).stream_completion(
        messages=[{"role": "user", "content": "hello there"}], max_tokens=8))
    assert "".join(pieces) == "Echo: hello there" and len(pieces) > 1
    assert daemon.requests[-1][2]["stream"] is True


def test_stream_completion_close_delimited(daemon: FakeDaemon) -> None:
    assert list(client(daemon).stream_completion("Tell")) == ["Once", " upon"]


def test_stream_error_event_raises(daemon: FakeDaemon) -> None:
    stream = client(daemon).stream_completion("fail")
    assert next(stream) == "par"
    with pytest.raises(DaemonError, match="queued 1 ms") as err:
        next(stream)
    assert err.value.code == "deadline_exceeded"


def test_http_errors_map_to_daemon_error(daemon: FakeDaemon) -> None:
    c = client(daemon)
    with pytest.raises(DaemonError) as err:
        c.complete("full")
    e = err.value
    assert (e.code, e.status, e.retry_after) == ("queue_full", 503, 2.0)
    assert "POST /v1/completions: HTTP 503 queue_full: queue full (64/64)" in str(e)
    with pytest.raises(DaemonError) as err:
        c.metrics()
    assert (err.value.code, err.value.status) == ("http_500", 500) and "boom" in str(err.value)
    with pytest.raises(DaemonError, match=r"POST /v1/models/x/load: HTTP 400 invalid_request: "
                       r"field 'x'") as err:
        c.load_model("x")
    assert err.value.code == "invalid_request" and err.value.status == 400
    with pytest.raises(ValueError, match="exactly one of prompt or messages"):
        next(c.stream_completion())


def test_unavailable_when_absent_refused_or_not_http(short_dir: Path) -> None:
    absent = DaemonClient(short_dir / "absent.sock", timeout=5)
    assert absent.available() is False
    with pytest.raises(DaemonUnavailable) as err:
        absent.health()
    assert isinstance(err.value, EdgeAgentError) and isinstance(err.value, OSError)
    assert "absent.sock: No such file or directory. Hint: start the daemon" in str(err.value)

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as bound:  # bound, not listening
        bound.bind(str(short_dir / "refused.sock"))
        refused = DaemonClient(short_dir / "refused.sock", timeout=5)
        assert refused.available() is False
        with pytest.raises(DaemonUnavailable, match="Connection refused"):
            refused.models()

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as rude:  # accepts, then hangs up
        rude.bind(str(short_dir / "rude.sock"))
        rude.listen()

        def hang_up() -> None:
            for _ in range(2):
                conn, _ = rude.accept()
                conn.recv(1024)
                conn.close()

        t = threading.Thread(target=hang_up)
        t.start()
        c = DaemonClient(short_dir / "rude.sock", timeout=5)
        assert c.available() is False
        with pytest.raises(DaemonError, match="is this socket an edge-agent daemon") as err:
            c.health()
        assert err.value.code == "protocol"
        t.join(10)


def test_timeout_is_a_daemon_error(short_dir: Path) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as silent:  # listens, never answers
        silent.bind(str(short_dir / "silent.sock"))
        silent.listen()
        with pytest.raises(DaemonError, match=r"no answer within 0\.2 s") as err:
            DaemonClient(short_dir / "silent.sock", timeout=0.2).health()
        assert err.value.code == "timeout"


# ----- the CLI ---------------------------------------------------------------------------------


def test_status_human_and_json(daemon: FakeDaemon, capsys: pytest.CaptureFixture[str]) -> None:
    sock = str(daemon.server_address)
    assert cli.main(["status", "--socket", sock]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == f"edge-agent: serving (pid 19230, up 4m46s, HTTP 200, socket {sock})"
    assert lines[1] == ("queue:     depth 0 of 64 (queued 0, running 0, done 2, expired 0, "
                        "cancelled 0, failed 0)")
    assert lines[2] == ('pressure:  normal (stage 0), admitting; psi trigger "some 300000 '
                        '2000000" on /proc/pressure/memory, 0 events')
    assert lines[3] == ("journal:   /tmp/walk/.state/journal.sqlite3 (synchronous FULL, "
                        "ack durable), 215 decode steps committed")
    assert lines[4].startswith("cgroup:    not available: the memory controller is bound to "
                               "the cgroup v1 hierarchy")
    assert lines[5].startswith("           fix: boot with the unified hierarchy")
    assert lines[6:] == [
        "models:",
        "  NAME     STATE  LOADS  RUNNING  QUEUED  BATCH  CONTEXT  KV FREE    WEIGHTS LOCKED",
        "  smollm2  idle   1      0        0       8      2048     1024/1024  513 MiB of 513 MiB",
    ]
    assert "{" not in out  # no section dumped as raw JSON
    assert cli.main(["status", "--json", "--socket", sock]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc == {"available": True, "socket": sock, "http_status": 200, "health": HEALTH}
    daemon.health_code = 503
    assert cli.main(["status", "--socket", sock]) == 1  # not serving yet


def test_status_text_for_trouble() -> None:
    """What an operator must see without --json: why a model failed, why its weights are not
    locked, a pressure stage that refuses work, the cgroup in use, and sections the renderer
    does not know (shown as key=value, not dropped)."""
    h = copy.deepcopy(HEALTH)
    h["status"] = "degraded"
    h["uptime_s"] = 2 * 86400 + 3 * 3600 + 5
    m = h["models"]["smollm2"]
    m.update(state="failed", reason="runner exited with signal 9 (SIGKILL) 3 times in 60 s")
    m["mlock"].update(locked=False, locked_bytes=0, error="mlock: Cannot allocate memory "
                      "(RLIMIT_MEMLOCK 8 MiB)")
    h["pressure"].update(stage=2, name="shed", admitting=False)
    h["cgroup"] = {"available": True, "reason": None, "fix": None, "base": "/sys/fs/cgroup/ea",
                   "policy": "default", "models": {"smollm2": "/sys/fs/cgroup/ea/models/smollm2"},
                   "warnings": ["memory.swap.max is not writable here"],
                   "service_memory_max": 2 << 30, "oom_kills": {"smollm2": 2}}
    h["gadget"] = {"port": "/dev/ttyS0", "open": True}  # a section status does not know
    h["serial"] = [{"url": "/dev/ttyAMA0", "up": False, "link_lost": 2, "reopens": 1,
                    "open_failures": 7}, {"url": "/dev/ttyS1", "up": True}]
    text = render_health(h, "/run/edge-agent.sock", 503)
    lines = text.splitlines()
    assert lines[0] == ("edge-agent: degraded (pid 19230, up 2d03h, HTTP 503, "
                        "socket /run/edge-agent.sock)")
    assert lines[2].startswith("pressure:  shed (stage 2), refusing new requests; ")
    assert lines[4:10] == [
        "cgroup:    /sys/fs/cgroup/ea (policy default, service memory.max 2147483648, "
        "OOM kills 2)",
        "           warning: memory.swap.max is not writable here",
        "serial:    /dev/ttyAMA0 DOWN (reopening); link lost 2, reopened 1, failed opens 7",
        "           /dev/ttyS1 up; link lost -, reopened -, failed opens -",
        "gadget:    port=/dev/ttyS0, open=yes",
        "models:",
    ]
    assert lines[11].split() == ["smollm2", "failed", "1", "0", "0", "8", "2048", "1024/1024",
                                 "no", "(best-effort)"]
    assert lines[12:] == [
        "  smollm2: runner exited with signal 9 (SIGKILL) 3 times in 60 s",
        "  smollm2: weights not locked: mlock: Cannot allocate memory (RLIMIT_MEMLOCK 8 MiB)",
    ]


def test_status_text_with_only_the_headline() -> None:
    """A daemon still starting may answer with little more than its state."""
    assert render_health({"status": "loading"}, "/s", 503) == \
        "edge-agent: loading (HTTP 503, socket /s)"
    assert render_health({}, "/s", 200) == "edge-agent: ok (HTTP 200, socket /s)"
    for uptime, shown in ((5.7, "5s"), (60, "1m00s"), (3720.2, "1h02m"), (86399, "23h59m")):
        assert render_health({"status": "loading", "uptime_s": uptime}, "/s", 503) == \
            f"edge-agent: loading (up {shown}, HTTP 503, socket /s)"


def test_status_when_daemon_is_down(short_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sock = str(short_dir / "none.sock")
    assert cli.main(["status", "--socket", sock]) == 1
    assert "Hint: start the daemon" in capsys.readouterr().err
    assert cli.main(["status", "--json", "--socket", sock]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["available"] is False and doc["error"]["code"] == "unavailable"


def test_status_socket_from_configuration(daemon: FakeDaemon, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("EDGE_AGENT_SERVER__SOCKET", str(daemon.server_address))
    assert cli.main(["status", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["socket"] == str(daemon.server_address)


def test_models_command(daemon: FakeDaemon, capsys: pytest.CaptureFixture[str]) -> None:
    sock = str(daemon.server_address)
    assert cli.main(["models", "--socket", sock]) == 0
    assert capsys.readouterr().out.splitlines() == ["NAME     STATE     CONTEXT  BATCH",
                                                    "smollm2  serving   2048     8",
                                                    "coder    unloaded  4096     16"]
    assert cli.main(["models", "--json", "--socket", sock]) == 0
    assert json.loads(capsys.readouterr().out)[0]["id"] == "smollm2"


def test_chat_keeps_the_conversation(daemon: FakeDaemon, monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n\nagain\n/exit\nnever sent\n"))
    assert cli.main(["chat", "--socket", str(daemon.server_address), "--system", "Be brief.",
                     "--max-tokens", "5", "--seed", "3"]) == 0
    assert capsys.readouterr().out == "Echo: hello\nEcho: again\n"
    posts = [r for r in daemon.requests if r[0] == "POST"]
    assert len(posts) == 2
    last = posts[-1][2]
    assert last["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "Echo: hello"},
        {"role": "user", "content": "again"},
    ]
    assert last["max_tokens"] == 5 and last["seed"] == 3 and "temperature" not in last


def test_chat_reset_and_errors(daemon: FakeDaemon, monkeypatch: pytest.MonkeyPatch,
                               short_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("one\n/reset\ntwo\n"))
    assert cli.main(["chat", "--socket", str(daemon.server_address)]) == 0
    assert daemon.requests[-1][2]["messages"] == [{"role": "user", "content": "two"}]
    capsys.readouterr()
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\n"))
    assert cli.main(["chat", "--socket", str(short_dir / "none.sock")]) == 1
    assert "Hint: start the daemon" in capsys.readouterr().err


# ----- where the state directory and the socket are (edge_agent.paths) -------------------------


def _checkout(root: Path) -> Path:
    """A directory that looks like an edge-agent checkout (what paths.checkout_root looks for)."""
    (root / "edge_agent").mkdir(parents=True, exist_ok=True)
    (root / "edge_agent" / "paths.py").write_text("")
    (root / "pyproject.toml").write_text('[project]\nname = "edge-agent"\n')
    return root


@pytest.fixture
def no_location_env(monkeypatch: pytest.MonkeyPatch, short_dir: Path) -> Path:
    """No EDGE_AGENT_*/systemd variables, no config file, no systemd install (its directories
    pointed into short_dir, absent)."""
    import os

    from edge_agent import config, paths

    for var in list(os.environ):
        if var.startswith("EDGE_AGENT_") or var in ("STATE_DIRECTORY", "RUNTIME_DIRECTORY"):
            monkeypatch.delenv(var)
    monkeypatch.setenv("XDG_STATE_HOME", str(short_dir / "xdg"))
    monkeypatch.setattr(paths, "SYSTEM_STATE_DIR", short_dir / "var-lib-edge-agent")
    monkeypatch.setattr(paths, "SYSTEM_RUNTIME_DIR", short_dir / "run-edge-agent")
    monkeypatch.setattr(config, "DEFAULT_CONFIG_PATH", short_dir / "no-config.toml")
    return short_dir


def test_state_dir_and_socket_rule(no_location_env: Path,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from edge_agent import paths

    root = no_location_env
    outside = root / "elsewhere"
    outside.mkdir()
    co = _checkout(root / "co")
    (co / "edge_agent" / "sub").mkdir()
    env: dict[str, str] = {"XDG_STATE_HOME": str(root / "xdg")}
    # XDG when nothing else applies; the socket sits in the state directory
    loc = paths.locate(env=env, cwd=outside)
    assert (loc.state_dir, loc.socket) == (root / "xdg" / "edge-agent",
                                           root / "xdg" / "edge-agent" / "edge-agent.sock")
    # a checkout (from any directory inside it): CHECKOUT/.state, the socket `make run` serves on
    for cwd in (co, co / "edge_agent" / "sub"):
        loc = paths.locate(env=env, cwd=cwd)
        assert (loc.state_dir, loc.socket) == (co / ".state", co / ".state" / "edge-agent.sock")
        assert str(co) in loc.why
    # the systemd install, once its socket or state directory exists
    paths.SYSTEM_RUNTIME_DIR.mkdir()
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(paths.SYSTEM_RUNTIME_DIR / "edge-agent.sock"))
    loc = paths.locate(env=env, cwd=outside)
    assert (loc.state_dir, loc.socket) == (paths.SYSTEM_STATE_DIR,
                                           paths.SYSTEM_RUNTIME_DIR / "edge-agent.sock")
    assert paths.locate(env=env, cwd=co).state_dir == co / ".state"  # the checkout comes first
    # systemd's own variables (inside the service), then EDGE_AGENT_STATE_DIR, then the flag
    sd = {**env, "STATE_DIRECTORY": "/var/lib/x:/o", "RUNTIME_DIRECTORY": "/run/x"}
    loc = paths.locate(env=sd, cwd=co)
    assert (loc.state_dir, loc.socket) == (Path("/var/lib/x"), Path("/run/x/edge-agent.sock"))
    loc = paths.locate(env={**env, "EDGE_AGENT_STATE_DIR": "/srv/ea"}, cwd=co)
    assert (loc.state_dir, loc.socket) == (Path("/srv/ea"), Path("/srv/ea/edge-agent.sock"))
    loc = paths.locate("/opt/st", env={**env, "EDGE_AGENT_STATE_DIR": "/srv/ea"}, cwd=co)
    assert (loc.state_dir, loc.socket, loc.why) == (Path("/opt/st"),
                                                    Path("/opt/st/edge-agent.sock"), "--state-dir")
    # naming the system state directory keeps the system socket
    assert paths.locate(str(paths.SYSTEM_STATE_DIR), env=env).socket == \
        paths.SYSTEM_RUNTIME_DIR / "edge-agent.sock"
    # serve's configuration follows the same rule, and its socket follows --state-dir
    from edge_agent.config import load_config

    monkeypatch.chdir(co)
    c = load_config(None, env={}, check_paths=False)
    assert (c.server.state_dir, c.server.socket) == (co / ".state",
                                                     co / ".state" / "edge-agent.sock")
    c = load_config(None, env={}, check_paths=False, overrides={"server.state_dir": "st"})
    assert (c.server.state_dir, c.server.socket) == (co / "st", co / "st" / "edge-agent.sock")


def _serve_fake(sock: Path) -> tuple[FakeDaemon, threading.Thread]:
    server = FakeDaemon(str(sock))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    return server, thread


def test_commands_find_the_checkout_daemon_with_no_flags(
        no_location_env: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """`make run` serves on CHECKOUT/.state/edge-agent.sock; status and models find it from the
    checkout (and below it) with no flags."""
    co = _checkout(no_location_env / "co")
    (co / ".state").mkdir()
    server, thread = _serve_fake(co / ".state" / "edge-agent.sock")
    try:
        for cwd in (co, co / "edge_agent"):
            monkeypatch.chdir(cwd)
            assert cli.main(["status", "--json"]) == 0
            doc = json.loads(capsys.readouterr().out)
            assert doc["available"] and doc["socket"] == str(co / ".state" / "edge-agent.sock")
            assert cli.main(["models"]) == 0
            assert capsys.readouterr().out.startswith("NAME ")
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def test_global_options_after_the_command(daemon: FakeDaemon, no_location_env: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    sock = Path(str(daemon.server_address))  # short_dir/api.sock
    state = sock.parent / "st"
    state.mkdir()
    (state / "edge-agent.sock").symlink_to(sock)
    for argv in (["status", "--json", "--state-dir", str(state)],
                 ["--state-dir", str(state), "status", "--json"],
                 ["--socket", str(sock), "status", "--json"],
                 ["status", "--json", "--socket", str(sock)],
                 ["models", "-v", "--socket", str(sock)]):
        assert cli.main(argv) == 0, argv
        out = capsys.readouterr().out
        if "--json" in argv:
            assert json.loads(out)["available"] is True
    # after the command wins over before it
    assert cli.main(["--state-dir", "/nowhere", "status", "--json", "--state-dir",
                     str(state)]) == 0
    capsys.readouterr()
    # a top-level --socket for a command that never talks to the daemon is refused
    assert cli.main(["--socket", str(sock), "journal", "stats"]) == 2
    err = capsys.readouterr().err
    assert f"--socket {sock}: `edge-agent journal` does not talk to the daemon" in err
    assert "Hint: drop --socket" in err


@pytest.mark.parametrize(("argv", "prog", "fragment"), [
    (["status", "--bogus"], "edge-agent status", "unrecognized arguments: --bogus"),
    (["model", "info", "--nope"], "edge-agent model info", "unrecognized arguments: --nope"),
    (["generate"], "edge-agent generate", "the following arguments are required: PROMPT"),
    (["generate", "x", "--max-tokens", "many"], "edge-agent generate",
     "argument --max-tokens: invalid int value: 'many'"),
    (["frobnicate"], "edge-agent", "argument COMMAND: invalid choice: 'frobnicate'"),
    # a socket cannot wait 0, a negative or NaN seconds (it was a traceback, or a bogus
    # "is this an edge-agent daemon?" after an instant timeout)
    (["status", "--timeout", "-1"], "edge-agent status",
     "argument --timeout: '-1' seconds: give a number above 0"),
    (["models", "--timeout", "0"], "edge-agent models",
     "argument --timeout: '0' seconds: give a number above 0"),
    (["chat", "--timeout", "nan"], "edge-agent chat",
     "argument --timeout: 'nan' seconds: give a number above 0"),
    (["model"], "edge-agent model", "the following arguments are required: ACTION"),
    (["systemd"], "edge-agent systemd", "the following arguments are required: ACTION"),
    (["status", "--timeout", "soon"], "edge-agent status",
     "argument --timeout: 'soon' is not a number of seconds"),
])
def test_usage_errors_end_with_a_hint(argv: list[str], prog: str, fragment: str,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-2].startswith(f"{prog}: error: {fragment}"), err
    assert err[-1] == f"Hint: run `{prog} --help` for the options and arguments."


def test_no_command_is_a_usage_error_with_a_hint(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        "edge-agent: error: no command given. Hint: ")


# ----- wall-clock times ------------------------------------------------------------------------


def test_health_points_in_time_become_iso_8601() -> None:
    from datetime import datetime

    from edge_agent.wallclock import health_times, iso

    h = copy.deepcopy(HEALTH)
    h["pressure"]["last_change"] = 39100.5
    h["pressure"]["history"] = [{"at": 39100.5, "from": 0, "to": 1}]
    h["models"]["smollm2"]["memory"]["last_oom"] = {"at": 1796019000.25, "event": "oom"}
    wall, now = 1796019500.0, 39300.0
    out = health_times(h, started=39000.0, wall=wall, now=now)
    assert h["models"]["smollm2"]["since"] == 39219.076327461  # the input is not touched
    m = out["models"]["smollm2"]
    for key in ("since", "idle_since", "last_used"):
        t = datetime.fromisoformat(m[key])
        assert t.utcoffset() is not None
        assert abs(t.timestamp() - (wall - (now - 39219.076327461))) < 0.001
    assert datetime.fromisoformat(out["started_at"]).timestamp() == wall - 300.0
    assert out["uptime_s"] == HEALTH["uptime_s"]  # durations stay seconds
    assert out["pressure"]["last_event"] is None  # no event yet: still null
    assert datetime.fromisoformat(out["pressure"]["last_change"]).timestamp() == wall - 199.5
    assert out["pressure"]["history"][0]["at"] == 39100.5  # intervals are computed from it
    assert out["pressure"]["history"][0]["time"] == out["pressure"]["last_change"]
    assert m["memory"]["last_oom"]["at"] == iso(1796019000.25)
    assert out["journal"]["retention"]["at"] == iso(1796019492.565725)
    assert iso(0.0).endswith(("+00:00", "Z")) or iso(0.0)[-6] in "+-"


def test_status_headline_has_the_start_time() -> None:
    h = {"status": "serving", "pid": 7, "uptime_s": 61.0,
         "started_at": "2025-06-01T14:03:07.412+02:00"}
    assert render_health(h, "/s", 200) == ("edge-agent: serving (pid 7, up 1m01s since "
                                           "2025-06-01T14:03:07.412+02:00, HTTP 200, socket /s)")
