"""Read Memory and Write Memory: one block, and the streamed block loops over many.

`MemoryBlocks` extends `firmware_tools.link.Link`; `firmware_tools.bootloader.Bootloader` is
built on it.

Invariants this module owns:
- Every Write Memory frame is checked (4-byte aligned address, 1..256 bytes) before the first
  byte of the first block goes out.
- Only the Write Memory data stage is retried (NACK there means the frame was rejected, the chip
  is back waiting for a command), at most `write_retries` times; nothing else is retried.
- Frames are never sent past an unanswered ACK (a real USART holds one byte). On a tty, between
  a reply and the next frame only the reply's check runs: the loops send the next command first
  and run `done(i)` (counters, progress) while a long frame or reply is on the wire; `done` runs
  once per block that succeeded, in order, also for the block before a failure.
- `compare_blocks` sends nothing after a block that differs.
- With a `trace`, or a deadline longer than VTIME can express, the loops take the general path
  (one call per block through the Link's checked I/O) with the same results.
"""

from __future__ import annotations

import os
import termios
import time
from collections.abc import Callable, Sequence

from firmware_tools import an3155
from firmware_tools.an3155 import ACK, Command, ProtocolError
from firmware_tools.bootloader_errors import BootloaderError, NackError
from firmware_tools.link import Link
from firmware_tools.ttyfd import VTIME_MAX_S, deciseconds, write_all

__all__ = ["MemoryBlocks"]

_ACK_BYTE = bytes((ACK,))
_READ_COMMAND = an3155.encode_command(Command.READ_MEMORY)
_WRITE_COMMAND = an3155.encode_command(Command.WRITE_MEMORY)


