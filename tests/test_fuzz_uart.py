"""Bounded fuzzing (hypothesis) of the UART protocols: the console line editor and command
grammar, the output encoder, COBS frames and the console/frame demultiplexer, the MCU payloads,
and a whole UartSession over a stand-in backend.

Properties:
- nothing raises but the documented types (CommandError with a Hint from parse_command,
  ValueError from the payload unpackers); bad input becomes InputError / FrameError events;
- a bad frame bumps exactly one counter, a good one `frames_ok`;
- valid frames and typed lines round-trip, whatever the chunking and whatever noise came before;
- console output is valid UTF-8 with CRLF line ends and no control or 0x00 byte, so a session's
  output (echo, console text and frames together) splits back into frames that all decode;
- every call returns (the module's timeout catches a hang).

Budget: 200-300 examples per property, no deadline; the module runs in a few seconds.
"""

from __future__ import annotations

import asyncio
import re
import struct
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edge_agent.protocol import console as con
from edge_agent.protocol import frames as fr
from edge_agent.transports.backend import Done, GenParams, StreamEvent, Token
from edge_agent.transports.uart import UartSession

pytestmark = pytest.mark.timeout(120)

FUZZ = settings(max_examples=300, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
SMALL = settings(FUZZ, max_examples=150)

# bytes a terminal or a noisy line sends: printable, UTF-8 pieces, every control the editor
# handles, 0x00, and anything else
SPECIAL = st.sampled_from([b"\r", b"\n", b"\r\n", b"\x03", b"\x08", b"\x7f", b"\x15", b"\x1b[A",
                           b"\x1bOD", b"\x1b", b"\t", b"\x00", "é".encode(), "€".encode()[:2],
                           b"\x82\xac", b"\xff", b"\xed\xa0\x80", b"gen ", b"--seed 3 ",
                           b"help", b"status", b"load x", b"chat", b"/exit", b"cancel"])
TYPED = st.lists(st.one_of(SPECIAL, st.binary(max_size=12)), max_size=24).map(b"".join)


def chunks(draw: st.DrawFn, data: bytes) -> list[bytes]:
    """`data` cut at random places (a port hands bytes over in arbitrary pieces)."""
    cuts = sorted(draw(st.lists(st.integers(0, len(data)), max_size=6)))
    return [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]


# ---- console: line editor --------------------------------------------------------------------

@FUZZ
@given(data=st.data(), typed=TYPED, max_line=st.sampled_from([8, 64, 512]),
       echo=st.booleans())
def test_line_editor_turns_any_bytes_into_events(data: st.DataObject, typed: bytes,
                                                 max_line: int, echo: bool) -> None:
    ed = con.LineEditor(max_line=max_line, echo=echo)
    for piece in chunks(data.draw, typed):
        events, out = ed.feed(piece)
        out.decode("utf-8")  # the echo is whole characters only
        assert b"\x00" not in out and b"\x1b" not in out
        for ev in events:
            assert isinstance(ev, con.Line | con.Interrupt | con.InputError), ev
            if isinstance(ev, con.Line):
                assert len(ev.text.encode("utf-8")) <= max_line
                assert not re.search(r"[\x00-\x08\x0a-\x1f\x7f]", ev.text), ev
            elif isinstance(ev, con.InputError):
                assert "Hint:" in ev.message, ev


LINE_TEXT = st.text(st.characters(blacklist_categories=("Cc", "Cs")), max_size=80)


@FUZZ
@given(data=st.data(), lines=st.lists(LINE_TEXT, min_size=1, max_size=4),
       ending=st.sampled_from([b"\r", b"\n", b"\r\n"]))
def test_typed_lines_round_trip_whatever_the_chunking(data: st.DataObject, lines: list[str],
                                                      ending: bytes) -> None:
    ed = con.LineEditor(max_line=64)
    wire = b"".join(line.encode() + ending for line in lines)
    events: list[object] = []
    echo = b""
    for piece in chunks(data.draw, wire):
        ev, out = ed.feed(piece)
        events += ev
        echo += out
    assert len(events) == len(lines)
    for line, ev in zip(lines, events, strict=True):
        if len(line.encode()) <= 64:
            assert ev == con.Line(line)
        else:  # refused whole, never truncated
            assert isinstance(ev, con.InputError) and "64-byte limit" in ev.message
    assert echo == b"".join(line.encode()[:64] + b"\r\n" if len(line.encode()) <= 64
                            else _echoed_prefix(line, 64) + b"\r\n" for line in lines)


@FUZZ
@given(before=LINE_TEXT, after=LINE_TEXT, noise=st.sampled_from(
    [bytes([b]) for b in range(0x20) if b not in (0x03, 0x08, 0x09, 0x0A, 0x0D, 0x15, 0x1B)]),
    ending=st.sampled_from([b"\r", b"\n", b"\r\n"]))
def test_a_line_with_a_stray_control_byte_is_discarded_whole(before: str, after: str,
                                                             noise: bytes, ending: bytes) -> None:
    ed = con.LineEditor(max_line=512)
    events, _ = ed.feed(before.encode() + noise + after.encode() + ending + b"help" + ending)
    assert len(events) == 2 and isinstance(events[0], con.InputError), events
    assert f"control byte 0x{noise[0]:02x}" in events[0].message
    assert events[1] == con.Line("help")  # the console carries on


def _echoed_prefix(line: str, limit: int) -> bytes:
    """What is echoed of an overlong line: the whole characters within the first `limit` bytes."""
    return line.encode()[:limit].decode("utf-8", "ignore").encode()


# ---- console: command grammar ----------------------------------------------------------------

COMMAND_TEXT = st.one_of(
    st.text(max_size=60),
    st.lists(st.sampled_from(["gen", "GEN", "load", "unload", "flash", "status", "help", "?",
                              "--max-tokens", "--temperature", "--seed", "--priority", "--",
                              "--x", "=", "1", "0", "-1", "4097", "2.5", "nan", "1e309", "é",
                              "\t", " ", "a", "x" * 70, "\x00"]),
             max_size=8).map(" ".join),
)


@FUZZ
@given(line=COMMAND_TEXT)
def test_any_console_line_is_a_command_or_a_command_error_with_a_hint(line: str) -> None:
    try:
        cmd = con.parse_command(line)
    except con.CommandError as exc:
        assert "Hint:" in str(exc), exc
    else:
        assert cmd.name in (*con.COMMANDS, "")
        if cmd.name == "gen":
            assert cmd.arg and cmd.arg == cmd.arg.strip()
            o = cmd.options
            assert o.max_tokens is None or 1 <= o.max_tokens <= 4096
            assert o.temperature is None or 0.0 <= o.temperature <= 2.0
            assert o.seed is None or 0 <= o.seed < 2**32
            assert o.priority is None or 0 <= o.priority <= 10


@FUZZ
@given(max_tokens=st.none() | st.integers(1, 4096), seed=st.none() | st.integers(0, 2**32 - 1),
       priority=st.none() | st.integers(0, 10),
       text=st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=40)
       .filter(lambda t: t.strip(" \t") == t and t.strip() and t.strip() == t))
