"""GENERATE's extension block (flag 4 of frames.py): TLV entries for the sampling controls, stop
strings, logit bias and the output format (any JSON object, a JSON Schema, or a registered
schema's id). Sans-IO like frames.py, which frames and unframes it.

Entry: `tag u8, len u16, value[len]`, little-endian; docs/serial.md has the table of tags.

Invariants owned here:
- `unpack_extension(pack_extension(g))` gives back every extension field `g` sets.
- A malformed entry raises ValueError naming the field (by name and tag) and ending with a
  Hint: unknown tag, wrong value length, value out of range, tag repeated (only STOP and
  LOGIT_BIAS may repeat), two output formats, bad UTF-8, text that is not a JSON object.
- Ranges are the HTTP API's (protocol/api.py), in wire units (x1000 for fractions).
"""

from __future__ import annotations

import enum
import json
import struct
from dataclasses import dataclass, fields
from typing import Any

__all__ = ["SamplingExtras", "SAMPLING_EXTRAS", "ExtTag", "EXT_ENTRY", "MAX_STOP",
           "pack_extension", "unpack_extension", "schema_from_json"]


@dataclass(frozen=True, kw_only=True)
class SamplingExtras:
    """The sampling controls a UART request may carry beyond max_tokens / temperature / seed
    (None / (): the daemon's default), shared by the GENERATE frame and the transports'
    GenParams so the list is written once."""

    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repeat_penalty: float | None = None
    repeat_last_n: int | None = None
    stop: tuple[str, ...] = ()
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)


SAMPLING_EXTRAS = tuple(f.name for f in fields(SamplingExtras))

EXT_ENTRY = struct.Struct("<BH")  # tag, value length
MAX_STOP = 4  # protocol/api.py's MAX_STOP (tests/test_frames.py checks they agree)


class ExtTag(enum.IntEnum):
    """Tags of GENERATE's extension entries (docs/serial.md has the value layouts)."""

    TOP_K = 0x01  # u32
    TOP_P = 0x02  # u16, x1000
    MIN_P = 0x03  # u16, x1000
    PRESENCE_PENALTY = 0x04  # i16, x1000
    FREQUENCY_PENALTY = 0x05  # i16, x1000
    REPEAT_PENALTY = 0x06  # u32, x1000
    REPEAT_LAST_N = 0x07  # i32
    STOP = 0x08  # UTF-8 text; repeatable
    LOGIT_BIAS = 0x09  # n x (token u32, bias x1000 i32); repeatable
    JSON_OBJECT = 0x10  # empty: the reply is one JSON object
    SCHEMA = 0x11  # UTF-8 JSON Schema (an object): the reply follows it
    SCHEMA_ID = 0x12  # u8: a schema registered on this port with a SCHEMA frame


# tag -> (Generate field, value struct, scale, lowest, highest) with bounds in wire units
_SCALARS: dict[int, tuple[str, struct.Struct, int, int, int]] = {
    ExtTag.TOP_K: ("top_k", struct.Struct("<I"), 1, 0, 1 << 20),
    ExtTag.TOP_P: ("top_p", struct.Struct("<H"), 1000, 1, 1000),
    ExtTag.MIN_P: ("min_p", struct.Struct("<H"), 1000, 0, 1000),
    ExtTag.PRESENCE_PENALTY: ("presence_penalty", struct.Struct("<h"), 1000, -2000, 2000),
    ExtTag.FREQUENCY_PENALTY: ("frequency_penalty", struct.Struct("<h"), 1000, -2000, 2000),
    ExtTag.REPEAT_PENALTY: ("repeat_penalty", struct.Struct("<I"), 1000, 1, 100_000),
    ExtTag.REPEAT_LAST_N: ("repeat_last_n", struct.Struct("<i"), 1, -1, 1 << 20),
    ExtTag.SCHEMA_ID: ("schema_id", struct.Struct("<B"), 1, 0, 255),
}
_BIAS = struct.Struct("<Ii")  # token id, bias x1000
_BIAS_MILLI = 100_000
_FORMATS = (ExtTag.JSON_OBJECT, ExtTag.SCHEMA, ExtTag.SCHEMA_ID)
_HINT = "Hint: docs/serial.md lists the GENERATE extension tags and their value layouts."


def _entry(tag: int, value: bytes) -> bytes:
    return EXT_ENTRY.pack(tag, len(value)) + value


def _scalar_name(tag: int) -> str:
    return f"{ExtTag(tag).name.lower()} (tag 0x{tag:02x})"


def pack_extension(g: Any) -> bytes:
    """The extension entries of `g` (a frames.Generate); b"" when it sets none."""
    out = bytearray()
    for tag, (name, fmt, scale, lo, hi) in _SCALARS.items():
        value = getattr(g, name)
        if value is None:
            continue
        wire = round(value * scale)
        if not lo <= wire <= hi:
            raise ValueError(f"{name} {value} out of range "
                             + (f"{lo}..{hi}" if scale == 1 else f"{lo / scale}..{hi / scale}"))
        out += _entry(tag, fmt.pack(wire))
    for text in g.stop:
        out += _entry(ExtTag.STOP, text.encode("utf-8"))
    if g.logit_bias:
        out += _entry(ExtTag.LOGIT_BIAS, b"".join(_BIAS.pack(t, round(b * 1000))
                                                  for t, b in g.logit_bias))
    if g.json_object:
        out += _entry(ExtTag.JSON_OBJECT, b"")
    if g.schema is not None:
        out += _entry(ExtTag.SCHEMA, json.dumps(g.schema, separators=(",", ":"),
                                                ensure_ascii=False).encode("utf-8"))
    return bytes(out)


