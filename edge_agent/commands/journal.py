"""`edge-agent journal stats|tail|export|vacuum`: look at and maintain the daemon's journal.

stats, tail and export open the file read-only (`PRAGMA query_only`); they never create,
migrate or move it, so they are safe while the daemon runs. vacuum writes: it takes the write
lock for its duration (the daemon waits), and refuses a corrupt file instead of moving it aside
(only the daemon's start does that). Data goes to stdout, diagnostics to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from edge_agent.errors import UsageError

__all__ = ["register", "run"]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "journal",
        help="show, export or compact the daemon's journal (SQLite state)",
        description="Inspect the journal: requests, generated tokens, sessions and caches the "
        "daemon keeps across crashes and power cuts.",
    )
    parser.add_argument("--journal", metavar="FILE",
                        help="journal file (default: the daemon's: journal.path from the "
                        "configuration, else STATE_DIR/journal.sqlite3)")
    parser.add_argument("--config", metavar="FILE",
                        help="the daemon's configuration file, for journal.path and "
                        "server.state_dir (default: /etc/edge-agent/config.toml)")
    actions = parser.add_subparsers(dest="journal_action", metavar="ACTION", required=True)
    stats = actions.add_parser("stats", help="counts, file size, durability settings, events")
    stats.add_argument("--json", action="store_true", help="print one JSON object")
    tail = actions.add_parser("tail", help="the most recent requests, newest first")
    tail.add_argument("-n", "--lines", type=int, default=10, metavar="N",
                      help="how many requests (default 10)")
    tail.add_argument("--json", action="store_true", help="print a JSON list")
    export = actions.add_parser("export", help="every request with its token ids, JSON lines")
    export.add_argument("--state", action="append", metavar="STATE",
                        help="only requests in STATE (repeatable): queued, running, done, "
                        "failed, cancelled, expired")
    vacuum = actions.add_parser("vacuum", help="prune finished requests and compact the file")
    vacuum.add_argument("--max-age", type=float, metavar="SECONDS",
                        help="also delete finished requests older than this")
    vacuum.add_argument("--keep", type=int, metavar="N",
                        help="also keep only the newest N finished requests")
    vacuum.add_argument("--session-max-age", type=float, metavar="SECONDS",
                        help="also forget sessions unused for this long")
    vacuum.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run)


def _path(args: argparse.Namespace) -> Path:
    """--journal, else the daemon's journal: journal.path, else STATE_DIR/journal.sqlite3,
    with the state directory as the daemon finds it (server.state_dir included)."""
    from edge_agent.commands.client import configured

    if args.journal:
        return Path(args.journal)
    config = configured(args)
    path: Path = config.journal.resolve_path(Path(config.server.state_dir))
    return path


def _when(ts: float | None) -> str:
    return "-" if ts is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def _stats(store: Any, as_json: bool) -> int:
    stats = store.stats()
    if as_json:
        print(json.dumps(stats, indent=1))
        return 0
    states = ", ".join(f"{k} {v}" for k, v in stats["requests"].items())
    print(f"journal        {stats['path']}")
    print(f"schema         version {stats['schema_version']}, {stats['journal_mode']}, "
          f"synchronous={stats['synchronous']}")
    print(f"size           {stats['file_bytes']} bytes + WAL {stats['wal_bytes']} bytes "
          f"({stats['freelist_count']} free pages of {stats['page_count']})")
    print(f"requests       {states}")
    print(f"tokens         {stats['tokens']}")
    print(f"sessions       {stats['sessions']}")
    print(f"caches         {stats['tokenizer_cache']} tokenizer(s), {stats['models']} model(s), "
          f"{stats['flash_jobs']} flash job(s)")
    for ev in stats["events"]:
        print(f"event          {_when(ev['at'])} {ev['kind']}: {ev['message']}")
    return 0


def _tail(store: Any, n: int, as_json: bool) -> int:
    if n < 1:
        raise UsageError(f"journal tail: -n {n} must be at least 1. Hint: e.g. -n 20.")
    rows = []
    for req in store.requests(limit=n, newest_first=True):
        rows.append({"id": req.id, "state": req.state, "model": req.model,
                     "session": req.session, "created_at": req.created_at,
                     "finished_at": req.finished_at, "prompt_tokens": len(req.prompt_ids),
                     "tokens": store.token_count(req.id), "finish_reason": req.finish_reason,
                     "error": req.error})
    if as_json:
        print(json.dumps(rows, indent=1))
        return 0
    for r in rows:
        line = (f"{_when(r['created_at'])}  {r['id']}  {r['state']:<9} {r['model']}  "
                f"prompt {r['prompt_tokens']}  generated {r['tokens']}")
        if r["finish_reason"]:
            line += f"  ({r['finish_reason']})"
        if r["error"]:
            line += f"  error: {r['error']}"
        print(line)
    if not rows:
        print("edge-agent: the journal holds no requests", file=sys.stderr)
    return 0


def _export(store: Any, states: list[str] | None) -> int:
    from edge_agent.journal import REQUEST_STATES

    bad = [s for s in states or () if s not in REQUEST_STATES]
    if bad:
        raise UsageError(f"journal export: unknown state {bad[0]!r}. Hint: use one of "
                         f"{', '.join(REQUEST_STATES)}.")
    n = 0
    for row in store.export(states):
        sys.stdout.write(json.dumps(row, ensure_ascii=False) + "\n")
        n += 1
    print(f"edge-agent: exported {n} request(s)", file=sys.stderr)
    return 0


def _vacuum(path: Path, args: argparse.Namespace) -> int:
    from edge_agent.journal import (
        JournalError,
        JournalMissingError,
        JournalStore,
        NotAJournalError,
        open_journal,
    )

    for name, value in (("--max-age", args.max_age), ("--keep", args.keep),
                        ("--session-max-age", args.session_max_age)):
        if value is not None and value < 0:
            raise UsageError(f"journal vacuum: {name} {value} must be >= 0. Hint: e.g. "
                             f"{name} 86400.")
    if not path.is_file():
        raise JournalMissingError(f"no journal at {path}. Hint: pass the right --state-dir "
                                  "or --journal FILE.")
    try:  # never write a journal into another program's file (a corrupt one: the open below)
        open_journal(path, readonly=True).close()
    except NotAJournalError:
        raise
    except JournalError:
        pass
    store = JournalStore(open_journal(path, on_corrupt="raise"))
    try:
        pruned = store.prune(max_age_s=args.max_age, max_finished=args.keep,
                             session_max_age_s=args.session_max_age)
        before, after = store.vacuum()
    finally:
        store.close()
    result = {"path": str(path), "pruned_requests": pruned.requests,
              "pruned_sessions": pruned.sessions, "bytes_before": before, "bytes_after": after}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{path}: pruned {pruned.requests} finished request(s) and {pruned.sessions} "
              f"session(s); {before} -> {after} bytes (file + WAL)")
    return 0


def run(args: argparse.Namespace) -> int:
    from edge_agent.journal import JournalStore, open_journal

    path = _path(args)
    action = args.journal_action
    if action == "vacuum":
        return _vacuum(path, args)
    store = JournalStore(open_journal(path, readonly=True))
    try:
        if action == "stats":
            return _stats(store, args.json)
        if action == "tail":
            return _tail(store, args.lines, args.json)
        return _export(store, args.state)
    finally:
        store.close()
