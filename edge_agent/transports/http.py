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
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
import os
import socket
import stat
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

import h11

from edge_agent.errors import EdgeAgentError
from edge_agent.protocol.api import error_body

__all__ = ["Request", "Response", "StreamResponse", "HttpServer", "Handler", "SocketInUseError"]

READ_CHUNK = 65536


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


def _err(status: int, code: str, message: str) -> Response:
    return Response(status, error_body(code, message))


class _Disconnected(Exception):
    pass


class HttpServer:
    """Serve `handler` over HTTP/1.1 on any number of listening sockets."""

    def __init__(self, handler: Handler, *, max_body_bytes: int = 1 << 20,
                 drain_timeout_s: float = 10.0) -> None:
        self.handler = handler
        self.max_body_bytes = max_body_bytes
        self.drain_timeout_s = drain_timeout_s
        self._servers: list[asyncio.AbstractServer] = []
        self._unix_paths: list[Path] = []
        self._conns: dict[asyncio.Task[None], bool] = {}  # task -> busy
        self._closing = False

    # ---- listening -------------------------------------------------------------------------
    async def listen_unix(self, path: Path, *, mode: int = 0o660, group: str | None = None) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(str(path))
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
        server = await asyncio.start_server(self._on_client, host, port)
        self._servers.append(server)
        return int(server.sockets[0].getsockname()[1])

    async def adopt(self, sock: socket.socket) -> None:
        """Serve on an already listening socket (socket activation hands these over)."""
        sock.setblocking(False)
        if sock.family == socket.AF_UNIX:
            server = await asyncio.start_unix_server(self._on_client, sock=sock)
        else:
            server = await asyncio.start_server(self._on_client, sock=sock)
        self._servers.append(server)

    async def close(self) -> None:
        """Stop accepting, let busy connections finish (bounded), close the rest."""
        self._closing = True
        for server in self._servers:
            server.close()
        for path in self._unix_paths:
            with contextlib.suppress(OSError):
                path.unlink()
        for task, busy in list(self._conns.items()):
            if not busy:
                task.cancel()
        pending = list(self._conns)
        if pending:
            _, still = await asyncio.wait(pending, timeout=self.drain_timeout_s)
            for task in still:
                task.cancel()
            if still:
                await asyncio.wait(still, timeout=1.0)

    # ---- connections -----------------------------------------------------------------------
    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns[task] = False
        try:
            await self._serve(task, reader, writer)
        except (asyncio.CancelledError, ConnectionError, _Disconnected, h11.ProtocolError):
            pass
        finally:
            self._conns.pop(task, None)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _next_event(self, conn: h11.Connection, reader: asyncio.StreamReader) -> object:
        while True:
            event = conn.next_event()
            if event is not h11.NEED_DATA:
                return event
            conn.receive_data(await reader.read(READ_CHUNK))

    async def _serve(self, task: asyncio.Task[None], reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=64 * 1024)
        while not self._closing or self._conns.get(task):
            try:
                event = await self._next_event(conn, reader)
            except h11.RemoteProtocolError as exc:
                if conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                    msg = f"malformed HTTP request: {exc}. Hint: send HTTP/1.1."
                    await self._send(conn, writer, _err(exc.error_status_hint, "bad_http", msg),
                                     close=True)
                return
            if event is h11.PAUSED or isinstance(event, h11.ConnectionClosed):
                return
            if not isinstance(event, h11.Request):
                return
            self._conns[task] = True
            request, too_big = await self._read_request(conn, reader, event)
            if too_big:
                msg = (f"request body is larger than the limit of {self.max_body_bytes} bytes. "
                       "Hint: send a smaller body or raise server.max_body_bytes.")
                await self._send(conn, writer, _err(413, "body_too_large", msg), close=True)
                await _linger(reader, writer, 4 * self.max_body_bytes + READ_CHUNK)
                return
            assert request is not None
            response = await self._run_handler(conn, reader, request)
            close = self._closing
            if isinstance(response, StreamResponse):
                await self._stream(conn, reader, writer, response, close)
            else:
                await self._send(conn, writer, response, close=close)
            self._conns[task] = False
            if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
                return
            try:
                conn.start_next_cycle()
            except h11.LocalProtocolError:
                return

    async def _read_request(self, conn: h11.Connection, reader: asyncio.StreamReader,
                            event: h11.Request) -> tuple[Request | None, bool]:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in event.headers}
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return None, True
        body = bytearray()
        while True:
            ev = await self._next_event(conn, reader)
            if isinstance(ev, h11.Data):
                body += ev.data
                if len(body) > self.max_body_bytes:
                    return None, True
            elif isinstance(ev, h11.EndOfMessage):
                break
            else:
                raise _Disconnected()
        parts = urlsplit(event.target.decode("latin-1"))
        req = Request(
            method=event.method.decode("ascii").upper(),
            path=unquote(parts.path),
            query=parse_qs(parts.query),
            headers=headers,
            body=bytes(body),
        )
        return req, False

    async def _run_handler(self, conn: h11.Connection, reader: asyncio.StreamReader,
                           request: Request) -> Response | StreamResponse:
        """Run the handler while watching for the client hanging up (then cancel it)."""
        work = asyncio.ensure_future(self.handler(request))
        watch = asyncio.ensure_future(reader.read(READ_CHUNK))
        try:
            while True:
                done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
                if work in done:
                    return work.result()
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
            await writer.drain()
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
                    await writer.drain()
            writer.write(conn.send(h11.EndOfMessage()))
            await writer.drain()
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
        await writer.drain()


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
        raise SocketInUseError(
            f"socket path {path}: exists and is not a socket. "
            "Hint: choose another --socket path or remove the file."
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
