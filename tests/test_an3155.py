"""AN3155 frames, byte for byte.

Reference sequences: ST AN3155 (Get `00 FF`, Read Memory `11 EE`, Write Memory `31 CE`,
Extended Erase `44 BB`, Go `21 DE`, mass erase `FF FF 00`) and stm32flash's stm32.c, which
builds the same frames (address MSB first + XOR; write `N-1, data, XOR(N-1, data)` with 0xFF
padding to 4 bytes; extended erase `(N-1)>>8, (N-1)&FF, pages as 2 bytes, XOR`).
"""

from __future__ import annotations

import pytest

from firmware_tools import an3155
from firmware_tools.an3155 import Command, ProtocolError


@pytest.mark.parametrize(
    ("code", "wire"),
    [
        (Command.GET, "00 ff"),
        (Command.GET_VERSION, "01 fe"),
        (Command.GET_ID, "02 fd"),
        (Command.READ_MEMORY, "11 ee"),
        (Command.GO, "21 de"),
        (Command.WRITE_MEMORY, "31 ce"),
        (Command.ERASE, "43 bc"),
        (Command.EXTENDED_ERASE, "44 bb"),
        (Command.READOUT_UNPROTECT, "92 6d"),
    ],
)
def test_command_frames(code: int, wire: str) -> None:
    assert an3155.encode_command(code).hex(" ") == wire


def test_address_frame_is_msb_first_with_xor() -> None:
    assert an3155.encode_address(0x08000000).hex(" ") == "08 00 00 00 08"
    assert an3155.encode_address(0x08001234).hex(" ") == "08 00 12 34 2e"  # 08^00^12^34
    assert an3155.encode_address(0x20003000).hex(" ") == "20 00 30 00 10"
    assert an3155.decode_address(bytes.fromhex("0800123 42e".replace(" ", ""))) == 0x08001234


def test_address_out_of_range_and_bad_checksum() -> None:
    with pytest.raises(ProtocolError, match=r"0x100000000 does not fit in 32 bits.*Hint:"):
        an3155.encode_address(1 << 32)
    with pytest.raises(ProtocolError, match="bad checksum"):
        an3155.decode_address(bytes.fromhex("0800000000"))
    with pytest.raises(ProtocolError, match="has 4 bytes, expected 5"):
        an3155.decode_address(b"\x08\x00\x00\x00")


def test_read_length_frame() -> None:
    assert an3155.encode_length(256).hex(" ") == "ff 00"
    assert an3155.encode_length(1).hex(" ") == "00 ff"
    assert an3155.encode_length(16).hex(" ") == "0f f0"
    assert an3155.decode_length(b"\x0f\xf0") == 16
    for bad in (0, 257):
        with pytest.raises(ProtocolError, match=r"outside 1\.\.256.*Hint:"):
            an3155.encode_length(bad)
    with pytest.raises(ProtocolError, match="is not `N, ~N`"):
        an3155.decode_length(b"\x0f\x0f")


def test_write_frame_pads_with_ff_to_four_bytes() -> None:
    # 3 bytes -> padded to 4: N-1 = 3, data 01 02 03 ff, XOR = 03^01^02^03^ff = fc
    assert an3155.encode_write_data(b"\x01\x02\x03").hex(" ") == "03 01 02 03 ff fc"
    frame = an3155.encode_write_data(bytes(range(256)))
    assert len(frame) == 258 and frame[0] == 0xFF
    assert frame[-1] == an3155.checksum(frame[:-1])
    assert an3155.decode_write_data(frame) == bytes(range(256))
    with pytest.raises(ProtocolError, match=r"write of 257 bytes.*Hint: split"):
        an3155.encode_write_data(bytes(257))
    with pytest.raises(ProtocolError, match="write of 0 bytes"):
        an3155.encode_write_data(b"")
    with pytest.raises(ProtocolError, match="bad checksum"):
        an3155.decode_write_data(frame[:-1] + bytes((frame[-1] ^ 1,)))


