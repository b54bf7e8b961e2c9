"""End to end over UART: `python -m edge_agent serve` with serial.port on real ptys, real model.

One daemon for the module, with two ports: the slave of an os.openpty pair (console and frames
share it) and, when socat is installed, one end of a socat pty pair that is killed and restarted
(a USB adapter unplugged and plugged back). Outputs are checked against the same daemon's HTTP
API at temperature 0 (the same scheduler and runner serve both). Structured output on both UART
paths (a SCHEMA frame and GENERATE's extension; the console's `schema` and `gen --schema`) is
checked with json.loads + jsonschema and against the HTTP API's answer to the same request.
The module runs twice, on a daemon of each engine (the `engine` fixture).
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import struct
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest
import serial
from daemon_proc import Daemon, launch, serve_argv

from edge_agent.protocol import frames as fr

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

PROMPT = "The capital of France is"


class Pty:
    """The far end of the daemon's port: a pty master, read with select and a deadline."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buf = bytearray()
        self.demux = fr.PortDemux()
        self.pending: list[fr.Frame] = []

    def send(self, data: bytes) -> None:
        os.write(self.fd, data)

    def _fill(self, until: float) -> None:
        r, _, _ = select.select([self.fd], [], [], max(0.0, until - time.monotonic()))
        if r:
            self.buf += os.read(self.fd, 65536)

    def expect(self, needle: bytes, timeout: float = 30.0) -> bytes:
        end = time.monotonic() + timeout
        while needle not in self.buf:
            if time.monotonic() > end:
                raise AssertionError(f"no {needle!r} within {timeout} s; got {bytes(self.buf)!r}")
            self._fill(end)
        cut = self.buf.index(needle) + len(needle)
        out = bytes(self.buf[:cut])
        del self.buf[:cut]
        return out

    def frames(self, rid: int, until_type: int, timeout: float = 60.0) -> list[fr.Frame]:
        """Frames for `rid` (CRC checked; console text skipped) up to the first `until_type`;
        later frames stay pending for the next call."""
        out: list[fr.Frame] = []
        end = time.monotonic() + timeout
        while True:
            while self.pending:
                f = self.pending.pop(0)
                if f.rid == rid:
                    out.append(f)
                    if f.type == until_type:
                        return out
            if time.monotonic() > end:
                raise AssertionError(f"no frame type {until_type:#x} within {timeout} s: {out}")
            if not self.buf:
                self._fill(end)
            data = bytes(self.buf)
            self.buf.clear()
            for ev in self.demux.feed(data, 0.0):
                assert not isinstance(ev, fr.FrameError), ev
                if isinstance(ev, fr.Frame):
                    self.pending.append(ev)

    def drain(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self._fill(end)
        self.buf.clear()
        self.pending.clear()
        self.demux = fr.PortDemux()


class Served(Daemon):
    """The daemon with its pty (`pty`) and, with socat, the pty pair standing for a USB
    adapter (`socat_link` is the daemon's port, `socat_peer` the far end)."""

    pty: Pty
    socat_link: Path | None
    socat_peer: Path | None
    socat: subprocess.Popen[bytes] | None

    def completion(self, prompt: str, max_tokens: int) -> str:
        status, r = self.json("POST", "/v1/completions",
                              {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
        assert status == 200, r
        return str(r["choices"][0]["text"])


def start_socat(a: Path, b: Path) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(["socat", f"pty,raw,echo=0,link={a}", f"pty,raw,echo=0,link={b}"],
                            stderr=subprocess.DEVNULL)
    end = time.monotonic() + 10
    while not (a.exists() and b.exists()):
        assert time.monotonic() < end and proc.poll() is None, "socat made no pty pair"
        time.sleep(0.01)
    return proc


@pytest.fixture(scope="module", params=["llamacpp", "numpy"])
def engine(request: pytest.FixtureRequest) -> str:
    """Every test of this module runs against a daemon on each engine."""
    return str(request.param)


@pytest.fixture(scope="module")
def served(prepared_state_dir: Path, engine: str) -> Iterator[Served]:
    root = Path(tempfile.mkdtemp(prefix="eu-", dir="/tmp"))
    master, slave = os.openpty()
    slave_path = os.ttyname(slave)
    os.close(slave)
    socat = link = peer = None
    s: Served | None = None
    try:
        ports = [slave_path]
        if shutil.which("socat"):
            link, peer = root / "ttyUSB", root / "ttyPeer"
            socat = start_socat(link, peer)
            ports.append(str(link))
        cfg = root / "config.toml"
        cfg.write_text(
            f'[server]\nsocket = "{root / "ea.sock"}"\nstate_dir = "{prepared_state_dir}"\n'
            "drain_timeout_s = 5\n"
            f'[runtime]\nengine = "{engine}"\nmlock = "best-effort"\nthreads = 1\n'
            "[models.smollm2]\ncontext = 512\nmax_batch = 4\npreload = true\n"
            f'[serial]\nport = "{",".join(ports)}"\nbaudrate = 115200\nmax_line = 256\n'
        )
        with launch(Served, root, serve_argv(cfg), ready_timeout=150) as s:
            s.pty, s.socat_link, s.socat_peer, s.socat = Pty(master), link, peer, socat
            assert s.health()["models"]["smollm2"]["engine"] == engine
            yield s
            s.proc.send_signal(signal.SIGTERM)
            assert s.proc.wait(30) == 0, s.log_tail()
            assert "stopped" in s.log.read_text()
    finally:
        for p in (socat, None if s is None else s.socat):  # replugged: s.socat is a new one
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
        os.close(master)
        shutil.rmtree(root, ignore_errors=True)


def test_console_session_prompt_gen_ctrl_c_chat(served: Served) -> None:
    pty = served.pty
    pty.send(b"\r")
    pty.expect(b"edge> ")
    pty.send(b"status\r")
    out = pty.expect(b"edge> ")
    assert b"state: serving" in out and b"smollm2=" in out
    pty.send(b"flash status\r")
    assert b"flash: no flash job on record" in pty.expect(b"edge> ")
    pty.send(b"jobs\r")
    assert b"no jobs" in pty.expect(b"edge> ")
    want = served.completion(PROMPT, 10)
    pty.send(f"gen --max-tokens 10 {PROMPT}\r".encode())
    out = pty.expect(b"edge> ")
    text = out.decode("utf-8").split("\r\n", 1)[1].rsplit("\r\n", 1)[0]
    assert text == want.replace("\n", "\r\n")
    # Ctrl-C cancels the running generation
    pty.send(b"gen --max-tokens 400 Once upon a time, in a small village by the sea,\r")
    pty.expect(b"\r\n")  # the echo; tokens follow
    end = time.monotonic() + 30
    while not pty.buf:  # the first token is on the wire: interrupt now
        pty._fill(end)
    pty.send(b"\x03")
    out = pty.expect(b"edge> ", timeout=30)
    assert b"[cancelled]" in out
    served.wait_quiet(free_blocks=False)
    # chat: each line a user turn until /exit
    pty.send(b"chat\r")
    pty.expect(b"you> ")
    pty.send(b"Name three colours.\r")
    reply = pty.expect(b"you> ", timeout=60)
    assert len(reply.strip()) > len(b"Name three colours.") + 2
    pty.send(b"/exit\r")
    assert b"chat ended" in pty.expect(b"edge> ")
    # unload / load from the console: the same waits as POST /v1/models/NAME/(un)load
    pty.send(b"unload smollm2\r")
    assert b"smollm2: unloaded" in pty.expect(b"edge> ", timeout=60)
    assert served.health()["models"]["smollm2"]["runner_pid"] is None
    pty.send(b"load smollm2\r")
    out = pty.expect(b"edge> ", timeout=120)
    assert b"smollm2: idle" in out or b"smollm2: serving" in out, out  # loaded, nothing to do
    assert served.health()["models"]["smollm2"]["runner_pid"] is not None
    pty.send(b"load nope\r")
    assert b"no model named 'nope'" in pty.expect(b"edge> ")


def test_noise_and_garbage_then_the_console_carries_on(served: Served) -> None:
    pty = served.pty
    pty.send(b"\xff\xfe\xfd garbage \x80\r")
    assert b"error: line discarded: invalid UTF-8" in pty.expect(b"edge> ")
    pty.send(b"gen " + b"x" * 400 + b"\r")
    assert b"longer than the 256-byte limit" in pty.expect(b"edge> ")
    pty.send(b"version\r")
    assert b"edge-agent " in pty.expect(b"edge> ")


def test_machine_client_with_crc_checks_status_and_nak(served: Served) -> None:
    pty = served.pty
    want = served.completion(PROMPT, 12)
    g = fr.Generate(PROMPT, priority=8, max_tokens=12, deadline_ms=60000)
    pty.send(fr.encode_frame(fr.FrameType.GENERATE, 42, fr.pack_generate(g)))
    frames = pty.frames(42, fr.FrameType.DONE)
    assert frames[0].type == fr.FrameType.ACK
    text = "".join(fr.unpack_token(f.payload)[1] for f in frames if f.type == fr.FrameType.TOKEN)
    assert text == want
    n, reason = fr.unpack_done(frames[-1].payload)
    assert reason in ("length", "stop") and n <= 12
    bad = bytearray(fr.encode_frame(fr.FrameType.STATUS, 43))
    bad[-3] ^= 0x10  # a flipped bit in the CRC
    pty.send(bytes(bad))
    nak = pty.frames(43, fr.FrameType.NAK)[-1]
    assert fr.unpack_reason(nak.payload)[0] == fr.NakReason.BAD_CRC
    pty.send(fr.encode_frame(fr.FrameType.STATUS, 44))
    st = json.loads(pty.frames(44, fr.FrameType.STATUS_REPLY)[-1].payload)
    assert st["state"] == "serving" and st["link"]["bad_crc"] == 1


def test_line_drop_then_resume(served: Served) -> None:
    pty = served.pty
    want = served.completion(PROMPT, 24)
    g = fr.Generate(PROMPT, max_tokens=24)
    pty.send(fr.encode_frame(fr.FrameType.GENERATE, 7, fr.pack_generate(g)))
    got: list[tuple[int, str]] = []
    while len(got) < 3:
        got.append(fr.unpack_token(pty.frames(7, fr.FrameType.TOKEN)[-1].payload))
    pty.drain(1.5)  # the line drops: everything sent meanwhile is lost
    last = got[-1][0]
    pty.send(fr.encode_frame(fr.FrameType.RESUME, 7, fr.pack_resume(last + 1)))
    # Frames of the old stream (even its DONE) may still be on the wire; the resumed stream
    # starts after the ACK of the RESUME.
    frames = pty.frames(7, fr.FrameType.ACK)
    frames = pty.frames(7, fr.FrameType.DONE)
    toks = [fr.unpack_token(f.payload) for f in frames if f.type == fr.FrameType.TOKEN]
    assert toks and toks[0][0] == last + 1
    assert "".join(t for _, t in got + toks) == want


PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20},
    "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"], "additionalProperties": False}
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
ASK = "Describe a person as JSON."


