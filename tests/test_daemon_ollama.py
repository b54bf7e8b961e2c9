"""Ollama's API on a live daemon's TCP listener, through the official `ollama` Python client:
chat and generate (streamed and not), list, ps, show, version, keep_alive (0 unloads, a
duration or -1 keeps the model), load/unload by an empty request, bad inputs as
`ollama.ResponseError` with their status, the same tokens as the OpenAI routes at
temperature 0, and a tool call round trip (the call, then the tool's result and the answer)
checked against the OpenAI route given the same conversation.

Recipe as tests/test_daemon_openai.py: `python -m edge_agent serve` as a subprocess with the
real default model (tests/daemon_proc.py), `server.tcp` on a free loopback port, one daemon for
the module, READY=1 awaited, killed in `finally`. The module runs twice, on a daemon of each
engine (the `engine` fixture; numpy serves the session's prepared f32 copy and computes no
embeddings: /api/embed is then checked to refuse, naming the engine).
"""

from __future__ import annotations

import hashlib
import json
import socket
import tempfile
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import httpx
import ollama
import pytest
from daemon_proc import Daemon, launch, serve_argv

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CONTEXT = 512  # room for the tool round trip's conversation
HELLO = [{"role": "user", "content": "Tell me about dragons."}]
GREEDY = {"temperature": 0, "num_predict": 12}


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module", params=["llamacpp", "numpy"])
def engine(request: pytest.FixtureRequest) -> str:
    """Every test of this module runs against a daemon on each engine."""
    return str(request.param)


@pytest.fixture(scope="module")
def daemon(engine: str, request: pytest.FixtureRequest) -> Iterator[Daemon]:
    root = Path(tempfile.mkdtemp(prefix="ea-ol-", dir="/tmp"))
    cfg = root / "config.toml"
    port = _free_port()
    # llama.cpp reads the GGUF itself (an empty state dir); numpy the prepared f32 copy
    state = (request.getfixturevalue("prepared_state_dir") if engine == "numpy"
             else root / "state")
    cfg.write_text(
        f'[server]\nsocket = "{root / "ea.sock"}"\nstate_dir = "{state}"\n'
        f'tcp = "127.0.0.1:{port}"\ndrain_timeout_s = 5\n'
        f'[runtime]\nengine = "{engine}"\nmlock = "off"\nthreads = 1\n'
        f"[models.smollm2]\ncontext = {CONTEXT}\nmax_batch = 2\npreload = true\n"
        'pooling = "mean"\n'  # /api/embed
    )
    with launch(Daemon, root, serve_argv(cfg)) as d:
        assert d.health()["models"]["smollm2"]["engine"] == engine
        d.port = port  # type: ignore[attr-defined]  # this test's own note on the Daemon
        yield d


@pytest.fixture(scope="module")
def base(daemon: Daemon) -> str:
    return f"http://127.0.0.1:{daemon.port}"  # type: ignore[attr-defined]  # set by the fixture above


@pytest.fixture(scope="module")
def client(base: str) -> Iterator[Any]:
    c = ollama.Client(host=base, timeout=240)
    yield c
    c.close()


def _error(exc: pytest.ExceptionInfo[Any]) -> tuple[int, str]:
    return exc.value.status_code, str(exc.value.error)


