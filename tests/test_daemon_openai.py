"""The OpenAI-compatible surface of a live daemon, through the official `openai` SDK over the
Unix socket and through raw HTTP: limits (no max_tokens: until end-of-sequence or the context;
max_completion_tokens wins), unknown and unsupported fields refused naming them, GET
/v1/models/{id}, POST /tokenize and /detokenize (llama-server's shapes) and /metrics.

Recipe as tests/test_daemon_e2e.py: `python -m edge_agent serve` as a subprocess with the real
default model (tests/daemon_proc.py), one daemon for the module, READY=1 awaited, killed in
`finally`.
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


@pytest.fixture(scope="module")
def daemon(prepared_state_dir: Path) -> Iterator[Daemon]:
    root = Path(tempfile.mkdtemp(prefix="ea-oa-", dir="/tmp"))
    cfg = root / "config.toml"
    cfg.write_text(
        f'[server]\nsocket = "{root / "ea.sock"}"\nstate_dir = "{prepared_state_dir}"\n'
        "drain_timeout_s = 5\n"
        '[runtime]\nmlock = "best-effort"\nthreads = 1\n'
        f"[models.smollm2]\ncontext = {CONTEXT}\nmax_batch = 2\npreload = true\n"
    )
    with launch(Daemon, root, serve_argv(cfg)) as d:
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
                                       max_tokens=2, response_format={"type": "json_object"})
    assert info.value.code == "unsupported_parameter" and info.value.param == "response_format"
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
