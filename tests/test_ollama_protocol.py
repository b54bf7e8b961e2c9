"""protocol/ollama.py without a daemon: keep_alive durations (Go's time.ParseDuration units),
options onto parse_generation's fields and their errors named `options.NAME`, the load/unload
form of an empty request, refused fields naming themselves, and tool calling mapped both ways
(Ollama's `tools`, assistant `tool_calls` and `tool` messages onto the fields
daemon/structured.py reads; a reply's calls back in Ollama's shape), checked against the
OpenAI route's parser and the prompt daemon/structured.py renders with the real tokenizer."""

from __future__ import annotations

import json
from typing import Any

import pytest

from edge_agent.daemon.structured import chat_prompt, tool_calls
from edge_agent.protocol.api import UNTIL_CONTEXT, ApiError, parse_generation
from edge_agent.protocol.ollama import (
    KeepAlive,
    final,
    ollama_tool_calls,
    parse_chat,
    parse_generate,
    parse_keep_alive,
    rfc3339,
)

HI = [{"role": "user", "content": "Hi"}]


def chat(**body: Any) -> Any:
    return parse_chat(json.dumps({"model": "m", "messages": HI, **body}).encode(),
                      max_tokens_limit=100)


@pytest.mark.parametrize(("value", "seconds"), [
    ("5m", 300.0), ("1h30m", 5400.0), ("1.5h", 5400.0), ("300ms", 0.3), ("0", 0.0), (0, 0.0),
    (300, 300.0), ("300", 300.0), (2.5, 2.5), ("-1", None), (-1, None), ("-5m", None),
])
def test_keep_alive_values(value: Any, seconds: float | None) -> None:
    assert parse_keep_alive(value) == KeepAlive(seconds)


@pytest.mark.parametrize("value", ["soon", "5 m", "m", "", True, [1], "1d"])
def test_bad_keep_alive_names_the_field(value: Any) -> None:
    with pytest.raises(ApiError) as info:
        parse_keep_alive(value)
    assert info.value.param == "keep_alive" and "Hint:" in info.value.message


def test_options_map_onto_sampling_with_ollamas_defaults() -> None:
    g = chat().generation
    assert (g.temperature, g.top_k, g.top_p, g.max_tokens, g.seed) == (0.8, 40, 0.9,
                                                                       UNTIL_CONTEXT, None)
    g = chat(options={"temperature": 0, "top_k": 5, "top_p": 0.5, "seed": 7, "num_predict": 9,
                      "stop": ["\n"], "num_ctx": 4096}).generation
    assert (g.temperature, g.top_k, g.top_p, g.seed, g.max_tokens, g.stop) == (
        0.0, 5, 0.5, 7, 9, ("\n",))
    assert chat(options={"seed": -1, "num_predict": -1}).generation.seed is None
    assert chat(options={"num_predict": -2}).generation.max_tokens == UNTIL_CONTEXT
    # the tool role reaches the template like the others
    g = chat(messages=[*HI, {"role": "tool", "content": "42", "tool_name": "f"}]).generation
    assert [m.role for m in g.messages] == ["user", "tool"]


@pytest.mark.parametrize(("options", "param", "words"), [
    ({"temperature": 3}, "options.temperature", "out of range"),
    ({"top_p": 0}, "options.top_p", "out of range"),
    ({"num_predict": 101}, "options.num_predict", "-2..100"),
    ({"stop": 5}, "options.stop", "list of strings"),
    ({"temprature": 1}, "options.temprature", "options.temperature"),
    ({"mirostat": 1}, "options.mirostat", "not supported"),
    ({"num_ctx": "big"}, "options.num_ctx", "an integer"),
])
def test_bad_options_name_the_option(options: dict[str, Any], param: str, words: str) -> None:
    with pytest.raises(ApiError) as info:
        chat(options=options)
    assert info.value.status == 400 and info.value.param == param
    assert f"'{param}'" in info.value.message and words in info.value.message


