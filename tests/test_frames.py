"""Machine-mode frames: COBS, CRC-32, every NAK reason, and the console/frame demux (sans-IO)."""

from __future__ import annotations

import json
import random
import struct
from pathlib import Path

import pytest

from edge_agent.protocol import frames as fr


def crc32_bitwise(data: bytes) -> int:
    """Independent oracle: the bit-at-a-time loop an MCU developer would write in C."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0xEDB88320 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def cobs_reference(data: bytes) -> bytes:
    """Independent oracle: the textbook COBS encoder (code byte patched in place)."""
    out = bytearray([0])
    code_at, code = 0, 1
    for byte in data:
        if byte:
            out.append(byte)
            code += 1
        if not byte or code == 0xFF:
            out[code_at] = code
            code_at, code = len(out), 1
            out.append(0)
    out[code_at] = code
    return bytes(out)


# Vectors from Cheshire & Baker's paper / the Wikipedia COBS article.
COBS_VECTORS = [
    (b"\x00", b"\x01\x01"),
    (b"\x00\x00", b"\x01\x01\x01"),
    (b"\x00\x11\x00", b"\x01\x02\x11\x01"),
    (b"\x11\x22\x00\x33", b"\x03\x11\x22\x02\x33"),
    (b"\x11\x22\x33\x44", b"\x05\x11\x22\x33\x44"),
    (b"\x11\x00\x00\x00", b"\x02\x11\x01\x01\x01"),
    (bytes(range(1, 255)), b"\xff" + bytes(range(1, 255)) + b"\x01"),
    (bytes(range(0, 255)), b"\x01\xff" + bytes(range(1, 255)) + b"\x01"),
    (bytes(range(1, 256)), b"\xff" + bytes(range(1, 255)) + b"\x02\xff"),
]


@pytest.mark.parametrize(("raw", "encoded"), COBS_VECTORS)
def test_cobs_known_vectors(raw: bytes, encoded: bytes) -> None:
    assert fr.cobs_encode(raw) == encoded
    assert fr.cobs_decode(encoded) == raw


def test_cobs_matches_reference_and_round_trips_random_data() -> None:
    rng = random.Random(7)
    for n in list(range(0, 600, 7)) + [253, 254, 255, 508, 509]:
        data = bytes(rng.choice([0, 0, 1, 0xFF, rng.randrange(256)]) for _ in range(n))
        enc = fr.cobs_encode(data)
        assert 0 not in enc
        assert enc == cobs_reference(data)
        assert fr.cobs_decode(enc) == data


def test_cobs_decode_errors() -> None:
    with pytest.raises(fr.CobsError) as e:
        fr.cobs_decode(b"\x05\x11\x22")
    assert e.value.reason is fr.NakReason.TRUNCATED
    assert "needs 4 bytes, 2 present" in str(e.value)
    with pytest.raises(fr.CobsError) as e:
        fr.cobs_decode(b"\x03\x11\x00")
    assert e.value.reason is fr.NakReason.BAD_ENCODING


def test_crc32_is_the_ieee_crc_an_mcu_computes() -> None:
    assert crc32_bitwise(b"123456789") == 0xCBF43926  # the catalogue check value
    frame = fr.encode_frame(fr.FrameType.TOKEN, 3, fr.pack_token(9, "héllo"))
    raw = fr.cobs_decode(frame[1:-1])
    assert struct.unpack("<I", raw[-4:])[0] == crc32_bitwise(raw[:-4])


SERIAL_DOC = Path(__file__).resolve().parent.parent / "docs" / "serial.md"


def test_worked_example_bytes_from_docs_serial() -> None:
    """docs/serial.md's byte-by-byte example; an MCU implementation can test against it."""
    g = fr.Generate("Hi", priority=5, max_tokens=16, deadline_ms=5000, seed=42)
    wire = fr.encode_frame(fr.FrameType.GENERATE, 7, fr.pack_generate(g))
    assert wire.hex(" ") == ("00 04 01 01 07 02 10 04 05 01 10 03 88 13 01 02 2a 01 01 01 01 07 "
                             "48 69 1c 4f 8b 7f 00")
    raw = bytes.fromhex("01 01 07 00 10 00 05 01 10 00 88 13 00 00 2a 00 00 00 00 00 48 69")
    doc = SERIAL_DOC.read_text(encoding="utf-8")
    assert f"wire: {wire.hex(' ')}" in doc
    assert "raw : 01 01 07 00 10 00 | 05 01 10 00 88 13 00 00 2a 00 00 00 00 00 48 69 | " in doc
    ack = fr.encode_frame(fr.FrameType.ACK, 7, b"")
    assert f"ACK (`{ack.hex(' ')}`)" in doc
    assert fr.cobs_decode(wire[1:-1]) == raw + struct.pack("<I", crc32_bitwise(raw))
    frame = fr.decode_body(wire[1:-1])
    assert isinstance(frame, fr.Frame)
    assert (frame.type, frame.rid) == (fr.FrameType.GENERATE, 7)
    assert fr.unpack_generate(frame.payload) == g


