"""The AN3155 client against the simulator URL: exact bytes on the wire, and every fault knob."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import serial

import firmware_tools.simulator  # noqa: F401 - registers stm32sim://
from firmware_tools.an3155 import ProtocolError
from firmware_tools.bootloader import (
    Bootloader,
    BootloaderTimeout,
    ChipMismatchError,
    LinkError,
    NackError,
    ReadoutProtectedError,
    Timeouts,
    open_port,
)

FAST = Timeouts(ack=0.2, sync=0.1, write=0.2, sector_erase=0.2, mass_erase=0.5, read=0.2)


class Wire:
    """Records the bytes each way, merging consecutive transfers in the same direction."""

    def __init__(self) -> None:
        self.log: list[tuple[str, bytes]] = []

    def __call__(self, direction: str, data: bytes) -> None:
        if self.log and self.log[-1][0] == direction:
            self.log[-1] = (direction, self.log[-1][1] + data)
        else:
            self.log.append((direction, data))

    def text(self) -> list[str]:
        return [f"{d} {b.hex(' ')}" for d, b in self.log]


def connect(query: str = "chip=f405", timeouts: Timeouts = FAST) -> tuple[Bootloader, Wire]:
    wire = Wire()
    bl = Bootloader(open_port(f"stm32sim://?{query}"), timeouts=timeouts, trace=wire)
    return bl, wire


def test_handshake_bytes_f405() -> None:
    bl, wire = connect()
    bl.sync()
    info = bl.get()
    assert bl.get_id() == 0x413
    assert wire.text() == [
        "tx 7f",
        "rx 79",
        "tx 00 ff",
        # Get: ACK, N=11, v3.1, 11 commands (0x44, not 0x43), ACK
        "rx 79 0b 31 00 01 02 11 21 31 44 63 73 82 92 79",
        "tx 02 fd",
        "rx 79 01 04 13 79",
    ]
    assert info.version_text == "3.1" and bl.erase_command() == 0x44
    assert bl.get_version().version == 0x31


def test_second_sync_is_answered_with_nack() -> None:
    bl, wire = connect()
    bl.sync()
    assert not bl.already_synced
    bl.sync()
    assert bl.already_synced
    assert wire.text()[-2:] == ["tx 7f", "rx 1f"]


def test_f103_lists_plain_erase_and_uses_it() -> None:
    bl, wire = connect("chip=f103")
    bl.sync()
    assert bl.get().supports(0x43) and not bl.get().supports(0x44)
    bl.erase([2, 3])
    assert wire.text()[-4:] == ["tx 43 bc", "rx 79", "tx 01 02 03 00", "rx 79"]


def test_write_read_erase_bytes_on_the_wire() -> None:
    bl, wire = connect()
    bl.sync()
    bl.get()
    wire.log.clear()
    bl.erase([0, 1])
    bl.write_memory(0x08000000, b"\x01\x02\x03")
    assert bl.read_memory(0x08000000, 4) == b"\x01\x02\x03\xff"
    assert wire.text() == [
        "tx 44 bb", "rx 79", "tx 00 01 00 00 00 01 00", "rx 79",
        "tx 31 ce", "rx 79", "tx 08 00 00 00 08", "rx 79", "tx 03 01 02 03 ff fc", "rx 79",
        "tx 11 ee", "rx 79", "tx 08 00 00 00 08", "rx 79", "tx 03 fc", "rx 79 01 02 03 ff",
    ]


def test_programming_only_clears_bits() -> None:
    bl, _ = connect()
    bl.sync()
    bl.write_memory(0x08004000, b"\xf0\xf0\xff\xff")
    bl.write_memory(0x08004000, b"\x0f\xff\x00\xff")
    assert bl.read_memory(0x08004000, 4) == b"\x00\xf0\x00\xff"
    bl.erase([1])
    assert bl.read_memory(0x08004000, 4) == b"\xff" * 4


def test_reserved_ram_and_unmapped_addresses_are_refused() -> None:
    bl, _ = connect()
    bl.sync()
    with pytest.raises(NackError, match=r"WRITE_MEMORY at 0x20000100 \(4 bytes\).*NACK \(0x1F\) "
                       r"to the address: the address is not writable.*Hint:"):
        bl.write_memory(0x20000100, b"abcd")
    bl.write_memory(0x20003000, b"abcd")  # first byte after the 12 KiB the bootloader keeps
    assert bl.read_memory(0x20003000, 4) == b"abcd"
    with pytest.raises(NackError, match=r"READ_MEMORY at 0x60000000.*outside readable memory"):
        bl.read_memory(0x60000000, 4)
    with pytest.raises(ProtocolError, match=r"0x08000002.*not 4-byte aligned.*Hint:"):
        bl.write_memory(0x08000002, b"ab")


def test_nack_on_write_is_retried() -> None:
    bl, wire = connect("chip=f405&nack=0x31:2")
    bl.sync()
    bl.get()
    bl.write_memory(0x08000000, b"\x11\x22\x33\x44")
    assert bl.read_memory(0x08000000, 4) == b"\x11\x22\x33\x44"
    assert sum(1 for line in wire.text() if line == "tx 31 ce") == 3


def test_persistent_nack_on_write_gives_up_with_hint() -> None:
    bl, _ = connect("chip=f405&nack=0x31:all")
    bl.sync()
    with pytest.raises(NackError, match=r"WRITE_MEMORY at 0x08000000 \(4 bytes\).*NACK \(0x1F\) "
                       r"4 times\. Hint: .*write-protected"):
        bl.write_memory(0x08000000, b"abcd")


def test_silence_times_out_naming_the_command() -> None:
    bl, _ = connect("chip=f405&silence=0x02")
    bl.sync()
    t0 = time.monotonic()
    with pytest.raises(BootloaderTimeout, match=r"GET_ID \(0x02\) on stm32sim.*waited 0\.2 s for "
                       r"1 bytes, got nothing\. Hint: check that BOOT0"):
        bl.get_id()
    assert 0.15 < time.monotonic() - t0 < 1.0


def test_silent_chip_fails_sync_with_wiring_hint() -> None:
    bl, wire = connect("chip=f405&silence=sync")
    with pytest.raises(BootloaderTimeout, match=r"sync \(0x7F\).*no answer to two sync bytes.*"
                       r"BOOT0 is high.*8E1"):
        bl.sync()
    assert wire.text() == ["tx 7f 7f"]


def test_garbage_reply_is_a_protocol_error() -> None:
    bl, _ = connect("chip=f405&garbage=0x00")
    bl.sync()
    with pytest.raises(ProtocolError, match=r"GET \(0x00\).*expected ACK \(0x79\), got 0xA5.*"
                       r"Hint: noise or a wrong baud rate"):
        bl.get()


def test_byte_at_a_time_delivery() -> None:
    port = open_port("stm32sim://?chip=f405&bytewise=1", timeout=0.2)
    port.write(b"\x7f\x00\xff")
    # one byte per read, however many are asked for
    assert [port.read(16) for _ in range(4)] == [b"\x79", b"\x79", b"\x0b", b"\x31"]
    port.close()
    bl = Bootloader(open_port("stm32sim://?chip=f405&bytewise=1"), timeouts=FAST)
    bl.sync()
    assert bl.get().version == 0x31
    bl.erase([0], 0x44)
    bl.write_memory(0x08000000, bytes(range(256)))
    assert bl.read_memory(0x08000000, 256) == bytes(range(256))


def test_busy_bytes_are_waited_through() -> None:
    bl, wire = connect("chip=f405&busy=3")
    bl.sync()
    bl.erase([0], 0x44)
    bl.write_memory(0x08000000, b"abcd")
    assert "rx 76 76 76 79" in wire.text()


def test_slow_erase_needs_its_own_timeout() -> None:
    bl, _ = connect("chip=f405&erase_ms=300")
    bl.sync()
    with pytest.raises(BootloaderTimeout, match=r"EXTENDED_ERASE \(0x44\) of sectors 4-5 .*"
                       r"waited 0\.4 s"):
        bl.erase([4, 5], 0x44)
    bl2, _ = connect("chip=f405&erase_ms=100", Timeouts(sector_erase=1.0))
    bl2.sync()
    t0 = time.monotonic()
    bl2.erase([0, 1, 2], 0x44)
    assert time.monotonic() - t0 >= 0.29


def test_link_drop_is_a_link_error() -> None:
    bl, _ = connect("chip=f405&drop_after=20")
    bl.sync()
    bl.get()
    with pytest.raises(LinkError, match=r"WRITE_MEMORY at 0x08000000 \(256 bytes\).*link dropped.*"
                       r"--resume"):
        bl.write_memory(0x08000000, bytes(256))


def test_readout_protection_is_explained_and_unprotect_erases(tmp_path: Path) -> None:
    state = tmp_path / "flash.bin"
    state.write_bytes(b"\x00" * 64)
    bl, _ = connect(f"chip=f405&rdp=1&state={state}")
    bl.sync()
    bl.get()
    with pytest.raises(ReadoutProtectedError, match=r"READ_MEMORY.*refused READ_MEMORY \(0x11\) "
                       r"with NACK.*readout protection.*Readout Unprotect \(0x92\).*MASS-ERASES"):
        bl.read_memory(0x08000000, 16)
    with pytest.raises(ReadoutProtectedError):
        bl.write_memory(0x08000000, b"abcd")
    bl.readout_unprotect()
    bl.sync()  # the chip reset after unprotecting
    assert not bl.already_synced
    assert bl.read_memory(0x08000000, 64) == b"\xff" * 64
    assert state.read_bytes()[:64] == b"\xff" * 64


def test_wrong_chip_lists_expected_ids() -> None:
    bl, _ = connect("chip=f103")
    bl.sync()
    with pytest.raises(ChipMismatchError, match=r"chip id is 0x410, but board profile 'stm32f405' "
                       r"expects 0x413\. Hint: pick the profile"):
        bl.check_chip([0x413], "stm32f405")
    assert bl.check_chip([0x412, 0x410], "stm32f103x8") == 0x410


def test_state_file_persists_flash_across_opens(tmp_path: Path) -> None:
    url = f"chip=f405&state={tmp_path / 'f.bin'}"
    bl, _ = connect(url)
    bl.sync()
    bl.write_memory(0x08000100, b"keep")
    bl.close()
    bl, _ = connect(url)
    bl.sync()
    assert bl.read_memory(0x08000100, 4) == b"keep"
    assert (tmp_path / "f.bin").stat().st_size == 1024 * 1024


def test_injected_port_object_and_go() -> None:
    port = serial.serial_for_url("stm32sim://?chip=h750", timeout=0.2)
    bl = Bootloader(port, timeouts=FAST)
    bl.sync()
    assert bl.get_id() == 0x450
    bl.go(0x08000000)
    assert port.sim.running_at == 0x08000000


@pytest.mark.parametrize(("url", "match"), [
    ("stm32sim://?chip=f405&nak=0x31", r"simulator option 'nak' is unknown.*valid options are "
     r"chip, board, state, reset, boot0, reset_invert, boot0_invert, nack"),
    ("stm32sim://?reset=dtr", r"simulator option boot0='' is not a modem line.*"
     r"reset=dtr&boot0=rts"),
    ("stm32sim://?reset=cts&boot0=rts", r"option reset='cts' is not a modem line"),
    ("stm32sim://?reset=rts&boot0=rts", r"reset and boot0 are both rts.*different lines"),
    ("stm32sim://?reset=dtr&boot0=rts&boot0_invert=maybe",
     r"boot0_invert='maybe' is not a boolean"),
    ("stm32sim://?chip=f999", r"simulator chip 'f999' is unknown.*f103, f405"),
    ("stm32sim://?nack=x31", r"nack='x31'.*not an integer"),
    ("/dev/nonexistent-tty", r"opening serial port '/dev/nonexistent-tty'.*Hint: check"),
])
def test_bad_simulator_options_are_named(url: str, match: str) -> None:
    with pytest.raises(LinkError, match=match):
        open_port(url)


def test_board_profile_gives_the_sector_map() -> None:
    bl, _ = connect("board=stm32f103x8")
    bl.sync()
    assert bl.get_id() in (0x410,)
    assert bl.erase_command() == 0x43
    bl.erase([63])  # 64 pages of 1 KiB
    with pytest.raises(NackError, match=r"ERASE \(0x43\) of sectors 64 .*NACK \(0x1F\)\. "
                       r"Hint: .*sector this chip does not have"):
        bl.erase([64])


def test_large_erases_are_split_into_255_page_commands() -> None:
    from firmware_tools.profiles import load_profile

    profile = load_profile("stm32f103xe")  # 512 KiB in 2 KiB pages: 256 pages
    assert len(profile.sectors) == 256
    bl, wire = connect("board=stm32f103xe")
    bl.sync()
    assert bl.erase_command() == 0x43
    bl.write_memory(0x0807F800, b"abcd")  # last page
    wire.log.clear()
    bl.erase(list(range(len(profile.sectors))))
    commands = [line for line in wire.text() if line == "tx 43 bc"]
    assert len(commands) == 2  # 255 pages, then 1 (a one-byte count holds at most 255)
    assert wire.text()[-2:] == ["tx 00 ff ff", "rx 79"]  # count-1 = 0, page 255, XOR
    assert bl.read_memory(0x0807F800, 4) == b"\xff" * 4
