"""Constrained decoding (runtime/constrain.py) and what the API builds on it: `response_format`
json_object / json_schema and `tools` with `tool_choice`.

Unit tests drive the llama.cpp engine in process with the real SmolLM2 GGUF: the mask removes
exactly what the grammar forbids, a resumed sequence (prompt + generated prefilled) continues
with the same tokens, a step with no grammar is left alone. Daemon tests go through the official
`openai` SDK (recipe of tests/test_daemon_openai.py): every output `json.loads` and validates
against its schema with `jsonschema`, twice the same at temperature 0; a tool call round trip;
a bad schema is a 400 naming `response_format`. One daemon runs the numpy engine for one case.
"""

from __future__ import annotations

import json
import random
import sqlite3
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import openai
import pytest
from daemon_proc import Daemon, launch, serve_argv
from journal_harness import prompt_ids

from edge_agent.daemon.structured import CallGate, parse_tool_calls
from edge_agent.protocol.api import ApiError, parse_generation
from edge_agent.runtime.constrain import Constraints, check_grammar, json_grammar
from edge_agent.runtime.sampling import SamplingParams

pytestmark = [pytest.mark.timeout(600)]

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20},
    "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"], "additionalProperties": False}


# -- the matcher hook (engine in process) ---------------------------------------------------------

@pytest.fixture(scope="module")
def engine(model_path: Path) -> Iterator[Any]:
    from edge_agent.runtime.llamacpp import LlamaCppEngine

    eng = LlamaCppEngine.load(model_path, max_batch=3, context=512, threads=1, mlock="off")
    yield eng
    eng.close()


def _prompt(engine: Any, text: str) -> list[int]:
    return list(engine.tokenizer.apply_chat_template([{"role": "user", "content": text}]))


def _run(engine: Any, sid: str, prompt: list[int], params: SamplingParams,
         grammar: str | None, generated: list[int] | None = None, n: int = 60) -> list[int]:
    if grammar is not None:
        engine.constraints.start(sid, grammar, generated or ())
    out = [engine.add(sid, prompt, params, generated=generated or ())]
    try:
        while out[-1] not in engine.stop_ids and len(out) < n:
            out.append(engine.step([sid])[sid])
    finally:
        engine.release(sid)
    return out


def test_mask_leaves_exactly_what_the_grammar_allows(engine: Any) -> None:
    tok = engine.tokenizer
    c = Constraints(tok, engine.n_vocab)
    c.start("s", json_grammar({"enum": ["yes", "no"]}))
    rows = np.zeros((2, engine.n_vocab), np.float32)
    c.mask(["other", "s"], rows)
    assert (rows[0] == 0).all()  # a sequence without a grammar: untouched
    allowed = np.flatnonzero(np.isfinite(rows[1]))
    # the oracle: a token may come first iff its bytes are a prefix of '"yes"' or '"no"'
    expect = [t for t in range(tok.vocab_size) if t not in tok.special_ids
              and tok.token_bytes(t) and any(w.startswith(tok.token_bytes(t))
                                             for w in (b'"yes"', b'"no"'))]
    assert sorted(allowed.tolist()) == expect
    c.advance(["s"], tok.encode('"yes"', add_bos=False)[:1])
    for t in tok.encode('"yes"', add_bos=False)[1:]:
        c.advance(["s"], [t])
    rows[1] = 0
    c.mask(["s"], rows[1:])  # complete: only end-of-generation tokens remain
    assert sorted(np.flatnonzero(np.isfinite(rows[1])).tolist()) == sorted(tok.eog_ids)


