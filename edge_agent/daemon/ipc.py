"""The control plane <-> runner protocol: typed messages over 4-byte big-endian length + UTF-8 JSON.

Every message is a frozen dataclass below; `encode` and `decode` are the only places that know
their wire form (a JSON object whose "op" names the type), so neither side probes dicts.

Invariants owned here:
- One frame is one JSON object of plain data (no pickle: a runner can never make the control
  plane execute code). Frames are bounded by MAX_FRAME; a larger length prefix is a protocol
  error, not an allocation.
- EOF before a complete frame means the peer is gone: `RunnerGone` (async side) / `EOFError`
  (blocking side), never a partial object.
- `decode` accepts exactly the fields of the named message (extra, missing or mistyped ones are
  a ValueError naming the op and the field); `decode(encode(m)) == m` for every message.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import socket
import struct
import types
import typing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Union

from edge_agent.errors import EdgeAgentError

if TYPE_CHECKING:  # the runner reads frames without asyncio (imported by the control plane)
    import asyncio

__all__ = ["MAX_FRAME", "FrameTooLarge", "RunnerGone", "encode_frame", "read_frame", "recv_frame",
           "send_frame",
           "Message", "encode", "decode", "AddSeq", "Step", "Embed", "Ping", "Shutdown", "Hurry",
           "Status", "Progress", "Failed", "Ready", "StepResult", "Embedded", "Pong",
           "ErrorReply", "TokenLogprob", "Snapshot", "SnapshotData", "Restore", "Restored"]

MAX_FRAME = 64 << 20
_LEN = struct.Struct(">I")


class RunnerGone(EdgeAgentError):
    """The runner's end of the socketpair closed (the process exited or was killed)."""


class FrameTooLarge(EOFError):
    """A length prefix over MAX_FRAME (blocking side): the stream cannot be read on, so it
    ends here like an EOF, but the reason can be told."""


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
    except (EOFError, ConnectionError) as exc:  # EOFError: asyncio.IncompleteReadError
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
        raise FrameTooLarge(f"a frame of {n} bytes exceeds MAX_FRAME={MAX_FRAME}")
    return _decode(_recv_exact(sock, n))


def send_frame(sock: socket.socket, obj: dict[str, Any]) -> None:
    sock.sendall(encode_frame(obj))


# ----- messages ----------------------------------------------------------------------------------
# (logprob of the chosen token, ((id, logprob), ...) the most likely ones)
TokenLogprob = tuple[float, tuple[tuple[int, float], ...]]


# control plane -> runner
@dataclass(frozen=True)
class AddSeq:
    """A new sequence: `prompt` ids (plus `generated` ones of a resumed request) are prefilled;
    `params` are the request's SamplingParams fields (and "grammar") as journaled."""

    id: str
    prompt: tuple[int, ...]
    params: dict[str, Any]
    generated: tuple[int, ...] = ()


@dataclass(frozen=True)
class Step:
    """Release, then add (prefill: each returns its first token), then `steps` decode steps of
    the `step` sequences. A sequence stops early in a message at a stop id or after
    `limits[id]` tokens (default `steps`); its first token goes in the reply's `tokens`, the
    rest in `then`. Logprobs are reported for the first step only (ask for one step when a
    sequence wants them). A Hurry that arrives meanwhile ends it after the step in progress."""

    release: tuple[str, ...] = ()
    add: tuple[AddSeq, ...] = ()
    step: tuple[str, ...] = ()
    steps: int = 1
    limits: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Embed:
    inputs: tuple[tuple[int, ...], ...]  # token ids, one list per vector


@dataclass(frozen=True)
class Snapshot:
    """The KV state of the free slot holding a prefix of `tokens` (a finished session turn)."""

    tokens: tuple[int, ...]


@dataclass(frozen=True)
class Restore:
    """Load a `SnapshotData.data` blob into a free slot, as holding the first of `tokens`."""

    tokens: tuple[int, ...]
    data: bytes


@dataclass(frozen=True)
class Ping:
    pass


@dataclass(frozen=True)
class Shutdown:
    pass


@dataclass(frozen=True)
class Hurry:
    """No reply: work waits in the control plane (a queued request), so the runner ends the
    step message in progress after its current decode step (its reply says how many ran).
    Between messages it means nothing and is dropped."""


# runner -> control plane
@dataclass(frozen=True)
class Status:
    state: str  # "loading", "warming"
    pid: int | None = None


@dataclass(frozen=True)
class Progress:
    stage: str
    done: int
    total: int


@dataclass(frozen=True)
class Failed:
    error: str


@dataclass(frozen=True)
class Ready:
    pid: int
    load_s: float
    warm_s: float
    lock: dict[str, Any] | None  # the engine's lock_report()
    stop_ids: tuple[int, ...]
    context: int
    free_blocks: int | None
    engine: dict[str, Any]  # the engine's describe()
    batch_invariant: bool | None


@dataclass(frozen=True)
class StepResult:
    tokens: dict[str, int]
    errors: dict[str, str]
    free_blocks: int | None
    step_s: float
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)  # those that asked
    cached: dict[str, int] = field(default_factory=dict)  # per add: prompt-cache tokens reused
    then: dict[str, tuple[int, ...]] = field(default_factory=dict)  # later steps' tokens, in order
    steps: int = 1  # decode steps run (step_s covers them all)