def frame_text(frames: list[fr.Frame]) -> str:
    assert frames[0].type == fr.FrameType.ACK, frames[0]
    assert frames[-1].type == fr.FrameType.DONE, frames[-1]
    return "".join(fr.unpack_token(f.payload)[1] for f in frames if f.type == fr.FrameType.TOKEN)


def test_machine_schema_constrained_generate_is_valid_json(served: Served) -> None:
    pty = served.pty
    status, r = served.json("POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": ASK}], "max_tokens": 120, "temperature": 0,
        "response_format": PERSON_FORMAT})
    assert status == 200, r
    want = r["choices"][0]["message"]["content"]
    # a schema registered once, then named by id
    pty.send(fr.encode_frame(fr.FrameType.SCHEMA, 60, fr.pack_schema(1, PERSON)))
    assert pty.frames(60, fr.FrameType.ACK)[-1].type == fr.FrameType.ACK
    g = fr.Generate(ASK, max_tokens=120, chat=True, schema_id=1)
    pty.send(fr.encode_frame(fr.FrameType.GENERATE, 61, fr.pack_generate(g)))
    frames = pty.frames(61, fr.FrameType.DONE)
    text = frame_text(frames)
    jsonschema.validate(json.loads(text), PERSON)
    assert fr.unpack_done(frames[-1].payload)[1] == "stop"
    assert text == want  # temperature 0: the HTTP API's answer to the same request
    # the same schema inline gives the same text; any JSON object (json_object) parses
    g = fr.Generate(ASK, max_tokens=120, chat=True, schema=PERSON)
    pty.send(fr.encode_frame(fr.FrameType.GENERATE, 62, fr.pack_generate(g)))
    assert frame_text(pty.frames(62, fr.FrameType.DONE)) == want
    g = fr.Generate("Give me a JSON object with a cat's name and age.", max_tokens=200,
                    chat=True, json_object=True)
    pty.send(fr.encode_frame(fr.FrameType.GENERATE, 63, fr.pack_generate(g)))
    assert isinstance(json.loads(frame_text(pty.frames(63, fr.FrameType.DONE))), dict)
    # a schema llguidance cannot compile: an ERROR naming it, at registration
    bad = {"type": "object", "properties": {"a": {"$ref": "#/definitions/missing"}}}
    pty.send(fr.encode_frame(fr.FrameType.SCHEMA, 64, fr.pack_schema(2, bad)))
    err = pty.frames(64, fr.FrameType.ERROR)[-1]
    code, message = fr.unpack_reason(err.payload)
    assert code == fr.ErrorCode.BAD_REQUEST
    assert message.startswith("schema id 2: field 'response_format': the JSON schema cannot be "
                              "used for constrained decoding") and "missing" in message
    pty.send(fr.encode_frame(fr.FrameType.GENERATE, 65, fr.pack_generate(
        fr.Generate("x", schema=bad))))
    assert "field 'response_format'" in fr.unpack_reason(
        pty.frames(65, fr.FrameType.ERROR)[-1].payload)[1]
    # a malformed extension: a NAK naming the field, and the link carries on
    pty.send(fr.encode_frame(fr.FrameType.GENERATE, 66, struct.pack(
        "<BBHIIHH", 5, fr.FLAG_EXT, 8, 0, 0, 0, 5) + b"\x11\x02\x00{]hi"))
    code, message = fr.unpack_reason(pty.frames(66, fr.FrameType.NAK)[-1].payload)
    assert code == fr.NakReason.BAD_PAYLOAD and "schema (tag 0x11) is not JSON" in message
    pty.send(fr.encode_frame(fr.FrameType.STATUS, 67))
    assert json.loads(pty.frames(67, fr.FrameType.STATUS_REPLY)[-1].payload)["state"] == \
        "serving"


