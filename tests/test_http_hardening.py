"""Hostile or broken clients: a clear 4xx instead of a dropped connection, and no way to hold
the daemon's connections or descriptors forever (in-process server on a temporary Unix socket,
the real Router over a stand-in daemon; no model)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from edge_agent.daemon.routes import Router
from edge_agent.errors import EdgeAgentError
from edge_agent.protocol.api import (
    MAX_JSON_DEPTH,
    MAX_NUMBER_DIGITS,
    MAX_STRING_CHARS,
    ApiError,
    parse_generation,
)
from edge_agent.systemd_units import render_units
from edge_agent.transports.http import HttpServer, Request, Response, StreamResponse

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parent.parent


# ---- a stand-in daemon for the real Router ---------------------------------------------------

class FakeDaemon:
    """What Router touches for /health, /v1/requests and /v1/requests/ID/events. `submit`
    encodes the text as the tokenizer and journal would, so text that cannot be encoded shows
    up as the EdgeAgentError (503 `unavailable`) it used to become."""

    def __init__(self) -> None:
        self.submitted: list[Any] = []

    def find_request(self, rid: str) -> Any:
        return None  # no request is known

    async def accept(self, greq: Any) -> Any:
        texts = [greq.prompt] if greq.prompt is not None else [m.content for m in greq.messages]
        for text in texts:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise EdgeAgentError(f"tokenizer: {exc}") from exc
        self.submitted.append(greq)
        return SimpleNamespace(id="req-1", to_dict=lambda now: {"id": "req-1", "state": "queued"})


class Handler:
    """/health answers at once, /slow blocks until released, anything else goes to Router."""

    def __init__(self) -> None:
        self.daemon = FakeDaemon()
        self.router = Router(self.daemon)  # type: ignore[arg-type]  # a fake with what the routes use
        self.release = asyncio.Event()
        self.running = 0

    async def handle(self, req: Request) -> Response | StreamResponse:
        if req.path == "/health":
            return Response(200, b'{"status": "serving"}')
        if req.path == "/slow":
            self.running += 1
            try:
                await self.release.wait()
            finally:
                self.running -= 1
            return Response(200, b"{}")
        if req.path == "/echo":
            return Response(200, json.dumps({"len": len(req.body)}).encode())
        if req.path == "/boom":
            raise RuntimeError("handler bug")
        return await self.router.handle(req)


@contextlib.asynccontextmanager
async def serving(**kw: Any) -> AsyncIterator[tuple[HttpServer, Path, Handler, list[str]]]:
    d = Path(tempfile.mkdtemp(prefix="ea-h-", dir="/tmp"))
    logs: list[str] = []
    h = Handler()
    srv = HttpServer(h.handle, log=logs.append, **kw)
    await srv.listen_unix(d / "s.sock")
    try:
        yield srv, d / "s.sock", h, logs
    finally:
        h.release.set()
        await srv.close()
        shutil.rmtree(d, ignore_errors=True)


async def exchange(path: Path, raw: bytes, timeout: float = 5.0) -> bytes:
    """Send `raw`, read until the server closes."""
    reader, writer = await asyncio.open_unix_connection(str(path))
    try:
        writer.write(raw)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()


def get(target: str) -> bytes:
    return f"GET {target} HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n".encode()


def post(target: str, body: bytes) -> bytes:
    return (f"POST {target} HTTP/1.1\r\nHost: a\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body


def status_and_error(raw: bytes) -> tuple[int, dict[str, Any]]:
    assert raw.startswith(b"HTTP/1.1 "), raw[:200]
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head[9:12])
    err = json.loads(body).get("error", {}) if body.startswith(b"{") else {}
    return status, err


def run(coro: Any) -> Any:
    return asyncio.run(coro)


# ---- 1. the JSON schema: limits, surrogates ----------------------------------------------------

def parse_bad(body: bytes) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse_generation(body, chat=None, max_tokens_limit=100)
    err = info.value
    assert err.status == 400 and err.code == "invalid_request", (err.status, err.code, err)
    assert "Hint:" in err.message
    return err


def test_json_nested_2000_deep_is_400_naming_the_limit() -> None:
    err = parse_bad(b'{"prompt": "x", "extra": ' + b"[" * 2000 + b"]" * 2000 + b"}")
    assert "deep" in err.message and str(MAX_JSON_DEPTH) in err.message


def test_json_nested_past_the_limit_names_the_field() -> None:
    n = MAX_JSON_DEPTH + 1
    err = parse_bad(b'{"prompt": "x", "extra": ' + b"[" * n + b"]" * n + b"}")
    assert "'extra[0]" in err.message and str(MAX_JSON_DEPTH) in err.message
    ok = MAX_JSON_DEPTH - 1  # the top-level object is one level
    body = b'{"prompt": "x", "extra": ' + b"[" * ok + b"]" * ok + b"}"
    with pytest.raises(ApiError) as info:  # within the limits: refused only as unknown
        parse_generation(body, chat=None, max_tokens_limit=100)
    assert info.value.code == "unknown_parameter" and info.value.param == "extra"


def test_integer_of_4300_digits_is_400_naming_the_field() -> None:
    err = parse_bad(b'{"prompt": "x", "max_tokens": ' + b"9" * 4301 + b"}")
    assert "'max_tokens'" in err.message and "4301 digits" in err.message
    assert str(MAX_NUMBER_DIGITS) in err.message
    err = parse_bad(b'{"prompt": "x", "unknown": [1, -' + b"1" * 5000 + b".5e3]}")
    assert "'unknown[1]'" in err.message
    err = parse_bad(b"1" * 5000)
    assert "request body" in err.message


def test_long_string_is_400_naming_the_field_and_limit() -> None:
    big = b"a" * (MAX_STRING_CHARS + 1)
    err = parse_bad(b'{"messages": [{"role": "user", "content": "' + big + b'"}]}')
    assert "'messages[0].content'" in err.message and str(MAX_STRING_CHARS) in err.message


@pytest.mark.parametrize("body,field", [
    (b'{"prompt": "a\\ud800b"}', "'prompt'"),
    (b'{"messages": [{"role": "user", "content": "\\udfff"}]}', "'messages[0].content'"),
    (b'{"prompt": "x", "stop": ["ok", "\\udc00\\ud800"]}', "'stop[1]'"),
    (b'{"prompt": "x", "\\ud800": 1}', "a key"),
])
def test_lone_surrogate_is_400_naming_the_field(body: bytes, field: str) -> None:
    err = parse_bad(body)
    assert field in err.message and "surrogate" in err.message


def test_surrogate_pair_is_one_character_and_accepted() -> None:
    r = parse_generation(b'{"prompt": "\\ud83d\\ude00"}', chat=None, max_tokens_limit=100)
    assert r.prompt == "\U0001F600"


def test_lone_surrogate_through_the_router_is_400_not_503() -> None:
    async def main() -> None:
        async with serving() as (_, sock, h, _logs):
            out = await exchange(sock, post("/v1/requests", b'{"prompt": "\\ud800"}'))
            status, err = status_and_error(out)
            assert (status, err["code"]) == (400, "invalid_request"), out
            assert "'prompt'" in err["message"]
            assert not h.daemon.submitted
    run(main())


def test_deep_json_and_huge_number_over_http_are_400_not_a_dropped_connection() -> None:
    async def main() -> None:
        async with serving() as (_, sock, _h, logs):
            for body in (b'{"prompt": ' + b"[" * 2000 + b"]" * 2000 + b"}",
                         b'{"prompt": "x", "seed": ' + b"7" * 4400 + b"}"):
                status, err = status_and_error(await exchange(sock, post("/v1/requests", body)))
                assert (status, err["code"]) == (400, "invalid_request")
            assert not logs
    run(main())


# ---- 1. strict query strings -----------------------------------------------------------------

@pytest.mark.parametrize("query,needle", [
    ("from=%C2%B2", "'from'"),  # '²': a digit to str.isdigit(), not to int()
    ("from=%ZZ", "percent"),
    ("from=%C3", "UTF-8"),
    ("from=1&from=2", "twice"),
    ("frm=1", "'frm'"),
    ("from=" + "9" * 5000, "'from'"),
    ("from=-1", "'from'"),
])
def test_bad_query_is_400(query: str, needle: str) -> None:
    async def main() -> None:
        async with serving() as (_, sock, _h, logs):
            out = await exchange(sock, get(f"/v1/requests/req-1/events?{query}"))
            status, err = status_and_error(out)
            assert (status, err["code"]) == (400, "invalid_request"), out
            assert needle in err["message"] and "Hint:" in err["message"]
            assert not logs
    run(main())


def test_good_query_reaches_the_route() -> None:
    async def main() -> None:
        async with serving() as (_, sock, _h, _logs):
            status, err = status_and_error(await exchange(sock, get("/v1/requests/r/events"
                                                                    "?from=12")))
            assert (status, err["code"]) == (404, "request_not_found")
    run(main())


# ---- 3. chunked bodies and Expect: 100-continue ----------------------------------------------

@pytest.mark.parametrize("chunks", [b"zz\r\nabc\r\n0\r\n\r\n", b"-1\r\n", b"3\r\nabcdef\r\n",
                                    b"1" * 100 + b"\r\n"])
def test_malformed_chunking_is_400(chunks: bytes) -> None:
    async def main() -> None:
        async with serving() as (_, sock, _h, logs):
            raw = (b"POST /echo HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
                   + chunks)
            status, err = status_and_error(await exchange(sock, raw))
            assert (status, err["code"]) == (400, "bad_http")
            assert "chunk" in err["message"] and "Hint:" in err["message"]
            assert not logs
    run(main())


def test_expect_100_continue_gets_an_interim_response_before_the_body() -> None:
    async def main() -> None:
        async with serving() as (_, sock, _h, _logs):
            reader, writer = await asyncio.open_unix_connection(str(sock))
            writer.write(b"POST /echo HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n"
                         b"Expect: 100-continue\r\n\r\n")
            interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 3)
            assert interim.startswith(b"HTTP/1.1 100 ")
            writer.write(b"hello")
            final = await asyncio.wait_for(reader.readuntil(b'"len": 5}'), 3)
            assert final.startswith(b"HTTP/1.1 200 ")
            writer.close()
            # too big: the 413 comes instead, without a 100 and without waiting for the body
            out = await exchange(sock, b"POST /echo HTTP/1.1\r\nHost: a\r\nContent-Length: "
                                 b"99999999\r\nExpect: 100-continue\r\n\r\n")
            assert out.startswith(b"HTTP/1.1 413 ")
    run(main())


def test_handler_exception_is_a_500_and_one_log_line() -> None:
    async def main() -> None:
        async with serving() as (_, sock, _h, logs):
            status, err = status_and_error(await exchange(sock, get("/boom")))
            assert (status, err["code"]) == (500, "internal_error")
            assert len(logs) == 1 and "RuntimeError: handler bug" in logs[0]
            assert "Traceback" not in logs[0]
    run(main())


# ---- 2. timeouts ---------------------------------------------------------------------------------

def test_half_sent_headers_time_out_with_408() -> None:
    async def main() -> None:
        async with serving(header_timeout_s=0.3) as (_, sock, _h, _logs):
            t0 = time.monotonic()
            out = await exchange(sock, b"GET /health HTTP/1.1\r\nHost: a\r\nX-Slow: ")
            assert 0.25 < time.monotonic() - t0 < 3
            status, err = status_and_error(out)
            assert (status, err["code"]) == (408, "request_timeout")
            assert "0.3 s" in err["message"] and "Hint:" in err["message"]
            # a connection that never sends a byte is closed silently
            t0 = time.monotonic()
            assert await exchange(sock, b"") == b""
            assert 0.25 < time.monotonic() - t0 < 3
    run(main())


def test_a_request_that_arrived_while_the_daemon_stalled_is_answered() -> None:
    """The whole process stalls between accepting a connection and reading it (memory.high
    throttling, a suspended VM: seen in the sibling-pressure guest as a reset /health), longer
    than the head's timeout. The request already waits in the socket: it is answered, not
    dropped. A client that sends nothing, or only part of a head, still times out."""
    async def main() -> None:
        async with serving(header_timeout_s=0.3) as (srv, sock, _h, _logs):
            admit = srv._admit

            def admit_then_stall(client: socket.socket, loop: asyncio.AbstractEventLoop) -> None:
                admit(client, loop)
                loop.call_soon(time.sleep, 0.6)  # the loop runs nothing else for 0.6 s

            srv._admit = admit_then_stall  # type: ignore[method-assign]
            out = await exchange(sock, get("/health"))
            assert out.startswith(b"HTTP/1.1 200") and out.endswith(b'"serving"}'), out[:300]
            assert await exchange(sock, b"") == b""
            out = await exchange(sock, b"GET /health HTTP/1.1\r\nHost: a\r\nX-Slow: ")
            assert status_and_error(out)[0] == 408
    run(main())


def test_slow_body_times_out_with_408() -> None:
    async def main() -> None:
        async with serving(header_timeout_s=0.3) as (_, sock, _h, _logs):
            out = await exchange(sock, b"POST /echo HTTP/1.1\r\nHost: a\r\nContent-Length: 10"
                                 b"\r\n\r\nabc")
            assert status_and_error(out)[0] == 408
    run(main())


def test_idle_keep_alive_connection_is_closed() -> None:
    async def main() -> None:
        async with serving(idle_timeout_s=0.3, header_timeout_s=5) as (_, sock, _h, _logs):
            reader, writer = await asyncio.open_unix_connection(str(sock))
            writer.write(b"GET /health HTTP/1.1\r\nHost: a\r\n\r\n")
            assert (await reader.readuntil(b"serving\"}")).startswith(b"HTTP/1.1 200")
            t0 = time.monotonic()
            assert await asyncio.wait_for(reader.read(), 5) == b""
            assert 0.25 < time.monotonic() - t0 < 3
            writer.close()
    run(main())


# ---- 2. the connection cap -----------------------------------------------------------------------

def test_beyond_the_cap_503_with_retry_after_but_health_answers() -> None:
    async def main() -> None:
        async with serving(max_connections=2, health_slots=2) as (srv, sock, h, _logs):
            busy = []
            for _ in range(2):
                r, w = await asyncio.open_unix_connection(str(sock))
                w.write(b"GET /slow HTTP/1.1\r\nHost: a\r\n\r\n")
                busy.append((r, w))
            while h.running < 2:
                await asyncio.sleep(0.01)
            out = await exchange(sock, post("/echo", b"{}"))
            status, err = status_and_error(out)
            assert (status, err["code"]) == (503, "too_many_connections")
            assert b"\r\nretry-after: " in out.lower() and "Hint:" in err["message"]
            out = await exchange(sock, get("/health"))
            assert out.startswith(b"HTTP/1.1 200") and b"serving" in out
            h.release.set()
            for r, w in busy:
                assert (await r.readuntil(b"{}")).startswith(b"HTTP/1.1 200")
                w.close()
    run(main())


def test_beyond_the_health_slots_a_canned_503() -> None:
    async def main() -> None:
        async with serving(max_connections=1, health_slots=1,
                           header_timeout_s=10) as (_, sock, h, _logs):
            r1, w1 = await asyncio.open_unix_connection(str(sock))
            w1.write(b"GET /slow HTTP/1.1\r\nHost: a\r\n\r\n")
            while h.running < 1:
                await asyncio.sleep(0.01)
            r2, w2 = await asyncio.open_unix_connection(str(sock))
            w2.write(b"GET /hea")  # holds the health slot, mid-request
            await w2.drain()
            await asyncio.sleep(0.1)
            t0 = time.monotonic()
            out = await exchange(sock, get("/health"))
            assert time.monotonic() - t0 < 2
            status, err = status_and_error(out)
            assert (status, err["code"]) == (503, "too_many_connections")
            assert b"retry-after: " in out.lower()
            for w in (w1, w2):
                w.close()
    run(main())


def test_idle_connections_cannot_lock_clients_out() -> None:
    """1,000 idle connections against a cap of 8: the oldest idle ones are closed to make room,
    so /health and requests are answered at once, long before any timeout."""
    async def main() -> None:
        async with serving(max_connections=8, health_slots=2,
                           header_timeout_s=30, idle_timeout_s=30) as (_, sock, _h, logs):
            # ~1,000, leaving this process (client and server side) descriptors to spare
            n = min(1000, resource.getrlimit(resource.RLIMIT_NOFILE)[0] - 300)
            assert n > 8 + 2 + 64  # far past the cap, the health slots and the backlog
            idle = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(n)]
            try:
                for s in idle:
                    s.setblocking(False)
                    with contextlib.suppress(BlockingIOError):
                        s.connect(str(sock))
                await asyncio.sleep(0.5)
                t0 = time.monotonic()
                out = await exchange(sock, get("/health"))
                assert out.startswith(b"HTTP/1.1 200"), out
                out = await exchange(sock, post("/echo", b"{}"))
                assert out.startswith(b"HTTP/1.1 200"), out
                assert time.monotonic() - t0 < 5
            finally:
                for s in idle:
                    s.close()
            assert len(logs) <= 1, logs
    run(main())


# ---- 2. accept() out of descriptors --------------------------------------------------------------

SERVER_SCRIPT = textwrap.dedent("""
    import asyncio, resource, sys
    from edge_agent.transports.http import HttpServer, Response

    async def handle(req):
        return Response(200, b'{"ok": true}')

    async def main():
        srv = HttpServer(handle, max_connections=1000, header_timeout_s=30,
                         log_interval_s=60, accept_retry_s=0.05)
        await srv.listen_unix(sys.argv[1])
        n = len(__import__("os").listdir("/proc/self/fd"))
        resource.setrlimit(resource.RLIMIT_NOFILE, (n + 8, resource.getrlimit(
            resource.RLIMIT_NOFILE)[1]))
        print("ready", flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main())
