"""An STM32 ROM bootloader (AN3155) board simulator: bytes from the host in, bytes back out.

Usable three ways: as a pyserial URL (`stm32sim://?chip=f405&nack=0x31`, see
`firmware_tools.urlhandler.protocol_stm32sim`; importing this module registers the scheme),
served on a real pty or TCP port for other tools (`python -m firmware_tools.simulator --pty`),
or driven directly (`Stm32Simulator.receive(data, now)` / `take_output(now)`).

Invariants this module owns (those of the silicon it imitates):
- Nothing is answered before the first 0x7F; after sync a lone 0x7F is answered with NACK.
- Get lists exactly the chip's commands with the exact length byte (F4 v3.1: 0x44, not 0x43).
- Programming flash only clears bits: stored = old & data. Only erase sets bytes back to 0xFF.
- Writes into the RAM the bootloader reserves, or outside RAM/flash, are NACKed.
- With readout protection on, Read/Write/Erase/Go are NACKed at the command byte; Readout
  Unprotect (0x92) mass-erases the flash, clears the protection and resets the chip.
- Time is a parameter: each reply carries the time it becomes readable (erase takes time).

Chips and fault knobs (URL query or `Faults.parse`): see `sim_board.py`.
"""

from __future__ import annotations

import atexit
import os
from collections import deque
from collections.abc import Generator, Mapping
from pathlib import Path

from firmware_tools import an3155
from firmware_tools.an3155 import ACK, BUSY, NACK, SYNC, Command, ProtocolError
from firmware_tools.sim_board import (
    CHIPS,
    Faults,
    SimChip,
    SimulatorError,
    Wiring,
    chip_from_profile,
)

__all__ = [
    "CHIPS",
    "Faults",
    "SimChip",
    "SimulatorError",
    "Stm32Simulator",
    "Wiring",
    "chip_from_profile",
    "simulator_from_query",
]


class _Reset(Exception):
    """The simulated chip resets (after Readout (Un)Protect, Write Unprotect)."""


