"""Helpers for the journal tests and bench/journal.py: a real `edge-agent serve` subprocess over
one journal, with a tiny model (fast restarts) and/or the default model, killed and restarted.

Invariants: every daemon started here runs in its own session (process group), so `kill()`
takes the daemon and its runner down at once like a power cut; the prepared weights of the
default model are hard-linked (not copied, not re-prepared) into the run's own state dir, so
the session fixture's state dir is never written to.
"""

from __future__ import annotations

import json
import os
import sqlite3
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # when imported from bench/

from daemon_proc import REPO, Daemon, serve_argv, spawn, stop  # noqa: E402

__all__ = ["Daemon", "ENGINE", "ENGINES", "REPO", "write_config", "start", "kill", "journal_tokens",
           "link_prepared", "tiny_gguf", "wait_done", "references", "sessions_history",
           "check_journal", "crash_run", "crash_world", "fill_journal"]


# The engine a journal helper uses unless told otherwise: the default one (runtime.engine =
# "auto" picks it when llama-cpp-python is installed). The suites pass `engine=` to run on both.
ENGINE = "llamacpp"
ENGINES = ("llamacpp", "numpy")


def fill_journal(path: Path, n: int = 200, *, synchronous: str | None = None) -> None:
    """A journal with `n` open requests of 20 tokens each (enough rows to span many pages),
    checkpointed into the main file."""
    from edge_agent.journal import JournalStore, open_journal

    store = JournalStore(open_journal(path) if synchronous is None
                         else open_journal(path, synchronous=synchronous))
    for i in range(n):
        store.add_request(id=f"r{i}", model="m", input={"prompt": "x" * 200},
                          prompt_ids=list(range(50)), params={"seed": i})
        store.append_tokens([(f"r{i}", k, k, k) for k in range(20)])
    store.checkpoint()
    store.close()


def write_config(root: Path, state: Path, models: dict[str, tuple[Path | None, bool]], *,
                 journal: bool = True, ack: str = "durable", drain_s: float = 2.0,
                 max_batch: int = 4, context: int = 128, timeout_ms: int = 600_000,
                 engine: str = ENGINE) -> Path:
    """config.toml in root: models maps name -> (GGUF path or None for the default, preload)."""
    text = (f'[server]\nsocket = "{root / "ea.sock"}"\nstate_dir = "{state}"\n'
            f"drain_timeout_s = {drain_s}\n"
            f"[scheduler]\nqueue_max = 256\nmax_batch_size = {max_batch}\nbatch_window_ms = 0\n"
            f"default_timeout_ms = {timeout_ms}\n"
            f'[runtime]\nengine = "{engine}"\nmlock = "off"\nthreads = 1\n'
            f'[journal]\nenabled = {str(journal).lower()}\npath = "{root / "journal.sqlite3"}"\n'
            f'ack = "{ack}"\n')
    for name, (path, preload) in models.items():
        text += (f"[models.{name}]\ncontext = {context}\nmax_batch = {max_batch}\n"
                 f"preload = {str(preload).lower()}\nttl_s = \"never\"\n")
        if path is not None:
            text += f'path = "{path}"\n'
    cfg = root / "config.toml"
    cfg.write_text(text)
    return cfg


def start(root: Path, *, wait_ready: bool = True, timeout: float = 120.0) -> Daemon:
    """Spawn the daemon on root/config.toml (log appended to root/daemon.log)."""
    (root / "ea.sock").unlink(missing_ok=True)  # the killed daemon's
    d = spawn(Daemon, root, serve_argv(root / "config.toml"), append_log=True,
              start_new_session=True)
    if wait_ready:
        d.wait_notify("READY=1", timeout)
    return d


def kill(d: Daemon) -> None:
    """SIGKILL the daemon and its runner (its process group) and reap the daemon; a daemon
    that exited by itself may have left its runner (same group) reading EOF: killed too."""
    stop(d, group=True)


def journal_tokens(path: Path) -> dict[str, list[int]]:
    raw = sqlite3.connect(path)
    try:
        out: dict[str, list[int]] = {}
        for rid, tok in raw.execute("SELECT request_id, token_id FROM tokens ORDER BY "
                                    "request_id, idx"):
            out.setdefault(rid, []).append(tok)
        return out
    finally:
        raw.close()


