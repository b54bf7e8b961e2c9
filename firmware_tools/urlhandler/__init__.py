"""pyserial URL handlers shipped by firmware_tools: `stm32sim://` (the AN3155 board simulator).

pyserial looks a scheme up as module `protocol_<scheme>` in each package listed in
`serial.protocol_handler_packages`; `register()` adds this package there (idempotent).
"""

from __future__ import annotations

__all__ = ["PACKAGE", "register"]

PACKAGE = "firmware_tools.urlhandler"


def register() -> None:
    """Make `serial.serial_for_url('stm32sim://...')` find our handler."""
    import serial

    if PACKAGE not in serial.protocol_handler_packages:
        serial.protocol_handler_packages.append(PACKAGE)
