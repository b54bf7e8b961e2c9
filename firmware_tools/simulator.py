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

Fault knobs (URL query or `Faults.parse`): see `Faults`.
"""

from __future__ import annotations

import atexit
import os
from collections import deque
from collections.abc import Generator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from firmware_tools import an3155
from firmware_tools.an3155 import ACK, BUSY, NACK, SYNC, Command, ProtocolError
from firmware_tools.errors import FirmwareError

__all__ = [
    "CHIPS",
    "Faults",
    "SimChip",
    "SimulatorError",
    "Stm32Simulator",
    "chip_from_profile",
    "simulator_from_query",
]


class SimulatorError(FirmwareError, ValueError):
    """A simulator URL or option that cannot be used."""


_F4_CMDS = (0x00, 0x01, 0x02, 0x11, 0x21, 0x31, 0x44, 0x63, 0x73, 0x82, 0x92)
_F1_CMDS = (0x00, 0x01, 0x02, 0x11, 0x21, 0x31, 0x43, 0x63, 0x73, 0x82, 0x92)


@dataclass(frozen=True)
class SimChip:
    """What the simulator needs to know about a chip (AN2606 for ids, RAM and versions)."""

    name: str
    pid: int
    version: int
    commands: tuple[int, ...]
    flash_start: int
    sector_sizes: tuple[int, ...]
    ram: tuple[tuple[int, int], ...]  # (start, size)
    ram_reserved: tuple[int, int]  # [start, end) used by the bootloader itself
    system_memory: tuple[int, int] = (0x1FFF0000, 0x7800)
    write_unit: int = 4

    @property
    def flash_size(self) -> int:
        return sum(self.sector_sizes)


_K = 1024
CHIPS: dict[str, SimChip] = {
    # RM0090 3.3: sectors 4x16K, 1x64K, 7x128K; AN2606: v3.1 uses 12 KiB of RAM from 0x20000000.
    "f405": SimChip(
        "f405", 0x413, 0x31, _F4_CMDS, 0x08000000,
        (16 * _K,) * 4 + (64 * _K,) + (128 * _K,) * 7,
        ((0x20000000, 128 * _K),), (0x20000000, 0x20003000),
    ),
    # RM0008: medium density, 128 x 1 KiB pages; AN2606: v2.2, 512 bytes of RAM reserved.
    "f103": SimChip(
        "f103", 0x410, 0x22, _F1_CMDS, 0x08000000, (1 * _K,) * 128,
        ((0x20000000, 20 * _K),), (0x20000000, 0x20000200), (0x1FFFF000, 0x800), 2,
    ),
    # RM0433: STM32H750VB, one 128 KiB sector, 32-byte flash word.
    "h750": SimChip(
        "h750", 0x450, 0x90, _F4_CMDS, 0x08000000, (128 * _K,),
        ((0x24000000, 512 * _K), (0x20000000, 128 * _K)), (0x20000000, 0x20004100),
        (0x1FF00000, 0x20000), 32,
    ),
}
CHIPS["f407"] = CHIPS["f405"]
CHIPS["stm32f405"] = CHIPS["stm32f407"] = CHIPS["f405"]
CHIPS["stm32f103"] = CHIPS["f103"]
CHIPS["stm32h750"] = CHIPS["stm32h750vb"] = CHIPS["h750"]


def chip_from_profile(profile: object) -> SimChip:
    """A SimChip with the sector map, chip id and reserved RAM of a firmware_tools profile."""
    pids = tuple(profile.chip_ids)  # type: ignore[attr-defined]
    known = {c.pid: c for c in CHIPS.values()}
    base = next((known[p] for p in pids if p in known), None)
    if base is None and pids and 0x410 <= pids[0] <= 0x430:
        base = CHIPS["f103"]  # the F1 family: v2.x bootloader with Erase (0x43)
    sectors = tuple(s.size for s in profile.sectors)  # type: ignore[attr-defined]
    ram = tuple((r.start, r.size) for r in getattr(profile, "ram", ())) or (
        base.ram if base else ((0x20000000, 128 * _K),)
    )
    reserved = profile.bootloader.ram_reserved  # type: ignore[attr-defined]
    uses_ext = len(sectors) > 256 or base is None or Command.EXTENDED_ERASE in base.commands
    return SimChip(
        name=str(profile.name),  # type: ignore[attr-defined]
        pid=profile.chip_ids[0],  # type: ignore[attr-defined]
        version=base.version if base else 0x31,
        commands=_F4_CMDS if uses_ext else _F1_CMDS,
        flash_start=profile.flash_start,  # type: ignore[attr-defined]
        sector_sizes=sectors,
        ram=ram,
        ram_reserved=(reserved.start, reserved.stop),
        system_memory=base.system_memory if base else (0x1FFF0000, 0x7800),
        write_unit=profile.write_unit,  # type: ignore[attr-defined]
    )


def _int(text: str, key: str) -> int:
    try:
        return int(text, 0)
    except ValueError:
        raise SimulatorError(
            f"simulator option {key}={text!r}: not an integer. Hint: write e.g. {key}=0x31."
        ) from None


@dataclass
class Faults:
    """Misbehaviour on demand.

    nack=0x31[:N|:all],...   NACK the final stage of that command N times (default once)
    silence=0x02,...|sync    never answer that command (or the sync byte)
    garbage=0x00,...         answer that command with 0xA5 instead of ACK
    busy=N                   send N BUSY (0x76) bytes before the ACK of every write/erase
    bytewise=1               deliver replies one byte per read
    drop_after=N             the link dies after the board received N bytes
    rdp=1                    readout protection active
    corrupt=0x08000010,...   programming that byte leaves bit 0 wrong (a weak cell)
    erase_ms=N               each sector erase takes N ms (default 0)
    baud=N                   pace the link: every byte takes 10/N s on the wire, each way
    timeline=PATH            instrumentation, off by default: log when each chunk of host
                             bytes was read and each reply written (monotonic seconds), as
                             `rx|tx<TAB>time<TAB>bytes` lines written to PATH at exit
    """

    nack: dict[int, int] = field(default_factory=dict)  # command -> remaining (-1: always)
    silence: set[int] = field(default_factory=set)  # SYNC (0x7F) stands for the sync byte
    garbage: set[int] = field(default_factory=set)
    busy: int = 0
    bytewise: bool = False
    drop_after: int | None = None
    rdp: bool = False
    corrupt: set[int] = field(default_factory=set)
    erase_ms: float = 0.0
    baud: int = 0
    timeline: str | None = None

    KEYS = ("nack", "silence", "garbage", "busy", "bytewise", "drop_after", "rdp", "corrupt",
            "erase_ms", "baud", "timeline")

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> Faults:
        f = cls()
        for key, value in options.items():
            items = [v for v in value.split(",") if v]
            if key == "nack":
                for item in items:
                    code, _, count = item.partition(":")
                    n = -1 if count == "all" else (_int(count, key) if count else 1)
                    f.nack[_int(code, key)] = n
            elif key == "silence":
                f.silence = {SYNC if v == "sync" else _int(v, key) for v in items}
            elif key == "garbage":
                f.garbage = {_int(v, key) for v in items}
            elif key == "corrupt":
                f.corrupt = {_int(v, key) for v in items}
            elif key in ("busy", "drop_after", "baud"):
                setattr(f, key, _int(value, key))
            elif key in ("bytewise", "rdp"):
                setattr(f, key, value.lower() in ("1", "true", "yes", "on"))
            elif key == "erase_ms":
                f.erase_ms = float(_int(value, key))
            elif key == "timeline":
                if not value:
                    raise SimulatorError(
                        "simulator option timeline= needs a file name. "
                        "Hint: write e.g. timeline=/tmp/sim-timeline.tsv."
                    )
                f.timeline = value
            else:
                raise SimulatorError(
                    f"simulator option {key!r} is unknown. Hint: valid options are chip, board, "
                    f"state, {', '.join(cls.KEYS)}."
                )
        return f


class _Reset(Exception):
    """The simulated chip resets (after Readout (Un)Protect, Write Unprotect)."""


class Stm32Simulator:
    """The board: feed it host bytes with `receive`, collect its replies with `take_output`."""

    def __init__(
        self,
        chip: SimChip,
        faults: Faults | None = None,
        state: str | os.PathLike[str] | None = None,
    ) -> None:
        self.chip = chip
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
        self._prog = self._program()
        self._need = next(self._prog)
        # Instrumentation (timeline knob): (direction, monotonic time, bytes) per chunk.
        self.timeline: list[tuple[str, float, int]] | None = None
        if self.faults.timeline:
            self.timeline = []
            atexit.register(self.write_timeline, self.faults.timeline)

    # --- byte seam ----------------------------------------------------------------------------

    def receive(self, data: bytes, now: float = 0.0) -> None:
        """Bytes from the host arriving at time `now`."""
        if self.dropped:
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
    return Stm32Simulator(chip, Faults.parse(opts), state)


def _register() -> None:
    from firmware_tools.urlhandler import register

    register()


_register()

if __name__ == "__main__":  # pragma: no cover - thin wrapper, tested through a subprocess
    import sys

    from firmware_tools.urlhandler.serve import main

    sys.exit(main())
