"""One exception root for firmware_tools."""

from __future__ import annotations

__all__ = ["FirmwareError", "FlashError"]


class FirmwareError(Exception):
    """Root of every error firmware_tools raises on purpose. `exit_code` is for the CLI."""

    exit_code = 1


class FlashError(FirmwareError):
    """A flashing job that cannot go on (bad arguments, missing or unreadable state)."""
