"""Journal benchmark (run on demand: `.venv/bin/python bench/journal.py`).

Store-level figures, from one run, on real files in a temporary directory (pass --dir to put
them on the storage you care about, e.g. the board's SD card or eMMC):
- decode steps/s when every step of a batch is journaled (one transaction per step) with
  synchronous FULL, NORMAL and OFF, against the same loop with no journal at all;
- accepting a burst of --burst requests (synchronous FULL): one transaction per request (the
  UART console's path) against one for the whole burst (the HTTP routes' group commit), in
  --bursts interleaved rounds, as median, p95 and worst milliseconds per burst;
- each step of the daemon's start path (open, quick_check, recovery, pending session turns)
  on a journal holding 10 000 sessions and 1 000 finished requests vs an empty one, and the
  retention pass that runs after READY.
Daemon-level figures (a real `edge-agent serve` on the default model, same run). Each is
measured in interleaved rounds (A, B, then B, A, ...) and reported as the median of the
per-round ratios with their spread, against the baseline of the same run:
- aggregate tok/s of the same concurrent load with the journal on (FULL, durable ack) vs off
  (target: overhead <= 5 %);
- time to READY after a SIGKILL with 10 000 sessions and 1 000 finished requests in the journal
  vs an empty journal (target: <= 1.1x), with the daemon's own start-step times (/health);
- first request (tokenize + load + prefill, model not preloaded) and tokenizer time after a
  cold start (new journal: tokenizer built from GGUF metadata) vs a warm start (from the
  journal's cache);
- the SIGKILL crash loop of tests/test_journal_crash.py for --crash iterations (default 200):
  every accepted request completes, journaled tokens never change, integrity ok, temperature-0
  match rate vs uninterrupted runs.
`--ready-only` runs the start figures alone (store start steps and time to READY).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # journal_harness

from edge_agent.journal import JournalStore, open_journal, recover  # noqa: E402
from edge_agent.paths import default_model_path  # noqa: E402

__all__ = ["main"]

Run = Callable[..., Path]


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


def _steps_figure(base: Path, args: argparse.Namespace) -> None:
    none = _steps_per_s(None, "OFF", args.batch, args.steps)
    print(f"decode steps/s, batch {args.batch}, {args.steps} steps (one transaction per step):")
    print(f"  no journal        {none:12.0f}")
    for sync in ("FULL", "NORMAL", "OFF"):
        rate = _steps_per_s(base / f"steps-{sync}.sqlite3", sync, args.batch, args.steps)
        print(f"  synchronous={sync:<6} {rate:10.0f}   {1000 / rate:6.2f} ms/step")


def _burst_figure(base: Path, args: argparse.Namespace) -> None:
    store = JournalStore(open_journal(base / "burst.sqlite3", synchronous="FULL"))
    each: list[float] = []
    group: list[float] = []
    for n in range(args.bursts):
        rows = [dict(id=f"b{n}-{k}", model="m", input={"prompt": "x"}, prompt_ids=[1] * 32,
                     params={"seed": k}) for k in range(args.burst)]
        order = ("each", "group") if n % 2 == 0 else ("group", "each")
        for way in order:
            t0 = time.perf_counter()
            if way == "each":
                for row in rows:
                    store.add_request(**{**row, "id": f"{row['id']}-e"})
                each.append(time.perf_counter() - t0)
            else:
                store.add_requests(rows)
                group.append(time.perf_counter() - t0)
    store.close()

    def ms(xs: list[float]) -> str:
        xs = sorted(xs)
        return (f"{statistics.median(xs) * 1000:6.2f} / {xs[int(0.95 * (len(xs) - 1))] * 1000:6.2f}"
                f" / {xs[-1] * 1000:6.2f}")

    print(f"accepting a burst of {args.burst} requests, {args.bursts} rounds, synchronous=FULL "
          "(median / p95 / worst ms):")
    print(f"  one transaction per request  {ms(each)}")
    print(f"  one transaction per burst    {ms(group)}")


def _populate(path: Path, sessions: int, finished: int, model: str = "m") -> None:
    """`sessions` sessions (512-token histories) and `finished` done requests, each a turn of
    one of those sessions saved the way the daemon saves it."""
    store = JournalStore(open_journal(path))
    now = time.time()  # recent, so retention does not prune them at the next open
    with store.journal.transaction() as conn:  # bulk fill: one transaction
        conn.executemany(
            "INSERT INTO sessions (id, model, history, n_tokens, turns, created_at, updated_at) "
            "VALUES (?, ?, ?, 512, 4, ?, ?)",
            [(f"s{i}", model, bytes(2048), now, now) for i in range(sessions)])
    for i in range(finished):
        rid, sid = f"f{i}", f"s{i % max(1, sessions)}"
        store.add_request(id=rid, model=model, input={"prompt": "x" * 100}, prompt_ids=[1] * 64,
                          params={"seed": i}, session=sid if sessions else None)
        store.append_tokens([(rid, k, k, k) for k in range(64)],
                            finish=[(rid, "done", None, "length")])
        if sessions:
            store.save_session(sid, model, [1] * 512, turn=rid)
    store.close()


def _start_steps(path: Path, repeats: int) -> dict[str, float]:
    """Median seconds of each step the daemon's start path does on this file, and of the
    retention pass that runs after READY."""
    rows: dict[str, list[float]] = {}
    for _ in range(repeats):
        t0 = time.perf_counter()
        store = JournalStore(open_journal(path))
        j = store.journal
        t1 = time.perf_counter()
        recover(store)
        t2 = time.perf_counter()
        store.pending_turns()
        t3 = time.perf_counter()
        step = {"open (pragmas, migrations)": j.open_seconds - j.check_seconds,
                "quick_check": j.check_seconds, "recover": t2 - t1,
                "pending session turns": t3 - t2, "total before READY": t3 - t0}
        t4 = time.perf_counter()
        while store.prune(max_age_s=604800.0, max_finished=10_000, limit=200).total:
            pass
        step["retention (after READY)"] = time.perf_counter() - t4
        store.close()
        for k, v in step.items():
            rows.setdefault(k, []).append(v)
    return {k: statistics.median(v) for k, v in rows.items()}


def _spread(ratios: list[float]) -> str:
    return (f"median {statistics.median(ratios):.3f}x, per-round {min(ratios):.3f}"
            f"..{max(ratios):.3f}x over {len(ratios)} interleaved rounds")


def _daemon_figures(base: Path, state: Path, args: argparse.Namespace) -> None:
    """Time to READY full vs empty; unless --ready-only also tok/s on vs off and warm vs cold
    first request."""
    from journal_harness import write_config

    def run(name: str, **cfg: object) -> Path:
        root = base / name
        root.mkdir(exist_ok=True)
        write_config(root, state, {"smollm2": (None, bool(cfg.pop("preload", True)))},
                     context=256, max_batch=args.batch, **cfg)  # type: ignore[arg-type]  # write_config's keywords, checked there
        return root

    _ready_figure(run, args)
    if args.ready_only:
        return
    _overhead_figure(run, args)
    _first_request_figure(run, args)


def _ready_figure(run: Run, args: argparse.Namespace) -> None:
    from journal_harness import kill, start

    def ready_s(root: Path) -> tuple[float, dict[str, float]]:
        t0 = time.perf_counter()
        d = start(root)
        took = time.perf_counter() - t0
        try:
            steps = dict(d.health()["journal"].get("start_s") or {})
        finally:
            kill(d)
        return took, steps

    empty, full = run("ready-empty"), run("ready-full")
    for root in (empty, full):
        kill(start(root))  # creates the journal, records the model, caches the tokenizer
    _populate(full / "journal.sqlite3", args.sessions, args.finished, model="smollm2")
    kill(start(full))  # the first start after the fill is not timed
    mb = os.path.getsize(full / "journal.sqlite3") / 1e6
    times: dict[Path, list[float]] = {empty: [], full: []}
    steps: dict[Path, list[dict[str, float]]] = {empty: [], full: []}
    ratios = []
    for i in range(args.ready_rounds):
        for root in ((empty, full) if i % 2 == 0 else (full, empty)):
            took, st = ready_s(root)
            times[root].append(took)
            steps[root].append(st)
        ratios.append(times[full][-1] / times[empty][-1])
    e, f = statistics.median(times[empty]), statistics.median(times[full])
    print("time to READY after SIGKILL (spawn -> READY=1, model preloaded):")
    print(f"  empty journal                              {e:6.3f} s (median)")
    print(f"  {args.sessions} sessions, {args.finished} finished requests  {f:6.3f} s (median; "
          f"{mb:.0f} MB file)")
    print(f"  ratio full/empty: {_spread(ratios)} (target <= 1.1x)")
    diffs = [(f_ - e_) * 1000 for f_, e_ in zip(times[full], times[empty], strict=True)]
    print(f"  full - empty, paired by round: median {statistics.median(diffs):+.0f} ms "
          f"(per-round {min(diffs):+.0f} .. {max(diffs):+.0f} ms: the machine's noise)")
    for root, name in ((empty, "empty"), (full, "full")):
        keys = [k for k in ("open", "check", "warm", "checked_while", "recover", "reconcile",
                            "total")
                if any(k in st for st in steps[root])]
        parts = ", ".join(
            f"{k} {statistics.median(st.get(k, 0.0) for st in steps[root]) * 1000:.1f}"
            for k in keys)
        print(f"  the daemon's journal start steps, {name} journal (median ms): {parts}")
    print("  (check runs in a thread beside warm, the preload model's tokenizer; checked_while "
          "is the two side by side)")


def _overhead_figure(run: Run, args: argparse.Namespace) -> None:
    from journal_harness import kill, start, wait_done

    def load_round(root: Path) -> tuple[float, float, float]:
        """(aggregate tok/s, journal write seconds, runner step seconds) of one round."""
        d = start(root)
        try:
            t0 = time.perf_counter()
            ids = []
            for i in range(args.batch):
                status, body = d.json("POST", "/v1/requests", {
                    "model": "smollm2", "prompt": f"Story {i}: once upon a time",
                    "max_tokens": args.tokens, "temperature": 0.8, "seed": i})
                assert status == 202, body
                ids.append(body["id"])
            res = wait_done(d, ids, 600)
            wall = time.perf_counter() - t0
            assert all(r["state"] == "done" for r in res.values()), res
            metrics = d.call("GET", "/metrics")[2].decode().splitlines()
            step_s = next(float(line.split()[-1]) for line in metrics
                          if line.startswith("edge_agent_step_seconds_sum"))
            write_s = float(d.health()["journal"].get("write_s", 0.0))
            return sum(r["completion_tokens"] for r in res.values()) / wall, write_s, step_s
        finally:
            kill(d)

    on, off = run("on"), run("off", journal=False)
    rates: dict[Path, list[float]] = {on: [], off: []}
    overheads = []
    write = step = 0.0
    for i in range(args.rounds):
        for root in ((off, on) if i % 2 == 0 else (on, off)):  # neither always runs first
            rate, w, st = load_round(root)
            rates[root].append(rate)
            if root is on:
                write, step = write + w, step + st
        overheads.append((1 - rates[on][-1] / rates[off][-1]) * 100)
    r_on, r_off = statistics.median(rates[on]), statistics.median(rates[off])
    print(f"daemon, {args.batch} concurrent requests x {args.tokens} tokens, {args.rounds} "
          "interleaved rounds (off, on / on, off ...):")
    print(f"  journal off                {r_off:8.1f} tok/s (median)")
    print(f"  journal FULL, durable ack  {r_on:8.1f} tok/s (median)")
    print(f"  overhead (1 - on/off per round): median {statistics.median(overheads):+.1f} %, "
          f"per-round {min(overheads):+.1f} .. {max(overheads):+.1f} % (target <= 5 %)")
    print(f"  journal transactions: {write:.3f} s in the decode loop vs {step:.1f} s of runner "
          f"steps = {write / (write + step) * 100:.2f} % of decode time (the loop waits for "
          "each commit, so this is the journal's own cost)")


def _first_request_figure(run: Run, args: argparse.Namespace) -> None:
    from journal_harness import kill, start

    def first_request(root: Path) -> tuple[float, float, str]:
        d = start(root)
        try:
            t0 = time.perf_counter()
            status, body = d.json("POST", "/v1/completions", {
                "model": "smollm2", "prompt": "The capital of France is", "max_tokens": 1})
            took = time.perf_counter() - t0
            assert status == 200, body
            m = d.health()["models"]["smollm2"]
            return took, float(m["tokenizer_s"]), str(m["tokenizer_from"])
        finally:
            kill(d)

    cold, warm = [], []
    for i in range(args.rounds):
        root = run(f"first-{i}", preload=False)
        cold.append(first_request(root))  # new journal: tokenizer from GGUF metadata
        warm.append(first_request(root))  # after a kill: tokenizer from the journal
    assert all(c[2] == "gguf" for c in cold) and all(w[2] == "journal" for w in warm)
    print(f"first request after start (model not preloaded: tokenize + runner load + prefill "
          f"+ 1 token), median of {args.rounds}:")
    for name, rows in (("cold (new journal)", cold), ("warm (journal cache)", warm)):
        print(f"  {name:<22} {statistics.median(r[0] for r in rows):6.3f} s   tokenizer "
              f"{statistics.median(r[1] for r in rows) * 1000:6.1f} ms ({rows[0][2]})")


def _crash(base: Path, state: Path, iterations: int) -> None:
    from journal_harness import crash_run, crash_world

    root = base / "crash"
    root.mkdir()
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time",
               "The three primary colours are"]
    refs = crash_world(root, state, prompts, 10, 128)
    r = crash_run(root, refs, iterations=iterations, budget_s=1e9, max_tokens=10, seed=29)
    print(f"crash loop: {r['iterations']} SIGKILL iterations ({r['before_ready']} before "
          f"READY) in {r['loop_s']:.0f} s, {r['requests']} requests ({r['big_requests']} on "
          f"the default model): all present, all completed, tokens never changed, "
          f"integrity ok; temperature-0 match rate {r['match_rate']:.1%}")
    for m in r["mismatches"][:5]:
        print(f"  mismatch: {m}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", help="where to put the journal files (default: a temp dir)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--burst", type=int, default=16, help="requests in a burst")
    parser.add_argument("--bursts", type=int, default=80, help="rounds of the burst figure")
    parser.add_argument("--sessions", type=int, default=10_000)
    parser.add_argument("--finished", type=int, default=1_000)
    parser.add_argument("--tokens", type=int, default=48, help="tokens per daemon request")
    parser.add_argument("--rounds", type=int, default=7,
                        help="interleaved rounds of the tok/s and first-request figures")
    parser.add_argument("--ready-rounds", type=int, default=15,
                        help="interleaved rounds (empty, full / full, empty) of time to READY")
    parser.add_argument("--crash", type=int, default=200, help="crash-loop iterations (0: skip)")
    parser.add_argument("--store-only", action="store_true", help="skip the daemon figures")
    parser.add_argument("--ready-only", action="store_true",
                        help="only the start figures: journal start steps and time to READY")
    args = parser.parse_args(argv)
    for name in ("rounds", "ready_rounds", "burst", "bursts"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="journal-bench-") as tmp:
        base = Path(tmp)
        print(f"journal files in {base} ({os.statvfs(base).f_bsize}-byte blocks)",
              file=sys.stderr)
        if not args.ready_only:
            _steps_figure(base, args)
            _burst_figure(base, args)
        empty, full = base / "empty.sqlite3", base / "full.sqlite3"
        open_journal(empty).close()
        t0 = time.perf_counter()
        _populate(full, args.sessions, args.finished)
        fill = time.perf_counter() - t0
        e, f = _start_steps(empty, 5), _start_steps(full, 5)
        print(f"daemon start path on the journal alone, median of 5 opens (filled in "
              f"{fill:.1f} s; {os.path.getsize(full) / 1e6:.1f} MB, {args.sessions} sessions, "
              f"{args.finished} finished):")
        print(f"  {'step':<30} {'empty':>9} {'full':>9}")
        for k in e:
            print(f"  {k:<30} {e[k] * 1000:7.2f}ms {f[k] * 1000:7.2f}ms")
        if args.store_only:
            return 0
        from edge_agent.runtime.prepare import prepare_model

        state = base / "state"
        prepare_model(default_model_path(), state, dtype="f32")
        _daemon_figures(base, state, args)
        if args.crash and not args.ready_only:
            _crash(base, state, args.crash)
    return 0


if __name__ == "__main__":
    sys.exit(main())