@dataclass(frozen=True)
class Embedded:
    """`vectors` float32 little-endian, row after row (count x dim); or the engine's `error`."""

    count: int = 0
    dim: int = 0
    vectors: bytes = b""
    embed_s: float = 0.0
    error: str | None = None


@dataclass(frozen=True)
class SnapshotData:
    """An engine blob (empty: nothing worth keeping, or an engine without snapshots) holding
    the KV of the first `tokens` ids, for the engine `identity` (model and context)."""

    data: bytes = b""
    tokens: int = 0
    identity: str = ""


@dataclass(frozen=True)
class Restored:
    ok: bool


@dataclass(frozen=True)
class Pong:
    free_blocks: int | None


@dataclass(frozen=True)
class ErrorReply:
    error: str


Message = (AddSeq | Step | Embed | Ping | Shutdown | Hurry | Status | Progress | Failed | Ready
           | StepResult | Embedded | Pong | ErrorReply | Snapshot | SnapshotData | Restore
           | Restored)
_OPS: dict[str, type[Any]] = {
    "step": Step, "embed": Embed, "ping": Ping, "shutdown": Shutdown, "hurry": Hurry,
    "status": Status,
    "progress": Progress, "failed": Failed, "ready": Ready, "result": StepResult,
    "embedded": Embedded, "pong": Pong, "error": ErrorReply, "snapshot": Snapshot,
    "snapshot_data": SnapshotData, "restore": Restore, "restored": Restored,
}
_NAMES = {cls: op for op, cls in _OPS.items()}


def _plain(value: Any) -> Any:
    if isinstance(value, bytes):
        return base64.b64encode(value).decode("ascii")
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def encode(msg: Message) -> dict[str, Any]:
    """The wire form of `msg`: a JSON-ready dict with "op"."""
    out: dict[str, Any] = {"op": _NAMES[type(msg)]}
    out.update(_plain(msg))
    return out


def _typed(value: Any, hint: Any, where: str) -> Any:
    """`value` (decoded JSON) as the type `hint`, or ValueError naming `where`."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is Any:
        return value
    if origin is Union or origin is types.UnionType:
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _typed(value, arg, where)
            except ValueError:
                continue
        raise ValueError(f"{where}: {value!r} is not {hint}")
    if origin is tuple:
        if not isinstance(value, list):
            raise ValueError(f"{where}: expected a list, got {type(value).__name__}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_typed(v, args[0], f"{where}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise ValueError(f"{where}: expected {len(args)} items, got {len(value)}")
        pairs = enumerate(zip(value, args, strict=True))
        return tuple(_typed(v, a, f"{where}[{i}]") for i, (v, a) in pairs)
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected an object, got {type(value).__name__}")
        return {str(k): _typed(v, args[1], f"{where}.{k}") for k, v in value.items()}
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected an object, got {type(value).__name__}")
        return _build(hint, value, where)
    if hint is bytes:
        if not isinstance(value, str):
            raise ValueError(f"{where}: expected base64 text, got {type(value).__name__}")
        return base64.b64decode(value, validate=True)
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if hint is int or hint is bool or hint is str:
        if type(value) is not hint:
            raise ValueError(f"{where}: expected {hint.__name__}, got {value!r}")
        return value
    raise ValueError(f"{where}: no decoder for {hint}")  # pragma: no cover - a new field type


_SCHEMAS: dict[type[Any], tuple[tuple[str, Any, bool], ...]] = {}


def _schema(cls: type[Any]) -> tuple[tuple[str, Any, bool], ...]:
    """(name, type, required) of each field of `cls`: worked out once per message class, not on
    every frame (get_type_hints evaluates the annotations' text each time it is called)."""
    schema = _SCHEMAS.get(cls)
    if schema is None:
        hints = typing.get_type_hints(cls)
        schema = _SCHEMAS[cls] = tuple(
            (f.name, hints[f.name], f.default is dataclasses.MISSING
             and f.default_factory is dataclasses.MISSING) for f in dataclasses.fields(cls))
    return schema


def _build(cls: type[Any], d: dict[str, Any], where: str) -> Any:
    schema = _schema(cls)
    extra = sorted(set(d) - {name for name, _, _ in schema})
    if extra:
        raise ValueError(f"{where}: unknown field {extra[0]!r}")
    kw = {}
    for name, hint, required in schema:
        if name in d:
            kw[name] = _typed(d[name], hint, f"{where}.{name}")
        elif required:
            raise ValueError(f"{where}: field {name!r} is missing")
    return cls(**kw)


def decode(obj: dict[str, Any]) -> Message:
    """The message `obj` (a decoded frame) holds; ValueError naming what is wrong."""
    op = obj.get("op")
    if not isinstance(op, str) or op not in _OPS:
        raise ValueError(f"runner protocol: unknown op {op!r}")
    cls = _OPS[op]
    fields_ = {k: v for k, v in obj.items() if k != "op"}
    msg: Message = _build(cls, fields_, op)
    return msg
