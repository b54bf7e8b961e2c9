"""The API's `session` field: validation, and the ids of a later chat turn."""

from __future__ import annotations

import pytest

from edge_agent.daemon.sessions import continuation_ids
from edge_agent.protocol.api import SESSION_MAX_LEN, ApiError, parse_generation


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
