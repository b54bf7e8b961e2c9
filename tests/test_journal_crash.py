"""The daemon under load, killed with SIGKILL at random points and restarted, over one journal.

Two models are served: `tiny` (a small random-weight llama with the default tokenizer, preloaded:
a restart to READY is mostly Python start-up) takes most requests, and the default `smollm2`
(prepared weights reused from the session's state dir, loaded on demand) takes a few, so kills
also land while it loads. Some iterations kill before READY (mid-recovery, mid-load), the rest
after submitting 1-3 requests, at a random delay (mid-prefill, mid-step, mid-commit).

Must hold in every iteration: every request that got an id is in the journal; journaled tokens
never change (each later look is an extension of the earlier one); the file passes
integrity_check. After a last restart every request completes (state done), and at temperature
0 its output equals an uninterrupted in-process run of the same model (the match rate is
printed and must be 100 %: resumption prefills prompt + journaled tokens and continues with the
same (seed, position) sampling). The loop lives in tests/journal_harness.py (bench/journal.py
runs it for 200 iterations).
Iterations: EDGE_AGENT_CRASH_ITERATIONS (default 50), within EDGE_AGENT_CRASH_BUDGET_S (240).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
from journal_harness import crash_run, crash_world

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ITERATIONS = int(os.environ.get("EDGE_AGENT_CRASH_ITERATIONS", "50"))
BUDGET_S = float(os.environ.get("EDGE_AGENT_CRASH_BUDGET_S", "240"))
MAX_TOKENS = 10
CONTEXT = 128
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time",
           "The three primary colours are"]


def test_sigkill_under_load_loses_nothing(prepared_state_dir: Path) -> None:
    root = Path(tempfile.mkdtemp(prefix="ea-crash-", dir="/tmp"))
    try:
        refs = crash_world(root, prepared_state_dir, PROMPTS, MAX_TOKENS, CONTEXT)
        r = crash_run(root, refs, iterations=ITERATIONS, budget_s=BUDGET_S,
                      max_tokens=MAX_TOKENS)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"\ncrash test: {r['iterations']} SIGKILL iterations ({r['before_ready']} before "
          f"READY) in {r['loop_s']:.0f} s, {r['requests']} requests ({r['big_requests']} on "
          f"smollm2), temperature-0 output match rate {r['match_rate']:.1%}, total "
          f"{r['total_s']:.0f} s")
    assert r["iterations"] >= min(ITERATIONS, 10)
    assert not r["mismatches"], r["mismatches"][:5]
