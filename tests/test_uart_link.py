"""The UART link and session over real ptys (termios raw, pyserial), socket:// and socat.

The backend here is a scripted one at the `Backend` seam (tokens on a timer); the real daemon
behind the same seam is exercised in test_uart_e2e.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import struct
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import serial

from edge_agent.protocol import frames as fr
from edge_agent.transports.serial_link import LinkSettings, SerialLink, SerialLinkError
from edge_agent.transports.uart import (
    BackendError,
    Done,
    Failed,
    GenParams,
    StreamEvent,
    Token,
    UartTransport,
)

pytestmark = pytest.mark.timeout(60)

WORDS = ["Hello", " from", " the", " board", ":", " 5", " €", " per", " token", "."]


class ScriptedBackend:
    """Tokens from WORDS on a timer; records kept, so events() can replay from any index."""

    def __init__(self, delay: float = 0.005) -> None:
        self.delay = delay
        self.recs: dict[str, dict[str, Any]] = {}
        self.submitted: list[tuple[Any, GenParams, int | None, int | None, str]] = []

    def submit(self, prompt: str | Sequence[Mapping[str, str]], params: GenParams,
               priority: int | None, timeout_ms: int | None, session: str) -> str:
        if prompt == "FULL":
            raise BackendError("queue_full", "queue full (64 requests). Hint: retry after 1 s.")
        self.submitted.append((prompt, params, priority, timeout_ms, session))
        rid = f"req-{len(self.submitted)}"
        rec: dict[str, Any] = {"pieces": [], "reason": None, "changed": asyncio.Event()}
        self.recs[rid] = rec
        rec["task"] = asyncio.ensure_future(self._produce(rec, params.max_tokens))
        return rid

    def check_format(self, response_format: Mapping[str, Any]) -> None:
        schema = response_format.get("json_schema", {}).get("schema", {})
        if "bad" in schema:
            raise BackendError("invalid_request", "field 'response_format': the JSON schema "
                               "cannot be used for constrained decoding: bad. Hint: fix it.")

    async def _produce(self, rec: dict[str, Any], n: int) -> None:
        for i in range(n):
            await asyncio.sleep(self.delay)
            if rec["reason"]:
                return
            rec["pieces"].append(WORDS[i % len(WORDS)])
            self._poke(rec)
        rec["reason"] = "length"
        self._poke(rec)

    @staticmethod
    def _poke(rec: dict[str, Any]) -> None:
        rec["changed"].set()
        rec["changed"] = asyncio.Event()

    async def events(self, request_id: str, from_index: int = 0) -> AsyncIterator[StreamEvent]:
        rec = self.recs.get(request_id)
        if rec is None:
            yield Failed("not_found", f"no request {request_id}")
            return
        i = from_index
        while True:
            changed = rec["changed"]
            while i < len(rec["pieces"]):
                yield Token(i, rec["pieces"][i])
                i += 1
            if rec["reason"]:
                yield Done(rec["reason"], len(rec["pieces"]))
                return
            await changed.wait()

    def cancel(self, request_id: str) -> bool:
        rec = self.recs.get(request_id)
        if rec is None or rec["reason"]:
            return False
        rec["reason"] = "cancelled"
        self._poke(rec)
        return True

    def status(self) -> dict[str, Any]:
        return {"state": "ready", "queue": {"depth": 0}}

    def models(self) -> list[dict[str, Any]]:
        return [{"name": "smollm2", "state": "serving"}]

    async def load(self, name: str) -> str:
        if name != "smollm2":
            raise BackendError("model_not_found", f"no model named {name!r}. Hint: `models`.")
        return f"{name}: serving"

    async def unload(self, name: str) -> str:
        return f"{name}: unloaded"

    def jobs(self) -> list[dict[str, Any]]:
        return [{"id": k, "state": v["reason"] or "running"} for k, v in self.recs.items()]


class Peer:
    """The far end of a link: a pty master fd or a pyserial port, read from the event loop."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buf = bytearray()
        self.all = bytearray()  # everything ever received
        self._changed = asyncio.Event()
        os.set_blocking(fd, False)
        asyncio.get_running_loop().add_reader(fd, self._readable)

    def _readable(self) -> None:
        try:
            data = os.read(self.fd, 65536)
        except OSError:
            data = b""
        if data:
            self.buf += data
            self.all += data
            self._changed.set()

    def close(self) -> None:
        asyncio.get_running_loop().remove_reader(self.fd)

    def send(self, data: bytes) -> None:
        os.write(self.fd, data)

    async def expect(self, needle: bytes, timeout: float = 5.0) -> bytes:
        """Wait for `needle`; return and consume everything up to and including it."""
        end = time.monotonic() + timeout
        while needle not in self.buf:
            left = end - time.monotonic()
            if left <= 0:
                raise AssertionError(f"timed out waiting for {needle!r}; got {bytes(self.buf)!r}")
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except asyncio.TimeoutError:
                pass
        cut = self.buf.index(needle) + len(needle)
        out = bytes(self.buf[:cut])
        del self.buf[:cut]
        return out

    async def frames(self, count: int, timeout: float = 5.0) -> list[fr.Frame]:
        """Read `count` valid frames (CRC checked by decode_body), skipping console text."""
        demux = fr.PortDemux()
        got: list[fr.Frame] = []
        end = time.monotonic() + timeout
        while len(got) < count:
            if self.buf:
                data = bytes(self.buf)
                self.buf.clear()
                for ev in demux.feed(data, 0.0):
                    assert not isinstance(ev, fr.FrameError), ev
                    if isinstance(ev, fr.Frame):
                        got.append(ev)
                continue
            left = end - time.monotonic()
            if left <= 0:
                raise AssertionError(f"timed out after {len(got)} of {count} frames: {got}")
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except asyncio.TimeoutError:
                pass
        return got


