"""Benchmark serving over a UART at 115200 baud against the Unix socket, in the same run.

Starts `python -m edge_agent serve` (default model, context 512) with `serial.port` on the slave
of a pseudo-terminal it creates and waits for READY=1. Each round (temperature 0, same prompt):

1. socket: one streamed POST /v1/completions; decode tok/s and time to first token;
2. console: `gen --max-tokens N PROMPT` typed on the console; 3. frames: a machine-mode GENERATE.

For 2 and 3 the bench finds the daemon's request id in its log and follows the *same request*
over the Unix socket (GET /v1/requests/{id}/events), so the added latency per token is the UART
path's arrival minus the socket's arrival of the very same token (no run-to-run jitter). Tokens
the socket follower received as a replay burst (before it caught up) are left out.

A pty has no baud rate: bytes pass as fast as the kernel copies them. The bench models the wire:
a byte read at time t arrives at max(t, previous arrival) + 10 / baud (8N1: ten bit times per
byte) - the serialisation delay of a UART transmitter kept busy. Reported: tok/s, TTFT, added ms
per token (p50 / p95), wire bytes per token and what the wire could carry in tok/s.

    .venv/bin/python bench/uart.py [--state-dir .state] [--tokens 48] [--rounds 3] [--baud 115200]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import select
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # daemon_proc, the launcher the tests use

from daemon_proc import Daemon, DaemonError, launch, serve_argv  # noqa: E402

from edge_agent.client import UnixHTTPConnection  # noqa: E402
from edge_agent.protocol import frames as fr  # noqa: E402

PROMPT = "Once upon a time, in a small village by the sea,"


class Wire:
    """The pty master with a modelled UART: per-byte arrival times at `baud` (8N1)."""

    def __init__(self, fd: int, baud: int) -> None:
        self.fd = fd
        self.byte_s = 10.0 / baud
        self.last = 0.0

    def read_until(self, done: Any, timeout: float = 300) -> list[tuple[float, bytes]]:
        """Chunks with the modelled arrival time of their last byte, until done(all bytes)."""
        out: list[tuple[float, bytes]] = []
        data = b""
        end = time.monotonic() + timeout
        while not done(data):
            r, _, _ = select.select([self.fd], [], [], max(0.0, end - time.monotonic()))
            if not r:
                raise TimeoutError(f"no end of output within {timeout} s: {data[-200:]!r}")
            now = time.monotonic()
            chunk = os.read(self.fd, 65536)
            for i in range(len(chunk)):
                self.last = max(now, self.last) + self.byte_s
                out.append((self.last, chunk[i:i + 1]))
            data += chunk
        return out


def socket_run(sock: str, tokens: int) -> dict[str, Any]:
    conn = UnixHTTPConnection(sock, timeout=600)
    body = json.dumps({"prompt": PROMPT, "max_tokens": tokens, "temperature": 0,
                       "stream": True})
    t0 = time.monotonic()
    conn.request("POST", "/v1/completions", body=body,
                 headers={"Content-Type": "application/json"})
    times: list[float] = []
    for raw in conn.getresponse():
        line = raw.decode().strip()
        if line.startswith("data: {") and json.loads(line[6:])["choices"][0].get("text"):
            times.append(time.monotonic())
    conn.close()
    return {"tokens": len(times), "ttft_s": times[0] - t0,
            "tok_s": (len(times) - 1) / (times[-1] - times[0])}


class Follower(threading.Thread):
    """Follows one request's tokens over the Unix socket: {index: (arrival, text)}."""

    def __init__(self, sock: str, rid: str) -> None:
        super().__init__(daemon=True)
        self.sock, self.rid = sock, rid
        self.tokens: dict[int, tuple[float, str]] = {}
        self.attached = 0.0

    def run(self) -> None:
        conn = UnixHTTPConnection(self.sock, timeout=600)
        conn.request("GET", f"/v1/requests/{self.rid}/events?from=0")
        resp = conn.getresponse()
        self.attached = time.monotonic()
        event = ""
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: ") and event == "token":
                d = json.loads(line[6:])
                self.tokens[d["index"]] = (time.monotonic(), d["text"])
        conn.close()


def follow_new_request(log: Path, seen: int, sock: str) -> tuple[Follower, int]:
    end = time.monotonic() + 30
    while time.monotonic() < end:
        ids = re.findall(r"request (req-[0-9a-f]+) accepted", log.read_text())
        if len(ids) > seen:
            f = Follower(sock, ids[seen])
            f.start()
            return f, len(ids)
        time.sleep(0.002)
    raise TimeoutError("the daemon logged no accepted UART request")


def added(f: Follower, uart: dict[int, float]) -> dict[str, float]:
    """UART arrival minus socket arrival of the same tokens (replayed tokens left out)."""
    first = min(t for t, _ in f.tokens.values())
    live = [i for i, (t, _) in f.tokens.items() if t > first + 0.005 and i in uart]
    diffs = sorted(uart[i] - f.tokens[i][0] for i in live)
    if not diffs:
        return {"added_ms_p50": float("nan"), "added_ms_p95": float("nan")}
    return {"added_ms_p50": statistics.median(diffs) * 1000,
            "added_ms_p95": diffs[int(0.95 * (len(diffs) - 1))] * 1000}


def rate(t0: float, arrivals: list[float]) -> dict[str, float]:
    return {"tokens": len(arrivals), "ttft_s": arrivals[0] - t0,
            "tok_s": (len(arrivals) - 1) / (arrivals[-1] - arrivals[0])}


