"""Blocking AN3155 client over a pyserial port (any `serial.serial_for_url` URL, or a port object).

Invariants this module owns:
- Every wait has a deadline chosen per operation (`Timeouts`): a block write takes milliseconds,
  an F4 sector erase seconds, a mass erase tens of seconds. BUSY (0x76) bytes are skipped while
  the deadline runs.
- A NACK to the *command* of Read/Write/Erase/Go, when Get listed it, means readout protection:
  the error says so and names the remedy (Readout Unprotect 0x92 erases the whole flash).
- Only the Write Memory data stage is retried (NACK there means the frame was rejected, the chip
  is back waiting for a command); nothing else is retried silently.
- Errors name the operation, its address and size, and what came back; they end with a Hint.
- Frames are never sent past an unanswered ACK (a real USART holds one byte). Each frame leaves
  in one write(). On a tty the wait for a reply is one blocking read() (VMIN=0, VTIME = the
  deadline), and between a reply and the next frame only the reply's check runs: the block
  loops (`write_blocks`, `compare_blocks`) send the next command first and do bookkeeping
  (`done(i)`: counters, progress) while it is on the wire. A read that returns nothing on a
  hung-up line is a LinkError, not a timeout.
"""

from __future__ import annotations

import errno
import fcntl
import math
import os
import select
import termios
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from firmware_tools import an3155
from firmware_tools.an3155 import ACK, BUSY, NACK, Command, GetInfo, ProtocolError, command_name
from firmware_tools.errors import FirmwareError

__all__ = [
    "Bootloader",
    "BootloaderError",
    "BootloaderTimeout",
    "NackError",
    "ReadoutProtectedError",
    "ChipMismatchError",
    "LinkError",
    "Timeouts",
    "open_port",
]

_ACK_BYTE = bytes((ACK,))
_READ_COMMAND = an3155.encode_command(Command.READ_MEMORY)
_WRITE_COMMAND = an3155.encode_command(Command.WRITE_MEMORY)
_VTIME_MAX_S = 25.5  # the longest wait VTIME can express; longer ones take the general path
# A reply that cannot be complete before this many seconds (its bytes and the frame's at the
# port's baud rate) is waited for in two steps: a timed wait that ends when the reply's last
# byte could first be there, then the read. An idle CPU takes 0.1-0.3 ms to wake after such a
# long sleep; the second, short sleep wakes fast.
_PREWAKE_MIN_S = 0.002
_PREWAKE_LEAD_S = 0.0003
_CHECK_WIRING = (
    "check that BOOT0 is high and the chip was reset into its bootloader, that TX/RX are "
    "crossed, and the baud rate and parity (the bootloader uses 8E1)"
)


class BootloaderError(FirmwareError):
    """The bootloader did not do what was asked."""


class BootloaderTimeout(BootloaderError, TimeoutError):
    """No (complete) answer before the operation's deadline."""


class NackError(BootloaderError):
    """The bootloader answered NACK (0x1F)."""


class ReadoutProtectedError(NackError):
    """The chip refuses memory commands: flash readout protection is active."""


class ChipMismatchError(BootloaderError):
    """Get ID returned a chip id the board profile does not list."""


class LinkError(BootloaderError, OSError):
    """The port failed (unplugged adapter, closed pty, dropped link)."""


@dataclass(frozen=True)
class Timeouts:
    """Seconds to wait for each kind of answer."""

    ack: float = 1.0  # command, address and small replies
    sync: float = 0.5  # answer to 0x7F (per attempt)
    write: float = 1.0  # one Write Memory block (F4: ~16 us/word; F1: 70 us/half-word)
    sector_erase: float = 5.0  # per sector (F4 128 KiB sector: 2 s typical, 4 s max at x8)
    mass_erase: float = 40.0  # whole chip (F4 1 MiB: 8-16 s typical, 32 s max at x8)
    read: float = 1.0  # one Read Memory block


def _register_sim() -> None:
    from firmware_tools.urlhandler import register

    register()


