"""QEMU guest harness for the tests: guest images built from Debian packages, cached by a hash
of their inputs under tests/.cache/qemu/, and helpers that boot them with timeouts.

Invariants: nothing here touches the host's dpkg state (a private apt configuration per
architecture); every QEMU or nbdkit process started here is killed when its helper exits.
"""

from __future__ import annotations

__all__: list[str] = []
