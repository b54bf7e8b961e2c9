"""The bootloader client's tty path (blocking reads with VMIN=0/VTIME, streamed blocks) over a
real pty served by `python -m firmware_tools.simulator --pty`, with the simulator's fault knobs.

Every error the tty path can meet is checked for its message, as on the stm32sim:// path, plus
what only a tty has: the fd's flags and termios are given back, a hung-up line is a LinkError
(not a timeout), and each frame leaves in one write() (the simulator's timeline shows one read
per frame).
"""

from __future__ import annotations

import fcntl
import os
import termios
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from firmware import served

from firmware_tools.an3155 import ProtocolError
from firmware_tools.bootloader import (
    Bootloader,
    BootloaderTimeout,
    LinkError,
    NackError,
    ReadoutProtectedError,
    Timeouts,
    open_port,
)
from firmware_tools.simulator import Faults, SimulatorError

FAST = Timeouts(ack=0.3, sync=0.2, write=0.3, sector_erase=0.3, mass_erase=0.5, read=0.3)
BASE = 0x08000000
BLOCKS = tuple((BASE + i * 256, bytes((i + k) % 251 for k in range(256))) for i in range(3))
ERASED = tuple((BASE + i * 256, b"\xff" * 256) for i in range(3))


@contextmanager
def chip(query: str = "", timeouts: Timeouts = FAST) -> Iterator[Bootloader]:
    """A synced Bootloader (Get done) on a pty to a served simulator with `query` knobs."""
    url = "stm32sim://?chip=f405" + (f"&{query}" if query else "")
    with served(url, "--pty") as (pty, _):
        bl = Bootloader(open_port(pty, parity="N"), timeouts=timeouts, name=pty)
        try:
            assert bl._fd is not None, "the tty path is not in use"
            bl.sync()
            bl.get()
            yield bl
        finally:
            bl.close()


def test_blocks_round_trip_and_stop_at_the_first_difference() -> None:
    with chip() as bl:
        bl.erase([0])
        seen: list[int] = []
        bl.write_blocks(BLOCKS, seen.append)
        assert seen == [0, 1, 2]
        seen.clear()
        assert bl.compare_blocks(BLOCKS, seen.append) is None
        assert seen == [0, 1, 2]
        wrong = list(BLOCKS)
        wrong[1] = (wrong[1][0], b"\x00" + wrong[1][1][1:])
        seen.clear()
        assert bl.compare_blocks(wrong, seen.append) == (1, BLOCKS[1][1])
        assert seen == [0]
        # Nothing was sent after the block that differed: the chip waits for a command.
        assert bl.get_id() == 0x413
        assert bl.read_memory(BASE + 256, 4) == BLOCKS[1][1][:4]


def test_data_stage_nack_is_retried_then_reported() -> None:
    with chip("nack=0x31:2") as bl:
        bl.erase([0])
        bl.write_blocks(BLOCKS[:1])
        assert bl.compare_blocks(BLOCKS[:1]) is None
    with chip("nack=0x31:all") as bl:
        with pytest.raises(NackError, match=r"WRITE_MEMORY at 0x08000000 \(256 bytes\) on "
                           r"/dev/pts/\d+: bootloader answered NACK \(0x1F\) 4 times\. Hint: "):
            bl.write_blocks(BLOCKS[:1])


def test_address_nack_names_the_stage() -> None:
    with chip() as bl:
        with pytest.raises(NackError, match=r"WRITE_MEMORY at 0x20000100 \(4 bytes\) on "
                           r"/dev/pts/\d+: .*NACK \(0x1F\) to the address: the address is not "
                           r"writable\. Hint: check the board profile"):
            bl.write_blocks(((0x20000100, b"abcd"),))
        with pytest.raises(NackError, match=r"READ_MEMORY at 0x60000000 \(4 bytes\) on "
                           r".*to the address: the address is outside readable memory\. Hint:"):
            bl.compare_blocks(((0x60000000, b"abcd"),))
        assert bl.get_id() == 0x413  # still in step with the chip


def test_readout_protection_is_explained_on_both_loops() -> None:
    with chip("rdp=1") as bl:
        with pytest.raises(ReadoutProtectedError, match=r"refused WRITE_MEMORY \(0x31\) with "
                           r"NACK although Get lists it.*Hint: Readout Unprotect \(0x92\)"):
            bl.write_blocks(BLOCKS[:1])
        with pytest.raises(ReadoutProtectedError, match=r"refused READ_MEMORY \(0x11\)"):
            bl.compare_blocks(BLOCKS[:1])


def test_busy_bytes_and_bytewise_replies_are_waited_through() -> None:
    with chip("busy=3&bytewise=1") as bl:
        bl.erase([0])
        bl.write_blocks(BLOCKS)
        assert bl.compare_blocks(BLOCKS) is None