def test_no_grammar_costs_nothing_and_changes_nothing(engine: Any) -> None:
    prompt = _prompt(engine, "Say hello.")
    fresh = Constraints(engine.tokenizer, engine.n_vocab)
    rows = np.random.default_rng(0).standard_normal((2, engine.n_vocab)).astype(np.float32)
    before = rows.copy()
    fresh.mask(["a", "b"], rows)
    fresh.advance(["a", "b"], [1, 2])
    assert np.array_equal(rows, before) and fresh._lltok is None  # nothing built
    plain = _run(engine, "p", prompt, SamplingParams(max_tokens=20), None, n=20)
    assert engine.constraints.active == []
    again = _run(engine, "p", prompt, SamplingParams(max_tokens=20), None, n=20)
    assert plain == again


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.9, seed=7)])
def test_resume_replays_the_generated_tokens(engine: Any, params: SamplingParams) -> None:
    grammar = json_grammar(PERSON)
    prompt = _prompt(engine, "Describe a person as JSON.")
    whole = _run(engine, "w", prompt, params, grammar)
    assert whole[-1] in engine.stop_ids
    text = engine.tokenizer.decode(whole[:-1])
    jsonschema.validate(json.loads(text), PERSON)
    assert _run(engine, "w2", prompt, params, grammar) == whole  # deterministic
    for k in (1, len(whole) // 2, len(whole) - 1):
        rest = _run(engine, f"r{k}", prompt, params, grammar, generated=whole[:k])
        assert whole[:k] + rest == whole, k


def test_a_grammar_that_cannot_compile_says_why() -> None:
    assert check_grammar(json_grammar(PERSON)) is None
    err = check_grammar(json_grammar({"type": "frob"}))
    assert err is not None and "frob" in err


def test_api_validates_response_format_and_tools() -> None:
    msgs = [{"role": "user", "content": "x"}]

    def bad(body: dict[str, Any]) -> ApiError:
        with pytest.raises(ApiError) as info:
            parse_generation({"messages": msgs, **body}, chat=True, max_tokens_limit=100)
        assert "Hint:" in info.value.message
        return info.value

    assert bad({"response_format": {"type": "xml"}}).param == "response_format"
    assert bad({"response_format": {"type": "json_schema"}}).param == \
        "response_format.json_schema"
    assert bad({"response_format": {"type": "json_schema", "json_schema": {
        "name": "a b", "schema": {}}}}).param == "response_format.json_schema.name"
    assert bad({"tool_choice": "required"}).param == "tool_choice"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    assert bad({"tools": tools, "tool_choice": {"type": "function",
                                                "function": {"name": "g"}}}).param == "tool_choice"
    assert parse_generation({"messages": msgs, "tools": tools, "session": "s1"}, chat=True,
                            max_tokens_limit=9).session == "s1"  # the session keeps the tools
    assert parse_generation({"messages": msgs, "tools": tools, "stream": True}, chat=True,
                            max_tokens_limit=9).stream is True  # held till the end, then sent
    assert bad({"messages": [{"role": "tool", "content": "1"}]}).param == \
        "messages[0].tool_call_id"
    r = parse_generation({"messages": msgs, "tools": tools}, chat=True, max_tokens_limit=9)
    assert r.tool_choice == "auto" and r.tools is not None
    assert parse_generation({"prompt": "x", "response_format": {"type": "json_object"}},
                            chat=False, max_tokens_limit=9).response_format == {
                                "type": "json_object"}


def test_tool_calls_recognized_in_both_forms() -> None:
    names = ["get_weather"]
    assert parse_tool_calls('{"name": "get_weather", "arguments": {"city": "Oslo"}}',
                            names) == [("get_weather", {"city": "Oslo"})]
    assert parse_tool_calls('<tool_call>\n{"name": "get_weather", "arguments": {}}\n'
                            '</tool_call>', names) == [("get_weather", {})]
    assert parse_tool_calls('```json\n{"name": "get_weather", "arguments": "{}"}\n```',
                            names) == [("get_weather", {})]
    assert parse_tool_calls('{"name": "other", "arguments": {}}', names) is None
    # Llama 3.x's templates ask for "parameters" (and may add "type")
    assert parse_tool_calls('{"type": "function", "name": "get_weather", "parameters": '
                            '{"city": "Oslo"}}', names) == [("get_weather", {"city": "Oslo"})]
    assert parse_tool_calls('{"name": "get_weather", "parameters": [1]}', names) is None
    assert parse_tool_calls("It is sunny.", names) is None



def _gate(pieces: list[str]) -> tuple[list[str], str, bool]:
    """What a stream sends as text for `pieces` (piece by piece), what it sends at the end,
    and whether the reply calls get_weather."""
    gate = CallGate(["get_weather"])
    sent = [gate.feed(p) for p in pieces]
    return sent, gate.end(), bool(gate.calls)


def _parts(pieces: list[str], names: tuple[str, ...] = ("get_weather",)) -> list[list[Any]]:
    """The calls' parts a stream sends after each piece, and at the end."""
    gate = CallGate(names)
    out = []
    for p in pieces:
        gate.feed(p)
        out.append(gate.take())
    gate.end()
    return [*out, gate.take()]


def _whole(reply: str, names: tuple[str, ...] = ("get_weather",)) -> tuple[str, list[Any]]:
    """(content, [(name, arguments' text, closed)]) of the unstreamed reply."""
    gate = CallGate(names)
    text = gate.feed(reply) + gate.end()
    return text, [(c.name, c.arguments, c.closed) for c in gate.calls]


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


def test_a_stream_that_may_call_tools_sends_text_as_soon_as_it_cannot_be_a_call() -> None:
    # text streams as it comes; trailing whitespace waits for what follows it
    assert _gate(["Bon", "jour", "! ", "Ça va ?"]) == (["Bon", "jour", "!", " Ça va ?"], "",
                                                        False)
    # a `<tool_call>` split across pieces: the text before it went, then the call
    assert _gate(["Let me check.", " <tool", "_call>", CALL[11:]]) == (
        ["Let me check.", "", "", ""], "", True)
    assert _whole("Let me check. " + CALL) == (
        "Let me check.", [("get_weather", '{"city": "Oslo"}', True)])
    # what only looked like the start of one is sent once it is not
    assert _gate(["Use <to", "day> here"]) == (["Use", " <today> here"], "", False)
    # a reply that begins like a bare or fenced JSON call is held until it is one, or the end
    assert _gate(['  {"name"', ': "get_weather", "arguments": {}}']) == (["", ""], "", True)
    assert _gate(["{not json", "}"]) == (["", ""], "{not json}", False)
    assert _gate(["```json\n", '{"name": "get_weather", "arguments": {}}\n```']) == (
        ["", ""], "", True)
    # ... and sent as text once it cannot be one: no JSON object opens it
    assert _gate(["`x` is", " a variable"]) == (["`x` is", " a variable"], "", False)
    assert _gate(["```", "python\nprint(1)\n", "```"]) == (
        ["", "```python\nprint(1)", "\n```"], "", False)
    assert _gate(["``", "`json\n[1]"]) == (["", "```json\n[1]"], "", False)
    assert _gate(['{"city": "Oslo"}', " is it"]) == (["", ""], '{"city": "Oslo"} is it', False)
    # blank, and a block that is not a call: everything held back comes at the end
    assert _gate(["\n", " "]) == (["", ""], "\n ", False)
    assert _gate(["Hi <tool_call>", "oops</tool_call> bye"]) == (["Hi", ""],
                                                                 " <tool_call>oops</tool_call> bye",
                                                                 False)
    # held whole and read whole: a call with no arguments is a call with none
    assert _whole(CALL)[0] == "" and _whole('{"name": "get_weather"}') == (
        "", [("get_weather", "{}", True)])


def test_a_call_streams_its_name_then_its_arguments_as_written() -> None:
    pieces = ['Sure. <tool_call>\n{"name": "get_', 'weather", "argu', 'ments": {"ci',
              'ty": "Oslo", "note": "a } and a \\" {"}', '}\n</tool_call>', " Done."]
    assert _parts(pieces) == [[], [], [(0, "get_weather", '{"ci')],
                              [(0, None, 'ty": "Oslo", "note": "a } and a \\" {"}')], [], [],
                              []]
    # the text after a call is left out; the arguments are the text the model wrote
    assert _whole("".join(pieces)) == (
        "Sure.", [("get_weather", '{"city": "Oslo", "note": "a } and a \\" {"}', True)])
    # Llama 3.x's "parameters", bare and fenced; the rest of the reply is left out
    assert _whole('```json\n{"name":"get_weather","parameters":{"city":"Oslo"}}\n``` ok') == (
        "", [("get_weather", '{"city":"Oslo"}', True)])
    # cut short: the call keeps what was written (the route's finish_reason says "length")
    assert _whole('{"name": "get_weather", "arguments": {"city": "Os') == (
        "", [("get_weather", '{"city": "Os', False)])
    # after a call, a block in another form is read whole when it closes; one that is not a
    # call is left out
    other = '<tool_call>{"arguments": {"city": "Rome"}, "name": "get_weather"}</tool_call>'
    assert _whole(CALL + other + "<tool_call>oops</tool_call>") == (
        "", [("get_weather", '{"city": "Oslo"}', True), ("get_weather", '{"city": "Rome"}', True)])
    # a function that was not offered is no call: the reply is text
    assert _whole('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>') == (
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', [])
    # names are matched whole, even when one begins another
    assert _parts(['{"name": "get', '", "arguments": {}}'], ("get", "get_weather")) == [
        [], [(0, "get", "{}")], []]


def test_whatever_the_pieces_a_gated_stream_sends_the_unstreamed_reply() -> None:
    rng = random.Random(7)
    replies = ["Sure. " + CALL + "\n" + CALL, CALL, "  " + CALL[11:-12], "It is <b>sunny</b>.",
               "a <tool_call", "Oslo: <tool_call>{}</tool_call> done", "\n\nPlain text.\n",
               "x" + CALL + " and text after it", CALL + "<tool_call>oops</tool_call>",
               '{"name": "get_weather", "arguments": {"city": "Os',
               '```json\n{"name": "get_weather", "arguments": "{}"}\n```',
               CALL + '<tool_call>{"arguments": {}, "name": "get_weather"}</tool_call> bye',
               "`x` is <tool_call>" + CALL[11:], "```sh\nls\n``` " + CALL]
    for reply in replies:
        content, calls = _whole(reply)
        for _ in range(40):
            cuts = sorted(rng.sample(range(1, len(reply)), min(len(reply) - 1, rng.randint(1, 9))))
            pieces = [reply[a:b] for a, b in zip([0, *cuts], [*cuts, len(reply)], strict=True)]
            sent, rest, _ = _gate(pieces)
            assert "".join(sent) + rest == content, (reply, pieces)
            streamed: dict[int, list[str]] = {}
            for index, name, args in (p for after in _parts(pieces) for p in after):
                assert (index in streamed) == (name is None), (reply, pieces)
                streamed.setdefault(index, [name, ""])[1] += args
            assert [tuple(v) for v in streamed.values()] == [c[:2] for c in calls], (
                reply, pieces)


# -- the daemon through the openai SDK -------------------------------------------------------------

def _client(d: Daemon) -> openai.OpenAI:
    try:
        import httpx2 as httpx_mod
    except ImportError:
        import httpx as httpx_mod
    transport = httpx_mod.HTTPTransport(uds=str(d.sock))
    return openai.OpenAI(base_url="http://localhost/v1", api_key="unused", max_retries=0,
                         timeout=300, http_client=openai.DefaultHttpxClient(transport=transport))


@pytest.fixture(scope="module", params=["llamacpp", "numpy"])
def client(request: pytest.FixtureRequest, prepared_state_dir: Path) -> Iterator[openai.OpenAI]:
    root = Path(tempfile.mkdtemp(prefix="ea-cd-", dir="/tmp"))
    cfg = root / "config.toml"
    cfg.write_text(
        f'[server]\nsocket = "{root / "ea.sock"}"\nstate_dir = "{prepared_state_dir}"\n'
        "drain_timeout_s = 5\n"
        f'[runtime]\nengine = "{request.param}"\nmlock = "best-effort"\nthreads = 1\n'
        "[models.smollm2]\ncontext = 1024\nmax_batch = 2\npreload = true\n")
    with launch(Daemon, root, serve_argv(cfg)) as d:
        c = _client(d)
        c.engine = request.param  # type: ignore[attr-defined]
        c.daemon = d  # type: ignore[attr-defined]
        c.journal = prepared_state_dir / "journal.sqlite3"  # type: ignore[attr-defined]
        yield c
        c.close()


def _ask(client: openai.OpenAI, text: str, **kw: Any) -> Any:
    return client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": text}],  # type: ignore[arg-type]
        temperature=0, max_tokens=200, **kw)


SCHEMAS = {
    "person": PERSON,
    "nested": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 24},
        "location": {"type": "object", "properties": {
            "lat": {"type": "number", "minimum": -90, "maximum": 90},
            "lon": {"type": "number", "minimum": -180, "maximum": 180}},
            "required": ["lat", "lon"], "additionalProperties": False}},
        "required": ["city", "location"], "additionalProperties": False},
    "enum_array": {"type": "object", "properties": {
        "mood": {"enum": ["happy", "sad", "angry"]},
        "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                   "minItems": 1, "maxItems": 3}},
        "required": ["mood", "colors"], "additionalProperties": False},
}


