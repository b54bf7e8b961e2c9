"""The OpenAI-compatible surface of a live daemon, through the official `openai` SDK over the
Unix socket and through raw HTTP: limits (no max_tokens: until end-of-sequence or the context;
max_completion_tokens wins), unknown and unsupported fields refused naming them, GET
/v1/models/{id}, POST /tokenize and /detokenize (llama-server's shapes) and /metrics.

Recipe as tests/test_daemon_e2e.py: `python -m edge_agent serve` as a subprocess with the real
default model (tests/daemon_proc.py), one daemon for the module, READY=1 awaited, killed in
`finally`. The module runs twice, on a daemon of each engine (the `engine` fixture); the
log-probabilities are checked against an independent full-sequence forward of the same engine.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from daemon_proc import Daemon, launch, serve_argv

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CONTEXT = 256  # bounds a reply that runs until the context
STORY = [{"role": "user", "content": "Write a long story about a dragon and a knight."}]


@pytest.fixture(scope="module", params=["llamacpp", "numpy"])
def engine(request: pytest.FixtureRequest) -> str:
    """Every test of this module runs against a daemon on each engine."""
    return str(request.param)


@pytest.fixture(scope="module")
def daemon(prepared_state_dir: Path, engine: str) -> Iterator[Daemon]:
    root = Path(tempfile.mkdtemp(prefix="ea-oa-", dir="/tmp"))
    cfg = root / "config.toml"
    cfg.write_text(
        f'[server]\nsocket = "{root / "ea.sock"}"\nstate_dir = "{prepared_state_dir}"\n'
        "drain_timeout_s = 5\n"
        f'[runtime]\nengine = "{engine}"\nmlock = "best-effort"\nthreads = 1\n'
        f"[models.smollm2]\ncontext = {CONTEXT}\nmax_batch = 2\npreload = true\n"
    )
    with launch(Daemon, root, serve_argv(cfg)) as d:
        assert d.health()["models"]["smollm2"]["engine"] == engine
        yield d


def _httpx_module() -> Any:
    """The HTTP library the installed SDK is built on (httpx2 from openai 3, else httpx)."""
    try:
        import httpx2

        return httpx2
    except ImportError:
        import httpx

        return httpx


@pytest.fixture(scope="module")
def client(daemon: Daemon) -> Iterator[openai.OpenAI]:
    transport = _httpx_module().HTTPTransport(uds=str(daemon.sock))
    c = openai.OpenAI(base_url="http://localhost/v1", api_key="unused", max_retries=0,
                      timeout=240, http_client=openai.DefaultHttpxClient(transport=transport))
    yield c
    c.close()


def test_chat_without_max_tokens_runs_past_16_tokens(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="smollm2", messages=STORY,  # type: ignore[arg-type]  # plain dicts for the SDK's message TypedDicts
                                       temperature=0)
    assert r.usage is not None
    assert r.usage.completion_tokens > 16, r
    assert r.choices[0].finish_reason in ("stop", "length")
    if r.choices[0].finish_reason == "length":  # only the context stopped it
        assert r.usage.prompt_tokens + r.usage.completion_tokens == CONTEXT


def test_max_completion_tokens_wins_over_max_tokens(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="smollm2", messages=STORY,  # type: ignore[arg-type]  # plain dicts for the SDK's message TypedDicts
                                       temperature=0, max_tokens=12, max_completion_tokens=5)
    assert r.usage is not None and r.usage.completion_tokens == 5
    assert r.choices[0].finish_reason == "length"


def test_unknown_and_unsupported_fields_are_bad_requests_naming_them(
        client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="smollm2", messages=STORY,  # type: ignore[arg-type]  # plain dicts for the SDK's message TypedDicts
                                       max_tokens=2, extra_body={"frobnicate": 1})
    err = info.value
    assert err.code == "unknown_parameter" and err.param == "frobnicate"
    assert "'frobnicate'" in err.message and "Hint:" in err.message
    assert isinstance(err.body, dict) and err.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="smollm2", messages=STORY,  # type: ignore[call-overload]  # plain dicts for the SDK's TypedDicts
                                       max_tokens=2, functions=[{"name": "f", "parameters": {}}])
    assert info.value.code == "unsupported_parameter" and info.value.param == "functions"
    assert "not supported yet" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="smollm2", prompt="Hi", max_tokens=2, echo=True)
    assert info.value.param == "echo"
    # the ignore list and neutral values are accepted
    r = client.chat.completions.create(model="smollm2", messages=STORY,  # type: ignore[call-overload]  # plain dicts for the SDK's TypedDicts
                                       max_completion_tokens=2, user="u1", store=False,
                                       metadata={"k": "v"}, presence_penalty=0,
                                       response_format={"type": "text"})
    assert r.usage is not None and r.usage.completion_tokens == 2


def test_models_retrieve_and_unknown_model(client: openai.OpenAI, daemon: Daemon) -> None:
    m = client.models.retrieve("smollm2")
    assert (m.id, m.object, m.owned_by) == ("smollm2", "model", "edge-agent")
    assert [x.id for x in client.models.list()] == ["smollm2"]
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("nope")
    assert info.value.code == "model_not_found" and "nope" in info.value.message
    status, body = daemon.json("GET", "/v1/models/nope")
    assert status == 404 and set(body["error"]) == {"message", "type", "param", "code"}


def test_tokenize_and_detokenize_in_llama_server_shapes(daemon: Daemon) -> None:
    from edge_agent.paths import default_model_path
    from edge_agent.runtime.gguf import GGUFFile
    from edge_agent.runtime.tokenizer import Tokenizer

    with GGUFFile(default_model_path()) as g:
        tok = Tokenizer.from_metadata(g.metadata)
    text = "Hello world, héllo"
    status, r = daemon.json("POST", "/tokenize", {"content": text})
    assert status == 200 and r == {"tokens": tok.encode(text)}
    status, r = daemon.json("POST", "/tokenize", {"content": text, "with_pieces": True})
    assert status == 200 and [p["id"] for p in r["tokens"]] == tok.encode(text)
    pieces = r["tokens"]
    assert all(isinstance(p["piece"], (str, list)) for p in pieces)
    assert b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"])
                    for p in pieces) == text.encode()
    # control-token text is that token by default (parse_special), plain text without it
    start = tok.token_id("<|im_start|>")
    status, r = daemon.json("POST", "/tokenize", {"content": "<|im_start|>user"})
    assert r["tokens"][0] == start and len(r["tokens"]) == 2
    status, r = daemon.json("POST", "/tokenize", {"content": "<|im_start|>user",
                                                  "parse_special": False})
    assert start not in r["tokens"]
    status, r = daemon.json("POST", "/detokenize", {"tokens": tok.encode(text)})
    assert status == 200 and r == {"content": text}
    # control tokens come back as their text, as on llama-server (docs/api.md)
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    status, r = daemon.json("POST", "/detokenize", {"tokens": ids})
    assert status == 200 and r["content"].startswith("<|im_start|>") and "<|im_end|>" in \
        r["content"], r
    status, r = daemon.json("POST", "/detokenize", {"tokens": [1, 10 ** 9]})
    assert status == 400 and r["error"]["param"] == "tokens[1]"
    assert "vocabulary" in r["error"]["message"] and "Hint:" in r["error"]["message"]
    status, r = daemon.json("POST", "/tokenize", {"content": "x", "model": "nope"})
    assert status == 404 and r["error"]["code"] == "model_not_found"
    status, r = daemon.json("POST", "/tokenize", {"text": "x"})
    assert status == 400 and r["error"]["param"] == "text"


def test_metrics_exact_integers_labels_build_info(daemon: Daemon) -> None:
    from edge_agent import __version__

    status, _, data = daemon.call("GET", "/metrics")
    text = data.decode()
    assert status == 200
    lines = text.splitlines()
    samples = [ln for ln in lines if ln and not ln.startswith("#")]
    assert not [ln for ln in samples if "e+" in ln.split()[-1]], text
    weight = daemon.health()["models"]["smollm2"]["mlock"]["weight_bytes"]
    assert weight > 10**6 and f'edge_agent_weight_bytes{{model="smollm2"}} {weight}' in lines
    assert f'edge_agent_build_info{{version="{__version__}"}} 1' in lines
    key = 'edge_agent_prompt_tokens_total{model="smollm2"}'
    prompt = [ln for ln in samples if ln.startswith(key)]
    assert prompt and int(prompt[0].split()[-1]) > 0, text
    for family in ("edge_agent_ttft_seconds", "edge_agent_request_latency_seconds",
                   "edge_agent_batch_size", "edge_agent_step_seconds"):
        assert any(ln.startswith(f'{family}_count{{model="smollm2"}}') for ln in samples), family


# ---- sampling controls, logprobs, stream_options.include_usage ---------------------------------

PROMPT = "The cat sat on the mat. The cat sat on the mat. The cat sat on the"


def _prompt_ids(text: str) -> list[int]:
    """The ids the daemon prefills for a /v1/completions prompt (its tokenizer's encode)."""
    from edge_agent.paths import default_model_path
    from edge_agent.runtime.llama_vocab import LlamaVocab

    return list(LlamaVocab.load(default_model_path()).encode(text))


def _engine_logits(engine: str, state_dir: Path, ids: list[int]) -> Any:
    """(len(ids), V) logits of one full-sequence forward over `ids` on `engine`, in process:
    llama.cpp's own (logits_all), or the numpy engine's model over the prepared f32 copy."""
    import numpy as np

    from edge_agent.paths import default_model_path

    if engine == "numpy":
        from edge_agent.runtime.engines import load_engine
        from edge_agent.runtime.kvcache import BlockTable, blocks_for

        loaded: Any = load_engine("numpy", default_model_path(), state_dir=state_dir,
                                  mlock="off", max_batch=1, context=CONTEXT, threads=1)
        try:
            model = loaded.model
            pool = model.new_pool(blocks_for(len(ids)) + 1)
            table = BlockTable()
            out = model.forward(np.asarray(ids).reshape(1, -1), [table], pool, all_logits=True)
            pool.release(table)
            return np.asarray(out, dtype=np.float64).reshape(len(ids), -1)
        finally:
            loaded.close()
    from llama_cpp import Llama

    llm = Llama(model_path=str(default_model_path()), n_ctx=CONTEXT, n_threads=1,
                verbose=False, logits_all=True, flash_attn=True, swa_full=False)
    try:
        llm.eval(ids)
        return np.array(llm.scores[: len(ids)], dtype=np.float64)  # (L, V)
    finally:
        llm.close()


def _oracle_log_softmax(engine: str, state_dir: Path, ids: list[int]) -> Any:
    """(len(ids), V) log-softmax of `engine`'s own logits over `ids` (an independent run)."""
    import numpy as np

    z = _engine_logits(engine, state_dir, ids)
    m = z.max(axis=1, keepdims=True)
    return z - m - np.log(np.exp(z - m).sum(axis=1, keepdims=True))


def test_completion_logprobs_equal_the_oracle_streamed_and_not(
        client: openai.OpenAI, engine: str, prepared_state_dir: Path) -> None:
    if engine == "llamacpp":
        pytest.importorskip("llama_cpp")
    r = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=8, temperature=0,
                                  logprobs=3)
    lp = r.choices[0].logprobs
    assert r.usage is not None and lp is not None and lp.tokens and lp.token_logprobs
    n = r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs or []) == n
    text = r.choices[0].text
    assert lp.text_offset is not None and lp.text_offset[0] == 0
    assert all(text[at:].startswith(t) for at, t in zip(lp.text_offset, lp.tokens, strict=True))
    prompt = _prompt_ids(PROMPT)
    ids = _prompt_ids(PROMPT + text)
    assert ids[: len(prompt)] == prompt
    # the generated ids re-encode the same
    oracle = _oracle_log_softmax(engine, prepared_state_dir, ids[: len(prompt) + n])
    for i, (got, top) in enumerate(zip(lp.token_logprobs, lp.top_logprobs or [], strict=True)):
        want = oracle[len(prompt) + i - 1]
        assert got == pytest.approx(want[ids[len(prompt) + i]], abs=1e-3)
        assert list(top.values()) == sorted(top.values(), reverse=True) and len(top) == 3
        assert max(top.values()) == pytest.approx(got, abs=1e-9)  # greedy: the chosen is top
    streamed = list(client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=8,
                                              temperature=0, logprobs=3, stream=True))
    got_tokens: list[str] = []
    got_lps: list[float | None] = []
    for chunk in streamed:
        if chunk.choices and chunk.choices[0].logprobs is not None:
            got_tokens += chunk.choices[0].logprobs.tokens or []
            got_lps += chunk.choices[0].logprobs.token_logprobs or []
    assert got_tokens == lp.tokens and got_lps == lp.token_logprobs


