"""MCU board profiles: flash geometry, bootloader settings and reset/BOOT0 wiring, from TOML.

Invariants this module owns (checked when a file is loaded, so every other module may rely on
them):

- A profile is immutable (frozen dataclasses) and loaded once from one TOML file.
- Sectors are listed in address order, are contiguous, start at `flash_start` and their sizes sum
  to `flash_size`; `erase_unit_min` is the smallest of them.
- `write_unit` (the flash programming granularity) is a power of two between 1 and 256 and divides
  every sector size; a 256-byte bootloader write is therefore always whole flash words.
- Unknown keys are errors that name the file, the table and list the valid keys.
- Only files with `kind = "mcu"` are profiles here; `kind = "host"` files (Linux boards) share the
  directory and are skipped by `list_profiles()`; loading one as an MCU target is an error.

Where profiles live: `profile_dir()` is `$FIRMWARE_TOOLS_PROFILE_DIR` if set, else the
`board_profiles/` directory of a source checkout (next to this package), else the copy installed
as package data in `firmware_tools/profiles/`.
"""

from __future__ import annotations

import bisect
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from firmware_tools.errors import FirmwareError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

__all__ = [
    "BootloaderSettings",
    "LineControl",
    "McuProfile",
    "ProfileError",
    "RamRegion",
    "Sector",
    "list_profiles",
    "load_profile",
    "profile_dir",
]

PROFILE_DIR_ENV = "FIRMWARE_TOOLS_PROFILE_DIR"
KINDS = ("mcu", "host")
RESET_METHODS = ("dtr-rts", "gpio", "manual")
SERIAL_LINES = ("dtr", "rts")


class ProfileError(FirmwareError, ValueError):
    """A board profile that is unknown, unreadable or invalid (bad configuration: exit 78)."""

    exit_code = 78


@dataclass(frozen=True)
class Sector:
    """One erase unit of flash (an F4 "sector" or an F1 "page")."""

    index: int
    start: int
    size: int

    @property
    def end(self) -> int:
        """First address after the sector."""
        return self.start + self.size


@dataclass(frozen=True)
class RamRegion:
    name: str
    start: int
    size: int

    @property
    def end(self) -> int:
        return self.start + self.size


@dataclass(frozen=True)
class BootloaderSettings:
    """The ROM bootloader's UART settings and limits (AN2606, AN3155)."""

    baud: int = 115200
    parity: str = "E"  # 'E' (what the ROM bootloader expects) or 'N' (some ptys and bridges)
    stopbits: int = 1
    ram_reserved: range = range(0)  # RAM the bootloader itself uses (AN2606): do not write there
    command_timeout_s: float = 1.0  # ACK of an ordinary command
    write_timeout_s: float = 1.0  # ACK after a 256-byte Write Memory
    erase_timeout_s: float = 5.0  # ACK after erasing one sector/page
    mass_erase_timeout_s: float = 40.0  # ACK after a global erase
    write_retries: int = 3

    @property
    def ram_reserved_end(self) -> int:
        """First RAM address after the bootloader's reserved area."""
        return self.ram_reserved.stop


@dataclass(frozen=True)
class LineControl:
    """How RESET (NRST) and BOOT0 are driven to enter the ROM bootloader.

    method 'dtr-rts': `reset_line`/`boot0_line` are 'dtr' or 'rts'. Asserting a line means
    setting it True in pyserial; `reset_invert`/`boot0_invert` flip that (for adapters wired
    through an inverter). Asserted reset line = NRST held low; asserted BOOT0 line = BOOT0 high.
    method 'gpio': `gpio_chip` (e.g. 'gpiochip0') and line offsets `reset_line`/`boot0_line`
    driven through libgpiod; the invert flags mean the line is active low.
    method 'manual': the user sets BOOT0 and presses reset when asked.
    """

    method: str = "manual"
    reset_line: str | int | None = None
    boot0_line: str | int | None = None
    reset_invert: bool = False
    boot0_invert: bool = False
    gpio_chip: str | None = None
    pulse_s: float = 0.1  # how long reset is held
    settle_s: float = 0.1  # wait after releasing reset before the first 0x7F