def test_json_object_is_a_json_object(client: openai.OpenAI) -> None:
    r = _ask(client, "Give me a JSON object with a cat's name and age.",
             response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop", r
    assert isinstance(json.loads(r.choices[0].message.content), dict)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_outputs_validate_and_repeat(client: openai.OpenAI, name: str) -> None:
    if client.engine == "numpy" and name != "person":  # type: ignore[attr-defined]
        pytest.skip("one case on the numpy engine (it is the slow one)")
    fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name],
                                                  "strict": True}}
    replies = [_ask(client, f"Describe a {name.replace('_', ' ')} as JSON.",
                    response_format=fmt) for _ in range(2)]
    for r in replies:
        assert r.choices[0].finish_reason == "stop", r
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMAS[name])
    assert replies[0].choices[0].message.content == replies[1].choices[0].message.content


def test_completions_take_response_format(client: openai.OpenAI) -> None:
    r = client.completions.create(model="smollm2", prompt="A person as JSON:", max_tokens=80,
                                  temperature=0, extra_body={"response_format": {
                                      "type": "json_schema", "json_schema": {
                                          "name": "p", "schema": PERSON}}})
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)


def test_a_schema_that_cannot_be_compiled_is_a_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        _ask(client, "x", response_format={"type": "json_schema", "json_schema": {
            "name": "bad", "schema": {"type": "object", "properties": {
                "a": {"$ref": "#/definitions/missing"}}}}})
    assert info.value.param == "response_format"
    assert "missing" in info.value.message and "Hint:" in info.value.message


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_weather"}}])
def test_tool_call_round_trip(client: openai.OpenAI, choice: Any) -> None:
    if client.engine == "numpy" and choice != "required":  # type: ignore[attr-defined]
        pytest.skip("one case on the numpy engine")
    messages: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(model="smollm2", messages=messages, tools=[WEATHER],
                                       tool_choice=choice, temperature=0, max_tokens=120)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls", r
    assert msg.content is None and msg.tool_calls and len(msg.tool_calls) == 1
    call = msg.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments),
                        WEATHER["function"]["parameters"])
    messages += [msg.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"}]
    final = client.chat.completions.create(model="smollm2", messages=messages,
                                           tools=[WEATHER], tool_choice="none", temperature=0,
                                           max_tokens=40)
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls


def test_a_streamed_reply_that_may_call_tools_is_the_unstreamed_reply(
        client: openai.OpenAI) -> None:
    """The stream, put together as the SDK's own stream helper does (`accumulate_delta`), is
    the unstreamed reply; a call's arguments come in parts as they are written."""
    from openai.lib.streaming._deltas import accumulate_delta

    if client.engine == "numpy":  # type: ignore[attr-defined]
        pytest.skip("the streaming is the routes' own: checked on the default engine")
    kinds = set()
    for choice, text in (("required", "What is the weather in Paris?"),
                         ("auto", "Say hello in French.")):
        ask: dict[str, Any] = {"model": "smollm2", "tools": [WEATHER], "tool_choice": choice,
                               "messages": [{"role": "user", "content": text}],
                               "temperature": 0, "max_tokens": 60, "logprobs": True}
        whole = client.chat.completions.create(**ask)
        message: dict[Any, Any] = {}
        finish, roles, texts, parts, lps = [], [], 0, 0, []
        for chunk in client.chat.completions.create(stream=True, **ask):
            delta = chunk.choices[0].delta
            roles += [delta.role] if delta.role else []
            message = accumulate_delta(message, delta.to_dict())
            texts += bool(delta.content)
            parts += bool(delta.tool_calls)
            lps += [e.token for e in chunk.choices[0].logprobs.content or ()] \
                if chunk.choices[0].logprobs else []
            finish += [chunk.choices[0].finish_reason] if chunk.choices[0].finish_reason else []
        msg = whole.choices[0].message
        assert roles == ["assistant"] and finish == [whole.choices[0].finish_reason], finish
        assert message.get("content") == msg.content or (
            msg.content is None and not message.get("content"))
        if msg.tool_calls:
            assert finish == ["tool_calls"]
            calls = message["tool_calls"]
            assert [(c["type"], c["function"]["name"], c["function"]["arguments"])
                    for c in calls] == [(c.type, c.function.name, c.function.arguments)
                                        for c in msg.tool_calls]
            assert all(c["id"].startswith("call_") for c in calls)  # once each, not repeated
            assert len({c["id"] for c in calls}) == len(calls) and all(
                c["id"].count("call_") == 1 for c in calls)
            assert parts > 1, parts  # the arguments came as they were written
        else:
            assert "tool_calls" not in message and texts > 1, texts  # text as it came
        # every token's log-probability, a call's too, streamed or not
        assert whole.choices[0].logprobs and lps == [
            e.token for e in whole.choices[0].logprobs.content or ()]
        assert len(lps) == whole.usage.completion_tokens
        kinds.add(bool(msg.tool_calls))
    assert kinds == {True, False}  # both a call and text went through


def _session_row(journal: Path, sid: str) -> tuple[list[int], str | None, str | None]:
    from edge_agent.journal.store import unpack_ids

    raw = sqlite3.connect(journal)
    try:
        row = raw.execute("SELECT history, tools, calls FROM sessions WHERE id = ?",
                          (sid,)).fetchone()
        return unpack_ids(row[0]), row[1], row[2]
    finally:
        raw.close()


def test_a_session_keeps_its_tools_and_the_names_of_its_calls(client: openai.OpenAI) -> None:
    """Turn 1 offers a tool and calls it; turn 2 sends only the tool's result: its prompt is the
    history plus that result, naming the function the call id called (kept with the session in
    the journal), without a second listing of the tools. A turn with other tools is a 400
    naming `tools`, and the session is kept as it was."""
    d, journal = client.daemon, client.journal  # type: ignore[attr-defined]
    sid = f"tools-{client.engine}"  # type: ignore[attr-defined]
    ask: dict[str, Any] = {"model": "smollm2", "tools": [WEATHER], "temperature": 0,
                           "extra_body": {"session": sid}}
    r1 = client.chat.completions.create(
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tool_choice="required", max_tokens=120, **ask)
    assert r1.choices[0].finish_reason == "tool_calls", r1
    call = r1.choices[0].message.tool_calls[0]
    history, tools, calls = _session_row(journal, sid)
    assert json.loads(tools or "null") == [WEATHER["function"]]
    assert json.loads(calls or "null") == {call.id: "get_weather"}
    assert history[:len(prompt_ids(journal, r1.id))] == prompt_ids(journal, r1.id)

    r2 = client.chat.completions.create(
        messages=[{"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"}],
        tool_choice="none", max_tokens=30, **ask)
    assert r2.choices[0].message.content and not r2.choices[0].message.tool_calls, r2
    p2 = prompt_ids(journal, r2.id)
    assert p2[:len(history)] == history and r2.usage.prompt_tokens == len(p2)

    def text(ids: list[int]) -> str:
        status, body = d.json("POST", "/detokenize", {"tokens": ids, "model": "smollm2"})
        assert status == 200, body
        return str(body["content"])

    turn = text(p2[len(history):])
    assert f"Result of get_weather (call {call.id}): 18 degrees, sunny" in turn, turn
    assert text(p2).count("You can call functions") == 1  # listed once, by the first turn
    after, _, calls2 = _session_row(journal, sid)
    assert after[:len(p2)] == p2 and json.loads(calls2 or "null") == {call.id: "get_weather"}

    other = {"type": "function", "function": {"name": "get_time", "parameters": {}}}
    for tools_now, says in (([other], "this turn has the tools get_time"),
                            (None, "this turn has no tools"),
                            ([{"type": "function", "function": {
                                **WEATHER["function"], "description": "Weather."}}],
                             "has the tools get_weather defined otherwise")):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(
                messages=[{"role": "user", "content": "And in Oslo?"}], max_tokens=5,
                **{**ask, "tools": tools_now or openai.NOT_GIVEN})
        assert info.value.param == "tools", info.value
        message = info.value.message
        assert f"session '{sid}' began with the tools get_weather;" in message, message
        assert says in message and "Hint:" in message, message
    assert _session_row(journal, sid)[0] == after  # refused turns leave the history alone
