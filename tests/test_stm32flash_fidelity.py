"""The simulator against a tool we did not write: Debian's stm32flash, over a real pty.

Facts checked here: stm32flash's default 8E1 fails on a pty (the kernel ignores PARENB there and
stm32flash checks the flags it set), `-m 8n1` works; stm32flash parses Get by its length byte,
so the simulator must send exactly N+1 bytes; it erases F4 sectors with Extended Erase (0x44).
Parity-E traffic from our client is tested over `socket://` to the TCP server instead.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import firmware
import pytest
from firmware import served

from firmware_tools.flasher import flash_elf, read_flash
from firmware_tools.profiles import load_profile

F405 = load_profile("stm32f405")


def stm32flash(*args: str) -> subprocess.CompletedProcess[str]:
    tool = firmware.require("stm32flash")
    return subprocess.run([tool, *args], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def fw(tmp_path_factory: pytest.TempPathFactory) -> firmware.FirmwareBuilder:
    return firmware.builder(tmp_path_factory)


@pytest.mark.tools
def test_stm32flash_writes_and_verifies_through_the_simulator(tmp_path: Path) -> None:
    image = os.urandom(40 * 1024 + 100)  # sectors 0, 1, 2 (16 KiB each) and a ragged end
    (tmp_path / "fw.bin").write_bytes(image)
    state = tmp_path / "flash.bin"
    with served(f"stm32sim://?chip=f405&state={state}", "--pty") as (pty, _):
        done = stm32flash("-m", "8n1", "-b", "115200", "-w", str(tmp_path / "fw.bin"), "-v", pty)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "Device ID    : 0x0413" in done.stdout
        assert re.search(r"Wrote and verified address 0x0800a064 \(100\.00%\)", done.stdout)
        # Read back through the same pty with our client (a second session: the chip is
        # already synced and answers our 0x7F with NACK).
        n = read_flash(F405, pty, tmp_path / "dump.bin", length=len(image) + 16)
    assert n == len(image) + 16
    dump = (tmp_path / "dump.bin").read_bytes()
    assert dump[: len(image)] == image and dump[len(image):] == b"\xff" * 16
    assert state.read_bytes()[: len(image)] == image


@pytest.mark.tools
def test_stm32flash_reads_what_we_flashed(fw: firmware.FirmwareBuilder, tmp_path: Path) -> None:
    image = fw.objcopy_bin().read_bytes()
    with served(f"stm32sim://?chip=f405&state={tmp_path / 'f.bin'}", "--pty") as (pty, _):
        result = flash_elf(fw.elf(), F405, pty, go=False)
        assert result.erased == [0]
        # a pty has no DTR/RTS: the profile's [reset] wiring cannot be driven, and it says so
        assert (f"{pty} has no modem control lines (Inappropriate ioctl for device): [reset] "
                "dtr/rts not driven; the board must be in its bootloader already (BOOT0 high, "
                "then reset)") in result.warnings, result.warnings
        out = tmp_path / "read.bin"
        done = stm32flash("-m", "8n1", "-r", str(out), "-S", f"0x08000000:{len(image)}", pty)
        assert done.returncode == 0, done.stdout + done.stderr
    assert out.read_bytes() == image


@pytest.mark.tools
def test_stm32flash_default_parity_fails_on_a_pty() -> None:
    with served("stm32sim://?chip=f405", "--pty") as (pty, _):
        done = stm32flash("-b", "115200", pty)
    assert done.returncode != 0
    assert "Failed to set terminal flags" in done.stderr


def test_parity_e_over_tcp_socket(fw: firmware.FirmwareBuilder, tmp_path: Path) -> None:
    state = tmp_path / "f.bin"
    assert F405.bootloader.parity == "E"
    with served(f"stm32sim://?chip=f405&state={state}", "--tcp", "0") as (addr, _):
        result = flash_elf(fw.elf(), F405, f"socket://{addr}", go=True)
    assert result.went and result.bytes_verified == fw.objcopy_bin().stat().st_size
    assert state.read_bytes().startswith(fw.objcopy_bin().read_bytes())


def test_pty_link_drop_ends_the_server(tmp_path: Path) -> None:
    with served("stm32sim://?chip=f405&drop_after=3", "--pty") as (pty, proc):
        fd = os.open(pty, os.O_RDWR | os.O_NOCTTY)
        try:
            os.write(fd, b"\x7f\x00\xff")
            assert proc.wait(timeout=10) == 0
            assert proc.stderr is not None and "dropped" in proc.stderr.read()
        finally:
            os.close(fd)


def test_server_rejects_bad_options() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "firmware_tools.simulator", "--pty", "--url",
         "stm32sim://?chip=f405&nack=oops"],
        capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 2 and done.stdout == ""
    assert "simulator option nack='oops': not an integer. Hint:" in done.stderr


def test_link_drop_over_a_pty_then_resume(fw: firmware.FirmwareBuilder, tmp_path: Path) -> None:
    from firmware_tools.bootloader import LinkError

    state, st = tmp_path / "f.bin", tmp_path / "st"
    with served(f"stm32sim://?chip=f405&state={state}&drop_after=300", "--pty") as (pty, _):
        with pytest.raises(LinkError, match=r"on /dev/pts/\d+: .*Hint: .*--resume"):
            flash_elf(fw.elf(), F405, pty, state_dir=st)
    with served(f"stm32sim://?chip=f405&state={state}", "--pty") as (pty, _):
        # Progress is keyed on the port: if the new pty got another name no journal matches
        # and --resume degrades to a normal run (read, erase, write, verify); either way the
        # job completes.
        result = flash_elf(fw.elf(), F405, pty, state_dir=st, resume=True)
    assert result.resumed == [] and result.bytes_verified == fw.objcopy_bin().stat().st_size
    assert state.read_bytes().startswith(fw.objcopy_bin().read_bytes())
    assert any("pseudo-terminal" in w for w in result.warnings)
