"""MCU board profiles: flash geometry, bootloader settings and reset/BOOT0 wiring, from TOML.

Invariants this module owns (checked when a file is loaded, so every other module may rely on
them):

- A profile is immutable (frozen dataclasses) and loaded once from one TOML file.
- Sectors are listed in address order, are contiguous, start at `flash_start` and their sizes sum
  to `flash_size`; `erase_unit_min` is the smallest of them.
- `write_unit` (the flash programming granularity) is a power of two between 1 and 256 and divides
  every sector size; a 256-byte bootloader write is therefore always whole flash words.
- Unknown keys are errors that name the file, the table and list the valid keys.
- The checks themselves are `profile_parser.ProfileParser`; this module locates files, reads
  the TOML and holds the types.
- Only files with `kind = "mcu"` are profiles here; `kind = "host"` files (Linux boards) share the
  directory and are skipped by `list_profiles()`; loading one as an MCU target is an error.

Where profiles live: `profile_dir()` is `$FIRMWARE_TOOLS_PROFILE_DIR` if set, else the
`board_profiles/` directory of a source checkout (next to this package), else the copy installed
as package data in `firmware_tools/profiles/`.
"""

from __future__ import annotations

import bisect
import os
import stat
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
    method 'gpio': `gpio_chip` (as `gpiodetect` names it: 'gpiochip0', a /dev path or the
    chip's label) and line offsets `reset_line`/`boot0_line`; an asserted reset line is driven
    low, an asserted BOOT0 line high (a pin wired straight to the chip), and the invert flags
    flip that (a transistor or an inverter in between).
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


PROFILE_MAX_BYTES = 1 << 20  # a profile is a few KiB; a larger "file" is a wrong path
_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"))


def _read_bounded(path: Path) -> bytes:
    """A regular file of at most PROFILE_MAX_BYTES; OSError or ValueError saying what is wrong.
    Stat first and open non-blocking, so a FIFO is never waited on; a device never read."""
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        what = next((name for test, name in _KINDS if test(st.st_mode)), "a special file")
        raise ValueError(f"it is {what}, not a regular file")
    if st.st_size > PROFILE_MAX_BYTES:
        raise ValueError(f"{st.st_size} bytes, more than the {PROFILE_MAX_BYTES}-byte limit")
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # replaced between the stat and the open
            raise ValueError("it is not a regular file")
        data = fh.read(PROFILE_MAX_BYTES + 1)
    if len(data) > PROFILE_MAX_BYTES:
        raise ValueError(f"more than the {PROFILE_MAX_BYTES}-byte limit")
    return data


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        text = _read_bounded(path).decode("utf-8")
        return tomllib.loads(text)
    except OSError as exc:
        raise ProfileError(
            f"board profile {path}: cannot read it ({exc.strerror or exc}). "
            "Hint: check the path, or pass a profile name from `edge-agent flash check --help`."
        ) from exc
    except UnicodeDecodeError as exc:
        raise ProfileError(
            f"board profile {path}: not UTF-8 text ({exc.reason} at byte {exc.start}). "
            "Hint: check the path points at a .toml board profile."
        ) from exc
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(
            f"board profile {path}: not valid TOML ({exc}). Hint: fix the syntax at that line."
        ) from exc
    except ValueError as exc:  # not a regular file, or too large
        raise ProfileError(
            f"board profile {path}: cannot read it ({exc}). Hint: check the path, or pass a "
            "profile name from `edge-agent flash check --help`; a profile is a TOML file of at "
            "most 1 MiB."
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
    from firmware_tools.profile_parser import ProfileParser  # it imports this module

    return ProfileParser(path).profile(doc)
