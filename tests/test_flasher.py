"""flash_elf / read_flash against the simulator: skip, verify, journal and resume, faults."""

from __future__ import annotations

import json
from pathlib import Path

import firmware
import pytest

from firmware_tools.bootloader import ChipMismatchError, LinkError, ReadoutProtectedError
from firmware_tools.errors import FirmwareError
from firmware_tools.flasher import (
    FlashError,
    VerifyError,
    flash_elf,
    journal_path,
    port_identity,
    read_flash,
)
from firmware_tools.profiles import load_profile

F405 = load_profile("stm32f405")


@pytest.fixture(scope="module")
def fw(tmp_path_factory: pytest.TempPathFactory) -> firmware.FirmwareBuilder:
    return firmware.builder(tmp_path_factory)


def sim(state: Path, extra: str = "") -> str:
    return f"stm32sim://?chip=f405&state={state}" + (f"&{extra}" if extra else "")


def test_flash_writes_verifies_and_goes(fw: firmware.FirmwareBuilder, tmp_path: Path) -> None:
    state = tmp_path / "flash.bin"
    events: list[tuple[int, int, str]] = []
    result = flash_elf(fw.elf(), F405, sim(state), state_dir=tmp_path / "st",
                       progress=lambda d, t, p: events.append((d, t, p)))
    image = fw.objcopy_bin().read_bytes()
    flash = state.read_bytes()
    assert flash[: len(image)] == image
    assert flash[len(image):] == b"\xff" * (len(flash) - len(image))
    assert result.sectors == [0] and result.erased == [0] and result.skipped == []
    assert result.bytes_written == result.bytes_verified == len(image)
    assert result.went and result.chip_id == 0x413 and result.erase_command == 0x44
    assert result.to_dict()["base"] == "0x08000000"
    assert result.journal is None  # the progress file is removed once the job completed
    phases = [p for _, _, p in events]
    assert {"read", "erase", "write", "verify"} <= set(phases) and phases[-1] == "done"
    dones = [d for d, _, _ in events]
    assert dones == sorted(dones) and events[-1][:2] == (len(image), len(image))


def test_reflash_of_the_same_image_touches_nothing(
    fw: firmware.FirmwareBuilder, tmp_path: Path
) -> None:
    state = tmp_path / "flash.bin"
    flash_elf(fw.elf(), F405, sim(state), go=False)
    again = flash_elf(fw.elf(), F405, sim(state), go=False)
    assert again.skipped == [0] and again.erased == [] and again.bytes_written == 0
    assert not again.went
    # One changed byte in the image's range: the sector is erased and written again.
    flash = bytearray(state.read_bytes())
    flash[0x40] ^= 0xFF
    state.write_bytes(bytes(flash))
    third = flash_elf(fw.elf(), F405, sim(state), go=False)
    assert third.erased == [0] and third.skipped == []
    assert state.read_bytes()[:0x100] == fw.objcopy_bin().read_bytes()[:0x100]


def test_dry_run_opens_no_port(fw: firmware.FirmwareBuilder) -> None:
    result = flash_elf(fw.elf(), F405, "/dev/this-port-does-not-exist", dry_run=True)
    assert result.dry_run and result.sectors == [0] and result.bytes_written == 0
    assert result.chip_id is None and not result.went


def test_link_drop_then_resume_finishes(fw: firmware.FirmwareBuilder, tmp_path: Path) -> None:
    big = fw.elf("big")
    state, st = tmp_path / "flash.bin", tmp_path / "st"
    with pytest.raises(LinkError, match=r"link dropped.*--resume"):
        flash_elf(big, F405, sim(state, "drop_after=400000"), state_dir=st, go=False)
    image = fw.objcopy_bin("big").read_bytes()
    journals = list((st / "flash").glob("*.json"))
    assert len(journals) == 1
    doc = json.loads(journals[0].read_text())
    done = sorted(int(k) for k, v in doc["sectors"].items() if v == "verified")
    erased = sorted(int(k) for k, v in doc["sectors"].items() if v == "erased")
    # One erase command for all sectors came first; the drop hit while writing sector 6.
    assert done == [0, 1, 2, 3, 4, 5] and erased == [6, 7, 8, 9, 10, 11]
    assert journals[0] == journal_path(st, doc["image_sha256"], "stm32f405", sim(state))

    result = flash_elf(big, F405, sim(state), state_dir=st, resume=True)
    assert result.resumed == done
    assert result.erased == []  # erased sectors keep their written blocks: no second erase
    assert result.skipped == []
    assert 0 < result.bytes_written < len(image) - 256 * 1024  # sectors 0-5 hold 256 KiB
    assert state.read_bytes()[: len(image)] == image
    assert not journals[0].exists()


