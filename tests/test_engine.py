"""Engine step API on the real model: batched decode == one-at-a-time, errors, block lifecycle."""

from __future__ import annotations

import numpy as np
import pytest

from edge_agent.errors import EdgeAgentError
from edge_agent.runtime.engine import Engine, EngineError, NewSeq, blas_info
from edge_agent.runtime.kvcache import BlockTable, KVCacheExhaustedError, blocks_for
from edge_agent.runtime.sampling import SamplingParams

STEPS = 10


@pytest.fixture()
def engine(llama_f32, tokenizer):
    e = Engine(llama_f32, tokenizer=tokenizer, max_batch=4, context=128)
    yield e
    e.close()


def _requests(tokenizer):
    texts = ["The quick brown fox", "def add(a, b):\n    return",
             "In 1969, astronauts first", "Paris is"]
    params = [SamplingParams(), SamplingParams(temperature=0.9, top_k=50, seed=1),
              SamplingParams(temperature=0.7, top_p=0.9, seed=2),
              SamplingParams(temperature=1.2, seed=3)]
    return [(tokenizer.encode(t), p) for t, p in zip(texts, params, strict=True)]


@pytest.fixture()
def pinned_engine(prepared_state_dir):
    """The engine the runner serves with: weights are views of the mapped prepared file."""
    e = Engine.load(state_dir=prepared_state_dir, mlock="off", max_batch=4, context=128)
    yield e
    e.close()


@pytest.mark.parametrize("which", ["engine", "pinned_engine"])
def test_batched_decode_equals_one_at_a_time(which, request, tokenizer):
    engine = request.getfixturevalue(which)
    requests = _requests(tokenizer)
    assert len({len(ids) for ids, _ in requests}) > 1  # ragged prompt lengths
    alone = []
    for ids, params in requests:
        first = engine.add("solo", ids, params)
        alone.append([first] + [engine.step(["solo"])["solo"] for _ in range(STEPS)])
        engine.release("solo")
    assert engine.free_blocks == engine.pool.n_blocks

    # the same requests decoded together; the last one joins two steps late
    names = [f"r{i}" for i in range(len(requests))]
    together: dict[str, list[int]] = {}
    for name, (ids, params) in list(zip(names, requests, strict=True))[:3]:
        together[name] = [engine.add(name, ids, params)]
    for step in range(STEPS + 2):
        if step == 2:
            ids, params = requests[3]
            together["r3"] = [engine.add("r3", ids, params)]
        live = [n for n in names if n in together and len(together[n]) < STEPS + 1]
        for name, token in engine.step(live).items():
            together[name].append(token)
    assert [together[n] for n in names] == alone
    assert sorted(engine.active) == names
    for n in names:
        engine.release(n)
    assert engine.free_blocks == engine.pool.n_blocks


def test_generate_stops_before_eos_and_returns_blocks(engine, tokenizer, reference_logits):
    ids = reference_logits["chat_capital__input_ids"].tolist()
    expected = reference_logits["chat_capital__generated_ids"].tolist()
    out = list(engine.generate(ids, SamplingParams(max_tokens=30)))
    assert out == expected[: expected.index(tokenizer.eos_id)]
    assert tokenizer.decode(out) == "The capital of France is Paris."
    assert engine.free_blocks == engine.pool.n_blocks
    assert list(engine.generate(ids, SamplingParams(max_tokens=3))) == expected[:3]


def test_stream_text_cuts_at_stop_string(engine, reference_logits):
    ids = reference_logits["chat_capital__input_ids"].tolist()
    text = "".join(engine.stream_text(ids, SamplingParams(max_tokens=30, stop=("Paris", "x"))))
    assert text == "The capital of France is "
    whole = "".join(engine.stream_text(ids, SamplingParams(max_tokens=30)))
    assert whole == "The capital of France is Paris."


def test_abandoned_generation_releases_its_blocks(engine, tokenizer):
    gen = engine.generate(tokenizer.encode("Once"), SamplingParams(max_tokens=50))
    next(gen)
    assert engine.free_blocks < engine.pool.n_blocks
    gen.close()
    assert engine.free_blocks == engine.pool.n_blocks and engine.active == []