@pytest.mark.parametrize(("body", "param"), [
    ({"format": "yaml"}, "format"), ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"think": "max"}, "think"), ({"think": 1}, "think"), ({"frobnicate": 1}, "frobnicate"),
    ({"messages": [{"role": "user", "content": "x", "images": ["aGk="]}]}, "messages[0].images"),
    ({"messages": [{"role": "user", "content": 1}]}, "messages[0].content"),
    ({"stream": "yes"}, "stream"),
])
def test_refused_fields_name_themselves(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as info:
        chat(**body)
    assert info.value.status == 400 and info.value.param == param
    # the neutral values change nothing and pass
    chat(format="", tools=[], think=False, logprobs=False, top_logprobs=0)


def test_empty_requests_load_or_unload() -> None:
    r = parse_chat(b'{"model": "m", "messages": [], "keep_alive": 0}', max_tokens_limit=9)
    assert r.generation is None and r.keep_alive == KeepAlive(0.0) and r.chat
    r = parse_generate(b'{"model": "m"}', max_tokens_limit=9)
    assert r.generation is None and r.keep_alive is None and not r.chat


def test_generate_prompt_system_raw() -> None:
    g = parse_generate(b'{"model": "m", "prompt": "Hi", "system": "Be brief."}',
                       max_tokens_limit=9).generation
    assert g.chat and [(m.role, m.content) for m in g.messages] == [
        ("system", "Be brief."), ("user", "Hi")]
    g = parse_generate(b'{"model": "m", "prompt": "Hi", "raw": true}',
                       max_tokens_limit=9).generation
    assert not g.chat and g.prompt == "Hi"
    for body in (b'{"model": "m", "prompt": "Hi", "raw": true, "system": "x"}',
                 b'{"model": "m", "prompt": "Hi", "template": "{{ .Prompt }}"}',
                 b'{"model": "m", "prompt": "Hi", "context": [1, 2]}'):
        with pytest.raises(ApiError) as info:
            parse_generate(body, max_tokens_limit=9)
        assert info.value.status == 400 and "Hint:" in info.value.message
    for think in (b"true", b"false"):  # no template opens or closes a raw prompt's thought
        with pytest.raises(ApiError) as info:
            parse_generate(b'{"model": "m", "prompt": "Hi", "raw": true, "think": %s}' % think,
                           max_tokens_limit=9)
        assert info.value.param == "think" and 'drop "think"' in info.value.message
    g = parse_generate(b'{"model": "m", "prompt": "Hi", "think": false}',
                       max_tokens_limit=9).generation
    assert g.chat and g.template_vars == {"enable_thinking": False}


@pytest.mark.parametrize("level", ["high", "medium", "low"])
def test_a_think_level_turns_thinking_on(level: str) -> None:
    """Ollama's levels are "thinking on" for a model that has none (Ollama's ThinkValue.Bool)."""
    r = chat(think=level)
    assert r.think is True and r.generation is not None
    assert r.generation.template_vars is None  # enable_thinking stays the default, true
    g = parse_generate(json.dumps({"model": "m", "prompt": "Hi", "think": level}).encode(),
                       max_tokens_limit=9)
    assert g.think is True


def test_an_assistants_thinking_is_its_reasoning() -> None:
    said = {"role": "assistant", "content": "4", "thinking": "2+2"}
    r = chat(messages=[*HI, said])
    assert [m.reasoning for m in r.generation.messages] == [None, "2+2"]
    for messages, where in (([{**HI[0], "thinking": "x"}], "messages[0].thinking"),
                            ([*HI, {**said, "thinking": 4}], "messages[1].thinking")):
        with pytest.raises(ApiError) as info:
            chat(messages=messages)
        assert info.value.param == where and "Hint:" in info.value.message


def test_rfc3339_is_utc() -> None:
    assert rfc3339(0.5) == "1970-01-01T00:00:00.500000Z"


def test_format_becomes_the_response_format() -> None:
    assert chat(format="json").generation.response_format == {"type": "json_object"}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    rf = chat(format=schema).generation.response_format
    assert rf["type"] == "json_schema" and rf["json_schema"]["schema"] == schema
    assert chat(format="").generation.response_format is None


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {}}}
# a conversation as the official client sends it back: the reply's message, then the results
HISTORY = [
    {"role": "user", "content": "Weather and time in Oslo?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}},
        {"function": {"name": "get_time", "arguments": {}}}]},
    {"role": "tool", "content": "12:00", "tool_name": "get_time"},
    {"role": "tool", "content": "5 degrees", "tool_name": "get_weather"},
]


def test_tools_are_the_openai_routes_tools_with_tool_choice_auto() -> None:
    g = chat(tools=[WEATHER]).generation
    oa = parse_generation({"messages": HI, "tools": [WEATHER]}, chat=True, max_tokens_limit=9)
    assert (g.tools, g.tool_choice) == (oa.tools, oa.tool_choice) == (oa.tools, "auto")
    assert g.stream is True  # streamed with tools: held until the end (daemon/ollama.py)
    assert chat(tools=[WEATHER], stream=False).generation.stream is False
    assert chat(tools=[]).generation.tools is None


def test_tool_turns_map_onto_openais_fields() -> None:
    g = chat(messages=HISTORY, tools=[WEATHER, CLOCK]).generation
    user, asked, time_, weather = g.messages
    assert asked.role == "assistant" and asked.content == ""
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in asked.tool_calls] == [("function", "get_weather", {"city": "Oslo"}),
                                           ("function", "get_time", {})]
    ids = [c["id"] for c in asked.tool_calls]
    assert len(set(ids)) == 2
    # each result answers the call of its tool_name, whatever the order
    assert (time_.tool_call_id, weather.tool_call_id) == (ids[1], ids[0])
    # without tool_name: the oldest unanswered call; an id sent back is kept and names its call
    g = chat(messages=[HISTORY[0], {**HISTORY[1], "tool_calls": [
        {"id": "call_x", **HISTORY[1]["tool_calls"][0]}, HISTORY[1]["tool_calls"][1]]},
        {"role": "tool", "content": "12:00", "tool_call_id": "call_1_1"},
        {"role": "tool", "content": "5 degrees"},
        {"role": "tool", "content": "late", "tool_name": "get_weather"}]).generation
    assert [c["id"] for c in g.messages[1].tool_calls] == ["call_x", "call_1_1"]
    assert [m.tool_call_id for m in g.messages[2:]] == ["call_1_1", "call_x", None]


