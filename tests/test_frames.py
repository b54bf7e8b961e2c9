"""Machine-mode frames: COBS, CRC-32, every NAK reason, and the console/frame demux (sans-IO)."""

from __future__ import annotations

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