def test_resume_rewrites_a_verified_sector_that_changed_since(
        fw: firmware.FirmwareBuilder, tmp_path: Path) -> None:
    # interrupted, then sector 0 (verified by the interrupted run) is written over by
    # something else: --resume used to fail its read-back on every run ("the flash cell is
    # worn"); it now erases and writes that sector again and finishes
    big = fw.elf("big")
    state, st = tmp_path / "flash.bin", tmp_path / "st"
    with pytest.raises(LinkError):
        flash_elf(big, F405, sim(state, "drop_after=400000"), state_dir=st, go=False)
    flash = bytearray(state.read_bytes())
    flash[0x100:0x110] = bytes(16)  # flash bits only go 1 -> 0 without an erase
    state.write_bytes(bytes(flash))
    result = flash_elf(big, F405, sim(state), state_dir=st, resume=True)
    image = fw.objcopy_bin("big").read_bytes()
    assert state.read_bytes()[: len(image)] == image
    assert 0 not in result.resumed and result.resumed == [1, 2, 3, 4, 5]
    assert result.erased == [0]
    assert not list((st / "flash").glob("*.json"))  # finished: no progress file left


def test_resume_elsewhere_finishes_by_reading_before_erase(
    fw: firmware.FirmwareBuilder, tmp_path: Path
) -> None:
    # Interrupted with one state directory (e.g. the CLI's), resumed with another (the
    # daemon's): the finished sectors are found by reading them, not rewritten.
    big = fw.elf("big")
    state = tmp_path / "flash.bin"
    with pytest.raises(LinkError, match=r"link dropped"):
        flash_elf(big, F405, sim(state, "drop_after=400000"), state_dir=tmp_path / "cli",
                  go=False)
    result = flash_elf(big, F405, sim(state), state_dir=tmp_path / "daemon", resume=True)
    image = fw.objcopy_bin("big").read_bytes()
    assert result.resumed == [] and result.skipped == [0, 1, 2, 3, 4, 5]
    assert result.erased == [6, 7, 8, 9, 10, 11]
    assert state.read_bytes()[: len(image)] == image
    assert any("every sector is read first" in w for w in result.warnings)


def test_resume_without_journal_is_a_normal_run(
    fw: firmware.FirmwareBuilder, tmp_path: Path
) -> None:
    result = flash_elf(fw.elf(), F405, sim(tmp_path / "f.bin"), state_dir=tmp_path, resume=True)
    assert result.resumed == [] and result.erased == [0]
    assert any("resume: no progress of an interrupted job" in w for w in result.warnings)
    with pytest.raises(FlashError, match=r"resume: no state directory.*Hint: pass state_dir"):
        flash_elf(fw.elf(), F405, sim(tmp_path / "f.bin"), resume=True)


def test_verify_mismatch_names_the_address(fw: firmware.FirmwareBuilder, tmp_path: Path) -> None:
    with pytest.raises(VerifyError, match=r"verify of sector 0 on stm32sim.*byte at 0x08000011 "
                       r"reads 0x[0-9A-F]{2}, wrote 0x[0-9A-F]{2}\. Hint: run the flash again"):
        flash_elf(fw.elf(), F405, sim(tmp_path / "f.bin", "corrupt=0x08000011"))


def test_nack_on_write_is_retried_by_the_job(
    fw: firmware.FirmwareBuilder, tmp_path: Path
) -> None:
    state = tmp_path / "f.bin"
    result = flash_elf(fw.elf(), F405, sim(state, "nack=0x31:3&busy=2&bytewise=1"))
    assert result.erased == [0]
    assert state.read_bytes()[:64] == fw.objcopy_bin().read_bytes()[:64]


def test_readout_protected_chip_is_explained(fw: firmware.FirmwareBuilder, tmp_path: Path) -> None:
    with pytest.raises(ReadoutProtectedError, match=r"readout protection.*MASS-ERASES"):
        flash_elf(fw.elf(), F405, sim(tmp_path / "f.bin", "rdp=1"))