def test_gen_options_round_trip(max_tokens: int | None, seed: int | None, priority: int | None,
                                text: str) -> None:
    opts = [f"{flag} {value}" for flag, value in (("--max-tokens", max_tokens), ("--seed", seed),
                                                 ("--priority", priority)) if value is not None]
    cmd = con.parse_command(" ".join(["gen", *opts, "--", text]))
    assert cmd == con.Command("gen", text, con.GenOptions(max_tokens=max_tokens, seed=seed,
                                                          priority=priority))


# ---- console: output -------------------------------------------------------------------------

PIECES = st.lists(st.one_of(st.tuples(st.just("text"), st.text(max_size=20)),
                            st.tuples(st.just("raw"), st.binary(max_size=12))), max_size=10)
CLEAN = re.compile(rb"(?:[^\x00-\x08\x0a-\x1f\x7f]|\r\n)*")  # tab allowed


@FUZZ
@given(pieces=PIECES)
def test_output_is_utf8_crlf_and_free_of_control_bytes(pieces: list[tuple[str, Any]]) -> None:
    enc = con.OutputEncoder()
    out = b"".join(enc.text(p) if kind == "text" else enc.raw(p) for kind, p in pieces)
    out += enc.flush()
    out.decode("utf-8")
    assert CLEAN.fullmatch(out), out


@FUZZ
@given(text=st.text(st.characters(blacklist_categories=("Cs",),
                                  blacklist_characters="\r\x00\x01\x02\x03\x04\x05\x06\x07\x08"
                                  "\x0b\x0c\x0e\x0f\x10\x11\x12\x13\x14\x15\x16\x17\x18\x19"
                                  "\x1a\x1b\x1c\x1d\x1e\x1f\x7f"), max_size=60),
       data=st.data())
