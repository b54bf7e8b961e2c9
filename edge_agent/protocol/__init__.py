"""Wire formats: the HTTP API schema (api.py). Pure: bytes and dicts in, typed objects out."""

from __future__ import annotations

__all__: list[str] = []