def test_context_limit_is_enforced(llama_f32, tokenizer):
    e = Engine(llama_f32, tokenizer=tokenizer, max_batch=1, context=20)
    ids = list(range(100, 118))  # 18 tokens
    e.add("a", ids, SamplingParams())
    e.step(["a"])  # position 18 -> 19 tokens
    e.step(["a"])  # 20 tokens: the context is full
    assert e.length("a") == 20
    with pytest.raises(EngineError, match=r"sequence 'a' has reached the context of 20 tokens"):
        e.step(["a"])
    e.release("a")
    with pytest.raises(EngineError, match=r"prompt of 'b' has 20 tokens; the context is 20"):
        e.add("b", list(range(100, 120)), SamplingParams())
    # generate() stops by itself at the context limit
    assert len(list(e.generate(ids, SamplingParams(max_tokens=50, ignore_eos=True)))) == 3


def test_bad_requests_are_named(engine):
    p = SamplingParams()
    engine.add("a", [1, 2, 3], p)
    with pytest.raises(EngineError, match=r"sequence 'a' is already active.*Hint:"):
        engine.add("a", [4], p)
    with pytest.raises(EngineError, match=r"'b' has an empty prompt"):
        engine.add("b", [], p)
    with pytest.raises(EngineError, match=r"token id 49152 outside the vocabulary 0\.\.49151"):
        engine.add("b", [5, 49152], p)
    with pytest.raises(EngineError, match=r"no active sequence 'zz' \(1 active\)"):
        engine.step(["a", "zz"])
    with pytest.raises(EngineError, match=r"got a sequence twice"):
        engine.step(["a", "a"])
    assert engine.length("a") == 3  # failed steps did not advance it
    for name in "bcd":
        engine.add(name, [7], p)
    with pytest.raises(EngineError, match=r"4 sequences active, max_batch is 4; cannot add 'e'"):
        engine.add("e", [7], p)
    assert isinstance(EngineError("x"), EdgeAgentError)
    assert engine.step([]) == {}
    engine.release("never-added")  # ignored


def test_forward_runs_with_the_engine_thread_count(llama_f32, tokenizer, monkeypatch):
    if not blas_info():
        pytest.skip("threadpoolctl sees no BLAS library: thread count cannot be observed")
    before = [i["num_threads"] for i in blas_info()]
    e = Engine(llama_f32, tokenizer=tokenizer, max_batch=1, context=32, threads=1)
    seen = []
    real = llama_f32.forward

    def spy(*args, **kwargs):
        seen.append([i["num_threads"] for i in blas_info()])
        return real(*args, **kwargs)

    monkeypatch.setattr(llama_f32, "forward", spy)
    assert len(list(e.generate([1, 2], SamplingParams(max_tokens=3, ignore_eos=True)))) == 3
    assert seen == [[1]] * 3  # prefill + 2 decode steps, each with 1 BLAS thread
    assert [i["num_threads"] for i in blas_info()] == before  # restored afterwards


def test_engine_load_serves_the_prepared_pinned_weights(prepared_state_dir, reference_logits):
    e = Engine.load(state_dir=prepared_state_dir, mlock="off", max_batch=2, context=64)
    try:
        assert e.weights is not None and e.weights.lock.policy == "off"
        assert not e.weights.lock.locked
        ids = reference_logits["story__input_ids"].tolist()
        assert list(e.generate(ids, SamplingParams(max_tokens=8))) == (
            reference_logits["story__generated_ids"][:8].tolist()
        )
        assert e.tokenizer is not None and e.tokenizer.eos_id == 2
    finally:
        e.close()
    assert e.weights is None


def test_prompts_added_together_decode_as_one_at_a_time(engine, tokenizer, monkeypatch):
    requests = _requests(tokenizer)
    alone = []
    for ids, params in requests:
        first = engine.add("solo", ids, params)
        alone.append([first] + [engine.step(["solo"])["solo"] for _ in range(STEPS)])
        engine.release("solo")

    forwards = []
    real = engine.model.forward
    monkeypatch.setattr(engine.model, "forward",
                        lambda tokens, *a, **kw: forwards.append(len(tokens)) or
                        real(tokens, *a, **kw))
    names = [f"r{i}" for i in range(len(requests))]
    first, errors = engine.add_many(
        [NewSeq(n, ids, p) for n, (ids, p) in zip(names, requests, strict=True)])
    assert errors == {}
    assert len(forwards) < len(requests) and max(forwards) > 1  # prompts shared a forward
    # blocks held for padding went back: each sequence holds exactly its prompt's blocks
    for n, (ids, _) in zip(names, requests, strict=True):
        assert engine.length(n) == len(ids)
        assert len(engine._seqs[n].table.blocks) == blocks_for(len(ids))
    together = {n: [first[n]] for n in names}
    for _ in range(STEPS):
        for n, token in engine.step(names).items():
            together[n].append(token)
    assert [together[n] for n in names] == alone
    for n in names:
        engine.release(n)
    assert engine.free_blocks == engine.pool.n_blocks


