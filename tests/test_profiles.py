"""Board profiles: every shipped file loads and is consistent; bad files fail with clear errors."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from firmware_tools.errors import FirmwareError
from firmware_tools.profiles import (
    McuProfile,
    ProfileError,
    Sector,
    list_profiles,
    load_profile,
    profile_dir,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ALL_FILES = sorted(profile_dir().glob("*.toml"))
KiB = 1024


def _kind(path: Path) -> str:
    with path.open("rb") as fh:
        return str(tomllib.load(fh).get("kind"))


def test_profile_dir_is_the_checkout_board_profiles() -> None:
    assert profile_dir() == Path(__file__).resolve().parents[1] / "board_profiles"
    assert ALL_FILES, "no board profile files found"


@pytest.mark.parametrize("path", ALL_FILES, ids=[p.name for p in ALL_FILES])
def test_every_profile_file_loads(path: Path) -> None:
    kind = _kind(path)
    if kind == "host":
        with pytest.raises(ProfileError, match="host board, not an MCU target"):
            load_profile(path)
        assert path.stem not in list_profiles()
        return
    assert kind == "mcu", f"{path}: kind must be mcu or host"
    text = path.read_text()
    for source in ("AN2606", "AN3155"):
        assert source in text, f"{path.name} does not cite {source}"
    assert "RM0" in text, f"{path.name} does not cite its reference manual"
    p = load_profile(path)
    assert p.name == path.stem and path.stem in list_profiles()
    assert load_profile(path.stem) == p
    # Geometry: contiguous sectors from flash_start covering exactly flash_size.
    assert p.sectors[0].start == p.flash_start
    for i, (a, b) in enumerate(zip(p.sectors, p.sectors[1:], strict=False)):
        assert a.index == i and a.end == b.start
    assert p.sectors[-1].end == p.flash_end
    assert p.erase_unit_min == min(s.size for s in p.sectors)
    assert all(s.size % p.write_unit == 0 for s in p.sectors)
    # The bootloader's reserved RAM lies in a RAM region of the part.
    reserved = p.bootloader.ram_reserved
    region = p.ram_region_at(reserved.start)
    assert region is not None and reserved.stop <= region.end
    assert p.bootloader.parity == "E" and p.bootloader.baud == 115200
    assert p.reset.method in ("dtr-rts", "gpio", "manual")


def test_stm32f405_geometry() -> None:
    p = load_profile("stm32f405")
    assert p.chip_ids == (0x413,)
    assert (p.flash_start, p.flash_size) == (0x08000000, 1024 * KiB)
    sizes = [s.size for s in p.sectors]
    assert sizes == [16 * KiB] * 4 + [64 * KiB] + [128 * KiB] * 7
    assert p.sectors[5] == Sector(5, 0x08020000, 128 * KiB)
    assert p.bootloader.ram_reserved == range(0x20000000, 0x20003000)
    assert p.bootloader.ram_reserved_end == 0x20003000
    assert (p.reset.reset_line, p.reset.boot0_line) == ("dtr", "rts")
    assert load_profile("stm32f407").sectors == p.sectors


def test_stm32h750_geometry() -> None:
    p = load_profile("stm32h750vb")
    assert p.chip_ids == (0x450,)
    assert p.sectors == (Sector(0, 0x08000000, 128 * KiB),)
    assert p.write_unit == 32


@pytest.mark.parametrize(
    ("name", "chip_id", "page"),
    [
        ("stm32f103x6", 0x412, 1 * KiB),
        ("stm32f103x8", 0x410, 1 * KiB),
        ("stm32f103xb", 0x410, 1 * KiB),
        ("stm32f103xe", 0x414, 2 * KiB),
        ("stm32f107xc", 0x418, 2 * KiB),
        ("stm32f103xg", 0x430, 2 * KiB),
    ],
)
def test_stm32f1_pages(name: str, chip_id: int, page: int) -> None:
    p = load_profile(name)
    assert p.chip_ids == (chip_id,)
    assert {s.size for s in p.sectors} == {page}
    assert len(p.sectors) == p.flash_size // page
    assert p.write_unit == 2


def test_sector_lookup() -> None:
    p = load_profile("stm32f405")
    assert p.sector_at(0x08000000) == p.sectors[0]
    assert p.sector_at(0x08003FFF) == p.sectors[0]
    assert p.sector_at(0x08004000) == p.sectors[1]
    assert p.sector_at(0x080FFFFF) == p.sectors[11]
    assert p.sector_at(0x08100000) is None and p.sector_at(0x07FFFFFF) is None
    assert p.sectors_covering(0x08000000, 0x08004000) == (p.sectors[0],)
    assert p.sectors_covering(0x08003FFC, 0x08004004) == p.sectors[0:2]
    assert p.sectors_covering(0x08000000, 0x08100000) == p.sectors
    assert p.sectors_covering(0x08010000, 0x08010000) == ()
    assert p.sectors_covering(0x20000000, 0x20001000) == ()
    f1 = load_profile("stm32f103xg")
    assert f1.sectors_covering(0x08000400, 0x08001001) == f1.sectors[0:3]


def test_list_profiles_skips_host_boards(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "rpi4.toml").write_text('kind = "host"\n[agent]\nanything = "goes"\n')
    (tmp_path / "broken.toml").write_text("kind = \n")
    (tmp_path / "mcu.toml").write_text((profile_dir() / "stm32f405.toml").read_text())
    monkeypatch.setenv("FIRMWARE_TOOLS_PROFILE_DIR", str(tmp_path))
    assert profile_dir() == tmp_path
    assert list_profiles() == ["mcu"]
    with pytest.raises(ProfileError, match=r"rpi4\.toml: kind = 'host' describes a Linux host"):
        load_profile("rpi4")
    with pytest.raises(ProfileError, match=r"broken\.toml: not valid TOML"):
        load_profile("broken")


# --------------------------------------------------------------------------- bad files

GOOD = (profile_dir() / "stm32f405.toml").read_text()


def _bad(tmp_path: Path, text: str) -> ProfileError:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ProfileError) as info:
        load_profile(path)
    message = str(info.value)
    assert message.startswith(f"board profile {path}: ") and "Hint:" in message
    assert info.value.exit_code == 78 and isinstance(info.value, FirmwareError)
    return info.value


BAD_EDITS = [
    # (old, new, fragments expected in the message)
    ('kind = "mcu"', 'kind = "mcu"\ncolour = "blue"',
     ["top level: unknown key 'colour'", "valid keys are: kind, description, chip_ids"]),
    ("write_unit = 4 ", "write_units = 4 ",
     ["[flash]: unknown key 'write_units'", "valid keys are: start, size, write_unit"]),
    ("write_unit = 4 ", "write_unit = 3 ", ["write_unit = 3 is not a power of two"]),
    ("{ count = 7, size = 0x20000 }", "{ count = 6, size = 0x20000 }",
     ["sectors add up to 0xe0000 bytes but size is 0x100000"]),
    ("{ count = 1, size = 0x10000 }", "{ count = 1, size = 0x10000, erase_ms = 5 }",
     ["[flash] sectors[1]: unknown key 'erase_ms'", "valid keys are: count, size"]),
    ('parity = "E"', 'parity = "O"', ["[bootloader]: parity = 'O'", '"E" (8E1, AN3155)']),
    ("baud = 115200", "baud = true", ["`baud` = True is not an integer"]),
    ("chip_ids = [0x413]", "chip_ids = []", ["`chip_ids` = [] is not a non-empty list"]),
    ('boot0_line = "rts"', 'boot0_line = "dtr"', ["reset_line and boot0_line are the same"]),
    ('boot0_line = "rts"', 'boot0_line = "cts"', ["boot0_line = 'cts' with method dtr-rts"]),
    ('method = "dtr-rts"', 'method = "gpio"', ["reset_line = 'dtr' with method gpio"]),
    ('method = "dtr-rts"', 'method = "telepathy"', ["method = 'telepathy'", "dtr-rts, gpio"]),
    ("last = 0x20002FFF", "last = 0x1FFFFFFF", ["ram_reserved last 0x1fffffff < first"]),
    ('kind = "mcu"', 'kind = "mcus"', ["`kind` is 'mcus', expected one of mcu, host"]),
    ("mass_erase_timeout_s = 40.0", "mass_erase_timeout_s = -1",
     ["`mass_erase_timeout_s` = -1 is not a positive number"]),
]


@pytest.mark.parametrize(("old", "new", "fragments"), BAD_EDITS,
                         ids=[f"bad{i}" for i in range(len(BAD_EDITS))])
def test_bad_profile_is_rejected(tmp_path: Path, old: str, new: str, fragments: list[str]) -> None:
    assert old in GOOD
    message = str(_bad(tmp_path, GOOD.replace(old, new, 1)))
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} missing from: {message}"


def test_gpio_reset_needs_a_chip(tmp_path: Path) -> None:
    text = GOOD.replace('reset_line = "dtr"', "reset_line = 17").replace(
        'boot0_line = "rts"', "boot0_line = 27").replace('"dtr-rts"', '"gpio"')
    assert "[reset]: `gpio_chip` = None is not a string" in str(_bad(tmp_path, text))
    ok = tmp_path / "ok.toml"
    ok.write_text(text.replace("[reset]\n", '[reset]\ngpio_chip = "gpiochip0"\n'))
    reset = load_profile(ok).reset
    assert (reset.method, reset.gpio_chip, reset.reset_line, reset.boot0_line) == (
        "gpio", "gpiochip0", 17, 27)
    same = tmp_path / "same.toml"
    same.write_text(ok.read_text().replace("boot0_line = 27", "boot0_line = 17"))
    assert ("reset_line and boot0_line are the same line. Hint: wire NRST and BOOT0 to "
            "different lines (two offsets).") in str(_bad(tmp_path, same.read_text()))


def test_unknown_name_lists_profiles() -> None:
    with pytest.raises(ProfileError) as info:
        load_profile("stm32f999")
    message = str(info.value)
    assert "no file stm32f999.toml" in message
    assert "stm32f405" in message and "stm32h750vb" in message


def test_name_is_case_insensitive() -> None:
    assert load_profile("STM32F405").name == "stm32f405"


def test_missing_file_path() -> None:
    with pytest.raises(ProfileError, match=r"nowhere\.toml: cannot read it"):
        load_profile("/nonexistent/nowhere.toml")


def test_profile_is_frozen() -> None:
    p: McuProfile = load_profile("stm32f405")
    with pytest.raises(AttributeError):
        p.flash_size = 1  # type: ignore[misc]  # on purpose: a frozen profile refuses it
