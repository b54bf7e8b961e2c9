"""Sampling controls (logit_bias, presence/frequency/repeat penalties, min_p) and logprobs.

Oracles: the sampler against a plain-Python reference written from the documented rules
(llama.cpp's `llama_sampler_penalties_apply` for the penalties, a log-softmax for the
log-probabilities) on random logits; then both engines on the real model, whose penalized greedy
tokens and reported log-probabilities are checked against logits an independent forward gives
(the numpy model's own full-sequence forward; llama-cpp-python's high-level `Llama` with
logits_all), a resume by prefill and the same requests decoded in a batch.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest

from edge_agent.runtime.prefill_groups import NewSeq
from edge_agent.runtime.sampling import (
    SamplingParams,
    SamplingParamsError,
    rng_for,
    sample,
    sample_rows_with_logprobs,
    sample_with_logprobs,
    shape_logits,
)

# ---- a plain reference, written from the rules in docs/api.md -----------------------------------


def ref_shape(logits: Sequence[float], p: SamplingParams, history: Sequence[int]) -> list[float]:
    z = [float(x) for x in logits]
    for tid, bias in p.logit_bias:
        z[tid] += bias
    if p.repeat_last_n == 0:
        return z
    window = list(history) if p.repeat_last_n == -1 else list(history)[-p.repeat_last_n:]
    for tid, count in Counter(window).items():
        z[tid] = z[tid] * p.repeat_penalty if z[tid] <= 0 else z[tid] / p.repeat_penalty
        z[tid] -= count * p.frequency_penalty + p.presence_penalty
    return z


def ref_log_softmax(z: Sequence[float]) -> list[float]:
    m = max(z)
    lse = m + math.log(sum(math.exp(x - m) for x in z))
    return [x - lse for x in z]


def ref_draw(logits: Sequence[float], p: SamplingParams, position: int,
             history: Sequence[int]) -> int:
    z = ref_shape(logits, p, history)
    if p.temperature == 0:
        return max(range(len(z)), key=lambda i: (z[i], -i))
    t = [x / p.temperature for x in z]
    if p.top_k or p.top_p < 1:
        ids = sorted(range(len(t)), key=lambda i: (-t[i], i))
    else:
        ids = list(range(len(t)))
    if 0 < p.top_k < len(ids):
        ids = ids[:p.top_k]
    m = max(t[i] for i in ids)
    w = [math.exp(t[i] - m) for i in ids]
    total = sum(w)
    if p.top_p < 1:
        acc, keep = 0.0, len(ids)
        for j, x in enumerate(w):
            acc += x / total
            if acc >= p.top_p:
                keep = j + 1
                break
        ids, w = ids[:keep], w[:keep]
    if p.min_p > 0:
        top = max(w)
        w = [x if x >= p.min_p * top else 0.0 for x in w]
    u = rng_for(p.seed, position).random() * sum(w)
    acc = 0.0
    for i, x in zip(ids, w, strict=True):
        acc += x
        if u < acc:
            return i
    return ids[-1]


def _random_case(rng: np.random.Generator, vocab: int = 300) -> tuple[np.ndarray, list[int]]:
    logits = (rng.standard_normal(vocab) * 3).astype(np.float32)  # (V,) both signs
    history = rng.integers(0, 40, size=int(rng.integers(0, 120))).tolist()  # repeats
    return logits, history


PARAMS = [
    SamplingParams(repeat_penalty=1.3),
    SamplingParams(repeat_penalty=0.7, repeat_last_n=-1),
    SamplingParams(presence_penalty=1.5, frequency_penalty=0.4, repeat_last_n=16),
    SamplingParams(frequency_penalty=-0.8, repeat_penalty=1.1, temperature=0.9, seed=3),
    SamplingParams(logit_bias=((5, 100.0), (7, -100.0), (299, 3.5)), temperature=1.0, seed=1),
    SamplingParams(min_p=0.2, temperature=1.3, seed=11),
    SamplingParams(min_p=0.05, top_k=20, top_p=0.9, temperature=0.8, seed=2,
                   presence_penalty=0.5, logit_bias=((1, 2.0),)),
    SamplingParams(repeat_penalty=1.5, repeat_last_n=0, presence_penalty=2.0),  # window off
]


@pytest.mark.parametrize("p", PARAMS)
def test_shaping_and_draw_match_the_reference(p: SamplingParams) -> None:
    rng = np.random.default_rng(7)
    for position in range(25):
        logits, history = _random_case(rng)
        got = shape_logits(logits, p, history)
        np.testing.assert_allclose(got, ref_shape(logits, p, history), rtol=1e-12, atol=1e-12)
        assert sample(logits, p, position, history) == ref_draw(logits, p, position, history)
    assert p.plain == (p.repeat_last_n == 0)  # window off and nothing else: plain


@pytest.mark.parametrize("p", PARAMS)
def test_logprobs_are_the_log_softmax_of_the_shaped_logits(p: SamplingParams) -> None:
    rng = np.random.default_rng(3)
    asked = dataclasses.replace(p, logprobs=5)
    for position in range(10):
        logits, history = _random_case(rng)
        token, lp = sample_with_logprobs(logits, asked, position, history)
        assert token == sample(logits, p, position, history)  # asking changes no token
        ref = ref_log_softmax(ref_shape(logits, p, history))
        assert lp is not None
        assert lp.logprob == pytest.approx(ref[token], abs=1e-9)
        best = sorted(range(len(ref)), key=lambda i: (-ref[i], i))[:5]
        assert [i for i, _ in lp.top] == best
        assert [v for _, v in lp.top] == pytest.approx([ref[i] for i in best], abs=1e-9)


def test_logprobs_at_temperature_zero_and_zero_alternatives() -> None:
    logits = np.log(np.array([0.1, 0.6, 0.3], dtype=np.float64))
    token, lp = sample_with_logprobs(logits, SamplingParams(logprobs=0), 0)
    assert token == 1 and lp is not None and lp.top == ()
    assert lp.logprob == pytest.approx(math.log(0.6))
    # the distribution reported is at temperature 1 whatever the draw's temperature
    _, hot = sample_with_logprobs(logits, SamplingParams(logprobs=3, temperature=1.7, seed=4), 0)
    assert hot is not None
    assert [v for _, v in hot.top] == pytest.approx([math.log(x) for x in (0.6, 0.3, 0.1)])


def test_plain_params_keep_the_fast_path_and_old_draws() -> None:
    assert SamplingParams().plain and SamplingParams(temperature=0.7, top_k=5).plain
    assert SamplingParams(repeat_penalty=1.0, presence_penalty=0, repeat_last_n=0).plain
    assert not SamplingParams(repeat_penalty=1.2, repeat_last_n=0).penalized
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((4, 500)).astype(np.float32)  # (B, V)
    plain = [SamplingParams(), SamplingParams(temperature=0.9, seed=5)] * 2
    neutral = [SamplingParams(min_p=0.0, logit_bias=(), repeat_penalty=1.0)] * 4
    assert sample_rows_with_logprobs(logits, plain, [0, 1, 2, 3])[1] == [None] * 4
    assert (sample_rows_with_logprobs(logits, neutral, [0] * 4)[0]
            == list(np.argmax(logits, axis=1)))


def test_min_p_drops_the_unlikely_tail() -> None:
    probs = np.array([0.5, 0.3, 0.12, 0.05, 0.03])
    p = SamplingParams(temperature=1.0, min_p=0.2, seed=8)  # keep p >= 0.1
    assert {sample(np.log(probs), p, i) for i in range(400)} == {0, 1, 2}


def test_bias_and_penalties_move_tokens_the_expected_way() -> None:
    logits = np.array([2.0, 1.0, -1.0, 0.5], dtype=np.float32)
    assert sample(logits, SamplingParams(logit_bias=((2, 100.0),)), 0) == 2
    assert sample(logits, SamplingParams(logit_bias=((0, -100.0),)), 0) == 1
    # 0 seen twice: 2.0 / 2 - 2 * 0.5 - 0.2 = -0.2 < 1.0
    p = SamplingParams(repeat_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.2)
    assert sample(logits, p, 0, [0, 3, 0]) == 1
    assert shape_logits(logits, p, [0, 3, 0])[0] == pytest.approx(-0.2)
    assert shape_logits(logits, SamplingParams(repeat_penalty=2.0), [2])[2] == -2.0  # negative
    # only the last repeat_last_n tokens count
    assert sample(logits, SamplingParams(presence_penalty=2.0, repeat_last_n=2), 0,
                  [0, 3, 1]) == 0


@pytest.mark.parametrize("kwargs, fragment", [
    ({"min_p": 1.5}, "min_p 1.5 must be in [0, 1]"),
    ({"presence_penalty": 2.5}, "presence_penalty 2.5 must be in [-2, 2]"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty nan must be in [-2, 2]"),
    ({"repeat_penalty": 0.0}, "repeat_penalty 0.0 must be a number > 0"),
    ({"repeat_last_n": -2}, "repeat_last_n -2 must be an integer >= -1"),
    ({"logit_bias": ((1, 101.0),)}, "logit_bias ((1, 101.0),) must be (token id >= 0"),
    ({"logit_bias": ((-1, 1.0),)}, "logit_bias"),
    ({"logprobs": 21}, "logprobs 21 must be None or an integer 0..20"),
    ({"logprobs": True}, "logprobs True"),
])
def test_bad_controls_are_named(kwargs: dict[str, object], fragment: str) -> None:
    with pytest.raises(SamplingParamsError) as exc:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    assert fragment in str(exc.value) and "Hint:" in str(exc.value)


# ---- both engines on the real model --------------------------------------------------------------

PROMPT = "The cat sat on the mat. The cat sat on the mat. The cat sat on the"
N = 12


@pytest.fixture(scope="module", params=["numpy", "llamacpp"])
def engine(request: pytest.FixtureRequest, model_path: Path) -> Iterator[object]:
    if request.param == "numpy":
        from edge_agent.runtime.engine import Engine

        e: object = Engine(request.getfixturevalue("llama_f32"),
                           tokenizer=request.getfixturevalue("tokenizer"), max_batch=4,
                           context=128)
    else:
        pytest.importorskip("llama_cpp")
        from edge_agent.runtime.llamacpp import LlamaCppEngine

        e = LlamaCppEngine.load(model_path, max_batch=4, context=128, mlock="off", threads=2)
    try:
        yield e
    finally:
        e.close()  # type: ignore[attr-defined]


def _run(engine: object, sid: str, prompt: list[int], p: SamplingParams, n: int,
         generated: Sequence[int] = ()) -> tuple[list[int], list[object]]:
    """n tokens of one sequence (after `generated`), with the logprobs the engine reported."""
    e: object = engine
    tokens = [e.add(sid, prompt, p, generated=generated)]  # type: ignore[attr-defined]
    lps = [e.last_logprobs.get(sid)]  # type: ignore[attr-defined]
    try:
        for _ in range(n - 1):
            tokens.append(e.step([sid])[sid])  # type: ignore[attr-defined]
            lps.append(e.last_logprobs.get(sid))  # type: ignore[attr-defined]
    finally:
        e.release(sid)  # type: ignore[attr-defined]
    return tokens, lps


def _oracle_logits(engine: object, model_path: Path, ids: list[int]) -> np.ndarray:
    """(len(ids), V) logits of an independent full-sequence forward over `ids`."""
    if getattr(engine, "name", "") == "numpy":
        from edge_agent.runtime.kvcache import BlockTable, blocks_for

        model = engine.model  # type: ignore[attr-defined]
        pool = model.new_pool(blocks_for(len(ids)) + 1)
        table = BlockTable()
        out = model.forward(np.asarray(ids).reshape(1, -1), [table], pool, all_logits=True)
        pool.release(table)
        return np.asarray(out).reshape(len(ids), -1)
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(model_path), n_ctx=256, n_threads=2, verbose=False,
                          logits_all=True, flash_attn=True, swa_full=False)
    try:
        llm.eval(ids)
        return np.array(llm.scores[: len(ids)], dtype=np.float64)
    finally:
        llm.close()


def test_logit_bias_forces_and_bans_tokens(engine: object) -> None:
    tok = engine.tokenizer  # type: ignore[attr-defined]
    prompt = tok.encode(PROMPT)
    forced = tok.encode(" dog")[-1]
    for p in (SamplingParams(logit_bias=((forced, 100.0),)),
              SamplingParams(logit_bias=((forced, 100.0),), temperature=1.0, seed=9)):
        assert _run(engine, "f", prompt, p, 6)[0] == [forced] * 6
    greedy, _ = _run(engine, "g", prompt, SamplingParams(), 1)
    banned, _ = _run(engine, "b", prompt, SamplingParams(logit_bias=((greedy[0], -100.0),)), 6)
    assert greedy[0] not in banned


def test_penalized_greedy_and_logprobs_match_an_independent_forward(
        engine: object, model_path: Path) -> None:
    tok = engine.tokenizer  # type: ignore[attr-defined]
    prompt = tok.encode(PROMPT)
    p = SamplingParams(repeat_penalty=1.3, frequency_penalty=0.3, presence_penalty=0.4,
                       repeat_last_n=32, logit_bias=((tok.encode(" mat")[-1], -1.0),),
                       logprobs=4)
    plain, _ = _run(engine, "plain", prompt, SamplingParams(), N)
    tokens, lps = _run(engine, "pen", prompt, p, N)
    assert tokens != plain  # the penalties change this repetitive continuation
    ids = prompt + tokens
    logits = _oracle_logits(engine, model_path, ids)  # (L, V)
    tol = 1e-3  # a full-sequence forward vs token by token: the same logits, up to rounding
    for i, token in enumerate(tokens):
        history = ids[: len(prompt) + i]
        ref = np.asarray(ref_log_softmax(ref_shape(logits[len(prompt) + i - 1], p, history)))
        best = sorted(range(len(ref)), key=lambda j: (-ref[j], j))
        if ref[best[0]] - ref[best[1]] > 2 * tol:  # not a near-tie across kernels
            assert token == best[0], i
        lp = lps[i]
        assert lp is not None
        assert lp.logprob == pytest.approx(ref[token], abs=tol)  # type: ignore[attr-defined]
        top = lp.top  # type: ignore[attr-defined]
        assert len(top) == 4 and [v for _, v in top] == sorted((v for _, v in top), reverse=True)
        assert token in [j for j, _ in top] or lp.logprob <= top[-1][1]  # type: ignore[attr-defined]
        assert [v for _, v in top] == pytest.approx([ref[j] for j, _ in top], abs=tol)


def test_penalties_survive_a_resume_and_a_batch(engine: object) -> None:
    tok = engine.tokenizer  # type: ignore[attr-defined]
    prompts = [tok.encode(PROMPT), tok.encode("1, 2, 3, 1, 2, 3, 1, 2,"),
               tok.encode("Once upon a time")]
    params = [SamplingParams(repeat_penalty=1.4, repeat_last_n=-1),
              SamplingParams(temperature=0.9, seed=5, presence_penalty=1.0, min_p=0.05,
                             frequency_penalty=0.5, logprobs=2),
              SamplingParams(temperature=1.1, seed=6, top_k=30, repeat_penalty=1.2,
                             logit_bias=((tok.encode(" the")[-1], -5.0),))]
    alone = [_run(engine, f"a{i}", pr, p, N) for i, (pr, p) in enumerate(zip(prompts, params,
                                                                               strict=True))]
    # resumed by prefill after 5 tokens: the window holds prompt + generated as before
    for i, (pr, p) in enumerate(zip(prompts, params, strict=True)):
        toks, lps = _run(engine, f"r{i}", pr, p, N - 5, generated=alone[i][0][:5])
        assert toks == alone[i][0][5:]
        if p.logprobs is not None:
            assert [x.logprob for x in lps] == pytest.approx(  # type: ignore[attr-defined]
                [x.logprob for x in alone[i][1][5:]], abs=1e-3)  # type: ignore[attr-defined]
    if not engine.batch_invariance(prompts[0]):  # type: ignore[attr-defined]
        return
    e: object = engine
    first, errors = e.add_many([NewSeq(f"b{i}", pr, p)  # type: ignore[attr-defined]
                                for i, (pr, p) in enumerate(zip(prompts, params, strict=True))])
    assert not errors
    out = {k: [v] for k, v in first.items()}
    try:
        for _ in range(N - 1):
            for k, v in e.step(list(out)).items():  # type: ignore[attr-defined]
                out[k].append(v)
    finally:
        for k in out:
            e.release(k)  # type: ignore[attr-defined]
    assert [out[f"b{i}"] for i in range(3)] == [a[0] for a in alone]


def test_logit_bias_outside_the_vocabulary_is_refused(engine: object) -> None:
    vocab = engine.tokenizer.vocab_size  # type: ignore[attr-defined]
    with pytest.raises(Exception, match=r"logit_bias of 'x' names token id .* outside"):
        engine.add("x", [1, 2], SamplingParams(logit_bias=((vocab, 1.0),)))  # type: ignore
