"""The AN3155 client's errors, shared by its modules (`firmware_tools.bootloader` re-exports them).

Invariants this module owns:
- Every error the client raises is a `BootloaderError` (so a `FirmwareError`); a timeout is also
  a `TimeoutError` and a failed port also an `OSError`, so generic handlers still catch them.
- `ReadoutProtectedError` is a `NackError`: code that handles any NACK handles it too.
- `CHECK_WIRING` is the one wording of the wiring hint that timeouts and garbage replies give.
"""

from __future__ import annotations

from firmware_tools.errors import FirmwareError

__all__ = [
    "BootloaderError",
    "BootloaderTimeout",
    "CHECK_WIRING",
    "ChipMismatchError",
    "LinkError",
    "NackError",
    "ReadoutProtectedError",
]

CHECK_WIRING = (
    "check that BOOT0 is high and the chip was reset into its bootloader, that TX/RX are "
    "crossed, and the baud rate and parity (the bootloader uses 8E1)"
)


class BootloaderError(FirmwareError):
    """The bootloader did not do what was asked."""


class BootloaderTimeout(BootloaderError, TimeoutError):
    """No (complete) answer before the operation's deadline."""


class NackError(BootloaderError):
    """The bootloader answered NACK (0x1F)."""


class ReadoutProtectedError(NackError):
    """The chip refuses memory commands: flash readout protection is active."""


class ChipMismatchError(BootloaderError):
    """Get ID returned a chip id the board profile does not list."""


class LinkError(BootloaderError, OSError):
    """The port failed (unplugged adapter, closed pty, dropped link)."""