def _ts(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def _check_stats(r: Any) -> None:
    """The final object's statistics: integers of nanoseconds, consistent with each other."""
    assert r.done is True and r.done_reason in ("stop", "length")
    for key in ("total_duration", "load_duration", "prompt_eval_duration", "eval_duration",
                "prompt_eval_count", "eval_count"):
        assert isinstance(r[key], int) and r[key] >= 0, key
    assert r.prompt_eval_count > 0 and r.eval_count > 0
    assert r.total_duration >= r.prompt_eval_duration + r.eval_duration
    assert abs(_ts(r.created_at) - datetime.now(timezone.utc)) < timedelta(minutes=5)


def test_chat_streamed_and_not_give_the_same_reply(client: Any) -> None:
    whole = client.chat(model="smollm2", messages=HELLO, options=GREEDY)
    assert whole.model == "smollm2" and whole.message.role == "assistant"
    assert whole.message.content
    _check_stats(whole)
    assert whole.eval_count <= 12
    assert (whole.done_reason == "length") == (whole.eval_count == 12)
    parts = list(client.chat(model="smollm2", messages=HELLO, options=GREEDY, stream=True))
    assert all(p.done is False for p in parts[:-1]) and parts[-1].done is True
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert parts[-1].message.content == ""
    _check_stats(parts[-1])
    assert (parts[-1].eval_count, parts[-1].prompt_eval_count) == (
        whole.eval_count, whole.prompt_eval_count)
    # ":latest" is the same model, as Ollama names it
    again = client.chat(model="smollm2:latest", messages=HELLO, options=GREEDY)
    assert again.message.content == whole.message.content and again.model == "smollm2:latest"


def test_same_tokens_as_the_openai_routes(client: Any, daemon: Daemon) -> None:
    chat = client.chat(model="smollm2", messages=HELLO, options=GREEDY)
    status, oa = daemon.json("POST", "/v1/chat/completions", {
        "model": "smollm2", "messages": HELLO, "temperature": 0, "max_tokens": 12})
    assert status == 200, oa
    assert chat.message.content == oa["choices"][0]["message"]["content"]
    assert chat.eval_count == oa["usage"]["completion_tokens"]
    assert chat.prompt_eval_count == oa["usage"]["prompt_tokens"]
    # /api/generate: the prompt as a user turn through the chat template, like chat
    gen = client.generate(model="smollm2", prompt=HELLO[0]["content"], options=GREEDY)
    assert gen.response == chat.message.content and gen.done_reason == chat.done_reason
    _check_stats(gen)
    # raw: the prompt as is, like /v1/completions
    raw = client.generate(model="smollm2", prompt="The capital of France is", raw=True,
                          options=GREEDY)
    status, oa = daemon.json("POST", "/v1/completions", {
        "model": "smollm2", "prompt": "The capital of France is", "temperature": 0,
        "max_tokens": 12})
    assert status == 200 and raw.response == oa["choices"][0]["text"]
    streamed = client.generate(model="smollm2", prompt="The capital of France is", raw=True,
                               options=GREEDY, stream=True)
    assert "".join(p.response for p in streamed) == raw.response
    # a system message reaches the template: a different prompt than without it
    sys = client.generate(model="smollm2", prompt=HELLO[0]["content"], system="Be brief.",
                          options=GREEDY)
    assert sys.prompt_eval_count != gen.prompt_eval_count


def test_list_show_version_and_root(client: Any, base: str) -> None:
    from gguf import GGUFReader, LlamaFileType

    from edge_agent.paths import default_model_path

    path = default_model_path()
    reader = GGUFReader(path)
    params = sum(int(t.n_elements) for t in reader.tensors)
    ftype = int(reader.fields["general.file_type"].parts[-1][0])
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    template = bytes(reader.fields["tokenizer.chat_template"].parts[-1]).decode()

    models = client.list().models
    assert [m.model for m in models] == ["smollm2"]
    m = models[0]
    assert m.size == path.stat().st_size
    assert m.digest == hashlib.sha256(path.read_bytes()).hexdigest()
    d = m.details
    assert (d.format, d.family, d.families) == ("gguf", arch, [arch])
    assert d.quantization_level == LlamaFileType(ftype).name.removeprefix("MOSTLY_")
    assert d.parameter_size == f"{params / 1e6:.2f}M"  # a 135M model: Ollama's 2 decimals
    assert m.modified_at is not None

    show = client.show("smollm2")
    assert show.details == d and show.template == template
    assert show.modelinfo["general.architecture"] == arch
    assert show.modelinfo["general.parameter_count"] == params
    assert show.modelinfo[f"{arch}.context_length"] > 0
    assert "tokenizer.ggml.tokens" not in show.modelinfo
    assert show.capabilities == ["completion", "tools"]
    assert f"num_ctx {CONTEXT}" in show.parameters

    with httpx.Client(base_url=base) as h:
        r = h.get("/api/version")
        assert r.status_code == 200 and isinstance(r.json()["version"], str)
        assert h.head("/").status_code == 200
        r = h.get("/")
        assert r.status_code == 200 and r.text == "Ollama is running"


def test_keep_alive_and_load_unload(client: Any) -> None:
    def loaded() -> list[Any]:
        return list(client.ps().models)

    def wait_unloaded() -> None:
        end = time.monotonic() + 60
        while loaded():
            assert time.monotonic() < end, loaded()
            time.sleep(0.1)

    r = client.chat(model="smollm2", messages=HELLO, options={"num_predict": 2}, keep_alive=0)
    assert r.done is True
    wait_unloaded()  # unloaded right after the request, not after the configured ttl_s

    # an empty request loads the model; keep_alive sets when it expires
    r = client.generate(model="smollm2", keep_alive="10m")
    assert (r.done, r.done_reason, r.response) == (True, "load", "")
    (p,) = loaded()
    assert p.model == "smollm2" and p.context_length == CONTEXT and p.size > 0
    assert p.details.format == "gguf" and p.size_vram == 0
    now = datetime.now(timezone.utc)
    assert now + timedelta(minutes=8) < p.expires_at < now + timedelta(minutes=11)
    r = client.chat(model="smollm2", messages=[], keep_alive=-1)
    assert (r.done_reason, r.message.content) == ("load", "")
    assert loaded()[0].expires_at.year == 9999  # stays loaded

    # an empty request with keep_alive 0 unloads, and answers once it is unloaded
    r = client.generate(model="smollm2", keep_alive=0)
    assert (r.done, r.done_reason) == (True, "unload")
    assert loaded() == []
    r = client.chat(model="smollm2", messages=HELLO, options=GREEDY)  # loads again on demand
    assert r.load_duration > 0 and r.message.content
    assert loaded()[0].model == "smollm2"


def test_bad_inputs_are_response_errors_with_their_status(client: Any, base: str) -> None:
    with pytest.raises(ollama.ResponseError) as info:
        client.chat(model="nope", messages=HELLO)
    status, text = _error(info)
    assert status == 404 and "'nope' not found" in text and "smollm2" in text
    with pytest.raises(ollama.ResponseError) as info:
        list(client.chat(model="nope", messages=HELLO, stream=True))
    assert info.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as info:
        client.chat(model="smollm2", messages=HELLO, options={"temperature": 5})
    status, text = _error(info)
    assert status == 400 and "'options.temperature'" in text and "Hint:" in text
    with pytest.raises(ollama.ResponseError) as info:
        client.generate(model="smollm2", prompt="Hi", options={"temprature": 0})
    status, text = _error(info)
    assert status == 400 and "'options.temprature'" in text and "options.temperature" in text
    with pytest.raises(ollama.ResponseError) as info:
        client.chat(model="smollm2", messages=HELLO, options={"mirostat": 2})
    status, text = _error(info)
    assert status == 400 and "'options.mirostat'" in text and "not supported" in text
    with pytest.raises(ollama.ResponseError) as info:
        client.chat(model="smollm2", messages=HELLO,
                    format={"type": "object", "minProperties": "x"})
    status, text = _error(info)
    assert status == 400 and "'format'" in text
    with pytest.raises(ollama.ResponseError) as info:
        client.generate(model="smollm2", prompt="Hi", template="{{ .Prompt }}")
    status, text = _error(info)
    assert status == 400 and "'template'" in text and "raw" in text
    with pytest.raises(ollama.ResponseError) as info:
        client.chat(model="smollm2", messages=[{"role": "robot", "content": "x"}])
    assert _error(info)[0] == 400 and "messages[0].role" in _error(info)[1]
    # the runtime knobs the configuration owns are accepted and ignored
    r = client.chat(model="smollm2", messages=HELLO,
                    options={**GREEDY, "num_ctx": 4096, "num_thread": 2, "num_gpu": 0})
    assert r.done is True

    with httpx.Client(base_url=base) as h:
        r = h.post("/api/generate", json={"model": "smollm2", "prompt": "Hi",
                                          "images": ["aGk="]})
        assert r.status_code == 400 and "'images'" in r.json()["error"]
        r = h.post("/api/chat", json={"model": "smollm2", "messages": HELLO, "format": "yaml"})
        assert r.status_code == 400 and "'format'" in r.json()["error"]
        assert "JSON Schema" in r.json()["error"]
        r = h.post("/api/chat", content=b"{not json")
        assert r.status_code == 400 and set(r.json()) == {"error"}
        r = h.get("/api/chat")  # Ollama's error shape for every /api/ path
        assert r.status_code == 405 and "POST" in r.json()["error"]
        r = h.post("/api/pull", json={"model": "smollm2"})  # no model store here
        assert r.status_code == 404 and "/api/embed" in r.json()["error"]
        r = h.post("/api/embed", json={"model": "smollm2", "input": ["x", ""]})
        assert r.status_code == 400 and "'input'" in r.json()["error"]
        r = h.post("/api/embed", json={"model": "smollm2", "input": "x", "truncate": False,
                                       "frobnicate": 1})
        assert r.status_code == 400 and "'frobnicate'" in r.json()["error"]
        r = h.post("/api/generate", json={"model": "smollm2", "prompt": "Hi",
                                          "keep_alive": "soon"})
        assert r.status_code == 400 and "'keep_alive'" in r.json()["error"]
        r = h.post("/api/show", json={"model": "nope"})
        assert r.status_code == 404 and json.loads(r.text)["error"]


def test_format_constrains_the_reply_to_json_and_to_a_schema(client: Any) -> None:
    import jsonschema

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer", "minimum": 0,
                                                       "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    ask = [{"role": "user", "content": "Describe a person as JSON with a name and an age."}]
    replies = [client.chat(model="smollm2", messages=ask, format=schema,
                           options={"temperature": 0, "num_predict": 64}) for _ in range(2)]
    assert replies[0].message.content == replies[1].message.content  # deterministic at 0
    jsonschema.validate(json.loads(replies[0].message.content), schema)
    short = {"type": "object", "properties": {"sea": {"type": "string", "maxLength": 24}},
             "required": ["sea"], "additionalProperties": False}
    out = client.generate(model="smollm2", prompt="Reply with a JSON object about the sea.",
                          format=short, options={"temperature": 0, "num_predict": 48})
    jsonschema.validate(json.loads(out.response), short)


# as the client sends it (its Tool model keeps these keys, in this order), so the OpenAI route
# given the same dict renders the same prompt
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "required": ["city"],
                   "properties": {"city": {"type": "string"}}}}}


