"""Errors of the journal; all subclass edge_agent.errors.EdgeAgentError.

Invariant: every message names the journal file (or request) it is about, what came back, and
ends with a `Hint:` saying what to do.
"""

from __future__ import annotations

from edge_agent.errors import EXIT_CONFIG, EdgeAgentError

__all__ = ["JournalError", "JournalVersionError", "JournalConflictError", "JournalMissingError"]


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