def test_machine_sampling_controls_reach_the_sampler(served: Served) -> None:
    pty = served.pty
    # top_k 1 keeps only the likeliest token: any temperature and seed give the greedy text
    want = served.completion(PROMPT, 16)
    _, hot = served.json("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 16,
                                                      "temperature": 1.5, "seed": 1234})
    assert hot["choices"][0]["text"] != want  # without top_k this seed leaves the greedy path
    g = fr.Generate(PROMPT, max_tokens=16, temperature=1.5, seed=1234, top_k=1)
    pty.send(fr.encode_frame(fr.FrameType.GENERATE, 70, fr.pack_generate(g)))
    assert frame_text(pty.frames(70, fr.FrameType.DONE)) == want
    # penalties, min_p, top_p, stop and logit_bias: what the HTTP API gives for those fields
    body = {"prompt": "List the planets: Mercury, Venus,", "max_tokens": 24, "temperature": 0.8,
            "seed": 5, "top_p": 0.9, "min_p": 0.05, "presence_penalty": 1.5,
            "frequency_penalty": 0.5, "repeat_penalty": 1.3, "repeat_last_n": 32,
            "stop": ["Pluto"], "logit_bias": {"28": -100}}
    status, r = served.json("POST", "/v1/completions", body)
    assert status == 200, r
    g = fr.Generate(body["prompt"], max_tokens=24, temperature=0.8, seed=5, top_p=0.9,
                    min_p=0.05, presence_penalty=1.5, frequency_penalty=0.5, repeat_penalty=1.3,
                    repeat_last_n=32, stop=("Pluto",), logit_bias=((28, -100.0),))
    pty.send(fr.encode_frame(fr.FrameType.GENERATE, 71, fr.pack_generate(g)))
    assert frame_text(pty.frames(71, fr.FrameType.DONE)) == r["choices"][0]["text"]
    status, plain = served.json("POST", "/v1/completions", {**body, "presence_penalty": 0,
                                                             "frequency_penalty": 0,
                                                             "repeat_penalty": 1.0})
    assert plain["choices"][0]["text"] != r["choices"][0]["text"]  # the penalties did something


