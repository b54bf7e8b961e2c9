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

from edge_agent.errors import UPLOADED_ELF, UsageError

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


def _baud(text: str) -> int:
    """--baud: a rate above 0 (0 used to mean the profile's rate, silently)."""
    value = _int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a baud rate is above 0, e.g. 115200 "
                                         "(leave --baud out for the board profile's)")
    return value


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
    fl.add_argument("--baud", type=_baud, metavar="N",
                    help="baud rate (default: board profile)")
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
    try:
        if args.target == "check":
            return _run_check(args)
        if args.target == "read":
            return _run_read(args)
        return _run_flash(args)
    except KeyboardInterrupt:
        if args.target not in ("check", "read") and not args.dry_run:
            print("edge-agent: the flash was interrupted; run the same command with --resume to "
                  "finish it (verified sectors are kept)", file=sys.stderr)
        raise
    except Exception as exc:
        # --json: a failure is a JSON document too ({"ok": false, "error": ...}), so a script
        # reads one shape; the message still goes to stderr and the exit code is unchanged
        if getattr(args, "json", False) and not isinstance(exc, UsageError):
            _print_json({"ok": False, "error": _error_doc(exc)})
        raise


def _error_doc(exc: BaseException) -> dict[str, Any]:
    code = getattr(exc, "code", None)
    doc: dict[str, Any] = {"code": code if isinstance(code, str) else type(exc).__name__,
                           "message": str(exc)}
    for key in ("rule", "segment"):  # which ELF check failed
        if getattr(exc, key, None) is not None:
            doc[key] = getattr(exc, key)
    doc.update(getattr(exc, "details", None) or {})  # a daemon's: its job id
    return doc


def _run_check(args: argparse.Namespace) -> int:
    from firmware_tools.image import load_elf
    from firmware_tools.plan import plan_flash
    from firmware_tools.profiles import load_profile

    if not args.elf:
        raise UsageError("flash check: no ELF given. Hint: edge-agent flash check FW.ELF "
                         "--board NAME.")
    _reject(args, _FLASH_ONLY + _READ_ONLY, "check")
    profile = load_profile(_board_required(args, "check"))
    image = load_elf(args.elf, profile)
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
        handed = _via_daemon(args, profile)
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
    elf_limit = int(info.get("max_elf_bytes") or 0)
    if elf_limit and size > elf_limit:
        raise DaemonError(
            "elf_too_large",
            f"flash: {args.target} is {size} bytes, more than the {elf_limit} bytes the daemon "
            f"on {sock} takes for a firmware ELF. Hint: check that this is the firmware ELF; "
            "strip its debug sections (arm-none-eabi-strip -g) if it is.")


def _via_daemon(args: argparse.Namespace, profile: Any) -> int | None:
    """Hand the job to a running daemon that owns the port; None when it does not. The ELF
    is checked here first, so its errors name the file as --local's do."""
    from edge_agent.client import DaemonClient, DaemonError, DaemonUnavailable
    from firmware_tools.image import elf_image

    board = profile.name

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
            # flashing it from here would talk to the board at the same time as the daemon's
            # console or flash job: two writers on one bootloader corrupt each other's image
            raise DaemonError(
                "port_owned_as_other_string",
                f"flash: --port {args.port!r} names the board the daemon on {sock} owns as "
                f"{info['same_board_as']!r}, with other options; flashing it from this process "
                "could collide with the daemon's own use of it. Hint: pass --port "
                f"{info['same_board_as']!r} exactly to hand the job to the daemon, or --local "
                "to flash from here anyway (when the daemon is not using the board).")
        return None
    try:
        with open(args.target, "rb") as fh:
            data = fh.read()
    except OSError:
        return None  # the direct path reports an unreadable ELF with its own message
    _fits_daemon(args, board, len(data), info, sock)
    elf_image(args.target, data, profile)
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
        try:
            job = client.flash_job(job["id"])
        except DaemonUnavailable:
            raise DaemonError(
                "daemon_stopped",
                f"flash job {job['id']} ({args.target} to {board} on {args.port}): the daemon "
                f"on {sock} stopped while it ran; a job it could not finish in its stop time "
                "ends at a block boundary. Hint: once the daemon is back, run the same command "
                "with --resume: verified sectors are kept, and a finished job is not redone.",
                details={"daemon_job": job["id"]}) from None
        prog = job.get("progress") or {}
        mark = (prog.get("done"), prog.get("total"), job.get("phase"))
        if mark != last and prog.get("total"):
            last = mark
            bar(int(prog["done"]), int(prog["total"]), str(job.get("phase") or ""))
    if job["state"] == "failed":
        err = job.get("error") or {}
        message = str(err.get("message", err)).replace(UPLOADED_ELF, args.target)
        if "Hint:" not in message:
            message += (f" Hint: GET /v1/flash/{job['id']} on the daemon shows the job, and "
                        "its log the details.")
        raise DaemonError(str(err.get("code") or "flash_failed"),
                          f"flash job {job['id']} ({args.target} to {board} on {args.port}) "
                          f"failed in the daemon: {message}",
                          details={"daemon_job": job["id"]})
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
    notes: list[str] = []
    count = read_flash(
        profile,
        args.port,
        args.out,
        baud=args.baud,
        address=args.address,
        length=args.length,
        progress=_Progress(enabled=True),
        notes=notes,
    )
    for note in notes:
        print(f"edge-agent: note: {note}", file=sys.stderr)
    print(f"edge-agent: read {count} bytes to {args.out}", file=sys.stderr)
    return 0
