"""Errors of the journal; all subclass edge_agent.errors.EdgeAgentError.

Invariant: every message names the journal file (or request) it is about, what came back, and
ends with a `Hint:` saying what to do.
"""

from __future__ import annotations

from edge_agent.errors import EXIT_CONFIG, EdgeAgentError

__all__ = ["JournalError", "JournalVersionError", "JournalConflictError", "JournalMissingError",
           "NotAJournalError", "JournalUnavailableError", "StateDirBusyError", "EXIT_TEMPFAIL"]

EXIT_TEMPFAIL = 75  # EX_TEMPFAIL: try again later (another daemon holds the state directory)


class JournalError(EdgeAgentError):
    """The journal could not be opened, read or written."""


class JournalVersionError(JournalError):
    """The file's schema is newer than this program knows (a downgrade). Not corruption: the
    file is kept, and the exit code is EX_CONFIG so systemd does not restart in a loop."""

    exit_code = EXIT_CONFIG


class JournalConflictError(JournalError, ValueError):
    """A write that would change what is already journaled (a token at an index that holds
    another token, a gap in a token stream, an unknown request)."""


class JournalMissingError(JournalError, FileNotFoundError):
    """A read-only open of a journal file that does not exist."""


class NotAJournalError(JournalError):
    """A read-only open of a SQLite file that is not an edge-agent journal (an empty file,
    another program's database): a tool must not read it as one, nor write a journal into it."""


class JournalUnavailableError(JournalError):
    """The journal's storage refuses writes (disk full, I/O error): nothing can be accepted
    until a write succeeds again (the daemon answers 507 meanwhile)."""


class StateDirBusyError(EdgeAgentError):
    """Another daemon holds the state directory's lock. Exit status 75 (EX_TEMPFAIL): under
    Restart=on-failure the service manager tries again later, when the holder may be gone."""

    exit_code = EXIT_TEMPFAIL
