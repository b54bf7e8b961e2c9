"""The byte link under the AN3155 client: frames out, replies in, ACKs checked, deadlines kept.

`Link` is the base of `firmware_tools.bootloader.Bootloader`; it holds the port and the tty fast
path, and knows nothing of flash layout. Its methods are the client's internals.

Invariants this module owns:
- Every wait has a deadline chosen per operation (`Timeouts`): a block write takes milliseconds,
  an F4 sector erase seconds, a mass erase tens of seconds. BUSY (0x76) bytes are skipped while
  the deadline runs.
- A NACK to the *command* of Read/Write/Erase/Go, when Get listed it, means readout protection:
  the error says so and names the remedy (Readout Unprotect 0x92 erases the whole flash).
- Errors name the operation, its address and size, and what came back; they end with a Hint.
- Each frame leaves in one write(). On a tty the fd is switched to blocking reads and the wait
  for a reply is one read() (VMIN=0, VTIME = the deadline, a tcsetattr only when it changes);
  `release()`/`close()` put the fd's flags and termios back. A read that returns nothing on a
  hung-up line is a LinkError, not a timeout.
- Paced wake-up: before a reply that cannot be complete for a while (its bytes at the port's
  baud rate), sleep until shortly before it can be, run the caller's bookkeeping, then read.
  A reply that comes sooner than the baud rate allows turns this off for the link
  (`link_paced`): a pty or USB CDC port is not paced.
- The `_finish_*` slow paths leave VTIME as they found it.
"""

from __future__ import annotations

import errno
import fcntl
import os
import select
import termios
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from firmware_tools import an3155
from firmware_tools.an3155 import ACK, BUSY, NACK, Command, GetInfo, ProtocolError, command_name
from firmware_tools.bootloader_errors import (
    CHECK_WIRING,
    BootloaderTimeout,
    LinkError,
    NackError,
    ReadoutProtectedError,
)
from firmware_tools.ttyfd import blocking_reads, deciseconds, posix_fd, write_all

__all__ = ["Link", "Timeouts"]

# A reply that cannot be complete before this many seconds (its bytes and the frame's at the
# port's baud rate) is waited for in two steps: a timed wait that ends when the reply's last
# byte could first be there, then the read. An idle CPU takes 0.1-0.3 ms to wake after such a
# long sleep; the second, short sleep wakes fast.
_PREWAKE_MIN_S = 0.002
_PREWAKE_LEAD_S = 0.0003


@dataclass(frozen=True)
class Timeouts:
    """Seconds to wait for each kind of answer."""

    ack: float = 1.0  # command, address and small replies
    sync: float = 0.5  # answer to 0x7F (per attempt)
    write: float = 1.0  # one Write Memory block (F4: ~16 us/word; F1: 70 us/half-word)
    sector_erase: float = 5.0  # per sector (F4 128 KiB sector: 2 s typical, 4 s max at x8)
    mass_erase: float = 40.0  # whole chip (F4 1 MiB: 8-16 s typical, 32 s max at x8)
    read: float = 1.0  # one Read Memory block


class Link:
    """A port for the AN3155 client. `trace(direction, bytes)` sees every byte on the wire.

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
        fd = posix_fd(port)
        if fd is not None:
            self._saved = blocking_reads(fd)
            if self._saved is not None:
                self._fd = fd

    # --- raw I/O ------------------------------------------------------------------------------

    def _send(self, data: bytes, what: str) -> None:
        if self.trace:
            self.trace("tx", data)
        try:
            if self._fd is not None:
                write_all(self._fd, data)
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
        self._set_vtime(deciseconds(timeout))
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
                f"Hint: {CHECK_WIRING}."
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
                    f"Hint: noise or a wrong baud rate/parity; {CHECK_WIRING}."
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

    # --- the tty fast path's waits and slow paths ---------------------------------------------

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
                f"Hint: {CHECK_WIRING}."
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