def test_payload_round_trips() -> None:
    g = fr.Generate("Καλημέρα", priority=10, max_tokens=4096, deadline_ms=1, seed=None,
                    temperature=0.7, chat=True)
    assert fr.unpack_generate(fr.pack_generate(g)) == g
    assert fr.unpack_token(fr.pack_token(12, "日本")) == (12, "日本")
    assert fr.unpack_done(fr.pack_done(40, "length")) == (40, "length")
    assert fr.unpack_resume(fr.pack_resume(17)) == 17
    assert fr.unpack_reason(fr.pack_nak(fr.NakReason.BAD_CRC, "bad")) == (1, "bad")
    long = fr.pack_error(fr.ErrorCode.FAILED, "é" * 5000)
    assert len(long) <= fr.MAX_PAYLOAD
    long[1:].decode("utf-8")  # cut on a character boundary


@pytest.mark.parametrize(("payload", "message"), [
    (b"\x05", "GENERATE payload is 1 bytes; needs 14 + prompt"),
    (struct.pack("<BBHIIH", 11, 0, 8, 0, 0, 0) + b"x", "priority 11 out of range 0..10"),
    (struct.pack("<BBHIIH", 1, 0, 0, 0, 0, 0) + b"x", "max_tokens 0 out of range 1..4096"),
    (struct.pack("<BBHIIH", 1, 0, 8, 0, 0, 2001) + b"x", "temperature 2.001 out of range 0..2"),
    (struct.pack("<BBHIIH", 1, 0, 8, 0, 0, 0) + b"\xff", "prompt is not UTF-8 (invalid start"),
    (struct.pack("<BBHIIH", 1, 0, 8, 0, 0, 0), "empty prompt"),
])
def test_generate_payload_errors(payload: bytes, message: str) -> None:
    with pytest.raises(ValueError) as e:
        fr.unpack_generate(payload)
    assert message in str(e.value)
    with pytest.raises(ValueError, match="needs 4"):
        fr.unpack_resume(b"\x01")


def _body(type_: int = 1, rid: int = 2, payload: bytes = b"xyz", *, ver: int = 1,
          length: int | None = None, crc_delta: int = 0) -> bytes:
    n = len(payload) if length is None else length
    raw = struct.pack("<BBHH", ver, type_, rid, n) + payload
    raw += struct.pack("<I", (crc32_bitwise(raw) + crc_delta) & 0xFFFFFFFF)
    return fr.cobs_encode(raw)


@pytest.mark.parametrize(("body", "reason", "detail", "rid"), [
    (_body(crc_delta=1), fr.NakReason.BAD_CRC, "frame says 0x", 2),
    (_body()[:-2], fr.NakReason.TRUNCATED, "needs", 0),
    (fr.cobs_encode(b"\x01\x01\x02"), fr.NakReason.TRUNCATED, "shorter than header + CRC", 0),
    (_body(length=9), fr.NakReason.TRUNCATED, "header says 9 payload bytes, 3 arrived", 2),
    (_body(length=1), fr.NakReason.BAD_PAYLOAD, "header says 1 payload bytes, 3 present", 2),
    (_body(ver=2), fr.NakReason.BAD_VERSION, "version 2, this daemon speaks 1", 2),
    (_body(type_=0x42, rid=9), fr.NakReason.UNKNOWN_TYPE, "type 0x42", 9),
    (b"\x03\x11\x00", fr.NakReason.BAD_ENCODING, "0x00 inside COBS data", 0),
    (b"\x01" * (fr.MAX_ENCODED + 1), fr.NakReason.TOO_LONG, "largest frame is", 0),
])
def test_every_nak_reason(body: bytes, reason: fr.NakReason, detail: str, rid: int) -> None:
    dec = fr.FrameDecoder()
    result = dec.decode(body)
    assert isinstance(result, fr.FrameError)
    assert result.reason is reason
    assert detail in result.detail
    assert result.rid == rid
    assert dec.counters[reason.name.lower()] == 1
    assert dec.bad_frames == 1 and dec.counters["frames_ok"] == 0


