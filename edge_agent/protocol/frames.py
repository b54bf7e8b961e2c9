"""Machine mode on a UART: COBS frames with a CRC-32, and the console/frame demultiplexer.

Sans-IO (h11's shape): bytes in, events out; time is a parameter. No port, no asyncio.

Wire format (all integers little-endian, the native order of Cortex-M):

    0x00 | COBS( ver:u8 type:u8 rid:u16 len:u16 | payload[len] | crc32:u32 ) | 0x00

- `ver` is 1. `rid` is chosen by the MCU for its request and echoed in every reply.
- CRC-32 is the IEEE 802.3 / zlib CRC (reflected polynomial 0xEDB88320, init and final XOR
  0xFFFFFFFF) over header + payload. Chosen over CRC-16/CCITT because frames carry prompts of up to
  MAX_PAYLOAD bytes, where a 16-bit check guarantees Hamming distance 4 only up to ~4 KB and lets 1
  in 65536 corrupt frames through; CRC-32 is in Python's stdlib (C speed), in newlib/zlib and in a
  256-entry table or a bitwise loop of ~10 lines on an MCU.
- COBS (Cheshire & Baker) removes every 0x00 from the frame body, so 0x00 only ever delimits.

Invariants owned here:
- `encode_frame(decode(x)) == x` for every valid frame; a decoded frame always passed its CRC.
- A bad frame never raises: it becomes a `FrameError` event with a `NakReason` and bumps exactly one
  counter in `FrameDecoder.counters`; decoding carries on with the next byte.
- Demux (`PortDemux`): a person never types 0x00, so 0x00 switches the port from console to frame
  mode. The body runs to the next 0x00. After a valid frame the port is back in console mode; after
  a bad one it stays in frame mode (the closing 0x00 may really be the opening of the next frame,
  e.g. after a line drop). A frame that stalls for more than `gap_s` (a break condition reads as a
  lone 0x00 too) is abandoned: counted as truncated and reported as `Abandoned`, and the port goes
  back to console mode. Console text never contains 0x00 (see console.OutputEncoder).
- GENERATE without FLAG_EXT is the original 14-byte layout, byte for byte. With FLAG_EXT an
  extension block (`ext_len u16`, then `tag u8, len u16, value` entries: frame_ext.py) sits
  between the fixed fields and the prompt. Unknown flag bits, unknown tags, a wrong value
  length, a value out of range, bad UTF-8 or bad JSON raise ValueError naming the field (the
  session NAKs it with BAD_PAYLOAD); `unpack_generate(pack_generate(g)) == g` for every valid
  `g`.
"""

from __future__ import annotations

import enum
import json
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any

from edge_agent.protocol.frame_ext import (
    MAX_STOP,
    ExtTag,
    SamplingExtras,
    pack_extension,
    schema_from_json,
    unpack_extension,
)

__all__ = [
    "VERSION", "HEADER", "MAX_PAYLOAD", "FrameType", "NakReason", "ErrorCode", "Frame",
    "FrameError", "Abandoned", "ConsoleBytes", "Generate", "cobs_encode", "cobs_decode",
    "CobsError", "encode_frame", "decode_body", "FrameDecoder", "PortDemux", "pack_generate",
    "unpack_generate", "pack_token", "unpack_token", "pack_done", "unpack_done", "pack_error",
    "pack_nak", "pack_resume", "unpack_resume", "unpack_reason", "ExtTag", "FLAG_SEED",
    "FLAG_CHAT", "FLAG_EXT", "MAX_SCHEMAS", "MAX_STOP", "pack_schema", "unpack_schema",
    "schema_from_json",
]

