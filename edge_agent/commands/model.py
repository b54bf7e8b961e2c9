"""`edge-agent model` (placeholder until implemented)."""

from __future__ import annotations

import argparse

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = sub.add_parser("model", help="(not yet implemented)")
    parser.set_defaults(func=lambda args: 1)
