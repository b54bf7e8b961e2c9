"""`edge-agent systemd install`: write the units for this installation (or print them).

ExecStart= is this interpreter running `-m edge_agent serve`, so a venv install works as well
as a packaged one. Files: the service and socket in --prefix, the sysusers and tmpfiles snippets
in --sysusers-dir and --tmpfiles-dir. Writes are atomic (temporary file + rename), mode 0644.
The installation's own Python modules are byte-compiled in place: the service runs as its own
user under ProtectSystem=strict, so it could not write them and would compile every module from
source at each start (0.2 s more to READY here, 0.95 s against 0.75 s on two x86 cores).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shlex
import sys
from pathlib import Path

from edge_agent.errors import EdgeAgentError, UsageError
from edge_agent.systemd_units import (
    SYSUSERS_FILE,
    TMPFILES_FILE,
    UnitOptions,
    render_units,
)

__all__ = ["register", "run", "compile_installation", "default_exec_start", "install_targets",
           "InstallError"]

_HOME_PREFIXES = ("/home/", "/root/", "/run/user/")
_USER_RE = re.compile(r"^[a-z_][a-z0-9_-]{0,30}$")


class InstallError(EdgeAgentError, OSError):
    """A unit file could not be written."""


def _quote(arg: str) -> str:
    # systemd's ExecStart= splits on whitespace and honours double quotes and backslashes.
    if re.fullmatch(r"[A-Za-z0-9_@%+=:,./-]+", arg):
        return arg
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'


def default_exec_start(python: str | None = None) -> str:
    """`<this python> -m edge_agent serve`, quoted for ExecStart=."""
    exe = python or sys.executable
    if not exe or not os.path.isabs(exe):
        raise InstallError(
            f"systemd install: the Python interpreter path {exe!r} is not absolute. "
            "Hint: pass --exec-start '/path/to/python -m edge_agent serve'."
        )
    return " ".join(_quote(a) for a in (exe, "-m", "edge_agent", "serve"))


def install_targets(
    prefix: Path, sysusers_dir: Path, tmpfiles_dir: Path
) -> dict[str, Path]:
    """Rendered file name -> where it is installed."""
    return {
        "edge-agent.service": prefix / "edge-agent.service",
        "edge-agent.socket": prefix / "edge-agent.socket",
        SYSUSERS_FILE: sysusers_dir / "edge-agent.conf",
        TMPFILES_FILE: tmpfiles_dir / "edge-agent.conf",
    }


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "systemd",
        help="install the systemd units for this installation",
        description="Manage the systemd integration (service, socket, sysusers, tmpfiles).",
    )
    actions = parser.add_subparsers(dest="systemd_action", metavar="ACTION", required=True)
    inst = actions.add_parser(
        "install",
        help="write edge-agent.service/.socket and the sysusers/tmpfiles snippets",
        description="Write the units with ExecStart= pointing at this installation. "
        "Then: systemd-sysusers; systemd-tmpfiles --create; systemctl daemon-reload; "
        "systemctl enable --now edge-agent.socket edge-agent.service.",
    )
    inst.add_argument("--prefix", type=Path, default=Path("/etc/systemd/system"),
                      help="directory for the unit files (default: %(default)s)")
    inst.add_argument("--sysusers-dir", type=Path, default=Path("/etc/sysusers.d"),
                      help="directory for the sysusers snippet (default: %(default)s)")
    inst.add_argument("--tmpfiles-dir", type=Path, default=Path("/etc/tmpfiles.d"),
                      help="directory for the tmpfiles snippet (default: %(default)s)")
    inst.add_argument("--user", default="edge-agent",
                      help="service user and group, created by sysusers (default: %(default)s)")
    inst.add_argument("--exec-start", metavar="CMD",
                      help="override ExecStart= (default: this Python with -m edge_agent serve)")
    inst.add_argument("--tcp", action=argparse.BooleanOptionalAction, default=None,
                      help="allow loopback TCP (AF_INET, localhost only) for server.tcp; "
                      "default: on when the configuration sets server.tcp, else Unix "
                      "sockets only and no network (PrivateNetwork=yes)")
    inst.add_argument("--dry-run", action="store_true",
                      help="print the files to stdout instead of writing them")
    inst.set_defaults(func=run)



def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def _options(args: argparse.Namespace) -> UnitOptions:
    if not _USER_RE.match(args.user):
        raise UsageError(
            f"systemd install --user {args.user!r}: not a valid system user name. "
            "Hint: use lower-case letters, digits, '_' or '-', starting with a letter."
        )
    exec_start = args.exec_start or default_exec_start()
    program = shlex.split(exec_start)[0] if exec_start.strip() else ""
    if not program or not os.path.isabs(program):
        raise UsageError(
            f"systemd install --exec-start {exec_start!r}: the program must be an absolute "
            "path. Hint: e.g. --exec-start '/usr/bin/edge-agent serve'."
        )
    protect_home = "yes"
    real = os.path.realpath(program)
    if any(p.startswith(_HOME_PREFIXES) for p in (program + "/", real + "/")):
        protect_home = "read-only"
        print(
            f"edge-agent: warning: {program} lives under a home directory, so the unit uses "
            "ProtectHome=read-only instead of yes; the service user must be able to read it.",
            file=sys.stderr,
        )
    tcp = args.tcp if args.tcp is not None else _tcp_configured()
    return UnitOptions(exec_start=exec_start, user=args.user, group=args.user,
                       protect_home=protect_home, tcp=tcp)


def _tcp_configured() -> bool:
    """server.tcp from the layered configuration (/etc/edge-agent/config.toml, EDGE_AGENT_*)."""
    from edge_agent.config import load_config

    tcp = load_config(None, env=os.environ, check_paths=False).server.tcp
    if tcp:
        print(f"edge-agent: server.tcp = {tcp!r} is configured: the unit allows loopback TCP "
              "(localhost only)", file=sys.stderr)
    return bool(tcp)


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise InstallError(
            f"systemd install: writing {path}: {exc.strerror or exc}. Hint: run it as root "
            "(sudo edge-agent systemd install), or use --prefix/--sysusers-dir/--tmpfiles-dir "
            "to write elsewhere, or --dry-run to print the files."
        ) from exc


def compile_installation() -> list[Path]:
    """Byte-compile the edge_agent and firmware_tools packages where they are installed (a
    module whose bytecode is current is skipped); the directories that could not be."""
    import compileall
    import io

    import edge_agent
    import firmware_tools

    failed = []
    for package in (edge_agent, firmware_tools):
        where = Path(package.__file__ or "").parent
        with contextlib.redirect_stdout(io.StringIO()):  # its per-file errors: summed up below
            ok = compileall.compile_dir(where, quiet=1)
        if not ok:
            failed.append(where)
    return failed


def run(args: argparse.Namespace) -> int:
    files = render_units(_options(args))
    targets = install_targets(args.prefix, args.sysusers_dir, args.tmpfiles_dir)
    if args.dry_run:
        for name, text in files.items():
            sys.stdout.write(f"# ---- {targets[name]}\n{text}\n")
        return 0
    for name, text in files.items():
        _write(targets[name], text)
        print(f"wrote {targets[name]}", file=sys.stderr)
    for where in compile_installation():
        print(f"edge-agent: warning: {where}: could not byte-compile every module; the service "
              "will compile them from source at each start (slower). Hint: run the install as "
              "the user who owns that directory, or as root.", file=sys.stderr)
    sysusers, tmpfiles = targets[SYSUSERS_FILE], targets[TMPFILES_FILE]
    print(
        "next:\n"
        f"  systemd-sysusers {sysusers}\n"
        f"  systemd-tmpfiles --create {tmpfiles}\n"
        "  systemctl daemon-reload\n"
        "  systemctl enable --now edge-agent.socket edge-agent.service",
        file=sys.stderr,
    )
    return 0
