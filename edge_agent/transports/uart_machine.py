"""Machine mode of a UART session: COBS frames from an MCU in, ACK/TOKEN/DONE/ERROR/NAK out.

Invariants owned here:
- An MCU request id (u16) maps to one daemon request per port (the last 256 kept). Every frame
  that is not valid gets a NAK with its reason; a GENERATE gets an ACK or an ERROR, then TOKEN
  frames (index = generated-token index, empty pieces skipped) and one DONE or ERROR.
- RESUME (and a repeated GENERATE id) replaces that id's stream: after the ACK of a RESUME the
  tokens start at the asked index; frames of the old stream never follow that ACK.
- SCHEMA registers a JSON Schema under a u8 id on this port (at most fr.MAX_SCHEMAS; the same id
  replaces it, an empty text forgets it): ACK once the backend's `check_format` accepts it,
  else ERROR BAD_REQUEST with the reason. Registrations live as long as the daemon process.
- A GENERATE's extension maps one to one onto GenParams; its schema or schema id becomes the
  HTTP API's `response_format` (json_schema named "schema" / "schema_<id>", strict).
- Backend failures become ERROR frames; nothing raises into the event loop.
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TypeVar

from edge_agent.errors import EdgeAgentError
from edge_agent.protocol import frames as fr
from edge_agent.protocol.frame_ext import SAMPLING_EXTRAS
from edge_agent.transports.backend import Backend, BackendError, Done, GenParams, Token

__all__ = ["MachineSession"]
_P = TypeVar("_P")

ERROR_CODES = {
    "invalid_request": fr.ErrorCode.BAD_REQUEST, "context_exceeded": fr.ErrorCode.BAD_REQUEST,
    "model_not_found": fr.ErrorCode.BAD_REQUEST, "queue_full": fr.ErrorCode.QUEUE_FULL,
    "deadline_exceeded": fr.ErrorCode.DEADLINE, "not_found": fr.ErrorCode.NOT_FOUND,
    "shutting_down": fr.ErrorCode.SHUTTING_DOWN, "cancelled": fr.ErrorCode.CANCELLED,
}


class MachineSession:
    def __init__(self, backend: Backend, write: Callable[[bytes], None], *, name: str,
                 stats: Callable[[], dict[str, Any]]) -> None:
        self.backend = backend
        self.write = write
        self.name = name
        self.stats = stats
        self.counters = {"naks": 0, "generations": 0}
        self._streams: dict[int, asyncio.Task[None]] = {}
        self._rids: OrderedDict[int, str] = OrderedDict()
        self.schemas: dict[int, dict[str, Any]] = {}  # id -> response_format

    @staticmethod
    def _format(name: str, schema: dict[str, Any]) -> dict[str, Any]:
        return {"type": "json_schema",
                "json_schema": {"name": name, "schema": schema, "strict": True}}

    def _params(self, f: fr.Frame, g: fr.Generate) -> GenParams | None:
        """GenParams of a GENERATE; None after an ERROR frame (an unknown schema id)."""
        fmt: dict[str, Any] | None = None
        if g.json_object:
            fmt = {"type": "json_object"}
        elif g.schema is not None:
            fmt = self._format("schema", g.schema)
        elif g.schema_id is not None:
            fmt = self.schemas.get(g.schema_id)
            if fmt is None:
                self._error(f.rid, "not_found", f"schema id {g.schema_id} is not registered on "
                            "this port. Hint: send a SCHEMA frame with it first (registrations "
                            "end when the daemon restarts).")
                return None
        return GenParams(g.max_tokens, g.temperature, g.seed,
                         **{k: getattr(g, k) for k in SAMPLING_EXTRAS}, response_format=fmt)

    def _schema(self, f: fr.Frame) -> None:
        try:
            sid, schema = fr.unpack_schema(f.payload)
        except ValueError as exc:
            self.nak(f.rid, fr.NakReason.BAD_PAYLOAD, str(exc))
            return
        if schema is None:
            self.schemas.pop(sid, None)
            self._send(fr.FrameType.ACK, f.rid)
            return
        if sid not in self.schemas and len(self.schemas) >= fr.MAX_SCHEMAS:
            self._error(f.rid, "invalid_request", f"schema id {sid}: {fr.MAX_SCHEMAS} schemas "
                        "are registered on this port already. Hint: reuse an id (the same id "
                        "replaces its schema) or forget one (SCHEMA with the id alone).")
            return
        fmt = self._format(f"schema_{sid}", schema)
        try:
            self.backend.check_format(fmt)
        except BackendError as exc:
            self._error(f.rid, exc.code, f"schema id {sid}: {exc}")
            return
        except EdgeAgentError as exc:
            self._error(f.rid, "failed", f"schema id {sid}: {exc}")
            return
        self.schemas[sid] = fmt
        self._send(fr.FrameType.ACK, f.rid)

    async def close(self) -> None:
        tasks = list(self._streams.values())
        for t in tasks:
            t.cancel()
        for t in tasks:
            try:
                await t
            except BaseException:  # noqa: BLE001 - cancelled or failed: closing anyway
                pass

    def _send(self, type_: fr.FrameType, rid: int, payload: bytes = b"") -> None:
        self.write(fr.encode_frame(type_, rid, payload))

    def nak(self, rid: int, reason: fr.NakReason, detail: str) -> None:
        self.counters["naks"] += 1
        self._send(fr.FrameType.NAK, rid, fr.pack_nak(reason, detail))

    def _error(self, rid: int, code: str, message: str) -> None:
        err = ERROR_CODES.get(code, fr.ErrorCode.FAILED)
        self._send(fr.FrameType.ERROR, rid, fr.pack_error(err, message))

    def _unpacked(self, f: fr.Frame, unpack: Callable[[bytes], _P]) -> tuple[_P] | None:
        """(`unpack(f.payload)`,), or None after a NAK naming what is malformed."""
        try:
            return (unpack(f.payload),)
        except ValueError as exc:
            self.nak(f.rid, fr.NakReason.BAD_PAYLOAD, str(exc))
            return None

    def handle(self, f: fr.Frame) -> None:
        t = f.type
        if t == fr.FrameType.GENERATE:
            got = self._unpacked(f, fr.unpack_generate)
            if got is None:
                return
            g = got[0]
            prompt: str | list[dict[str, str]] = (
                [{"role": "user", "content": g.prompt}] if g.chat else g.prompt)
            params = self._params(f, g)
            if params is None:
                return
            try:
                rid = self.backend.submit(prompt, params, g.priority, g.deadline_ms or None,
                                          f"uart:{self.name}:mcu")
            except BackendError as exc:
                self._error(f.rid, exc.code, str(exc))
                return
            except EdgeAgentError as exc:
                self._error(f.rid, "failed", str(exc))
                return
            old = self._rids.pop(f.rid, None)
            if old is not None:
                self.backend.cancel(old)
            self._rids[f.rid] = rid
            while len(self._rids) > 256:
                self._rids.popitem(last=False)
            self.counters["generations"] += 1
            self._send(fr.FrameType.ACK, f.rid)
            self._stream_frames(f.rid, rid, 0)
        elif t in (fr.FrameType.CANCEL, fr.FrameType.RESUME):
            # the frame itself first (a malformed one is malformed whatever its id names)
            if t == fr.FrameType.CANCEL and f.payload:
                self.nak(f.rid, fr.NakReason.BAD_PAYLOAD,
                         f"CANCEL takes no payload, got {len(f.payload)} bytes")
                return
            resume = self._unpacked(f, fr.unpack_resume) if t == fr.FrameType.RESUME else (0,)
            if resume is None:
                return
            if f.rid not in self._rids:
                self._error(f.rid, "not_found", f"no request with id {f.rid} on this port. "
                            "Hint: ids are kept for the last 256 GENERATE frames.")
                return
            rid = self._rids[f.rid]
            if t == fr.FrameType.CANCEL:
                self.backend.cancel(rid)
                self._send(fr.FrameType.ACK, f.rid)
                return
            self._send(fr.FrameType.ACK, f.rid)
            self._stream_frames(f.rid, rid, resume[0])
        elif t == fr.FrameType.SCHEMA:
            self._schema(f)
        elif t == fr.FrameType.STATUS:
            try:
                st = self.backend.status()
            except EdgeAgentError as exc:
                self._error(f.rid, "failed", str(exc))
                return
            st = {**st, "link": self.stats()}
            data = json.dumps(st, separators=(",", ":"), default=str).encode()
            self._send(fr.FrameType.STATUS_REPLY, f.rid, data[:fr.MAX_PAYLOAD])
        else:
            self.nak(f.rid, fr.NakReason.UNKNOWN_TYPE,
                      f"type 0x{t:02x} is a reply type; an MCU sends 0x01-0x05")

    def _stream_frames(self, mcu_id: int, rid: str, start: int) -> None:
        old = self._streams.pop(mcu_id, None)
        if old is not None:
            old.cancel()
        task = asyncio.ensure_future(self._frames_out(mcu_id, rid, start))
        self._streams[mcu_id] = task

        def _forget(t: asyncio.Task[None]) -> None:
            if self._streams.get(mcu_id) is t:
                del self._streams[mcu_id]

        task.add_done_callback(_forget)

    async def _frames_out(self, mcu_id: int, rid: str, start: int) -> None:
        try:
            async for ev in self.backend.events(rid, start):
                if isinstance(ev, Token):
                    if ev.text:
                        self._send(fr.FrameType.TOKEN, mcu_id, fr.pack_token(ev.index, ev.text))
                elif isinstance(ev, Done):
                    self._send(fr.FrameType.DONE, mcu_id, fr.pack_done(ev.tokens, ev.reason))
                    return
                else:
                    self._error(mcu_id, ev.code, ev.message)
                    return
        except BackendError as exc:
            self._error(mcu_id, exc.code, str(exc))
        except EdgeAgentError as exc:
            self._error(mcu_id, "failed", str(exc))
