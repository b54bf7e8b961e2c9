"""protocol/ollama.py without a daemon: keep_alive durations (Go's time.ParseDuration units),
options onto parse_generation's fields and their errors named `options.NAME`, the load/unload
form of an empty request, and refused fields naming themselves."""

from __future__ import annotations

import json
from typing import Any

import pytest

from edge_agent.protocol.api import UNTIL_CONTEXT, ApiError
from edge_agent.protocol.ollama import (
    KeepAlive,
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
    ({"format": "yaml"}, "format"), ({"tools": [{"type": "function"}]}, "tools"),
    ({"think": True}, "think"), ({"frobnicate": 1}, "frobnicate"),
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


def test_rfc3339_is_utc() -> None:
    assert rfc3339(0.5) == "1970-01-01T00:00:00.500000Z"


def test_format_becomes_the_response_format() -> None:
    assert chat(format="json").generation.response_format == {"type": "json_object"}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    rf = chat(format=schema).generation.response_format
    assert rf["type"] == "json_schema" and rf["json_schema"]["schema"] == schema
    assert chat(format="").generation.response_format is None
