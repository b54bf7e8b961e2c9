"""HTTP/1.1 server on a Unix socket (and optionally loopback TCP): asyncio streams + h11.

Invariants owned here:
- Parsing is h11's (sans-IO); this module only moves bytes and calls `handler(Request)`.
- A body larger than `max_body_bytes` is answered 413 without being parsed, and the connection
  is closed (Content-Length checked up front; chunked bodies counted as they arrive); what the
  client still sends is drained and dropped (bounded: 4x the limit, 2 s) so it can read the 413.
- While a handler runs or a response streams, the connection is watched: EOF from the client
  cancels the handler task / closes the stream's async generator (so generation can stop).
- The Unix socket is bound, chmod'ed (0660 by default) and chgrp'ed before `listen()`, so no
  client can connect while its permissions are wider than configured. A stale socket file left
  by a dead process is replaced; a live one is an error. `close()` removes the file.
- Keep-alive: after a complete exchange the connection starts the next cycle; during shutdown
  idle connections are closed at once and busy ones finish (bounded by `drain_timeout_s`).
- Nothing a client sends ends in an unhandled exception: a malformed head, chunk framing or
  query string is a 400 (`bad_http`, or `invalid_request` for the query) naming what was
  received, then the connection closes; `Expect: 100-continue` is answered `100 Continue` just
  before the body is read (not when the request is refused first, e.g. by a 413); a handler that
  raises is a 500 `internal_error` and one log line, not a dropped connection.
- Timeouts. A new connection must deliver a complete request head within `header_timeout_s` of
  being accepted. Between requests a keep-alive connection may stay idle (no byte of the next
  request) for `idle_timeout_s`; once the next request's first byte arrives, its head must be
  complete within `header_timeout_s`. A body must keep arriving (no gap longer than
  `header_timeout_s`). A head or body cut short is answered 408 and closed; an idle connection
  is closed silently. A client that reads no response bytes for `send_timeout_s` is dropped.
  The timeouts judge the client, not the daemon: when the daemon itself was stalled past a
  deadline (memory.high throttling, a suspended VM), what the client sent meanwhile is still
  read and answered.
  Handlers and streams have no time limit here (deadlines are the scheduler's).
- Connection cap. At most `max_connections` connections are served. When one more arrives, the
  oldest idle connection (waiting for a request, not a byte of it received, idle for at least
  EVICT_GRACE_S) is closed to make room, so idle or leaked keep-alive connections never lock
  clients out. If none is idle (all are mid-request), the newcomer takes one of `health_slots`
  reserved slots: there a `GET`/`HEAD` of a `priority_paths` path (/health) is answered, and
  anything else gets 503 `too_many_connections` with Retry-After; either way the connection then
  closes. With those slots taken too, a canned 503 is written without reading the request. So
  /health answers unless `max_connections` requests are in flight and `health_slots` more
  connections are mid-request at the same moment.
- accept() is this module's loop, not asyncio's: out of descriptors (EMFILE, ENFILE, ENOBUFS,
  ENOMEM) it logs one line per `log_interval_s` (with the count of repeats), waits
  `accept_retry_s` and accepts again, so serving resumes as soon as descriptors come back.
  The daemon's unit raises LimitNOFILE well above `max_connections` so this stays a last resort.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import grp
import logging
import os
import socket
import stat
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote

import h11

from edge_agent.errors import EdgeAgentError
from edge_agent.filekind import file_kind
from edge_agent.protocol.api import ApiError, error_body, parse_query
from edge_agent.sockpath import SocketPathError, bind_error, check_socket_path

__all__ = ["Request", "Response", "StreamResponse", "HttpServer", "Handler", "SocketInUseError"]

READ_CHUNK = 65536
MAX_HEAD_BYTES = 64 * 1024
EVICT_GRACE_S = 0.25  # a connection this young is not "idle" yet: its request may be in flight
RETRY_AFTER_S = 1
LATE_LOOK_S = 0.1  # past a deadline, how long the loop may take to see bytes already received
_OUT_OF_RESOURCES = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
_HEAD_HINTS = {
    400: "send HTTP/1.1: a request line `METHOD /path HTTP/1.1`, header lines `Name: value`, "
         "each ending in CRLF, then an empty line",
    431: f"send a request head (request line and headers) under {MAX_HEAD_BYTES} bytes",
    501: "send the body with Content-Length, or with Transfer-Encoding: chunked alone",
    505: "send HTTP/1.1 (or HTTP/1.0)",
}
_REFUSED_LINGER_MAX = 64  # canned-503 sockets read out at once; beyond, closed at once


class SocketInUseError(EdgeAgentError):
    """The socket path answers: another daemon is already serving there."""


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: bytes


@dataclass
class Response:
    status: int
    body: bytes = b""
    content_type: str = "application/json"
    headers: Sequence[tuple[str, str]] = ()


@dataclass
class StreamResponse:
    chunks: AsyncIterator[bytes]
    status: int = 200
    content_type: str = "text/event-stream"
    headers: Sequence[tuple[str, str]] = field(default_factory=tuple)


Handler = Callable[[Request], Awaitable["Response | StreamResponse"]]


def _err(status: int, code: str, message: str,
         headers: Sequence[tuple[str, str]] = ()) -> Response:
    return Response(status, error_body(code, message, status=status), headers=headers)


logger = logging.getLogger(__name__)


class _Disconnected(Exception):
    pass


class _TimedOut(Exception):
    def __init__(self, partial: bool, what: str) -> None:
        super().__init__(what)
        self.partial = partial  # some bytes of the request had arrived: answer 408
        self.what = what


class _Conn:
    """Bookkeeping of one accepted connection."""

    __slots__ = ("task", "busy", "idle", "since", "limited", "evicted", "accepted")

    def __init__(self, limited: bool, now: float) -> None:
        self.task: asyncio.Task[None] | None = None
        self.busy = False  # a handler runs or a response is being sent
        self.idle = True  # waiting for a request, not one byte of it received
        self.since = now  # when it became idle
        self.limited = limited  # in a health slot: /health or 503, then close
        self.evicted = False
        self.accepted = now


class _Warnings:
    """At most one log line per key and interval; the next one says how many were dropped."""

    def __init__(self, log: Callable[[str], None], interval_s: float) -> None:
        self.log = log
        self.interval_s = interval_s
        self._last: dict[str, float] = {}
        self._dropped: dict[str, int] = {}

    def warn(self, key: str, text: str) -> None:
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last < self.interval_s:
            self._dropped[key] = self._dropped.get(key, 0) + 1
            return
        dropped = self._dropped.pop(key, 0)
        self._last[key] = now
        if dropped:
            text += f" ({dropped} more like it since the last report)"
        self.log(text)


class HttpServer:
    """Serve `handler` over HTTP/1.1 on any number of listening sockets."""

    def __init__(self, handler: Handler, *, max_body_bytes: int = 1 << 20,
                 drain_timeout_s: float = 10.0, header_timeout_s: float = 10.0,
                 idle_timeout_s: float = 30.0, send_timeout_s: float = 60.0,
                 max_connections: int = 256, health_slots: int = 8,
                 priority_paths: Sequence[str] = ("/health",),
                 accept_retry_s: float = 0.5, log_interval_s: float = 60.0,
                 body_limit: Callable[[str, str], int | None] | None = None,
                 error_body: Callable[[str, int, str, str], bytes | None] | None = None,
                 log: Callable[[str], None] = logger.warning) -> None:
        self.handler = handler
        self.max_body_bytes = max_body_bytes
        # (method, path) -> that route's own body limit, None: max_body_bytes
        self.body_limit = body_limit
        # (path, status, code, message) -> the error body the API under `path` speaks (the
        # transport's own refusals: 413, a malformed body, 500), None: error_body's shape
        self.error_body = error_body
        self.drain_timeout_s = drain_timeout_s
        self.header_timeout_s = header_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.send_timeout_s = send_timeout_s
        self.max_connections = max_connections
        self.health_slots = health_slots
        self.priority_paths = frozenset(priority_paths)
        self.accept_retry_s = accept_retry_s
        self._warnings = _Warnings(log, log_interval_s)
        self._listeners: list[tuple[socket.socket, asyncio.Task[None]]] = []
        self._unix_paths: list[Path] = []
        self._conns: dict[asyncio.Task[None], _Conn] = {}
        self._refused: set[asyncio.Task[None]] = set()
        self._closing = False

    # ---- listening -------------------------------------------------------------------------
    async def listen_unix(self, path: Path, *, mode: int = 0o660, group: str | None = None) -> None:
        path = check_socket_path(path, role="serve")  # too long, under a file, on /proc
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise bind_error(path, exc) from exc
        _remove_stale(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            try:
                sock.bind(str(path))
            except OSError as exc:
                raise bind_error(path, exc) from exc
            os.chmod(path, mode)
            if group:
                try:
                    gid = grp.getgrnam(group).gr_gid
                except KeyError as exc:
                    raise EdgeAgentError(
                        f"socket {path}: group {group!r} does not exist. "
                        "Hint: create it (the sysusers snippet does) or unset server.socket_group."
                    ) from exc
                os.chown(path, -1, gid)
            sock.listen(64)
        except BaseException:
            sock.close()
            with contextlib.suppress(OSError):
                path.unlink()
            raise
        await self.adopt(sock)
        self._unix_paths.append(path)

    async def listen_tcp(self, host: str, port: int) -> int:
        """Listen on every address `host` resolves to (as asyncio.start_server does); the port
        actually bound is returned (port 0: the first address's, used for all)."""
        infos = await asyncio.get_running_loop().getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        bound: list[socket.socket] = []
        try:
            for family, kind, proto, _, addr in dict.fromkeys(infos):
                if bound and port == 0:
                    addr = (addr[0], bound[0].getsockname()[1], *addr[2:])
                sock = socket.socket(family, kind, proto)
                bound.append(sock)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind(addr)
                sock.listen(128)
        except BaseException:
            for sock in bound:
                sock.close()
            raise
        for sock in bound:
            await self.adopt(sock)
        return int(bound[0].getsockname()[1])

    async def adopt(self, sock: socket.socket) -> None:
        """Serve on an already listening socket (socket activation hands these over)."""
        sock.setblocking(False)
        task = asyncio.get_running_loop().create_task(self._accept_loop(sock))
        self._listeners.append((sock, task))

    async def close(self, timeout: float | None = None) -> None:
        """Stop accepting, let busy connections finish (within `timeout`, by default
        `drain_timeout_s`), close the rest."""
        self._closing = True
        for sock, task in self._listeners:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            sock.close()
        for path in self._unix_paths:
            with contextlib.suppress(OSError):
                path.unlink()
        for task in list(self._refused):
            task.cancel()
        for task, c in list(self._conns.items()):
            if not c.busy:
                task.cancel()
        pending = list(self._conns)
        if pending:
            _, still = await asyncio.wait(
                pending, timeout=self.drain_timeout_s if timeout is None else timeout)
            for task in still:
                task.cancel()
            if still:
                await asyncio.wait(still, timeout=1.0)

    # ---- accepting ---------------------------------------------------------------------------
    async def _accept_loop(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        where = _sock_name(sock)
        while not self._closing:
            try:
                client, _ = await loop.sock_accept(sock)
            except OSError as exc:
                if self._closing or sock.fileno() == -1:
                    return
                if exc.errno in (errno.ECONNABORTED, errno.EPROTO, errno.EINTR, errno.EAGAIN):
                    continue
                hint = ("raise LimitNOFILE (the systemd unit sets it) or lower the connection "
                        "limit" if exc.errno in _OUT_OF_RESOURCES else "check the listening socket")
                self._warnings.warn(
                    "accept", f"accept() on {where} failed: {exc.strerror or exc} "
                    f"(errno {errno.errorcode.get(exc.errno or 0, exc.errno)}) with "
                    f"{len(self._conns)} connections open; new connections wait in the backlog "
                    f"and accept() is retried every {self.accept_retry_s} s (this is reported "
                    f"at most once per {self._warnings.interval_s:g} s). Hint: {hint}.")
                await asyncio.sleep(self.accept_retry_s)
                continue
            self._admit(client, loop)
            await asyncio.sleep(0)  # let the new connection read what its client already sent

    def _admit(self, client: socket.socket, loop: asyncio.AbstractEventLoop) -> None:
        client.setblocking(False)
        now = loop.time()
        live = [c for c in self._conns.values() if not c.evicted]
        limited = False
        if sum(not c.limited for c in live) >= self.max_connections:
            if not self._evict([c for c in live if not c.limited], now):
                limited = True
                if (sum(c.limited for c in live) >= self.health_slots
                        and not self._evict([c for c in live if c.limited], now)):
                    self._refuse(client, loop)
                    return
        c = _Conn(limited, now)
        task = loop.create_task(self._on_client(client, c))
        c.task = task
        self._conns[task] = c

    def _evict(self, candidates: list[_Conn], now: float) -> bool:
        """Close the oldest idle connection among `candidates`; False if none is idle."""
        idle = [c for c in candidates if c.idle and not c.busy and now - c.since >= EVICT_GRACE_S]
        if not idle:
            return False
        oldest = min(idle, key=lambda c: c.since)
        oldest.evicted = True
        if oldest.task is not None:
            oldest.task.cancel()
        return True

    def _busy_response(self) -> Response:
        msg = (f"the daemon serves at most {self.max_connections} connections and all of them "
               "are in the middle of a request. Hint: retry after the Retry-After seconds, and "
               "reuse one keep-alive connection instead of opening many.")
        return _err(503, "too_many_connections", msg, [("retry-after", str(RETRY_AFTER_S))])

    def _refuse(self, client: socket.socket, loop: asyncio.AbstractEventLoop) -> None:
        """Beyond every slot: a canned 503, written without reading the request."""
        r = self._busy_response()
        raw = (f"HTTP/1.1 503 Service Unavailable\r\ncontent-type: {r.content_type}\r\n"
               f"content-length: {len(r.body)}\r\nretry-after: {RETRY_AFTER_S}\r\n"
               "connection: close\r\n\r\n").encode() + r.body
        with contextlib.suppress(OSError):
            client.send(raw)
        if len(self._refused) >= _REFUSED_LINGER_MAX:
            client.close()
            return
        task = loop.create_task(_read_out(client, loop))
        self._refused.add(task)
        task.add_done_callback(self._refused.discard)

    # ---- connections -----------------------------------------------------------------------
    async def _on_client(self, client: socket.socket, c: _Conn) -> None:
        task = asyncio.current_task()
        assert task is not None
        writer: asyncio.StreamWriter | None = None
        try:
            loop = asyncio.get_running_loop()
            reader = asyncio.StreamReader(limit=READ_CHUNK)
            protocol = asyncio.StreamReaderProtocol(reader)
            transport, _ = await loop.connect_accepted_socket(lambda: protocol, client)
            writer = asyncio.StreamWriter(transport, protocol, reader, loop)
            await self._serve(c, reader, writer)
        except (asyncio.CancelledError, ConnectionError, _Disconnected, h11.ProtocolError,
                _TimedOut):
            pass
        except Exception as exc:  # a bug: one line, not a traceback per connection
            self._warnings.warn("connection", f"connection dropped after an internal error: "
                                f"{type(exc).__name__}: {exc}. Hint: this is a daemon bug; "
                                "report it with the request that caused it.")
        finally:
            self._conns.pop(task, None)
            if writer is not None:
                writer.close()
                with contextlib.suppress(BaseException):
                    await writer.wait_closed()
            else:
                client.close()

    async def _read(self, reader: asyncio.StreamReader, timeout: float, partial: bool,
                    what: str) -> bytes:
        if timeout <= 0:
            raise _TimedOut(partial, what)
        try:
            return await asyncio.wait_for(reader.read(READ_CHUNK), timeout)
        except asyncio.TimeoutError:
            raise _TimedOut(partial, what) from None

    async def _read_head(self, c: _Conn, conn: h11.Connection, reader: asyncio.StreamReader,
                         first: bool) -> object:
        """The next request head (or ConnectionClosed / PAUSED), under the timeouts and
        MAX_HEAD_BYTES. h11 bounds only a head still incomplete when it looks: one that
        completes within the read that crosses the limit would pass (up to twice the limit),
        so the head's size is counted here as well."""
        loop = asyncio.get_running_loop()
        fed = len(conn.trailing_data[0])
        got = bool(fed)
        start = c.accepted if first else loop.time()
        c.idle, c.since = not got, start
        wait = self.header_timeout_s if (first or got) else self.idle_timeout_s
        deadline = start + wait
        late_look = True
        while True:
            event = conn.next_event()
            if event is not h11.NEED_DATA:
                c.idle = False
                head = fed - len(conn.trailing_data[0])
                if isinstance(event, h11.Request) and head > MAX_HEAD_BYTES:
                    raise h11.RemoteProtocolError(
                        f"request head of {head} bytes is over the limit of {MAX_HEAD_BYTES}",
                        error_status_hint=431)
                return event
            what = (f"the request head did not arrive within {self.header_timeout_s:g} s"
                    if got or first else f"idle for {self.idle_timeout_s:g} s")
            timeout = deadline - loop.time()
            if timeout <= 0 and late_look:
                # The deadline passed before this connection was read at all: the whole
                # process was stalled (memory.high throttling, a suspended VM). What the client
                # sent meanwhile waits in the socket and counts; the loop looks once.
                timeout, late_look = LATE_LOOK_S, False
            data = await self._read(reader, timeout, got, what)
            if data and not got:
                got, c.idle = True, False
                if not first:
                    deadline = loop.time() + self.header_timeout_s
            fed += len(data)
            conn.receive_data(data)

    async def _serve(self, c: _Conn, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
        first = True
        while not self._closing or c.busy:
            try:
                event = await self._read_head(c, conn, reader, first)
            except h11.RemoteProtocolError as exc:
                if conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                    status = exc.error_status_hint
                    hint = _HEAD_HINTS.get(status, _HEAD_HINTS[400])
                    msg = f"malformed HTTP request: {_cut(exc)}. Hint: {hint}."
                    await self._refuse_request(conn, reader, writer,
                                               _err(status, "bad_http", msg))
                return
            except _TimedOut as exc:
                if exc.partial and conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                    await self._timed_out(conn, reader, writer, exc)
                return
            if event is h11.PAUSED or isinstance(event, h11.ConnectionClosed):
                return
            if not isinstance(event, h11.Request):
                return
            first = False
            c.busy = True
            if c.limited and not self._is_priority(event):
                await self._refuse_request(conn, reader, writer, self._busy_response())
                return
            try:
                request, early = await self._read_request(conn, reader, writer, event)
            except h11.RemoteProtocolError as exc:
                chunked = any(k.lower() == b"transfer-encoding" for k, _ in event.headers)
                framing = ("chunked: each chunk is its size in hex, CRLF, the data, CRLF; a "
                           "0-size chunk ends it" if chunked else "exactly Content-Length bytes")
                msg = f"malformed request body: {_cut(exc)}. Hint: send the body {framing}."
                await self._refuse_request(conn, reader, writer,
                                           self._err_for(_path_of(event), 400, "bad_http", msg))
                return
            except _TimedOut as exc:
                await self._timed_out(conn, reader, writer, exc)
                return
            if early is not None:
                if early.status == 413:
                    await self._send(conn, writer, early, close=True)
                    await _linger(reader, writer, 4 * self._limit_for(event) + READ_CHUNK)
                    return
                await self._send(conn, writer, early, close=c.limited or self._closing)
            else:
                assert request is not None
                response = await self._run_handler(conn, reader, request)
                close = self._closing or c.limited
                if isinstance(response, StreamResponse):
                    await self._stream(conn, reader, writer, response, close)
                else:
                    await self._send(conn, writer, response, close=close)
            c.busy = False
            if (c.limited or conn.our_state is h11.MUST_CLOSE
                    or conn.their_state is h11.MUST_CLOSE):
                return
            try:
                conn.start_next_cycle()
            except h11.LocalProtocolError:
                return

    def _is_priority(self, event: h11.Request) -> bool:
        path = event.target.split(b"?", 1)[0].decode("latin-1").rstrip("/") or "/"
        return event.method in (b"GET", b"HEAD") and path in self.priority_paths

    async def _refuse_request(self, conn: h11.Connection, reader: asyncio.StreamReader,
                              writer: asyncio.StreamWriter, response: Response) -> None:
        """Answer and close; read out what the client still sends so it can read the answer."""
        with contextlib.suppress(h11.LocalProtocolError):
            await self._send(conn, writer, response, close=True)
        await _linger(reader, writer, 4 * READ_CHUNK, timeout_s=1.0)

    async def _timed_out(self, conn: h11.Connection, reader: asyncio.StreamReader,
                         writer: asyncio.StreamWriter, exc: _TimedOut) -> None:
        msg = (f"{exc.what}; closing the connection. Hint: send the whole request without "
               "pauses (a client must not hold a connection open mid-request).")
        with contextlib.suppress(h11.LocalProtocolError):
            await self._send(conn, writer, _err(408, "request_timeout", msg), close=True)
        await _linger(reader, writer, READ_CHUNK, timeout_s=0.2)

    def _limit_for(self, event: h11.Request) -> int:
        if self.body_limit is None:
            return self.max_body_bytes
        own = self.body_limit(event.method.decode("latin-1"), _path_of(event))
        return self.max_body_bytes if own is None else own

    def _too_large(self, limit: int, path: str) -> Response:
        hint = ("send a smaller body or raise server.max_body_bytes"
                if limit == self.max_body_bytes else "send a smaller body")
        return self._err_for(path, 413, "body_too_large",
                             f"request body is larger than the limit of {limit} bytes. "
                             f"Hint: {hint}.")

    def _err_for(self, path: str, status: int, code: str, message: str) -> Response:
        """`_err` in the shape of the API `path` belongs to (`error_body`)."""
        body = self.error_body(path, status, code, message) if self.error_body else None
        return _err(status, code, message) if body is None else Response(status, body)

    async def _read_request(self, conn: h11.Connection, reader: asyncio.StreamReader,
                            writer: asyncio.StreamWriter,
                            event: h11.Request) -> tuple[Request | None, Response | None]:
        """The whole request, or an early answer instead (413, or 400 for the query)."""
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in event.headers}
        length = headers.get("content-length")
        limit = self._limit_for(event)
        if length is not None and length.isdigit() and (
                len(length) > 18 or int(length) > limit):
            return None, self._too_large(limit, _path_of(event))
        has_body = length not in (None, "0") or "transfer-encoding" in headers
        if conn.client_is_waiting_for_100_continue and has_body:
            writer.write(conn.send(h11.InformationalResponse(status_code=100, headers=[])))
            await self._drain(writer)
        body = bytearray()
        what = f"the request body stopped arriving for {self.header_timeout_s:g} s"
        while True:
            ev = conn.next_event()
            if ev is h11.NEED_DATA:
                conn.receive_data(await self._read(reader, self.header_timeout_s, True, what))
            elif isinstance(ev, h11.Data):
                body += ev.data
                if len(body) > limit:
                    return None, self._too_large(limit, _path_of(event))
            elif isinstance(ev, h11.EndOfMessage):
                break
            else:
                raise _Disconnected()
        path, query = _split_target(event.target.decode("latin-1"))
        try:
            parsed_query = parse_query(query)
        except ApiError as exc:
            return None, Response(exc.status, exc.body(), headers=exc.headers)
        req = Request(
            method=event.method.decode("ascii").upper(),
            path=path,
            query=parsed_query,
            headers=headers,
            body=bytes(body),
        )
        return req, None

    async def _run_handler(self, conn: h11.Connection, reader: asyncio.StreamReader,
                           request: Request) -> Response | StreamResponse:
        """Run the handler while watching for the client hanging up (then cancel it)."""
        work = asyncio.ensure_future(self.handler(request))
        watch = asyncio.ensure_future(reader.read(READ_CHUNK))
        try:
            while True:
                done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
                if work in done:
                    try:
                        return work.result()
                    except Exception as exc:
                        return self._internal_error(request, exc)
                data = _watch_result(watch)
                if not data:
                    work.cancel()
                    with contextlib.suppress(BaseException):
                        await work
                    raise _Disconnected()
                conn.receive_data(data)  # pipelined next request: h11 keeps it for later
                watch = asyncio.ensure_future(reader.read(READ_CHUNK))
        finally:
            await _settle(conn, watch)

    def _internal_error(self, request: Request, exc: Exception) -> Response:
        what = f"{request.method} {request.path[:200]}"
        self._warnings.warn("handler", f"internal error while handling {what}: "
                            f"{type(exc).__name__}: {_cut(exc)}")
        msg = (f"{what}: internal error ({type(exc).__name__}). Hint: this is a daemon bug; "
               "the daemon's log has the details, and sending the same request again will "
               "likely fail the same way.")
        return self._err_for(request.path, 500, "internal_error", msg)

    async def _stream(self, conn: h11.Connection, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter, response: StreamResponse, close: bool) -> None:
        headers = [("content-type", response.content_type), ("cache-control", "no-cache"),
                   *response.headers]
        if close:
            headers.append(("connection", "close"))
        agen = response.chunks
        nxt: asyncio.Future[bytes] | None = None
        watch = asyncio.ensure_future(reader.read(READ_CHUNK))
        try:
            writer.write(conn.send(h11.Response(status_code=response.status, headers=headers)))
            await self._drain(writer)
            while True:
                if nxt is None:
                    nxt = asyncio.ensure_future(agen.__anext__())
                done, _ = await asyncio.wait({nxt, watch}, return_when=asyncio.FIRST_COMPLETED)
                if watch in done:
                    data = _watch_result(watch)
                    if not data:
                        raise _Disconnected()
                    conn.receive_data(data)
                    watch = asyncio.ensure_future(reader.read(READ_CHUNK))
                if nxt in done:
                    try:
                        chunk = nxt.result()
                    except StopAsyncIteration:
                        nxt = None
                        break
                    nxt = None
                    writer.write(conn.send(h11.Data(data=chunk)))
                    await self._drain(writer)
            writer.write(conn.send(h11.EndOfMessage()))
            await self._drain(writer)
        finally:
            await _settle(conn, watch)
            if nxt is not None:
                # Pending: cancel it. Done (the generator ended or yielded while the client hung
                # up): awaiting collects that outcome, which asyncio would otherwise report as
                # "Task exception was never retrieved".
                nxt.cancel()
                with contextlib.suppress(BaseException):
                    await nxt
            aclose = getattr(agen, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(BaseException):
                    await aclose()

    async def _send(self, conn: h11.Connection, writer: asyncio.StreamWriter, response: Response,
                    *, close: bool) -> None:
        headers = [("content-type", response.content_type),
                   ("content-length", str(len(response.body))), *response.headers]
        if close:
            headers.append(("connection", "close"))
        writer.write(conn.send(h11.Response(status_code=response.status, headers=headers)))
        if response.body:
            writer.write(conn.send(h11.Data(data=response.body)))
        writer.write(conn.send(h11.EndOfMessage()))
        await self._drain(writer)

    async def _drain(self, writer: asyncio.StreamWriter) -> None:
        """Wait for the client to take the bytes; one that reads nothing is dropped."""
        transport = writer.transport
        if not transport.is_closing() and transport.get_write_buffer_size() == 0:
            return  # the socket took it all: nothing to wait for (no timer, no task per chunk)
        try:
            await asyncio.wait_for(writer.drain(), self.send_timeout_s)
        except asyncio.TimeoutError:
            raise _Disconnected() from None


def _path_of(event: h11.Request) -> str:
    return _split_target(event.target.decode("latin-1"))[0]


def _split_target(target: str) -> tuple[str, str]:
    """(percent-decoded path, raw query) of an origin-form ("/p?q") or absolute-form target."""
    path, _, query = target.partition("?")
    path = path.partition("#")[0]
    query = query.partition("#")[0]
    if "://" in path and not path.startswith("/"):  # absolute-form: http://host/path
        rest = path.split("://", 1)[1]
        path = "/" + rest.partition("/")[2]
    return unquote(path), query


def _cut(exc: BaseException, limit: int = 200) -> str:
    text = str(exc)
    return text if len(text) <= limit else text[:limit] + "...(cut)"


def _sock_name(sock: socket.socket) -> str:
    with contextlib.suppress(OSError):
        name = sock.getsockname()
        if isinstance(name, tuple):
            return f"{name[0]}:{name[1]}"
        return str(name or "an unnamed socket")
    return "a listening socket"


async def _read_out(client: socket.socket, loop: asyncio.AbstractEventLoop) -> None:
    """After a canned reply: stop writing, read what the client sent (bounded), then close, so
    the close does not reset the connection before the client has read the reply."""
    try:
        with contextlib.suppress(OSError):
            client.shutdown(socket.SHUT_WR)
        left = 4 * READ_CHUNK
        end = loop.time() + 1.0
        while left > 0:
            timeout = end - loop.time()
            if timeout <= 0:
                break
            try:
                data = await asyncio.wait_for(loop.sock_recv(client, READ_CHUNK), timeout)
            except (OSError, asyncio.TimeoutError):
                break
            if not data:
                break
            left -= len(data)
    finally:
        client.close()


async def _settle(conn: h11.Connection, watch: asyncio.Future[bytes]) -> None:
    """Stop watching the client; bytes (or EOF) the watch already read go to h11, not lost."""
    if not watch.done():
        watch.cancel()
        with contextlib.suppress(BaseException):
            await watch
    if watch.done() and not watch.cancelled():
        with contextlib.suppress(h11.ProtocolError, RuntimeError):
            conn.receive_data(_watch_result(watch))


async def _linger(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, limit: int,
                  timeout_s: float = 2.0) -> None:
    """After an early error reply, read and drop what the client is still sending (bounded),
    so closing does not reset the connection before the client has read the reply."""
    with contextlib.suppress(Exception):
        if writer.can_write_eof():
            writer.write_eof()
        end = asyncio.get_running_loop().time() + timeout_s
        while limit > 0:
            left = end - asyncio.get_running_loop().time()
            if left <= 0:
                break
            data = await asyncio.wait_for(reader.read(READ_CHUNK), left)
            if not data:
                break
            limit -= len(data)


def _watch_result(watch: asyncio.Future[bytes]) -> bytes:
    try:
        return watch.result()
    except (ConnectionError, OSError):
        return b""


def _remove_stale(path: Path) -> None:
    try:
        st = path.lstat()
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        # nothing a restart changes: a configuration error (exit 78), which stops systemd's
        # restart loop (RestartPreventExitStatus=78)
        raise SocketPathError(
            f"socket path {path}: exists and is {file_kind(st.st_mode)}, not a socket. "
            "Hint: choose another --socket path (server.socket), or remove what is there if "
            "it is not needed."
        )
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:
        path.unlink()  # stale: nobody listens
        return
    finally:
        probe.close()
    raise SocketInUseError(
        f"socket path {path}: another process is already serving on it. "
        "Hint: stop the other daemon (`systemctl stop edge-agent`) or use another --socket."
    )