def prompt_ids(path: Path, rid: str) -> list[int]:
    """The prompt ids the journal at `path` holds for request `rid`."""
    from edge_agent.journal.store import unpack_ids

    raw = sqlite3.connect(path)
    try:
        return unpack_ids(raw.execute("SELECT prompt_ids FROM requests WHERE id = ?",
                                      (rid,)).fetchone()[0])
    finally:
        raw.close()


def sessions_history(path: Path, sid: str) -> list[int] | None:
    from edge_agent.journal.store import unpack_ids

    raw = sqlite3.connect(path)
    try:
        row = raw.execute("SELECT history FROM sessions WHERE id = ?", (sid,)).fetchone()
        return None if row is None else unpack_ids(row[0])
    finally:
        raw.close()


def crash_world(root: Path, src_state: Path, prompts: list[str], max_tokens: int,
                context: int, *, engine: str = ENGINE
                ) -> dict[str, dict[str, tuple[list[int], str]]]:
    """Set up root for crash_run on `engine`: state dir (default model's prepared weights
    linked, the tiny model prepared), config, and the uninterrupted temperature-0 references
    of the same engine."""
    state = root / "state"
    link_prepared(src_state, state)
    tiny = tiny_gguf(root / "tiny.gguf")
    refs = {"tiny": references(tiny, state, prompts, max_tokens, context,  # prepares tiny
                               engine=engine),
            "smollm2": references(None, state, prompts, max_tokens, context, engine=engine)}
    write_config(root, state, {"tiny": (tiny, True), "smollm2": (None, False)},
                 context=context, drain_s=2, engine=engine)
    return refs


def link_prepared(src_state: Path, dst_state: Path) -> None:
    """Hard-link the prepared weight files of src_state into dst_state (no re-prepare)."""
    (dst_state / "models").mkdir(parents=True, exist_ok=True)
    for f in (src_state / "models").glob("*.weights"):
        dst = dst_state / "models" / f.name
        if not dst.exists():
            try:
                os.link(f, dst)
            except OSError:
                dst.symlink_to(f)


def tiny_gguf(path: Path) -> Path:
    """A ~13 MB llama GGUF with the default model's tokenizer and small random weights."""
    from qemu.tiny_model import write_tiny_llama

    if not path.exists():
        write_tiny_llama(path)
    return path


def references(model: Path | None, state: Path, prompts: list[str], max_tokens: int,
               context: int, *, engine: str = ENGINE) -> dict[str, tuple[list[int], str]]:
    """Uninterrupted in-process temperature-0 runs on `engine`: prompt -> (token ids, text)."""
    from edge_agent.paths import default_model_path
    from edge_agent.runtime.engines import load_engine
    from edge_agent.runtime.sampling import SamplingParams

    out: dict[str, tuple[list[int], str]] = {}
    loaded = load_engine(engine, model or default_model_path(), state_dir=state, mlock="off",
                         max_batch=1, context=context, threads=1)
    try:
        tok = loaded.tokenizer
        for p in prompts:
            ids: list[int] = []
            text = "".join(loaded.stream_text(tok.encode(p), SamplingParams(
                max_tokens=max_tokens), on_token=ids.append))
            out[p] = (ids, text)
    finally:
        loaded.close()
    return out


def wait_done(d: Daemon, ids: list[str], timeout: float) -> dict[str, dict[str, Any]]:
    """Poll GET /v1/requests/{id} until none is queued or running (or the timeout)."""
    end = time.monotonic() + timeout
    results: dict[str, dict[str, Any]] = {}
    while len(results) < len(ids) and time.monotonic() < end:
        for rid in ids:
            if rid not in results:
                status, body = d.json("GET", f"/v1/requests/{rid}")
                assert status == 200, json.dumps(body)
                if body["state"] not in ("queued", "running"):
                    results[rid] = body
        time.sleep(0.05)
    return results