def test_wrong_chip_stops_before_writing(fw: firmware.FirmwareBuilder, tmp_path: Path) -> None:
    state = tmp_path / "f.bin"
    with pytest.raises(ChipMismatchError, match=r"chip id is 0x410, but board profile "
                       r"'stm32f405' expects 0x413"):
        flash_elf(fw.elf(), F405, f"stm32sim://?chip=f103&state={state}")
    assert state.read_bytes() == b"\xff" * (128 * 1024)


def test_read_flash(fw: firmware.FirmwareBuilder, tmp_path: Path) -> None:
    state = tmp_path / "f.bin"
    flash_elf(fw.elf(), F405, sim(state))
    out = tmp_path / "dump.bin"
    seen: list[int] = []
    n = read_flash(F405, sim(state), out, address=0x08000000, length=1000,
                   progress=lambda d, t, p: seen.append(d))
    assert n == 1000 and out.read_bytes() == state.read_bytes()[:1000]
    assert seen == [256, 512, 768, 1000]
    with pytest.raises(FlashError, match=r"read of 0 bytes at 0x08000000.*Hint:"):
        read_flash(F405, sim(state), out, length=0)


def test_read_flash_refuses_a_dump_path_it_cannot_write_before_reading(
        fw: firmware.FirmwareBuilder, tmp_path: Path) -> None:
    state = tmp_path / "f.bin"
    flash_elf(fw.elf(), F405, sim(state))
    reads: list[int] = []
    # the board is never asked: a read of the whole flash at 115200 baud takes minutes
    for out, text in [(tmp_path, r"dump file '.*' is a directory\. Hint: name a file in it"),
                      (tmp_path / "nowhere" / "d.bin", r"dump file '.*/nowhere/d\.bin' cannot "
                       r"be written: No such file or directory .*Hint: name a file in an "
                       r"existing directory")]:
        with pytest.raises(FlashError, match=text):
            read_flash(F405, sim(state), out, progress=lambda d, t, p: reads.append(d))
    assert reads == []
    assert not (tmp_path.parent / (tmp_path.name + ".tmp")).exists()
    # a read that fails half way leaves neither the dump nor its temporary file
    out = tmp_path / "dump.bin"
    with pytest.raises(FirmwareError):
        read_flash(F405, sim(state, "&drop_after=40"), out, length=4096)
    assert not out.exists() and not (tmp_path / "dump.bin.tmp").exists()


def test_port_identity_ignores_fault_knobs() -> None:
    assert port_identity("stm32sim://?chip=f405&state=/x/f.bin&drop_after=9") == port_identity(
        "stm32sim://?state=/x/f.bin&nack=0x31&chip=f405"
    )
    assert port_identity("socket://localhost:7000?logging=debug") == "socket://localhost:7000"


# --- NRST and BOOT0 on DTR and RTS ([reset] method = "dtr-rts") ---------------------------------

WIRED = "reset=dtr&boot0=rts"  # the wiring the shipped profiles describe


def _profile_with(tmp_path: Path, reset: str) -> object:
    """stm32f405 with another [reset] table."""
    from firmware_tools.profiles import profile_dir

    text = (profile_dir() / "stm32f405.toml").read_text()
    head, _, rest = text.partition("[reset]")
    tail = rest[rest.find("\n["):] if "\n[" in rest else ""
    path = tmp_path / "board.toml"
    path.write_text(f"{head}[reset]\n{reset}\n{tail}")
    return load_profile(str(path))


