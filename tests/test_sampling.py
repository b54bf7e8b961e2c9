"""Sampling: greedy, temperature, top-k, top-p; randomness keyed by (seed, position)."""

from __future__ import annotations

import random
import subprocess
import sys

import numpy as np
import pytest

from edge_agent.errors import EdgeAgentError, UsageError
from edge_agent.runtime.sampling import (
    SamplingParams,
    SamplingParamsError,
    rng_for,
    sample,
    sample_rows,
    uniform_for,
)

LOGITS = np.log(np.array([0.05, 0.4, 0.1, 0.3, 0.15], dtype=np.float32))  # softmax = these


def test_greedy_is_argmax_with_lowest_id_on_ties():
    assert sample(LOGITS, SamplingParams(), 0) == 1
    tie = np.array([0.0, 3.0, 1.0, 3.0], dtype=np.float32)
    assert sample(tie, SamplingParams(), 0) == 1
    assert SamplingParams().greedy and not SamplingParams(temperature=0.5).greedy


def test_same_seed_and_position_same_token_whatever_the_history():
    p = SamplingParams(temperature=1.0, seed=1234)
    run = [sample(LOGITS, p, i) for i in range(200)]
    # a request "resumed" at position 150 draws exactly what the first run drew there
    assert [sample(LOGITS, p, i) for i in range(150, 200)] == run[150:]
    assert [sample(LOGITS, SamplingParams(temperature=1.0, seed=1235), i)
            for i in range(200)] != run
    assert len(set(run)) == 5  # it is random across positions


def test_random_numbers_are_pinned_to_seed_and_position():
    # Golden values: if numpy's Philox stream ever changes, resumed requests would diverge.
    assert rng_for(0, 0).random() == pytest.approx(0.011546754286331562, abs=0)
    assert rng_for(7, 3).random() == pytest.approx(0.4821286018761155, abs=0)
    assert rng_for(2**64 - 1, 2**40).random() != rng_for(2**64 - 1, 2**40 + 1).random()


def test_the_draw_without_numpy_is_numpys_philox_bit_for_bit() -> None:
    rnd = random.Random(5)
    keys = [(0, 0), (7, 3), (2**64 - 1, 0), (0, 2**64 - 1), (2**64 - 1, 2**64 - 1),
            (2**63, 2**63 - 1)]
    keys += [(rnd.getrandbits(64), rnd.getrandbits(rnd.choice((4, 16, 32, 64))))
             for _ in range(3000)]
    assert [uniform_for(s, p) for s, p in keys] == [rng_for(s, p).random() for s, p in keys]
    for bad in ((-1, 0), (0, -1), (2**64, 0), (0, 2**64)):
        with pytest.raises(ValueError, match=r"Philox key .*0\.\.2\*\*64-1"):
            uniform_for(*bad)


