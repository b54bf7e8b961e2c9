"""The journal: durable state of the control plane in one SQLite file (WAL, synchronous=FULL).

Requests, generated tokens (one transaction per decode step), sessions, the tokenizer cache,
model registry facts and flash jobs; integrity check and quarantine at open; warm-start
recovery. Never imports transports or the daemon (docs/architecture.md; checked by
tests/test_rooms.py). The control plane is the only writer; the CLI opens the file read-only
(`open_journal(path, readonly=True)`).
"""

from __future__ import annotations

from typing import Any

from edge_agent.journal.db import (
    DEFAULT_SYNC,
    JOURNAL_FILE,
    SYNC_MODES,
    Journal,
    QuarantineEvent,
    check_integrity,
    default_journal_path,
    open_journal,
)
from edge_agent.journal.errors import (
    JournalConflictError,
    JournalError,
    JournalMissingError,
    JournalUnavailableError,
    JournalVersionError,
    NotAJournalError,
    StateDirBusyError,
)
from edge_agent.journal.flashjobs import FlashJob, FlashJobs, FlashSector
from edge_agent.journal.migrations import FINISHED_STATES, MIGRATIONS, REQUEST_STATES, Migrations
from edge_agent.journal.recovery import (
    RecoveryPlan,
    Resumable,
    cache_tokenizer,
    load_cached_tokenizer,
    recover,
)
from edge_agent.journal.statelock import StateDirLock
from edge_agent.journal.store import JournaledRequest, JournalStore, PruneResult, Session, Token

__all__ = [
    "DEFAULT_SYNC", "JOURNAL_FILE", "SYNC_MODES", "Journal", "QuarantineEvent",
    "check_integrity", "default_journal_path", "open_journal", "JournalConflictError",
    "JournalError", "JournalMissingError", "NotAJournalError", "JournalUnavailableError",
    "JournalVersionError",
    "StateDirBusyError", "StateDirLock", "FlashJob", "FlashJobs",
    "FlashSector", "FINISHED_STATES", "MIGRATIONS", "REQUEST_STATES", "Migrations",
    "RecoveryPlan", "Resumable", "cache_tokenizer", "load_cached_tokenizer", "recover",
    "JournaledRequest", "JournalStore", "PruneResult", "Session", "Token", "open_store",
]


def open_store(path: str, **kwargs: Any) -> JournalStore:
    """`JournalStore(open_journal(path, **kwargs))`."""
    return JournalStore(open_journal(path, **kwargs))