def test_token_bytes_split_anywhere_come_out_whole(text: str, data: st.DataObject) -> None:
    enc = con.OutputEncoder()
    raw = text.encode("utf-8")
    out = b"".join(enc.raw(piece) for piece in chunks(data.draw, raw)) + enc.flush()
    assert out == text.replace("\n", "\r\n").encode("utf-8")


# ---- frames ----------------------------------------------------------------------------------

FRAME_TYPES = st.sampled_from(list(fr.FrameType))
PAYLOADS = st.one_of(st.binary(max_size=64), st.binary(min_size=250, max_size=600),
                     st.just(b"\x00" * 300), st.just(bytes(range(1, 256)) * 2))


@st.composite
def frames(draw: st.DrawFn) -> fr.Frame:
    return fr.Frame(draw(FRAME_TYPES), draw(st.integers(0, 0xFFFF)), draw(PAYLOADS))


def bumped(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in after if after[k] != before[k]}


@FUZZ
@given(body=st.one_of(st.binary(max_size=64), st.binary(min_size=4000, max_size=4500)))
def test_any_body_decodes_to_a_frame_or_one_counted_frame_error(body: bytes) -> None:
    dec = fr.FrameDecoder()
    before = dict(dec.counters)
    result = dec.decode(body)
    assert isinstance(result, fr.Frame | fr.FrameError)
    if isinstance(result, fr.Frame):
        assert bumped(before, dec.counters) == {"frames_ok": 1}
        assert fr.decode_body(fr.encode_frame(result.type, result.rid, result.payload)[1:-1]) \
            == result
    else:
        assert bumped(before, dec.counters) == {result.reason.name.lower(): 1}
        assert isinstance(result.reason, fr.NakReason) and result.detail


@FUZZ
@given(f=frames(), data=st.data())
def test_mutated_frames_never_raise_and_a_decoded_one_passed_its_crc(f: fr.Frame,
                                                                     data: st.DataObject) -> None:
    body = bytearray(fr.encode_frame(f.type, f.rid, f.payload)[1:-1])
    assert fr.decode_body(bytes(body)) == f  # the valid frame round-trips
    for _ in range(data.draw(st.integers(1, 3))):
        at = data.draw(st.integers(0, len(body) - 1))
        how = data.draw(st.sampled_from(["flip", "byte", "insert", "delete", "cut"]))
        if how == "flip":
            body[at] ^= 1 << data.draw(st.integers(0, 7))
        elif how == "byte":
            body[at] = data.draw(st.integers(0, 255))
        elif how == "insert":
            body[at:at] = data.draw(st.binary(min_size=1, max_size=4))
        elif how == "delete":
            del body[at:at + data.draw(st.integers(1, 4))]
        else:
            del body[at:]
        if not body:
            body.append(1)
    dec = fr.FrameDecoder()
    result = dec.decode(bytes(body))
    assert isinstance(result, fr.Frame | fr.FrameError)
    assert sum(dec.counters.values()) == 1
    if isinstance(result, fr.Frame):  # a mutation that kept a valid frame: it decodes the same
        assert fr.decode_body(fr.encode_frame(result.type, result.rid, result.payload)[1:-1]) \
            == result


NOISE = st.one_of(TYPED, st.binary(max_size=40), st.just(b"\x00"), st.just(b"\x00\x00"),
                  st.binary(min_size=fr.MAX_ENCODED, max_size=fr.MAX_ENCODED + 20))


@SMALL
@given(parts=st.lists(st.one_of(frames(), NOISE), max_size=8), data=st.data())
def test_demux_yields_every_valid_frame_after_any_noise(parts: list[Any],
                                                        data: st.DataObject) -> None:
    d = fr.PortDemux(gap_s=0.5)
    wire = b"".join(fr.encode_frame(p.type, p.rid, p.payload) if isinstance(p, fr.Frame) else p
                    for p in parts)
    events: list[Any] = []
    now = 0.0
    for piece in chunks(data.draw, wire):
        now += data.draw(st.sampled_from([0.0, 0.01, 0.2, 0.6]))
        events += d.feed(piece, now)
        if data.draw(st.booleans()):
            events += d.expire(now + data.draw(st.sampled_from([0.0, 0.3, 1.0])))
    sent = [p for p in parts if isinstance(p, fr.Frame)]
    got = [e for e in events if isinstance(e, fr.Frame)]
    it = iter(got)  # the frames sent come out in order (noise may hold a valid frame too);
    # a frame is lost only if a gap_s stall cut it, which chunking with time steps can do
    assert all(isinstance(e, fr.ConsoleBytes | fr.Frame | fr.FrameError | fr.Abandoned)
               for e in events)
    assert all(b"\x00" not in e.data for e in events if isinstance(e, fr.ConsoleBytes))
    c = d.decoder.counters
    assert c["frames_ok"] == len(got)
    errors = sum(v for k, v in c.items() if k not in ("frames_ok", "abandoned"))
    assert errors == sum(isinstance(e, fr.FrameError) for e in events) + sum(
        1 for e in events if isinstance(e, fr.Abandoned) and e.size)
    assert c["abandoned"] == sum(isinstance(e, fr.Abandoned) for e in events)
    if not any(isinstance(e, fr.Abandoned) for e in events):
        assert all(any(g == s for g in it) for s in sent), (sent, got)


