"""Engine.add(..., generated=...): resuming a sequence by prefill continues it exactly.

A request resumed after a restart prefills prompt + the tokens it had generated and must go on
with the tokens an uninterrupted run produces (same (seed, position) randomness), whatever the
point it stopped at.
"""

from __future__ import annotations

import pytest

from edge_agent.runtime.engine import Engine, EngineError
from edge_agent.runtime.sampling import SamplingParams

STEPS = 12


@pytest.fixture()
def engine(llama_f32, tokenizer):
    e = Engine(llama_f32, tokenizer=tokenizer, max_batch=4, context=64)
    yield e
    e.close()


def _run(engine: Engine, ids: list[int], params: SamplingParams, n: int,
         generated: list[int] | None = None) -> list[int]:
    out = [engine.add("s", ids, params, generated=generated or ())]
    out += [engine.step(["s"])["s"] for _ in range(n - 1)]
    engine.release("s")
    return out


@pytest.mark.parametrize("params", [
    SamplingParams(),  # greedy
    SamplingParams(temperature=0.9, top_k=40, seed=7),
    SamplingParams(temperature=1.1, top_p=0.95, seed=123),
], ids=["greedy", "top_k", "top_p"])
def test_resume_by_prefill_continues_the_uninterrupted_run(engine, tokenizer, params):
    ids = tokenizer.encode("Once upon a time, in a small village,")
    full = _run(engine, ids, params, STEPS)
    for k in (1, 2, 5, STEPS - 1):
        rest = _run(engine, ids, params, STEPS - k, generated=full[:k])
        assert rest == full[k:], f"resumed after {k} tokens"
    assert engine.free_blocks == engine.pool.n_blocks


def test_resumed_sequence_is_at_the_right_position(engine, tokenizer):
    ids = tokenizer.encode("The capital of France is")
    engine.add("a", ids, SamplingParams(), generated=[11, 12, 13])
    assert engine.length("a") == len(ids) + 3
    engine.step(["a"])
    assert engine.length("a") == len(ids) + 4
    engine.release("a")


def test_resume_errors_name_the_generated_tokens(engine, tokenizer):
    ids = tokenizer.encode("Hello")
    with pytest.raises(EngineError, match=r"has 64 tokens \(\d+ of them already generated\); "
                       r"the context is 64.*Hint: shorten"):
        engine.add("a", ids, SamplingParams(), generated=[5] * (64 - len(ids)))
    with pytest.raises(EngineError, match="token id -1 outside the vocabulary"):
        engine.add("a", ids, SamplingParams(), generated=[5, -1])
    assert engine.active == [] and engine.free_blocks == engine.pool.n_blocks
