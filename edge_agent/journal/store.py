"""The journal API the control plane calls: requests, tokens, sessions, tokenizer cache, models.

Invariants this module owns:
- The control plane is the only writer; a `JournalStore` is used from one thread.
- Every public write is ONE transaction that is durable (per the file's `synchronous` mode)
  when the call returns: `add_request` returns only after the request is on disk, so its id can
  be handed out; `append_tokens` writes one decode step for every sequence of the batch (and the
  requests that finish in it) in one transaction: one fsync per step, not per token.
- Journaled tokens never change: a token index is written once; re-sending the same token at an
  index (a replay after a runner death) is accepted and ignored, a different token or a gap is
  JournalConflictError and the whole step is rolled back. Tokens of a finished request are
  refused.
- A request's state only moves queued -> running -> (queued again on requeue) -> one of
  FINISHED_STATES, after which it never changes.
- The transaction that finishes a session's request as done marks it `session_pending`;
  `save_session(..., turn=id)` clears the mark in the transaction that writes the history, so
  `pending_turns()` is exactly the done turns whose history save did not happen.
- The warm-start reads (`open_requests`, `pending_turns`) go through partial indexes: their
  cost follows the open work, not the number of finished requests or sessions kept.
"""

from __future__ import annotations

import json
import os
import struct
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from edge_agent.journal.db import Journal
from edge_agent.journal.errors import JournalConflictError, JournalError
from edge_agent.journal.flashjobs import FlashJobs
from edge_agent.journal.migrations import FINISHED_STATES, REQUEST_STATES
from edge_agent.journal.retention import PruneResult, Retention

__all__ = ["JournalStore", "JournaledRequest", "Token", "Session", "PruneResult", "pack_ids",
           "unpack_ids"]

_FIN_SQL = ", ".join(f"'{s}'" for s in FINISHED_STATES)


def pack_ids(ids: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(ids)}i", *ids)


def unpack_ids(data: bytes | None) -> list[int]:
    if not data:
        return []
    return list(struct.unpack(f"<{len(data) // 4}i", data))


class Token(NamedTuple):
    """One generated token: its index in the request's output and the detokenizer byte offset
    after it (`text_offset`: bytes of output text emitted once this token was pushed)."""

    request_id: str
    index: int  # type: ignore[assignment]  # shadows tuple.index(), which nothing here calls
    token_id: int
    text_offset: int


@dataclass(frozen=True)
class JournaledRequest:
    id: str
    session: str | None
    model: str
    input: Any
    prompt_ids: list[int]
    params: dict[str, Any]
    priority: int
    deadline: float | None
    state: str
    created_at: float
    started_at: float | None
    finished_at: float | None
    attempts: int
    finish_reason: str | None
    error: str | None

    @property
    def finished(self) -> bool:
        return self.state in FINISHED_STATES

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass(frozen=True)
class Session:
    id: str
    model: str
    history: list[int]
    turns: int
    created_at: float
    updated_at: float
    tools: str | None = None  # JSON of the functions its first turn was sent (None: none)
    calls: dict[str, str] = field(default_factory=dict)  # call id -> function


_REQ_COLS = ("id, session, model, input, prompt_ids, params, priority, deadline, state, "
             "created_at, started_at, finished_at, attempts, finish_reason, error")


def _request(row: Sequence[Any]) -> JournaledRequest:
    return JournaledRequest(row[0], row[1], row[2], json.loads(row[3]), unpack_ids(row[4]),
                            json.loads(row[5]), *row[6:])