def test_silence_is_a_timeout_with_the_operation_named() -> None:
    with chip("silence=0x11") as bl:
        t0 = time.monotonic()
        with pytest.raises(BootloaderTimeout, match=r"READ_MEMORY at 0x08000000 \(256 bytes\) "
                           r"on /dev/pts/\d+: waited 0\.3 s for 1 bytes, got nothing\. Hint: "
                           r"check that BOOT0 is high"):
            bl.compare_blocks(BLOCKS[:1])
        assert 0.25 < time.monotonic() - t0 < 2.0


def test_garbage_instead_of_ack() -> None:
    with chip("garbage=0x31") as bl:
        with pytest.raises(ProtocolError, match=r"WRITE_MEMORY at 0x08000000 \(256 bytes\) on "
                           r"/dev/pts/\d+: expected ACK \(0x79\), got 0xA5\. Hint: noise"):
            bl.write_blocks(BLOCKS[:1])


def test_bad_blocks_are_refused_before_any_byte_is_sent() -> None:
    with chip() as bl:
        with pytest.raises(ProtocolError, match=r"WRITE_MEMORY at 0x08000102 \(4 bytes\): "
                           r"address is not 4-byte aligned\. Hint: "):
            bl.write_blocks(((BASE, b"abcd"), (BASE + 0x102, b"abcd")))
        with pytest.raises(ProtocolError, match=r"257"):
            bl.write_blocks(((BASE, bytes(257)),))
        assert bl.read_memory(BASE, 4) == b"\xff" * 4  # the first block was not written


def test_hung_up_line_is_a_link_error_at_once() -> None:
    with chip("drop_after=40") as bl:
        t0 = time.monotonic()
        with pytest.raises(LinkError, match=r"on /dev/pts/\d+: .*failed: .*Hint: the link "
                           r"dropped; reconnect the adapter and rerun with --resume\."):
            bl.compare_blocks(ERASED * 3)
        assert time.monotonic() - t0 < FAST.read + 0.25


def test_release_gives_the_fd_back_as_pyserial_opened_it() -> None:
    with served("stm32sim://?chip=f405", "--pty") as (pty, _):
        port = open_port(pty, parity="N")
        try:
            before = (fcntl.fcntl(port.fd, fcntl.F_GETFL), termios.tcgetattr(port.fd))
            bl = Bootloader(port, timeouts=FAST)
            bl.sync()
            assert not fcntl.fcntl(port.fd, fcntl.F_GETFL) & os.O_NONBLOCK
            assert termios.tcgetattr(port.fd)[6][termios.VTIME] == 2  # the 0.2 s sync wait
            bl.release()
            assert (fcntl.fcntl(port.fd, fcntl.F_GETFL), termios.tcgetattr(port.fd)) == before
            # Afterwards the port works through pyserial's own reads.
            assert bl.get_id() == 0x413
        finally:
            port.close()


def test_each_frame_is_one_write(tmp_path: Path) -> None:
    log = tmp_path / "timeline.tsv"
    with chip(f"timeline={log}") as bl:
        assert bl.compare_blocks(ERASED[:2]) is None
    rows = [line.split("\t") for line in log.read_text().splitlines()]
    rx = [int(n) for d, _, n in rows if d == "rx"]
    # sync, Get, then per block: command, address, length -- each read whole by the simulator.
    assert rx == [1, 2, 2, 5, 2, 2, 5, 2]
    times = [float(t) for _, t, _ in rows]
    assert times == sorted(times)
    tx = [int(n) for d, _, n in rows if d == "tx"]
    assert tx[-1] == 257  # ACK and 256 data bytes in one reply


def test_timeline_knob_needs_a_file_name() -> None:
    with pytest.raises(SimulatorError, match=r"simulator option timeline= needs a file name\. "
                       r"Hint: write e\.g\. timeline=/tmp/"):
        Faults.parse({"timeline": ""})
    assert Faults.parse({"timeline": "/tmp/x.tsv"}).timeline == "/tmp/x.tsv"


def test_long_waits_on_a_paced_link_and_on_a_fast_one() -> None:
    # Paced at 115200 baud: replies cannot come before their wire time, the early wake-up
    # before each long reply stays on, and the blocks still round-trip.
    with chip("baud=115200") as bl:
        bl.erase([0])
        t0 = time.monotonic()
        bl.write_blocks(BLOCKS[:2])
        assert bl.compare_blocks(BLOCKS[:2]) is None
        took = time.monotonic() - t0
        wire = 2 * (2 + 1 + 5 + 1 + 258 + 1 + 2 + 1 + 5 + 1 + 2 + 257) * 10 / 115200
        assert wire <= took < wire + 1.0
        assert bl.link_paced
    # A pty without pacing answers at once: the first long reply shows it.
    with chip() as bl:
        bl.erase([0])
        bl.write_blocks(BLOCKS)
        assert not bl.link_paced
        assert bl.compare_blocks(BLOCKS) is None
