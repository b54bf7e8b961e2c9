"""The llama.cpp engine's prompt cache (KV prefix reuse) and what the daemon reports of it.

Engine level, on the two shipped models: a released slot keeps its cells; a new prompt takes
the free slot holding its longest common prefix and prefills only the rest; unmatched prompts
evict the least recently released slot; on the batch-invariant SmolLM2 a hit gives the very
tokens a cold prefill gives (greedy and seeded sampling, alone and in a batch), and the same
prompt again takes its cells and its last logits and decodes nothing; on Gemma 3
(sliding-window layers, not batch-invariant) a tail is cut only while the window before the
cut is still held; decoded alone (`runtime.decode = "alone"`) it is batch-invariant and its hits
are exact too. The oracle for "same tokens" is the same engine with its cache cleared.

Daemon level (a real `edge-agent serve`, the openai SDK): a session's second turn reports
cached prompt tokens in `usage.prompt_tokens_details`, /metrics counts them, /health says so.
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from edge_agent.paths import default_model_path
from edge_agent.runtime.prefill_groups import NewSeq
from edge_agent.runtime.sampling import SamplingParams

pytest.importorskip("llama_cpp", reason="the prompt cache is the llama.cpp engine's")

from edge_agent.runtime.llamacpp import BATCH_TOKENS, LlamaCppEngine  # noqa: E402

pytestmark = pytest.mark.timeout(600)

GREEDY = SamplingParams(max_tokens=16, temperature=0.0)
SEEDED = SamplingParams(max_tokens=16, temperature=0.9, top_k=40, seed=1234)


def _text(topic: str, n: int) -> str:
    return " ".join(f"Note {i} about {topic}: it changes with the season and the hour."
                    for i in range(n))


@pytest.fixture(scope="module")
def smol() -> Iterator[LlamaCppEngine]:
    e = LlamaCppEngine.load(default_model_path(), max_batch=4, context=2048, threads=2)
    try:
        assert e.batch_invariance(())  # what the runner does at warm-up
        assert e.exact_reuse
        yield e
    finally:
        e.close()


@pytest.fixture()
def engine(smol: LlamaCppEngine) -> LlamaCppEngine:
    smol.clear_cache()
    assert not smol.active
    return smol


def _ids(e: LlamaCppEngine, topic: str, n: int = 36) -> list[int]:
    """A prompt a little longer than one prefill piece (BATCH_TOKENS), so exact reuse hits."""
    ids = e.tokenizer.encode(_text(topic, n))
    assert len(ids) > BATCH_TOKENS + 20
    return ids


def _run(e: LlamaCppEngine, prompts: dict[str, list[int]], params: SamplingParams,
         n: int = 12) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Add `prompts` together, step them `n - 1` times; (tokens, cached) by id; released."""
    out, cached, _ = _run_lp(e, prompts, params, n)
    return out, cached


def _run_lp(e: LlamaCppEngine, prompts: dict[str, list[int]], params: SamplingParams,
            n: int = 12) -> tuple[dict[str, list[int]], dict[str, int], dict[str, object]]:
    """`_run`, and the first token's log-probabilities by id (when params ask for them)."""
    first, errors = e.add_many([NewSeq(sid, ids, params) for sid, ids in prompts.items()])
    assert not errors, errors
    out = {sid: [tok] for sid, tok in first.items()}
    lps: dict[str, object] = dict(e.last_logprobs)
    cached = {sid: e.cached_tokens(sid) for sid in prompts}
    try:
        for _ in range(n - 1):
            for sid, tok in e.step(list(prompts)).items():
                out[sid].append(tok)
    finally:
        for sid in prompts:
            e.release(sid)
    return out, cached, lps