def test_too_long_payload_is_refused_by_the_encoder() -> None:
    with pytest.raises(ValueError, match="exceeds 4096"):
        fr.encode_frame(fr.FrameType.TOKEN, 1, b"x" * (fr.MAX_PAYLOAD + 1))


# ----- demux --------------------------------------------------------------------------------------

def frame(rid: int, text: str = "ok") -> bytes:
    return fr.encode_frame(fr.FrameType.TOKEN, rid, fr.pack_token(0, text))


def kinds(events: list[object]) -> list[str]:
    return [type(e).__name__ for e in events]


def test_demux_splits_console_text_and_frames() -> None:
    d = fr.PortDemux()
    ev = d.feed(b"help\r" + frame(1) + b"status\r" + frame(2) + frame(3), 0.0)
    assert kinds(ev) == ["ConsoleBytes", "Frame", "ConsoleBytes", "Frame", "Frame"]
    assert ev[0] == fr.ConsoleBytes(b"help\r") and ev[2] == fr.ConsoleBytes(b"status\r")
    assert [e.rid for e in ev if isinstance(e, fr.Frame)] == [1, 2, 3]
    assert d.decoder.counters["frames_ok"] == 3 and not d.in_frame


def test_demux_byte_at_a_time_and_repeated_delimiters() -> None:
    d = fr.PortDemux()
    wire = b"\x00\x00\x00" + frame(5)[1:] + b"a"
    out: list[object] = []
    for i, b in enumerate(wire):
        out += d.feed(bytes([b]), i * 1e-4)
    assert kinds(out) == ["Frame", "ConsoleBytes"]


def test_demux_truncated_frame_then_next_frame_is_not_lost() -> None:
    """A line drop mid-frame: the next frame's opening 0x00 closes the broken one (NAK), and
    because that frame was bad the demux stays in frame mode, so the next frame decodes."""
    d = fr.PortDemux()
    broken = frame(1, "a long token text")[:-6]
    ev = d.feed(broken + frame(2), 0.0)
    assert kinds(ev) == ["FrameError", "Frame"]
    assert ev[1].rid == 2  # type: ignore[union-attr]  # ev[1] is the Frame (kinds above)
    assert d.decoder.bad_frames == 1


def test_demux_stalled_frame_and_break_are_abandoned_after_the_gap() -> None:
    d = fr.PortDemux(gap_s=0.5)
    assert d.feed(b"\x00\x05\x11", 0.0) == []
    assert d.deadline() == 0.5
    assert d.expire(0.4) == []
    assert d.expire(0.6) == [fr.Abandoned(2)]
    assert d.decoder.counters["truncated"] == 1 and d.decoder.counters["abandoned"] == 1
    # A break reads as one NUL; a person typing afterwards is console input again.
    assert d.feed(b"\x00", 1.0) == []
    ev = d.feed(b"help\r", 2.0)
    assert ev == [fr.Abandoned(0), fr.ConsoleBytes(b"help\r")]
    assert d.deadline() is None


def test_demux_overlong_frame_is_nakked_once_and_link_carries_on() -> None:
    d = fr.PortDemux()
    ev = d.feed(b"\x00" + b"\x01" * (fr.MAX_ENCODED + 50) + b"\x00" + frame(4)[1:], 0.0)
    assert kinds(ev) == ["FrameError", "Frame"]
    assert ev[0].reason is fr.NakReason.TOO_LONG  # type: ignore[union-attr]  # ev[0] is the FrameError (kinds above)


def test_random_noise_never_raises_and_every_bad_frame_is_counted() -> None:
    rng = random.Random(11)
    d = fr.PortDemux()
    good = 0
    for i in range(400):
        if i % 3 == 0:
            d.feed(frame(i & 0xFFFF), i * 0.01)
            good += 1
        else:
            d.feed(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 60))), i * 0.01)
    c = d.decoder.counters
    assert c["frames_ok"] == good  # a frame always opens with 0x00, whatever came before
    naks = sum(v for k, v in c.items() if k not in ("frames_ok", "abandoned"))
    assert naks > 0


