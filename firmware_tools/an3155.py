"""STM32 system bootloader UART protocol (ST application note AN3155), sans-IO.

Only bytes in, bytes out: nothing here touches a port or a clock, so the host side
(`firmware_tools.bootloader`) and the board side (`firmware_tools.simulator`) share one
definition of every frame.

Invariants this module owns:
- A command frame is `cmd, cmd ^ 0xFF`; every other host frame ends with the XOR of its bytes
  (a single byte N is sent as `N, N ^ 0xFF`, i.e. its own checksum seeded with 0xFF).
- Addresses are 4 bytes, most significant first, followed by their XOR.
- Write Memory carries 1..256 bytes, padded with 0xFF to a multiple of 4, sent as
  `N-1, data..., XOR(N-1, data...)`.
- Erase (0x43) takes 1-byte page numbers (at most 255 of them in one frame);
  Extended Erase (0x44) takes 2-byte page numbers, count-1 as 2 bytes, MSB first.
- Replies: ACK 0x79, NACK 0x1F; newer bootloaders send BUSY 0x76 while a long operation runs.
  Get answers `N, version, N commands`; Get ID answers `N, PID (N+1 bytes)`; Get Version
  answers exactly 3 bytes on UART.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from firmware_tools.errors import FirmwareError

__all__ = [
    "ACK",
    "NACK",
    "BUSY",
    "SYNC",
    "MAX_TRANSFER",
    "Command",
    "ProtocolError",
    "GetInfo",
    "VersionInfo",
    "checksum",
    "command_name",
    "encode_command",
    "encode_address",
    "encode_length",
    "encode_write_data",
    "encode_erase",
    "encode_erase_global",
    "encode_extended_erase",
    "encode_extended_erase_special",
    "decode_address",
    "decode_length",
    "decode_write_data",
    "decode_erase_pages",
    "decode_extended_erase",
    "encode_get_reply",
    "encode_get_id_reply",
    "parse_get",
    "parse_get_version",
    "parse_get_id",
    "erase_command_of",
    "EXTENDED_ERASE_MASS",
    "EXTENDED_ERASE_BANK1",
    "EXTENDED_ERASE_BANK2",
]

ACK = 0x79
NACK = 0x1F
BUSY = 0x76
SYNC = 0x7F
MAX_TRANSFER = 256

EXTENDED_ERASE_MASS = 0xFFFF
EXTENDED_ERASE_BANK1 = 0xFFFE
EXTENDED_ERASE_BANK2 = 0xFFFD


class Command(enum.IntEnum):
    GET = 0x00
    GET_VERSION = 0x01
    GET_ID = 0x02
    READ_MEMORY = 0x11
    GO = 0x21
    WRITE_MEMORY = 0x31
    ERASE = 0x43
    EXTENDED_ERASE = 0x44
    WRITE_PROTECT = 0x63
    WRITE_UNPROTECT = 0x73
    READOUT_PROTECT = 0x82
    READOUT_UNPROTECT = 0x92


class ProtocolError(FirmwareError, ValueError):
    """A frame that breaks AN3155 (bad length, bad checksum, unexpected reply byte)."""


def command_name(code: int) -> str:
    """`WRITE_MEMORY (0x31)` for a known command, `0xNN` otherwise."""
    try:
        return f"{Command(code).name} (0x{code:02X})"
    except ValueError:
        return f"0x{code:02X}"


def checksum(data: Iterable[int], seed: int = 0) -> int:
    """XOR of all bytes (AN3155's only checksum)."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        # Fold the bytes as one integer: a few big-int operations instead of a loop per byte.
        value = int.from_bytes(data, "little")
        width = len(data)
        while width > 1:
            half = (width + 1) // 2
            value = (value & ((1 << (8 * half)) - 1)) ^ (value >> (8 * half))
            width = half
        return (value ^ seed) & 0xFF if data else seed
    value = seed
    for byte in data:
        value ^= byte
    return value


def encode_command(code: int) -> bytes:
    """`cmd, ~cmd`: Get is `00 FF`, Write Memory is `31 CE`."""
    _check_byte(code, "command")
    return bytes((code, code ^ 0xFF))


def encode_address(address: int) -> bytes:
    """Four address bytes MSB first, then their XOR: 0x08000000 -> `08 00 00 00 08`."""
    if not 0 <= address <= 0xFFFFFFFF:
        raise ProtocolError(
            f"address 0x{address:X} does not fit in 32 bits. "
            "Hint: STM32 addresses are 32-bit; check the image base."
        )
    raw = address.to_bytes(4, "big")
    return raw + bytes((checksum(raw),))


def encode_length(length: int) -> bytes:
    """Read Memory length frame: `N-1, ~(N-1)`; 256 bytes is `FF 00`."""
    if not 1 <= length <= MAX_TRANSFER:
        raise ProtocolError(
            f"transfer of {length} bytes is outside 1..{MAX_TRANSFER}. "
            "Hint: split reads into blocks of at most 256 bytes."
        )
    return bytes((length - 1, (length - 1) ^ 0xFF))


def encode_write_data(data: bytes) -> bytes:
    """Write Memory payload: pad to a multiple of 4 with 0xFF, then `N-1, data, XOR`."""
    if not 1 <= len(data) <= MAX_TRANSFER:
        raise ProtocolError(
            f"write of {len(data)} bytes is outside 1..{MAX_TRANSFER}. "
            "Hint: split writes into blocks of at most 256 bytes."
        )
    padded = bytes(data) + b"\xff" * (-len(data) % 4)
    head = bytes((len(padded) - 1,))
    return head + padded + bytes((checksum(padded, head[0]),))


def encode_erase(pages: Sequence[int]) -> bytes:
    """Erase (0x43) of listed pages: `N-1, page..., XOR` (pages 0..254, 1..255 of them)."""
    if not 1 <= len(pages) <= 255:
        raise ProtocolError(
            f"Erase (0x43) of {len(pages)} pages: one frame holds 1..255 pages. "
            "Hint: erase in several commands."
        )
    for page in pages:
        _check_byte(page, "page number for Erase (0x43)")
    body = bytes((len(pages) - 1, *pages))
    return body + bytes((checksum(body),))


def encode_erase_global() -> bytes:
    """Erase (0x43) of the whole flash: `FF 00`."""
    return b"\xff\x00"


def encode_extended_erase(pages: Sequence[int]) -> bytes:
    """Extended Erase (0x44): `(N-1) as 2 bytes MSB first, pages as 2 bytes each, XOR`."""
    if not 1 <= len(pages) <= 0xFFF0:
        raise ProtocolError(
            f"Extended Erase (0x44) of {len(pages)} pages is outside 1..65520. "
            "Hint: use the special codes for mass erase."
        )
    body = bytearray((len(pages) - 1).to_bytes(2, "big"))
    for page in pages:
        if not 0 <= page < 0xFFF0:
            raise ProtocolError(
                f"Extended Erase page number {page} is outside 0..65519. "
                "Hint: page numbers come from the board profile's sector map."
            )
        body += page.to_bytes(2, "big")
    return bytes(body) + bytes((checksum(body),))


def encode_extended_erase_special(code: int) -> bytes:
    """Extended Erase special codes: mass `FF FF 00`, bank 1 `FF FE 01`, bank 2 `FF FD 02`."""
    if code not in (EXTENDED_ERASE_MASS, EXTENDED_ERASE_BANK1, EXTENDED_ERASE_BANK2):
        raise ProtocolError(
            f"0x{code:04X} is not an Extended Erase special code. "
            "Hint: use 0xFFFF (mass), 0xFFFE (bank 1) or 0xFFFD (bank 2)."
        )
    raw = code.to_bytes(2, "big")
    return raw + bytes((checksum(raw),))


# --- board side: decoding host frames -------------------------------------------------------


def decode_address(frame: bytes) -> int:
    """Inverse of encode_address; raises ProtocolError on a bad length or checksum."""
    if len(frame) != 5:
        raise ProtocolError(f"address frame has {len(frame)} bytes, expected 5")
    if checksum(frame[:4]) != frame[4]:
        raise ProtocolError(f"address frame {frame.hex(' ')} has a bad checksum")
    return int.from_bytes(frame[:4], "big")


def decode_length(frame: bytes) -> int:
    """Inverse of encode_length (returns N, 1..256)."""
    if len(frame) != 2 or frame[0] ^ frame[1] != 0xFF:
        raise ProtocolError(f"length frame {frame.hex(' ')} is not `N, ~N`")
    return frame[0] + 1


def decode_write_data(frame: bytes) -> bytes:
    """Inverse of encode_write_data, given the whole frame (`N-1, data, XOR`)."""
    if len(frame) < 3 or len(frame) != frame[0] + 3:
        raise ProtocolError(f"write frame of {len(frame)} bytes does not match its length byte")
    if checksum(frame[:-1]) != frame[-1]:
        raise ProtocolError("write frame has a bad checksum")
    return bytes(frame[1:-1])


def decode_erase_pages(frame: bytes) -> list[int]:
    """Inverse of encode_erase, given `N-1, pages, XOR` (not the global `FF 00`)."""
    if len(frame) != frame[0] + 3 or checksum(frame[:-1]) != frame[-1]:
        raise ProtocolError(f"erase frame {frame.hex(' ')} is malformed")
    return list(frame[1:-1])


def decode_extended_erase(frame: bytes) -> list[int]:
    """Inverse of encode_extended_erase, given `count(2), pages(2n), XOR`."""
    count = int.from_bytes(frame[:2], "big") + 1
    if len(frame) != 2 + 2 * count + 1 or checksum(frame[:-1]) != frame[-1]:
        raise ProtocolError(f"extended erase frame of {len(frame)} bytes is malformed")
    return [int.from_bytes(frame[i : i + 2], "big") for i in range(2, 2 + 2 * count, 2)]


def encode_get_reply(version: int, commands: Sequence[int]) -> bytes:
    """Board's Get payload between the ACKs: `N, version, commands` with N = len(commands)."""
    return bytes((len(commands), version, *commands))


def encode_get_id_reply(pid: int) -> bytes:
    """Board's Get ID payload between the ACKs: `01, PID MSB, PID LSB`."""
    return bytes((1,)) + pid.to_bytes(2, "big")


# --- host side: parsing replies -------------------------------------------------------------


@dataclass(frozen=True)
class GetInfo:
    """Get (0x00): bootloader version (0x31 means v3.1) and the command codes it lists."""

    version: int
    commands: tuple[int, ...]

    @property
    def version_text(self) -> str:
        return f"{self.version >> 4}.{self.version & 0xF}"

    def supports(self, code: int) -> bool:
        return code in self.commands


@dataclass(frozen=True)
class VersionInfo:
    """Get Version (0x01): version and the two option bytes (read protection counters)."""

    version: int
    option1: int
    option2: int


def parse_get(payload: bytes) -> GetInfo:
    """`N, version, N command bytes` (the ACKs around it stripped)."""
    if len(payload) < 2 or len(payload) != payload[0] + 2:
        raise ProtocolError(
            f"Get reply {payload.hex(' ')} has {len(payload)} bytes; its length byte "
            f"promises {payload[0] + 2 if payload else '?'}"
        )
    return GetInfo(version=payload[1], commands=tuple(payload[2:]))


def parse_get_version(payload: bytes) -> VersionInfo:
    if len(payload) != 3:
        raise ProtocolError(f"Get Version reply has {len(payload)} bytes, expected 3")
    return VersionInfo(payload[0], payload[1], payload[2])


def parse_get_id(payload: bytes) -> int:
    """`N, PID bytes (N+1 of them)` -> PID as an integer (0x413 for an STM32F405)."""
    if len(payload) < 3 or len(payload) != payload[0] + 2:
        raise ProtocolError(f"Get ID reply {payload.hex(' ')} is malformed")
    return int.from_bytes(payload[1:], "big")


def erase_command_of(info: GetInfo) -> int:
    """Which erase the chip lists: Extended Erase (0x44) wins over Erase (0x43)."""
    if info.supports(Command.EXTENDED_ERASE):
        return int(Command.EXTENDED_ERASE)
    if info.supports(Command.ERASE):
        return int(Command.ERASE)
    raise ProtocolError(
        f"Get lists neither Erase (0x43) nor Extended Erase (0x44): "
        f"{' '.join(f'{c:02X}' for c in info.commands)}. "
        "Hint: this bootloader cannot erase flash over UART; check the chip and its bootloader."
    )


def _check_byte(value: int, what: str) -> None:
    if not 0 <= value <= 0xFF:
        raise ProtocolError(f"{what} {value} does not fit in one byte")
