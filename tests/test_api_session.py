"""The API's `session` field: validation, and the ids of a later chat turn."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from edge_agent.daemon.sessions import Sessions, continuation_ids
from edge_agent.errors import InvalidRequest
from edge_agent.protocol.api import SESSION_MAX_LEN, ApiError, parse_generation
from edge_agent.runtime.chat_template import GGUFChatTemplate


def _parse(**fields: object):
    return parse_generation({"prompt": "Hi", **fields}, chat=None, max_tokens_limit=64)


def test_session_is_optional_and_kept() -> None:
    assert _parse().session is None
    assert _parse(session="chat-42").session == "chat-42"
    assert _parse(session="a.b:c_d-" + "x" * (SESSION_MAX_LEN - 8)).session is not None


@pytest.mark.parametrize("value", ["", "has space", "é", "x" * (SESSION_MAX_LEN + 1), 7, True,
                                   ["s"]])
def test_bad_session_ids_are_named(value: object) -> None:
    with pytest.raises(ApiError) as info:
        _parse(session=value)
    err = info.value
    assert err.status == 400 and err.code == "invalid_request"
    assert err.message.startswith("field 'session': expected an id of 1..128 characters")
    assert "Hint: use e.g. \"session\": \"chat-42\"" in err.message


def test_a_later_turn_continues_the_rendered_conversation(tokenizer) -> None:
    first = [{"role": "user", "content": "Hi, I am Ada."}]
    answer = "Hello Ada!"
    second = [{"role": "user", "content": "What is my name?"}]
    template = tokenizer.chat_template
    history = (tokenizer.apply_chat_template(first) + tokenizer.encode(answer)
               + [template.im_end_id, *tokenizer.encode("\n")])
    ids = history + continuation_ids(tokenizer, second)
    whole = first + [{"role": "assistant", "content": answer}] + second
    assert tokenizer.decode(ids) == template.render(whole)  # one default system prompt only
    assert continuation_ids(tokenizer, second)[0] == template.im_start_id


# -- a session that offers tools, on a template that renders them (Qwen2.5's) --------------------

QWEN = Path(__file__).parent / "data" / "templates" / "Qwen-Qwen2.5-7B-Instruct.jinja"
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


class _CharVocab:
    """A vocabulary of one id per character (its code point) under a real GGUF chat template:
    what Sessions and structured need of a model's vocabulary, so ids are readable text."""

    def __init__(self, source: str) -> None:
        self.chat_template = GGUFChatTemplate(source)

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def apply_chat_template(self, messages: Any, *, add_generation_prompt: bool = True,
                            **extra: Any) -> list[int]:
        return self.encode(self.chat_template.render(
            list(messages), add_generation_prompt=add_generation_prompt, **extra))

    def turn_end_ids(self) -> list[int]:
        return self.encode("<|im_end|>\n")

    def ensure_tokenizer(self) -> _CharVocab:
        return self


def _text(ids: list[int]) -> str:
    return "".join(map(chr, ids))


def test_a_session_turn_with_tools_continues_what_the_template_renders() -> None:
    """Qwen2.5 renders tools natively: turn 1's prompt lists them as the template does, and
    turn 2 (the tool's result only) makes the history exactly the template's rendering of the
    whole conversation, the call included, with the tools listed once."""
    vocab = _CharVocab(QWEN.read_text())
    model = SimpleNamespace(engine="numpy", to_snapshot={}, ensure_tokenizer=lambda: vocab,
                            poke=lambda: None)
    journal = SimpleNamespace(store=None, check_admission=lambda: None)
    sessions = Sessions(journal, {"qwen": model})  # type: ignore[arg-type]
    ask = {"tools": [WEATHER], "session": "s"}
    user = {"role": "user", "content": "Weather in Paris?"}
    req1 = parse_generation({**ask, "messages": [user]}, chat=True, max_tokens_limit=64)
    p1 = sessions.prompt_ids(req1, "qwen", vocab)
    assert _text(p1) == vocab.chat_template.render([user], tools=[WEATHER])
    reply = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    rec = SimpleNamespace(id="req-abc", model="qwen", request=req1, text=reply,
                          job=SimpleNamespace(prompt_ids=p1, params={}),
                          tokens=vocab.encode(reply))
    sessions.finished(rec, True)  # type: ignore[arg-type]

    result = {"role": "tool", "tool_call_id": "call_abc_0", "content": "18 degrees"}
    req2 = parse_generation({**ask, "messages": [result], "tool_choice": "none"}, chat=True,
                            max_tokens_limit=64)
    p2 = sessions.prompt_ids(req2, "qwen", vocab)
    call = {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "get_weather",
                                          "arguments": {"city": "Paris"}}}]}
    assert _text(p2) == vocab.chat_template.render([user, call, result], tools=[WEATHER])
    assert _text(p2).count("# Tools") == 1
    assert sessions._memory["s"].calls == {"call_abc_0": "get_weather"}

    other = {"type": "function", "function": {"name": "get_time"}}
    req3 = parse_generation({"messages": [user], "tools": [other], "session": "s"}, chat=True,
                            max_tokens_limit=64)
    with pytest.raises(InvalidRequest, match="field 'tools': session 's' began with the "
                       "tools get_weather; this turn has the tools get_time"):
        sessions.prompt_ids(req3, "qwen", vocab)
