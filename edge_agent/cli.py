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
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from edge_agent import __version__
from edge_agent.errors import EXIT_ERROR, EXIT_OK, EXIT_USAGE, EdgeAgentError, UsageError
from edge_agent.logs import configure, level_for

__all__ = ["build_parser", "command_in", "main", "main_entry", "COMMANDS", "COMMAND_MODULES"]

# Order here is the order in `edge-agent --help`.
COMMAND_MODULES = ("model", "tokenize", "generate", "serve", "client", "systemd", "flash",
                   "doctor", "cgroup", "journal")
# COMMAND -> the module that registers it. `edge-agent COMMAND ...` imports that module alone:
# every command's parser takes all of their imports (0.07 s and 1.3 MiB more for `serve`,
# whose start counts). tests/test_cli_lazy.py keeps this table equal to the modules' own.
COMMANDS = {"model": "model", "tokenize": "tokenize", "generate": "generate", "serve": "serve",
            "status": "client", "models": "client", "chat": "client", "systemd": "systemd",
            "flash": "flash", "doctor": "doctor", "cgroup": "cgroup", "journal": "journal"}
_GLOBAL_VALUE_OPTIONS = ("--state-dir", "--socket")  # global options that take a value


class _Parser(argparse.ArgumentParser):
    """Usage errors name the command and end with a Hint: line (exit 2)."""

    _deepest: argparse.ArgumentParser | None = None  # the last (sub-)parser that parsed

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        _Parser._deepest = self
        return super().parse_known_args(args, namespace)

    def parse_args(self, args: Any = None, namespace: Any = None) -> Any:
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:  # reported by the sub-command that was parsing, so its --help is named
            (_Parser._deepest or self).error(f"unrecognized arguments: {' '.join(extra)}")
        return parsed

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n"
                              f"Hint: run `{self.prog} --help` for the options and arguments.\n")


# Global options: accepted before the sub-command and after it (at any depth); a value given
# after the sub-command wins. Sub-parsers get them with default=SUPPRESS so they do not
# overwrite the top-level value.
_STATE_DIR_HELP = ("state directory (default: $EDGE_AGENT_STATE_DIR, systemd's "
                   "$STATE_DIRECTORY, CHECKOUT/.state inside an edge-agent checkout, "
                   "/var/lib/edge-agent for a systemd install, else ~/.local/state/edge-agent)")
_SOCKET_HELP = ("daemon socket (default: server.socket from the configuration, else "
                "STATE_DIR/edge-agent.sock; /run/edge-agent/edge-agent.sock for a systemd "
                "install)")
_VERBOSE_HELP = "more detail on stderr (timings, debug log lines)"
_QUIET_HELP = "less on stderr: only the log's warnings and errors"
log = logging.getLogger(__name__)


def _sub_parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    out: list[argparse.ArgumentParser] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):
                out += [child, *_sub_parsers(child)]
    return out


def _globals_everywhere(parser: argparse.ArgumentParser) -> set[str]:
    """Add the global options to every sub-parser; the progs of those that take --socket."""
    takes_socket: set[str] = set()
    for child in _sub_parsers(parser):
        known = child._option_string_actions
        options: tuple[tuple[tuple[str, ...], dict[str, Any]], ...] = (
            (("--state-dir",), {"metavar": "DIR", "help": _STATE_DIR_HELP}),
            (("-v", "--verbose"), {"action": "store_true", "help": _VERBOSE_HELP}),
            (("-q", "--quiet"), {"action": "store_true", "help": _QUIET_HELP}))
        for flags, kwargs in options:
            if flags[-1] in known:
                known[flags[-1]].default = argparse.SUPPRESS
            else:
                child.add_argument(*flags, default=argparse.SUPPRESS, **kwargs)
        if "--socket" in known:
            known["--socket"].default = argparse.SUPPRESS
            takes_socket.add(child.prog)
    return takes_socket


def command_in(argv: Sequence[str]) -> str | None:
    """The COMMAND word of `argv` (the first argument that is neither a global option nor its
    value), None when there is none or when --help comes before it (the whole list then)."""
    args = iter(argv)
    for arg in args:
        if arg in ("-h", "--help", "--"):
            return None
        if arg in _GLOBAL_VALUE_OPTIONS:
            next(args, None)
        elif not arg.startswith("-"):
            return arg
    return None


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole CLI; with a known `command`, only the module that registers it is imported
    (and `--help` lists only that command: main() passes a command only when it comes before
    any --help)."""
    parser = _Parser(
        prog="edge-agent",
        description="Local LLM inference and MCU flashing for ARM Linux boards.",
        epilog="--state-dir, --socket, -v and -q may also follow the command. "
        "`make run` serves on CHECKOUT/.state/edge-agent.sock, which every command finds "
        "from inside the checkout with no flags.",
    )
    parser.add_argument("--version", action="version", version=f"edge-agent {__version__}")
    parser.add_argument("--state-dir", metavar="DIR", help=_STATE_DIR_HELP)
    parser.add_argument("--socket", metavar="PATH", help=_SOCKET_HELP)
    parser.add_argument("-v", "--verbose", action="store_true", default=False,
                        help=_VERBOSE_HELP)
    parser.add_argument("-q", "--quiet", action="store_true", default=False, help=_QUIET_HELP)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in (COMMANDS[command],) if command in COMMANDS else COMMAND_MODULES:
        module = importlib.import_module(f"edge_agent.commands.{name}")
        module.register(sub)
    parser.set_defaults(_takes_socket=frozenset(_globals_everywhere(parser)))
    return parser


def _check_socket_flag(args: argparse.Namespace) -> None:
    """A top-level --socket for a command that never talks to the daemon is a mistake."""
    if args.socket and args.command and not any(
            prog.split()[1:2] == [args.command] for prog in args._takes_socket):
        takes = build_parser().get_default("_takes_socket")  # every command, for the hint
        raise UsageError(f"--socket {args.socket}: `edge-agent {args.command}` does not talk "
                         "to the daemon. Hint: drop --socket; commands that take it: "
                         f"{', '.join(sorted({p.split()[1] for p in takes}))}.")


def _firmware_error_type() -> type[BaseException]:
    from firmware_tools.errors import FirmwareError

    return FirmwareError


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(command_in(argv))
    args = parser.parse_args(argv)
    # the one place log handlers are set up (the runner process copies the level)
    configure(level_for(verbose=bool(args.verbose), quiet=bool(args.quiet)))
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help(sys.stderr)
        print("edge-agent: error: no command given. Hint: pick a COMMAND above, e.g. "
              "`edge-agent status`.", file=sys.stderr)
        return EXIT_USAGE
    firmware_error = _firmware_error_type()
    try:
        _check_socket_flag(args)
        return int(func(args) or EXIT_OK)
    except EdgeAgentError as exc:
        log.error("%s", exc)  # "edge-agent: error: ...", priority err under systemd
        return exc.exit_code
    except firmware_error as exc:
        log.error("%s", exc)
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