def test_a_reply_s_calls_go_back_in_ollamas_shape_and_round_trip() -> None:
    g = chat(tools=[WEATHER]).generation
    oa_calls = tool_calls(g, '{"name": "get_weather", "arguments": {"city": "Paris"}}',
                          "req-abc")
    calls = ollama_tool_calls(oa_calls)
    assert calls == [{"id": oa_calls[0]["id"], "function": {
        "index": 0, "name": "get_weather", "arguments": {"city": "Paris"}}}]
    body = final(chat=True, model="m", now=0.0, text="", done_reason="stop", stats=None,
                 tool_calls=calls)
    assert body["message"] == {"role": "assistant", "content": "", "tool_calls": calls}
    assert (body["done"], body["done_reason"]) == (True, "stop")
    assert tool_calls(g, "It is sunny.", "req-abc") is None  # text stays text
    # a call whose arguments are not an object (cut short, a list) is left out; the rest are
    # indexed from where the reply's earlier calls left off
    cut = [{"id": "a", "function": {"name": "f", "arguments": '{"city": "Os'}},
           {"id": "b", "function": {"name": "f", "arguments": "[1]"}},
           {"id": "c", "function": {"name": "f", "arguments": '{"city": "Oslo"}'}}]
    assert ollama_tool_calls(cut, start=2) == [{"id": "c", "function": {
        "index": 2, "name": "f", "arguments": {"city": "Oslo"}}}]
    # the reply's message sent back as is: the same calls as the OpenAI route would keep
    again = chat(messages=[*HI, body["message"]], tools=[WEATHER]).generation.messages[1]
    assert again.tool_calls == tuple(oa_calls)


def test_tool_turns_reach_the_prompt(tokenizer: Any) -> None:
    """SmolLM2's template renders no tools: the calls as their JSON text, the results as user
    turns naming the call they answer (daemon/structured.py)."""
    g = chat(messages=[*HISTORY, {"role": "tool", "content": "orphan"}],
             tools=[WEATHER, CLOCK]).generation
    text = tokenizer.decode(chat_prompt(g, tokenizer))
    ids = [c["id"] for c in g.messages[1].tool_calls]
    assert '{"name": "get_weather", "arguments": {"city": "Oslo"}}' in text
    assert f"Result of get_time (call {ids[1]}): 12:00" in text
    assert f"Result of get_weather (call {ids[0]}): 5 degrees" in text
    assert "Result of the function: orphan" in text
    assert '"name": "get_time"' in text.split("Weather and time")[0]  # offered before the turn


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"tools": {"name": "f"}}, "tools", "a list"),
    ({"tools": [{"function": {"name": "f"}}]}, "tools[0].type", '"function"'),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name", "twice"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]},
     "tools[0].function.name", "1..64"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
     "tools[0].function.parameters", "JSON Schema"),
    ({"tools": [WEATHER], "tool_choice": "required"}, "tool_choice", "unknown parameter"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"function": {"name": "f", "arguments": {}}}]}]}, "messages[0].tool_calls",
     "only assistant"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "f", "arguments": '{"a": 1}'}}]}]},
     "messages[0].tool_calls[0].function.arguments", "JSON object"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"arguments": {}}}]}]},
     "messages[0].tool_calls[0].function", '"name"'),
    ({"messages": [{"role": "assistant", "tool_calls": [
        {"function": {"name": "f", "args": {}}}]}]},
     "messages[0].tool_calls[0].function.args", "unknown field"),
    ({"messages": [{"role": "tool", "content": "1", "tool_name": 3}]},
     "messages[0].tool_name", "a string"),
])
def test_bad_tools_name_the_field(body: dict[str, Any], param: str, words: str) -> None:
    with pytest.raises(ApiError) as info:
        chat(**body)
    assert info.value.status == 400 and info.value.param == param, info.value.message
    assert words in info.value.message and "Hint:" in info.value.message


def test_embed_requests_map_onto_the_embeddings_request() -> None:
    from edge_agent.protocol.ollama import parse_embed

    e = parse_embed(b'{"model": "m:latest", "input": ["a", "b"], "truncate": false}')
    assert e.request.inputs == ("a", "b") and e.request.truncate is False and not e.legacy
    one = parse_embed(b'{"model": "m", "prompt": "a"}', legacy=True)
    assert one.request.inputs == ("a",) and one.request.single and one.request.truncate
    for body, param in ((b'{"model": "m", "input": []}', "input"),
                        (b'{"model": "m", "input": 3}', "input"),
                        (b'{"model": "m", "input": "a", "prompt": "b"}', "prompt"),
                        (b'{"model": "m", "input": "a", "dimensions": 0}', "dimensions"),
                        (b'{"model": "m", "input": "a", "options": 1}', "options")):
        with pytest.raises(ApiError) as info:
            parse_embed(body)
        assert info.value.status == 400 and info.value.param == param, body
