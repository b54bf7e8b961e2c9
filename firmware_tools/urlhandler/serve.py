"""Serve a `stm32sim` simulator on a real pty or a TCP port, for tools that are not Python.

`python -m firmware_tools.simulator --pty [--url 'stm32sim://?chip=f405&state=f.bin']` prints the
pty path (e.g. /dev/pts/7) on stdout, one line, flushed, then serves until killed; `--tcp PORT`
listens on 127.0.0.1:PORT (one client at a time; use with `socket://127.0.0.1:PORT`).

Invariants: the slave side of the pty stays open in this process, so clients may close and
reopen it (stm32flash, then a reader) and talk to the same simulated chip; replies are written
when the simulator says they are ready; with the bytewise knob each byte is a separate write.
A link drop (drop_after knob) closes the pty/connection and ends the server.
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import socket
import sys
import time
import tty
import urllib.parse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from firmware_tools.simulator import Stm32Simulator

__all__ = ["main", "serve_fd", "open_pty"]


def open_pty() -> tuple[int, int, str]:
    """(master, slave, slave path) with the slave in raw mode (no echo, no CR/LF mapping)."""
    master, slave = os.openpty()
    tty.setraw(slave)
    return master, slave, os.ttyname(slave)


def serve_fd(sim: Stm32Simulator, read_fd: int, write_fd: int, *,
             stop_on_eof: bool = True) -> str:
    """Pump bytes between the fd and the simulator until EOF or a link drop; returns why."""
    while True:
        now = time.monotonic()
        ready = sim.next_ready()
        wait = None if ready is None else max(ready - now, 0.0)
        r, _, _ = select.select([read_fd], [], [], wait)
        if r:
            try:
                data = os.read(read_fd, 65536)
            except OSError:
                data = b""
            if not data:
                if stop_on_eof:
                    return "eof"
                time.sleep(0.01)
                continue
            sim.receive(data, time.monotonic())
            if sim.dropped:
                return "dropped"
        out = sim.take_output(time.monotonic())
        if out:
            if sim.faults.bytewise:
                for i in range(len(out)):
                    os.write(write_fd, out[i : i + 1])
                    time.sleep(0.0002)
            else:
                os.write(write_fd, out)


def main(argv: list[str] | None = None) -> int:
    from firmware_tools.simulator import SimulatorError, simulator_from_query

    parser = argparse.ArgumentParser(
        prog="python -m firmware_tools.simulator",
        description="Serve the STM32 AN3155 bootloader simulator on a pty or TCP port.",
    )
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--pty", action="store_true", help="create a pty and print its path")
    where.add_argument("--tcp", type=int, metavar="PORT", help="listen on 127.0.0.1:PORT")
    parser.add_argument(
        "--url", default="stm32sim://?chip=f405",
        help="simulator options as a stm32sim:// URL (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    query = urllib.parse.parse_qs(urllib.parse.urlsplit(args.url).query, keep_blank_values=True)
    try:
        sim = simulator_from_query({k: ",".join(v) for k, v in query.items()})
    except SimulatorError as exc:
        print(f"simulator: error: {exc}", file=sys.stderr)
        return 2
    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        return _serve(args, sim)
    except KeyboardInterrupt:
        return 0
    finally:
        print(f"simulator: host sent {sim.received} bytes, board sent {sim.sent} bytes; "
              f"commands: {len(sim.log)}", file=sys.stderr)


def _serve(args: argparse.Namespace, sim: Stm32Simulator) -> int:
    if args.pty:
        master, slave, path = open_pty()
        print(path, flush=True)
        # Keep `slave` open: reading the master of a pty with no open slave fails with EIO.
        why = serve_fd(sim, master, master, stop_on_eof=False)
        os.close(master)
        os.close(slave)
        print(f"simulator: {why}", file=sys.stderr)
        return 0
    with socket.create_server(("127.0.0.1", args.tcp)) as server:
        print(f"127.0.0.1:{server.getsockname()[1]}", flush=True)
        while True:
            conn, _ = server.accept()
            with conn:
                why = serve_fd(sim, conn.fileno(), conn.fileno())
            if why == "dropped":
                print("simulator: dropped", file=sys.stderr)
                return 0