def test_add_many_names_each_bad_sequence_and_adds_the_rest(engine):
    p = SamplingParams()
    engine.add("old", [1, 2, 3], p)
    first, errors = engine.add_many([
        NewSeq("ok1", [5, 6, 7], p), NewSeq("old", [4], p), NewSeq("empty", [], p),
        NewSeq("vocab", [5, 49152], p), NewSeq("ok2", [9, 10], p), NewSeq("ok3", [8], p),
        NewSeq("full", [11], p),
    ])
    assert sorted(first) == ["ok1", "ok2", "ok3"]
    assert {k: type(v) for k, v in errors.items()} == dict.fromkeys(
        ["old", "empty", "vocab", "full"], EngineError)
    assert sorted(engine.active) == ["ok1", "ok2", "ok3", "old"]
    assert engine.length("ok1") == 3 and engine.length("ok2") == 2
    assert "already active" in str(errors["old"]) and "empty prompt" in str(errors["empty"])
    assert "outside the vocabulary" in str(errors["vocab"])
    assert "max_batch is 4; cannot add 'full'" in str(errors["full"])
    engine.release("ok3")
    with pytest.raises(EngineError, match=r"got a sequence id twice in \['x', 'x'\]"):
        engine.add_many([NewSeq("x", [1], p), NewSeq("x", [2], p)])
    assert sorted(engine.active) == ["ok1", "ok2", "old"]  # nothing was added


def test_add_many_without_room_for_padding_adds_one_by_one(engine):
    pool = engine.pool
    hog = BlockTable()
    pool.grow(hog, (pool.n_blocks - 2) * pool.block_size)  # leave 2 free blocks
    p = SamplingParams()
    first, errors = engine.add_many([NewSeq("long", list(range(100, 130)), p),
                                     NewSeq("short", list(range(200, 217)), p)])
    # one group (13 pads); padded it needs 2 x 2 blocks: the shorter goes alone and fits
    assert list(first) == ["short"] and list(errors) == ["long"]
    assert isinstance(errors["long"], KVCacheExhaustedError)
    assert engine.free_blocks == 0 and engine.active == ["short"]
    engine.release("short")
    pool.release(hog)
    assert engine.free_blocks == pool.n_blocks


def test_prefill_many_matches_one_prompt_at_a_time(llama_f32):
    prompts = [list(range(300, 305)), list(range(400, 412)), [77], list(range(500, 510))]
    pool = llama_f32.new_pool(16)
    alone = np.stack([llama_f32.prefill(ids, BlockTable(), pool) for ids in prompts])
    assert pool.free_blocks == 16 - sum(blocks_for(len(ids)) for ids in prompts)
    pool = llama_f32.new_pool(16)
    tables = [BlockTable() for _ in prompts]
    together = llama_f32.prefill_many(prompts, tables, pool, chunk=5)  # 3 chunks, ragged rows
    np.testing.assert_allclose(together, alone, rtol=0, atol=2e-4)
    assert [t.length for t in tables] == [len(ids) for ids in prompts]
    assert [len(t.blocks) for t in tables] == [1, 1, 1, 1]
    with pytest.raises(ValueError, match=r"lengths \[0, 1\] for 2 rows of 3 tokens"):
        llama_f32.forward(np.zeros((2, 3), dtype=np.intp), [BlockTable(), BlockTable()], pool,
                          lengths=[0, 1])
    with pytest.raises(ValueError, match="one non-empty prompt per table"):
        llama_f32.prefill_many([[1], []], [BlockTable(), BlockTable()], pool)


def test_prefill_groups_bound_the_padding():
    from edge_agent.runtime.prefill_groups import prefill_groups

    def lengths(*ns: int) -> list[list[int]]:
        items = [(NewSeq(f"s{i}", [1] * n, SamplingParams()), [1] * n) for i, n in enumerate(ns)]
        return [[len(ids) for _, ids in g] for g in prefill_groups(items)]

    assert lengths(8, 9, 8, 8, 9, 8, 8, 8) == [[8, 8, 8, 8, 8, 8, 9, 9]]  # 6 pads: one group
    assert lengths(8, 8, 8, 8, 8, 8, 8, 14) == [[8] * 7, [14]]  # 42 pads: two forwards
    assert lengths(10, 26) == [[10, 26]]  # 16 pads: still cheaper than a second forward
    assert lengths(10, 27) == [[10], [27]]
    assert lengths() == []
