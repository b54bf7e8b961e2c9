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

The same loop runs on the numpy engine (the references are then the numpy engine's own) with
fewer kills: EDGE_AGENT_CRASH_ITERATIONS_NUMPY (default 12) within 120 s, a larger share of the
requests on `smollm2` so that some land on the big model and some kills on its load.
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
NUMPY_ITERATIONS = int(os.environ.get("EDGE_AGENT_CRASH_ITERATIONS_NUMPY", "12"))
NUMPY_BUDGET_S = 120.0
# engine -> (iterations, budget in seconds, share of the requests sent to smollm2)
RUNS = {"llamacpp": (ITERATIONS, BUDGET_S, 0.1), "numpy": (NUMPY_ITERATIONS, NUMPY_BUDGET_S, 0.4)}
MAX_TOKENS = 10
CONTEXT = 128
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time",
           "The three primary colours are"]


@pytest.mark.parametrize("engine", list(RUNS))
def test_sigkill_under_load_loses_nothing(prepared_state_dir: Path, engine: str) -> None:
    iterations, budget_s, big_share = RUNS[engine]
    root = Path(tempfile.mkdtemp(prefix="ea-crash-", dir="/tmp"))
    try:
        refs = crash_world(root, prepared_state_dir, PROMPTS, MAX_TOKENS, CONTEXT, engine=engine)
        r = crash_run(root, refs, iterations=iterations, budget_s=budget_s,
                      max_tokens=MAX_TOKENS, big_share=big_share)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"\ncrash test ({engine}): {r['iterations']} SIGKILL iterations "
          f"({r['before_ready']} before READY) in {r['loop_s']:.0f} s, {r['requests']} "
          f"requests ({r['big_requests']} on smollm2), temperature-0 output match rate "
          f"{r['match_rate']:.1%}, total {r['total_s']:.0f} s")
    assert r["iterations"] >= min(iterations, 10)
    assert not r["mismatches"], r["mismatches"][:5]
