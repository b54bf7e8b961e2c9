"""Opening the journal: one SQLite file, WAL, durability pragmas, integrity check, quarantine
(the check itself and the move aside are in journal/quarantine.py).

Invariants this module owns:
- Every open of the writer issues `PRAGMA journal_mode=WAL` and `PRAGMA synchronous=<mode>`
  (default FULL) and reads both back; SQLite persists the journal mode in the file but NOT
  `synchronous`, and sqlite-utils has no API for it, so it is set here on every open.
  Risk of the other modes: NORMAL in WAL mode survives a killed process but can lose the last
  committed transactions on a power cut (the WAL is not fsynced at each commit); OFF can also
  corrupt the file on a power cut. EXTRA adds a directory fsync on top of FULL.
- Before the first write the file passes `PRAGMA quick_check` (or `integrity_check`); it is
  the only step of an open whose cost grows with the file (about 0.3-0.9 ms per MB from the
  page cache here, read through a temporary memory map). `while_checking` runs other start
  work in the opening thread while the check runs in a worker thread on its own connection;
  the opening connection is `query_only` until the verdict, so "checked before the first
  write" holds either way. A file
  that is not a database, fails the check, or raises SQLITE_CORRUPT while migrating is moved
  aside as `<name>.corrupt-<UTC timestamp>` (with its -wal and -shm), a new file is started and
  the `QuarantineEvent` is returned on the `Journal` (and recorded in the new file's `events`
  table) so the daemon reports it in /health, the log and `status`. One quarantine per open at
  most: if the fresh file fails too, JournalError is raised (never a crash loop of moves).
- After the integrity check, the schema is checked against the file's user_version
  (`Migrations.schema_problems`: tables, columns, indexes): a valid SQLite file that is not
  the journal this program wrote (a table or column missing, user_version not matching the
  tables) is quarantined exactly like a corrupt one, before recovery reads it (a start that
  died on "no such table" every time was a restart loop).
- A newer schema than this program knows is not corruption: JournalVersionError (exit 78),
  the file is left untouched.
- Writes go through `Journal.transaction()` (BEGIN IMMEDIATE ... COMMIT on a connection in
  autocommit mode, `isolation_level=None`), so one Python block is one SQLite transaction and,
  with synchronous=FULL, one fsync. sqlite-utils calls nested inside use savepoints.
- Read-only opens (`readonly=True`, the CLI) never create, migrate, quarantine or write
  (`PRAGMA query_only`).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sqlite3
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edge_agent.journal._sqlite_utils import database
from edge_agent.journal.errors import (
    JournalError,
    JournalMissingError,
    JournalVersionError,
    NotAJournalError,
)
from edge_agent.journal.migrations import MIGRATIONS, Migrations
from edge_agent.journal.quarantine import (
    QuarantineEvent,
    check_integrity,
    integrity_pragma,
    is_corruption,
    quarantine,
    wal_keep_path,
)

if TYPE_CHECKING:
    import sqlite_utils

__all__ = [
    "Journal",
    "QuarantineEvent",
    "open_journal",
    "default_journal_path",
    "check_integrity",
    "quarantine",
    "SYNC_MODES",
    "DEFAULT_SYNC",
    "JOURNAL_FILE",
]

JOURNAL_FILE = "journal.sqlite3"
SYNC_MODES = ("OFF", "NORMAL", "FULL", "EXTRA")
DEFAULT_SYNC = "FULL"
_SYNC_VALUE = {"OFF": 0, "NORMAL": 1, "FULL": 2, "EXTRA": 3}
WAL_SIZE_LIMIT = 64 * 1024 * 1024  # bytes the -wal file is truncated to after a checkpoint

Connect = Callable[[str], sqlite3.Connection]


def default_journal_path(state_dir: str | os.PathLike[str]) -> Path:
    return Path(state_dir) / JOURNAL_FILE


def _default_connect(path: str) -> sqlite3.Connection:
    return sqlite3.connect(path, timeout=10.0, isolation_level=None)


class Journal:
    """An open journal database: `db` (sqlite_utils.Database) over `conn` (sqlite3)."""

    def __init__(self, path: Path, db: sqlite_utils.Database, *, synchronous: str,
                 readonly: bool, quarantined: QuarantineEvent | None, open_seconds: float,
                 schema_version: int, check_seconds: float = 0.0,
                 overlap_seconds: float = 0.0) -> None:
        self.path = path
        self.db = db
        self.conn: sqlite3.Connection = db.conn
        self.synchronous = synchronous
        self.readonly = readonly
        self.quarantined = quarantined
        self.open_seconds = open_seconds
        self.schema_version = schema_version
        self.check_seconds = check_seconds  # the integrity check itself
        # of open_seconds: the check and `while_checking` side by side (0.0: not overlapped)
        self.overlap_seconds = overlap_seconds

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """One SQLite write transaction (one fsync at COMMIT with synchronous=FULL). On any
        failure, the COMMIT's included (disk full, I/O error), the transaction is rolled back
        and the connection is left without one, so the same write can be tried again."""
        if self.conn.in_transaction:
            raise JournalError(
                f"journal {self.path}: a transaction is already open on this connection. "
                "Hint: group the writes in one `with journal.transaction():` block."
            )
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            yield self.conn
            self.conn.execute("COMMIT")
        except BaseException:
            if self.conn.in_transaction:
                with contextlib.suppress(sqlite3.Error):  # the first error is the one to report
                    self.conn.execute("ROLLBACK")
            raise

    def pragma(self, name: str) -> Any:
        row = self.conn.execute(f"PRAGMA {name}").fetchone()
        return None if row is None else row[0]

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _configure(conn: sqlite3.Connection, synchronous: str) -> None:
    fresh = conn.execute("PRAGMA page_count").fetchone()[0] == 0
    if fresh:
        # Only effective before the first table exists; lets prune() return pages to the OS.
        conn.execute("PRAGMA auto_vacuum=INCREMENTAL")
    mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
    if str(mode).lower() != "wal":
        raise JournalError(
            f"PRAGMA journal_mode=WAL returned {mode!r}. Hint: the journal needs a local "
            "filesystem with shared-memory support (not NFS, not a read-only mount)."
        )
    conn.execute(f"PRAGMA synchronous={synchronous}")
    got = conn.execute("PRAGMA synchronous").fetchone()[0]
    if got != _SYNC_VALUE[synchronous]:
        raise JournalError(f"PRAGMA synchronous={synchronous} did not take (reads back {got}). "
                           "Hint: report this SQLite build.")
    conn.execute("PRAGMA foreign_keys=ON")
    conn.execute(f"PRAGMA journal_size_limit={WAL_SIZE_LIMIT}")


def _check_sync(synchronous: str) -> str:
    mode = str(synchronous).upper()
    if mode not in SYNC_MODES:
        raise JournalError(
            f"journal synchronous mode {synchronous!r} is not one of {', '.join(SYNC_MODES)}. "
            "Hint: use FULL (the default); NORMAL can lose the last commits on a power cut."
        )
    return mode


class _SchemaMismatch(sqlite3.DatabaseError):
    """The file's tables do not match its user_version: quarantined like corruption."""


