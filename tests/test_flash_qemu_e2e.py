"""The full loop: ELF -> our flasher -> simulated STM32F405 -> flash dump -> QEMU boots it.

The example firmware prints a line that lives in `.data`, so seeing it proves the image carried
the LMA->VMA copy source to the right flash address, byte for byte.
"""

from __future__ import annotations

from pathlib import Path

import firmware
import pytest

from firmware_tools.flasher import flash_elf, read_flash
from firmware_tools.profiles import load_profile

pytestmark = [pytest.mark.tools, pytest.mark.qemu]


def test_flash_dump_and_boot_in_qemu(tmp_path_factory: pytest.TempPathFactory) -> None:
    fw = firmware.builder(tmp_path_factory)
    firmware.require("qemu-system-arm")
    tmp = tmp_path_factory.mktemp("e2e")
    profile = load_profile("stm32f405")
    url = f"stm32sim://?chip=f405&state={tmp / 'flash.bin'}"
    result = flash_elf(fw.elf(), profile, url, state_dir=tmp / "state")
    assert result.went and result.erased == [0]
    dump = tmp / "dump.bin"
    # The first sector is enough to boot: the image lives there.
    assert read_flash(profile, url, dump, length=16 * 1024) == 16 * 1024
    output = firmware.boot_qemu(dump)
    assert firmware.GREETING in output, output
    # And an erased chip does not print it (the check can fail).
    blank = tmp / "blank.bin"
    blank.write_bytes(b"\xff" * 1024)
    assert firmware.GREETING not in firmware.boot_qemu(blank, timeout=2.0)


def test_full_dump_boots_too(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    fw = firmware.builder(tmp_path_factory)
    firmware.require("qemu-system-arm")
    profile = load_profile("stm32f405")
    url = f"stm32sim://?chip=f405&state={tmp_path / 'flash.bin'}"
    flash_elf(fw.elf(), profile, url, go=False)
    dump = tmp_path / "dump.bin"
    assert read_flash(profile, url, dump) == 1024 * 1024
    assert firmware.GREETING in firmware.boot_qemu(dump)