@dataclass(frozen=True)
class McuProfile:
    """An MCU target: identity, flash geometry, RAM, bootloader and reset wiring."""

    name: str
    description: str
    chip_ids: tuple[int, ...]
    flash_start: int
    flash_size: int
    sectors: tuple[Sector, ...]
    write_unit: int
    erase_unit_min: int
    allow_unaligned_start: bool
    bootloader: BootloaderSettings
    reset: LineControl
    ram: tuple[RamRegion, ...] = ()
    elf_machine: str = "EM_ARM"
    source: Path | None = None
    _starts: tuple[int, ...] = field(default=(), repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_starts", tuple(s.start for s in self.sectors))

    @property
    def flash_end(self) -> int:
        """First address after flash."""
        return self.flash_start + self.flash_size

    def sector_at(self, addr: int) -> Sector | None:
        """The sector holding `addr`, or None when `addr` is outside flash."""
        if not self.flash_start <= addr < self.flash_end:
            return None
        return self.sectors[bisect.bisect_right(self._starts, addr) - 1]

    def sectors_covering(self, start: int, end: int) -> tuple[Sector, ...]:
        """Sectors that intersect [start, end) (end exclusive), in address order."""
        if end <= start:
            return ()
        lo = max(start, self.flash_start)
        hi = min(end, self.flash_end)
        if hi <= lo:
            return ()
        first = bisect.bisect_right(self._starts, lo) - 1
        last = bisect.bisect_left(self._starts, hi)
        return self.sectors[first:last]

    def ram_region_at(self, addr: int) -> RamRegion | None:
        for region in self.ram:
            if region.start <= addr < region.end:
                return region
        return None


# --------------------------------------------------------------------------- locating files


def profile_dir() -> Path:
    """Directory holding the profile TOML files (see module docstring for the order)."""
    env = os.environ.get(PROFILE_DIR_ENV)
    if env:
        return Path(env)
    here = Path(__file__).resolve().parent
    checkout = here.parent / "board_profiles"
    if checkout.is_dir():
        return checkout
    return here / "profiles"


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except OSError as exc:
        raise ProfileError(
            f"board profile {path}: cannot read it ({exc.strerror or exc}). "
            "Hint: check the path, or pass a profile name from `edge-agent flash check --help`."
        ) from exc
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(
            f"board profile {path}: not valid TOML ({exc}). Hint: fix the syntax at that line."
        ) from exc


def _kind_of(path: Path, doc: Mapping[str, Any]) -> str:
    kind = doc.get("kind")
    if kind not in KINDS:
        raise ProfileError(
            f"board profile {path}: `kind` is {kind!r}, expected one of {', '.join(KINDS)}. "
            'Hint: MCU targets start with `kind = "mcu"`, Linux host boards with '
            '`kind = "host"`.'
        )
    return str(kind)


def list_profiles() -> list[str]:
    """Names (file stems) of the MCU profiles in `profile_dir()`, sorted.

    Files that fail to parse are left out here; `load_profile` reports them.
    """
    names = []
    for path in sorted(profile_dir().glob("*.toml")):
        try:
            if _kind_of(path, _read_toml(path)) == "mcu":
                names.append(path.stem)
        except ProfileError:
            continue
    return names


def _resolve(name_or_path: str | os.PathLike[str]) -> Path:
    text = os.fspath(name_or_path)
    candidate = Path(text)
    if text.endswith(".toml") or os.sep in text or candidate.is_file():
        return candidate
    path = profile_dir() / f"{text.lower()}.toml"
    if path.is_file():
        return path
    known = ", ".join(list_profiles()) or "(none)"
    raise ProfileError(
        f"board profile {text!r}: no file {path.name} in {profile_dir()}. "
        f"Hint: use one of: {known}; or pass the path of a .toml profile."
    )


def load_profile(name_or_path: str | os.PathLike[str]) -> McuProfile:
    """Load and validate an MCU profile by name (file stem in `profile_dir()`) or path."""
    path = _resolve(name_or_path)
    doc = _read_toml(path)
    kind = _kind_of(path, doc)
    if kind != "mcu":
        raise ProfileError(
            f"board profile {path}: kind = {kind!r} describes a Linux host board, "
            "not an MCU target to flash. Hint: pass an MCU profile "
            f"({', '.join(list_profiles()) or 'none found'})."
        )
    return _Parser(path).profile(doc)


# --------------------------------------------------------------------------- validation


class _Parser:
    """Typed reads from a TOML document; every error names the file and the key."""

    TOP = ("kind", "description", "chip_ids", "elf_machine", "flash", "ram", "bootloader", "reset")
    FLASH = ("start", "size", "write_unit", "allow_unaligned_start", "sectors")
    SECTOR_RUN = ("count", "size")
    RAM = ("name", "start", "size")
    BOOTLOADER = (
        "baud",
        "parity",
        "stopbits",
        "ram_reserved",
        "command_timeout_s",
        "write_timeout_s",
        "erase_timeout_s",
        "mass_erase_timeout_s",
        "write_retries",
    )
    RAM_RESERVED = ("first", "last")
    RESET = (
        "method",
        "reset_line",
        "boot0_line",
        "reset_invert",
        "boot0_invert",
        "gpio_chip",
        "pulse_s",
        "settle_s",
    )

    def __init__(self, path: Path) -> None:
        self.path = path

    def fail(self, where: str, what: str, hint: str) -> ProfileError:
        return ProfileError(f"board profile {self.path}: {where}: {what}. Hint: {hint}")

    def keys(self, table: Mapping[str, Any], valid: tuple[str, ...], where: str) -> None:
        unknown = sorted(set(table) - set(valid))
        if unknown:
            raise self.fail(
                where,
                f"unknown key{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}",
                f"valid keys are: {', '.join(valid)}.",
            )

    def table(self, doc: Mapping[str, Any], key: str, where: str) -> Mapping[str, Any]:
        value = doc.get(key, {})
        if not isinstance(value, Mapping):
            raise self.fail(where, f"`{key}` must be a table", f"write it as [{key}].")
        return value

    def int_(self, t: Mapping[str, Any], key: str, where: str, default: int | None = None,
             minimum: int = 0) -> int:
        if key not in t:
            if default is None:
                raise self.fail(where, f"missing required key `{key}`", f"add `{key} = ...`.")
            return default
        value = t[key]
        if type(value) is not int or value < minimum:
            raise self.fail(
                where, f"`{key}` = {value!r} is not an integer >= {minimum}",
                "write a plain or 0x-prefixed integer."
            )
        return value

    def float_(self, t: Mapping[str, Any], key: str, where: str, default: float) -> float:
        value = t.get(key, default)
        if type(value) not in (int, float) or value <= 0:
            raise self.fail(where, f"`{key}` = {value!r} is not a positive number",
                            "give seconds, e.g. 1.5.")
        return float(value)

    def bool_(self, t: Mapping[str, Any], key: str, where: str, default: bool) -> bool:
        value = t.get(key, default)
        if not isinstance(value, bool):
            raise self.fail(where, f"`{key}` = {value!r} is not a boolean", "use true or false.")
        return value

    def str_(self, t: Mapping[str, Any], key: str, where: str, default: str | None = None) -> str:
        value = t.get(key, default)
        if not isinstance(value, str):
            raise self.fail(where, f"`{key}` = {value!r} is not a string",
                            f'write `{key} = "..."`.')
        return value

    def profile(self, doc: Mapping[str, Any]) -> McuProfile:
        self.keys(doc, self.TOP, "top level")
        chip_ids = doc.get("chip_ids")
        if (
            not isinstance(chip_ids, list)
            or not chip_ids
            or any(type(c) is not int or not 0 < c <= 0xFFFF for c in chip_ids)
        ):
            raise self.fail("top level", f"`chip_ids` = {chip_ids!r} is not a non-empty list of "
                            "16-bit product ids", "e.g. chip_ids = [0x413] (AN2606, Get ID).")
        flash = self.table(doc, "flash", "[flash]")
        start, size, write_unit, sectors = self.flash(flash)
        return McuProfile(
            name=self.path.stem,
            description=self.str_(doc, "description", "top level"),
            chip_ids=tuple(chip_ids),
            flash_start=start,
            flash_size=size,
            sectors=sectors,
            write_unit=write_unit,
            erase_unit_min=min(s.size for s in sectors),
            allow_unaligned_start=self.bool_(flash, "allow_unaligned_start", "[flash]", False),
            bootloader=self.bootloader(self.table(doc, "bootloader", "[bootloader]")),
            reset=self.reset(self.table(doc, "reset", "[reset]")),
            ram=self.ram(doc.get("ram", [])),
            elf_machine=self.str_(doc, "elf_machine", "top level", "EM_ARM"),
            source=self.path,
        )

    def flash(self, t: Mapping[str, Any]) -> tuple[int, int, int, tuple[Sector, ...]]:
        self.keys(t, self.FLASH, "[flash]")
        start = self.int_(t, "start", "[flash]")
        size = self.int_(t, "size", "[flash]", minimum=1)
        unit = self.int_(t, "write_unit", "[flash]", minimum=1)
        if unit > 256 or unit & (unit - 1):
            raise self.fail("[flash]", f"write_unit = {unit} is not a power of two <= 256",
                            "give the flash word size in bytes (F1: 2, F4: 4, H7: 32).")
        runs = t.get("sectors")
        if not isinstance(runs, list) or not runs:
            raise self.fail("[flash]", "`sectors` is missing or empty",
                            "list runs of equal sectors: sectors = [{ count = 4, size = 0x4000 }].")
        sectors: list[Sector] = []
        addr = start
        for i, run in enumerate(runs):
            where = f"[flash] sectors[{i}]"
            if not isinstance(run, Mapping):
                raise self.fail(where, f"{run!r} is not a table", "write { count = N, size = S }.")
            self.keys(run, self.SECTOR_RUN, where)
            count = self.int_(run, "count", where, minimum=1)
            sector_size = self.int_(run, "size", where, minimum=1)
            if sector_size % unit:
                raise self.fail(where, f"size {sector_size} is not a multiple of write_unit "
                                f"{unit}", "check the reference manual's sector table.")
            for _ in range(count):
                sectors.append(Sector(len(sectors), addr, sector_size))
                addr += sector_size
        if addr - start != size:
            raise self.fail("[flash]", f"sectors add up to {addr - start:#x} bytes but size is "
                            f"{size:#x}", "make the sector runs cover the whole flash.")
        return start, size, unit, tuple(sectors)

    def ram(self, value: Any) -> tuple[RamRegion, ...]:
        if not isinstance(value, list):
            raise self.fail("[[ram]]", "`ram` must be an array of tables", "write [[ram]] blocks.")
        regions = []
        for i, t in enumerate(value):
            where = f"[[ram]] #{i}"
            if not isinstance(t, Mapping):
                raise self.fail(where, f"{t!r} is not a table", "write [[ram]] blocks.")
            self.keys(t, self.RAM, where)
            regions.append(RamRegion(self.str_(t, "name", where), self.int_(t, "start", where),
                                     self.int_(t, "size", where, minimum=1)))
        return tuple(regions)

    def bootloader(self, t: Mapping[str, Any]) -> BootloaderSettings:
        where = "[bootloader]"
        self.keys(t, self.BOOTLOADER, where)
        d = BootloaderSettings()
        parity = self.str_(t, "parity", where, d.parity)
        if parity not in ("E", "N"):
            raise self.fail(where, f"parity = {parity!r}", 'use "E" (8E1, AN3155) or "N" (8N1).')
        stopbits = self.int_(t, "stopbits", where, d.stopbits, minimum=1)
        if stopbits not in (1, 2):
            raise self.fail(where, f"stopbits = {stopbits}", "use 1 or 2.")
        reserved = range(0)
        if "ram_reserved" in t:
            r = self.table(t, "ram_reserved", where + " ram_reserved")
            self.keys(r, self.RAM_RESERVED, where + " ram_reserved")
            first = self.int_(r, "first", where + " ram_reserved")
            last = self.int_(r, "last", where + " ram_reserved")
            if last < first:
                raise self.fail(where, f"ram_reserved last {last:#x} < first {first:#x}",
                                "both ends are inclusive, as AN2606 writes them.")
            reserved = range(first, last + 1)
        return BootloaderSettings(
            baud=self.int_(t, "baud", where, d.baud, minimum=1200),
            parity=parity,
            stopbits=stopbits,
            ram_reserved=reserved,
            command_timeout_s=self.float_(t, "command_timeout_s", where, d.command_timeout_s),
            write_timeout_s=self.float_(t, "write_timeout_s", where, d.write_timeout_s),
            erase_timeout_s=self.float_(t, "erase_timeout_s", where, d.erase_timeout_s),
            mass_erase_timeout_s=self.float_(t, "mass_erase_timeout_s", where,
                                             d.mass_erase_timeout_s),
            write_retries=self.int_(t, "write_retries", where, d.write_retries),
        )

    def reset(self, t: Mapping[str, Any]) -> LineControl:
        where = "[reset]"
        self.keys(t, self.RESET, where)
        d = LineControl()
        method = self.str_(t, "method", where, d.method)
        if method not in RESET_METHODS:
            raise self.fail(where, f"method = {method!r}",
                            f"use one of {', '.join(RESET_METHODS)}.")
        lines: dict[str, str | int | None] = {}
        for key in ("reset_line", "boot0_line"):
            value = t.get(key)
            if method == "dtr-rts" and value not in SERIAL_LINES:
                raise self.fail(where, f"{key} = {value!r} with method dtr-rts",
                                'use "dtr" or "rts".')
            if method == "gpio" and (type(value) is not int or value < 0):
                raise self.fail(where, f"{key} = {value!r} with method gpio",
                                "give the line offset on the GPIO chip (see `gpioinfo`).")
            if method == "manual" and value is not None:
                raise self.fail(where, f"{key} is set but method is manual",
                                'remove it, or set method = "dtr-rts" or "gpio".')
            lines[key] = value
        if method == "dtr-rts" and lines["reset_line"] == lines["boot0_line"]:
            raise self.fail(where, "reset_line and boot0_line are the same line",
                            "wire NRST and BOOT0 to different lines (dtr and rts).")
        chip = t.get("gpio_chip")
        if method == "gpio":
            chip = self.str_(t, "gpio_chip", where)
        elif chip is not None:
            raise self.fail(where, f"gpio_chip is set but method is {method}",
                            'remove it, or set method = "gpio".')
        return LineControl(
            method=method,
            reset_line=lines["reset_line"],
            boot0_line=lines["boot0_line"],
            reset_invert=self.bool_(t, "reset_invert", where, d.reset_invert),
            boot0_invert=self.bool_(t, "boot0_invert", where, d.boot0_invert),
            gpio_chip=chip,
            pulse_s=self.float_(t, "pulse_s", where, d.pulse_s),
            settle_s=self.float_(t, "settle_s", where, d.settle_s),
        )