VERSION = 1
HEADER = struct.Struct("<BBHH")  # version, type, request id, payload length
CRC = struct.Struct("<I")
MAX_PAYLOAD = 4096
# COBS adds one byte per 254 plus one; plus header and CRC.
MAX_ENCODED = MAX_PAYLOAD + HEADER.size + CRC.size + (MAX_PAYLOAD // 254) + 2


class FrameType(enum.IntEnum):
    # requests (MCU -> daemon)
    GENERATE = 0x01
    CANCEL = 0x02
    STATUS = 0x03
    RESUME = 0x04
    SCHEMA = 0x05
    # replies (daemon -> MCU)
    ACK = 0x81
    TOKEN = 0x82
    DONE = 0x83
    ERROR = 0x84
    NAK = 0x85
    STATUS_REPLY = 0x86


class NakReason(enum.IntEnum):
    BAD_CRC = 1
    TRUNCATED = 2
    UNKNOWN_TYPE = 3
    TOO_LONG = 4
    BAD_VERSION = 5
    BAD_ENCODING = 6  # not valid COBS
    BAD_PAYLOAD = 7  # fields of a known type are malformed


class ErrorCode(enum.IntEnum):
    """First byte of an ERROR frame's payload (the rest is a UTF-8 message)."""

    BAD_REQUEST = 1
    QUEUE_FULL = 2
    DEADLINE = 3
    NOT_FOUND = 4
    FAILED = 5
    SHUTTING_DOWN = 6
    CANCELLED = 7


@dataclass(frozen=True)
class Frame:
    type: int
    rid: int
    payload: bytes = b""


@dataclass(frozen=True)
class FrameError:
    reason: NakReason
    detail: str
    rid: int = 0  # best effort: the header's id when the header could be read


@dataclass(frozen=True)
class Abandoned:
    """A frame (or a lone 0x00, e.g. a break) that stalled; `size` body bytes were dropped."""

    size: int


@dataclass(frozen=True)
class ConsoleBytes:
    data: bytes


class CobsError(ValueError):
    def __init__(self, reason: NakReason, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


# ----- COBS -------------------------------------------------------------------------------------


def cobs_encode(data: bytes) -> bytes:
    out = bytearray()
    block = bytearray()
    for byte in data:
        if byte == 0:
            out.append(len(block) + 1)
            out += block
            block.clear()
        else:
            block.append(byte)
            if len(block) == 254:
                out.append(255)
                out += block
                block.clear()
    out.append(len(block) + 1)
    out += block
    return bytes(out)


def cobs_decode(data: bytes) -> bytes:
    out = bytearray()
    i = 0
    n = len(data)
    while i < n:
        code = data[i]
        if code == 0:
            raise CobsError(NakReason.BAD_ENCODING, f"0x00 inside COBS data at offset {i}")
        end = i + code
        if end > n:
            raise CobsError(NakReason.TRUNCATED, f"COBS block at offset {i} needs {code - 1} "
                            f"bytes, {n - i - 1} present")
        block = data[i + 1:end]
        if 0 in block:
            raise CobsError(NakReason.BAD_ENCODING, "0x00 inside COBS data")
        out += block
        i = end
        if code != 255 and i < n:
            out.append(0)
    return bytes(out)


# ----- frames -----------------------------------------------------------------------------------


def encode_frame(type_: int, rid: int, payload: bytes = b"") -> bytes:
    """The bytes on the wire, both delimiters included."""
    if len(payload) > MAX_PAYLOAD:
        raise ValueError(f"payload of {len(payload)} bytes exceeds {MAX_PAYLOAD}")
    body = HEADER.pack(VERSION, int(type_), rid & 0xFFFF, len(payload)) + payload
    body += CRC.pack(zlib.crc32(body))
    return b"\x00" + cobs_encode(body) + b"\x00"


def decode_body(encoded: bytes) -> Frame | FrameError:
    """Decode one COBS body (without delimiters)."""
    if len(encoded) > MAX_ENCODED:
        return FrameError(NakReason.TOO_LONG, f"{len(encoded)} encoded bytes; largest frame is "
                          f"{MAX_ENCODED} ({MAX_PAYLOAD}-byte payload)")
    try:
        raw = cobs_decode(encoded)
    except CobsError as exc:
        return FrameError(exc.reason, str(exc))
    if len(raw) < HEADER.size + CRC.size:
        return FrameError(NakReason.TRUNCATED, f"{len(raw)} bytes, shorter than header + CRC "
                          f"({HEADER.size + CRC.size})")
    ver, type_, rid, length = HEADER.unpack_from(raw)
    have = len(raw) - HEADER.size - CRC.size
    if have < length:
        return FrameError(NakReason.TRUNCATED, f"header says {length} payload bytes, "
                          f"{have} arrived", rid)
    want = CRC.unpack_from(raw, len(raw) - CRC.size)[0]
    got = zlib.crc32(raw[:-CRC.size])
    if want != got:
        return FrameError(NakReason.BAD_CRC, f"CRC-32 0x{got:08x} computed, frame says "
                          f"0x{want:08x}", rid)
    if ver != VERSION:
        return FrameError(NakReason.BAD_VERSION, f"version {ver}, this daemon speaks {VERSION}",
                          rid)
    if have != length:
        return FrameError(NakReason.BAD_PAYLOAD, f"header says {length} payload bytes, "
                          f"{have} present", rid)
    if length > MAX_PAYLOAD:
        return FrameError(NakReason.TOO_LONG, f"payload of {length} bytes; largest is "
                          f"{MAX_PAYLOAD}", rid)
    if type_ not in FrameType._value2member_map_:
        return FrameError(NakReason.UNKNOWN_TYPE, f"type 0x{type_:02x}", rid)
    return Frame(type_, rid, bytes(raw[HEADER.size:HEADER.size + length]))


_COUNTER_NAMES = {r: r.name.lower() for r in NakReason}


@dataclass
class FrameDecoder:
    """Counts what `decode_body` says; `counters` is what /metrics and `status` show."""

    counters: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ["frames_ok", "abandoned", *_COUNTER_NAMES.values()], 0))

    def decode(self, encoded: bytes) -> Frame | FrameError:
        result = decode_body(encoded)
        if isinstance(result, FrameError):
            self.counters[_COUNTER_NAMES[result.reason]] += 1
        else:
            self.counters["frames_ok"] += 1
        return result

    @property
    def bad_frames(self) -> int:
        return sum(v for k, v in self.counters.items() if k != "frames_ok")