# ----- GENERATE's extension (FLAG_EXT) and SCHEMA frames ------------------------------------------

def ext_generate(entries: bytes, prompt: bytes = b"hi", *, flags: int = fr.FLAG_EXT,
                 ext_len: int | None = None) -> bytes:
    """A GENERATE payload built by hand (the oracle for pack_generate): fixed fields, ext_len,
    the entries, the prompt."""
    n = len(entries) if ext_len is None else ext_len
    return struct.pack("<BBHIIHH", 5, flags, 64, 0, 0, 0, n) + entries + prompt


def tlv(tag: int, value: bytes) -> bytes:
    return struct.pack("<BH", tag, len(value)) + value


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}},
          "required": ["name"]}


def test_extension_round_trips_and_matches_a_hand_built_payload() -> None:
    g = fr.Generate("hi", top_k=40, top_p=0.9, min_p=0.05, presence_penalty=-1.5,
                    frequency_penalty=0.5, repeat_penalty=1.3, repeat_last_n=-1,
                    stop=("\n", "END"), logit_bias=((5, -100.0), (7, 2.5)), schema=PERSON)
    schema_text = json.dumps(PERSON, separators=(",", ":")).encode()
    want = ext_generate(
        tlv(0x01, struct.pack("<I", 40)) + tlv(0x02, struct.pack("<H", 900))
        + tlv(0x03, struct.pack("<H", 50)) + tlv(0x04, struct.pack("<h", -1500))
        + tlv(0x05, struct.pack("<h", 500)) + tlv(0x06, struct.pack("<I", 1300))
        + tlv(0x07, struct.pack("<i", -1)) + tlv(0x08, b"\n") + tlv(0x08, b"END")
        + tlv(0x09, struct.pack("<IiIi", 5, -100000, 7, 2500)) + tlv(0x11, schema_text))
    assert fr.pack_generate(g) == want
    assert fr.unpack_generate(want) == g
    for other in (fr.Generate("x", json_object=True, chat=True, seed=3),
                  fr.Generate("x", schema_id=255, top_k=0, min_p=0.0),
                  fr.Generate("x", repeat_penalty=100.0, repeat_last_n=1 << 20, top_p=0.001)):
        assert fr.unpack_generate(fr.pack_generate(other)) == other
    # entries in any order, stop strings and logit_bias entries accumulate, an empty block
    shuffled = ext_generate(tlv(0x09, struct.pack("<Ii", 7, 2500)) + tlv(0x08, b"a")
                            + tlv(0x10, b"") + tlv(0x09, struct.pack("<Ii", 5, -1000))
                            + tlv(0x08, "é".encode()))
    assert fr.unpack_generate(shuffled) == fr.Generate(
        "hi", stop=("a", "é"), logit_bias=((5, -1.0), (7, 2.5)), json_object=True)
    assert fr.unpack_generate(ext_generate(b"")) == fr.Generate("hi")


def test_a_generate_without_extension_is_the_original_layout() -> None:
    """Old clients: no new field set means no flag 4 and the 14 fixed bytes + prompt."""
    g = fr.Generate("Hi", priority=5, max_tokens=16, deadline_ms=5000, seed=42, chat=True)
    assert fr.pack_generate(g) == struct.pack("<BBHIIH", 5, 3, 16, 5000, 42, 0) + b"Hi"


def test_max_stop_agrees_with_the_http_api() -> None:
    from edge_agent.protocol.api import MAX_STOP

    assert fr.MAX_STOP == MAX_STOP


