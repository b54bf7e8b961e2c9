"""Framing between the control plane and a runner: 4-byte big-endian length + UTF-8 JSON object.

Invariants owned here:
- One frame is one JSON object of plain data (no pickle: a runner can never make the control
  plane execute code). Frames are bounded by MAX_FRAME; a larger length prefix is a protocol
  error, not an allocation.
- EOF before a complete frame means the peer is gone: `RunnerGone` (async side) / `EOFError`
  (blocking side), never a partial object.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
from typing import Any

from edge_agent.errors import EdgeAgentError

__all__ = ["MAX_FRAME", "RunnerGone", "encode_frame", "read_frame", "recv_frame", "send_frame"]

MAX_FRAME = 64 << 20
_LEN = struct.Struct(">I")


class RunnerGone(EdgeAgentError):
    """The runner's end of the socketpair closed (the process exited or was killed)."""


def encode_frame(obj: dict[str, Any]) -> bytes:
    data = json.dumps(obj, separators=(",", ":")).encode()
    if len(data) > MAX_FRAME:
        raise ValueError(f"frame of {len(data)} bytes exceeds MAX_FRAME={MAX_FRAME}")
    return _LEN.pack(len(data)) + data


def _decode(data: bytes) -> dict[str, Any]:
    obj = json.loads(data)
    if not isinstance(obj, dict):
        raise ValueError(f"frame holds a JSON {type(obj).__name__}, expected an object")
    return obj


async def read_frame(reader: asyncio.StreamReader) -> dict[str, Any]:
    try:
        head = await reader.readexactly(_LEN.size)
        (n,) = _LEN.unpack(head)
        if n > MAX_FRAME:
            raise RunnerGone(f"runner sent a frame of {n} bytes (limit {MAX_FRAME})")
        return _decode(await reader.readexactly(n))
    except (asyncio.IncompleteReadError, ConnectionError) as exc:
        raise RunnerGone("runner socket closed") from exc


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError("control plane closed the socket")
        buf += chunk
    return bytes(buf)


def recv_frame(sock: socket.socket) -> dict[str, Any]:
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if n > MAX_FRAME:
        raise EOFError(f"frame of {n} bytes exceeds MAX_FRAME")
    return _decode(_recv_exact(sock, n))


def send_frame(sock: socket.socket, obj: dict[str, Any]) -> None:
    sock.sendall(encode_frame(obj))