class PortDemux:
    """Split one port's byte stream into console bytes and frames (see module docstring)."""

    def __init__(self, *, gap_s: float = 0.5, decoder: FrameDecoder | None = None) -> None:
        self.gap_s = gap_s
        self.decoder = decoder or FrameDecoder()
        self.in_frame = False
        self._body = bytearray()
        self._overflow = False
        self._last = 0.0

    def expire(self, now: float) -> list[Abandoned]:
        """Abandon a frame that has been silent for more than gap_s (call on a timer too)."""
        if self.in_frame and now - self._last > self.gap_s:
            size = len(self._body)
            self.in_frame = False
            self._body.clear()
            self._overflow = False
            if size:
                self.decoder.counters["truncated"] += 1
            self.decoder.counters["abandoned"] += 1
            return [Abandoned(size)]
        return []

    def deadline(self) -> float | None:
        """When `expire` should next be called, or None outside a frame."""
        return self._last + self.gap_s if self.in_frame else None

    def feed(self, data: bytes, now: float) -> list[ConsoleBytes | Frame | FrameError | Abandoned]:
        events: list[ConsoleBytes | Frame | FrameError | Abandoned] = list(self.expire(now))
        i = 0
        n = len(data)
        while i < n:
            if not self.in_frame:
                j = data.find(b"\x00", i)
                if j < 0:
                    events.append(ConsoleBytes(bytes(data[i:])))
                    break
                if j > i:
                    events.append(ConsoleBytes(bytes(data[i:j])))
                self.in_frame = True
                self._body.clear()
                self._overflow = False
                i = j + 1
                continue
            j = data.find(b"\x00", i)
            chunk = data[i:] if j < 0 else data[i:j]
            if not self._overflow:
                self._body += chunk
                if len(self._body) > MAX_ENCODED:
                    self._overflow = True
            i = n if j < 0 else j + 1
            if j < 0:
                break
            if not self._body and not self._overflow:
                continue  # repeated delimiter: still waiting for a body
            result: Frame | FrameError
            if self._overflow:
                self.decoder.counters["too_long"] += 1
                result = FrameError(NakReason.TOO_LONG, f"frame longer than {MAX_ENCODED} "
                                    "encoded bytes")
            else:
                result = self.decoder.decode(bytes(self._body))
            events.append(result)
            self._body.clear()
            self._overflow = False
            self.in_frame = isinstance(result, FrameError)
        self._last = now
        return events


# ----- payloads ---------------------------------------------------------------------------------

# priority u8, flags u8, max_tokens u16, deadline_ms u32, seed u32, temperature_milli u16, prompt
GEN = struct.Struct("<BBHIIH")
FLAG_SEED = 0x01  # seed field is meaningful (else the daemon picks one)
FLAG_CHAT = 0x02  # prompt is one user message: apply the model's chat template
FLAG_EXT = 0x04  # an extension block (ext_len u16 + TLV entries) precedes the prompt
_FLAGS = FLAG_SEED | FLAG_CHAT | FLAG_EXT
EXT_LEN = struct.Struct("<H")
MAX_SCHEMAS = 16  # schemas one port may hold registered (SCHEMA frames)


@dataclass(frozen=True)
class Generate(SamplingExtras):
    prompt: str
    priority: int = 5
    max_tokens: int = 64
    deadline_ms: int = 0  # 0: the daemon's default timeout
    seed: int | None = None
    temperature: float = 0.0
    chat: bool = False
    # the extension (FLAG_EXT), beside SamplingExtras'; None / False: the daemon's default
    json_object: bool = False  # the reply is one JSON object
    schema: dict[str, Any] | None = None  # the reply follows this JSON Schema
    schema_id: int | None = None  # ... or the one registered under this id (SCHEMA frame)