def check_journal(journal: Path, accepted: dict[str, Any],
                  seen: dict[str, list[int]]) -> dict[str, list[int]]:
    """integrity_check ok, every accepted id present, journaled tokens only extended."""
    from edge_agent.journal import JournalStore, check_integrity, open_journal

    j = open_journal(journal, readonly=True)
    try:
        assert check_integrity(j.conn, full=True) == []
        ids = {r.id for r in JournalStore(j).requests()}
    finally:
        j.close()
    missing = set(accepted) - ids
    assert not missing, f"requests that got an id are missing from the journal: {missing}"
    now = journal_tokens(journal)
    for rid, old in seen.items():
        assert now.get(rid, [])[: len(old)] == old, f"journaled tokens of {rid} changed"
    return now


def crash_run(root: Path, refs: dict[str, dict[str, tuple[list[int], str]]], *,
              iterations: int, budget_s: float, max_tokens: int, seed: int = 11,
              big_share: float = 0.1, early_share: float = 0.2) -> dict[str, Any]:
    """SIGKILL the daemon of root/config.toml (models "tiny" preloaded, "smollm2" on demand)
    at random points `iterations` times, checking the journal after each kill; then restart
    once more, wait for every request and compare with `refs` (model -> prompt -> (ids, text))."""
    import random

    rng = random.Random(seed)
    journal = root / "journal.sqlite3"
    accepted: dict[str, tuple[str, str]] = {}  # id -> (model, prompt)
    seen: dict[str, list[int]] = {}
    prompts = sorted(refs["tiny"])
    t0 = time.monotonic()
    done = early = 0
    for _ in range(iterations):
        if time.monotonic() - t0 > budget_s:
            break
        before_ready = rng.random() < early_share
        d = start(root, wait_ready=not before_ready)
        try:
            if before_ready:  # journal open/recovery, runner spawn, model load, warm-up
                time.sleep(rng.uniform(0.0, 1.2))
                early += 1
            else:
                h = d.health()
                assert h["journal"]["enabled"] and h["journal"]["synchronous"] == "FULL"
                assert h["journal"]["quarantined"] is None
                for _ in range(rng.randint(1, 3)):
                    model = "smollm2" if rng.random() < big_share else "tiny"
                    prompt = rng.choice(prompts)
                    status, body = d.json("POST", "/v1/requests",
                                          {"model": model, "prompt": prompt, "temperature": 0,
                                           "max_tokens": max_tokens})
                    assert status == 202, body
                    accepted[body["id"]] = (model, prompt)
                time.sleep(rng.uniform(0.0, 0.5))  # mid-prefill, mid-step, mid-commit
        finally:
            kill(d)
        done += 1
        seen = check_journal(journal, accepted, seen)
    loop_s = time.monotonic() - t0
    d = start(root)
    try:
        results = wait_done(d, list(accepted), 180)
        assert len(results) == len(accepted), "not every accepted request completed"
        bad = {rid: r for rid, r in results.items() if r["state"] != "done"}
        assert not bad, f"requests that did not complete: {bad}"
        rid = next(iter(accepted))  # a reconnecting client reads the whole output by id
        status, _, data = d.call("GET", f"/v1/requests/{rid}/events?from=0")
        assert status == 200 and b"event: end" in data
    finally:
        kill(d)
    final = check_journal(journal, accepted, seen)
    mismatches = []
    for rid, (model, prompt) in accepted.items():
        ids, text = refs[model][prompt]
        if results[rid]["text"] != text or final.get(rid, []) != ids:
            mismatches.append((rid, model, prompt, results[rid]["text"], text))
    return {"iterations": done, "before_ready": early, "loop_s": loop_s,
            "total_s": time.monotonic() - t0, "requests": len(accepted),
            "big_requests": sum(m == "smollm2" for m, _ in accepted.values()),
            "match_rate": 1 - len(mismatches) / max(1, len(accepted)),
            "mismatches": mismatches}


def daemon_journal(host: Any) -> Any:
    """A DaemonJournal over a fake daemon `host` (config.journal, state_dir, services, ready and,
    when it has them, sessions): what the composition root passes, from the fake's parts."""
    from edge_agent.daemon.durable import DaemonJournal

    dj = DaemonJournal(host.config.journal, host.state_dir, services=host.services,
                       submit=lambda job, now: None, add_record=lambda rec: None,
                       ready=lambda: bool(host.ready))
    dj.sessions = getattr(host, "sessions", None)
    return dj