def console_text(out: bytes) -> str:
    """The generated text of a console `gen`: between the echoed line and the prompt."""
    return out.decode("utf-8").split("\r\n", 1)[1].rsplit("\r\n", 1)[0]


def test_console_schema_and_json_constrained_gen(served: Served) -> None:
    pty = served.pty
    pty.send(b"\r")
    pty.expect(b"edge> ")
    status, r = served.json("POST", "/v1/completions", {
        "prompt": "A person as JSON:", "max_tokens": 80, "temperature": 0,
        "response_format": PERSON_FORMAT})
    assert status == 200, r
    want = r["choices"][0]["text"]
    pty.send(f"schema person {json.dumps(PERSON, separators=(',', ':'))}\r".encode())
    assert b"schema person registered" in pty.expect(b"edge> ")
    pty.send(b"gen --schema person --max-tokens 80 A person as JSON:\r")
    text = console_text(pty.expect(b"edge> ", timeout=60))
    jsonschema.validate(json.loads(text), PERSON)
    assert text == want
    pty.send(b"gen --json --max-tokens 200 --top-k 1 --temperature 1.2 A cat as a JSON object:\r")
    assert isinstance(json.loads(console_text(pty.expect(b"edge> ", timeout=90))), dict)
    pty.send(b'schema bad {"type":"object","properties":{"a":{"$ref":"#/definitions/x"}}}\r')
    out = pty.expect(b"edge> ")
    assert b"error: schema bad: field 'response_format': the JSON schema cannot be used" in out
    pty.send(b"gen --schema bad hi\r")
    assert b"error: gen: no schema named 'bad' on this port (registered: person)" in \
        pty.expect(b"edge> ")
    # the sampling options: top_k 1 at any temperature is the greedy text
    want = served.completion(PROMPT, 10)
    _, hot = served.json("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 10,
                                                      "temperature": 1.7, "seed": 9})
    assert hot["choices"][0]["text"] != want  # without top_k this seed leaves the greedy path
    pty.send(f"gen --max-tokens 10 --top-k 1 --temperature 1.7 --seed 9 {PROMPT}\r".encode())
    assert console_text(pty.expect(b"edge> ")) == want.replace("\n", "\r\n")


