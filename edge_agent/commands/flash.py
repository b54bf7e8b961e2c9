"""`edge-agent flash`: check an ELF against a board, flash it over the STM32 UART bootloader, or
read flash back.

Three forms share one parser, told apart by the first word:

    edge-agent flash check FW.ELF --board NAME [--json]
    edge-agent flash FW.ELF [--board NAME] [--port URL] [--baud N] [--dry-run] [--resume]
                     [--no-go] [--json]
    edge-agent flash read --board NAME --port URL --out FILE [--address A] [--length N]

`check` and `read` are sub-command words; anything else is the ELF path (write `./check` for a
file named `check`). Options that do not belong to the chosen form are usage errors (exit 2).
Data (the plan, JSON) goes to stdout; progress and warnings go to stderr.

Daemon handoff: when a daemon answers on its socket (--socket, else server.socket from the
configuration) and owns --port (its flash.ports or serial.port), the job is posted to it
(POST /v1/flash, the ELF's bytes in the body) and followed (GET /v1/flash/{id}) with the same
progress bar and the same summary or --json output; the daemon journals it. Otherwise, or with
--local, the CLI flashes directly. The daemon cannot share a port with a second opener.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from edge_agent.errors import UsageError

__all__ = ["register", "run"]

USAGE = """\
edge-agent flash check ELF --board NAME [--json]
       edge-agent flash ELF [--board NAME] [--port URL] [--baud N] [--dry-run] [--resume]
                            [--no-go] [--json]
       edge-agent flash read --board NAME --port URL --out FILE [--address A] [--length N]"""

DESCRIPTION = """\
check: run every ELF check against the board's flash geometry and print the plan (segments,
sectors to erase, bytes to write) without touching hardware. Exit 1 if the ELF is rejected,
78 if the board profile is unknown or invalid.
ELF: flash the firmware through the STM32 system bootloader (AN3155), verify by reading back,
and start it (unless --no-go). --port takes any pyserial URL (/dev/ttyUSB0, socket://host:port,
stm32sim://?chip=f405).
read: dump flash to a file (default: the whole flash).

`check` and `read` are words, anything else is the ELF path (write ./check for a file named
check). --board takes a profile name from board_profiles/ or a .toml path; leave it out to get
the list of known boards."""

_FLASH_ONLY = ("port", "baud", "dry_run", "resume", "no_go", "local", "socket")
POLL_S = 0.1
PROBE_TIMEOUT_S = 5.0
_READ_ONLY = ("out", "address", "length")


def _int(text: str) -> int:
    try:
        return int(text, 0)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an integer (e.g. 4096, 0x08000000)"
        ) from None


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "flash",
        help="check, flash or read STM32 firmware over the UART bootloader",
        usage=USAGE,
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("target", metavar="check|read|ELF", help="sub-command word or ELF path")
    parser.add_argument("elf", nargs="?", metavar="ELF", help="the ELF to check (with `check`)")
    parser.add_argument("--board", metavar="NAME", help="MCU board profile name or .toml path")
    parser.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    fl = parser.add_argument_group("flashing (edge-agent flash ELF)")
    fl.add_argument("--port", metavar="URL", help="serial port or pyserial URL")
    fl.add_argument("--baud", type=_int, metavar="N", help="baud rate (default: board profile)")
    fl.add_argument("--dry-run", action="store_true",
                    help="run the checks and the plan only; no port is opened")
    fl.add_argument("--resume", action="store_true", help="finish an interrupted flash job")
    fl.add_argument("--no-go", action="store_true", help="do not start the firmware afterwards")
    fl.add_argument("--local", action="store_true",
                    help="flash from this process even when a running daemon owns the port")
    fl.add_argument("--socket", metavar="PATH",
                    help="daemon socket (default: server.socket from the configuration)")
    rd = parser.add_argument_group("reading (edge-agent flash read)")
    rd.add_argument("--out", metavar="FILE", help="where to write the flash dump")
    rd.add_argument("--address", type=_int, metavar="A", help="first address (default: flash)")
    rd.add_argument("--length", type=_int, metavar="N", help="bytes to read (default: to end)")
    parser.set_defaults(func=run)


def _reject(args: argparse.Namespace, names: tuple[str, ...], form: str) -> None:
    given = [n for n in names if getattr(args, n) not in (None, False)]
    if given:
        flags = ", ".join("--" + n.replace("_", "-") for n in given)
        raise UsageError(
            f"flash {form}: {flags} cannot be used here. Hint: see `edge-agent flash --help` "
            "for the options of each form."
        )


def _board_required(args: argparse.Namespace, form: str) -> str:
    if args.board:
        return str(args.board)
    from firmware_tools.profiles import list_profiles, profile_dir

    names = ", ".join(list_profiles()) or f"(none found in {profile_dir()})"
    raise UsageError(
        f"flash {form}: no --board given, so the flash geometry is unknown. "
        f"Hint: add --board NAME, one of: {names}."
    )


def run(args: argparse.Namespace) -> int:
    if args.target == "check":
        return _run_check(args)
    if args.target == "read":
        return _run_read(args)
    return _run_flash(args)


def _run_check(args: argparse.Namespace) -> int:
    from firmware_tools.image import ElfImageError, load_elf
    from firmware_tools.plan import plan_flash
    from firmware_tools.profiles import load_profile

    if not args.elf:
        raise UsageError("flash check: no ELF given. Hint: edge-agent flash check FW.ELF "
                         "--board NAME.")
    _reject(args, _FLASH_ONLY + _READ_ONLY, "check")
    profile = load_profile(_board_required(args, "check"))
    try:
        image = load_elf(args.elf, profile)
    except ElfImageError as exc:
        if args.json:
            error = {"rule": exc.rule, "segment": exc.segment, "message": str(exc)}
            _print_json({"ok": False, "board": profile.name, "error": error})
        raise
    plan = plan_flash(image, profile)
    if args.json:
        for warning in image.warnings:
            print(f"edge-agent: warning: {warning}", file=sys.stderr)
        _print_json({"ok": True, **plan.to_json()})
    else:
        print(plan.format_text())
    return 0


def _print_json(doc: dict[str, Any]) -> None:
    json.dump(doc, sys.stdout, indent=2)
    sys.stdout.write("\n")
    sys.stdout.flush()


class _Progress:
    """A one-line progress bar on stderr, redrawn at most 10 times a second; silent when stderr
    is not a terminal (logs get the summary line only)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and sys.stderr.isatty()
        self.last = 0.0

    def __call__(self, done: int, total: int, phase: str = "") -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        finished = phase == "done" or (phase == "read" and done >= total)
        if not finished and now - self.last < 0.1:
            return
        self.last = now
        width = 30
        filled = width * done // total if total else width
        pct = 100 * done // total if total else 100
        sys.stderr.write(
            f"\r{phase:<7} [{'#' * filled}{'.' * (width - filled)}] {pct:3d}% {done}/{total}"
        )
        if finished:
            sys.stderr.write("\n")
        sys.stderr.flush()


def _summary(result: Any) -> str:
    """One human line from a `firmware_tools.flasher.FlashResult`."""
    if result.dry_run:
        return (f"dry run: {result.elf} passes the checks for {result.board}: {result.size} "
                f"bytes at 0x{result.base:08X}, sectors {result.sectors}; nothing written")
    parts = [f"flashed {result.elf} to {result.board} on {result.port}:",
             f"{result.bytes_written} bytes written, {result.bytes_verified} verified"]
    if result.erased:
        parts.append(f"erased sectors {result.erased}")
    if result.skipped:
        parts.append(f"sectors {result.skipped} already matched")
    if result.resumed:
        parts.append(f"sectors {result.resumed} done by the interrupted run")
    parts.append("started" if result.went else "not started (--no-go)")
    return f"{parts[0]} {', '.join(parts[1:])} in {result.seconds:.1f} s"


def _state_dir(args: argparse.Namespace) -> Any:
    from edge_agent.paths import state_dir

    return state_dir(getattr(args, "state_dir", None))


def _run_flash(args: argparse.Namespace) -> int:
    if args.elf:
        raise UsageError(
            f"flash: unexpected second argument {args.elf!r}. Hint: `edge-agent flash FW.ELF` "
            "flashes, `edge-agent flash check FW.ELF` only checks."
        )
    _reject(args, _READ_ONLY, "ELF")
    board = _board_required(args, "ELF")
    if not args.port and not args.dry_run:
        raise UsageError("flash: no --port given. Hint: add --port /dev/ttyUSB0 (any pyserial "
                         "URL, e.g. stm32sim://?chip=f405 for the simulator).")
    from firmware_tools.flasher import flash_elf  # the AN3155 flasher
    from firmware_tools.profiles import load_profile

    profile = load_profile(board)
    if args.port and not args.dry_run and not args.local:
        handed = _via_daemon(args, profile.name)
        if handed is not None:
            return handed
    result = flash_elf(
        args.target,
        profile,
        args.port or "",
        baud=args.baud,
        dry_run=args.dry_run,
        resume=args.resume,
        go=not args.no_go,
        progress=_Progress(enabled=not args.json),
        state_dir=_state_dir(args),
    )
    for warning in result.warnings:
        print(f"edge-agent: warning: {warning}", file=sys.stderr)
    if args.json:
        _print_json({"ok": True, **result.to_dict()})
    else:
        print(_summary(result))
    return 0


def _daemon_socket(args: argparse.Namespace) -> Any:
    if args.socket:
        return args.socket

    from edge_agent.errors import ConfigError

    try:
        from edge_agent.commands.client import daemon_socket

        return daemon_socket(args, config=None)
    except ConfigError as exc:
        print(f"edge-agent: warning: cannot find the daemon's socket ({exc}); flashing "
              "directly", file=sys.stderr)
        return None


def _fits_daemon(args: argparse.Namespace, board: str, size: int, info: dict[str, Any],
                 sock: Any) -> None:
    """The daemon takes the ELF only as bytes in the request body, and a board by name: refuse
    here, with what to change, what it would refuse."""
    from edge_agent.client import DaemonError

    if args.board != board and args.board.lower() != board:
        raise UsageError(
            f"flash: --board {args.board} is a profile file, but the daemon on {sock} that owns "
            f"{args.port} takes board profile names only. Hint: install the profile in the "
            "daemon's board_profiles/ and pass its name, or flash from this process with "
            "--local.")
    body = (size + 2) // 3 * 4 + len(args.port) + len(board) + 256  # base64 + the JSON
    body_limit = int(info.get("max_body_bytes") or 0)
    elf_limit = int(info.get("max_elf_bytes") or 0)
    if elf_limit and size > elf_limit:
        raise DaemonError(
            "elf_too_large",
            f"flash: {args.target} is {size} bytes, more than the {elf_limit} bytes the daemon "
            f"on {sock} takes for a firmware ELF. Hint: check that this is the firmware ELF; "
            "strip its debug sections (arm-none-eabi-strip -g) if it is.")
    if body_limit and body > body_limit:
        raise DaemonError(
            "body_too_large",
            f"flash: {args.target} is {size} bytes, about {body} bytes sent base64-encoded, "
            f"more than the daemon on {sock} takes in a request (server.max_body_bytes = "
            f"{body_limit}). Hint: raise server.max_body_bytes in the daemon's configuration "
            f"to at least {body}, strip the ELF's debug sections (arm-none-eabi-strip -g), or "
            "flash from this process with --local while the daemon does not hold the port.")


def _via_daemon(args: argparse.Namespace, board: str) -> int | None:
    """Hand the job to a running daemon that owns the port; None when it does not."""
    from edge_agent.client import DaemonClient, DaemonError

    sock = _daemon_socket(args)
    if sock is None or not DaemonClient(sock, timeout=PROBE_TIMEOUT_S).available():
        return None
    client = DaemonClient(sock, timeout=30.0)
    try:
        info = client.flash_ports(args.port)
    except DaemonError as exc:
        if exc.status == 404:  # a daemon without flash jobs
            return None
        raise
    if not info.get("owned"):
        if info.get("same_board_as"):
            print(f"edge-agent: note: the daemon on {sock} owns this board as "
                  f"{info['same_board_as']!r}; --port with exactly that string hands the job "
                  "to it", file=sys.stderr)
        return None
    try:
        with open(args.target, "rb") as fh:
            data = fh.read()
    except OSError:
        return None  # the direct path reports an unreadable ELF with its own message
    _fits_daemon(args, board, len(data), info, sock)
    options: dict[str, Any] = {"dry_run": False, "resume": bool(args.resume),
                               "go": not args.no_go}
    if args.baud is not None:
        options["baud"] = args.baud
    job = client.flash_submit(board, args.port, data, **options)
    print(f"edge-agent: {args.port} is owned by the daemon on {sock}: flash job {job['id']} "
          "handed to it (--local flashes from here)", file=sys.stderr)
    bar = _Progress(enabled=not args.json)
    last = None
    while job["state"] not in ("done", "failed"):
        time.sleep(POLL_S)
        job = client.flash_job(job["id"])
        prog = job.get("progress") or {}
        mark = (prog.get("done"), prog.get("total"), job.get("phase"))
        if mark != last and prog.get("total"):
            last = mark
            bar(int(prog["done"]), int(prog["total"]), str(job.get("phase") or ""))
    if job["state"] == "failed":
        err = job.get("error") or {}
        raise DaemonError(
            "flash_failed",
            f"flash job {job['id']} ({args.target} to {board} on {args.port}) failed in the "
            f"daemon: {err.get('message', err)}. Hint: the message above says why; "
            "`edge-agent flash --resume` continues an interrupted job.")
    job["result"]["elf"] = args.target  # the daemon flashed its copy of this file
    result = _result_from(job["result"])
    for warning in result.warnings:
        print(f"edge-agent: warning: {warning}", file=sys.stderr)
    if args.json:
        _print_json({"ok": True, **job["result"], "daemon_job": job["id"]})
    else:
        print(_summary(result))
    return 0


def _result_from(d: dict[str, Any]) -> Any:
    from firmware_tools.flasher import FlashResult

    fields = dict(d)
    fields["base"] = int(str(fields["base"]), 16)
    for key in ("chip_id", "erase_command"):
        if fields.get(key) is not None:
            fields[key] = int(str(fields[key]), 16)
    return FlashResult(**fields)


def _run_read(args: argparse.Namespace) -> int:
    if args.elf:
        raise UsageError(f"flash read: unexpected argument {args.elf!r}. Hint: write the dump "
                         "file with --out FILE.")
    _reject(args, ("dry_run", "resume", "no_go", "json"), "read")
    board = _board_required(args, "read")
    if not args.port or not args.out:
        raise UsageError("flash read: --port and --out are required. Hint: edge-agent flash "
                         "read --board NAME --port /dev/ttyUSB0 --out dump.bin.")
    from firmware_tools.flasher import read_flash  # the AN3155 flasher
    from firmware_tools.profiles import load_profile

    profile = load_profile(board)
    count = read_flash(
        profile,
        args.port,
        args.out,
        baud=args.baud,
        address=args.address,
        length=args.length,
        progress=_Progress(enabled=True),
    )
    print(f"edge-agent: read {count} bytes to {args.out}", file=sys.stderr)
    return 0
