"""Command-line entry point.

`main(argv) -> int` is the only place that turns errors into exit codes:
0 ok, 1 operational error, 2 usage, 75 state directory held by another daemon, 78 bad
configuration, 130 interrupted.
Each sub-command lives in `edge_agent/commands/<name>.py` and exposes `register(subparsers)`,
which adds its parser and sets `func(args) -> int`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from edge_agent import __version__
from edge_agent.errors import EXIT_ERROR, EXIT_OK, EXIT_USAGE, EdgeAgentError

__all__ = ["build_parser", "main", "main_entry", "COMMAND_MODULES"]

# Order here is the order in `edge-agent --help`.
COMMAND_MODULES = ("model", "tokenize", "generate", "serve", "client", "systemd", "flash",
                   "doctor", "cgroup", "journal")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="edge-agent",
        description="Local LLM inference and MCU flashing for ARM Linux boards.",
    )
    parser.add_argument("--version", action="version", version=f"edge-agent {__version__}")
    parser.add_argument(
        "--state-dir",
        metavar="DIR",
        help="state directory (default: $EDGE_AGENT_STATE_DIR, $STATE_DIRECTORY, "
        "or ~/.local/state/edge-agent)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        module = importlib.import_module(f"edge_agent.commands.{name}")
        module.register(sub)
    return parser


def _firmware_error_type() -> type[BaseException]:
    from firmware_tools.errors import FirmwareError

    return FirmwareError


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    firmware_error = _firmware_error_type()
    try:
        return int(func(args) or EXIT_OK)
    except EdgeAgentError as exc:
        print(f"edge-agent: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except firmware_error as exc:
        print(f"edge-agent: error: {exc}", file=sys.stderr)
        return int(getattr(exc, "exit_code", EXIT_ERROR))
    except KeyboardInterrupt:
        print("edge-agent: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # stdout closed early (e.g. `edge-agent generate ... | head -1`): not an error.
        # Point stdout at devnull so the interpreter's final flush does not raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK


def main_entry() -> None:
    sys.exit(main())
