"""The journal's schema as a registry of numbered migrations (sqlite-utils style).

Invariants this module owns:
- `PRAGMA user_version` is the number of the last applied migration; migrations are applied in
  order, each in its own transaction together with the user_version bump, so a crash leaves the
  file at a whole version (never between two).
- Migrations are append-only: a released migration is never edited; a change is a new number.
- Table meanings (migration 1):
  requests        one row per accepted request; `input` is JSON ({"prompt": str} or
                  {"messages": [...]}), `prompt_ids` little-endian int32, `params` JSON
                  (seed may exceed SQLite's int64, so it lives in JSON), `deadline` wall clock.
  tokens          (request_id, idx) -> token_id and `text_offset`, the detokenizer byte offset
                  after that token (a resumed stream starts there, on a UTF-8 boundary).
  sessions        token history of each conversation (little-endian int32 blob).
  tokenizer_cache Tokenizer.to_bytes() keyed by (model sha256, tokenizer fingerprint).
  models          registry facts: sha256, prepared file, last load, last failure.
  flash_jobs / flash_sectors   per-sector state of a flash job (pending, erased, written,
                  verified).
  events          journal-level events (quarantine, recovery) for /health and `status`.
- Migration 2 (warm start in O(open work)): `requests.session_pending` is 1 while a done turn
  of a session is not yet in that session's history (set by the transaction that finishes the
  request as done, cleared by the one that saves the session); partial indexes hold only those
  rows (`requests_session_pending`) and only the queued/running ones (`requests_open`), so a
  start finds what to resume and the turns to put back without reading finished requests.
  Queries must repeat the index's WHERE with literals (a `?` cannot prove it).
- Migration 3 (a session's prompt cache across a restart): `kv_snapshots` holds, per
  session, the llama.cpp KV state of its last turn's slot (`data`, an engine blob that names
  the model and context it fits), the `n_tokens` ids it holds (`tokens`, little-endian
  int32), the engine's `identity` and the blob's `bytes`; newest first by `created_at`.
- Migration 4 (sessions that offer tools): `sessions.tools` is the JSON of the functions its
  first turn was sent (NULL: none), which the history lists to the model; `sessions.calls`
  the JSON object {call id: function name} of the tool calls its turns made, so a later
  turn's tool result names the function its `tool_call_id` called (NULL: none yet).
- `schema_problems(conn, version)`: a file at user_version N holds exactly the tables, columns
  and indexes migrations 1..N create (SQLite's own `sqlite_*` objects aside); anything else
  (a table or column missing or unknown, a user_version that does not match the tables) is
  listed, and open_journal quarantines such a file like a corrupt one. Column types are not
  compared (they are spelled by sqlite-utils, which may change between versions).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from typing import TYPE_CHECKING

from edge_agent.journal._sqlite_utils import database

if TYPE_CHECKING:
    import sqlite_utils

__all__ = ["Migrations", "MIGRATIONS", "REQUEST_STATES", "FINISHED_STATES", "SECTOR_STATES",
           "schema_of"]

REQUEST_STATES = ("queued", "running", "done", "failed", "cancelled", "expired")
FINISHED_STATES = ("done", "failed", "cancelled", "expired")
SECTOR_STATES = ("pending", "erased", "written", "verified")

Migration = Callable[["sqlite_utils.Database"], None]


class Migrations:
    """Numbered migrations; `@registry(n)` registers `fn(db)` as migration n (1, 2, ...)."""

    def __init__(self) -> None:
        self._steps: dict[int, Migration] = {}
        self._schemas: dict[int, dict[str, tuple[str, ...]]] = {}

    def __call__(self, number: int) -> Callable[[Migration], Migration]:
        def register(fn: Migration) -> Migration:
            if number in self._steps:
                raise ValueError(f"migration {number} registered twice")
            if number != len(self._steps) + 1:
                raise ValueError(f"migration {number} out of order; next is "
                                 f"{len(self._steps) + 1}")
            self._steps[number] = fn
            return fn

        return register

    @property
    def latest(self) -> int:
        return len(self._steps)

    def names(self) -> list[str]:
        return [f"{n:04d}_{fn.__name__}" for n, fn in sorted(self._steps.items())]

    def pending(self, db: sqlite_utils.Database) -> list[int]:
        version = int(db.execute("PRAGMA user_version").fetchone()[0])
        return [n for n in sorted(self._steps) if n > version]

    def schema(self, version: int) -> dict[str, tuple[str, ...]]:
        """`schema_of` a database migrated to `version` (built once in memory, then cached)."""
        if version not in self._schemas:
            conn = sqlite3.connect(":memory:", isolation_level=None)
            try:
                db = database(conn, execute_plugins=False)
                for number in sorted(self._steps):
                    if number <= version:
                        self._steps[number](db)
                self._schemas[version] = schema_of(conn)
            finally:
                conn.close()
        return self._schemas[version]

    def schema_problems(self, conn: sqlite3.Connection, version: int) -> list[str]:
        """How the file's schema differs from what user_version `version` stands for ([]:
        it matches)."""
        want, have = self.schema(version), schema_of(conn)
        problems = [f"{name} is missing" for name in want if name not in have]
        problems += [f"{name} is not part of schema version {version}" for name in have
                     if name not in want]
        for name, cols in want.items():
            got = have.get(name)
            if got is None or got == cols:
                continue
            missing = [c for c in cols if c not in got]
            extra = [c for c in got if c not in cols]
            if missing:
                problems.append(f"{name} lacks column(s) {', '.join(missing)}")
            if extra:
                problems.append(f"{name} has column(s) {', '.join(extra)} unknown to schema "
                                f"version {version}")
        return problems

    def apply(self, db: sqlite_utils.Database) -> list[int]:
        """Apply every pending migration, each atomically with its user_version bump."""
        done = []
        for number in self.pending(db):
            db.conn.execute("BEGIN IMMEDIATE")
            try:
                self._steps[number](db)
                db.conn.execute(f"PRAGMA user_version={number}")
            except BaseException:
                if db.conn.in_transaction:
                    db.conn.execute("ROLLBACK")
                raise
            db.conn.execute("COMMIT")
            done.append(number)
        return done


def schema_of(conn: sqlite3.Connection) -> dict[str, tuple[str, ...]]:
    """{"table NAME" or "index NAME": its column names} of a database, without SQLite's own
    objects (sqlite_stat1, sqlite_sequence, automatic indexes)."""
    out: dict[str, tuple[str, ...]] = {}
    rows = conn.execute("SELECT type, name FROM sqlite_master WHERE type IN ('table', 'index') "
                        "AND name NOT LIKE 'sqlite\\_%' ESCAPE '\\' ORDER BY type, name")
    for kind, name in rows.fetchall():
        quoted = '"' + name.replace('"', '""') + '"'
        pragma = "table_info" if kind == "table" else "index_info"
        col = 1 if kind == "table" else 2
        out[f"{kind} {name}"] = tuple(str(r[col]) for r in
                                      conn.execute(f"PRAGMA {pragma}({quoted})").fetchall())
    return out


MIGRATIONS = Migrations()


@MIGRATIONS(1)
def initial(db: sqlite_utils.Database) -> None:
    states = ", ".join(f"'{s}'" for s in REQUEST_STATES)
    db.execute(f"""
        CREATE TABLE requests (
            id TEXT PRIMARY KEY,
            session TEXT,
            model TEXT NOT NULL,
            input TEXT NOT NULL,
            prompt_ids BLOB NOT NULL,
            params TEXT NOT NULL,
            priority INTEGER NOT NULL DEFAULT 5,
            deadline REAL,
            state TEXT NOT NULL CHECK (state IN ({states})),
            created_at REAL NOT NULL,
            started_at REAL,
            finished_at REAL,
            attempts INTEGER NOT NULL DEFAULT 0,
            finish_reason TEXT,
            error TEXT
        )""")
    db.table("requests").create_index(["state", "finished_at"], index_name="requests_state")
    db.table("requests").create_index(["session"], index_name="requests_session")
    db.execute("""
        CREATE TABLE tokens (
            request_id TEXT NOT NULL REFERENCES requests(id) ON DELETE CASCADE,
            idx INTEGER NOT NULL,
            token_id INTEGER NOT NULL,
            text_offset INTEGER NOT NULL,
            PRIMARY KEY (request_id, idx)
        ) WITHOUT ROWID""")
    db.table("sessions").create(
        {"id": str, "model": str, "history": bytes, "n_tokens": int, "turns": int,
         "created_at": float, "updated_at": float},
        pk="id", not_null={"model", "history", "created_at", "updated_at"},
        defaults={"n_tokens": 0, "turns": 0},
    )
    db.table("sessions").create_index(["updated_at"], index_name="sessions_updated")
    db.table("tokenizer_cache").create(
        {"model_sha256": str, "fingerprint": str, "data": bytes, "created_at": float},
        pk=("model_sha256", "fingerprint"), not_null={"data", "created_at"},
    )
    db.table("models").create(
        {"name": str, "path": str, "sha256": str, "size": int, "mtime_ns": int,
         "prepared_path": str, "last_load_at": float, "last_load_s": float,
         "last_failure": str, "last_failure_at": float, "updated_at": float},
        pk="name",
    )
    db.table("flash_jobs").create(
        {"id": int, "image_sha256": str, "board": str, "port": str, "state": str,
         "created_at": float, "updated_at": float, "error": str},
        pk="id", not_null={"image_sha256", "board", "port", "state", "created_at"},
    )
    sector_states = ", ".join(f"'{s}'" for s in SECTOR_STATES)
    db.execute(f"""
        CREATE TABLE flash_sectors (
            job_id INTEGER NOT NULL REFERENCES flash_jobs(id) ON DELETE CASCADE,
            sector INTEGER NOT NULL,
            address INTEGER NOT NULL,
            size INTEGER NOT NULL,
            state TEXT NOT NULL CHECK (state IN ({sector_states})),
            updated_at REAL NOT NULL,
            PRIMARY KEY (job_id, sector)
        ) WITHOUT ROWID""")
    db.table("events").create({"id": int, "at": float, "kind": str, "message": str}, pk="id",
                        not_null={"at", "kind", "message"})


@MIGRATIONS(2)
def warm_start_indexes(db: sqlite_utils.Database) -> None:
    db.execute("ALTER TABLE requests ADD COLUMN session_pending INTEGER NOT NULL DEFAULT 0")
    # the turns a start before this migration put back: done, newer than their session's row
    db.execute("""
        UPDATE requests SET session_pending = 1 WHERE id IN (
            SELECT r.id FROM requests r LEFT JOIN sessions s ON s.id = r.session
            WHERE r.session IS NOT NULL AND r.state = 'done'
              AND (s.updated_at IS NULL OR r.finished_at > s.updated_at))""")
    db.execute("CREATE INDEX requests_session_pending ON requests (finished_at) "
               "WHERE session_pending = 1")
    # recovery's query; the (state, finished_at) index is not used for it once ANALYZE has
    # seen that most rows are finished (the planner then scans the whole table)
    db.execute("CREATE INDEX requests_open ON requests (created_at) "
               "WHERE state IN ('queued', 'running')")


@MIGRATIONS(3)
def kv_snapshots(db: sqlite_utils.Database) -> None:
    db.table("kv_snapshots").create(
        {"session": str, "model": str, "tokens": bytes, "n_tokens": int, "identity": str,
         "data": bytes, "bytes": int, "created_at": float},
        pk="session", not_null={"model", "tokens", "identity", "data", "created_at"},
        defaults={"n_tokens": 0, "bytes": 0},
    )
    db.table("kv_snapshots").create_index(["created_at"], index_name="kv_snapshots_created")


@MIGRATIONS(4)
def session_tools(db: sqlite_utils.Database) -> None:
    db.execute("ALTER TABLE sessions ADD COLUMN tools TEXT")
    db.execute("ALTER TABLE sessions ADD COLUMN calls TEXT")
