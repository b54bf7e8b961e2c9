"""HTTP API schema: request validation, OpenAI-compatible response shapes, SSE encoding.

Invariants owned here:
- Pure: no I/O, no clock (callers pass `created`), no randomness (callers pass the seed default).
- Every rejected body raises `ApiError` with an HTTP status, a stable `code` and a message that
  names the offending field (`messages[1].role`, `max_tokens`, ...) and ends with a `Hint:`.
- `bool` is never accepted where a number is expected (JSON `true` is not `1`).
- Unknown top-level fields are ignored (OpenAI clients send many); known fields are checked.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from edge_agent.errors import EdgeAgentError

__all__ = [
    "ApiError",
    "ChatMessage",
    "GenerationRequest",
    "parse_generation",
    "parse_json_body",
    "error_body",
    "completion_response",
    "completion_chunk",
    "sse_event",
    "SSE_DONE",
    "MAX_STOP",
    "SESSION_MAX_LEN",
    "PRIORITY_MIN",
    "PRIORITY_MAX",
]

MAX_STOP = 4
SESSION_MAX_LEN = 128
PRIORITY_MIN = 0
PRIORITY_MAX = 10
ROLES = ("system", "user", "assistant")
SSE_DONE = b"data: [DONE]\n\n"


class ApiError(EdgeAgentError):
    """A request the API refuses; carries the HTTP status and the JSON error code."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        headers: Sequence[tuple[str, str]] = (),
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = tuple(headers)
        self.extra = dict(extra or {})

    def body(self) -> bytes:
        return error_body(self.code, self.message, self.extra)


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


@dataclass(frozen=True)
class GenerationRequest:
    """A validated completion or chat request (exactly one of prompt / messages is set)."""

    chat: bool
    model: str | None
    prompt: str | None
    messages: tuple[ChatMessage, ...] | None
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    priority: int | None
    timeout_ms: int | None
    session: str | None = None  # conversation id: its token history is kept by the daemon

    def sampling_dict(self, seed: int) -> dict[str, Any]:
        """Plain data for the runner's SamplingParams (the seed resolved by the caller)."""
        return {
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "seed": self.seed if self.seed is not None else seed,
            "max_tokens": self.max_tokens,
        }


def _bad(field: str, problem: str, hint: str) -> ApiError:
    return ApiError(400, "invalid_request", f"field {field!r}: {problem}. Hint: {hint}")


def error_body(code: str, message: str, extra: Mapping[str, Any] | None = None) -> bytes:
    err: dict[str, Any] = {"code": code, "message": message}
    if extra:
        err.update(extra)
    return json.dumps({"error": err}).encode()


def parse_json_body(body: bytes) -> dict[str, Any]:
    """Decode a JSON object body; 400 `malformed_json` naming the position otherwise."""
    if not body.strip():
        raise ApiError(
            400, "malformed_json", "request body is empty, expected a JSON object. "
            "Hint: send Content-Type: application/json with a body such as {\"prompt\": \"Hi\"}."
        )
    try:
        value = json.loads(body)
    except UnicodeDecodeError as exc:
        raise ApiError(
            400, "malformed_json", f"request body is not UTF-8 ({exc.reason} at byte "
            f"{exc.start}). Hint: encode the JSON body as UTF-8."
        ) from exc
    except json.JSONDecodeError as exc:
        raise ApiError(
            400, "malformed_json", f"request body is not valid JSON ({exc.msg} at line "
            f"{exc.lineno} column {exc.colno}). Hint: check quoting and commas; "
            "`python -m json.tool` shows the fault."
        ) from exc
    if not isinstance(value, dict):
        raise ApiError(
            400, "malformed_json", f"request body is a JSON {type(value).__name__}, expected "
            "an object. Hint: wrap the fields in {...}."
        )
    return value


def _int(d: Mapping[str, Any], key: str, default: int | None, lo: int, hi: int) -> int | None:
    if key not in d or d[key] is None:
        return default
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(key, f"expected an integer, got {json.dumps(v)}", f"use an integer {lo}..{hi}")
    if not lo <= v <= hi:
        raise _bad(key, f"{v} is out of range", f"use an integer {lo}..{hi}")
    return v


def _float(d: Mapping[str, Any], key: str, default: float, lo: float, hi: float,
           lo_open: bool = False) -> float:
    if key not in d or d[key] is None:
        return default
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _bad(key, f"expected a number, got {json.dumps(v)}", f"use a number in {lo}..{hi}")
    if v != v or not (lo < v if lo_open else lo <= v) or v > hi:
        rng = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise _bad(key, f"{v} is out of range", f"use a number in {rng}")
    return float(v)


def _stop(d: Mapping[str, Any]) -> tuple[str, ...]:
    v = d.get("stop")
    if v is None:
        return ()
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise _bad("stop", f"expected a string or a list of strings, got {json.dumps(v)}",
                   'use "stop": "\\n" or "stop": ["\\n", "END"]')
    if len(items) > MAX_STOP:
        raise _bad("stop", f"{len(items)} sequences given", f"use at most {MAX_STOP}")
    if any(s == "" for s in items):
        raise _bad("stop", "empty stop sequence", "remove the empty string")
    return tuple(items)


