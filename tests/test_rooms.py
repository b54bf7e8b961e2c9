"""The rooms of docs/architecture.md hold: each package imports only what its room allows.

A static check over every module's import statements (what import-linter would enforce, without
adding it as a dependency).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

IO_MODULES = {"asyncio", "socket", "socketserver", "selectors", "serial", "sqlite3", "sqlite_utils"}

# package folder -> top-level or dotted module prefixes it must never import
RULES: dict[str, set[str]] = {
    "firmware_tools": {"edge_agent"},
    "edge_agent/runtime": IO_MODULES,
    "edge_agent/scheduler": IO_MODULES | {"time"},
    "edge_agent/protocol": IO_MODULES | {"subprocess", "edge_agent.daemon", "edge_agent.runtime"},
    "edge_agent/transports": {"edge_agent.runtime", "edge_agent.scheduler", "edge_agent.daemon"},
    "edge_agent/journal": {"edge_agent.transports", "edge_agent.daemon"},
    "edge_agent/cgroup": {"edge_agent.transports", "edge_agent.daemon"},
}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _violations(folder: str, forbidden: set[str]) -> list[str]:
    found = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for name in _imports(path):
            for banned in forbidden:
                if name == banned or name.startswith(banned + "."):
                    found.append(f"{path.relative_to(ROOT)} imports {name}")
    return found


@pytest.mark.parametrize("folder", sorted(RULES))
def test_room_imports(folder: str) -> None:
    assert (ROOT / folder).is_dir()
    assert _violations(folder, RULES[folder]) == []


def test_the_check_sees_a_violation(tmp_path: Path) -> None:
    bad = tmp_path / "m.py"
    bad.write_text("import asyncio\nfrom edge_agent.daemon import app\n")
    assert _imports(bad) == {"asyncio", "edge_agent.daemon"}