class Stm32Simulator:
    """The board: feed it host bytes with `receive`, collect its replies with `take_output`."""

    def __init__(
        self,
        chip: SimChip,
        faults: Faults | None = None,
        state: str | os.PathLike[str] | None = None,
        wiring: Wiring | None = None,
    ) -> None:
        self.chip = chip
        self.wiring = wiring
        self.faults = faults or Faults()
        self.rdp = self.faults.rdp
        self.state_path = Path(state) if state else None
        size = chip.flash_size
        self.flash = bytearray(b"\xff" * size)
        if self.state_path is not None:
            if self.state_path.exists():
                data = self.state_path.read_bytes()
                self.flash[: min(size, len(data))] = data[:size]
            self._persist(0, size)
        self.ram = {start: bytearray(length) for start, length in chip.ram}
        starts, at = [], chip.flash_start
        for s in chip.sector_sizes:
            starts.append(at)
            at += s
        self.sector_starts = tuple(starts)
        self.received = 0
        self.sent = 0
        self.dropped = False
        self.running_at: int | None = None  # set by Go
        self.synced = False
        self.log: list[str] = []
        self._out: deque[tuple[float, bytes]] = deque()
        self._clock = 0.0
        self._rx_free = 0.0
        self._byte_time = 10.0 / self.faults.baud if self.faults.baud else 0.0
        self._need = 1
        self._inbuf = bytearray()
        # Pins: with modem-line wiring the board powers up as a board does (BOOT0 pulled low:
        # the application in flash runs, the bootloader is not listening) until the host
        # drives NRST and BOOT0; without it, in the bootloader (a board someone reset into it)
        self.in_reset = False
        self._lines = {"dtr": False, "rts": False}
        self._prog = self._program()
        self._need = next(self._prog)
        if wiring is not None:
            self._restart(bootloader=False)
        # Instrumentation (timeline knob): (direction, monotonic time, bytes) per chunk.
        self.timeline: list[tuple[str, float, int]] | None = None
        if self.faults.timeline:
            self.timeline = []
            atexit.register(self.write_timeline, self.faults.timeline)

    # --- byte seam ----------------------------------------------------------------------------

    def receive(self, data: bytes, now: float = 0.0) -> None:
        """Bytes from the host arriving at time `now`."""
        if self.dropped or self.in_reset:
            return
        if self.timeline is not None:
            self.timeline.append(("rx", now, len(data)))
        if self.faults.drop_after is not None:
            room = self.faults.drop_after - self.received
            if len(data) >= room:
                data = data[: max(room, 0)]
                self.dropped = True
        self.received += len(data)
        if self._byte_time:
            # The host's bytes arrive one after the other on the wire.
            self._rx_free = max(now, self._rx_free) + len(data) * self._byte_time
            now = self._rx_free
        self._clock = max(self._clock, now)
        self._inbuf += data
        while len(self._inbuf) >= self._need:
            chunk = bytes(self._inbuf[: self._need])
            del self._inbuf[: self._need]
            self._need = self._prog.send(chunk)
        if self.dropped:
            self._out.clear()

    def take_output(self, now: float, limit: int | None = None) -> bytes:
        """Reply bytes readable at `now` (at most `limit`)."""
        out = bytearray()
        while self._out and self._out[0][0] <= now and (limit is None or len(out) < limit):
            ready, data = self._out.popleft()
            if limit is not None and len(out) + len(data) > limit:
                cut = limit - len(out)
                self._out.appendleft((ready, data[cut:]))
                data = data[:cut]
            out += data
        self.sent += len(out)
        if out and self.timeline is not None:
            self.timeline.append(("tx", now, len(out)))
        return bytes(out)

    def write_timeline(self, path: str | os.PathLike[str]) -> None:
        """Write the timeline (timeline knob) as `rx|tx<TAB>seconds<TAB>bytes` lines."""
        if self.timeline is None:
            return
        with open(path, "w", encoding="ascii") as fh:
            fh.writelines(f"{d}\t{t:.9f}\t{n}\n" for d, t, n in self.timeline)

    # --- pins ---------------------------------------------------------------------------------

    def modem_line(self, line: str, asserted: bool) -> None:
        """The host set its `line` ('dtr' or 'rts'; asserted is pyserial's True). Through the
        wiring it drives NRST or BOOT0; unwired lines go nowhere."""
        self._lines[line] = asserted
        w = self.wiring
        if w is None:
            return
        nrst_low = self._lines[w.reset] != w.reset_invert
        boot0_high = self._lines[w.boot0] != w.boot0_invert
        if nrst_low:
            if not self.in_reset:
                self.log.append("RESET")
            self.in_reset = True
            self._out.clear()
        elif self.in_reset:
            self.in_reset = False  # BOOT0 is sampled as NRST rises
            self._restart(bootloader=boot0_high)

    def _restart(self, *, bootloader: bool) -> None:
        self._out.clear()
        self._inbuf.clear()
        self.synced = False
        self.running_at = None if bootloader else self.chip.flash_start
        self.log.append("BOOT bootloader" if bootloader else "BOOT application")
        self._prog = self._program() if bootloader else self._application()
        self._need = next(self._prog)

    def _application(self) -> Generator[int, bytes, None]:
        while True:  # the image in flash runs; it does not speak AN3155
            yield 1

    def next_ready(self) -> float | None:
        return self._out[0][0] if self._out else None

    def ready_count(self, now: float) -> int:
        return sum(len(d) for t, d in self._out if t <= now)

    def clear_output(self) -> None:
        self._out.clear()

    def _emit(self, data: bytes | int, delay: float = 0.0) -> None:
        raw = bytes((data,)) if isinstance(data, int) else data
        self._clock += delay + len(raw) * self._byte_time
        self._out.append((self._clock, raw))

    # --- the ROM program ----------------------------------------------------------------------

    def _program(self) -> Generator[int, bytes, None]:
        while True:
            try:
                yield from self._session()
            except _Reset:
                self.synced = False
                self._inbuf.clear()

    def _session(self) -> Generator[int, bytes, None]:
        while True:  # auto-baud: everything but 0x7F is ignored
            b = (yield 1)[0]
            if b == SYNC and SYNC not in self.faults.silence:
                self._emit(ACK)
                self.synced = True
                break
        while True:
            first = (yield 1)[0]
            if first == SYNC:
                self._emit(NACK)  # already synced
                continue
            second = (yield 1)[0]
            if first ^ second != 0xFF:
                self._emit(NACK)
                continue
            code = first
            self.log.append(an3155.command_name(code))
            if code in self.faults.silence:
                continue
            if code in self.faults.garbage:
                self._emit(0xA5)
                continue
            if code not in self.chip.commands:
                self._emit(NACK)
                continue
            protected = (Command.READ_MEMORY, Command.WRITE_MEMORY, Command.ERASE,
                         Command.EXTENDED_ERASE, Command.GO)
            if self.rdp and code in protected:
                self._emit(NACK)
                continue
            yield from self._dispatch(code)
            if self.running_at is not None:
                while True:  # the application runs; the bootloader is gone
                    yield 1

    def _nack_fault(self, code: int) -> bool:
        left = self.faults.nack.get(code, 0)
        if left == 0:
            return False
        if left > 0:
            self.faults.nack[code] = left - 1
        return True

    def _dispatch(self, code: int) -> Generator[int, bytes, None]:
        c = self.chip
        if code == Command.GET:
            if self._nack_fault(code):
                self._emit(NACK)
                return
            self._emit(bytes((ACK,)) + an3155.encode_get_reply(c.version, c.commands) + b"\x79")
        elif code == Command.GET_VERSION:
            self._emit(bytes((ACK, c.version, 0, 0, ACK)))
        elif code == Command.GET_ID:
            self._emit(bytes((ACK,)) + an3155.encode_get_id_reply(c.pid) + b"\x79")
        elif code == Command.READ_MEMORY:
            yield from self._read()
        elif code == Command.WRITE_MEMORY:
            yield from self._write()
        elif code in (Command.ERASE, Command.EXTENDED_ERASE):
            yield from self._erase(code)
        elif code == Command.GO:
            self._emit(ACK)
            address = yield from self._address()
            if address is None or self._region(address, 4) is None:
                self._emit(NACK)
                return
            self._emit(ACK)
            self.running_at = address
        elif code == Command.READOUT_UNPROTECT:
            self._emit(ACK)
            self._erase_range(0, len(self.flash))
            self.rdp = False
            self._emit(ACK, self.faults.erase_ms / 1000 * len(c.sector_sizes))
            raise _Reset
        elif code == Command.READOUT_PROTECT:
            self._emit(bytes((ACK, ACK)))
            self.rdp = True
            raise _Reset
        elif code == Command.WRITE_UNPROTECT:
            self._emit(bytes((ACK, ACK)))
            raise _Reset
        elif code == Command.WRITE_PROTECT:
            self._emit(ACK)
            n = (yield 1)[0]
            yield n + 2
            self._emit(ACK)
            raise _Reset

    def _address(self) -> Generator[int, bytes, int | None]:
        frame = yield 5
        try:
            return an3155.decode_address(frame)
        except ProtocolError:
            return None

    def _read(self) -> Generator[int, bytes, None]:
        self._emit(ACK)
        address = yield from self._address()
        if address is None or self._region(address, 1) is None:
            self._emit(NACK)
            return
        self._emit(ACK)
        try:
            length = an3155.decode_length((yield 2))
        except ProtocolError:
            self._emit(NACK)
            return
        region = self._region(address, length)
        if region is None or self._nack_fault(Command.READ_MEMORY):
            self._emit(NACK)
            return
        buf, start = region
        self._emit(bytes((ACK,)) + bytes(buf[address - start : address - start + length]))

    def _write(self) -> Generator[int, bytes, None]:
        self._emit(ACK)
        address = yield from self._address()
        if address is None or address % 4 or self._writable(address, 4) is None:
            self._emit(NACK)
            return
        self._emit(ACK)
        n = (yield 1)[0]
        rest = yield n + 2
        try:
            data = an3155.decode_write_data(bytes((n,)) + rest)
        except ProtocolError:
            self._emit(NACK)
            return
        region = self._writable(address, len(data))
        if region is None or self._nack_fault(Command.WRITE_MEMORY):
            self._emit(NACK)
            return
        buf, start = region
        off = address - start
        if buf is self.flash:
            old = buf[off : off + len(data)]
            n = len(data)
            anded = int.from_bytes(old, "little") & int.from_bytes(data, "little")
            new = bytearray(anded.to_bytes(n, "little"))
            for bad in self.faults.corrupt:
                if address <= bad < address + len(data):
                    i = bad - address
                    new[i] = old[i] & (data[i] ^ 0x01)
            buf[off : off + len(data)] = new
            self._persist(off, len(data))
        else:
            buf[off : off + len(data)] = data
        self._emit(bytes((BUSY,)) * self.faults.busy + bytes((ACK,)))

    def _erase(self, code: int) -> Generator[int, bytes, None]:
        self._emit(ACK)
        if code == Command.ERASE:
            first = (yield 1)[0]
            if first == 0xFF:
                ok = (yield 1)[0] == 0x00
                pages = list(range(len(self.chip.sector_sizes))) if ok else None
            else:
                try:
                    pages = an3155.decode_erase_pages(bytes((first,)) + (yield first + 2))
                except ProtocolError:
                    pages = None
        else:
            head = yield 2
            count = int.from_bytes(head, "big")
            if count >= 0xFFF0:
                ok = (yield 1)[0] == head[0] ^ head[1] and count == an3155.EXTENDED_ERASE_MASS
                pages = list(range(len(self.chip.sector_sizes))) if ok else None
            else:
                try:
                    pages = an3155.decode_extended_erase(head + (yield 2 * (count + 1) + 1))
                except ProtocolError:
                    pages = None
        if pages is None or any(p >= len(self.chip.sector_sizes) for p in pages):
            self._emit(NACK)
            return
        if self._nack_fault(code):
            self._emit(NACK)
            return
        for p in pages:
            start = self.sector_starts[p] - self.chip.flash_start
            self._erase_range(start, self.chip.sector_sizes[p])
        delay = self.faults.erase_ms / 1000 * len(pages)
        self._emit(bytes((BUSY,)) * self.faults.busy + bytes((ACK,)), delay)

    # --- memory -------------------------------------------------------------------------------

    def _erase_range(self, off: int, size: int) -> None:
        self.flash[off : off + size] = b"\xff" * size
        self._persist(off, size)

    def _persist(self, off: int, size: int) -> None:
        if self.state_path is None:
            return
        mode = "r+b" if self.state_path.exists() else "w+b"
        with open(self.state_path, mode) as fh:
            fh.seek(off)
            fh.write(self.flash[off : off + size])

    def _region(self, address: int, length: int) -> tuple[bytearray, int] | None:
        """The buffer holding [address, address+length) and its base address, if readable."""
        c = self.chip
        if c.flash_start <= address and address + length <= c.flash_start + len(self.flash):
            return self.flash, c.flash_start
        for start, buf in self.ram.items():
            if start <= address and address + length <= start + len(buf):
                return buf, start
        sys_start, sys_size = c.system_memory
        if sys_start <= address and address + length <= sys_start + sys_size:
            return bytearray(sys_size), sys_start
        return None

    def _writable(self, address: int, length: int) -> tuple[bytearray, int] | None:
        region = self._region(address, length)
        if region is None or region[1] == self.chip.system_memory[0]:
            return None
        lo, hi = self.chip.ram_reserved
        if region[0] is not self.flash and address < hi and address + length > lo:
            return None
        return region


def simulator_from_query(options: Mapping[str, str]) -> Stm32Simulator:
    """Build a simulator from URL query options (chip/board/state plus `Faults` knobs)."""
    opts = dict(options)
    chip_name = opts.pop("chip", None)
    board = opts.pop("board", None)
    state = opts.pop("state", None)
    wiring = Wiring.parse({k: opts.pop(k) for k in Wiring.KEYS if k in opts})
    if board:
        from firmware_tools.profiles import load_profile

        chip = chip_from_profile(load_profile(board))
    else:
        key = (chip_name or "f405").lower()
        if key not in CHIPS:
            raise SimulatorError(
                f"simulator chip {chip_name!r} is unknown. Hint: use one of "
                f"{', '.join(sorted(k for k in CHIPS if len(k) == 4))}, or board=PROFILE."
            )
        chip = CHIPS[key]
    return Stm32Simulator(chip, Faults.parse(opts), state, wiring)


def _register() -> None:
    from firmware_tools.urlhandler import register

    register()


_register()

if __name__ == "__main__":  # pragma: no cover - thin wrapper, tested through a subprocess
    import sys

    from firmware_tools.urlhandler.serve import main

    sys.exit(main())