def test_chat_logprobs_stop_cut_and_include_usage(client: openai.OpenAI) -> None:
    msgs = [{"role": "user", "content": "Count from 1 to 20, separated by commas."}]
    kw: dict[str, Any] = {"model": "smollm2", "messages": msgs, "temperature": 0,
                          "max_tokens": 40, "logprobs": True, "top_logprobs": 2}
    full = client.chat.completions.create(**kw)
    content = full.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content and full.usage is not None
    assert len(content) == full.usage.completion_tokens
    text = full.choices[0].message.content or ""
    assert b"".join(bytes(c.bytes or []) for c in content).decode() == text
    for c in content:
        assert [t.logprob for t in c.top_logprobs] == sorted(
            (t.logprob for t in c.top_logprobs), reverse=True)
        assert c.top_logprobs[0].token == c.token  # greedy: the chosen token is the likeliest
    # a stop string inside the text: the tokens after the cut lose their logprobs, streamed or not
    stop = text[len(text) // 2: len(text) // 2 + 2]
    assert stop.strip() and stop in text
    cut = client.chat.completions.create(**kw, stop=[stop])
    cut_content = cut.choices[0].logprobs.content  # type: ignore[union-attr]
    cut_text = cut.choices[0].message.content or ""
    assert cut.choices[0].finish_reason == "stop" and cut_text == text[: text.index(stop)]
    assert cut_content is not None and 0 < len(cut_content) < len(content)
    assert [c.token for c in cut_content] == [c.token for c in content[: len(cut_content)]]
    joined = b"".join(bytes(c.bytes or []) for c in cut_content).decode()
    assert joined.startswith(cut_text) and len(joined) - len(cut_text) < len(stop) + 8
    chunks = list(client.chat.completions.create(**kw, stop=[stop], stream=True,
                                                 stream_options={"include_usage": True}))
    streamed = [c for ch in chunks if ch.choices and ch.choices[0].logprobs
                for c in ch.choices[0].logprobs.content or []]
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob)
                                                       for c in cut_content]
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == cut_text
    # include_usage: every chunk has usage null but the last, which has no choices
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == cut.usage.completion_tokens  # type: ignore
    assert chunks[-1].usage.prompt_tokens == cut.usage.prompt_tokens  # type: ignore[union-attr]
    # the streamed usage has prompt_tokens_details as the whole reply's has (the same prompt
    # again: the llama.cpp engine's prompt cache holds some of it, the numpy engine none)
    details = chunks[-1].usage.prompt_tokens_details  # type: ignore[union-attr]
    assert details is not None and isinstance(details.cached_tokens, int)
    assert 0 <= details.cached_tokens <= cut.usage.prompt_tokens  # type: ignore[union-attr]
    assert all(ch.usage is None and ch.choices for ch in chunks[:-1])
    comp = list(client.completions.create(model="smollm2", prompt="Hi", max_tokens=3,
                                          stream=True, stream_options={"include_usage": True}))
    assert comp[-1].choices == [] and comp[-1].usage is not None
    assert comp[-1].usage.total_tokens == comp[-1].usage.prompt_tokens + 3