def pack_generate(g: Generate) -> bytes:
    ext = pack_extension(g)
    flags = ((FLAG_SEED if g.seed is not None else 0) | (FLAG_CHAT if g.chat else 0)
             | (FLAG_EXT if ext else 0))
    head = GEN.pack(g.priority, flags, g.max_tokens, g.deadline_ms, g.seed or 0,
                    round(g.temperature * 1000))
    if ext:
        head += EXT_LEN.pack(len(ext)) + ext
    return head + g.prompt.encode()


def unpack_generate(payload: bytes) -> Generate:
    """Raises ValueError naming the bad field."""
    if len(payload) < GEN.size:
        raise ValueError(f"GENERATE payload is {len(payload)} bytes; needs {GEN.size} + prompt")
    prio, flags, max_tokens, deadline_ms, seed, temp = GEN.unpack_from(payload)
    if prio > 10:
        raise ValueError(f"priority {prio} out of range 0..10")
    if not 1 <= max_tokens <= 4096:
        raise ValueError(f"max_tokens {max_tokens} out of range 1..4096")
    if temp > 2000:
        raise ValueError(f"temperature {temp / 1000} out of range 0..2")
    if flags & ~_FLAGS:
        raise ValueError(f"flags 0x{flags:02x}: bits 0x{flags & ~_FLAGS & 0xFF:02x} are "
                         "reserved. Hint: flags are 1 (seed), 2 (chat), 4 (extension); send "
                         "the others as 0.")
    start = GEN.size
    ext: dict[str, Any] = {}
    if flags & FLAG_EXT:
        if len(payload) < start + EXT_LEN.size:
            raise ValueError(f"GENERATE payload is {len(payload)} bytes; flag 4 (extension) "
                             f"needs ext_len u16 after the {GEN.size} fixed bytes")
        (n,) = EXT_LEN.unpack_from(payload, start)
        start += EXT_LEN.size
        if start + n > len(payload):
            raise ValueError(f"GENERATE ext_len {n} runs past the payload ({len(payload) - start}"
                             " bytes after it). Hint: ext_len counts the entries only, not the "
                             "prompt.")
        ext = unpack_extension(payload[start:start + n])
        start += n
    try:
        prompt = payload[start:].decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"prompt is not UTF-8 ({exc.reason} at byte {exc.start})") from exc
    if not prompt:
        raise ValueError("empty prompt")
    return Generate(prompt, prio, max_tokens, deadline_ms,
                    seed if flags & FLAG_SEED else None, temp / 1000, bool(flags & FLAG_CHAT),
                    **ext)


def pack_schema(schema_id: int, schema: dict[str, Any] | None) -> bytes:
    """SCHEMA payload: register `schema` under `schema_id` (None: forget that id)."""
    text = b"" if schema is None else json.dumps(schema, separators=(",", ":"),
                                                  ensure_ascii=False).encode("utf-8")
    return bytes([schema_id]) + text


def unpack_schema(payload: bytes) -> tuple[int, dict[str, Any] | None]:
    """(schema id, schema or None to forget it); raises ValueError naming the bad field."""
    if not payload:
        raise ValueError("SCHEMA payload is 0 bytes; needs schema_id u8 + JSON Schema text "
                         "(nothing after the id forgets it)")
    if len(payload) == 1:
        return payload[0], None
    return payload[0], schema_from_json(payload[1:], f"SCHEMA {payload[0]} text")


_U32 = struct.Struct("<I")


def pack_token(index: int, text: str) -> bytes:
    return _U32.pack(index) + text.encode("utf-8")


def unpack_token(payload: bytes) -> tuple[int, str]:
    return _U32.unpack_from(payload)[0], payload[4:].decode("utf-8")


def pack_done(tokens: int, reason: str) -> bytes:
    return _U32.pack(tokens) + reason.encode()


def unpack_done(payload: bytes) -> tuple[int, str]:
    return _U32.unpack_from(payload)[0], payload[4:].decode()


def pack_resume(from_index: int) -> bytes:
    return _U32.pack(from_index)


def unpack_resume(payload: bytes) -> int:
    if len(payload) != 4:
        raise ValueError(f"RESUME payload is {len(payload)} bytes; needs 4 (from_index u32)")
    return int(_U32.unpack(payload)[0])


def _reason_payload(code: int, text: str) -> bytes:
    data = text.encode("utf-8")
    limit = MAX_PAYLOAD - 1
    if len(data) > limit:
        data = data[:limit].decode("utf-8", "ignore").encode()
    return bytes([code]) + data


def pack_error(code: ErrorCode, text: str) -> bytes:
    return _reason_payload(code, text)


def pack_nak(reason: NakReason, text: str) -> bytes:
    return _reason_payload(reason, text)


def unpack_reason(payload: bytes) -> tuple[int, str]:
    """(code, text) of an ERROR or NAK payload."""
    return payload[0], payload[1:].decode("utf-8", "replace")