def _session(d: Mapping[str, Any]) -> str | None:
    v = d.get("session")
    if v is None:
        return None
    if (not isinstance(v, str) or not 1 <= len(v) <= SESSION_MAX_LEN
            or not all(c.isascii() and (c.isalnum() or c in "._:-") for c in v)):
        raise _bad("session", f"expected an id of 1..{SESSION_MAX_LEN} characters A-Z a-z 0-9 "
                   f"._:- , got {json.dumps(v)}", 'use e.g. "session": "chat-42"')
    return v


def _messages(d: Mapping[str, Any]) -> tuple[ChatMessage, ...]:
    v = d.get("messages")
    if not isinstance(v, list) or not v:
        raise _bad("messages", "expected a non-empty list of {role, content} objects, got "
                   f"{json.dumps(v)}", 'use "messages": [{"role": "user", "content": "Hi"}]')
    out = []
    for i, m in enumerate(v):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(where, f"expected an object, got {json.dumps(m)}",
                       'use {"role": "user", "content": "..."}')
        role = m.get("role")
        if role not in ROLES:
            raise _bad(f"{where}.role", f"{json.dumps(role)} is not a known role",
                       f"use one of {', '.join(ROLES)}")
        content = m.get("content")
        if isinstance(content, list):  # OpenAI content parts: keep the text parts
            parts = []
            for j, p in enumerate(content):
                if not (isinstance(p, dict) and p.get("type") == "text"
                        and isinstance(p.get("text"), str)):
                    raise _bad(f"{where}.content[{j}]", "only text parts are supported",
                               'use {"type": "text", "text": "..."}')
                parts.append(p["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise _bad(f"{where}.content", f"expected a string, got {json.dumps(content)}",
                       "send the message text as a string")
        out.append(ChatMessage(role, content))
    return tuple(out)


def parse_generation(
    body: bytes | Mapping[str, Any],
    *,
    chat: bool | None,
    max_tokens_limit: int,
    default_max_tokens: int = 16,
) -> GenerationRequest:
    """Validate a /v1/completions (chat=False), /v1/chat/completions (chat=True) or
    /v1/requests (chat=None: whichever of prompt / messages is present) body."""
    d = parse_json_body(body) if isinstance(body, (bytes, bytearray)) else dict(body)
    if chat is None:
        if ("prompt" in d) == ("messages" in d):
            raise _bad("prompt", "give exactly one of 'prompt' or 'messages'",
                       'use "prompt": "text" or "messages": [...]')
        chat = "messages" in d
    model = d.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise _bad("model", f"expected a model name, got {json.dumps(model)}",
                   "GET /v1/models lists the names")
    prompt: str | None = None
    messages: tuple[ChatMessage, ...] | None = None
    if chat:
        messages = _messages(d)
    else:
        p = d.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
            p = p[0]
        if not isinstance(p, str):
            raise _bad("prompt", f"expected a string, got {json.dumps(p)}",
                       'use "prompt": "Once upon a time"')
        prompt = p
    n = d.get("n", 1)
    if n != 1 or isinstance(n, bool):
        raise _bad("n", f"{json.dumps(n)} choices requested", "only n=1 is supported")
    stream = d.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("stream", f"expected true or false, got {json.dumps(stream)}",
                   'use "stream": true')
    seed = d.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0
                             or seed >= 2**63):
        raise _bad("seed", f"expected a non-negative integer, got {json.dumps(seed)}",
                   "use an integer 0..2**63-1")
    return GenerationRequest(
        chat=chat,
        model=model,
        prompt=prompt,
        messages=messages,
        max_tokens=int(_int(d, "max_tokens", default_max_tokens, 1, max_tokens_limit) or 1),
        temperature=_float(d, "temperature", 1.0, 0.0, 2.0),
        top_p=_float(d, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        top_k=int(_int(d, "top_k", 0, 0, 1 << 20) or 0),
        seed=seed,
        stop=_stop(d),
        stream=stream,
        priority=_int(d, "priority", None, PRIORITY_MIN, PRIORITY_MAX),
        timeout_ms=_int(d, "timeout_ms", None, 1, 7 * 24 * 3600 * 1000),
        session=_session(d),
    )


def completion_response(
    *, rid: str, model: str, created: int, chat: bool, text: str, finish_reason: str | None,
    prompt_tokens: int, completion_tokens: int,
) -> dict[str, Any]:
    """The OpenAI-shaped (non-streaming) reply."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
        choice["logprobs"] = None
    return {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def completion_chunk(
    *, rid: str, model: str, created: int, chat: bool, text: str | None,
    finish_reason: str | None, first: bool = False,
) -> dict[str, Any]:
    """One streamed chunk; with chat, the first chunk carries the assistant role."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason}
    if chat:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text:
            delta["content"] = text
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
        choice["logprobs"] = None
    return {
        "id": rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
    }


def sse_event(data: Mapping[str, Any] | str, *, event: str | None = None,
              event_id: int | None = None) -> bytes:
    """One server-sent event (data JSON-encoded on a single line)."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    head = ""
    if event_id is not None:
        head += f"id: {event_id}\n"
    if event is not None:
        head += f"event: {event}\n"
    return f"{head}data: {payload}\n\n".encode()