def run(coro_fn: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(coro_fn())  # type: ignore[arg-type]  # the tests pass async functions


def open_pty() -> tuple[int, str]:
    master, slave = os.openpty()
    path = os.ttyname(slave)
    os.close(slave)  # pyserial reopens it by path; the master keeps the pair alive
    return master, path


async def start_transport(path: str, backend: Any, **kw: Any) -> UartTransport:
    t = UartTransport(LinkSettings(path, **kw.pop("link", {})), backend, gap_s=0.2, **kw)
    await t.start(wait=True)
    return t


# ----- link ---------------------------------------------------------------------------------------

def test_pty_link_is_read_through_the_event_loop_fd_and_never_blocks_it(
        log_lines: list[str]) -> None:
    async def main() -> None:
        master, path = open_pty()
        got = bytearray()
        logs = log_lines
        link = SerialLink(LinkSettings(path, parity="even"), got.extend)
        await link.start(wait=True)
        assert link._fd is not None and link._reader is None  # fd-based, no thread
        # A pty takes PARENB without error and drops it: we notice and say so.
        assert any("ignored parity" in line for line in logs), logs
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.001)

        tick = asyncio.ensure_future(ticker())
        peer = Peer(master)
        await asyncio.sleep(0.05)  # the loop keeps running while the port is idle
        assert ticks > 10
        peer.send(b"ping\x00\xff")
        link.write(b"pong")
        await peer.expect(b"pong")
        for _ in range(100):
            if bytes(got) == b"ping\x00\xff":
                break
            await asyncio.sleep(0.01)
        assert bytes(got) == b"ping\x00\xff"
        assert link.counters["bytes_in"] == 6
        tick.cancel()
        peer.close()
        await link.close()
        os.close(master)

    run(main)


def test_exclusive_open_refuses_a_second_user_without_crashing(log_lines: list[str]) -> None:
    async def main() -> None:
        master, path = open_pty()
        first = SerialLink(LinkSettings(path), lambda b: None)
        await first.start(wait=True)
        logs = log_lines
        second = SerialLink(LinkSettings(path, backoff_s=0.05), lambda b: None)
        await second.start()
        await asyncio.sleep(0.2)
        assert not second.up and second.counters["open_failures"] >= 2
        assert "Could not exclusively lock port" in logs[0] and "Hint:" in logs[0]
        await first.close()  # released: the second link gets it on its next try
        await asyncio.wait_for(second.opened.wait(), 5)
        assert second.up and second.counters["reopens"] == 1
        await second.close()
        os.close(master)

    run(main)


def test_dtr_and_rts_take_the_configured_levels_before_the_open(tmp_path: Path) -> None:
    from edge_agent.config import load_config
    from firmware_tools.urlhandler import register

    register()  # stm32sim://, as the daemon registers it
    # a microcontroller wired as the shipped MCU profiles describe (NRST on DTR, BOOT0 on RTS),
    # simulated: a tty's open (both asserted) holds it in reset for as long as the port is open
    url = "stm32sim://?chip=f405&reset=dtr&boot0=rts"
    port = LinkSettings(url).open_port()
    assert port.sim.in_reset and (port.dtr, port.rts) == (True, True)
    port.close()
    cfg = load_config(None, env={"EDGE_AGENT_SERIAL__DTR": "false",
                                 "EDGE_AGENT_SERIAL__RTS": "false"}, check_paths=False,
                      overrides={"server.state_dir": str(tmp_path)})
    assert (cfg.serial.dtr, cfg.serial.rts) == (False, False)
    port = LinkSettings(url, dtr=cfg.serial.dtr, rts=cfg.serial.rts).open_port()
    # lowered before the open: the board runs its application, never reset on the way
    assert not port.sim.in_reset and port.sim.log == ["BOOT application"]
    port.close()
    # a pty has no modem lines: the levels are not an error there
    master, path = open_pty()
    try:
        LinkSettings(path, dtr=False, rts=False).open_port().close()
    finally:
        os.close(master)