def test_a_wired_board_is_reset_into_its_bootloader_and_left_to_boot_the_image(
        fw: firmware.FirmwareBuilder, tmp_path: Path) -> None:
    import serial

    from firmware_tools.bootloader import open_port
    from firmware_tools.reset_lines import open_levels

    # a wired board powers up running its application: nothing answers 0x7F. pyserial's
    # default open (both lines asserted) holds it in reset; the profile's levels release it
    port = serial.serial_for_url(sim(tmp_path / "a.bin", WIRED), timeout=0.2)
    assert port.sim.in_reset and port.sim.log == ["BOOT application", "RESET"]
    port.close()
    port = open_port(sim(tmp_path / "a.bin", WIRED), levels=open_levels(F405.reset))
    assert not port.sim.in_reset and port.sim.running_at == F405.flash_start
    port.write(b"\x7f")
    assert port.read(1) == b""  # the application does not speak AN3155
    # the flash resets it into the bootloader, flashes, releases BOOT0 and goes
    result = flash_elf(fw.elf(), F405, port)
    assert result.went and result.warnings == []
    assert port.sim.log[:4] == ["BOOT application", "RESET", "BOOT bootloader", "GET (0x00)"]
    assert port.rts is False  # BOOT0 low: a reset now boots the new image
    port.dtr = True
    port.dtr = False
    assert port.sim.log[-2:] == ["RESET", "BOOT application"]
    assert port.sim.running_at == F405.flash_start
    port.close()
    image = fw.objcopy_bin().read_bytes()
    assert (tmp_path / "a.bin").read_bytes()[: len(image)] == image


def test_a_read_of_a_wired_board_leaves_it_running_its_application(
        fw: firmware.FirmwareBuilder, tmp_path: Path) -> None:
    from firmware_tools.bootloader import open_port
    from firmware_tools.reset_lines import open_levels

    flash_elf(fw.elf(), F405, sim(tmp_path / "f.bin", WIRED))  # a URL: opened and closed
    port = open_port(sim(tmp_path / "f.bin", WIRED), levels=open_levels(F405.reset))
    read_flash(F405, port, tmp_path / "dump.bin", length=64)
    assert port.sim.log[-2:] == ["RESET", "BOOT application"]
    assert (tmp_path / "dump.bin").read_bytes() == fw.objcopy_bin().read_bytes()[:64]


def test_the_profiles_polarity_must_match_the_board(
        fw: firmware.FirmwareBuilder, tmp_path: Path) -> None:
    from firmware_tools.bootloader import BootloaderTimeout

    # NRST behind an inverter: the shipped profile holds the chip in reset, and the error
    # says what to check; a profile with reset_invert = true flashes it
    board = sim(tmp_path / "f.bin", WIRED + "&reset_invert=1")
    with pytest.raises(BootloaderTimeout, match=r"no answer to two sync bytes.*Hint: check "
                       r"that BOOT0 is high.*This board profile \(stm32f405\) reset the chip "
                       r"through the adapter: NRST on dtr, BOOT0 on rts; .*reset_invert"):
        flash_elf(fw.elf(), F405, board)
    inverted = _profile_with(tmp_path, 'method = "dtr-rts"\nreset_line = "dtr"\n'
                             'boot0_line = "rts"\nreset_invert = true')
    assert flash_elf(fw.elf(), inverted, board).went
    # wired the other way round (NRST on RTS, BOOT0 on DTR): a profile saying so works too
    swapped = _profile_with(tmp_path, 'method = "dtr-rts"\nreset_line = "rts"\n'
                            'boot0_line = "dtr"')
    assert flash_elf(fw.elf(), swapped, sim(tmp_path / "g.bin", "reset=rts&boot0=dtr")).went


def test_a_manual_profile_leaves_the_lines_alone(
        fw: firmware.FirmwareBuilder, tmp_path: Path) -> None:
    from firmware_tools.bootloader import BootloaderTimeout

    manual = _profile_with(tmp_path, 'method = "manual"')
    with pytest.raises(BootloaderTimeout) as e:  # it runs its application; nobody reset it
        flash_elf(fw.elf(), manual, sim(tmp_path / "f.bin", WIRED))
    assert "This board profile" not in str(e.value)
    assert flash_elf(fw.elf(), manual, sim(tmp_path / "f.bin")).went  # one reset by hand
    from firmware_tools.gpio_lines import GpioError

    # wired to a GPIO chip this host does not have (driven for real: tests/test_qemu_flash.py)
    gpio = _profile_with(tmp_path, 'method = "gpio"\ngpio_chip = "no-such-chip"\n'
                         'reset_line = 3\nboot0_line = 4')
    with pytest.raises(GpioError) as g:
        flash_elf(fw.elf(), gpio, sim(tmp_path / "g.bin"))
    assert str(g.value).startswith("GPIO chip 'no-such-chip': no chip with that name or label")
    assert "Hint: set gpio_chip under [reset]" in str(g.value)
    assert (tmp_path / "g.bin").read_bytes().count(0xFF) == len((tmp_path / "g.bin").read_bytes())