def open_port(url: str, baud: int = 115200, parity: str = "E", timeout: float = 1.0) -> Any:
    """Open `url` with pyserial (8 data bits, `parity`, 1 stop bit); `stm32sim://` included."""
    import serial

    _register_sim()
    try:
        return serial.serial_for_url(
            url, baudrate=baud, parity=parity, bytesize=8, stopbits=1, timeout=timeout
        )
    except (serial.SerialException, ValueError, OSError) as exc:
        raise LinkError(
            f"opening serial port {url!r} at {baud} baud 8{parity}1 failed: {exc}. "
            "Hint: check the port name (`ls /dev/serial/by-id/`), that no other program holds "
            "it, and that you may open it (group `dialout`)."
        ) from exc


class Bootloader:
    """Talks AN3155 on an open port. `trace(direction, bytes)` sees every byte on the wire.

    On a POSIX tty the port's fd is switched to blocking reads with VMIN=0 and VTIME set to the
    wait (termios' own timer, 0.1 s steps): one read() per reply, no poll() before it. `close()`
    and `release()` put the fd's flags and termios back.
    """

    def __init__(
        self,
        port: Any,
        *,
        timeouts: Timeouts | None = None,
        write_retries: int = 3,
        trace: Callable[[str, bytes], None] | None = None,
        name: str | None = None,
    ) -> None:
        self.port = port
        self.timeouts = timeouts or Timeouts()
        self.write_retries = write_retries
        self.trace = trace
        self.name = name or str(getattr(port, "portstr", None) or getattr(port, "name", "port"))
        self.info: GetInfo | None = None
        self.already_synced = False
        self.chip_id: int | None = None
        self._timeout: float | None = None
        self._vtime = -1
        # True until a reply comes back sooner than the baud rate allows (a pty, a USB CDC
        # port): then long waits are no longer split for an early wake-up.
        self.link_paced = True
        self._saved: tuple[int, list[Any]] | None = None
        self._fd: int | None = None
        fd = _posix_fd(port)
        if fd is not None:
            self._saved = _blocking_reads(fd)
            if self._saved is not None:
                self._fd = fd

    # --- raw I/O ------------------------------------------------------------------------------

    def _send(self, data: bytes, what: str) -> None:
        if self.trace:
            self.trace("tx", data)
        try:
            if self._fd is not None:
                _write_all(self._fd, data)
            else:
                self.port.write(data)
        except Exception as exc:  # pyserial raises SerialException/OSError/portNotOpenError
            raise self._link_error(what, f"writing {len(data)} bytes", exc) from exc

    def _link_error(self, what: str, doing: str, exc: BaseException) -> LinkError:
        return LinkError(
            f"{what} on {self.name}: {doing} failed: {exc}. "
            "Hint: the link dropped; reconnect the adapter and rerun with --resume."
        )

    def _set_vtime(self, deciseconds: int) -> None:
        """VTIME (0.1 s units, 1..255) on the blocking tty; a tcsetattr only on a change."""
        if deciseconds != self._vtime:
            assert self._fd is not None
            attrs = termios.tcgetattr(self._fd)
            attrs[6][termios.VMIN] = 0
            attrs[6][termios.VTIME] = deciseconds
            termios.tcsetattr(self._fd, termios.TCSANOW, attrs)
            self._vtime = deciseconds

    def _read_some(self, n: int, timeout: float) -> bytes:
        """Up to `n` bytes: what has arrived, or b"" after `timeout` (tty fast path)."""
        assert self._fd is not None
        self._set_vtime(_deciseconds(timeout))
        return os.read(self._fd, n)

    def _check_hangup(self) -> None:
        """After a read returned nothing: tell a hung-up line (adapter unplugged, pty master
        closed: read() returns at once) from a wait that ran out."""
        assert self._fd is not None
        probe = select.poll()
        probe.register(self._fd, select.POLLIN)
        for _, events in probe.poll(0):
            if events & (select.POLLHUP | select.POLLERR | select.POLLNVAL):
                raise OSError(errno.EIO, "the line hung up (adapter unplugged or far end closed)")

    def _recv(self, n: int, timeout: float, what: str) -> bytes:
        deadline = time.monotonic() + timeout
        try:
            if self._fd is not None:
                buf = bytearray()
                while len(buf) < n:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    chunk = self._read_some(n - len(buf), left)
                    if not chunk:
                        self._check_hangup()
                    buf += chunk
            else:
                buf = self._read_port(n, timeout, deadline)
        except (Exception, termios.error) as exc:  # SerialException, OSError, PortNotOpenError
            raise self._link_error(what, "reading", exc) from exc
        if self.trace and buf:
            self.trace("rx", bytes(buf))
        if len(buf) < n:
            got = f"only {bytes(buf).hex(' ')}" if buf else "nothing"
            raise BootloaderTimeout(
                f"{what} on {self.name}: waited {timeout:g} s for {n} bytes, got {got}. "
                f"Hint: {_CHECK_WIRING}."
            )
        return bytes(buf)

    def _read_port(self, n: int, timeout: float, deadline: float) -> bytearray:
        if self._timeout != timeout:
            # Changing a port's timeout may cost a tcsetattr: only when the operation changes.
            self.port.timeout = timeout
            self._timeout = timeout
        buf = bytearray()
        while len(buf) < n:
            chunk = self.port.read(n - len(buf))
            buf += chunk
            if not chunk and time.monotonic() >= deadline:
                break
        return buf

    def _ack(self, what: str, timeout: float | None = None) -> None:
        timeout = timeout or self.timeouts.ack
        self._ack_slow(what, timeout, time.monotonic() + timeout, None)

    def _ack_slow(self, what: str, timeout: float, deadline: float, first: int | None) -> None:
        while True:
            if first is not None:
                byte, first = first, None
            else:
                byte = self._recv(1, timeout, what)[0]
            if byte == BUSY and time.monotonic() > deadline:
                raise BootloaderTimeout(
                    f"{what} on {self.name}: still BUSY (0x76) after {timeout:g} s. "
                    "Hint: raise the timeout for this operation or check the chip's supply."
                )
            if byte == ACK:
                return
            if byte == NACK:
                raise NackError(
                    f"{what} on {self.name}: bootloader answered NACK (0x1F). Hint: the chip "
                    "rejected the request: an address, size or sector this chip does not have "
                    "(check the board profile), or write protection (Write Unprotect 0x73)."
                )
            if byte != BUSY:
                raise ProtocolError(
                    f"{what} on {self.name}: expected ACK (0x79), got 0x{byte:02X}. "
                    f"Hint: noise or a wrong baud rate/parity; {_CHECK_WIRING}."
                )

    def _command(self, code: int, what: str) -> None:
        self._send(an3155.encode_command(code), what)
        self._command_ack(code, what)

    def _command_ack(self, code: int, what: str, first: int | None = None) -> None:
        """Wait for the ACK of command `code` (sent already; `first`: a reply byte read
        already); explain a NACK."""
        try:
            self._ack_from(what, first)
        except NackError as exc:
            protected = (
                Command.READ_MEMORY,
                Command.WRITE_MEMORY,
                Command.ERASE,
                Command.EXTENDED_ERASE,
                Command.GO,
            )
            if code in protected and self.info is not None and self.info.supports(code):
                raise ReadoutProtectedError(
                    f"{what} on {self.name}: the bootloader refused {command_name(code)} with "
                    "NACK although Get lists it: flash readout protection (RDP level 1) is "
                    "active. Hint: Readout Unprotect (0x92) removes it but MASS-ERASES the whole "
                    "flash (firmware and data are lost): `stm32flash -k PORT`, then flash again."
                ) from exc
            raise NackError(
                f"{what} on {self.name}: bootloader answered NACK (0x1F) to the command byte. "
                "Hint: this bootloader does not offer the command in this state; reset the chip "
                "into its bootloader and retry."
            ) from exc

    # --- commands -----------------------------------------------------------------------------

    def sync(self) -> None:
        """Send 0x7F; ACK means synced, NACK means the chip was synced already (also fine)."""
        try:
            self.port.reset_input_buffer()
        except Exception:  # noqa: BLE001 - not every port object has a buffer to flush
            pass
        for attempt in range(2):
            self._send(bytes((an3155.SYNC,)), "sync (0x7F)")
            try:
                byte = self._recv(1, self.timeouts.sync, "sync (0x7F)")[0]
            except BootloaderTimeout:
                if attempt == 0:
                    # The chip may have taken our 0x7F as the first byte of a command frame:
                    # a second one completes a bad frame, answered by NACK.
                    continue
                raise BootloaderTimeout(
                    f"sync (0x7F) on {self.name}: no answer to two sync bytes within "
                    f"{self.timeouts.sync:g} s each. Hint: {_CHECK_WIRING}."
                ) from None
            if byte == ACK:
                self.already_synced = False
                return
            if byte == NACK:
                self.already_synced = True
                return
            raise ProtocolError(
                f"sync (0x7F) on {self.name}: expected ACK (0x79) or NACK (0x1F), got "
                f"0x{byte:02X}. Hint: the application may be running instead of the "
                f"bootloader, or {_CHECK_WIRING}."
            )

    def get(self) -> GetInfo:
        what = "GET (0x00)"
        self._command(Command.GET, what)
        head = self._recv(1, self.timeouts.ack, what)
        body = self._recv(head[0] + 1, self.timeouts.ack, what)
        self._ack(what)
        self.info = an3155.parse_get(head + body)
        return self.info

    def get_version(self) -> an3155.VersionInfo:
        what = "GET_VERSION (0x01)"
        self._command(Command.GET_VERSION, what)
        payload = self._recv(3, self.timeouts.ack, what)
        self._ack(what)
        return an3155.parse_get_version(payload)

    def get_id(self) -> int:
        what = "GET_ID (0x02)"
        self._command(Command.GET_ID, what)
        head = self._recv(1, self.timeouts.ack, what)
        body = self._recv(head[0] + 1, self.timeouts.ack, what)
        self._ack(what)
        self.chip_id = an3155.parse_get_id(head + body)
        return self.chip_id

    def check_chip(self, expected: Sequence[int], board: str) -> int:
        """Get ID and compare with the profile's ids; ChipMismatchError lists them."""
        pid = self.get_id()
        if pid not in expected:
            ids = ", ".join(f"0x{i:03X}" for i in expected)
            raise ChipMismatchError(
                f"GET_ID (0x02) on {self.name}: chip id is 0x{pid:03X}, but board profile "
                f"{board!r} expects {ids}. Hint: pick the profile for this chip with --board, "
                "or check that the port reaches the intended MCU."
            )
        return pid

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
        ack_ds, write_ds = _deciseconds(ack_t), _deciseconds(write_t)
        if max(ack_t, write_t) > _VTIME_MAX_S:
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
                        _write_all(fd, _WRITE_COMMAND)
                    if not same:
                        self._set_vtime(ack_ds)
                    got = os.read(fd, 1)
                    if got != _ACK_BYTE:
                        self._finish_ack(got, ack_t, _what_write(address, blocks[i][1]), "cmd")
                    if (k := os.write(fd, address_frame)) != 5:
                        _write_all(fd, address_frame[k:])  # cut short by a signal (rare)
                    got = os.read(fd, 1)
                    if got != _ACK_BYTE:
                        self._finish_ack(got, ack_t, _what_write(address, blocks[i][1]), "addr")
                    if (k := os.write(fd, frame)) != len(frame):
                        _write_all(fd, frame[k:])
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
                        _write_all(fd, _WRITE_COMMAND[k:])  # cut short by a signal (rare)
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
        ack_ds, read_ds = _deciseconds(ack_t), _deciseconds(read_t)
        if max(ack_t, read_t) > _VTIME_MAX_S:
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
                        _write_all(fd, _READ_COMMAND)
                    if not same:
                        self._set_vtime(ack_ds)
                    got = os.read(fd, 1)
                    if got != _ACK_BYTE:
                        self._finish_ack(got, ack_t, _what_read(address, expected), "cmd")
                    address_frame, length_frame = frames[i]
                    if (k := os.write(fd, address_frame)) != 5:
                        _write_all(fd, address_frame[k:])  # cut short by a signal (rare)
                    got = os.read(fd, 1)
                    if got != _ACK_BYTE:
                        self._finish_ack(got, ack_t, _what_read(address, expected), "raddr")
                    if (k := os.write(fd, length_frame)) != 2:
                        _write_all(fd, length_frame[k:])
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
                    _write_all(fd, _READ_COMMAND[k:])  # cut short by a signal (rare)
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

    def _byte_seconds(self) -> float:
        """Wire time of one byte at the port's baud rate (start, 8 data, stop bits), 0 if the
        port does not say."""
        baud = getattr(self.port, "baudrate", None)
        return 10.0 / baud if isinstance(baud, int) and baud > 0 else 0.0

    def _wait_then(
        self, fd: int, ready: float, done: Callable[[int], None] | None, pending: int
    ) -> None:
        """Before the read of a reply that cannot be complete before `ready`: if that is far
        enough away (`_PREWAKE_MIN_S`), sleep until shortly before it (or until bytes arrive);
        then run `done(pending)` (bookkeeping: off the CPU while the chip takes the frame).
        A reply that comes early shows a link faster than its baud rate (a pty, a USB CDC
        port): no more early wake-ups on it."""
        left = ready - _PREWAKE_LEAD_S - time.monotonic()
        if left > _PREWAKE_MIN_S and self.link_paced:
            early, _, _ = select.select((fd,), (), (), left)
            if early and ready - time.monotonic() > _PREWAKE_MIN_S:
                self.link_paced = False
        if pending >= 0 and done is not None:
            done(pending)

    def _finish_ack(self, got: bytes, timeout: float, what: str, stage: str = "") -> None:
        """The fast path read `got` (b"" when VTIME ran out) instead of a plain ACK: skip BUSY,
        explain NACK as the stage (`cmd`, `addr`, `raddr` or the data stage) would, raise.
        VTIME is as before when it returns."""
        vtime = self._vtime
        self._finish_ack_stage(got, timeout, what, stage)
        if self._fd is not None:
            self._set_vtime(vtime)

    def _finish_ack_stage(self, got: bytes, timeout: float, what: str, stage: str) -> None:
        if not got:
            try:
                self._check_hangup()
            except OSError as exc:
                raise self._link_error(what, "reading", exc) from exc
            raise BootloaderTimeout(
                f"{what} on {self.name}: waited {timeout:g} s for 1 bytes, got nothing. "
                f"Hint: {_CHECK_WIRING}."
            )
        deadline = time.monotonic() + timeout
        if stage == "cmd":
            code = Command.WRITE_MEMORY if what.startswith("WRITE") else Command.READ_MEMORY
            self._command_ack(code, what, got[0])
        elif stage:
            reason = "the address is not writable" if stage == "addr" else (
                "the address is outside readable memory")
            self._ack_or_explain(what, reason, got[0])
        else:
            self._ack_slow(what, timeout, deadline, got[0])

    def _finish_read(self, got: bytes, n: int, timeout: float, what: str) -> bytes:
        """The rest of an ACK + `n` data bytes reply of which the fast path read `got`;
        VTIME is as before when it returns."""
        vtime = self._vtime
        data = self._finish_read_stage(got, n, timeout, what)
        if self._fd is not None:
            self._set_vtime(vtime)
        return data

    def _finish_read_stage(self, got: bytes, n: int, timeout: float, what: str) -> bytes:
        if not got:
            self._finish_ack(got, timeout, what)  # raises: timeout or hung-up line
        k = 0
        while k < len(got) and got[k] == BUSY:
            k += 1
        deadline = time.monotonic() + timeout
        if k < len(got):
            if got[k] != ACK:
                self._ack_slow(what, timeout, deadline, got[k])  # raises: NACK or garbage
            data = got[k + 1 :]
        else:
            self._ack_slow(what, timeout, deadline, None)
            data = b""
        if len(data) < n:
            data += self._recv(n - len(data), timeout, what)
        return data

    def erase(self, pages: Sequence[int], erase_command: int | None = None) -> None:
        """Erase the given pages/sectors with 0x44 or 0x43, whichever Get listed.

        Split into commands of at most 255 pages (0x43's one-byte count) or 512 (0x44; some
        chips, e.g. the STM32L1, refuse more in one command)."""
        code = erase_command if erase_command is not None else self.erase_command()
        group = 512 if code == Command.EXTENDED_ERASE else 255
        for at in range(0, len(pages), group):
            part = list(pages[at : at + group])
            what = f"{command_name(code)} of sectors {_ranges(part)}"
            self._command(code, what)
            if code == Command.EXTENDED_ERASE:
                frame = an3155.encode_extended_erase(part)
            else:
                frame = an3155.encode_erase(part)
            self._send(frame, what)
            self._ack(what, self.timeouts.sector_erase * len(part))

    def mass_erase(self) -> None:
        code = self.erase_command()
        what = f"{command_name(code)} (mass erase)"
        self._command(code, what)
        if code == Command.EXTENDED_ERASE:
            self._send(an3155.encode_extended_erase_special(an3155.EXTENDED_ERASE_MASS), what)
        else:
            self._send(an3155.encode_erase_global(), what)
        self._ack(what, self.timeouts.mass_erase)

    def go(self, address: int) -> None:
        what = f"GO to 0x{address:08X}"
        self._command(Command.GO, what)
        self._send(an3155.encode_address(address), what)
        self._ack_or_explain(what, "the address is not a valid jump target")

    def readout_unprotect(self) -> None:
        """Remove readout protection. THIS MASS-ERASES THE FLASH; the chip then resets."""
        what = "READOUT_UNPROTECT (0x92)"
        self._command(Command.READOUT_UNPROTECT, what)
        self._ack(what, self.timeouts.mass_erase)

    def release(self) -> None:
        """Put the tty's fd flags and termios back as pyserial set them (for a port that stays
        open after this Bootloader); later calls use pyserial's own reads."""
        if self._saved is not None and self._fd is not None:
            flags, attrs = self._saved
            try:
                termios.tcsetattr(self._fd, termios.TCSANOW, attrs)
                fcntl.fcntl(self._fd, fcntl.F_SETFL, flags)
            except (OSError, termios.error):
                pass  # a dead link: nothing left to give back
        self._saved = None
        self._fd = None

    def close(self) -> None:
        self.release()
        try:
            self.port.close()
        except Exception:  # noqa: BLE001 - closing a dead link must not mask the real error
            pass

    # --- helpers ------------------------------------------------------------------------------

    def erase_command(self) -> int:
        """0x44 or 0x43, whichever Get listed (runs Get if it has not run)."""
        if self.info is None:
            self.get()
        assert self.info is not None
        return an3155.erase_command_of(self.info)

    def _ack_from(self, what: str, first: int | None) -> None:
        timeout = self.timeouts.ack
        self._ack_slow(what, timeout, time.monotonic() + timeout, first)

    def _ack_or_explain(self, what: str, reason: str, first: int | None = None) -> None:
        try:
            self._ack_from(what, first)
        except NackError as exc:
            raise NackError(
                f"{what} on {self.name}: bootloader answered NACK (0x1F) to the address: "
                f"{reason}. Hint: check the board profile's memory map against the chip."
            ) from exc