def _check_schema(conn: sqlite3.Connection, version: int, migrations: Migrations) -> None:
    problems = migrations.schema_problems(conn, version)
    if problems:
        more = f" (and {len(problems) - 4} more)" if len(problems) > 4 else ""
        raise _SchemaMismatch(f"schema does not match user_version {version}: "
                              + "; ".join(problems[:4]) + more)


def _version(conn: sqlite3.Connection, path: Path, migrations: Migrations) -> int:
    version = int(conn.execute("PRAGMA user_version").fetchone()[0])
    if version > migrations.latest:
        raise JournalVersionError(
            f"journal {path} has schema version {version}; this edge-agent knows up to "
            f"{migrations.latest}. The file was left untouched. Hint: run the newer edge-agent "
            "that wrote it, or move the file aside to start an empty journal."
        )
    return version


def _open_readonly(path: Path, connect: Connect | None, t0: float) -> Journal:
    if not path.is_file():
        raise JournalMissingError(
            f"no journal at {path}. Hint: start the daemon once (`edge-agent serve`) or pass "
            "the right --state-dir."
        )
    uri = f"file:{urllib.parse.quote(str(path))}?mode=rw"
    try:
        conn = (connect or (lambda p: sqlite3.connect(uri, uri=True, timeout=10.0,
                                                      isolation_level=None)))(str(path))
        conn.execute("PRAGMA query_only=ON")
        version = _version(conn, path, MIGRATIONS)
        tables = {name for (name,) in conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table'")}
    except sqlite3.DatabaseError as exc:
        raise JournalError(f"journal {path}: cannot read it ({exc}). Hint: if the daemon is not "
                           "running, starting it checks the file and moves a corrupt one "
                           "aside.") from exc
    if version == 0 or "requests" not in tables:  # an empty file, or another program's DB
        conn.close()
        what = (f"tables {', '.join(sorted(tables)[:5])}" if tables else "no tables")
        raise NotAJournalError(f"{path} is not an edge-agent journal (SQLite schema version "
                           f"{version}, {what}). Hint: point --journal at the daemon's journal "
                           "(STATE_DIR/journal.sqlite3, or journal.path in its configuration).")
    db = database(conn, execute_plugins=False)
    return Journal(path, db, synchronous="(set by the writer on each open)", readonly=True,
                   quarantined=None, open_seconds=time.monotonic() - t0,
                   schema_version=version)


def _private(path: Path) -> None:
    """Create the journal file 0600 before SQLite does (SQLite gives its -wal and -shm the
    main file's mode), so requests and tokens are not readable by other users whatever the
    umask; an existing file, -wal or -shm loses any permission for others (group bits an
    administrator set stay)."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
    except FileExistsError:
        pass
    except OSError:
        return  # SQLite's own open reports it, with the journal's wording
    for p in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        with contextlib.suppress(OSError):
            mode = os.stat(p).st_mode & 0o7777
            if mode & 0o007:
                os.chmod(p, mode & ~0o007)


def open_journal(
    path: str | os.PathLike[str],
    *,
    synchronous: str = DEFAULT_SYNC,
    check: str = "quick",
    readonly: bool = False,
    connect: Connect | None = None,
    migrations: Migrations = MIGRATIONS,
    now: Callable[[], float] = time.time,
    tracer: Callable[[str, Any], None] | None = None,
    on_corrupt: str = "quarantine",
    while_checking: Callable[[Journal], None] | None = None,
) -> Journal:
    """Open (creating, migrating, and when corrupt quarantining) the journal at `path`.

    check: "quick" (PRAGMA quick_check, default), "full" (integrity_check) or "none".
    connect: factory `connect(path) -> sqlite3.Connection` (default: sqlite3, autocommit mode).
    on_corrupt: "quarantine" (the daemon) or "raise" (maintenance commands: never move a file
    another process may hold open).
    while_checking: `fn(journal)` run in this thread while the check runs in another one (on
    its own connection; SQLite releases the GIL), so the check's time overlaps other start
    work. `journal` is query_only during the call: nothing is written before the check passes;
    a corrupt file is quarantined exactly as without it. Ignored for a new file and when
    migrations are pending (the check then runs first, alone).
    """
    t0 = time.monotonic()
    path = Path(path)
    if readonly:
        return _open_readonly(path, connect, t0)
    if check not in ("quick", "full", "none"):
        raise JournalError(f"journal check {check!r} is not quick, full or none. "
                           "Hint: use quick (the default).")
    sync = _check_sync(synchronous)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise JournalError(f"journal directory {path.parent}: cannot create it "
                           f"({exc.strerror or exc}). Hint: fix --state-dir or its "
                           "permissions.") from exc
    event: QuarantineEvent | None = None
    # SQLite may fold a -wal into the file and delete it when a connection closes, even when
    # the file turns out corrupt: a hard link keeps the -wal as found, for the quarantine.
    wal, kept = path.with_name(path.name + "-wal"), wal_keep_path(path)
    with contextlib.suppress(OSError):
        kept.unlink()
    with contextlib.suppress(OSError):
        os.link(wal, kept)
    while True:
        _private(path)  # 0600 whatever the umask (also the fresh file after a quarantine)
        conn = (connect or _default_connect)(str(path))
        try:
            fresh = conn.execute("PRAGMA page_count").fetchone()[0] == 0
            _configure(conn, sync)
            db = database(conn, execute_plugins=False, tracer=tracer)
            overlap = (while_checking is not None and check != "none" and not fresh
                       and event is None and not migrations.pending(db))
            t_check = time.monotonic()
            if overlap:
                assert while_checking is not None
                peek = Journal(path, db, synchronous=sync, readonly=False, quarantined=None,
                               open_seconds=0.0,
                               schema_version=_version(conn, path, migrations))
                problems, check_s = _check_overlapped(path, conn, connect, check == "full",
                                                      functools.partial(while_checking, peek))
                overlap_s = time.monotonic() - t_check
            else:
                problems = [] if check == "none" else check_integrity(conn, full=check == "full")
                check_s, overlap_s = time.monotonic() - t_check, 0.0
            if problems:
                lines = [ln.strip() for p in problems for ln in p.splitlines() if ln.strip()]
                raise sqlite3.DatabaseError(f"{integrity_pragma(check == 'full')}: "
                                            + "; ".join(lines[:3])[:300])
            version = _version(conn, path, migrations)
            _check_schema(conn, version, migrations)
            migrations.apply(db)
            version = int(conn.execute("PRAGMA user_version").fetchone()[0])
        except sqlite3.DatabaseError as exc:
            conn.close()
            corrupt = isinstance(exc, _SchemaMismatch) or is_corruption(exc) or (
                "malformed" in str(exc) or type(exc) is sqlite3.DatabaseError
            )
            if not corrupt:
                raise JournalError(f"journal {path}: {exc}. Hint: check the file's permissions "
                                   "and free space.") from exc
            if on_corrupt != "quarantine":
                raise JournalError(
                    f"journal {path} is corrupt ({exc}). Hint: stop the daemon and start it "
                    "again: it moves a corrupt journal aside and starts a new one."
                ) from exc
            if event is not None:
                raise JournalError(
                    f"journal {path}: a freshly started journal failed too ({exc}) after the "
                    f"corrupt one was moved to {event.moved_to}. Hint: check the storage "
                    "device (dmesg) and free space."
                ) from exc
            event = quarantine(path, str(exc), now=now())
            continue
        except BaseException:
            conn.close()
            raise
        break
    with contextlib.suppress(OSError):
        kept.unlink()
    if event is not None:
        with _autocommit_tx(conn):
            conn.execute("INSERT INTO events (at, kind, message) VALUES (?, ?, ?)",
                         (event.at, "quarantine", event.message()))
    return Journal(path, db, synchronous=sync, readonly=False, quarantined=event,
                   open_seconds=time.monotonic() - t0, schema_version=version,
                   check_seconds=check_s, overlap_seconds=overlap_s)


def _check_overlapped(path: Path, conn: sqlite3.Connection, connect: Connect | None,
                      full: bool, work: Callable[[], None]) -> tuple[list[str], float]:
    """check_integrity on a second connection in a worker thread while `work()` runs here
    with `conn` query_only. Returns (problems, seconds the check took); raises
    sqlite3.DatabaseError as the check does. An exception of `work` is raised after the
    check's verdict (a corrupt file wins)."""
    result: list[Any] = []
    took: list[float] = [0.0]

    def run() -> None:
        t0 = time.monotonic()
        try:
            checker = (connect or _default_connect)(str(path))
            try:
                checker.execute("PRAGMA query_only=ON")
                result.append(check_integrity(checker, full=full))
            finally:
                checker.close()
        except BaseException as exc:  # noqa: BLE001 - handed to the opening thread
            result.append(exc)
        took[0] = time.monotonic() - t0

    worker = threading.Thread(target=run, name="journal-check", daemon=True)
    conn.execute("PRAGMA query_only=ON")
    worker.start()
    failure: BaseException | None = None
    try:
        work()
    except BaseException as exc:  # noqa: BLE001 - decided after the check's verdict
        failure = exc
    finally:
        worker.join()
        conn.execute("PRAGMA query_only=OFF")
    verdict = result[0]
    if isinstance(verdict, BaseException):
        raise verdict
    if verdict or failure is None:
        return list(verdict), took[0]
    raise failure


@contextlib.contextmanager
def _autocommit_tx(conn: sqlite3.Connection) -> Iterator[None]:
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")
