"""Validation of one MCU board profile: a TOML document in, a frozen `McuProfile` out.

Invariants this module owns (those `profiles.py` promises its callers):
- Every key is read through a typed accessor; an unknown key, a missing one or a value of the
  wrong type or range is a `ProfileError` naming the file, the table and the key, with a hint.
- Sectors come out in address order, contiguous from `flash.start`, summing to `flash.size`, and
  `write_unit` is a power of two (1..256) dividing every sector size.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from firmware_tools.profiles import (
    RESET_METHODS,
    SERIAL_LINES,
    BootloaderSettings,
    LineControl,
    McuProfile,
    ProfileError,
    RamRegion,
    Sector,
)

__all__ = ["ProfileParser"]


class ProfileParser:
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
        if method != "manual" and lines["reset_line"] == lines["boot0_line"]:
            raise self.fail(where, "reset_line and boot0_line are the same line",
                            "wire NRST and BOOT0 to different lines ("
                            + ("dtr and rts)." if method == "dtr-rts" else "two offsets)."))
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