def schema_from_json(data: bytes, where: str) -> dict[str, Any]:
    """A JSON Schema object from UTF-8 JSON text; ValueError naming `where` otherwise."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{where} is not UTF-8 ({exc.reason} at byte {exc.start}). "
                         "Hint: send the schema as UTF-8 JSON text.") from exc

    def no_constant(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    try:
        value = json.loads(text, parse_constant=no_constant)
    except RecursionError as exc:
        raise ValueError(f"{where} is nested too deeply. Hint: flatten the schema.") from exc
    except ValueError as exc:
        raise ValueError(f"{where} is not JSON ({exc}). Hint: check the schema text with a "
                         "JSON validator.") from exc
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be a JSON object (a JSON Schema), got "
                         f"{type(value).__name__}. Hint: e.g. {{\"type\": \"object\"}}.")
    return value


def unpack_extension(ext: bytes) -> dict[str, Any]:
    """The Generate fields an extension block sets; ValueError naming the entry otherwise."""
    out: dict[str, Any] = {}
    stop: list[str] = []
    bias: dict[int, float] = {}
    seen: set[int] = set()
    i = 0
    while i < len(ext):
        if len(ext) - i < EXT_ENTRY.size:
            raise ValueError(f"GENERATE extension: {len(ext) - i} bytes left at offset {i}; an "
                             f"entry needs {EXT_ENTRY.size} (tag u8, len u16). {_HINT}")
        tag, n = EXT_ENTRY.unpack_from(ext, i)
        value = ext[i + EXT_ENTRY.size:i + EXT_ENTRY.size + n]
        if tag not in ExtTag._value2member_map_:
            raise ValueError(f"GENERATE extension: unknown tag 0x{tag:02x} at offset {i}. "
                             f"{_HINT}")
        where = f"GENERATE extension {_scalar_name(tag)}"
        if len(value) < n:
            raise ValueError(f"{where}: length {n} runs past the extension block "
                             f"({len(value)} bytes left). Hint: ext_len must count every entry.")
        i += EXT_ENTRY.size + n
        if tag in seen and tag not in (ExtTag.STOP, ExtTag.LOGIT_BIAS):
            raise ValueError(f"{where}: given twice. Hint: send each tag once.")
        seen.add(tag)
        if tag in _SCALARS:
            name, fmt, scale, lo, hi = _SCALARS[tag]
            if n != fmt.size:
                raise ValueError(f"{where}: value is {n} bytes; needs {fmt.size}. {_HINT}")
            wire = fmt.unpack(value)[0]
            if not lo <= wire <= hi:
                shown = f"{wire}" if scale == 1 else f"{wire} ({wire / scale:g})"
                raise ValueError(f"{where}: {shown} out of range {lo}..{hi}"
                                 + ("" if scale == 1 else f" (x{scale})")
                                 + f". Hint: use {lo}..{hi}.")
            out[name] = wire if scale == 1 else wire / scale
        elif tag == ExtTag.STOP:
            if not value:
                raise ValueError(f"{where}: empty stop string. Hint: leave the entry out.")
            try:
                stop.append(value.decode("utf-8"))
            except UnicodeDecodeError as exc:
                raise ValueError(f"{where}: not UTF-8 ({exc.reason} at byte {exc.start}). "
                                 "Hint: send stop strings as UTF-8.") from exc
            if len(stop) > MAX_STOP:
                raise ValueError(f"{where}: more than {MAX_STOP} stop strings. Hint: send at "
                                 f"most {MAX_STOP}.")
        elif tag == ExtTag.LOGIT_BIAS:
            if not n or n % _BIAS.size:
                raise ValueError(f"{where}: value is {n} bytes; needs a positive multiple of "
                                 f"{_BIAS.size} (token u32, bias x1000 i32). {_HINT}")
            for token, milli in _BIAS.iter_unpack(value):
                if not -_BIAS_MILLI <= milli <= _BIAS_MILLI:
                    raise ValueError(f"{where}: token {token}: bias {milli} (x1000) out of range"
                                     f" {-_BIAS_MILLI}..{_BIAS_MILLI}. Hint: -100000 bans the "
                                     "token, 0 changes nothing.")
                if token in bias:
                    raise ValueError(f"{where}: token {token} given twice. Hint: one bias per "
                                     "token.")
                bias[token] = milli / 1000
        elif tag == ExtTag.JSON_OBJECT:
            if n:
                raise ValueError(f"{where}: value is {n} bytes; needs 0. {_HINT}")
            out["json_object"] = True
        else:  # SCHEMA
            if not value:
                raise ValueError(f"{where}: empty schema. Hint: send JSON Schema text, or "
                                 "json_object (tag 0x10) for any JSON object.")
            out["schema"] = schema_from_json(value, where)
        formats = [t for t in _FORMATS if t in seen]
        if len(formats) > 1:
            raise ValueError(f"GENERATE extension: {' and '.join(map(_scalar_name, formats))} "
                             "together. Hint: give at most one of json_object, schema, "
                             "schema_id.")
    if stop:
        out["stop"] = tuple(stop)
    if bias:
        out["logit_bias"] = tuple(sorted(bias.items()))
    return out