def test_sampling_controls_through_the_api(client: openai.OpenAI, daemon: Daemon) -> None:
    ids = _prompt_ids(" dog")
    dog = ids[-1]
    r = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=5, temperature=0.9,
                                  seed=3, logit_bias={str(dog): 100})
    assert r.choices[0].text == " dog" * 5
    plain = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=12,
                                      temperature=0)
    greedy_first = _prompt_ids(PROMPT + plain.choices[0].text)[len(_prompt_ids(PROMPT))]
    banned = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=1,
                                       temperature=0, logit_bias={str(greedy_first): -100},
                                       logprobs=0)
    assert banned.choices[0].logprobs is not None
    assert banned.choices[0].logprobs.top_logprobs == [{}]
    assert _prompt_ids(PROMPT + banned.choices[0].text)[len(_prompt_ids(PROMPT))] != greedy_first
    penalized = client.completions.create(
        model="smollm2", prompt=PROMPT, max_tokens=12, temperature=0, presence_penalty=1.5,
        frequency_penalty=0.5, extra_body={"repeat_penalty": 1.3, "repeat_last_n": -1,
                                           "min_p": 0.05, "top_k": 40})
    assert penalized.choices[0].text != plain.choices[0].text
    again = client.completions.create(
        model="smollm2", prompt=PROMPT, max_tokens=12, temperature=0, presence_penalty=1.5,
        frequency_penalty=0.5, extra_body={"repeat_penalty": 1.3, "repeat_last_n": -1,
                                           "min_p": 0.05, "top_k": 40})
    assert again.choices[0].text == penalized.choices[0].text
    for body, param in [({"logit_bias": {"49152": 1}}, "logit_bias.49152"),
                        ({"logit_bias": {"x": 1}}, "logit_bias.x"),
                        ({"logit_bias": {"5": 101}}, "logit_bias.5"),
                        ({"presence_penalty": 2.5}, "presence_penalty"),
                        ({"repeat_penalty": 0}, "repeat_penalty"),
                        ({"min_p": -0.1}, "min_p"),
                        ({"logprobs": 6}, "logprobs")]:
        status, err = daemon.json("POST", "/v1/completions", {"prompt": "x", **body})
        assert status == 400 and err["error"]["param"] == param, (body, err)
        assert "Hint:" in err["error"]["message"]
    for body, param in [({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                        ({"top_logprobs": 2}, "top_logprobs"),
                        ({"logprobs": 1}, "logprobs")]:
        status, err = daemon.json("POST", "/v1/chat/completions", {"messages": STORY, **body})
        assert status == 400 and err["error"]["param"] == param, (body, err)
    status, err = daemon.json("POST", "/v1/requests", {"prompt": "x", "logprobs": 1})
    assert status == 400 and err["error"]["param"] == "logprobs"
