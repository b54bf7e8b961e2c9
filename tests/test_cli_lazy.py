"""`edge-agent COMMAND` imports only the module that registers COMMAND (the daemon's start pays
for no other command's imports); `edge-agent --help`, an unknown command and the --socket hint
still see every command."""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from edge_agent import cli

REPO = Path(__file__).resolve().parents[1]


def test_the_command_table_is_what_the_modules_register() -> None:
    registered: dict[str, str] = {}
    for name in cli.COMMAND_MODULES:
        sub = argparse.ArgumentParser().add_subparsers()
        importlib.import_module(f"edge_agent.commands.{name}").register(sub)
        registered.update(dict.fromkeys(sub.choices, name))
    assert registered == cli.COMMANDS


@pytest.mark.parametrize(("argv", "command"), [
    (["serve"], "serve"),
    (["--state-dir", "serve", "status"], "status"),  # the option's value is not the command
    (["--state-dir=d", "-v", "serve", "--print-config"], "serve"),
    (["--socket", "/run/x.sock", "model", "info"], "model"),
    (["serve", "--help"], "serve"),
    (["-h", "serve"], None),  # the whole list
    (["--help"], None),
    (["-v"], None),
    ([], None),
    (["--", "serve"], None),
])
def test_command_in(argv: list[str], command: str | None) -> None:
    assert cli.command_in(argv) == command


def _run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=120, check=True).stdout


def test_a_command_imports_only_its_module() -> None:
    out = _run("import sys\nfrom edge_agent import cli\n"
               "cli.build_parser(cli.command_in(['--state-dir', '/x', 'serve', '-v']))\n"
               "print(sorted(m for m in sys.modules if m.startswith('edge_agent.commands.')))")
    assert out.split() == ["['edge_agent.commands.serve']"]
    out = _run("import sys\nfrom edge_agent import cli\ncli.build_parser(None)\n"
               "print(sum(m.startswith('edge_agent.commands.') for m in sys.modules))")
    assert int(out) >= len(cli.COMMAND_MODULES)


def test_help_and_mistakes_still_see_every_command(tmp_path: Path) -> None:
    def edge_agent(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "edge_agent", *args], cwd=tmp_path,
                              capture_output=True, text=True, timeout=120)

    for args in (["--help"], ["-h", "serve"]):
        r = edge_agent(*args)
        assert r.returncode == 0 and all(f"    {c} " in r.stdout for c in cli.COMMANDS), args
    r = edge_agent("serve", "--help")
    assert r.returncode == 0 and r.stdout.startswith("usage: edge-agent serve")
    r = edge_agent("bogus")
    assert r.returncode == 2 and all(repr(c) in r.stderr for c in cli.COMMANDS)
    r = edge_agent("--socket", str(tmp_path / "s.sock"), "model", "info")
    assert r.returncode == 2, r.stderr
    assert "commands that take it: chat, flash, generate, models, serve, status." in r.stderr
