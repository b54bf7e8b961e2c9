"""Transports: bytes between the outside world and the daemon (HTTP on a Unix socket, UART).

Transports never import the runtime or the scheduler: they hand parsed requests to a handler.
"""

from __future__ import annotations

__all__: list[str] = []