def _posix_fd(port: Any) -> int | None:
    """The file descriptor of a pyserial POSIX port (a tty or pty), else None."""
    try:
        from serial.serialposix import Serial as PosixSerial
    except ImportError:  # pragma: no cover - not on POSIX
        return None
    if isinstance(port, PosixSerial) and port.is_open and port.fd is not None:
        return int(port.fd)
    return None


def _blocking_reads(fd: int) -> tuple[int, list[Any]] | None:
    """Clear O_NONBLOCK on a tty (VMIN/VTIME are set per wait); returns what to restore, or
    None if the fd refuses (then pyserial's reads are used)."""
    try:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        attrs = termios.tcgetattr(fd)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_NONBLOCK)
    except (OSError, termios.error):
        return None
    return flags, attrs


def _deciseconds(seconds: float) -> int:
    """A wait as VTIME: 0.1 s steps, rounded up, within 1..255."""
    return max(1, min(255, math.ceil(seconds * 10 - 1e-9)))


def _write_all(fd: int, data: bytes) -> None:
    """All of `data` to a blocking fd (one write() unless a signal cuts it short)."""
    n = os.write(fd, data)
    while n < len(data):
        n += os.write(fd, memoryview(data)[n:])


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


def _ranges(pages: Sequence[int]) -> str:
    """`0-3,5` for [0, 1, 2, 3, 5]."""
    out: list[str] = []
    start = prev = None
    for page in list(pages) + [None]:  # type: ignore[list-item]
        if start is not None and (page is None or page != prev + 1):  # type: ignore[operator]
            out.append(str(start) if start == prev else f"{start}-{prev}")
            start = None
        if page is not None and start is None:
            start = page
        prev = page
    return ",".join(out)