@SMALL
@given(parts=st.lists(st.one_of(frames(), NOISE), max_size=8), data=st.data())
def test_demux_fed_at_once_yields_exactly_the_frames_sent_in_order(parts: list[Any],
                                                                   data: st.DataObject) -> None:
    d = fr.PortDemux()
    wire = b"".join(fr.encode_frame(p.type, p.rid, p.payload) if isinstance(p, fr.Frame) else p
                    for p in parts)
    events: list[Any] = []
    for piece in chunks(data.draw, wire):  # no time passes: nothing is abandoned
        events += d.feed(piece, 0.0)
    got = iter([e for e in events if isinstance(e, fr.Frame)])
    assert all(any(g == s for g in got) for s in parts if isinstance(s, fr.Frame))


# ---- MCU payloads ----------------------------------------------------------------------------

@FUZZ
@given(payload=st.one_of(st.binary(max_size=40),
                         st.binary(min_size=14, max_size=14).map(lambda h: h + b"hi")))
def test_payload_unpackers_return_or_raise_value_error(payload: bytes) -> None:
    try:
        g = fr.unpack_generate(payload)
    except ValueError as exc:
        assert str(exc)
    else:
        assert fr.unpack_generate(fr.pack_generate(g)) == g
        assert 0 <= g.priority <= 10 and 1 <= g.max_tokens <= 4096 and g.prompt
    try:
        assert 0 <= fr.unpack_resume(payload) < 2**32
    except ValueError as exc:
        assert "needs 4" in str(exc)


def milli(lo: int, hi: int) -> st.SearchStrategy[float | None]:
    return st.none() | st.integers(lo, hi).map(lambda m: m / 1000)


SCHEMAS = st.recursive(st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.text(max_size=8),
                       lambda inner: st.lists(inner, max_size=3)
                       | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=12)
GENERATES = st.builds(
    fr.Generate,
    prompt=st.text(min_size=1, max_size=30),
    priority=st.integers(0, 10), max_tokens=st.integers(1, 4096),
    deadline_ms=st.integers(0, 2**32 - 1), seed=st.none() | st.integers(0, 2**32 - 1),
    temperature=st.integers(0, 2000).map(lambda m: m / 1000), chat=st.booleans(),
    top_k=st.none() | st.integers(0, 1 << 20), top_p=milli(1, 1000), min_p=milli(0, 1000),
    presence_penalty=milli(-2000, 2000), frequency_penalty=milli(-2000, 2000),
    repeat_penalty=milli(1, 100_000), repeat_last_n=st.none() | st.integers(-1, 1 << 20),
    stop=st.lists(st.text(min_size=1, max_size=6), max_size=4).map(tuple),
    logit_bias=st.dictionaries(st.integers(0, 2**32 - 1), st.integers(-100_000, 100_000),
                               max_size=5).map(lambda d: tuple(sorted(
                                   (t, b / 1000) for t, b in d.items()))),
    json_object=st.just(False), schema=st.none(), schema_id=st.none(),
).flatmap(lambda g: st.sampled_from(["none", "json", "schema", "id"]).flatmap(
    lambda kind: {"none": st.just(g), "json": st.just(replace(g, json_object=True)),
                  "schema": st.dictionaries(st.text(max_size=6), SCHEMAS, max_size=4).map(
                      lambda s: replace(g, schema=s)),
                  "id": st.integers(0, 255).map(lambda i: replace(g, schema_id=i))}[kind]))