def test_a_sampled_token_does_not_import_numpy_random() -> None:
    code = """
import sys
import numpy as np
from edge_agent.runtime.sampling import SamplingParams, sample_rows
rows = (np.arange(1500, dtype=np.float32).reshape(3, 500) % 17) / 3
p = SamplingParams(temperature=0.9, top_p=0.9, top_k=40, min_p=0.01, seed=3)
print(sample_rows(rows, [p, p, SamplingParams()], [0, 1, 0]), "numpy.random" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    rows = (np.arange(1500, dtype=np.float32).reshape(3, 500) % 17) / 3
    p = SamplingParams(temperature=0.9, top_p=0.9, top_k=40, min_p=0.01, seed=3)
    assert out.split() == [*str(sample_rows(rows, [p, p, SamplingParams()], [0, 1, 0])).split(),
                           "False"]


def test_temperature_one_follows_the_softmax():
    p = SamplingParams(temperature=1.0, seed=5)
    n = 4000
    counts = np.bincount([sample(LOGITS, p, i) for i in range(n)], minlength=5) / n
    np.testing.assert_allclose(counts, [0.05, 0.4, 0.1, 0.3, 0.15], atol=0.03)


def test_low_temperature_sharpens_high_flattens():
    n = 1000
    cold = [sample(LOGITS, SamplingParams(temperature=0.1, seed=1), i) for i in range(n)]
    hot = [sample(LOGITS, SamplingParams(temperature=10.0, seed=1), i) for i in range(n)]
    assert cold.count(1) > 0.9 * n
    assert 0.13 * n < hot.count(0) < 0.27 * n  # near uniform (0.2)


def test_top_k_keeps_only_the_k_largest():
    p = SamplingParams(temperature=1.0, top_k=2, seed=9)
    drawn = {sample(LOGITS, p, i) for i in range(500)}
    assert drawn == {1, 3}
    assert all(sample(LOGITS, SamplingParams(temperature=2.0, top_k=1, seed=3), i) == 1
               for i in range(50))


def test_top_p_keeps_the_smallest_nucleus():
    # sorted probs 0.4, 0.3, 0.15, 0.1, 0.05 -> cumulative 0.4, 0.7, 0.85, 0.95, 1.0
    nucleus = {sample(LOGITS, SamplingParams(temperature=1.0, top_p=0.8, seed=2), i)
               for i in range(500)}
    assert nucleus == {1, 3, 4}
    tiny = {sample(LOGITS, SamplingParams(temperature=1.0, top_p=0.01, seed=2), i)
            for i in range(100)}
    assert tiny == {1}


def test_top_k_and_top_p_combine():
    p = SamplingParams(temperature=1.0, top_k=4, top_p=0.6, seed=4)
    assert {sample(LOGITS, p, i) for i in range(300)} == {1, 3}


def test_large_vocab_draws_are_in_range_and_deterministic():
    logits = np.random.default_rng(0).standard_normal(49152).astype(np.float32)
    p = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=11)
    a = [sample(logits, p, i) for i in range(20)]
    assert a == [sample(logits, p, i) for i in range(20)]
    top40 = set(np.argsort(-logits)[:40].tolist())
    assert set(a) <= top40


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"temperature": -0.5}, "temperature -0.5 must be a finite number >= 0"),
        ({"temperature": float("nan")}, "temperature nan must be a finite number >= 0"),
        ({"top_k": -1}, "top_k -1 must be an integer >= 0 (0 = off)"),
        ({"top_p": 0.0}, "top_p 0.0 must be in (0, 1] (1 = off)"),
        ({"top_p": 1.5}, "top_p 1.5 must be in (0, 1] (1 = off)"),
        ({"seed": -1}, "seed -1 must be an integer in 0..2**64-1"),
        ({"seed": 2**64}, "must be an integer in 0..2**64-1"),
        ({"max_tokens": 0}, "max_tokens 0 must be an integer >= 1"),
        ({"stop": ("",)}, "stop ('',) must be a tuple of non-empty strings"),
    ],
)
def test_bad_parameters_are_named(kwargs, fragment):
    with pytest.raises(SamplingParamsError) as exc:
        SamplingParams(**kwargs)
    msg = str(exc.value)
    assert msg.startswith("sampling parameters: ") and fragment in msg and "Hint:" in msg
    assert isinstance(exc.value, UsageError)


def test_non_finite_logits_are_an_error():
    bad = np.array([0.0, np.nan, 1.0], dtype=np.float32)
    with pytest.raises(EdgeAgentError, match="non-finite logits.*Hint:"):
        sample(bad, SamplingParams(), 0)
    with pytest.raises(EdgeAgentError, match="non-finite logits"):
        sample(np.full(3, np.inf, np.float32), SamplingParams(temperature=1.0), 0)


def test_sample_rows_equals_sample_row_by_row():
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((6, 1000)).astype(np.float32) * 3  # (B, V)
    logits[2, [10, 20]] = logits[2].max() + 1  # a tie: lowest id wins
    params = [SamplingParams(), SamplingParams(temperature=0.8, top_k=40, seed=9),
              SamplingParams(), SamplingParams(temperature=1.1, top_p=0.9, seed=4),
              SamplingParams(temperature=0.5, seed=2**64 - 1), SamplingParams()]
    positions = [0, 3, 7, 1, 12, 2]
    got = sample_rows(logits, params, positions)
    assert got == [sample(logits[i], p, n) for i, (p, n) in enumerate(zip(params, positions,
                                                                          strict=True))]
    assert got[2] == 10
    greedy = [SamplingParams()] * 6
    assert sample_rows(logits, greedy, [0] * 6) == list(np.argmax(logits, axis=1))


def test_sample_rows_refuses_non_finite_logits_in_any_row():
    logits = np.zeros((3, 4), dtype=np.float32)
    logits[1, 2] = np.nan
    with pytest.raises(EdgeAgentError, match=r"non-finite logits \(max nan\) over 4 tokens.*Hint:"):
        sample_rows(logits, [SamplingParams()] * 3, [0, 0, 0])
    logits[1, 2] = np.inf
    with pytest.raises(EdgeAgentError, match=r"non-finite logits \(max inf\)"):
        sample_rows(logits, [SamplingParams(), SamplingParams(), SamplingParams()], [0, 1, 2])


def test_sample_rows_with_histories_equals_sample_row_by_row():
    rng = np.random.default_rng(8)
    logits = rng.standard_normal((4, 300)).astype(np.float32) * 3  # (B, V)
    params = [SamplingParams(repeat_penalty=1.5), SamplingParams(),
              SamplingParams(temperature=0.9, seed=2, presence_penalty=1.0, min_p=0.1),
              SamplingParams(logit_bias=((3, 50.0),), logprobs=2)]
    histories = [rng.integers(0, 300, 50).tolist() for _ in params]
    got = sample_rows(logits, params, [0, 1, 2, 3], histories)
    assert got == [sample(logits[i], p, i, histories[i]) for i, p in enumerate(params)]
    assert got[3] == 3