class MemoryBlocks(Link):
    """Read Memory and Write Memory on a `Link`, one block or a stream of blocks."""

    def read_memory(self, address: int, length: int) -> bytes:
        what = f"READ_MEMORY at 0x{address:08X} ({length} bytes)"
        address_frame = an3155.encode_address(address)
        length_frame = an3155.encode_length(length)
        self._command(Command.READ_MEMORY, what)
        self._send(address_frame, what)
        self._ack_or_explain(what, "the address is outside readable memory")
        self._send(length_frame, what)
        self._ack(what, self.timeouts.read)
        return self._recv(length, self.timeouts.read, what)

    def write_memory(self, address: int, data: bytes) -> None:
        """Write ≤256 bytes at a 4-byte aligned address (padded with 0xFF); retried on NACK."""
        self.write_blocks(((address, data),))

    def write_blocks(
        self, blocks: Sequence[tuple[int, bytes]], done: Callable[[int], None] | None = None
    ) -> None:
        """Write Memory for each (address, ≤256 bytes) in order; a NACKed data stage is retried.

        Every frame is checked before the first byte goes out. The next block's command is sent
        as soon as a block's data is ACKed. `done(i)` (bookkeeping) runs once the next block's
        data frame is out -- while its ~256 bytes are on the wire and the chip programs them,
        not while a short reply is due -- and for the last block at the end.
        """
        frames = [_write_frames(address, data) for address, data in blocks]
        fd = self._fd if self.trace is None else None
        ack_t, write_t = self.timeouts.ack, self.timeouts.write
        ack_ds, write_ds = deciseconds(ack_t), deciseconds(write_t)
        if max(ack_t, write_t) > VTIME_MAX_S:
            fd = None
        i, attempt, sent, same, pending = 0, 0, False, ack_ds == write_ds, -1
        byte_s = self._byte_seconds()
        try:
            if fd is not None:
                self._set_vtime(ack_ds)
            while i < len(frames):
                address, address_frame, frame = frames[i]
                if fd is None:
                    self._write_block_slow(address, address_frame, frame, len(blocks[i][1]),
                                           attempt)
                else:
                    # Between a reply and the next frame: only the check of the reply.
                    if not sent:
                        write_all(fd, _WRITE_COMMAND)
                    if not same:
                        self._set_vtime(ack_ds)
                    got = os.read(fd, 1)
                    if got != _ACK_BYTE:
                        self._finish_ack(got, ack_t, _what_write(address, blocks[i][1]), "cmd")
                    if (k := os.write(fd, address_frame)) != 5:
                        write_all(fd, address_frame[k:])  # cut short by a signal (rare)
                    got = os.read(fd, 1)
                    if got != _ACK_BYTE:
                        self._finish_ack(got, ack_t, _what_write(address, blocks[i][1]), "addr")
                    if (k := os.write(fd, frame)) != len(frame):
                        write_all(fd, frame[k:])
                    t_sent = time.monotonic()
                    if not same:
                        self._set_vtime(write_ds)
                    self._wait_then(fd, t_sent + (len(frame) + 1) * byte_s, done, pending)
                    pending = -1
                    got = os.read(fd, 1)
                    if got != _ACK_BYTE:
                        try:
                            self._finish_ack(got, write_t, _what_write(address, blocks[i][1]))
                        except NackError as exc:
                            attempt = self._write_nacked(attempt, address, blocks[i][1], exc)
                            sent = False
                            continue
                    i += 1
                    sent = i < len(frames)
                    if sent and (k := os.write(fd, _WRITE_COMMAND)) != 2:
                        write_all(fd, _WRITE_COMMAND[k:])  # cut short by a signal (rare)
                    attempt, pending = 0, i - 1
                    continue
                i += 1
                attempt = 0
                if done is not None:
                    done(i - 1)
        except BootloaderError:
            raise
        except (OSError, termios.error) as exc:
            address, data = blocks[min(i, len(blocks) - 1)]
            raise self._link_error(_what_write(address, data), "talking", exc) from exc
        finally:
            if pending >= 0 and done is not None:
                done(pending)  # the last block, or the one before a failure

    def _write_block_slow(
        self, address: int, address_frame: bytes, frame: bytes, size: int, attempt: int
    ) -> None:
        what = f"WRITE_MEMORY at 0x{address:08X} ({size} bytes)"
        while True:
            self._command(Command.WRITE_MEMORY, what)
            self._send(address_frame, what)
            self._ack_or_explain(what, "the address is not writable")
            self._send(frame, what)
            try:
                self._ack(what, self.timeouts.write)
                return
            except NackError as exc:
                attempt = self._write_nacked(attempt, address, bytes(size), exc)

    def _write_nacked(self, attempt: int, address: int, data: bytes, exc: NackError) -> int:
        """Count a NACKed data stage; raise when the retries are used up."""
        if attempt >= self.write_retries:
            raise NackError(
                f"{_what_write(address, data)} on {self.name}: bootloader answered NACK (0x1F) "
                f"{attempt + 1} times. Hint: the flash there may be write-protected "
                "(Write Unprotect 0x73) or not erased; noise on the line also causes "
                "this — try a lower --baud."
            ) from exc
        return attempt + 1

    def compare_blocks(
        self, blocks: Sequence[tuple[int, bytes]], done: Callable[[int], None] | None = None
    ) -> tuple[int, bytes] | None:
        """Read Memory for each (address, expected bytes) and compare, in order.

        Returns (index, bytes read) of the first block that differs, None if all matched.
        After a block matched the next command is sent at once; `done(i)` runs once the next
        block's length frame is out (its ~257-byte reply is then on the wire), and for the last
        block at the end. Nothing is sent after a block that differs.
        """
        frames = [
            (an3155.encode_address(address), an3155.encode_length(len(expected)))
            for address, expected in blocks
        ]
        fd = self._fd if self.trace is None else None
        ack_t, read_t = self.timeouts.ack, self.timeouts.read
        ack_ds, read_ds = deciseconds(ack_t), deciseconds(read_t)
        if max(ack_t, read_t) > VTIME_MAX_S:
            fd = None
        i, sent, same, pending = 0, False, ack_ds == read_ds, -1
        byte_s = self._byte_seconds()
        try:
            if fd is not None:
                self._set_vtime(ack_ds)
            for i, (address, expected) in enumerate(blocks):
                if fd is None:
                    data = self.read_memory(address, len(expected))
                else:
                    # Between a reply and the next frame: only the check of the reply.
                    if not sent:
                        write_all(fd, _READ_COMMAND)
                    if not same:
                        self._set_vtime(ack_ds)
                    got = os.read(fd, 1)
                    if got != _ACK_BYTE:
                        self._finish_ack(got, ack_t, _what_read(address, expected), "cmd")
                    address_frame, length_frame = frames[i]
                    if (k := os.write(fd, address_frame)) != 5:
                        write_all(fd, address_frame[k:])  # cut short by a signal (rare)
                    got = os.read(fd, 1)
                    if got != _ACK_BYTE:
                        self._finish_ack(got, ack_t, _what_read(address, expected), "raddr")
                    if (k := os.write(fd, length_frame)) != 2:
                        write_all(fd, length_frame[k:])
                    t_sent = time.monotonic()
                    n = len(expected)
                    if not same:
                        self._set_vtime(read_ds)
                    self._wait_then(fd, t_sent + (n + 3) * byte_s, done, pending)
                    pending = -1
                    got = os.read(fd, n + 1)
                    if len(got) == n + 1 and got[0] == ACK:
                        data = got[1:]
                    else:
                        data = self._finish_read(got, n, read_t, _what_read(address, expected))
                if data != expected:
                    return i, data
                if fd is None:
                    if done is not None:
                        done(i)
                    continue
                sent = i + 1 < len(blocks)
                if sent and (k := os.write(fd, _READ_COMMAND)) != 2:
                    write_all(fd, _READ_COMMAND[k:])  # cut short by a signal (rare)
                pending = i
        except BootloaderError:
            raise
        except (OSError, termios.error) as exc:
            address, expected = blocks[i]
            raise self._link_error(_what_read(address, expected), "talking", exc) from exc
        finally:
            if pending >= 0 and done is not None:
                done(pending)  # the last block, or the one before a failure
        return None


def _what_write(address: int, data: bytes) -> str:
    return f"WRITE_MEMORY at 0x{address:08X} ({len(data)} bytes)"


def _what_read(address: int, expected: bytes) -> str:
    return f"READ_MEMORY at 0x{address:08X} ({len(expected)} bytes)"


def _write_frames(address: int, data: bytes) -> tuple[int, bytes, bytes]:
    """(address, address frame, data frame) of one Write Memory; raises on a bad request."""
    if address % 4:
        raise ProtocolError(
            f"{_what_write(address, data)}: address is not 4-byte aligned. "
            "Hint: the bootloader writes whole words; align the chunk."
        )
    frame = an3155.encode_write_data(data)  # validates the size
    return address, an3155.encode_address(address), frame
