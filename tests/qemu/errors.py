"""Errors of the QEMU harness. `PackagesUnavailable` is the only one a test may turn into a skip:
it means the Debian archive or PyPI could not be reached, not that the harness is broken."""

from __future__ import annotations

__all__ = ["GuestError", "GuestTimeout", "HarnessError", "PackagesUnavailable"]


class HarnessError(RuntimeError):
    """Root of the harness errors (build or boot went wrong)."""


class PackagesUnavailable(HarnessError):
    """A Debian package or a wheel could not be downloaded (offline, mirror down)."""


class GuestError(HarnessError):
    """The guest booted but did not do what was asked (bad exit, no marker, QEMU died)."""


class GuestTimeout(GuestError):
    """The guest did not reach the expected point in time; QEMU has been killed."""