def test_a_new_prompt_takes_the_slot_with_its_longest_prefix(engine: LlamaCppEngine) -> None:
    a, b = _ids(engine, "rivers"), _ids(engine, "mountains")
    _run(engine, {"a": a}, GREEDY)
    _run(engine, {"b": b}, GREEDY)
    more = engine.tokenizer.encode(" And one more line.")
    _, cached = _run(engine, {"a2": a + more}, GREEDY)
    # whole pieces of BATCH_TOKENS prefilled cells (exact reuse on this model)
    assert cached["a2"] == len(a) // BATCH_TOKENS * BATCH_TOKENS > 0
    _, cached = _run(engine, {"b2": b + more, "c": _ids(engine, "deserts")}, GREEDY)
    assert cached == {"b2": len(b) // BATCH_TOKENS * BATCH_TOKENS, "c": 0}
    info = engine.describe()["prompt_cache"]
    assert info["slots"] == 4 and info["exact"] is True and info["held_tokens"] > 0
    engine.clear_cache()
    assert engine.describe()["prompt_cache"]["held_tokens"] == 0
    _, cached = _run(engine, {"a3": a + more}, GREEDY)
    assert cached == {"a3": 0}


def test_unmatched_prompts_evict_the_least_recently_used_slot(engine: LlamaCppEngine) -> None:
    p = [_ids(engine, t) for t in ("salt", "iron", "glass", "paper")]
    for k, ids in enumerate(p):  # released in order: slot of p[0] is the oldest
        _run(engine, {f"p{k}": ids}, GREEDY, n=2)
    _run(engine, {"q": _ids(engine, "clouds")}, GREEDY, n=2)  # no match: evicts p[0]
    hit = len(p[0]) // BATCH_TOKENS * BATCH_TOKENS
    assert _run(engine, {"p3": p[3] + [p[3][-1]]}, GREEDY, n=2)[1] == {"p3": hit}
    assert _run(engine, {"p0": p[0] + [p[0][-1]]}, GREEDY, n=2)[1] == {"p0": 0}  # gone
    # that miss took the then least recently used slot (p[1]'s); p[2] still hits
    assert _run(engine, {"p2": p[2] + [p[2][-1]]}, GREEDY, n=2)[1] == {"p2": hit}
    assert _run(engine, {"p1": p[1] + [p[1][-1]]}, GREEDY, n=2)[1] == {"p1": 0}


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_hit_gives_the_tokens_of_a_cold_prefill(engine: LlamaCppEngine,
                                                  params: SamplingParams) -> None:
    """A session's next turn (its previous prompt + reply + a new line), with and without
    the previous turn's cells, alone and next to another new sequence. Next to company, a
    step of a sequence past 256 cells takes another attention kernel than alone (llama.cpp's
    split-KV path is for a lone stream; docs/engines.md), so the hit next to company is
    compared with a cold prefill next to the same company."""
    tok = engine.tokenizer
    for n in (36,):
        first = _ids(engine, "tides", n)
        reply = _run(engine, {"t1": first}, params)[0]["t1"]
        turn2 = first + reply + tok.encode(" Tell me more.")
        warm, cached = _run(engine, {"t2": turn2}, params)
        assert cached["t2"] == len(first) // BATCH_TOKENS * BATCH_TOKENS > 0
        engine.clear_cache()
        cold, cached = _run(engine, {"t2": turn2}, params)
        assert cached["t2"] == 0
        assert warm == cold, n
        company = tok.encode("Tell me about the moon.")
        engine.clear_cache()
        cold_both, cached = _run(engine, {"t2": turn2, "o": company}, params)
        assert cached["t2"] == 0
        engine.clear_cache()
        _run(engine, {"t1": first}, params)  # the cache holds the first turn again
        both, cached = _run(engine, {"t2": turn2, "o": company}, params)
        assert cached["t2"] > 0 and both == cold_both, n
        engine.clear_cache()


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_the_same_prompt_again_takes_its_cells_and_its_logits(engine: LlamaCppEngine,
                                                               params: SamplingParams) -> None:
    """A retry or a regenerated reply: the same short prompt (no whole BATCH_TOKENS piece to
    reuse by prefix, and its slot holds a reply twice its length) takes the cells and the
    last row's logits its first prefill wrote, and decodes nothing: the tokens and the first
    token's log-probabilities are a cold prefill's, alone and next to a new sequence."""
    tok = engine.tokenizer
    params = replace(params, logprobs=3)
    short = tok.encode("Once upon a time, a lighthouse keeper")
    other = tok.encode("The moon rose over the harbour")
    cold, cached, cold_lp = _run_lp(engine, {"a": short}, params, n=3 * len(short))
    assert cached == {"a": 0}
    again, cached, again_lp = _run_lp(engine, {"a2": short}, params, n=3 * len(short))
    assert cached == {"a2": len(short)}
    assert again["a2"] == cold["a"] and again_lp["a2"] == cold_lp["a"]
    engine.clear_cache()
    cold_both, cached, cold_both_lp = _run_lp(engine, {"a": short, "o": other}, params)
    assert cached == {"a": 0, "o": 0}
    engine.clear_cache()
    _run(engine, {"a": short}, params, n=3 * len(short))
    both, cached, both_lp = _run_lp(engine, {"a": short, "o": other}, params)
    assert cached == {"a": len(short), "o": 0}
    assert both == cold_both and both_lp == cold_both_lp
    assert both["a"] == cold["a"][:len(both["a"])]  # short sequences: batch-invariant here
    # a longer or shorter prompt is not the same prompt: prefix rules (nothing reused here)
    _, cached = _run(engine, {"b": short[:-1]}, params, n=2)
    assert cached == {"b": 0}


def test_a_resume_never_takes_a_whole_prompt_hit(engine: LlamaCppEngine) -> None:
    """A plain prompt equal to a resumed request's prompt + journaled tokens: its slot's
    logits were written by a prefill, the resume's by one decode per journaled token, so the
    resume does not take them (it continues the uninterrupted run's tokens)."""
    short = engine.tokenizer.encode("Once upon a time, a lighthouse keeper")
    whole = _run(engine, {"r": short}, GREEDY, n=16)[0]["r"]
    cut = 6
    _run(engine, {"p": short + whole[:cut]}, GREEDY, n=2)  # its slot: this prompt's logits
    token = engine.add("r2", short, GREEDY, generated=whole[:cut])
    try:
        assert engine.cached_tokens("r2") == 0
        rest = [token] + [engine.step(["r2"])["r2"] for _ in range(len(whole) - cut - 1)]
    finally:
        engine.release("r2")
    assert whole[:cut] + rest == whole


def test_a_resume_continues_its_journaled_tokens_whatever_the_cache_holds(
        engine: LlamaCppEngine) -> None:
    ids = _ids(engine, "orchards")
    whole = _run(engine, {"r": ids}, GREEDY, n=16)[0]["r"]
    cut = 6
    # the cache holds the whole run (prompt + fed tokens): the resume still starts at `cut`
    token = engine.add("r2", ids, GREEDY, generated=whole[:cut])
    try:
        assert engine.cached_tokens("r2") == len(ids) // BATCH_TOKENS * BATCH_TOKENS
        rest = [token] + [engine.step(["r2"])["r2"] for _ in range(len(whole) - cut - 1)]
    finally:
        engine.release("r2")
    assert whole[:cut] + rest == whole


# ---- Gemma 3: sliding-window layers, not batch-invariant -------------------------------------

@pytest.fixture(scope="module")
def gemma(gemma_path: Path) -> Iterator[LlamaCppEngine]:
    e = LlamaCppEngine.load(gemma_path, max_batch=2, context=4096, threads=2)
    try:
        # the mode the warm-up's probe picks for Gemma 3 (not batch-invariant here, see
        # tests/test_llamacpp_engine.py); set directly, as a 2-slot probe may not see it
        e.exact_reuse = False
        yield e
    finally:
        e.close()


def test_gemma_reuses_every_cell_and_cuts_a_tail_only_inside_the_window(
        gemma: LlamaCppEngine) -> None:
    e = gemma
    e.clear_cache()
    assert e.exact_reuse is False and e.describe()["prompt_cache"]["sliding_window"] > 0
    window = e.describe()["prompt_cache"]["sliding_window"]
    tok = e.tokenizer
    short = tok.encode(_text("lanterns", 8))
    assert len(short) < window
    _run(e, {"s": short}, GREEDY, n=4)  # held: prompt + 3 fed tokens
    _, cached = _run(e, {"s2": short[:-5] + tok.encode(" candles")}, GREEDY, n=2)
    assert cached == {"s2": len(short) - 5}  # tail cut: the window before it is all there
    e.clear_cache()
    # a prompt that shares less than half of what a slot holds does not cut it (a shared
    # system prompt would otherwise throw a long conversation's cache away)
    convo = tok.encode(_text("a long chat", 12))
    _run(e, {"c": convo}, GREEDY, n=2)
    _, cached = _run(e, {"o": convo[: len(convo) // 3] + tok.encode(" Other.")}, GREEDY, n=2)
    assert cached == {"o": 0}  # the other (empty) slot
    _, cached = _run(e, {"c2": convo + tok.encode(" More.")}, GREEDY, n=2)
    assert cached == {"c2": len(convo)}
    e.clear_cache()
    long = tok.encode(_text("harbours", 100))
    assert len(long) > 2 * window + 256  # the SWA cache (window + one batch) was overwritten
    reply = _run(e, {"l": long}, GREEDY, n=4)[0]["l"]
    # an exact continuation (prompt + fed tokens are a prefix): reused, nothing cut
    _, cached = _run(e, {"l2": long + reply[:3] + tok.encode(" Next.")}, GREEDY, n=2)
    assert cached == {"l2": len(long) + 3}
    # diverging far before the end: the window before the cut is gone, so no reuse
    _, cached = _run(e, {"l3": long[: len(long) // 2] + tok.encode(" Next.")}, GREEDY, n=2)
    assert cached == {"l3": 0}


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_gemma_decoded_alone_reuses_in_the_exact_mode(gemma_path: Path,
                                                      params: SamplingParams) -> None:
    """`decode = "alone"`: the probe finds Gemma 3 batch-invariant, so its cache runs in the
    exact mode. A session's next turn reuses whole prefill pieces, and the same prompt again
    takes its cells and logits; each gives the tokens (and first log-probabilities) of a cold
    prefill of that prompt alone, whether it runs alone or next to another new sequence."""
    e = LlamaCppEngine.load(gemma_path, max_batch=4, context=2048, threads=2, decode="alone")
    try:
        assert e.batch_invariance(()) is True and e.exact_reuse is True
        tok = e.tokenizer
        params = replace(params, logprobs=3)
        company = tok.encode("Tell me about the moon.")
        first = _ids(e, "tides")
        reply = _run(e, {"t1": first}, params)[0]["t1"]
        turn2 = first + reply + tok.encode(" Tell me more.")
        e.clear_cache()
        cold, cached, cold_lp = _run_lp(e, {"t2": turn2}, params)
        assert cached == {"t2": 0}
        for others in ({}, {"o": company}):
            e.clear_cache()
            _run(e, {"t1": first}, params)  # the cache holds the first turn
            warm, cached, warm_lp = _run_lp(e, {"t2": turn2, **others}, params)
            assert cached["t2"] == len(first) // BATCH_TOKENS * BATCH_TOKENS > 0
            assert (warm["t2"], warm_lp["t2"]) == (cold["t2"], cold_lp["t2"]), others
            # the same prompt again: its cells and its last logits, nothing decoded
            again, cached, again_lp = _run_lp(e, {"t3": turn2, **others}, params)
            assert cached["t3"] == len(turn2)
            assert (again["t3"], again_lp["t3"]) == (cold["t2"], cold_lp["t2"]), others
    finally:
        e.close()


# ---- the daemon --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def daemon() -> Iterator[object]:
    from daemon_proc import Daemon, launch, serve_argv

    root = Path(tempfile.mkdtemp(prefix="ea-pc-", dir="/tmp"))
    cfg = root / "config.toml"
    cfg.write_text(
        f'[server]\nsocket = "{root / "ea.sock"}"\nstate_dir = "{root / "state"}"\n'
        "drain_timeout_s = 5\n"
        '[runtime]\nmlock = "best-effort"\nengine = "llamacpp"\nthreads = 2\n'
        "[models.smollm2]\ncontext = 2048\nmax_batch = 2\npreload = true\n"
    )
    with launch(Daemon, root, serve_argv(cfg)) as d:
        yield d


def _counter(text: str, name: str, model: str = "smollm2") -> int:
    m = re.search(rf'^{name}{{model="{model}"}} (\d+)$', text, re.M)
    return int(m.group(1)) if m else 0


@pytest.mark.slow
def test_a_sessions_second_turn_is_served_from_the_cache(daemon: object) -> None:
    import openai

    try:
        import httpx2 as httpx  # the HTTP library of openai 3
    except ImportError:
        import httpx
    d = daemon
    transport = httpx.HTTPTransport(uds=str(d.sock))  # type: ignore[attr-defined]
    client = openai.OpenAI(base_url="http://localhost/v1", api_key="unused", max_retries=0,
                           timeout=240,
                           http_client=openai.DefaultHttpxClient(transport=transport))
    before = d.call("GET", "/metrics")[2].decode()  # type: ignore[attr-defined]
    try:
        story = _text("the lighthouse keeper", 70)
        one = client.chat.completions.create(
            model="smollm2", max_tokens=8, temperature=0,
            messages=[{"role": "user", "content": f"{story}\nSummarise."}],
            extra_body={"session": "pc-1"})
        assert one.usage is not None and one.usage.prompt_tokens > BATCH_TOKENS
        assert one.usage.prompt_tokens_details.cached_tokens == 0
        two = client.chat.completions.create(
            model="smollm2", max_tokens=8, temperature=0,
            messages=[{"role": "user", "content": "Shorter, please."}],
            extra_body={"session": "pc-1"})
    finally:
        client.close()
    assert two.usage is not None and two.usage.prompt_tokens > one.usage.prompt_tokens
    cached = two.usage.prompt_tokens_details.cached_tokens
    assert cached == one.usage.prompt_tokens // BATCH_TOKENS * BATCH_TOKENS > 0
    after = d.call("GET", "/metrics")[2].decode()  # type: ignore[attr-defined]
    assert (_counter(after, "edge_agent_prompt_tokens_total")
            - _counter(before, "edge_agent_prompt_tokens_total")
            == one.usage.prompt_tokens + two.usage.prompt_tokens)
    assert (_counter(after, "edge_agent_prompt_cache_hit_tokens_total")
            - _counter(before, "edge_agent_prompt_cache_hit_tokens_total") == cached)
    pc = d.health()["models"]["smollm2"]["prompt_cache"]  # type: ignore[attr-defined]
    assert pc["enabled"] is True and pc["exact"] is True
    assert pc["hits"] >= 1 and pc["cached_tokens"] >= cached
