"""Bounded fuzzing (hypothesis) of the HTTP request parser and the API schema.

Properties:
- any bytes sent to the server get well-formed HTTP/1.1 responses or a clean close, never a 5xx
  (but 501 for a transfer coding it does not implement), a log line about an internal error, or
  an exception reported by the event loop;
- any body given to the schema (parse_generation, and the Router's POST /v1/requests over a
  stand-in daemon) is accepted or refused with a 4xx carrying a Hint, never a 5xx or exception.

Budget: 200 examples per property, no deadline; the whole module runs in a few seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shutil
import socket
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edge_agent.daemon.routes import Router
from edge_agent.errors import EdgeAgentError
from edge_agent.protocol.api import ApiError, GenerationRequest, parse_generation
from edge_agent.transports.http import HttpServer, Request, Response, StreamResponse

pytestmark = pytest.mark.timeout(120)

FUZZ = settings(max_examples=200, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])


class FakeDaemon:
    """Router's view of the daemon for /v1/requests*: submit encodes the text as the tokenizer
    and journal do (text they cannot encode would surface as a 503 `unavailable`)."""

    def find_request(self, rid: str) -> Any:
        return None  # no request is known

    async def accept(self, greq: GenerationRequest) -> Any:
        texts = [greq.prompt] if greq.prompt is not None else [
            m.content for m in greq.messages or ()]
        for text in [*texts, *greq.stop, greq.model or "", greq.session or ""]:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise EdgeAgentError(f"tokenizer: {exc}") from exc
        return SimpleNamespace(id="req-1", to_dict=lambda now: {"id": "req-1"})


ROUTED = re.compile(r"/v1/requests(/[^/]+(/events)?)?/?")


def make_handler() -> Any:
    router = Router(FakeDaemon())  # type: ignore[arg-type]  # a fake with what the routes use

    async def handle(req: Request) -> Response | StreamResponse:
        if req.path == "/health":
            return Response(200, b'{"status": "serving"}')
        if ROUTED.fullmatch(req.path):
            return await router.handle(req)
        return Response(200, json.dumps({"len": len(req.body), "q": req.query}).encode())

    return handle


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[Path, list[str], list[dict[str, Any]]]]:
    """One server for the module, on its own event loop in a thread."""
    d = Path(tempfile.mkdtemp(prefix="ea-z-", dir="/tmp"))
    sock = d / "s.sock"
    logs: list[str] = []
    errors: list[dict[str, Any]] = []
    loop = asyncio.new_event_loop()
    loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx))
    srv = HttpServer(make_handler(), max_body_bytes=4096, header_timeout_s=2.0,
                     idle_timeout_s=2.0, log=logs.append)
    loop.run_until_complete(srv.listen_unix(sock))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield sock, logs, errors
    finally:
        asyncio.run_coroutine_threadsafe(srv.close(), loop).result(20)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
        shutil.rmtree(d, ignore_errors=True)


def send(sock: Path, data: bytes) -> bytes:
    """Send, half-close, read to the end. A reset after the reply counts as a close."""
    got = b""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(sock))
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
        with contextlib.suppress(ConnectionResetError):
            while chunk := s.recv(65536):
                got += chunk
    return got


STATUS_LINE = re.compile(rb"HTTP/1\.1 ([1-5][0-9][0-9]) [^\r\n]*")


def responses(raw: bytes, head_request: bool = False) -> list[int]:
    """Statuses of the complete responses in `raw`; AssertionError if anything is malformed.
    `head_request`: the first request was a HEAD, so its reply carries no body."""
    statuses: list[int] = []
    while raw:
        head, sep, rest = raw.partition(b"\r\n\r\n")
        assert sep, f"a response head without its end: {raw[:300]!r}"
        lines = head.split(b"\r\n")
        m = STATUS_LINE.fullmatch(lines[0])
        assert m, f"bad status line: {lines[0][:200]!r}"
        status = int(m.group(1))
        headers: dict[bytes, bytes] = {}
        for line in lines[1:]:
            name, colon, value = line.partition(b":")
            assert colon and name.strip() == name, f"bad header line {line[:200]!r}"
            headers[name.lower()] = value.strip()
        if 100 <= status < 200:
            raw = rest
            continue
        assert b"transfer-encoding" not in headers
        # a HEAD's reply has no body, unless the head was refused before its method was known
        bodyless = head_request and not statuses and (not rest or rest.startswith(b"HTTP/"))
        n = 0 if bodyless else int(headers[b"content-length"])
        body, raw = rest[:n], rest[n:]
        assert len(body) == n, "a truncated body"
        if status >= 400 and not bodyless:
            err = json.loads(body)["error"]
            assert "Hint:" in err["message"], err
        statuses.append(status)
    return statuses


def check(server: tuple[Path, list[str], list[dict[str, Any]]], data: bytes) -> None:
    sock, logs, errors = server
    statuses = responses(send(sock, data), head_request=data.startswith(b"HEAD "))
    # 501: a transfer coding the server does not implement (RFC 9112 6.1), not a failure
    assert all(s < 500 or s == 501 for s in statuses), (statuses, data[:300])
    assert not logs, logs
    assert not errors, [e.get("message") for e in errors]


# ---- strategies: requests --------------------------------------------------------------------

def mostly(draw: st.DrawFn, usual: Any, odd: st.SearchStrategy[Any], percent: int = 85) -> Any:
    """`usual` most of the time, else something drawn from `odd` (so most requests get past
    the request line and exercise headers, framing, queries and the routes)."""
    return usual if draw(st.integers(0, 99)) < percent else draw(odd)


METHODS = st.sampled_from([b"GET", b"POST", b"DELETE", b"HEAD"])
ODD_METHODS = st.sampled_from([b"PUT", b"OPTIONS", b"get", b"G T", b"", b"\xff"])
TARGETS = st.sampled_from([b"/health", b"/echo", b"/v1/requests", b"/v1/requests/r1",
                           b"/v1/requests/r1/events", b"*", b"http://a/health", b"/%ZZ",
                           b"/a%00b", b"", b"/\xff", b"//[", b"/v1/requests/%E2%82"])
QUERY_PARTS = st.sampled_from([b"from", b"port", b"x", b"", b"=", b"&", b"%", b"%C2%B2",
                               b"%ZZ", b"%C3", b"+", b"1", b"99999999999999999999999",
                               b"\xc3\xa9", b"#f"])
QUERIES = st.one_of(st.just(b""), st.lists(QUERY_PARTS, max_size=6).map(
    lambda parts: b"?" + b"".join(parts)))
ODD_VERSIONS = st.sampled_from([b"HTTP/1.0", b"HTTP/2.0", b"HTTP/1.1 x", b"", b"HTTP/1.1\x00"])
HEADER_NAMES = st.sampled_from([b"Content-Type", b"Expect", b"Connection", b"X",
                                b"Content-Length", b"Transfer-Encoding"])
ODD_HEADER_NAMES = st.sampled_from([b"Bad Name", b"", b"X:", b"\xff"])
HEADER_VALUES = st.sampled_from([b"a", b"100-continue", b"close", b"keep-alive", b"chunked",
                                 b"gzip, chunked", b"-1", b"5", b"0x10", b"9" * 30, b""])
JSON_BODIES = st.sampled_from([b'{"prompt": "hi"}', b'{"prompt": "\\ud800"}',
                               b'{"messages": [{"role": "user", "content": "x"}]}',
                               b"[" * 3000, b'{"prompt": "x", "seed": ' + b"1" * 5000 + b"}",
                               b"{}", b"", b"\xff\xfe", b'{"prompt": 1e999999}'])
BODIES = st.one_of(JSON_BODIES, st.binary(max_size=64))


@st.composite
def http_requests(draw: st.DrawFn) -> bytes:
    eol = mostly(draw, b"\r\n", st.sampled_from([b"\n", b"\r", b"\r\r\n"]), 95)
    line = b" ".join([mostly(draw, draw(METHODS), ODD_METHODS), draw(TARGETS) + draw(QUERIES),
                      mostly(draw, b"HTTP/1.1", ODD_VERSIONS)])
    headers = [(b"Host", b"a")] if mostly(draw, True, st.just(False), 90) else []
    for _ in range(draw(st.integers(0, 3))):
        headers.append((mostly(draw, draw(HEADER_NAMES), ODD_HEADER_NAMES, 90),
                        mostly(draw, draw(HEADER_VALUES), st.binary(max_size=12), 90)))
    body = draw(BODIES)
    framing = draw(st.sampled_from(["length", "length", "wrong-length", "chunked", "bad-chunks",
                                    "none"]))
    if framing == "length":
        headers.append((b"Content-Length", str(len(body)).encode()))
    elif framing == "wrong-length":
        headers.append((b"Content-Length", str(draw(st.integers(0, 10_000))).encode()))
    elif framing in ("chunked", "bad-chunks"):
        headers.append((b"Transfer-Encoding", b"chunked"))
        if framing == "chunked":
            body = (f"{len(body):x}".encode() + b"\r\n" + body + b"\r\n0\r\n\r\n"
                    if body else b"0\r\n\r\n")
        else:
            size = draw(st.sampled_from([b"zz", b"-1", b"1" * 40, b"3", b"ffffffff", b""]))
            body = size + draw(st.sampled_from([b"\r\n", b";ext\r\n", b"\n"])) + body
    if draw(st.booleans()):
        headers.append((b"Expect", b"100-continue"))
    raw = line + eol + b"".join(k + b": " + v + eol for k, v in headers) + eol + body
    if draw(st.integers(0, 3)) == 0:
        raw = raw[:draw(st.integers(0, len(raw)))]
    if draw(st.integers(0, 4)) == 0:  # pipelined: a second request on the same connection
        raw += b"GET /health HTTP/1.1\r\nHost: a\r\n\r\n"
    return raw


@FUZZ
@given(data=http_requests())
def test_any_request_gets_a_well_formed_answer_or_a_clean_close(
        server: tuple[Path, list[str], list[dict[str, Any]]], data: bytes) -> None:
    check(server, data)


@FUZZ
@given(data=st.binary(max_size=400))
def test_any_bytes_get_a_well_formed_answer_or_a_clean_close(
        server: tuple[Path, list[str], list[dict[str, Any]]], data: bytes) -> None:
    check(server, data)


# ---- strategies: JSON bodies -----------------------------------------------------------------

ODD_TEXT = st.sampled_from(["\ud800", "a\udfff", "\udc00\ud800", "\U0001F600", "\x00", "é",
                            "x" * 300])
TEXT = st.one_of(st.text(max_size=12), ODD_TEXT)
LEAVES = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(-(2**70), 2**70),
                   st.floats(), TEXT)
VALUES = st.recursive(LEAVES, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(TEXT, inner, max_size=4)), max_leaves=12)
MESSAGE = st.fixed_dictionaries({}, optional={
    "role": st.one_of(st.sampled_from(["user", "system", "assistant", "tool"]), VALUES),
    "content": st.one_of(TEXT, VALUES, st.lists(st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image"]), "text": st.one_of(TEXT, VALUES)}),
        max_size=3)),
})
FIELDS = st.fixed_dictionaries({}, optional={
    "prompt": st.one_of(TEXT, VALUES, st.lists(TEXT, max_size=2)),
    "messages": st.one_of(st.lists(MESSAGE, max_size=3), VALUES),
    "model": st.one_of(TEXT, VALUES),
    "max_tokens": st.one_of(st.integers(-3, 10**25), VALUES),
    "temperature": st.one_of(st.floats(), VALUES),
    "top_p": st.one_of(st.floats(), VALUES),
    "top_k": st.one_of(st.integers(-3, 2**22), VALUES),
    "seed": st.one_of(st.integers(-3, 2**64), VALUES),
    "stop": st.one_of(TEXT, st.lists(TEXT, max_size=6), VALUES),
    "stream": VALUES,
    "priority": st.one_of(st.integers(-3, 20), VALUES),
    "timeout_ms": st.one_of(st.integers(-3, 10**13), VALUES),
    "session": st.one_of(st.from_regex(r"[A-Za-z0-9._:-]{0,130}", fullmatch=True), TEXT, VALUES),
    "n": VALUES,
    "extra": VALUES,
})


@st.composite
def json_bodies(draw: st.DrawFn) -> bytes:
    raw = json.dumps(draw(st.one_of(FIELDS, VALUES))).encode()
    how = draw(st.sampled_from(["as-is"] * 6 + ["cut", "junk", "deep", "digits", "binary"]))
    if how == "cut":
        raw = raw[:draw(st.integers(0, len(raw)))]
    elif how == "junk":
        at = draw(st.integers(0, len(raw)))
        raw = raw[:at] + draw(st.binary(min_size=1, max_size=8)) + raw[at:]
    elif how == "deep":
        n = draw(st.sampled_from([63, 64, 65, 900, 3000]))
        raw = b'{"prompt": "x", "extra": ' + b"[" * n + b"]" * n + b"}"
    elif how == "digits":
        n = draw(st.sampled_from([19, 64, 65, 4300, 5000]))
        raw = b'{"prompt": "x", "seed": ' + b"7" * n + b"}"
    elif how == "binary":
        raw = draw(st.binary(max_size=64))
    return raw


@FUZZ
@given(body=json_bodies(), chat=st.sampled_from([None, False, True]))
def test_schema_accepts_or_refuses_with_a_4xx(body: bytes, chat: bool | None) -> None:
    try:
        r = parse_generation(body, chat=chat, max_tokens_limit=8192)
    except ApiError as exc:
        assert 400 <= exc.status < 500, exc
        assert "Hint:" in exc.message, exc.message
        json.loads(exc.body())
    else:
        assert isinstance(r, GenerationRequest)
        for text in [r.prompt or "", *(m.content for m in r.messages or ()), *r.stop]:
            text.encode("utf-8")  # whatever passes can be tokenized and journaled


@FUZZ
@given(body=json_bodies())
def test_router_answers_any_body_with_2xx_or_4xx(body: bytes) -> None:
    router = Router(FakeDaemon())  # type: ignore[arg-type]  # a fake with what the routes use
    reply = asyncio.run(router.handle(Request("POST", "/v1/requests", {}, {}, body)))
    assert isinstance(reply, Response)
    assert 200 <= reply.status < 300 or 400 <= reply.status < 500, reply
