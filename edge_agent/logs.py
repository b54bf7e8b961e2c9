"""How edge-agent's log lines look on stderr, in a terminal and under systemd.

Every module logs through `logging.getLogger(__name__)` (the `edge_agent` hierarchy; llama.cpp's
own log is the `edge_agent.llama` logger). Only `configure()` installs a handler: `cli.main`
calls it for every command and the runner process calls it with the control plane's level.

Invariants owned here:
- One line per record, `edge-agent: LEVEL: message`, the level word left out for INFO
  (`edge-agent: listening on ...`, `edge-agent: warning: ...`); a multi-line message
  (a traceback) keeps its lines.
- Under systemd (`$JOURNAL_STREAM` names the device:inode of the stderr we write to, as
  systemd.exec(5) describes) every line, continuation lines included, starts with its syslog
  priority `<N>` (sd-daemon(3)): journald strips it and files the line at that priority, so
  `journalctl -p warning -u edge-agent` shows warnings and errors only. A stderr redirected
  elsewhere (a file, a pipe) gets no prefix even when the variable is inherited.
- The handler writes to whatever `sys.stderr` is when a record is emitted.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from typing import IO

__all__ = ["LineFormatter", "StderrHandler", "configure", "journal_stream_matches",
           "level_for", "syslog_priority", "PROG"]

PROG = "edge-agent"


def syslog_priority(levelno: int) -> int:
    """The syslog priority of a logging level: 2 crit, 3 err, 4 warning, 6 info, 7 debug."""
    if levelno >= logging.CRITICAL:
        return 2
    if levelno >= logging.ERROR:
        return 3
    if levelno >= logging.WARNING:
        return 4
    if levelno >= logging.INFO:
        return 6
    return 7


def journal_stream_matches(env: Mapping[str, str], stream: IO[str] | IO[bytes]) -> bool:
    """True when `env`'s JOURNAL_STREAM ("DEV:INODE", decimal) is the file behind `stream`."""
    dev, sep, ino = env.get("JOURNAL_STREAM", "").partition(":")
    if not sep or not dev.isdigit() or not ino.isdigit():
        return False
    try:
        st = os.fstat(stream.fileno())
    except (AttributeError, OSError, ValueError):  # no descriptor (a test's capture), closed
        return False
    return (st.st_dev, st.st_ino) == (int(dev), int(ino))


class LineFormatter(logging.Formatter):
    """`edge-agent: warning: text`; with `journal=True` each line starts with `<priority>`."""

    def __init__(self, *, journal: bool = False) -> None:
        super().__init__()
        self.journal = journal

    def format(self, record: logging.LogRecord) -> str:
        text = record.getMessage()
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        level = "" if logging.INFO <= record.levelno < logging.WARNING else (
            f"{record.levelname.lower()}: ")
        line = f"{PROG}: {level}{text}"
        if not self.journal:
            return line
        prefix = f"<{syslog_priority(record.levelno)}>"
        return "\n".join(prefix + part for part in line.split("\n"))


class StderrHandler(logging.Handler):
    """Writes each formatted record to the current `sys.stderr` and flushes it."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stderr
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:
            self.handleError(record)


def level_for(*, verbose: bool = False, quiet: bool = False) -> int:
    """The `edge_agent` logger's level for the CLI's -v / -q: DEBUG, WARNING, else INFO."""
    if verbose:
        return logging.DEBUG
    return logging.WARNING if quiet else logging.INFO


def configure(level: int, *, env: Mapping[str, str] = os.environ) -> StderrHandler:
    """Install the one stderr handler on the root logger (replacing an earlier one of ours,
    so calling it again is harmless) and set the `edge_agent` loggers to `level`. Other
    libraries' records (asyncio's) reach the same handler at their own WARNING default."""
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, StderrHandler)]:
        root.removeHandler(old)
    handler = StderrHandler()
    handler.setFormatter(LineFormatter(journal=journal_stream_matches(env, sys.stderr)))
    root.addHandler(handler)
    logging.getLogger("edge_agent").setLevel(level)
    return handler
