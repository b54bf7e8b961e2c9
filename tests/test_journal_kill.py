"""Real crashes: a child process appends decode steps in a tight loop and is SIGKILLed at a
random time, 30 times over the same file. Every step it reported committed must be there, each
step is all-or-nothing across the batch, tokens never change, and the file stays intact."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from edge_agent.journal import JournalStore, check_integrity, open_journal

BATCH = 4
CHILD = r"""
import sys
from edge_agent.journal import JournalStore, open_journal

path = sys.argv[1]
store = JournalStore(open_journal(path))
ids = [f"r{k}" for k in range(BATCH)]
for rid in ids:
    if store.get_request(rid) is None:
        store.add_request(id=rid, model="m", input={"prompt": rid}, prompt_ids=[1, 2, 3],
                          params={"seed": 1})
n = store.token_count(ids[0])
print("ready", n, flush=True)
while True:
    store.append_tokens([(rid, n, (k * 7919 + n * 31) % 49152, 2 * n + 2)
                         for k, rid in enumerate(ids)])
    if n % 25 == 0:  # other transactions in between: a request that comes and goes, sessions
        store.add_request(id=f"x{n}", model="m", input={}, prompt_ids=[1], params={})
        store.finish(f"x{n}", "done")
        store.save_session("s", "m", list(range(n % 500)))
        store.prune(max_finished=3)
    print(n, flush=True)
    n += 1
""".replace("BATCH", str(BATCH))


def _token(k: int, n: int) -> int:
    return (k * 7919 + n * 31) % 49152


def test_sigkill_mid_commit_loses_nothing_committed(tmp_path: Path) -> None:
    path = tmp_path / "j.sqlite3"
    rng = random.Random(5)
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    previous = 0
    for iteration in range(30):
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(path)], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert child.stdout is not None
            if iteration % 5 == 4:  # some kills land during start-up: open, check, migrate
                time.sleep(rng.uniform(0.0, 0.4))
            else:
                first = child.stdout.readline()
                assert first.startswith("ready"), child.stderr.read() if child.stderr else first
                assert int(first.split()[1]) >= previous
                time.sleep(rng.uniform(0.0, 0.12))
            os.kill(child.pid, signal.SIGKILL)
            out, err = child.communicate(timeout=30)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
        assert child.returncode == -signal.SIGKILL, err
        # steps whose commit had returned (the "ready N" line is not a step)
        reported = [int(ln) for ln in out.splitlines() if not ln.startswith("ready")]
        last = reported[-1] if reported else previous - 1

        j = open_journal(path, check="full")
        assert j.quarantined is None
        assert j.pragma("synchronous") == 2
        assert check_integrity(j.conn, full=True) == []
        store = JournalStore(j)
        counts = {store.token_count(f"r{k}") for k in range(BATCH)}
        assert len(counts) == 1, f"iteration {iteration}: a step was torn: {counts}"
        count = counts.pop()
        # every reported step is there; at most one more (committed, killed before printing)
        assert last + 1 <= count <= last + 2, (iteration, last, count)
        assert count >= previous
        for k in range(BATCH):
            toks = store.tokens(f"r{k}")
            assert [t.index for t in toks] == list(range(count))
            assert [t.token_id for t in toks] == [_token(k, n) for n in range(count)]
            assert [t.text_offset for t in toks] == [2 * n + 2 for n in range(count)]
        store.close()
        previous = count
    assert previous > 30  # the children made progress across the kills
