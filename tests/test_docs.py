"""The README documents every command the CLI has (sqlite-utils' tests/test_docs.py idea)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from edge_agent.cli import build_parser

README = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")


def _commands() -> list[str]:
    parser = build_parser()
    names: list[str] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                names.append(name)
                for inner in sub._actions:
                    if isinstance(inner, argparse._SubParsersAction):
                        names.extend(f"{name} {child}" for child in inner.choices)
    return names


def test_the_cli_has_commands() -> None:
    assert {"serve", "generate", "flash", "model prepare"} <= set(_commands())


@pytest.mark.parametrize("command", _commands())
def test_command_is_documented(command: str) -> None:
    head, _, rest = command.partition(" ")
    forms = [f"edge-agent {command}", f"`{command}`"]
    if rest:  # tables list siblings as `edge-agent model prepare | info | pin`
        forms.append(f"| {rest}")
        forms.append(f"edge-agent {head} {rest}")
    assert any(form in README for form in forms), f"`edge-agent {command}` is not in README.md"
