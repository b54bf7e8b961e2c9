"""Blocking AN3155 client over a pyserial port (any `serial.serial_for_url` URL, or a port object).

The client is built in layers, each module owning its invariants:
- `firmware_tools.bootloader_errors`: the errors (re-exported here);
- `firmware_tools.ttyfd`: the tty fast path's fd/termios primitives;
- `firmware_tools.link`: `Link` (frames out, replies in, ACK checks, deadlines, `Timeouts`,
  the paced early wake-up, `release()`);
- `firmware_tools.blocks`: `MemoryBlocks` (Read/Write Memory and the streamed block loops);
- this module: `Bootloader` (sync, Get, Get ID, erase, Go, Readout Unprotect) and `open_port`.
Callers import from here only: the names in `__all__` are the client's public surface.

Invariants this module owns:
- Sync tries 0x7F twice (a first 0x7F may have been taken as a command's first byte); ACK means
  synced, NACK means the chip was synced already (`already_synced`), anything else is an error.
- Erase commands carry at most 255 pages (0x43's one-byte count) or 512 (0x44), each with a
  deadline of the per-sector time times its page count; mass erase gets `Timeouts.mass_erase`.
- `check_chip` runs Get ID and raises ChipMismatchError naming the ids the profile expects.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from firmware_tools import an3155
from firmware_tools.an3155 import ACK, NACK, Command, GetInfo, ProtocolError, command_name
from firmware_tools.blocks import MemoryBlocks
from firmware_tools.bootloader_errors import (
    CHECK_WIRING,
    BootloaderError,
    BootloaderTimeout,
    ChipMismatchError,
    LinkError,
    NackError,
    ReadoutProtectedError,
)
from firmware_tools.errors import FirmwareError
from firmware_tools.link import Timeouts

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

def _register_sim() -> None:
    from firmware_tools.urlhandler import register

    register()


def open_port(url: str, baud: int = 115200, parity: str = "E", timeout: float = 1.0,
              levels: Mapping[str, bool] | None = None) -> Any:
    """Open `url` with pyserial (8 data bits, `parity`, 1 stop bit); `stm32sim://` included.
    `levels` sets `dtr`/`rts` before the open (pyserial asserts both otherwise)."""
    import serial

    _register_sim()
    try:
        # exclusive: a tty held by another program (the daemon's UART console, another
        # flasher) is refused here instead of two talkers corrupting each other's bytes
        port = serial.serial_for_url(
            url, baudrate=baud, parity=parity, bytesize=8, stopbits=1, timeout=timeout,
            exclusive=True, do_not_open=True,
        )
        for line, level in (levels or {}).items():
            setattr(port, line, level)
        port.open()
        return port
    except (serial.SerialException, ValueError, OSError) as exc:
        if "exclusively lock" in str(exc):
            raise LinkError(
                f"serial port {url!r} is held by another program (it has the port's exclusive "
                "lock). Hint: find it with `fuser -v` on the port; if it is the edge-agent "
                "daemon (serial.port or flash.ports), run the flash without --local so the "
                "daemon does it, or stop the daemon first."
            ) from exc
        if isinstance(exc.__cause__, FirmwareError):  # the simulator's errors carry their hint
            raise LinkError(f"opening serial port {url!r} failed: {exc}") from exc
        raise LinkError(
            f"opening serial port {url!r} at {baud} baud 8{parity}1 failed: {exc}. "
            "Hint: check the port name (`ls /dev/serial/by-id/`), that no other program holds "
            "it, and that you may open it (group `dialout`)."
        ) from exc


class Bootloader(MemoryBlocks):
    """Talks AN3155 on an open port. `trace(direction, bytes)` sees every byte on the wire.

    On a POSIX tty the port's fd is switched to blocking reads with VMIN=0 and VTIME set to the
    wait (termios' own timer, 0.1 s steps): one read() per reply, no poll() before it. `close()`
    and `release()` put the fd's flags and termios back.
    """

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
                    f"{self.timeouts.sync:g} s each. Hint: {CHECK_WIRING}."
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
                f"bootloader, or {CHECK_WIRING}."
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

    # --- helpers ------------------------------------------------------------------------------

    def erase_command(self) -> int:
        """0x44 or 0x43, whichever Get listed (runs Get if it has not run)."""
        if self.info is None:
            self.get()
        assert self.info is not None
        return an3155.erase_command_of(self.info)


def _ranges(pages: Sequence[int]) -> str:
    """`0-3,5` for [0, 1, 2, 3, 5]."""
    runs: list[tuple[int, int]] = []  # (first, last)
    for page in pages:
        if runs and page == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], page)
        else:
            runs.append((page, page))
    return ",".join(str(first) if first == last else f"{first}-{last}" for first, last in runs)
