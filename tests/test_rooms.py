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


# The composition root: the one module that knows the whole `Daemon` (collaborators get
# protocols and callables). commands/serve.py runs it.
COMPOSITION_ROOT = "edge_agent/daemon/app.py"
RUNS_THE_ROOT = {"edge_agent/commands/serve.py"}


def _imports_daemon_app(path: Path) -> bool:
    """Whether the module imports edge_agent.daemon.app, in any form, anywhere in it."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(
                a.name == "edge_agent.daemon.app" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (
                node.module == "edge_agent.daemon.app" or (node.module == "edge_agent.daemon"
                                                           and any(a.name == "app"
                                                                   for a in node.names))):
            return True
    return False


def test_only_the_composition_root_imports_the_daemon() -> None:
    users = {str(p.relative_to(ROOT)) for p in sorted((ROOT / "edge_agent").rglob("*.py"))
             if _imports_daemon_app(p)}
    assert users - {COMPOSITION_ROOT} - RUNS_THE_ROOT == set(), (
        "collaborators get a Protocol or callables, not the Daemon")
    assert RUNS_THE_ROOT <= users  # the check sees the one module that runs the root


def test_the_daemon_check_sees_every_import_form(tmp_path: Path) -> None:
    forms = ["import edge_agent.daemon.app\n", "from edge_agent.daemon.app import Daemon\n",
             "from edge_agent.daemon import app\n",
             "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
             "    from edge_agent.daemon.app import Daemon\n"]
    for i, text in enumerate(forms):
        (tmp_path / f"m{i}.py").write_text(text)
        assert _imports_daemon_app(tmp_path / f"m{i}.py"), text
    (tmp_path / "ok.py").write_text("from edge_agent.daemon import memory_guard\n")
    assert not _imports_daemon_app(tmp_path / "ok.py")