def _asked(city: str, result: str) -> list[dict[str, Any]]:
    """One earlier exchange: the question, the call, its result, the answer (SmolLM2 135M
    follows the pattern, so `auto` makes the call: the model is too weak to without)."""
    return [{"role": "user", "content": f"What is the weather in {city}?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"function": {"name": "get_weather", "arguments": {"city": city}}}]},
            {"role": "tool", "content": result, "tool_name": "get_weather"},
            {"role": "assistant", "content": f"It is {result} in {city}."}]


ASK = [*_asked("Oslo", "5 degrees, rain"), *_asked("Rome", "25 degrees, sunny"),
       {"role": "user", "content": "What is the weather in Paris?"}]
TOOL_GREEDY = {"temperature": 0, "num_predict": 60}


def _openai_form(messages: list[Any]) -> list[dict[str, Any]]:
    """The same conversation for /v1/chat/completions: arguments as JSON strings, the ids
    Ollama's form gets (`call_I_J`, docs/api.md), tool messages by tool_call_id."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        m = dict(m)
        if m.get("tool_calls"):
            out.append({"role": "assistant", "content": m.get("content") or None, "tool_calls": [
                {"id": f"call_{i}_{j}", "type": "function", "function": {
                    "name": c["function"]["name"],
                    "arguments": json.dumps(dict(c["function"]["arguments"]))}}
                for j, c in enumerate(m["tool_calls"])]})
        elif m["role"] == "tool":
            asked = next(k for k in range(i - 1, -1, -1) if out[k].get("tool_calls"))
            out.append({"role": "tool", "tool_call_id": f"call_{asked}_0",
                        "content": m["content"]})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    return out


def _oracle(daemon: Daemon, messages: list[Any]) -> dict[str, Any]:
    status, oa = daemon.json("POST", "/v1/chat/completions", {
        "model": "smollm2", "messages": _openai_form(messages), "tools": [WEATHER],
        "temperature": 0, "max_tokens": TOOL_GREEDY["num_predict"]})
    assert status == 200, oa
    return dict(oa)


def test_tool_call_round_trip(client: Any, daemon: Daemon, base: str) -> None:
    import jsonschema

    r = client.chat(model="smollm2", messages=ASK, tools=[WEATHER], options=TOOL_GREEDY)
    assert r.message.tool_calls, r.message  # the pattern above makes the call
    assert (r.message.content, r.done, r.done_reason) == ("", True, "stop")
    (call,) = r.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(dict(call.function.arguments), WEATHER["function"]["parameters"])
    # the oracle: the OpenAI route parses the same call out of the same tokens
    oa = _oracle(daemon, ASK)
    (oa_call,) = oa["choices"][0]["message"]["tool_calls"]
    assert (oa_call["function"]["name"], json.loads(oa_call["function"]["arguments"])) == (
        call.function.name, dict(call.function.arguments))
    assert (r.eval_count, r.prompt_eval_count) == (oa["usage"]["completion_tokens"],
                                                     oa["usage"]["prompt_tokens"])
    # on the wire: Ollama's shape, arguments an object
    with httpx.Client(base_url=base, timeout=240) as h:
        raw = h.post("/api/chat", json={"model": "smollm2", "messages": ASK,
                                         "tools": [WEATHER], "options": TOOL_GREEDY,
                                         "stream": False}).json()
    (wire,) = raw["message"]["tool_calls"]
    assert wire["function"] == {"index": 0, "name": "get_weather",
                                "arguments": dict(call.function.arguments)}
    assert isinstance(wire["id"], str) and wire["id"].startswith("call_")

    # streamed: the calls in one object before the final one, no text
    parts = list(client.chat(model="smollm2", messages=ASK, tools=[WEATHER],
                             options=TOOL_GREEDY, stream=True))
    assert [p.done for p in parts] == [False, True]
    assert parts[0].message.tool_calls == r.message.tool_calls
    assert parts[0].message.content == parts[1].message.content == ""
    assert (parts[1].done_reason, parts[1].eval_count) == ("stop", r.eval_count)

    # the result goes back as a tool message; the answer is text, as the OpenAI route's
    done = [*ASK, r.message, {"role": "tool", "content": "18 degrees, sunny",
                              "tool_name": call.function.name}]
    answer = client.chat(model="smollm2", messages=done, tools=[WEATHER], options=TOOL_GREEDY)
    assert answer.message.content and not answer.message.tool_calls
    oa = _oracle(daemon, [*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": call.function.name,
                      "arguments": dict(call.function.arguments)}}]}, done[-1]])
    assert answer.message.content == oa["choices"][0]["message"]["content"]
    assert answer.prompt_eval_count == oa["usage"]["prompt_tokens"]
    parts = list(client.chat(model="smollm2", messages=done, tools=[WEATHER],
                             options=TOOL_GREEDY, stream=True))
    assert "".join(p.message.content for p in parts) == answer.message.content
    assert len(parts) > 2 and parts[-1].message.content == ""  # streamed as it came
    assert not any(p.message.tool_calls for p in parts)


def test_a_call_cut_short(client: Any, daemon: Daemon) -> None:
    """A reply that ends inside a call's arguments: the OpenAI route gives the call with the
    arguments written so far and finish_reason "length", as OpenAI does; Ollama's calls carry
    an object, so its routes leave the call out (content "", done_reason "length"), streamed
    or not."""
    full = _oracle(daemon, ASK)["choices"][0]["message"]["tool_calls"][0]["function"]
    head = '{"name": "get_weather", "arguments": {"'
    status, ids = daemon.json("POST", "/tokenize", {"model": "smollm2", "content": head})
    assert status == 200, ids
    n = len(ids["tokens"]) + 1  # the call made, its arguments begun, not ended
    status, oa = daemon.json("POST", "/v1/chat/completions", {
        "model": "smollm2", "messages": _openai_form(ASK), "tools": [WEATHER],
        "temperature": 0, "max_tokens": n})
    assert status == 200, oa
    choice = oa["choices"][0]
    (call,) = choice["message"]["tool_calls"]
    args = call["function"]["arguments"]
    assert choice["finish_reason"] == "length" and call["function"]["name"] == "get_weather"
    assert args.startswith("{") and full["arguments"].startswith(args) and args != full[
        "arguments"], (args, full)
    cut = dict(TOOL_GREEDY, num_predict=n)
    r = client.chat(model="smollm2", messages=ASK, tools=[WEATHER], options=cut)
    assert (r.message.content, r.message.tool_calls, r.done_reason) == ("", None, "length")
    parts = list(client.chat(model="smollm2", messages=ASK, tools=[WEATHER], options=cut,
                             stream=True))
    assert not any(p.message.tool_calls or p.message.content for p in parts), parts
    assert parts[-1].done_reason == "length"


def test_bad_tools_are_400s_naming_the_field(client: Any, base: str) -> None:
    with pytest.raises(ollama.ResponseError) as info:
        client.chat(model="smollm2", messages=HELLO,
                    tools=[{"type": "function", "function": {"name": "get weather"}}])
    status, text = _error(info)
    assert status == 400 and "'tools[0].function.name'" in text and "Hint:" in text
    with httpx.Client(base_url=base) as h:
        for body, field in (
                ({"tools": {"type": "function"}}, "'tools'"),
                ({"tools": [{"type": "retrieval"}]}, "'tools[0].type'"),
                ({"tools": [WEATHER], "tool_choice": "auto"}, "'tool_choice'"),
                ({"messages": [*HELLO, {"role": "assistant", "tool_calls": [
                    {"function": {"name": "f", "arguments": "{}"}}]}]},
                 "'messages[1].tool_calls[0].function.arguments'")):
            r = h.post("/api/chat", json={"model": "smollm2", "messages": HELLO, **body})
            assert r.status_code == 400 and field in r.json()["error"], r.text
        r = h.post("/api/generate", json={"model": "smollm2", "prompt": "Hi",
                                          "tools": [WEATHER]})
        assert r.status_code == 400 and "'tools'" in r.json()["error"]  # chat only


def test_embed_matches_the_openai_route(client: Any, daemon: Daemon, engine: str) -> None:
    import math

    texts = ["The cat sat on the mat.", "Boards run models at the edge."]
    if engine == "numpy":  # refused before any load, as the OpenAI route refuses it
        with pytest.raises(ollama.ResponseError) as info:
            client.embed(model="smollm2", input=texts)
        status, text = _error(info)
        assert status == 400 and "engine numpy computes no embeddings" in text, text
        assert "Hint:" in text
        status, body = daemon.json("POST", "/v1/embeddings", {"model": "smollm2",
                                                              "input": texts})
        assert status == 400 and body["error"]["message"] == text, body
        pytest.skip("engine numpy computes no embeddings (the refusal is checked above): the "
                    "vectors, their norms and truncation are the llamacpp engine's")
    r = client.embed(model="smollm2", input=texts)
    assert len(r.embeddings) == 2 and r.prompt_eval_count > 0
    for v in r.embeddings:
        assert math.isclose(math.sqrt(sum(x * x for x in v)), 1.0, rel_tol=1e-4)
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(daemon.sock)),
                      base_url="http://localhost") as h:
        ref = h.post("/v1/embeddings", json={"model": "smollm2", "input": texts},
                     timeout=240).json()
    assert r.prompt_eval_count == ref["usage"]["prompt_tokens"]
    for got, want in zip(r.embeddings, ref["data"], strict=True):
        assert max(abs(a - b) for a, b in zip(got, want["embedding"], strict=True)) < 1e-6
    legacy = client.embeddings(model="smollm2:latest", prompt=texts[0])
    assert max(abs(a - b) for a, b in zip(legacy.embedding, r.embeddings[0], strict=True)) < 1e-6
    # truncate (Ollama's default) cuts an input to the context; truncate false refuses it
    long = "word " * (CONTEXT * 2)
    assert len(client.embed(model="smollm2", input=long).embeddings) == 1
    with pytest.raises(ollama.ResponseError) as info:
        client.embed(model="smollm2", input=long, truncate=False)
    status, text = _error(info)
    assert status == 400 and "context" in text