class JournalStore(Retention):
    """Typed reads and single-transaction writes over an open `Journal` (retention and size:
    journal/retention.py)."""

    def __init__(self, journal: Journal, *, clock: Any = time.time) -> None:
        self.journal = journal
        self.conn = journal.conn
        self._clock = clock
        self.flash = FlashJobs(journal, clock=clock)

    def close(self) -> None:
        self.journal.close()

    # -- requests -------------------------------------------------------------------------

    def add_request(self, *, id: str, model: str, input: Any, prompt_ids: Sequence[int],
                    params: Mapping[str, Any], priority: int = 5, deadline: float | None = None,
                    session: str | None = None, state: str = "queued",
                    now: float | None = None) -> JournaledRequest:
        """Record an accepted request; durable when this returns (hand out its id after)."""
        return self.add_requests([dict(
            id=id, model=model, input=input, prompt_ids=prompt_ids, params=params,
            priority=priority, deadline=deadline, session=session, state=state)], now=now)[0]

    def add_requests(self, requests: Sequence[Mapping[str, Any]], *,
                     now: float | None = None) -> list[JournaledRequest]:
        """Record accepted requests (each `add_request`'s keywords) in ONE transaction, so a
        burst costs one fsync; durable when this returns, and none is when it raises."""
        now = self._clock() if now is None else now
        rows = []
        for r in requests:
            state = r.get("state", "queued")
            if state not in ("queued", "running"):
                raise JournalError(f"request {r['id']}: cannot be added in state {state!r}. "
                                   "Hint: add it as queued or running.")
            rows.append((r["id"], r.get("session"), r["model"],
                         json.dumps(r["input"], ensure_ascii=False),
                         pack_ids(list(r["prompt_ids"])),
                         json.dumps(dict(r["params"]), sort_keys=True),
                         int(r.get("priority", 5)), r.get("deadline"), state, now,
                         now if state == "running" else None, None,
                         1 if state == "running" else 0, None, None))
        if not rows:
            return []
        try:
            with self.journal.transaction() as conn:
                conn.executemany(f"INSERT INTO requests ({_REQ_COLS}) VALUES "
                                 f"({', '.join('?' * len(rows[0]))})", rows)
        except Exception as exc:
            if "UNIQUE" in str(exc):
                ids = ", ".join(str(r[0]) for r in rows)
                raise JournalConflictError(
                    f"request {ids}: already journaled. Hint: use a new request id."
                ) from exc
            raise
        return [_request(row) for row in rows]

    def get_request(self, request_id: str) -> JournaledRequest | None:
        row = self.conn.execute(f"SELECT {_REQ_COLS} FROM requests WHERE id = ?",
                                (request_id,)).fetchone()
        return None if row is None else _request(row)

    def requests(self, states: Iterable[str] | None = None, *, limit: int | None = None,
                 newest_first: bool = False) -> list[JournaledRequest]:
        sql = f"SELECT {_REQ_COLS} FROM requests"
        args: list[Any] = []
        if states is not None:
            states = list(states)
            sql += f" WHERE state IN ({', '.join('?' * len(states))})"
            args += states
        sql += " ORDER BY created_at DESC, rowid DESC" if newest_first else (
            " ORDER BY created_at, rowid")
        if limit is not None:
            sql += " LIMIT ?"
            args.append(int(limit))
        return [_request(r) for r in self.conn.execute(sql, args)]

    def open_requests(self) -> list[JournaledRequest]:
        """Queued and running requests, oldest first (partial index `requests_open`: reads
        only those rows, however many finished requests the journal keeps)."""
        return [_request(r) for r in self.conn.execute(
            f"SELECT {_REQ_COLS} FROM requests WHERE state IN ('queued', 'running') "
            "ORDER BY created_at, rowid")]

    def set_running(self, request_ids: Iterable[str], *, now: float | None = None) -> None:
        now = self._clock() if now is None else now
        ids = list(request_ids)
        with self.journal.transaction() as conn:
            for rid in ids:
                cur = conn.execute(
                    "UPDATE requests SET state = 'running', attempts = attempts + 1, "
                    "started_at = coalesce(started_at, ?) WHERE id = ? AND state IN "
                    "('queued', 'running')", (now, rid))
                if cur.rowcount != 1:
                    raise self._not_open(rid, "start")

    def requeue(self, request_ids: Iterable[str]) -> None:
        """Running -> queued (runner died, or recovery after a restart)."""
        with self.journal.transaction() as conn:
            for rid in request_ids:
                conn.execute("UPDATE requests SET state = 'queued' WHERE id = ? AND "
                             "state = 'running'", (rid,))

    def finish(self, request_id: str, state: str, *, error: str | None = None,
               finish_reason: str | None = None, now: float | None = None) -> None:
        with self.journal.transaction() as conn:
            self._finish(conn, request_id, state, error, finish_reason,
                         self._clock() if now is None else now)

    def _finish(self, conn: Any, rid: str, state: str, error: str | None,
                finish_reason: str | None, now: float) -> None:
        if state not in FINISHED_STATES:
            raise JournalError(f"request {rid}: {state!r} is not a final state "
                               f"({', '.join(FINISHED_STATES)}). Hint: pass one of those.")
        cur = conn.execute(
            f"UPDATE requests SET state = ?, error = ?, finish_reason = ?, finished_at = ?, "
            f"session_pending = (session IS NOT NULL AND ? = 'done') "
            f"WHERE id = ? AND state NOT IN ({_FIN_SQL})",
            (state, error, finish_reason, now, state, rid))
        if cur.rowcount != 1:
            raise self._not_open(rid, f"finish as {state}")

    def _not_open(self, rid: str, what: str) -> JournalConflictError:
        row = self.conn.execute("SELECT state FROM requests WHERE id = ?", (rid,)).fetchone()
        found = "it is not journaled" if row is None else f"it is already {row[0]}"
        return JournalConflictError(f"request {rid}: cannot {what}: {found}. Hint: only a "
                                    "queued or running request can change state.")

    # -- tokens ---------------------------------------------------------------------------

    def append_tokens(self, step: Iterable[tuple[str, int, int, int]], *,
                      finish: Iterable[tuple[str, str, str | None, str | None]] = (),
                      running: Iterable[str] = (), now: float | None = None) -> int:
        """Journal one decode step: rows (request_id, index, token_id, text_offset) for every
        sequence of the batch, `running` ids of the requests that started in it, and `finish`
        rows (request_id, state, error, finish_reason) for the requests that end with it, in
        ONE transaction. Returns the number of new tokens."""
        rows = sorted(Token(*r) for r in step)
        ends = list(finish)
        starts = list(running)
        if not rows and not ends and not starts:
            return 0
        by_req: dict[str, list[Token]] = {}
        for r in rows:
            by_req.setdefault(r.request_id, []).append(r)
        new: list[Token] = []
        stamp = self._clock() if now is None else now
        with self.journal.transaction() as conn:
            for rid in starts:  # a request finished meanwhile stays finished
                conn.execute(
                    "UPDATE requests SET state = 'running', attempts = attempts + 1, "
                    "started_at = coalesce(started_at, ?) WHERE id = ? AND state IN "
                    "('queued', 'running')", (stamp, rid))
            if by_req:
                marks = ", ".join("?" * len(by_req))
                found = {rid: (state, top) for rid, state, top in conn.execute(
                    "SELECT id, state, (SELECT max(idx) FROM tokens WHERE request_id = "
                    f"requests.id) FROM requests WHERE id IN ({marks})", list(by_req))}
                for rid, toks in by_req.items():
                    new += self._check_tokens(conn, rid, toks, found.get(rid))
                conn.executemany("INSERT INTO tokens (request_id, idx, token_id, text_offset) "
                                 "VALUES (?, ?, ?, ?)", new)
            for rid, state, error, reason in ends:
                self._finish(conn, rid, state, error, reason, stamp)
        return len(new)

    def _check_tokens(self, conn: Any, rid: str, toks: list[Token],
                      found: tuple[str, int | None] | None) -> list[Token]:
        if found is None:
            raise JournalConflictError(f"append_tokens: request {rid} is not journaled. "
                                       "Hint: add_request() before its tokens.")
        state, top = found
        if state in FINISHED_STATES:
            raise JournalConflictError(f"append_tokens: request {rid} is already {state}; its "
                                       "tokens are final. Hint: stop decoding it.")
        nxt = -1 if top is None else top
        fresh = []
        for t in toks:
            if t.index <= nxt:
                old = conn.execute("SELECT token_id FROM tokens WHERE request_id = ? AND "
                                   "idx = ?", (rid, t.index)).fetchone()
                if old is None or old[0] != t.token_id:
                    raise JournalConflictError(
                        f"append_tokens: request {rid} token {t.index} is journaled as "
                        f"{None if old is None else old[0]}, the step sends {t.token_id}; "
                        "journaled tokens never change. Hint: a replay must regenerate the "
                        "same tokens (same seed); check the runner's determinism."
                    )
                continue
            if t.index != nxt + 1:
                raise JournalConflictError(
                    f"append_tokens: request {rid} token {t.index} leaves a gap (next index is "
                    f"{nxt + 1}). Hint: journal every generated token, in order."
                )
            fresh.append(t)
            nxt = t.index
        return fresh

    def tokens(self, request_id: str, start: int = 0) -> list[Token]:
        return [Token(*r) for r in self.conn.execute(
            "SELECT request_id, idx, token_id, text_offset FROM tokens WHERE request_id = ? "
            "AND idx >= ? ORDER BY idx", (request_id, int(start)))]

    def token_count(self, request_id: str) -> int:
        row = self.conn.execute("SELECT max(idx) FROM tokens WHERE request_id = ?",
                                (request_id,)).fetchone()
        return 0 if row[0] is None else int(row[0]) + 1

    def text_offset(self, request_id: str) -> int:
        """The detokenizer byte offset after the last journaled token (0 when none)."""
        row = self.conn.execute("SELECT text_offset FROM tokens WHERE request_id = ? ORDER BY "
                                "idx DESC LIMIT 1", (request_id,)).fetchone()
        return 0 if row is None else int(row[0])

    # -- sessions -------------------------------------------------------------------------

    def save_session(self, session_id: str, model: str, history: Sequence[int], *,
                     turn: str | None = None, now: float | None = None,
                     tools: str | None = None, calls: Mapping[str, str] | None = None) -> None:
        """Replace the session's token history (the whole conversation so far), its tools
        (JSON, None: none) and the names of the calls its turns made; `turn`, the done request
        this history ends with, is no longer pending (same transaction)."""
        now = self._clock() if now is None else now
        named = json.dumps(dict(calls), ensure_ascii=False) if calls else None
        with self.journal.transaction() as conn:
            if turn is not None:
                conn.execute("UPDATE requests SET session_pending = 0 WHERE id = ?", (turn,))
            conn.execute(
                "INSERT INTO sessions (id, model, history, n_tokens, turns, created_at, "
                "updated_at, tools, calls) VALUES (?, ?, ?, ?, 1, ?, ?, ?, ?) ON CONFLICT(id) "
                "DO UPDATE SET model = excluded.model, history = excluded.history, n_tokens = "
                "excluded.n_tokens, turns = turns + 1, updated_at = excluded.updated_at, "
                "tools = excluded.tools, calls = excluded.calls",
                (session_id, model, pack_ids(list(history)), len(history), now, now, tools,
                 named))

    def get_session(self, session_id: str) -> Session | None:
        row = self.conn.execute("SELECT id, model, history, turns, created_at, updated_at, "
                                "tools, calls FROM sessions WHERE id = ?",
                                (session_id,)).fetchone()
        if row is None:
            return None
        return Session(row[0], row[1], unpack_ids(row[2]), row[3], row[4], row[5], row[6],
                       json.loads(row[7]) if row[7] else {})

    def delete_session(self, session_id: str) -> bool:
        with self.journal.transaction() as conn:
            conn.execute("UPDATE requests SET session_pending = 0 WHERE session = ? AND "
                         "session_pending = 1", (session_id,))
            conn.execute("DELETE FROM kv_snapshots WHERE session = ?", (session_id,))
            return conn.execute("DELETE FROM sessions WHERE id = ?", (session_id,)).rowcount > 0

    def save_kv_snapshot(self, session_id: str, model: str, tokens: Sequence[int],
                         identity: str, data: bytes, *, max_bytes: int,
                         now: float | None = None) -> int:
        """Replace the session's KV snapshot, then drop the oldest ones until all of them
        hold at most `max_bytes` (this one too, when it alone is larger); how many dropped."""
        now = self._clock() if now is None else now
        with self.journal.transaction() as conn:
            conn.execute(
                "INSERT OR REPLACE INTO kv_snapshots (session, model, tokens, n_tokens, "
                "identity, data, bytes, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (session_id, model, pack_ids(list(tokens)), len(tokens), identity, data,
                 len(data), now))
            total, dropped = 0, []
            for sid, size in conn.execute("SELECT session, bytes FROM kv_snapshots ORDER BY "
                                          "created_at DESC, rowid DESC").fetchall():
                total += int(size)
                if total > max_bytes:
                    dropped.append(sid)
            conn.executemany("DELETE FROM kv_snapshots WHERE session = ?",
                             [(sid,) for sid in dropped])
            return len(dropped)

    def kv_snapshots(self, model: str, limit: int) -> list[tuple[str, list[int], bytes]]:
        """(session, tokens, blob) of `model`'s newest `limit` KV snapshots, newest first."""
        return [(r[0], unpack_ids(r[1]), bytes(r[2])) for r in self.conn.execute(
            "SELECT session, tokens, data FROM kv_snapshots WHERE model = ? ORDER BY "
            "created_at DESC, rowid DESC LIMIT ?", (model, int(limit)))]

    def pending_turns(self) -> list[str]:
        """Ids of done session turns not yet saved in their session's history, oldest first
        (a partial index holds only these rows: cost O(pending), not O(journal))."""
        return [r[0] for r in self.conn.execute(
            "SELECT id FROM requests WHERE session_pending = 1 ORDER BY finished_at, rowid")]

    # -- tokenizer cache ------------------------------------------------------------------

    def put_tokenizer(self, model_sha256: str, fingerprint: str, data: bytes, *,
                      now: float | None = None) -> None:
        now = self._clock() if now is None else now
        with self.journal.transaction() as conn:
            conn.execute("INSERT OR REPLACE INTO tokenizer_cache (model_sha256, fingerprint, "
                         "data, created_at) VALUES (?, ?, ?, ?)",
                         (model_sha256, fingerprint, bytes(data), now))

    def get_tokenizer(self, model_sha256: str, fingerprint: str | None = None
                      ) -> tuple[str, bytes] | None:
        """(fingerprint, data) of the newest cached tokenizer of that model, or None."""
        sql = "SELECT fingerprint, data FROM tokenizer_cache WHERE model_sha256 = ?"
        args: list[Any] = [model_sha256]
        if fingerprint is not None:
            sql += " AND fingerprint = ?"
            args.append(fingerprint)
        row = self.conn.execute(sql + " ORDER BY created_at DESC LIMIT 1", args).fetchone()
        return None if row is None else (row[0], bytes(row[1]))

    def drop_tokenizer(self, model_sha256: str, fingerprint: str | None = None) -> int:
        with self.journal.transaction() as conn:
            if fingerprint is None:
                return conn.execute("DELETE FROM tokenizer_cache WHERE model_sha256 = ?",
                                    (model_sha256,)).rowcount
            return conn.execute("DELETE FROM tokenizer_cache WHERE model_sha256 = ? AND "
                                "fingerprint = ?", (model_sha256, fingerprint)).rowcount

    # -- model registry -------------------------------------------------------------------

    def record_model(self, name: str, **facts: Any) -> None:
        """Upsert registry facts: path, sha256, size, mtime_ns, prepared_path, last_load_at,
        last_load_s, last_failure, last_failure_at (unknown keys are an error)."""
        allowed = {"path", "sha256", "size", "mtime_ns", "prepared_path", "last_load_at",
                   "last_load_s", "last_failure", "last_failure_at"}
        bad = sorted(set(facts) - allowed)
        if bad:
            raise JournalError(f"model {name}: unknown registry fact(s) {', '.join(bad)}. "
                               f"Hint: use {', '.join(sorted(allowed))}.")
        row = {"name": name, **facts, "updated_at": self._clock()}
        cols = ", ".join(row)
        sets = ", ".join(f"{k} = excluded.{k}" for k in row if k != "name")
        with self.journal.transaction() as conn:
            conn.execute(f"INSERT INTO models ({cols}) VALUES ({', '.join('?' * len(row))}) "
                         f"ON CONFLICT(name) DO UPDATE SET {sets}", list(row.values()))

    def get_model(self, name: str) -> dict[str, Any] | None:
        rows = list(self.journal.db.query("SELECT * FROM models WHERE name = ?", [name]))
        return rows[0] if rows else None

    def models(self) -> list[dict[str, Any]]:
        return list(self.journal.db.query("SELECT * FROM models ORDER BY name"))

    # -- events ---------------------------------------------------------------------------

    def record_event(self, kind: str, message: str, *, now: float | None = None) -> None:
        with self.journal.transaction() as conn:
            conn.execute("INSERT INTO events (at, kind, message) VALUES (?, ?, ?)",
                         (self._clock() if now is None else now, kind, message))

    def events(self, limit: int = 20) -> list[dict[str, Any]]:
        return list(self.journal.db.query(
            "SELECT id, at, kind, message FROM events ORDER BY id DESC LIMIT ?", [limit]))

    def stats(self) -> dict[str, Any]:
        q = self.conn.execute
        states = {s: 0 for s in REQUEST_STATES}
        states.update(dict(q("SELECT state, count(*) FROM requests GROUP BY state").fetchall()))
        wal = str(self.journal.path) + "-wal"
        return {
            "path": str(self.journal.path),
            "schema_version": int(self.journal.pragma("user_version")),
            "journal_mode": self.journal.pragma("journal_mode"),
            "synchronous": self.journal.synchronous,
            "requests": states,
            "tokens": q("SELECT count(*) FROM tokens").fetchone()[0],
            "sessions": q("SELECT count(*) FROM sessions").fetchone()[0],
            "tokenizer_cache": q("SELECT count(*) FROM tokenizer_cache").fetchone()[0],
            "models": q("SELECT count(*) FROM models").fetchone()[0],
            "flash_jobs": q("SELECT count(*) FROM flash_jobs").fetchone()[0],
            "file_bytes": os.path.getsize(self.journal.path),
            "wal_bytes": os.path.getsize(wal) if os.path.exists(wal) else 0,
            "page_size": self.journal.pragma("page_size"),
            "page_count": self.journal.pragma("page_count"),
            "freelist_count": self.journal.pragma("freelist_count"),
            "events": self.events(5),
        }

    def export(self, states: Iterable[str] | None = None) -> Iterator[dict[str, Any]]:
        """Each request (oldest first) as a dict with its token ids and final text offset."""
        for req in self.requests(states):
            toks = self.tokens(req.id)
            yield dict(req.to_dict(), tokens=[t.token_id for t in toks],
                       text_offset=toks[-1].text_offset if toks else 0)