def test_extended_erase_frames() -> None:
    # sectors 0 and 1: count-1 = 00 01, pages 00 00 00 01, XOR = 00^01^00^00^00^01 = 00
    assert an3155.encode_extended_erase([0, 1]).hex(" ") == "00 01 00 00 00 01 00"
    # sector 11 of an F4: 00 00 00 0b 0b
    assert an3155.encode_extended_erase([11]).hex(" ") == "00 00 00 0b 0b"
    # one sector, number 5: 00 00 00 05 05
    assert an3155.encode_extended_erase([5]).hex(" ") == "00 00 00 05 05"
    assert an3155.encode_extended_erase_special(0xFFFF).hex(" ") == "ff ff 00"
    assert an3155.encode_extended_erase_special(0xFFFE).hex(" ") == "ff fe 01"
    assert an3155.decode_extended_erase(bytes.fromhex("00010000000100")) == [0, 1]
    with pytest.raises(ProtocolError, match="not an Extended Erase special code"):
        an3155.encode_extended_erase_special(0x1234)
    with pytest.raises(ProtocolError, match="page number 65520"):
        an3155.encode_extended_erase([0xFFF0])
    with pytest.raises(ProtocolError, match="malformed"):
        an3155.decode_extended_erase(bytes.fromhex("00010000000101"))


def test_erase_0x43_frames() -> None:
    # pages 2, 3: N-1 = 01, 02 03, XOR = 01^02^03 = 00
    assert an3155.encode_erase([2, 3]).hex(" ") == "01 02 03 00"
    assert an3155.encode_erase_global().hex(" ") == "ff 00"
    assert an3155.decode_erase_pages(bytes.fromhex("01020300")) == [2, 3]
    with pytest.raises(ProtocolError, match=r"one frame holds 1\.\.255 pages"):
        an3155.encode_erase(list(range(256)))
    with pytest.raises(ProtocolError, match="page number for Erase"):
        an3155.encode_erase([300])


def test_parse_get_f4_v31() -> None:
    # What an STM32F405 (bootloader v3.1) sends between the ACKs (AN3155 / AN2606).
    payload = bytes.fromhex("0b 31 00 01 02 11 21 31 44 63 73 82 92".replace(" ", ""))
    info = an3155.parse_get(payload)
    assert info.version == 0x31 and info.version_text == "3.1"
    assert info.supports(0x44) and not info.supports(0x43)
    assert an3155.erase_command_of(info) == 0x44
    assert an3155.encode_get_reply(0x31, info.commands) == payload
    with pytest.raises(ProtocolError, match="length byte promises 13"):
        an3155.parse_get(payload[:-1])


def test_erase_command_choice_and_absence() -> None:
    f1 = an3155.GetInfo(0x22, (0x00, 0x01, 0x02, 0x11, 0x21, 0x31, 0x43))
    assert an3155.erase_command_of(f1) == 0x43
    with pytest.raises(ProtocolError, match=r"neither Erase \(0x43\) nor Extended.*Hint:"):
        an3155.erase_command_of(an3155.GetInfo(0x31, (0x00, 0x01)))


def test_parse_get_id_and_version() -> None:
    assert an3155.parse_get_id(bytes.fromhex("010413")) == 0x413
    assert an3155.encode_get_id_reply(0x450).hex(" ") == "01 04 50"
    with pytest.raises(ProtocolError, match="malformed"):
        an3155.parse_get_id(bytes.fromhex("0104"))
    assert an3155.parse_get_version(b"\x31\x00\x00") == an3155.VersionInfo(0x31, 0, 0)
    with pytest.raises(ProtocolError, match="has 2 bytes, expected 3"):
        an3155.parse_get_version(b"\x31\x00")


def test_command_name() -> None:
    assert an3155.command_name(0x31) == "WRITE_MEMORY (0x31)"
    assert an3155.command_name(0xA1) == "0xA1"