@pytest.mark.parametrize(("payload", "message"), [
    (struct.pack("<BBHIIH", 5, 0x0C, 8, 0, 0, 0) + b"x",
     "flags 0x0c: bits 0x08 are reserved. Hint: flags are 1 (seed), 2 (chat), 4 (extension)"),
    (struct.pack("<BBHIIH", 5, 4, 8, 0, 0, 0) + b"x",
     "GENERATE payload is 15 bytes; flag 4 (extension) needs ext_len u16"),
    (ext_generate(b"", b"hi", ext_len=3),
     "GENERATE ext_len 3 runs past the payload (2 bytes after it)"),
    (ext_generate(b"\x01\x04", b""), "GENERATE extension: 2 bytes left at offset 0; an entry "
                                      "needs 3 (tag u8, len u16)"),
    (ext_generate(tlv(0x42, b"")), "GENERATE extension: unknown tag 0x42 at offset 0. Hint: "
                                   "docs/serial.md lists the GENERATE extension tags"),
    (ext_generate(tlv(0x10, b"") + b"\x01\x04\x00\x01"),
     "GENERATE extension top_k (tag 0x01): length 4 runs past the extension block (1 bytes "
     "left)"),
    (ext_generate(tlv(0x02, b"\x01")), "top_p (tag 0x02): value is 1 bytes; needs 2"),
    (ext_generate(tlv(0x01, struct.pack("<I", (1 << 20) + 1))),
     "top_k (tag 0x01): 1048577 out of range 0..1048576. Hint: use 0..1048576."),
    (ext_generate(tlv(0x02, struct.pack("<H", 0))),
     "top_p (tag 0x02): 0 (0) out of range 1..1000 (x1000)"),
    (ext_generate(tlv(0x02, struct.pack("<H", 1001))), "top_p (tag 0x02): 1001 (1.001) out of"),
    (ext_generate(tlv(0x03, struct.pack("<H", 1001))), "min_p (tag 0x03): 1001 (1.001) out of"),
    (ext_generate(tlv(0x04, struct.pack("<h", -2001))),
     "presence_penalty (tag 0x04): -2001 (-2.001) out of range -2000..2000 (x1000)"),
    (ext_generate(tlv(0x05, struct.pack("<h", 2001))), "frequency_penalty (tag 0x05): 2001"),
    (ext_generate(tlv(0x06, struct.pack("<I", 0))), "repeat_penalty (tag 0x06): 0 (0) out of "
                                                    "range 1..100000 (x1000)"),
    (ext_generate(tlv(0x07, struct.pack("<i", -2))), "repeat_last_n (tag 0x07): -2 out of "
                                                     "range -1..1048576"),
    (ext_generate(tlv(0x01, b"\0\0\0\0") * 2), "top_k (tag 0x01): given twice"),
    (ext_generate(tlv(0x08, b"")), "stop (tag 0x08): empty stop string"),
    (ext_generate(tlv(0x08, b"\xc3")), "stop (tag 0x08): not UTF-8 (unexpected end of data at "
                                       "byte 0)"),
    (ext_generate(tlv(0x08, b"a") * 5), "stop (tag 0x08): more than 4 stop strings"),
    (ext_generate(tlv(0x09, b"\0" * 7)), "logit_bias (tag 0x09): value is 7 bytes; needs a "
                                         "positive multiple of 8 (token u32, bias x1000 i32)"),
    (ext_generate(tlv(0x09, b"")), "logit_bias (tag 0x09): value is 0 bytes"),
    (ext_generate(tlv(0x09, struct.pack("<Ii", 3, 100001))),
     "logit_bias (tag 0x09): token 3: bias 100001 (x1000) out of range -100000..100000"),
    (ext_generate(tlv(0x09, struct.pack("<IiIi", 3, 1, 3, 2))),
     "logit_bias (tag 0x09): token 3 given twice"),
    (ext_generate(tlv(0x10, b"x")), "json_object (tag 0x10): value is 1 bytes; needs 0"),
    (ext_generate(tlv(0x11, b"")), "schema (tag 0x11): empty schema"),
    (ext_generate(tlv(0x11, b'{"a":"\xff"}')), "schema (tag 0x11) is not UTF-8 (invalid start "
                                                "byte at byte 6)"),
    (ext_generate(tlv(0x11, b'{"type": "object"')), "schema (tag 0x11) is not JSON (Expecting "
                                                    "',' delimiter: line 1 column 18"),
    (ext_generate(tlv(0x11, b'{"maximum": Infinity}')), "schema (tag 0x11) is not JSON "
                                                        "(Infinity is not JSON)"),
    (ext_generate(tlv(0x11, b"[" * 2000 + b"]" * 2000)), "schema (tag 0x11) is nested too "
                                                         "deeply"),
    (ext_generate(tlv(0x11, b'"object"')), "schema (tag 0x11) must be a JSON object (a JSON "
                                           "Schema), got str"),
    (ext_generate(tlv(0x12, b"\x01\x00")), "schema_id (tag 0x12): value is 2 bytes; needs 1"),
    (ext_generate(tlv(0x10, b"") + tlv(0x12, b"\x01")),
     "GENERATE extension: json_object (tag 0x10) and schema_id (tag 0x12) together. Hint: give "
     "at most one of json_object, schema, schema_id."),
    (ext_generate(tlv(0x11, b"{}") + tlv(0x10, b"")), "json_object (tag 0x10) and schema (tag "
                                                      "0x11) together"),
    (ext_generate(tlv(0x10, b""), b""), "empty prompt"),
    (ext_generate(tlv(0x10, b""), b"\xff"), "prompt is not UTF-8"),
])
def test_every_malformed_extension_names_the_field(payload: bytes, message: str) -> None:
    with pytest.raises(ValueError) as e:
        fr.unpack_generate(payload)
    assert message in str(e.value)
    assert "Hint:" in str(e.value) or "prompt" in message or "GENERATE payload" in message \
        or "ext_len" in message