def test_bad_url_or_setting_is_a_config_error() -> None:
    async def main() -> None:
        for settings, text in [(LinkSettings("nosuch://x"), "pyserial refused the URL"),
                               (LinkSettings("loop://", parity="weird"), "parity 'weird'"),
                               (LinkSettings("loop://", stopbits=3), "stopbits 3")]:
            link = SerialLink(settings, lambda b: None)
            with pytest.raises(SerialLinkError, match=text) as e:
                await link.start()
            assert "Hint:" in str(e.value) and e.value.exit_code == 78
            await link.close()

    run(main)


def test_line_settings_a_pty_refuses_are_a_config_error_not_a_traceback() -> None:
    # This kernel's pty takes PARENB once (and drops it), then refuses it on the next open's
    # tcsetattr with EINVAL: termios.error, which is not an OSError. A restart with
    # serial.parity = "even" on a pty met that as a traceback.
    async def main() -> None:
        master, path = open_pty()
        try:
            LinkSettings(path, parity="even").open_port().close()
            try:
                LinkSettings(path, parity="even").open_port().close()
            except SerialLinkError:
                pass
            else:
                pytest.skip("this kernel's pty takes PARENB on every open")
            link = SerialLink(LinkSettings(path, parity="even"), lambda b: None)
            with pytest.raises(SerialLinkError) as e:
                await link.start()
            text = str(e.value)
            assert f"serial port {path!r} refused the line settings 115200 baud 8E1" in text
            assert "Invalid argument" in text and "Hint: set serial.parity" in text
            assert e.value.exit_code == 78
            await link.close()
        finally:
            os.close(master)

    run(main)