@FUZZ
@given(g=GENERATES)
def test_any_generate_with_extension_round_trips(g: fr.Generate) -> None:
    try:
        payload = fr.pack_generate(g)
    except UnicodeEncodeError:
        return  # a lone surrogate in the text: not UTF-8, nothing an MCU can send
    assert fr.unpack_generate(payload) == g
    assert bool(payload[1] & fr.FLAG_EXT) == (payload[14:] != g.prompt.encode())


@FUZZ
@given(entries=st.lists(st.tuples(st.sampled_from([*fr.ExtTag, 0x00, 0x13, 0xFF]),
                                  st.binary(max_size=12)), max_size=6),
       cut=st.integers(0, 3))
def test_any_extension_bytes_decode_or_raise_a_value_error_naming_the_field(
        entries: list[tuple[int, bytes]], cut: int) -> None:
    ext = b"".join(struct.pack("<BH", t, len(v)) + v for t, v in entries)
    ext = ext[:len(ext) - cut] if cut else ext
    payload = struct.pack("<BBHIIHH", 5, fr.FLAG_EXT, 8, 0, 0, 0, len(ext)) + ext + b"go"
    try:
        g = fr.unpack_generate(payload)
    except ValueError as exc:
        assert "GENERATE" in str(exc) and "Hint:" in str(exc), exc
    else:
        assert fr.unpack_generate(fr.pack_generate(g)) == g


# ---- a whole session -------------------------------------------------------------------------

class Backend:
    """Three tokens then done for every request; the rest answers at once."""

    def __init__(self) -> None:
        self.n = 0

    def submit(self, prompt: str | Sequence[Mapping[str, str]], params: GenParams,
               priority: int | None, timeout_ms: int | None, session: str) -> str:
        self.n += 1
        return f"req-{self.n}"

    def check_format(self, response_format: Mapping[str, Any]) -> None:
        return None

    async def events(self, request_id: str, from_index: int = 0) -> AsyncIterator[StreamEvent]:
        for i in range(from_index, 3):
            await asyncio.sleep(0)
            yield Token(i, ["ab", "€\x00", "\x1b[2J"][i])
        yield Done("length", 3)

    def cancel(self, request_id: str) -> bool:
        return True

    def status(self) -> dict[str, Any]:
        return {"state": "ready"}

    def models(self) -> list[dict[str, Any]]:
        return [{"name": "m", "state": "serving"}]

    async def load(self, name: str) -> str:
        return f"{name}: serving"

    async def unload(self, name: str) -> str:
        return f"{name}: unloaded"

    def jobs(self) -> list[dict[str, Any]]:
        return []


SESSION_INPUT = st.lists(st.one_of(
    TYPED, NOISE,
    frames().map(lambda f: fr.encode_frame(f.type, f.rid, f.payload)),
    st.sampled_from([fr.FrameType.GENERATE, fr.FrameType.RESUME, fr.FrameType.CANCEL]).flatmap(
        lambda t: st.tuples(st.integers(0, 3), st.binary(max_size=20)).map(
            lambda a: fr.encode_frame(t, a[0], b"\x05\x01\x03\x00\x00\x00\x00\x00\x00\x00\x00\x00"
                                      b"\x00\x00" + a[1] if t == fr.FrameType.GENERATE
                                      else a[1][:4])))), max_size=8)


@SMALL
@given(parts=SESSION_INPUT, mode=st.sampled_from(["auto", "console", "machine"]))
def test_session_answers_any_input_with_well_formed_output(parts: list[bytes],
                                                           mode: str) -> None:
    out: list[bytes] = []
    errors: list[dict[str, Any]] = []

    async def main() -> UartSession:
        asyncio.get_running_loop().set_exception_handler(lambda _l, ctx: errors.append(ctx))
        s = UartSession(Backend(), out.append, mode=mode, gap_s=0.01)
        for part in parts:
            s.feed(part)
            for _ in range(4):
                await asyncio.sleep(0)
        await asyncio.sleep(0.015)  # let a stalled frame be abandoned
        for _ in range(20):
            await asyncio.sleep(0)
        await s.close()
        return s

    asyncio.run(main())
    assert not errors, [e.get("message") for e in errors]
    # what the port receives: console text (UTF-8, no 0x00) and frames that all decode
    peer = fr.PortDemux()
    events = peer.feed(b"".join(out), 0.0)
    assert not peer.in_frame
    console = b"".join(e.data for e in events if isinstance(e, fr.ConsoleBytes))
    console.decode("utf-8")
    assert all(isinstance(e, fr.ConsoleBytes | fr.Frame) for e in events), [
        e for e in events if isinstance(e, fr.FrameError)]
