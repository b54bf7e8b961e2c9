"""What the AN3155 simulator imitates (`SimChip`: ids, sector map, RAM, bootloader version and
command list, per AN2606 and the reference manuals) and how it misbehaves on demand (`Faults`).

Invariants this module owns:
- A `SimChip` is immutable; `CHIPS` holds the built-in chips under short and full names, and
  `chip_from_profile` derives one from a firmware_tools board profile (its sector map, chip id
  and reserved RAM), so a profile and its simulated board cannot disagree.
- `Faults.parse` accepts exactly `Faults.KEYS`; any other option, or a value that is not an
  integer where one is needed, is a `SimulatorError` naming the option with a hint.
- `Wiring` is the board's NRST and BOOT0 wired to the adapter's DTR and RTS, with the
  polarity board profiles use (`[reset]`): an asserted line (pyserial's True) holds NRST low
  or BOOT0 high, an inverted one the opposite. Both pins are wired, to different lines, or
  neither.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from firmware_tools.an3155 import SYNC, Command
from firmware_tools.errors import FirmwareError

if TYPE_CHECKING:
    from firmware_tools.profiles import McuProfile

__all__ = ["CHIPS", "Faults", "SimChip", "SimulatorError", "Wiring", "chip_from_profile"]


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


def chip_from_profile(profile: McuProfile) -> SimChip:
    """A SimChip with the sector map, chip id and reserved RAM of a firmware_tools profile."""
    pids = tuple(profile.chip_ids)
    known = {c.pid: c for c in CHIPS.values()}
    base = next((known[p] for p in pids if p in known), None)
    if base is None and pids and 0x410 <= pids[0] <= 0x430:
        base = CHIPS["f103"]  # the F1 family: v2.x bootloader with Erase (0x43)
    sectors = tuple(s.size for s in profile.sectors)
    ram = tuple((r.start, r.size) for r in getattr(profile, "ram", ())) or (
        base.ram if base else ((0x20000000, 128 * _K),)
    )
    reserved = profile.bootloader.ram_reserved
    uses_ext = len(sectors) > 256 or base is None or Command.EXTENDED_ERASE in base.commands
    return SimChip(
        name=str(profile.name),
        pid=profile.chip_ids[0],
        version=base.version if base else 0x31,
        commands=_F4_CMDS if uses_ext else _F1_CMDS,
        flash_start=profile.flash_start,
        sector_sizes=sectors,
        ram=ram,
        ram_reserved=(reserved.start, reserved.stop),
        system_memory=base.system_memory if base else (0x1FFF0000, 0x7800),
        write_unit=profile.write_unit,
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
                    f"state, {', '.join(Wiring.KEYS)}, {', '.join(cls.KEYS)}."
                )
        return f


_LINES = ("dtr", "rts")


@dataclass(frozen=True)
class Wiring:
    """NRST and BOOT0 on the adapter's modem lines (`reset=dtr&boot0=rts`, optionally
    `reset_invert=1`, `boot0_invert=1`), as a board profile's `[reset]` describes them."""

    reset: str
    boot0: str
    reset_invert: bool = False
    boot0_invert: bool = False

    KEYS = ("reset", "boot0", "reset_invert", "boot0_invert")

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> Wiring | None:
        if not options:
            return None
        reset, boot0 = options.get("reset"), options.get("boot0")
        for key, value in (("reset", reset), ("boot0", boot0)):
            if value not in _LINES:
                raise SimulatorError(
                    f"simulator option {key}={value or ''!r} is not a modem line. Hint: wire "
                    "both pins, each to dtr or rts, e.g. reset=dtr&boot0=rts."
                )
        if reset == boot0:
            raise SimulatorError(
                f"simulator options reset and boot0 are both {reset}. Hint: wire NRST and "
                "BOOT0 to different lines: reset=dtr&boot0=rts."
            )
        flags = {}
        for key in ("reset_invert", "boot0_invert"):
            value = options.get(key, "0").lower()
            if value not in ("0", "1", "true", "false", "yes", "no", "on", "off"):
                raise SimulatorError(
                    f"simulator option {key}={value!r} is not a boolean. Hint: use 1 or 0."
                )
            flags[key] = value in ("1", "true", "yes", "on")
        assert reset is not None and boot0 is not None
        return cls(reset, boot0, **flags)