""")


def test_accept_out_of_descriptors_logs_once_and_recovers(tmp_path: Path) -> None:
    d = Path(tempfile.mkdtemp(prefix="ea-f-", dir="/tmp"))
    sock = d / "s.sock"
    proc = subprocess.Popen([sys.executable, "-c", SERVER_SCRIPT, str(sock)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    clients: list[socket.socket] = []
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
        for _ in range(40):  # far more than the 8 spare descriptors
            c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            c.connect(str(sock))
            clients.append(c)
        time.sleep(1.5)  # ~30 retries at 0.05 s
        for c in clients:
            c.close()
        clients.clear()
        deadline = time.monotonic() + 10
        while True:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
                c.settimeout(5)
                c.connect(str(sock))
                c.sendall(get("/health"))
                got = b""
                with contextlib.suppress(OSError):
                    while chunk := c.recv(4096):
                        got += chunk
            if got.startswith(b"HTTP/1.1 200"):
                break
            assert time.monotonic() < deadline, got
            time.sleep(0.1)
    finally:
        for c in clients:
            c.close()
        proc.kill()
        _, err = proc.communicate(timeout=10)
        shutil.rmtree(d, ignore_errors=True)
    text = err.decode()
    assert "Traceback" not in text and "Unhandled" not in text, text[:2000]
    lines = [ln for ln in text.splitlines() if "accept" in ln]
    assert len(lines) == 1, text[:2000]
    assert "Too many open files" in lines[0] and "Hint:" in lines[0]


def test_service_unit_raises_the_descriptor_limit() -> None:
    text = render_units()["edge-agent.service"]
    line = next(ln for ln in text.splitlines() if ln.startswith("LimitNOFILE="))
    assert int(line.split("=", 1)[1]) >= 4096
    assert (REPO / "systemd" / "edge-agent.service").read_text() == text


def test_a_request_head_over_the_limit_is_431_whatever_its_size() -> None:
    from edge_agent.transports.http import MAX_HEAD_BYTES

    def head_of(size: int) -> bytes:
        start = b"GET /health HTTP/1.1\r\nHost: a\r\nConnection: close\r\nX-Pad: "
        return start + b"a" * (size - len(start) - 4) + b"\r\n\r\n"

    async def go() -> list[tuple[int, int, dict[str, Any]]]:
        out = []
        async with serving() as (_, sock, _h, _logs):
            # h11 alone let a head through up to twice the limit when it completed in the
            # read that crossed it
            for size in (MAX_HEAD_BYTES - 100, MAX_HEAD_BYTES, MAX_HEAD_BYTES + 1,
                         MAX_HEAD_BYTES + 2000, 2 * MAX_HEAD_BYTES - 10, 300_000):
                raw = head_of(size)
                assert len(raw) == size
                out.append((size, *status_and_error(await exchange(sock, raw))))
            # the connection after a refused one: the server still serves
            out.append((0, *status_and_error(await exchange(sock, get("/health")))))
        return out

    results = run(go())
    assert [(size, status) for size, status, _ in results] == [
        (MAX_HEAD_BYTES - 100, 200), (MAX_HEAD_BYTES, 200), (MAX_HEAD_BYTES + 1, 431),
        (MAX_HEAD_BYTES + 2000, 431), (2 * MAX_HEAD_BYTES - 10, 431), (300_000, 431), (0, 200)]
    for _, status, err in results:
        if status == 431:
            assert err["code"] == "bad_http", err
            assert f"under {MAX_HEAD_BYTES} bytes" in err["message"], err
