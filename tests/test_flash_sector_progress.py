"""flash_elf(on_sector=...): per-sector progress reported live, in order, forward only (the
daemon journals it into flash_sectors as it comes)."""

from __future__ import annotations

from pathlib import Path

import firmware
import pytest

from firmware_tools.flasher import flash_elf
from firmware_tools.profiles import load_profile

F405 = load_profile("stm32f405")
RANK = {"erased": 1, "written": 2, "verified": 3}


@pytest.fixture(scope="module")
def fw(tmp_path_factory: pytest.TempPathFactory) -> firmware.FirmwareBuilder:
    return firmware.builder(tmp_path_factory)


def test_each_sector_goes_erased_written_verified(fw: firmware.FirmwareBuilder,
                                                  tmp_path: Path) -> None:
    state = tmp_path / "flash.bin"
    marks: list[tuple[list[int], str]] = []
    phases: list[str] = []
    result = flash_elf(fw.elf(), F405, f"stm32sim://?chip=f405&state={state}",
                       state_dir=tmp_path / "st", on_sector=lambda i, s: marks.append((i, s)),
                       progress=lambda d, t, p: phases.append(p))
    assert result.sectors == [0]
    assert marks == [([0], "erased"), ([0], "written"), ([0], "verified")]
    # a second flash of the same image: the sector already holds it, verified at once
    marks.clear()
    again = flash_elf(fw.elf(), F405, f"stm32sim://?chip=f405&state={state}",
                      on_sector=lambda i, s: marks.append((i, s)))
    assert again.skipped == [0] and marks == [([0], "verified")]
    for indexes, st in marks:
        assert st in RANK and indexes
