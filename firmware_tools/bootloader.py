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
"""

from __future__ import annotations

import os
import select
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
    """Talks AN3155 on an open port. `trace(direction, bytes)` sees every byte on the wire."""

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
        self._fd = _posix_fd(port)
        if self._fd is not None:
            self._poll = select.poll()
            self._poll.register(self._fd, select.POLLIN)

    # --- raw I/O ------------------------------------------------------------------------------

    def _send(self, data: bytes, what: str) -> None:
        if self.trace:
            self.trace("tx", data)
        try:
            if self._fd is not None:
                _write_fd(self._fd, data)
            else:
                self.port.write(data)
        except Exception as exc:  # pyserial raises SerialException/OSError/portNotOpenError
            raise LinkError(
                f"{what} on {self.name}: writing {len(data)} bytes failed: {exc}. "
                "Hint: the link dropped; reconnect the adapter and rerun with --resume."
            ) from exc

    def _send_first(self, data: bytes) -> bool:
        """Send a command frame before its error text is built: True if it went out whole on
        the tty fast path; False (nothing sent) means call `_send`, which explains failures."""
        if self._fd is None or self.trace is not None:
            return False
        try:
            n = os.write(self._fd, data)
            if n < len(data):
                _write_fd(self._fd, data[n:])
        except OSError:
            return False  # EAGAIN or a dead link: `_send` retries and words the error
        return True

    def _recv(self, n: int, timeout: float, what: str) -> bytes:
        deadline = time.monotonic() + timeout
        try:
            if self._fd is not None:
                buf = self._read_fd(n, deadline)
            else:
                buf = self._read_port(n, timeout, deadline)
        except Exception as exc:  # pyserial: SerialException, OSError, PortNotOpenError
            raise LinkError(
                f"{what} on {self.name}: reading failed: {exc}. "
                "Hint: the link dropped; reconnect and rerun with --resume."
            ) from exc
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

    def _read_fd(self, n: int, deadline: float) -> bytearray:
        """Direct reads on a POSIX tty (pyserial opened it O_NONBLOCK): one poll + one read per
        chunk, instead of pyserial's select on an abort pipe around every call."""
        assert self._fd is not None
        buf = bytearray()
        while len(buf) < n:
            left = deadline - time.monotonic()
            if left <= 0 or not self._poll.poll(left * 1000):
                break
            try:
                chunk = os.read(self._fd, n - len(buf))
            except BlockingIOError:
                continue
            if not chunk:
                raise OSError("device reports readiness to read but returned no data "
                              "(disconnected?)")
            buf += chunk
        return buf

    def _ack(self, what: str, timeout: float | None = None) -> None:
        timeout = timeout or self.timeouts.ack
        deadline = time.monotonic() + timeout
        first: int | None = None
        if self._fd is not None and self.trace is None:
            # Hot path (three times per block of a flash job): one poll, one one-byte read.
            # Anything but a plain ACK goes on to the general loop below.
            try:
                if self._poll.poll(timeout * 1000):
                    got = os.read(self._fd, 1)
                    if got == _ACK_BYTE:
                        return
                    if got:
                        first = got[0]
            except BlockingIOError:
                pass
            except OSError as exc:
                raise LinkError(
                    f"{what} on {self.name}: reading failed: {exc}. "
                    "Hint: the link dropped; reconnect and rerun with --resume."
                ) from exc
        self._ack_slow(what, timeout, deadline, first)

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

    def _command_ack(self, code: int, what: str) -> None:
        """Wait for the ACK of command `code` (sent already); explain a NACK."""
        try:
            self._ack(what)
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
        # Frames are ready before each ACK arrives: only a write separates an ACK from the next.
        if not (0 <= address <= 0xFFFFFFFF and 1 <= length <= an3155.MAX_TRANSFER):
            an3155.encode_address(address)  # raise the encoder's error
            an3155.encode_length(length)
        sent = self._send_first(_READ_COMMAND)
        # The error text and the frames are built while the command's ACK is on its way.
        what = f"READ_MEMORY at 0x{address:08X} ({length} bytes)"
        address_frame = an3155.encode_address(address)
        length_frame = an3155.encode_length(length)
        if not sent:
            self._send(_READ_COMMAND, what)
        self._command_ack(Command.READ_MEMORY, what)
        self._send(address_frame, what)
        self._ack_or_explain(what, "the address is outside readable memory")
        self._send(length_frame, what)
        return self._ack_then(length, self.timeouts.read, what)

    def _ack_then(self, n: int, timeout: float, what: str) -> bytes:
        """ACK, then `n` bytes (Read Memory's data stage). On a tty, one read takes both when
        the whole reply has arrived; BUSY bytes before the ACK are skipped, NACK raises."""
        if self._fd is None or self.trace is not None:
            self._ack(what, timeout)
            return self._recv(n, timeout, what)
        deadline = time.monotonic() + timeout
        try:
            got = os.read(self._fd, n + 1) if self._poll.poll(timeout * 1000) else b""
        except BlockingIOError:
            got = b""
        except OSError as exc:
            raise LinkError(
                f"{what} on {self.name}: reading failed: {exc}. "
                "Hint: the link dropped; reconnect and rerun with --resume."
            ) from exc
        if len(got) == n + 1 and got[0] == ACK:
            return got[1:]
        k = 0
        while k < len(got) and got[k] == BUSY:
            k += 1
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

    def write_memory(self, address: int, data: bytes) -> None:
        """Write ≤256 bytes at a 4-byte aligned address (padded with 0xFF); retried on NACK."""
        valid = 1 <= len(data) <= an3155.MAX_TRANSFER and 0 <= address <= 0xFFFFFFFF
        sent = not address % 4 and valid and self._send_first(_WRITE_COMMAND)
        # The error text and the frames are built while the command's ACK is on its way.
        what = f"WRITE_MEMORY at 0x{address:08X} ({len(data)} bytes)"
        if address % 4:
            raise ProtocolError(
                f"{what}: address is not 4-byte aligned. "
                "Hint: the bootloader writes whole words; align the chunk."
            )
        frame = an3155.encode_write_data(data)  # validates the size
        address_frame = an3155.encode_address(address)
        for attempt in range(self.write_retries + 1):
            if not sent:
                self._send(_WRITE_COMMAND, what)
            sent = False
            self._command_ack(Command.WRITE_MEMORY, what)
            self._send(address_frame, what)
            self._ack_or_explain(what, "the address is not writable")
            self._send(frame, what)
            try:
                self._ack(what, self.timeouts.write)
                return
            except NackError as exc:
                if attempt == self.write_retries:
                    raise NackError(
                        f"{what} on {self.name}: bootloader answered NACK (0x1F) "
                        f"{attempt + 1} times. Hint: the flash there may be write-protected "
                        "(Write Unprotect 0x73) or not erased; noise on the line also causes "
                        "this — try a lower --baud."
                    ) from exc

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

    def close(self) -> None:
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

    def _ack_or_explain(self, what: str, reason: str) -> None:
        try:
            self._ack(what)
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


def _write_fd(fd: int, data: bytes) -> None:
    """All of `data` to a non-blocking fd: one write() in the usual case."""
    try:
        n = os.write(fd, data)
    except BlockingIOError:
        n = 0
    if n == len(data):
        return
    view = memoryview(data)[n:]
    while view:
        try:
            n = os.write(fd, view)
        except BlockingIOError:
            select.select([], [fd], [], 1.0)
            continue
        view = view[n:]


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