def test_port_disappears_and_comes_back(served: Served) -> None:
    if served.socat is None or served.socat_link is None or served.socat_peer is None:
        pytest.skip("socat is not installed: apt-get install socat (CI installs it)")
    peer = serial.serial_for_url(str(served.socat_peer), baudrate=115200, timeout=10)
    peer.write(b"version\r")
    assert b"edge-agent " in peer.read_until(b"edge> ")
    peer.close()
    served.socat.kill()  # unplugged
    served.socat.wait()
    time.sleep(1.0)
    assert served.proc.poll() is None
    # /health says so (it was visible only on the port that is down)
    _, h = served.json("GET", "/health")
    link = next(p for p in h["serial"] if p["url"] == str(served.socat_link))
    assert link["up"] is False and link["link_lost"] >= 1, h["serial"]
    served.socat = start_socat(served.socat_link, served.socat_peer)  # plugged back
    end = time.monotonic() + 20
    while True:
        peer = serial.serial_for_url(str(served.socat_peer), baudrate=115200, timeout=1)
        peer.write(b"version\r")
        out = peer.read_until(b"edge> ")
        peer.close()
        if b"edge-agent " in out:
            break
        assert time.monotonic() < end, served.log.read_text()[-2000:]
    log = served.log.read_text()
    assert "link lost" in log and "reopened" in log
    _, h = served.json("GET", "/health")
    assert h["status"] == "serving"
    link = next(p for p in h["serial"] if p["url"] == str(served.socat_link))
    assert link["up"] is True and link["reopens"] >= 1, h["serial"]