def console_run(wire: Wire, tokens: int, log: Path, seen: int, sock: str
                ) -> tuple[dict[str, Any], int]:
    wire.last = 0.0
    t0 = time.monotonic()
    os.write(wire.fd, f"gen --max-tokens {tokens} {PROMPT}\r".encode())
    follower, seen = follow_new_request(log, seen, sock)
    got = wire.read_until(lambda d: d.endswith(b"edge> "))
    follower.join(30)
    stream = b"".join(b for _, b in got)
    offset = stream.index(b"\r\n") + 2  # after the echoed command line
    uart: dict[int, float] = {}
    for i in sorted(follower.tokens):
        text = follower.tokens[i][1]
        if text:
            offset += len(text.replace("\n", "\r\n").encode())
            uart[i] = got[offset - 1][0]
    row = {**rate(t0, sorted(uart.values())), **added(follower, uart),
           "wire_bytes_per_token": (len(stream) - stream.index(b"\r\n") - 2) / len(uart)}
    return row, seen


def frames_run(wire: Wire, tokens: int, rid: int, log: Path, seen: int, sock: str
               ) -> tuple[dict[str, Any], int]:
    wire.last = 0.0
    g = fr.Generate(PROMPT, max_tokens=tokens)
    demux = fr.PortDemux()
    uart: dict[int, float] = {}
    nbytes = 0
    t0 = time.monotonic()
    os.write(wire.fd, fr.encode_frame(fr.FrameType.GENERATE, rid, fr.pack_generate(g)))
    follower, seen = follow_new_request(log, seen, sock)
    finished = False
    while not finished:
        for t, b in wire.read_until(lambda d: len(d) > 0):
            nbytes += 1
            for ev in demux.feed(b, t):
                if isinstance(ev, fr.Frame) and ev.rid == rid:
                    if ev.type == fr.FrameType.TOKEN:
                        uart[fr.unpack_token(ev.payload)[0]] = t
                    elif ev.type in (fr.FrameType.DONE, fr.FrameType.ERROR):
                        finished = True
    follower.join(30)
    row = {**rate(t0, sorted(uart.values())), **added(follower, uart),
           "wire_bytes_per_token": nbytes / len(uart)}
    return row, seen


def measure(args: argparse.Namespace, wire: Wire, d: Daemon) -> dict[str, Any]:
    """The rounds against a READY daemon: medians per path and the ratios to the socket."""
    sock = str(d.sock)
    socket_run(sock, 4)  # warm up
    rows: dict[str, list[dict[str, Any]]] = {"socket": [], "console": [], "frames": []}
    seen = 0
    for r in range(args.rounds):
        rows["socket"].append(socket_run(sock, args.tokens))
        row, seen = console_run(wire, args.tokens, d.log, seen, sock)
        rows["console"].append(row)
        row, seen = frames_run(wire, args.tokens, 100 + r, d.log, seen, sock)
        rows["frames"].append(row)
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    result: dict[str, Any] = {"baud": args.baud, "tokens": args.tokens, "rounds": args.rounds}
    for path, rs in rows.items():
        result[path] = {k: round(statistics.median(x[k] for x in rs), 3) for k in rs[0]}
        if "wire_bytes_per_token" in result[path]:
            result[path]["wire_capacity_tok_s"] = round(
                args.baud / 10 / result[path]["wire_bytes_per_token"], 1)
    for path in ("console", "frames"):
        result[f"{path}_vs_socket_tok_s"] = round(result[path]["tok_s"]
                                                  / result["socket"]["tok_s"], 3)
    return result


def report(args: argparse.Namespace, result: dict[str, Any]) -> None:
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{args.tokens} tokens, temperature 0, {args.rounds} rounds (medians), "
          f"wire modelled at {args.baud} baud 8N1")
    print(f"{'path':8} {'tok/s':>7} {'TTFT s':>7} {'added ms p50':>12} {'p95':>7} "
          f"{'B/token':>8} {'wire max tok/s':>14}")
    for path in ("socket", "console", "frames"):
        d = result[path]
        print(f"{path:8} {d['tok_s']:7.2f} {d['ttft_s']:7.3f} "
              f"{d.get('added_ms_p50', 0):12.2f} {d.get('added_ms_p95', 0):7.2f} "
              f"{d.get('wire_bytes_per_token', 0):8.1f} "
              f"{d.get('wire_capacity_tok_s', 0):14.1f}")
    print(f"tok/s vs socket: console {result['console_vs_socket_tok_s']}, "
          f"frames {result['frames_vs_socket_tok_s']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--state-dir", default=str(REPO / ".state"))
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--baud", type=int, default=115200)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    root = Path(tempfile.mkdtemp(prefix="eb-", dir="/tmp"))
    master, slave = os.openpty()
    slave_path = os.ttyname(slave)
    os.close(slave)
    (root / "config.toml").write_text(
        f'[server]\nsocket = "{root / "ea.sock"}"\nstate_dir = "{Path(args.state_dir).resolve()}"\n'
        '[runtime]\nmlock = "best-effort"\nthreads = 1\n'
        "[models.smollm2]\ncontext = 512\nmax_batch = 4\npreload = true\n"
        f'[serial]\nport = "{slave_path}"\nbaudrate = {args.baud}\n')
    try:
        with launch(Daemon, root, serve_argv(root / "config.toml"), ready_timeout=600,
                    grace=30) as d:
            result = measure(args, Wire(master, args.baud), d)
    except DaemonError as exc:  # exited or silent before READY=1: its log's tail
        print(exc, file=sys.stderr)
        return 1
    finally:
        os.close(master)
        shutil.rmtree(root, ignore_errors=True)  # launch removes it, unless it never started
    report(args, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