class TcpPort:
    """A socket:// peer that can vanish and come back on the same port."""

    def __init__(self) -> None:
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.port = self.srv.getsockname()[1]
        self.conn: socket.socket | None = None

    def accept(self, timeout: float = 5.0) -> socket.socket:
        self.srv.settimeout(timeout)
        self.conn, _ = self.srv.accept()
        self.conn.settimeout(timeout)
        return self.conn

    def vanish(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self.srv.close()

    def come_back(self) -> None:
        self.srv = socket.create_server(("127.0.0.1", self.port))


def test_socket_url_parity_even_uses_a_reader_thread_and_reopens_after_a_drop(
        log_lines: list[str]) -> None:
    """Parity E is not testable on a pty (silently dropped), so it runs over socket://."""
    async def main() -> None:
        tcp = TcpPort()
        got = bytearray()
        logs = log_lines
        link = SerialLink(LinkSettings(f"socket://127.0.0.1:{tcp.port}", parity="even",
                                       stopbits=2, backoff_s=0.05, backoff_max_s=0.2),
                          got.extend)
        accepted = asyncio.get_running_loop().run_in_executor(None, tcp.accept)
        await link.start(wait=True)
        conn = await accepted
        assert link._fd is None and link._reader is not None  # no tty: a reader thread
        assert link.port.parity == serial.PARITY_EVEN
        conn.sendall(b"abc")
        link.write(b"xyz")
        assert await asyncio.get_running_loop().run_in_executor(None, conn.recv, 3) == b"xyz"
        for _ in range(200):
            if bytes(got) == b"abc":
                break
            await asyncio.sleep(0.01)
        assert bytes(got) == b"abc"
        tcp.vanish()  # the adapter disappears
        for _ in range(200):
            if not link.up:
                break
            await asyncio.sleep(0.01)
        assert not link.up and link.counters["link_lost"] == 1
        before = link.counters["dropped_bytes"]  # pyserial may report the last write as failed
        link.write(b"lost")  # dropped and counted, not buffered
        assert link.counters["dropped_bytes"] == before + 4
        await asyncio.sleep(0.3)
        assert link.counters["open_failures"] >= 1
        tcp.come_back()
        conn = await asyncio.get_running_loop().run_in_executor(None, tcp.accept)
        await asyncio.wait_for(link.opened.wait(), 5)
        assert link.counters["reopens"] == 1
        link.write(b"back")
        assert await asyncio.get_running_loop().run_in_executor(None, conn.recv, 4) == b"back"
        assert any("link lost" in line for line in logs)
        await link.close()
        tcp.vanish()

    run(main)


def test_loop_url_round_trip() -> None:
    async def main() -> None:
        got = bytearray()
        link = SerialLink(LinkSettings("loop://"), got.extend)
        await link.start(wait=True)
        link.write(b"echo me")
        for _ in range(200):
            if bytes(got) == b"echo me":
                break
            await asyncio.sleep(0.01)
        assert bytes(got) == b"echo me"
        await link.close()

    run(main)


@pytest.mark.tools
def test_socat_pty_pair_disappears_and_comes_back(tmp_path: Path) -> None:
    """A USB adapter unplugged: socat (and its pty) dies, the link path vanishes; the link keeps
    retrying with backoff and carries on when a new pty appears under the same name."""
    if shutil.which("socat") is None:
        pytest.skip("socat is not installed: apt-get install socat (CI installs it)")
    a, b = tmp_path / "ttyA", tmp_path / "ttyB"

    def start_socat() -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(["socat", f"pty,raw,echo=0,link={a}", f"pty,raw,echo=0,link={b}"],
                                stderr=subprocess.DEVNULL)
        for _ in range(200):
            if a.exists() and b.exists():
                return proc
            time.sleep(0.01)
        proc.kill()
        raise AssertionError("socat made no pty pair")

    async def main() -> None:
        proc = start_socat()
        backend = ScriptedBackend()
        t = await start_transport(str(a), backend,
                                  link={"backoff_s": 0.05, "backoff_max_s": 0.2})
        try:
            peer = serial.serial_for_url(str(b), baudrate=115200, timeout=2)
            loop = asyncio.get_running_loop()
            peer.write(b"version\r")
            line = await loop.run_in_executor(None, peer.read_until, b"edge> ")
            assert b"edge-agent " in line
            peer.close()
            proc.kill()
            proc.wait()
            for _ in range(300):
                if not t.link.up:
                    break
                await asyncio.sleep(0.01)
            assert not t.link.up
            await asyncio.sleep(0.3)  # a few failed reopen attempts
            assert t.link.counters["open_failures"] >= 1
            proc = start_socat()
            await asyncio.wait_for(t.link.opened.wait(), 5)
            peer = serial.serial_for_url(str(b), baudrate=115200, timeout=2)
            peer.write(b"version\r")
            line = await loop.run_in_executor(None, peer.read_until, b"edge> ")
            assert b"edge-agent " in line
            assert t.link.counters["reopens"] == 1 and t.link.counters["link_lost"] == 1
            peer.close()
        finally:
            await t.close()
            proc.kill()
            proc.wait()

    run(main)


# ----- console session over a pty ----------------------------------------------------------

def test_scripted_console_session_over_a_pty() -> None:
    async def main() -> None:
        master, path = open_pty()
        backend = ScriptedBackend()
        t = await start_transport(path, backend, max_line=64)
        peer = Peer(master)
        peer.send(b"\r")
        assert await peer.expect(b"edge> ") == b"\r\nedge> "
        peer.send(b"help\r")
        out = await peer.expect(b"edge> ")
        assert b"gen [--max-tokens N]" in out and b"\r\n" in out
        assert b"\n" not in out.replace(b"\r\n", b"")  # every line end is CRLF
        peer.send(b"gen --max-tokens 10 --seed 3 Say hi\r")
        out = await peer.expect(b"edge> ")
        assert "Hello from the board: 5 € per token.".encode() in out
        out.decode("utf-8")
        prompt, params, prio, _, session = backend.submitted[-1]
        assert (prompt, params, prio) == ("Say hi", GenParams(10, 0.0, 3), None)
        assert session.startswith("uart:")
        # Ctrl-C cancels a long generation
        backend.delay = 0.02
        peer.send(b"gen --max-tokens 500 go on\r")
        await peer.expect(b"Hello from")
        peer.send(b"jobs\r")
        assert b"busy: a generation is running" in await peer.expect(b"stops it.\r\n")
        peer.send(b"\x03")
        out = await peer.expect(b"edge> ")
        assert b"^C" in out and b"[cancelled]" in out
        assert backend.recs["req-2"]["reason"] == "cancelled"
        assert len(backend.recs["req-2"]["pieces"]) < 500
        backend.delay = 0.002
        # chat: every line is a user turn until /exit
        peer.send(b"chat\r")
        await peer.expect(b"you> ")
        peer.send(b"hi there\r")
        await peer.expect(b"you> ")
        peer.send(b"and again\r")
        await peer.expect(b"you> ")
        history = backend.submitted[-1][0]
        assert [m["role"] for m in history] == ["user", "assistant", "user"]
        assert history[0]["content"] == "hi there" and history[2]["content"] == "and again"
        peer.send(b"\x03")
        assert b"type /exit" in await peer.expect(b"you> ")
        peer.send(b"/exit\r")
        assert b"chat ended" in await peer.expect(b"edge> ")
        # the other commands
        for cmd, want in [(b"status", b"state: ready"), (b"models", b"name=smollm2"),
                          (b"load smollm2", b"smollm2: serving"),
                          (b"load nope", b"error: no model named 'nope'"),
                          (b"unload smollm2", b"smollm2: unloaded"),
                          (b"flash status", b"flash: no flash job on record"),
                          (b"cancel", b"nothing to cancel"), (b"jobs", b"id=req-1"),
                          (b"gen FULL", b"error: queue full"),
                          (b"bogus", b"error: unknown command 'bogus'. Hint:")]:
            peer.send(cmd + b"\r")
            assert want in await peer.expect(b"edge> "), cmd
        peer.send(b"status\r")
        out = await peer.expect(b"edge> ")
        assert b"link: url=" in out and b"frames_ok=0" in out
        peer.close()
        await t.close()
        os.close(master)

    run(main)


def test_noise_garbage_break_and_bursts_give_error_lines_and_the_console_carries_on() -> None:
    async def main() -> None:
        master, path = open_pty()
        t = await start_transport(path, ScriptedBackend(), max_line=64)
        peer = Peer(master)
        peer.send(b"ab\xff\xfe\xc0\r")
        assert b"error: line discarded: invalid UTF-8" in await peer.expect(b"edge> ")
        peer.send(b"\x01\x02\x10\x11\x12\x1c\x1fhelp\r")
        assert b"error: line discarded: control byte 0x01" in await peer.expect(b"edge> ")
        peer.send(b"x" * 5000 + b"\r")  # a burst far over max_line
        assert b"error: line refused: 5000 bytes, longer than the 64-byte limit" in \
            await peer.expect(b"edge> ")
        peer.send(b"\x00")  # a break condition reads as a NUL byte
        await asyncio.sleep(0.35)
        assert b"error: a break or a NUL byte ignored" in await peer.expect(b"edge> ")
        # a half-typed line before the break is gone with it: the new prompt starts empty
        peer.send(b"ver")
        await asyncio.sleep(0.05)
        peer.send(b"\x00")
        await asyncio.sleep(0.35)
        assert b"error: a break or a NUL byte ignored" in await peer.expect(b"edge> ")
        peer.send(b"sion\r")
        assert b"error: unknown command 'sion'" in await peer.expect(b"edge> ")
        peer.send(b"version\r")
        assert b"edge-agent " in await peer.expect(b"edge> ")
        stats = t.stats()
        assert stats["noise"] == 2 and stats["overlong"] == 1 and stats["abandoned"] == 2
        peer.close()
        await t.close()
        os.close(master)

    run(main)


# ----- machine mode over a pty -------------------------------------------------------------

def gen_frame(rid: int, prompt: str = "Hi", **kw: Any) -> bytes:
    return fr.encode_frame(fr.FrameType.GENERATE, rid, fr.pack_generate(fr.Generate(prompt, **kw)))


def test_machine_client_generate_cancel_status_and_naks() -> None:
    async def main() -> None:
        master, path = open_pty()
        backend = ScriptedBackend()
        t = await start_transport(path, backend)
        peer = Peer(master)
        peer.send(gen_frame(7, "Hi", priority=9, max_tokens=10, deadline_ms=3000, seed=1))
        got = await peer.frames(12)
        assert got[0] == fr.Frame(fr.FrameType.ACK, 7)
        tokens = [fr.unpack_token(f.payload) for f in got[1:11]]
        assert [i for i, _ in tokens] == list(range(10))
        assert "".join(s for _, s in tokens) == "".join(WORDS)
        assert got[11].type == fr.FrameType.DONE and fr.unpack_done(got[11].payload) == (10,
                                                                                          "length")
        assert backend.submitted[0][1:4] == (GenParams(10, 0.0, 1), 9, 3000)
        # a corrupted frame: NAK with the reason; the link carries on
        bad = bytearray(gen_frame(8))
        bad[-7] ^= 0x01  # "Hi" -> "Ii": a flipped bit in the prompt
        peer.send(bytes(bad))
        nak = (await peer.frames(1))[0]
        assert nak.type == fr.FrameType.NAK
        code, text = fr.unpack_reason(nak.payload)
        assert code == fr.NakReason.BAD_CRC and "CRC-32" in text
        peer.send(fr.encode_frame(0x55, 3))
        nak = (await peer.frames(1))[0]
        assert fr.unpack_reason(nak.payload)[0] == fr.NakReason.UNKNOWN_TYPE and nak.rid == 3
        peer.send(fr.encode_frame(fr.FrameType.GENERATE, 4, b"\x01"))
        nak = (await peer.frames(1))[0]
        assert fr.unpack_reason(nak.payload) == (fr.NakReason.BAD_PAYLOAD,
                                                 "GENERATE payload is 1 bytes; needs 14 + prompt")
        peer.send(gen_frame(5, "FULL"))
        err = (await peer.frames(1))[0]
        assert err.type == fr.FrameType.ERROR and err.rid == 5
        assert fr.unpack_reason(err.payload)[0] == fr.ErrorCode.QUEUE_FULL
        peer.send(fr.encode_frame(fr.FrameType.CANCEL, 99))
        err = (await peer.frames(1))[0]
        assert fr.unpack_reason(err.payload)[0] == fr.ErrorCode.NOT_FOUND
        # a malformed CANCEL or RESUME is that, whatever its id names (known or not)
        for rid in (7, 99):
            peer.send(fr.encode_frame(fr.FrameType.RESUME, rid, b"\x01"))
            nak = (await peer.frames(1))[0]
            assert nak.type == fr.FrameType.NAK and nak.rid == rid
            assert fr.unpack_reason(nak.payload)[0] == fr.NakReason.BAD_PAYLOAD
            peer.send(fr.encode_frame(fr.FrameType.CANCEL, rid, b"\x00\x01"))
            nak = (await peer.frames(1))[0]
            assert fr.unpack_reason(nak.payload) == (fr.NakReason.BAD_PAYLOAD,
                                                     "CANCEL takes no payload, got 2 bytes")
        # cancel a running request
        backend.delay = 0.02
        peer.send(gen_frame(6, max_tokens=500))
        await peer.frames(2)  # ACK + a token
        peer.send(fr.encode_frame(fr.FrameType.CANCEL, 6))
        seen = []
        while not seen or seen[-1].type != fr.FrameType.DONE:
            seen += await peer.frames(1)
        assert fr.FrameType.ACK in [f.type for f in seen]
        assert fr.unpack_done(seen[-1].payload)[1] == "cancelled"
        peer.send(fr.encode_frame(fr.FrameType.STATUS, 1))
        st = (await peer.frames(1))[0]
        assert st.type == fr.FrameType.STATUS_REPLY
        status = json.loads(st.payload)
        assert status["state"] == "ready" and status["link"]["bad_crc"] == 1
        assert status["link"]["naks"] == 7 and status["link"]["frames_ok"] >= 6  # 3 + the 4 above
        peer.close()
        await t.close()
        os.close(master)

    run(main)


PERSON = {"type": "object", "properties": {"name": {"type": "string"}}}


def test_console_schema_json_and_sampling_options_reach_the_backend() -> None:
    async def main() -> None:
        master, path = open_pty()
        backend = ScriptedBackend()
        t = await start_transport(path, backend, max_line=256)
        peer = Peer(master)
        for cmd, want in [
            (b"schema", b"no schemas registered"),
            (b"schema person", b"error: no schema named 'person' on this port (registered: "
                               b"none). Hint: register it with `schema person {...JSON "
                               b"Schema...}`."),
            (b"gen --schema person hi", b"error: gen: no schema named 'person'"),
            (b"schema person " + json.dumps(PERSON).encode(),
             b"schema person registered; use gen --schema person TEXT"),
            (b'schema broken {"bad": 1}', b"error: schema broken: field 'response_format': "
                                          b"the JSON schema cannot be used"),
            (b"schema person", b'person: {"type": "object", "properties": {"name": '
                               b'{"type": "string"}}}'),
            (b"schema", b"person: {"),
        ]:
            peer.send(cmd + b"\r")
            assert want in await peer.expect(b"edge> "), cmd
        assert len(backend.submitted) == 0
        peer.send(b"gen --schema person --max-tokens 3 --top-k 1 --top-p 0.5 --min-p 0.1 "
                  b"--repeat-penalty 1.2 --repeat-last-n 8 --presence-penalty -1 "
                  b"--frequency-penalty 0.5 --temperature 0.7 --seed 4 A person\r")
        await peer.expect(b"edge> ")
        peer.send(b"gen --json --max-tokens 2 A cat\r")
        await peer.expect(b"edge> ")
        (p1, g1, *_), (p2, g2, *_) = backend.submitted
        assert (p1, p2) == ("A person", "A cat")
        assert g1 == GenParams(3, 0.7, 4, top_k=1, top_p=0.5, min_p=0.1, presence_penalty=-1.0,
                               frequency_penalty=0.5, repeat_penalty=1.2, repeat_last_n=8,
                               response_format={"type": "json_schema", "json_schema": {
                                   "name": "person", "schema": PERSON, "strict": True}})
        assert g2 == GenParams(2, 0.0, None, response_format={"type": "json_object"})
        peer.close()
        await t.close()
        os.close(master)

    run(main)


def test_machine_schema_frames_and_generate_extension_reach_the_backend() -> None:
    async def main() -> None:
        master, path = open_pty()
        backend = ScriptedBackend()
        t = await start_transport(path, backend)
        peer = Peer(master)

        async def reply(frame: bytes) -> fr.Frame:
            peer.send(frame)
            return (await peer.frames(1))[0]

        ack = await reply(fr.encode_frame(fr.FrameType.SCHEMA, 1, fr.pack_schema(3, PERSON)))
        assert ack == fr.Frame(fr.FrameType.ACK, 1)
        err = await reply(fr.encode_frame(fr.FrameType.SCHEMA, 2, fr.pack_schema(4, {"bad": 1})))
        assert err.type == fr.FrameType.ERROR and fr.unpack_reason(err.payload) == (
            fr.ErrorCode.BAD_REQUEST, "schema id 4: field 'response_format': the JSON schema "
            "cannot be used for constrained decoding: bad. Hint: fix it.")
        nak = await reply(fr.encode_frame(fr.FrameType.SCHEMA, 3, b"\x05{"))
        assert nak.type == fr.FrameType.NAK and fr.unpack_reason(nak.payload)[0] == \
            fr.NakReason.BAD_PAYLOAD and "SCHEMA 5 text is not JSON" in nak.payload.decode()
        err = await reply(gen_frame(4, schema_id=4))
        assert err.type == fr.FrameType.ERROR and fr.unpack_reason(err.payload) == (
            fr.ErrorCode.NOT_FOUND, "schema id 4 is not registered on this port. Hint: send a "
            "SCHEMA frame with it first (registrations end when the daemon restarts).")
        nak = await reply(fr.encode_frame(fr.FrameType.GENERATE, 5, struct.pack(
            "<BBHIIHH", 5, fr.FLAG_EXT, 8, 0, 0, 0, 3) + b"\x42\x00\x00hi"))
        assert nak.type == fr.FrameType.NAK and fr.unpack_reason(nak.payload) == (
            fr.NakReason.BAD_PAYLOAD, "GENERATE extension: unknown tag 0x42 at offset 0. Hint: "
            "docs/serial.md lists the GENERATE extension tags and their value layouts.")
        assert backend.submitted == []
        # the link carries on: generations with the extension
        for rid, kw in [(6, {"schema_id": 3}), (7, {"schema": {"type": "array"}}),
                        (8, {"json_object": True})]:
            peer.send(gen_frame(rid, max_tokens=2, top_k=2, top_p=0.8, min_p=0.01,
                                presence_penalty=0.5, frequency_penalty=-0.5,
                                repeat_penalty=1.5, repeat_last_n=-1, stop=("\n",),
                                logit_bias=((3, -100.0),), **kw))
            got = await peer.frames(4)
            assert [f.type for f in got] == [fr.FrameType.ACK, fr.FrameType.TOKEN,
                                             fr.FrameType.TOKEN, fr.FrameType.DONE]
        formats = [{"type": "json_schema", "json_schema": {"name": "schema_3", "schema": PERSON,
                                                           "strict": True}},
                   {"type": "json_schema", "json_schema": {"name": "schema",
                                                           "schema": {"type": "array"},
                                                           "strict": True}},
                   {"type": "json_object"}]
        for (_, params, *_), fmt in zip(backend.submitted, formats, strict=True):
            assert params == GenParams(2, 0.0, None, top_k=2, top_p=0.8, min_p=0.01,
                                       presence_penalty=0.5, frequency_penalty=-0.5,
                                       repeat_penalty=1.5, repeat_last_n=-1, stop=("\n",),
                                       logit_bias=((3, -100.0),), response_format=fmt)
        # forgetting an id
        assert await reply(fr.encode_frame(fr.FrameType.SCHEMA, 9, b"\x03")) == \
            fr.Frame(fr.FrameType.ACK, 9)
        err = await reply(gen_frame(10, schema_id=3))
        assert fr.unpack_reason(err.payload)[0] == fr.ErrorCode.NOT_FOUND
        # at most MAX_SCHEMAS ids per port
        for i in range(fr.MAX_SCHEMAS):
            peer.send(fr.encode_frame(fr.FrameType.SCHEMA, 100 + i, fr.pack_schema(i, PERSON)))
        assert {f.type for f in await peer.frames(fr.MAX_SCHEMAS)} == {fr.FrameType.ACK}
        err = await reply(fr.encode_frame(fr.FrameType.SCHEMA, 11, fr.pack_schema(99, PERSON)))
        assert fr.unpack_reason(err.payload)[0] == fr.ErrorCode.BAD_REQUEST
        assert "16 schemas are registered" in err.payload.decode()
        peer.close()
        await t.close()
        os.close(master)

    run(main)


def test_line_drop_then_resume_from_token_n() -> None:
    async def main() -> None:
        master, path = open_pty()
        backend = ScriptedBackend(delay=0.01)
        t = await start_transport(path, backend)
        peer = Peer(master)
        peer.send(gen_frame(21, max_tokens=30))
        got = await peer.frames(4)  # ACK + 3 tokens, then the line drops
        last = fr.unpack_token(got[-1].payload)[0]
        peer.close()  # nothing is read for a while; what arrives is lost
        await asyncio.sleep(0.15)
        os.set_blocking(master, False)
        try:
            while os.read(master, 65536):
                pass
        except BlockingIOError:
            pass
        peer = Peer(master)
        # The first bytes after the drop arrive mid-frame; the MCU resyncs on 0x00 and asks
        # again from the token after the last one it has.
        peer.send(fr.encode_frame(fr.FrameType.RESUME, 21, fr.pack_resume(last + 1)))
        text = "".join(fr.unpack_token(f.payload)[1] for f in got[1:])
        frames: list[fr.Frame] = []
        demux = fr.PortDemux()
        end = time.monotonic() + 10
        while not frames or frames[-1].type != fr.FrameType.DONE:
            assert time.monotonic() < end
            await asyncio.sleep(0.02)
            data = bytes(peer.buf)
            peer.buf.clear()
            for ev in demux.feed(data, 0.0):
                if isinstance(ev, fr.Frame) and ev.rid == 21:
                    frames.append(ev)
        after_ack = frames[[f.type for f in frames].index(fr.FrameType.ACK) + 1:]
        toks = [fr.unpack_token(f.payload) for f in after_ack if f.type == fr.FrameType.TOKEN]
        assert toks[0][0] == last + 1
        text += "".join(s for _, s in toks)
        assert text == "".join(WORDS * 3)
        assert fr.unpack_done(frames[-1].payload) == (30, "length")
        peer.close()
        await t.close()
        os.close(master)

    run(main)


def test_console_and_machine_share_one_port() -> None:
    async def main() -> None:
        master, path = open_pty()
        t = await start_transport(path, ScriptedBackend())
        peer = Peer(master)
        peer.send(b"vers" + gen_frame(2, max_tokens=2) + b"ion\r")
        await peer.expect(b"edge> ")
        for _ in range(500):
            events = fr.PortDemux().feed(bytes(peer.all), 0.0)
            if sum(isinstance(e, fr.Frame) for e in events) == 4:
                break
            await asyncio.sleep(0.01)
        text = b"".join(e.data for e in events if isinstance(e, fr.ConsoleBytes))
        frames = [e for e in events if isinstance(e, fr.Frame)]
        assert b"edge-agent " in text  # the frame in the middle of a typed word changed nothing
        assert [f.type for f in frames] == [fr.FrameType.ACK, fr.FrameType.TOKEN,
                                            fr.FrameType.TOKEN, fr.FrameType.DONE]
        peer.close()
        await t.close()
        os.close(master)

    run(main)


def test_machine_mode_ignores_console_bytes() -> None:
    async def main() -> None:
        master, path = open_pty()
        t = await start_transport(path, ScriptedBackend(), mode="machine")
        peer = Peer(master)
        peer.send(b"help\r" + fr.encode_frame(fr.FrameType.STATUS, 1))
        frames = await peer.frames(1)
        assert frames[0].type == fr.FrameType.STATUS_REPLY
        assert b"commands" not in peer.buf and t.stats()["console_ignored"] == 5
        peer.close()
        await t.close()
        os.close(master)

    run(main)


def test_reader_thread_stops_when_the_link_closes() -> None:
    async def main() -> None:
        before = threading.active_count()
        link = SerialLink(LinkSettings("loop://"), lambda b: None)
        await link.start(wait=True)
        await link.close()
        await asyncio.sleep(0.3)
        assert threading.active_count() <= before + 1  # the executor may keep one worker

    run(main)


# ----- configuration ------------------------------------------------------------------------

@pytest.mark.parametrize(("key", "value", "message"), [
    ("serial.mode", "bogus", "expected one of auto, console, machine; got 'bogus'"),
    ("serial.stopbits", 3, "expected 1, 1.5 or 2 stop bits, got int 3"),
    ("serial.parity", "e", "expected one of none, even, odd, mark, space; got 'e'"),
    ("serial.max_line", 8, "expected an integer from 16 to 65536, got 8"),
    ("serial.echo", "maybe", "expected true or false"),
])
def test_serial_config_errors_name_the_key(key: str, value: object, message: str) -> None:
    from edge_agent.config import load_config
    from edge_agent.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        load_config(None, env={}, overrides={key: value})
    assert f"configuration key {key}" in str(e.value) and message in str(e.value)
    assert "Hint:" in str(e.value) and e.value.exit_code == 78


def test_serial_config_from_environment_and_several_ports() -> None:
    from edge_agent.config import load_config
    from edge_agent.daemon.uart_backend import serial_ports

    cfg = load_config(None, env={"EDGE_AGENT_SERIAL__STOPBITS": "1.5",
                                 "EDGE_AGENT_SERIAL__MODE": "machine",
                                 "EDGE_AGENT_SERIAL__PORT": "/dev/ttyAMA0, socket://h:7000"})
    assert (cfg.serial.stopbits, cfg.serial.mode, cfg.serial.echo) == (1.5, "machine", True)
    assert serial_ports(cfg) == ["/dev/ttyAMA0", "socket://h:7000"]
    assert serial_ports(load_config(None, env={})) == []