def test_the_encoder_refuses_out_of_range_extension_values() -> None:
    with pytest.raises(ValueError, match=r"top_p 1.5 out of range 0.001..1.0"):
        fr.pack_generate(fr.Generate("x", top_p=1.5))
    with pytest.raises(ValueError, match=r"repeat_last_n -3 out of range -1..1048576"):
        fr.pack_generate(fr.Generate("x", repeat_last_n=-3))


def test_schema_frame_payloads() -> None:
    text = json.dumps(PERSON, separators=(",", ":")).encode()
    assert fr.pack_schema(3, PERSON) == b"\x03" + text
    assert fr.unpack_schema(fr.pack_schema(3, PERSON)) == (3, PERSON)
    assert fr.unpack_schema(fr.pack_schema(200, None)) == (200, None)  # forget id 200
    with pytest.raises(ValueError, match="SCHEMA payload is 0 bytes; needs schema_id u8"):
        fr.unpack_schema(b"")
    with pytest.raises(ValueError, match=r"SCHEMA 7 text is not JSON \(Expecting property"):
        fr.unpack_schema(b"\x07{]")
    with pytest.raises(ValueError, match="SCHEMA 7 text must be a JSON object"):
        fr.unpack_schema(b"\x07[]")
    with pytest.raises(ValueError, match="SCHEMA 7 text is not UTF-8"):
        fr.unpack_schema(b"\x07\xfe")
    frame = fr.decode_body(fr.encode_frame(fr.FrameType.SCHEMA, 9, b"\x01{}")[1:-1])
    assert frame == fr.Frame(fr.FrameType.SCHEMA, 9, b"\x01{}")


def test_extension_worked_example_bytes_from_docs_serial() -> None:
    """docs/serial.md's SCHEMA + GENERATE-with-extension example, byte for byte."""
    doc = SERIAL_DOC.read_text(encoding="utf-8")
    schema = fr.encode_frame(fr.FrameType.SCHEMA, 9, fr.pack_schema(1, {"type": "object"}))
    g = fr.Generate("Hi", max_tokens=64, chat=True, top_k=40, schema_id=1)
    gen = fr.encode_frame(fr.FrameType.GENERATE, 10, fr.pack_generate(g))
    assert f"SCHEMA wire : {schema.hex(' ')}" in doc
    assert f"GENERATE wire: {gen.hex(' ')}" in doc
    for name, wire in (("SCHEMA raw  ", schema), ("GENERATE raw", gen)):
        line = next(x for x in doc.splitlines() if x.startswith(name + ":"))
        fields, crc = line.split(":", 1)[1].split("| crc")
        raw = bytes.fromhex(fields.replace("|", ""))
        assert fr.cobs_decode(wire[1:-1]) == raw + bytes.fromhex(crc)
        assert int.from_bytes(bytes.fromhex(crc), "little") == crc32_bitwise(raw)
    frame = fr.decode_body(gen[1:-1])
    assert isinstance(frame, fr.Frame) and fr.unpack_generate(frame.payload) == g
    assert "`ext_len` `0b 00` = 11 bytes" in doc  # the walk-through matches the bytes
    assert fr.pack_generate(g)[14:16] == b"\x0b\x00"
