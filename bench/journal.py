"""Journal benchmark (run on demand: `.venv/bin/python bench/journal.py`).

Store-level figures, from one run, on real files in a temporary directory (pass --dir to put
them on the storage you care about, e.g. the board's SD card or eMMC):
- decode steps/s when every step of a batch is journaled (one transaction per step) with
  synchronous FULL, NORMAL and OFF, against the same loop with no journal at all; the ratio to
  a model's step time is the journal's share of decode time (a numpy decode step of the default
  model at batch 8 takes ~30-50 ms here, so a few hundred steps/s is < 1 % overhead);
- open time (integrity check + migrations + recovery scan) of a journal holding 10 000 sessions
  and 1 000 finished requests vs an empty one (target: <= 1.1x).
Daemon-level figures (tok/s with the journal on vs off under load, time to READY, warm-start
first-request latency) belong to the daemon integration and are not measured here yet.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from edge_agent.journal import JournalStore, open_journal, recover

__all__ = ["main"]


def _steps_per_s(path: Path | None, sync: str, batch: int, steps: int) -> float:
    """Decode-step journaling rate; path None: the same loop with no journal (baseline)."""
    ids = [f"r{k}" for k in range(batch)]
    if path is None:
        t0 = time.perf_counter()
        sink: list[tuple[str, int, int, int]] = []
        for n in range(steps):
            sink.extend((rid, n, n, n) for rid in ids)
        return steps / (time.perf_counter() - t0)
    store = JournalStore(open_journal(path, synchronous=sync))
    for rid in ids:
        store.add_request(id=rid, model="m", input={"prompt": "x"}, prompt_ids=[1] * 64,
                          params={"seed": 1})
    t0 = time.perf_counter()
    for n in range(steps):
        store.append_tokens([(rid, n, 1000 + n, 4 * n) for rid in ids])
    rate = steps / (time.perf_counter() - t0)
    store.close()
    return rate


def _populate(path: Path, sessions: int, finished: int) -> None:
    store = JournalStore(open_journal(path))
    with store.journal.transaction() as conn:  # bulk fill: one transaction
        conn.executemany(
            "INSERT INTO sessions (id, model, history, n_tokens, turns, created_at, updated_at) "
            "VALUES (?, 'm', ?, 512, 4, 0, 0)",
            [(f"s{i}", bytes(2048)) for i in range(sessions)])
    for i in range(finished):
        rid = f"f{i}"
        store.add_request(id=rid, model="m", input={"prompt": "x" * 100}, prompt_ids=[1] * 64,
                          params={"seed": i})
        store.append_tokens([(rid, k, k, k) for k in range(64)],
                            finish=[(rid, "done", None, "length")])
    store.close()


def _open_s(path: Path, repeats: int, check: str = "quick") -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        store = JournalStore(open_journal(path, check=check))
        recover(store)
        times.append(time.perf_counter() - t0)
        store.close()
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", help="where to put the journal files (default: a temp dir)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--sessions", type=int, default=10_000)
    parser.add_argument("--finished", type=int, default=1_000)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="journal-bench-") as tmp:
        base = Path(tmp)
        print(f"journal files in {base} ({os.statvfs(base).f_bsize}-byte blocks)",
              file=sys.stderr)
        none = _steps_per_s(None, "OFF", args.batch, args.steps)
        print(f"decode steps/s, batch {args.batch}, {args.steps} steps "
              "(one transaction per step):")
        print(f"  no journal        {none:12.0f}")
        for sync in ("FULL", "NORMAL", "OFF"):
            rate = _steps_per_s(base / f"steps-{sync}.sqlite3", sync, args.batch, args.steps)
            print(f"  synchronous={sync:<6} {rate:10.0f}   {1000 / rate:6.2f} ms/step")
        empty, full = base / "empty.sqlite3", base / "full.sqlite3"
        open_journal(empty).close()
        t0 = time.perf_counter()
        _populate(full, args.sessions, args.finished)
        fill = time.perf_counter() - t0
        e, f = _open_s(empty, 5), _open_s(full, 5)
        print(f"open + integrity check + recovery (median of 5), after filling in {fill:.1f} s:")
        print(f"  empty                      {e * 1000:8.1f} ms")
        print(f"  {args.sessions} sessions, {args.finished} finished  {f * 1000:8.1f} ms "
              f"({os.path.getsize(full) / 1e6:.1f} MB)")
        unchecked = _open_s(full, 5, check="none")
        print(f"  of which quick_check       {(f - unchecked) * 1000:8.1f} ms (reads every page)")
        print(f"  ratio {f / e:.2f}x on the journal alone; the <= 1.1x target is on the daemon's "
              "time to READY, where model loading dominates")
    return 0


if __name__ == "__main__":
    sys.exit(main())
