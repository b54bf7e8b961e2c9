"""HTTP API schema: request validation, OpenAI-compatible response shapes, SSE encoding.

Invariants owned here:
- Pure: no I/O, no clock (callers pass `created`), no randomness (callers pass the seed default).
- Every rejected body raises `ApiError` with an HTTP status, a stable `code` and a message that
  names the offending field (`messages[1].role`, `max_tokens`, ...) and ends with a `Hint:`.
- `bool` is never accepted where a number is expected (JSON `true` is not `1`).
- Every top-level field is known to the endpoint or refused (400 `unknown_parameter` naming it,
  in body order). A known field is honored; or on the documented ignore list (accepted, type
  checked, no effect: IGNORED_FIELDS); or an OpenAI parameter this server does not implement
  (400 `unsupported_parameter`), unless it carries its neutral value (`functions: []`,
  `modalities: ["text"]`, ...), which changes nothing. `null` is as if absent.
- Error bodies are OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`; `type`
  follows the status (`invalid_request_error` for 4xx, `server_error` for 5xx), `param` names
  the field (`None` when the error is about no single field).
- Limits: chat with no `max_tokens` / `max_completion_tokens` generates until end-of-sequence or
  the context (UNTIL_CONTEXT); `max_completion_tokens` wins over `max_tokens`; completions keep
  OpenAI's documented default of 16.
- Every body is bounded before any field is read, wherever the value sits (unknown fields too):
  arrays/objects nest at most MAX_JSON_DEPTH levels, a number literal has at most
  MAX_NUMBER_DIGITS characters, a string (or key) at most MAX_STRING_CHARS characters, and no
  string holds a lone UTF-16 surrogate (`"\\ud800"` decodes to one, and no tokenizer or UTF-8
  encoder accepts it). Each is a 400 `invalid_request` naming the field and the limit.
- Query strings are parsed strictly (`parse_query`, `check_query`, `query_int`): percent-escapes
  must be well formed and decode to UTF-8, a key appears once, only the route's keys are
  allowed, and integers are ASCII digits ("²" is a digit to str.isdigit(), not to int()).
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote_to_bytes

from edge_agent.errors import (
    AdmissionRefused,
    BoardProfileError,
    ContextExceeded,
    EdgeAgentError,
    EmbeddingFailed,
    FlashBusy,
    FlashJobNotFound,
    InvalidRequest,
    JournalFailed,
    JournalNotWritable,
    ModelFailed,
    ModelNotEmbedding,
    ModelNotFound,
    PortNotOwned,
    RequestQueueFull,
    ServiceError,
    SessionBusy,
    SessionModelMismatch,
    SessionNotContinuable,
    SessionNotFound,
    ShuttingDown,
    UploadFailed,
)
from edge_agent.scheduler.jobs import MAX_PRIORITY, MIN_PRIORITY

__all__ = [
    "ApiError",
    "HTTP_ERRORS",
    "END_STATUS",
    "end_error",
    "api_error",
    "ChatMessage",
    "message_reasoning",
    "DetokenizeRequest",
    "IGNORED_FIELDS",
    "TokenizeRequest",
    "UNSUPPORTED_FIELDS",
    "UNTIL_CONTEXT",
    "error_type",
    "parse_detokenize",
    "parse_tokenize",
    "check_limits",
    "check_query",
    "parse_query",
    "query_int",
    "MAX_JSON_DEPTH",
    "MAX_NUMBER_DIGITS",
    "MAX_STRING_CHARS",
    "GenerationRequest",
    "parse_generation",
    "parse_json_body",
    "error_body",
    "completion_response",
    "completion_chunk",
    "usage_chunk",
    "chat_logprobs",
    "completion_logprobs",
    "sse_event",
    "SSE_DONE",
    "MAX_STOP",
    "SESSION_MAX_LEN",
    "MAX_TOKENS_LIMIT",
    "field_error",
    "bool_field",
    "MAX_LOGIT_BIAS_ENTRIES",
]

MAX_STOP = 4
MAX_LOGIT_BIAS_ENTRIES = 1024  # token ids one request may bias
CHAT_MAX_LOGPROBS = 20  # OpenAI's top_logprobs range (chat)
COMPLETION_MAX_LOGPROBS = 5  # OpenAI's logprobs range (completions)
SESSION_MAX_LEN = 128
MAX_TOKENS_LIMIT = 8192  # the largest max_tokens any request may ask for (HTTP and UART)
ROLES = ("system", "user", "assistant", "tool")
SSE_DONE = b"data: [DONE]\n\n"
MAX_JSON_DEPTH = 64  # nested arrays/objects, the top-level object included
MAX_NUMBER_DIGITS = 64  # characters of one number literal (sign, point and exponent included)
MAX_STRING_CHARS = 1 << 20  # characters of one string or key
MAX_QUERY_INT_DIGITS = 18  # below 2**63
_SHOW_CHARS = 80  # values quoted in messages are cut to this
_SURROGATE = re.compile("[\ud800-\udfff]")
_BAD_PERCENT = re.compile("%(?![0-9A-Fa-f]{2})")
_FIELD_PREFIX = re.compile(r"(?:field|query) '([^']+)'")
UNTIL_CONTEXT = (1 << 31) - 1  # max_tokens meaning "until end-of-sequence or the context"
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions


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
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = tuple(headers)
        self.extra = dict(extra or {})
        if param is None:  # "field 'messages[1].role': ..." names its field
            m = _FIELD_PREFIX.match(message)
            param = m.group(1) if m else None
        self.param = param

    def body(self) -> bytes:
        return error_body(self.code, self.message, self.extra, status=self.status,
                          param=self.param)


# The one place the daemon's domain errors (edge_agent/errors.py) get an HTTP status and code;
# daemon/uart_backend.py's UART_CODES is the serial console's counterpart.
HTTP_ERRORS: dict[type[ServiceError], tuple[int, str]] = {
    ShuttingDown: (503, "shutting_down"),
    AdmissionRefused: (503, "memory_pressure"),
    ModelNotFound: (404, "model_not_found"),
    ModelFailed: (503, "model_failed"),
    InvalidRequest: (400, "invalid_request"),
    ContextExceeded: (400, "context_exceeded"),
    RequestQueueFull: (503, "queue_full"),
    JournalFailed: (503, "journal_failed"),
    JournalNotWritable: (507, "journal_unavailable"),
    SessionBusy: (409, "session_busy"),
    SessionModelMismatch: (409, "session_model_mismatch"),
    SessionNotContinuable: (400, "session_template"),
    SessionNotFound: (404, "session_not_found"),
    ModelNotEmbedding: (400, "model_not_embedding"),
    EmbeddingFailed: (503, "embedding_failed"),
    PortNotOwned: (409, "port_not_owned"),
    FlashBusy: (409, "port_busy"),
    FlashJobNotFound: (404, "flash_job_not_found"),
    BoardProfileError: (400, "invalid_request"),
    UploadFailed: (507, "upload_failed"),
}


# The HTTP status of each code a request can end with (daemon/outcome.py's EndCode; the code
# is the error body's `code`); daemon/uart_backend.py's UART_END_CODES is the UART counterpart.
END_STATUS: dict[str, int] = {
    "deadline_exceeded": 504,
    "memory_pressure": 503,
    "shutting_down": 503,
    "runner_error": 500,
    "runner_failed": 503,
    "model_failed": 503,
    "budget_exceeded": 503,
    "failed": 503,  # a failed request read back from the journal (its code is not kept)
}


def end_error(code: str, message: str, extra: Mapping[str, Any] | None = None) -> ApiError:
    """The HTTP answer to a request that ended with error `code` (status from END_STATUS)."""
    return ApiError(END_STATUS[code], code, message, extra=extra)


def api_error(exc: ServiceError) -> ApiError:
    """The HTTP answer to a domain error: status and code from HTTP_ERRORS (its nearest listed
    class; 503 `unavailable` if none), `Retry-After` from `retry_after_s`, the message as is
    (a message starting "field 'x': " names its param)."""
    status, code = next((HTTP_ERRORS[c] for c in type(exc).__mro__ if c in HTTP_ERRORS),
                        (503, "unavailable"))
    headers = () if exc.retry_after_s is None else (("retry-after", str(exc.retry_after_s)),)
    return ApiError(status, code, exc.message, headers=headers)


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str  # "" for an assistant message that only calls tools (content null)
    tool_calls: tuple[dict[str, Any], ...] | None = None  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: the call this message answers
    # assistant: the reasoning a thinking model wrote before this answer, sent back
    # (`reasoning_content`; Ollama's `thinking`), for templates that render it (Qwen3's)
    reasoning: str | None = None


@dataclass(frozen=True)
class GenerationRequest:
    """A validated completion or chat request (exactly one of prompt / messages is set)."""

    chat: bool
    model: str | None
    prompt: str | None
    messages: tuple[ChatMessage, ...] | None
    max_tokens: int  # UNTIL_CONTEXT: until end-of-sequence or the context (no limit asked)
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    priority: int | None
    timeout_ms: int | None
    session: str | None = None  # conversation id: its token history is kept by the daemon
    # {"type": "json_object"} or {"type": "json_schema", "json_schema": {...}}; None: text
    response_format: dict[str, Any] | None = None
    tools: tuple[dict[str, Any], ...] | None = None  # [{"type": "function", "function": ...}]
    tool_choice: str | dict[str, Any] | None = None  # "none" | "auto" | "required" | {named}
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids ascending
    logprobs: int | None = None  # None: not asked; N: each token's logprob and the N likeliest
    include_usage: bool = False  # stream_options.include_usage: a last chunk with usage
    # the request field the messages came from, for errors: Ollama's /api/generate makes chat
    # turns of its "prompt"
    messages_field: str = "messages"
    # a thinking model's reply: "auto" keeps its reasoning apart (daemon/reasoning.py), "none"
    # leaves it in the text as the model wrote it
    reasoning_format: str = "auto"
    # variables for the model's Jinja chat template (llama-server's chat_template_kwargs, e.g.
    # {"enable_thinking": false}; Ollama's think: false)
    template_vars: dict[str, Any] | None = None

    def sampling_dict(self, seed: int) -> dict[str, Any]:
        """Plain data for the runner's SamplingParams (the seed resolved by the caller); the
        newer controls only when they change something (SamplingParams' defaults are neutral)."""
        out: dict[str, Any] = {
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "seed": self.seed if self.seed is not None else seed,
            "max_tokens": self.max_tokens,
        }
        for key, neutral in (("min_p", 0.0), ("presence_penalty", 0.0),
                             ("frequency_penalty", 0.0), ("repeat_penalty", 1.0),
                             ("repeat_last_n", 64), ("logprobs", None)):
            if getattr(self, key) != neutral:
                out[key] = getattr(self, key)
        if self.logit_bias:
            out["logit_bias"] = [[i, b] for i, b in self.logit_bias]
        return out


def field_error(field: str, problem: str, hint: str, code: str = "invalid_request") -> ApiError:
    """The 400 for one bad field: "field 'x': problem. Hint: hint" (`param` names it)."""
    param = None if field == "request body" or field.startswith("a key in ") else field
    return ApiError(400, code, f"field {field!r}: {problem}. Hint: {hint}", param=param)


_bad = field_error  # the short name this module's many checks use


def error_type(status: int) -> str:
    """OpenAI's error `type` for an HTTP status."""
    return "server_error" if status >= 500 else "invalid_request_error"


def error_body(code: str, message: str, extra: Mapping[str, Any] | None = None, *,
               status: int = 400, param: str | None = None) -> bytes:
    """`{"error": {"message", "type", "param", "code", ...extra}}` (OpenAI's shape)."""
    err: dict[str, Any] = {"message": message, "type": error_type(status), "param": param,
                           "code": code}
    if extra:
        err.update(extra)
    return json.dumps({"error": err}).encode()


def parse_json_body(body: bytes) -> dict[str, Any]:
    """Decode a JSON object body; 400 `malformed_json` naming the position otherwise, and
    400 `invalid_request` for a body past the limits (depth, number size, string size) or
    holding a lone surrogate."""
    if not body.strip():
        raise ApiError(
            400, "malformed_json", "request body is empty, expected a JSON object. "
            "Hint: send Content-Type: application/json with a body such as {\"prompt\": \"Hi\"}."
        )
    try:
        value = json.loads(body, parse_int=_parse_int, parse_float=_parse_float)
    except RecursionError:
        raise ApiError(
            400, "invalid_request", f"request body: JSON arrays/objects nested far deeper than "
            f"the limit of {MAX_JSON_DEPTH} levels. Hint: flatten the structure; no field of "
            "this API needs more than a few levels."
        ) from None
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
    if isinstance(value, _LongNumber):
        raise value.error("request body")
    if isinstance(value, (dict, list)):
        check_limits(value)
    if not isinstance(value, dict):
        raise ApiError(
            400, "malformed_json", f"request body is a JSON {type(value).__name__}, expected "
            "an object. Hint: wrap the fields in {...}."
        )
    return value


class _LongNumber:
    """A number literal past MAX_NUMBER_DIGITS, kept undecoded (int() refuses > 4300 digits and
    is quadratic below that) until `check_limits` names the field it sits in."""

    __slots__ = ("literal",)

    def __init__(self, literal: str) -> None:
        self.literal = literal

    def error(self, where: str) -> ApiError:
        return _too_long_number(where, self.literal)


def _too_long_number(where: str, literal: str) -> ApiError:
    digits = sum(c.isdigit() for c in literal)
    return _bad(where, f"a number of {digits} digits ({literal[:20]}...); at most "
                f"{MAX_NUMBER_DIGITS} characters are accepted",
                "send integers within 64 bits and floats as ordinary decimals")


def _parse_int(literal: str) -> int | _LongNumber:
    return int(literal) if len(literal) <= MAX_NUMBER_DIGITS else _LongNumber(literal)


def _parse_float(literal: str) -> float | _LongNumber:
    return float(literal) if len(literal) <= MAX_NUMBER_DIGITS else _LongNumber(literal)


def _show_key(key: str) -> str:
    if len(key) <= 40 and key.isprintable() and not _SURROGATE.search(key):
        return key
    return json.dumps(key[:40])[1:-1] + "..."


def _where(node: tuple[Any, ...] | None) -> str:
    """('messages', 0, 'content') as a linked list (parent, key) -> "messages[0].content"."""
    parts: list[str] = []
    while node is not None:
        node, key = node
        parts.append(f"[{key}]" if isinstance(key, int) else "." + _show_key(str(key)))
    text = "".join(reversed(parts)).lstrip(".")
    return text or "request body"


def _check_text(text: str, where: str, what: str = "string") -> None:
    if len(text) > MAX_STRING_CHARS:
        raise _bad(where, f"a {what} of {len(text)} characters; at most {MAX_STRING_CHARS} are "
                   "accepted", "send less text (a model's context is far smaller)")
    m = _SURROGATE.search(text)
    if m is not None:
        raise _bad(where, f"the {what} holds a lone UTF-16 surrogate "
                   f"({json.dumps(m.group())[1:-1]} at character {m.start()}), which is not a "
                   "Unicode character", "send valid UTF-8; a \\u escape in \\ud800-\\udfff "
                   "must be half of a pair (high \\ud800-\\udbff, then low \\udc00-\\udfff)")


def check_limits(root: dict[str, Any] | list[Any]) -> None:
    """Raise ApiError 400 naming the first value past the limits (depth, number size, string
    size) or holding a lone surrogate. Iterative: a deep value cannot exhaust the stack."""
    big = 10 ** MAX_NUMBER_DIGITS
    stack: list[tuple[Any, tuple[Any, ...] | None, int]] = [(root, None, 1)]
    while stack:
        node, at, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise _bad(_where(at), f"arrays/objects nested {depth} levels deep; at most "
                       f"{MAX_JSON_DEPTH} are accepted",
                       "flatten the structure; no field of this API needs more than a few levels")
        if isinstance(node, Mapping):
            items: Iterable[tuple[Any, Any]] = node.items()
            for key in node:
                if isinstance(key, str) and (len(key) > 40 or not key.isascii()):
                    _check_text(key, f"a key in {_where(at)}", "key")
        else:
            items = enumerate(node)
        for key, v in items:
            if isinstance(v, str):
                if len(v) > 64 or not v.isascii():
                    _check_text(v, _where((at, key)))
            elif isinstance(v, (dict, list, tuple)):
                stack.append((v, (at, key), depth + 1))
            elif isinstance(v, _LongNumber):
                raise v.error(_where((at, key)))
            elif isinstance(v, int) and not isinstance(v, bool) and not -big < v < big:
                raise _too_long_number(_where((at, key)), str(v)[:21])


def _show(value: Any) -> str:
    """A received value as JSON, cut to a readable length."""
    text = json.dumps(value, default=str)
    return text if len(text) <= _SHOW_CHARS else text[:_SHOW_CHARS] + "...(cut)"


# ----- query strings ---------------------------------------------------------------------------


def parse_query(raw: str) -> dict[str, list[str]]:
    """Strictly decode `a=1&b=x%20y` (`+` is a space); 400 for a malformed escape, bytes that
    are not UTF-8, or a key given twice. Values come as one-item lists (parse_qs' shape)."""
    out: dict[str, list[str]] = {}
    for piece in raw.split("&"):
        if not piece:
            continue
        key, _, value = piece.partition("=")
        key, value = _unescape(key, piece), _unescape(value, piece)
        if key in out:
            raise ApiError(400, "invalid_request", f"query {_show_key(key)!r}: given twice. "
                           "Hint: send each query parameter once.")
        out[key] = [value]
    return out


def _unescape(text: str, piece: str) -> str:
    shown = piece if len(piece) <= _SHOW_CHARS else piece[:_SHOW_CHARS] + "..."
    m = _BAD_PERCENT.search(text)
    if m is not None:
        raise ApiError(400, "invalid_request", f"query: {shown!r} is not valid percent-encoding "
                       f"({text[m.start():m.start() + 3]!r}: '%' must be followed by two hex "
                       "digits). Hint: write a literal '%' as %25 and percent-encode values "
                       "(urllib.parse.quote).")
    try:
        return unquote_to_bytes(text.replace("+", " ")).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, "invalid_request", f"query: {shown!r} decodes to bytes that are not "
                       f"UTF-8 ({exc.reason}). Hint: percent-encode the UTF-8 bytes of the "
                       "text (urllib.parse.quote).") from None


def check_query(query: Mapping[str, list[str]], allowed: Sequence[str]) -> None:
    """400 for a key this route does not take."""
    for key, values in query.items():
        if key not in allowed:
            takes = f"it takes only {', '.join(allowed)}" if allowed else "it takes none"
            raise ApiError(400, "invalid_request", f"query {_show_key(key)!r}: unknown "
                           f"parameter for this endpoint. Hint: remove it; {takes}.")
        if len(values) != 1:
            raise ApiError(400, "invalid_request", f"query {_show_key(key)!r}: given twice. "
                           "Hint: send each query parameter once.")


def query_int(query: Mapping[str, list[str]], key: str, default: int, *, hint: str) -> int:
    """A non-negative integer of ASCII digits (at most MAX_QUERY_INT_DIGITS)."""
    if key not in query:
        return default
    raw = query[key][0]
    if not (raw.isascii() and raw.isdigit() and len(raw) <= MAX_QUERY_INT_DIGITS):
        shown = raw if len(raw) <= 24 else raw[:24] + "..."
        raise ApiError(400, "invalid_request", f"query {key!r}: {shown!r} is not a non-negative "
                       f"integer of at most {MAX_QUERY_INT_DIGITS} ASCII digits. Hint: {hint}.")
    return int(raw)


def _int(d: Mapping[str, Any], key: str, default: int | None, lo: int, hi: int) -> int | None:
    if key not in d or d[key] is None:
        return default
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(key, f"expected an integer, got {_show(v)}", f"use an integer {lo}..{hi}")
    if not lo <= v <= hi:
        raise _bad(key, f"{v} is out of range", f"use an integer {lo}..{hi}")
    return v


def _float(d: Mapping[str, Any], key: str, default: float, lo: float, hi: float,
           lo_open: bool = False) -> float:
    if key not in d or d[key] is None:
        return default
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _bad(key, f"expected a number, got {_show(v)}", f"use a number in {lo}..{hi}")
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
        raise _bad("stop", f"expected a string or a list of strings, got {_show(v)}",
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
                   f"._:- , got {_show(v)}", 'use e.g. "session": "chat-42"')
    return v


def _messages(d: Mapping[str, Any]) -> tuple[ChatMessage, ...]:
    v = d.get("messages")
    if not isinstance(v, list) or not v:
        raise _bad("messages", "expected a non-empty list of {role, content} objects, got "
                   f"{_show(v)}", 'use "messages": [{"role": "user", "content": "Hi"}]')
    out = []
    for i, m in enumerate(v):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(where, f"expected an object, got {_show(m)}",
                       'use {"role": "user", "content": "..."}')
        role = m.get("role")
        if role not in ROLES:
            raise _bad(f"{where}.role", f"{_show(role)} is not a known role",
                       f"use one of {', '.join(ROLES)}")
        content = m.get("content")
        calls = _tool_calls(m.get("tool_calls"), where, role)
        call_id = m.get("tool_call_id")
        if role == "tool" and (not isinstance(call_id, str) or not call_id):
            raise _bad(f"{where}.tool_call_id", f"expected the id of the tool call this "
                       f"message answers, got {_show(call_id)}",
                       'send {"role": "tool", "tool_call_id": "call_...", "content": "..."}')
        if content is None and calls:
            content = ""
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
            raise _bad(f"{where}.content", f"expected a string, got {_show(content)}",
                       "send the message text as a string")
        out.append(ChatMessage(role, content, calls, call_id if role == "tool" else None,
                               message_reasoning(m, "reasoning_content", where, role)))
    return tuple(out)


def message_reasoning(m: Mapping[str, Any], key: str, where: str, role: Any,
                      bad: Callable[[str, str, str], ApiError] = field_error) -> str | None:
    """An assistant message's reasoning sent back under `key` (None: absent or null); `bad`:
    the route's 400 for a field."""
    value = m.get(key)
    if value is None:
        return None
    if role != "assistant":
        raise bad(f"{where}.{key}", "only assistant messages carry a thinking model's "
                   "reasoning", f"leave {key} out of {role} messages")
    if not isinstance(value, str):
        raise bad(f"{where}.{key}", f"expected a string, got {_show(value)}",
                  "send back the reasoning of the reply as it came, or leave it out")
    return value


def _tool_calls(v: Any, where: str, role: Any) -> tuple[dict[str, Any], ...] | None:
    """An assistant message's `tool_calls` as OpenAI sends them back."""
    if v is None or v == []:
        return None
    if role != "assistant":
        raise _bad(f"{where}.tool_calls", "only assistant messages carry tool calls",
                   'send the tool\'s answer as {"role": "tool", "tool_call_id": ..., '
                   '"content": ...}')
    if not isinstance(v, list):
        raise _bad(f"{where}.tool_calls", f"expected a list, got {_show(v)}",
                   "send back the tool_calls of the reply as they came")
    out = []
    for j, call in enumerate(v):
        fn = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)
                and isinstance(fn.get("arguments"), str) and isinstance(call.get("id"), str)):
            raise _bad(f"{where}.tool_calls[{j}]", f"expected {{\"id\": STRING, \"type\": "
                       f"\"function\", \"function\": {{\"name\": STRING, \"arguments\": "
                       f"JSON STRING}}}}, got {_show(call)}",
                       "send back the tool_calls of the reply as they came")
        out.append({"id": call["id"], "type": "function",
                    "function": {"name": fn["name"], "arguments": fn["arguments"]}})
    return tuple(out)


_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
RESPONSE_FORMATS = ("text", "json_object", "json_schema")


def _response_format(d: Mapping[str, Any]) -> dict[str, Any] | None:
    """None for text; else {"type": "json_object"} or {"type": "json_schema", "json_schema":
    {"name", "schema", "strict"?, "description"?}} (the schema is compiled by the daemon)."""
    v = d.get("response_format")
    if v is None:
        return None
    hint = ('use {"type": "json_object"} or {"type": "json_schema", "json_schema": {"name": '
            '"x", "schema": {...}}}')
    if not isinstance(v, dict) or v.get("type") not in RESPONSE_FORMATS:
        raise _bad("response_format", f"expected an object with a type of "
                   f"{', '.join(RESPONSE_FORMATS)}, got {_show(v)}", hint)
    kind = v["type"]
    extra = sorted(set(v) - {"type", "json_schema"})
    if extra or (kind != "json_schema" and "json_schema" in v):
        raise _bad(f"response_format.{_show_key((extra or ['json_schema'])[0])}",
                   f"not a field of a {kind!r} response format", hint)
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    js = v.get("json_schema")
    where = "response_format.json_schema"
    if not isinstance(js, dict):
        raise _bad(where, f"expected an object, got {_show(js)}", hint)
    for key in js:
        if key not in ("name", "schema", "strict", "description"):
            raise _unknown(f"{where}.{key}", [f"{where}.{k}" for k in
                                              ("name", "schema", "strict", "description")])
    name = js.get("name")
    if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
        raise _bad(f"{where}.name", f"expected a name of 1..64 characters a-z A-Z 0-9 _ -, "
                   f"got {_show(name)}", 'use e.g. "name": "person"')
    schema = js.get("schema", {})
    if not isinstance(schema, dict):
        raise _bad(f"{where}.schema", f"expected a JSON Schema object, got {_show(schema)}",
                   'use e.g. {"type": "object", "properties": {...}}')
    strict = js.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise _bad(f"{where}.strict", f"expected true or false, got {_show(strict)}",
                   '"strict": true (the output always follows the schema here)')
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema,
                                                   "strict": bool(strict)}}


def _tools(d: Mapping[str, Any]) -> tuple[tuple[dict[str, Any], ...] | None,
                                          str | dict[str, Any] | None]:
    """(tools, tool_choice) validated; tool_choice defaults to "auto" with tools."""
    v, choice = d.get("tools"), d.get("tool_choice")
    hint = ('send [{"type": "function", "function": {"name": "get_weather", "parameters": '
            '{"type": "object", "properties": {...}}}}]')
    if v is None or v == []:
        if choice is not None and choice != "none":
            raise _bad("tool_choice", f"{_show(choice)} given without tools",
                       "send tools too, or leave tool_choice out")
        return None, None
    if not isinstance(v, list):
        raise _bad("tools", f"expected a list of tools, got {_show(v)}", hint)
    out, names = [], []
    for i, tool in enumerate(v):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise _bad(f"{where}.type", f"expected a tool of type \"function\", got "
                       f"{_show(tool)}", hint)
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise _bad(f"{where}.function", f"expected an object, got {_show(fn)}", hint)
        name = fn.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name) or name in names:
            problem = "is defined twice" if name in names else "is not a name of 1..64 " \
                "characters a-z A-Z 0-9 _ -"
            raise _bad(f"{where}.function.name", f"{_show(name)} {problem}",
                       "give each function a unique name such as get_weather")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise _bad(f"{where}.function.parameters", f"expected a JSON Schema object, got "
                       f"{_show(params)}", hint)
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise _bad(f"{where}.function.description", f"expected a string, got "
                       f"{_show(desc)}", "describe the function in a sentence")
        names.append(name)
        entry: dict[str, Any] = {"name": name, "parameters": params}
        if desc:
            entry["description"] = desc
        out.append({"type": "function", "function": entry})
    if choice is None:
        choice = "auto"
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or name not in names:
            raise _bad("tool_choice", f"{_show(choice)} names no function of tools (they "
                       f"are {', '.join(names)})", 'use {"type": "function", "function": '
                       '{"name": NAME}} with a NAME from tools, or "auto"')
        choice = {"type": "function", "function": {"name": name}}
    elif choice not in ("none", "auto", "required"):
        raise _bad("tool_choice", f"expected \"none\", \"auto\", \"required\" or "
                   f"{{\"type\": \"function\", ...}}, got {_show(choice)}",
                   'use "auto" (the model decides) or "required"')
    return tuple(out), choice

# ----- which top-level fields each endpoint takes ------------------------------------------------

_CHAT, _COMPLETION = "chat", "completion"
_BOTH = frozenset((_CHAT, _COMPLETION))
_COMMON = ("model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "n",
           "response_format", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs",
           "stream_options")
# not OpenAI's; honored (min_p, repeat_penalty, repeat_last_n: llama-server's names)
EXTENSION_FIELDS = ("top_k", "min_p", "repeat_penalty", "repeat_last_n", "priority",
                    "timeout_ms", "session")
HONORED_FIELDS: dict[str, frozenset[str]] = {
    _CHAT: frozenset(("messages", "max_completion_tokens", "top_logprobs", "tools",
                      "tool_choice", "reasoning_format", "chat_template_kwargs", *_COMMON,
                      *EXTENSION_FIELDS)),
    _COMPLETION: frozenset(("prompt", *_COMMON, *EXTENSION_FIELDS)),
}


def _is_str(v: Any) -> bool:
    return isinstance(v, str)


def _is_bool(v: Any) -> bool:
    return isinstance(v, bool)


def _is_one(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == 1


def _never(v: Any) -> bool:
    return False


# accepted, type checked, no effect: (endpoints, type check, what the type check wants)
IGNORED_FIELDS: dict[str, tuple[frozenset[str], Callable[[Any], bool], str]] = {
    "user": (_BOTH, _is_str, "a string"),
    "store": (frozenset((_CHAT,)), _is_bool, "true or false"),
    "metadata": (frozenset((_CHAT,)),
                 lambda v: isinstance(v, dict) and all(isinstance(x, str) for x in v.values()),
                 "an object of string values"),
    "service_tier": (frozenset((_CHAT,)), _is_str, "a string"),
    # one tool call per reply when the output is constrained to a call (docs/api.md)
    "parallel_tool_calls": (frozenset((_CHAT,)), _is_bool, "true or false"),
    "safety_identifier": (frozenset((_CHAT,)), _is_str, "a string"),
    "prompt_cache_key": (frozenset((_CHAT,)), _is_str, "a string"),
    # the prompt cache here is the runner's KV slots, reused by common prefix (docs/engines.md)
    "prompt_cache_retention": (frozenset((_CHAT,)), lambda v: v in ("in_memory", "24h"),
                               '"in_memory" or "24h"'),
    "prompt_cache_options": (frozenset((_CHAT,)), lambda v: isinstance(v, dict),
                             "an object"),
}

# OpenAI (or llama-server) parameters this server does not implement: 400 unless the value is
# the neutral one. (neutral check, the neutral value as shown, planned: "not supported yet")
_Unsupported = tuple[Callable[[Any], bool], str, bool]
UNSUPPORTED_FIELDS: dict[str, dict[str, _Unsupported]] = {
    _CHAT: {
        "functions": (lambda v: v == [], "[]", True),
        "function_call": (lambda v: v in ("none", "auto"), '"none"', True),
        "modalities": (lambda v: v == ["text"], '["text"]', False),
        "audio": (_never, "null", False),
        "prediction": (_never, "null", False),
        "web_search_options": (_never, "null", False),
        "reasoning_effort": (_never, "null", False),
        "verbosity": (_never, "null", False),
        "moderation": (_never, "null", False),
    },
    _COMPLETION: {
        "echo": (lambda v: v is False, "false", True),
        "suffix": (lambda v: v == "", '""', True),
        "best_of": (_is_one, "1", False),
    },
}
_STREAM_OPTIONS = ("include_usage", "include_obfuscation")
_UNKNOWN_HINTS: dict[tuple[str, str], str] = {
    (_COMPLETION, "max_completion_tokens"): "use max_tokens here (max_completion_tokens is a "
    "field of /v1/chat/completions)",
    (_COMPLETION, "messages"): "send messages to /v1/chat/completions, or a prompt here",
    (_CHAT, "prompt"): 'send "messages": [{"role": "user", "content": "..."}], or send the '
    "prompt to /v1/completions",
    (_CHAT, "n_predict"): "use max_completion_tokens (or max_tokens)",
    (_COMPLETION, "n_predict"): "use max_tokens",
}


def _unknown(key: str, takes: Iterable[str], hint: str | None = None,
             where: str = "") -> ApiError:
    """400 unknown_parameter naming `key`, with a close match or the fields `takes`."""
    shown = _show_key(key)
    if hint is None:
        close = difflib.get_close_matches(key, list(takes), n=1, cutoff=0.75)
        hint = (f"did you mean {close[0]!r}? " if close else "remove it; ") + (
            "docs/api.md lists the fields of every endpoint")
    return ApiError(400, "unknown_parameter", f"field {shown!r}: unknown parameter{where}. "
                    f"Hint: {hint}.", param=shown)


def _check_fields(d: Mapping[str, Any], chat: bool) -> None:
    """Every top-level field honored, ignored (type checked) or neutral; else a 400."""
    kind = _CHAT if chat else _COMPLETION
    honored = HONORED_FIELDS[kind]
    unsupported = UNSUPPORTED_FIELDS[kind]
    for key, value in d.items():
        if key in honored:
            continue
        ignored = IGNORED_FIELDS.get(key)
        if ignored is not None and kind in ignored[0]:
            if value is not None and not ignored[1](value):
                raise _bad(key, f"expected {ignored[2]}, got {_show(value)}",
                           f"send {ignored[2]}, or leave it out (it is accepted and ignored)")
            continue
        if key in unsupported:
            neutral, shown, planned = unsupported[key]
            if value is None or neutral(value):
                continue
            when = "is not supported yet" if planned else "is not supported by this server"
            raise _bad(key, f"{when} (got {_show(value)}; only {shown}, which changes nothing, "
                       "is accepted)", f"remove {key!r} (or send {shown})",
                       code="unsupported_parameter")
        takes = [*honored, *(k for k, v in IGNORED_FIELDS.items() if kind in v[0])]
        where = " for /v1/chat/completions" if chat else " for /v1/completions"
        raise _unknown(key, takes, _UNKNOWN_HINTS.get((kind, key)), where)


def _stream_options(value: Any) -> bool:
    """Whether `stream_options` asks for the usage chunk (include_usage)."""
    if value is None:
        return False
    if not isinstance(value, dict):
        raise _bad("stream_options", f"expected an object, got {_show(value)}",
                   'use {"include_usage": false} or leave it out')
    for key, v in value.items():
        where = f"stream_options.{_show_key(key)}"
        if key not in _STREAM_OPTIONS:
            raise _unknown(f"stream_options.{key}",
                           [f"stream_options.{k}" for k in _STREAM_OPTIONS])
        if v is not None and not isinstance(v, bool):
            raise _bad(where, f"expected true or false, got {_show(v)}", "send true or false")
    return value.get("include_usage") is True


def _logit_bias(d: Mapping[str, Any]) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias}: ids as decimal strings, bias in [-100, 100]; sorted by id.
    (The ids are checked against the model's vocabulary by the caller.)"""
    v = d.get("logit_bias")
    if v is None:
        return ()
    hint = 'use e.g. "logit_bias": {"50256": -100} (token ids from POST /tokenize)'
    if not isinstance(v, dict):
        raise _bad("logit_bias", f"expected an object of token id -> bias, got {_show(v)}",
                   hint)
    if len(v) > MAX_LOGIT_BIAS_ENTRIES:
        raise _bad("logit_bias", f"{len(v)} token ids given", f"bias at most "
                   f"{MAX_LOGIT_BIAS_ENTRIES} tokens")
    out = []
    for key, bias in v.items():
        where = f"logit_bias.{_show_key(key)}"
        if not (key.isascii() and key.isdigit() and len(key) <= 10):
            raise _bad(where, f"{_show(key)} is not a token id", hint)
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or bias != bias or (
                not -100 <= bias <= 100):
            raise _bad(where, f"bias {_show(bias)} is not a number in [-100, 100]",
                       "-100 bans the token, 100 all but forces it, 0 changes nothing")
        out.append((int(key), float(bias)))
    return tuple(sorted(out))


def _logprobs(d: Mapping[str, Any], chat: bool) -> int | None:
    """How many alternatives to report per token (None: no logprobs). Chat: `logprobs` true
    with `top_logprobs` 0..20; completions: `logprobs` 0..5."""
    if not chat:
        return _int(d, "logprobs", None, 0, COMPLETION_MAX_LOGPROBS)
    want = d.get("logprobs")
    if want is not None and not isinstance(want, bool):
        raise _bad("logprobs", f"expected true or false, got {_show(want)}",
                   'use "logprobs": true (and "top_logprobs": N for alternatives)')
    top = _int(d, "top_logprobs", None, 0, CHAT_MAX_LOGPROBS)
    if not want:
        if top:
            raise _bad("top_logprobs", f"{top} alternatives asked without \"logprobs\": true",
                       'send "logprobs": true with it')
        return None
    return top or 0


def _max_tokens(d: Mapping[str, Any], chat: bool, limit: int, default: int | None) -> int:
    """max_completion_tokens (chat) wins over max_tokens; neither: `default`, else until the
    context for chat and OpenAI's 16 for completions."""
    mt = _int(d, "max_tokens", None, 1, limit)
    mct = _int(d, "max_completion_tokens", None, 1, limit) if chat else None
    if mct is not None:
        return mct
    if mt is not None:
        return mt
    if default is not None:
        return default
    return UNTIL_CONTEXT if chat else COMPLETION_DEFAULT_MAX_TOKENS


def parse_generation(
    body: bytes | Mapping[str, Any],
    *,
    chat: bool | None,
    max_tokens_limit: int,
    default_max_tokens: int | None = None,
) -> GenerationRequest:
    """Validate a /v1/completions (chat=False), /v1/chat/completions (chat=True) or
    /v1/requests (chat=None: whichever of prompt / messages is present) body. With no
    `max_tokens` (or `max_completion_tokens`): `default_max_tokens` when given, else chat runs
    until end-of-sequence or the context and completions stop after 16 (OpenAI's defaults)."""
    if isinstance(body, (bytes, bytearray)):
        d = parse_json_body(body)
    else:
        d = dict(body)
        check_limits(d)
    if chat is None:
        if ("prompt" in d) == ("messages" in d):
            raise _bad("prompt", "give exactly one of 'prompt' or 'messages'",
                       'use "prompt": "text" or "messages": [...]')
        chat = "messages" in d
    _check_fields(d, chat)
    model = d.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise _bad("model", f"expected a model name, got {_show(model)}",
                   "GET /v1/models lists the names")
    prompt: str | None = None
    messages: tuple[ChatMessage, ...] | None = None
    tools, tool_choice = _tools(d) if chat else (None, None)
    if chat:
        messages = _messages(d)
    else:
        p = d.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
            p = p[0]
        if not isinstance(p, str):
            raise _bad("prompt", f"expected a string, got {_show(p)}",
                       'use "prompt": "Once upon a time"')
        prompt = p
    n = d.get("n")
    n = 1 if n is None else n
    if n != 1 or isinstance(n, bool):
        raise _bad("n", f"{_show(n)} choices requested", "only n=1 is supported")
    stream = d.get("stream")
    stream = False if stream is None else stream
    if not isinstance(stream, bool):
        raise _bad("stream", f"expected true or false, got {_show(stream)}",
                   'use "stream": true')
    seed = d.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0
                             or seed >= 2**63):
        raise _bad("seed", f"expected a non-negative integer, got {_show(seed)}",
                   "use an integer 0..2**63-1")
    return GenerationRequest(
        chat=chat,
        model=model,
        prompt=prompt,
        messages=messages,
        max_tokens=_max_tokens(d, chat, max_tokens_limit, default_max_tokens),
        temperature=_float(d, "temperature", 1.0, 0.0, 2.0),
        top_p=_float(d, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        top_k=int(_int(d, "top_k", 0, 0, 1 << 20) or 0),
        seed=seed,
        stop=_stop(d),
        stream=stream,
        priority=_int(d, "priority", None, MIN_PRIORITY, MAX_PRIORITY),
        timeout_ms=_int(d, "timeout_ms", None, 1, 7 * 24 * 3600 * 1000),
        session=_session(d),
        response_format=_response_format(d),
        tools=tools,
        tool_choice=tool_choice,
        min_p=_float(d, "min_p", 0.0, 0.0, 1.0),
        presence_penalty=_float(d, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_float(d, "frequency_penalty", 0.0, -2.0, 2.0),
        repeat_penalty=_float(d, "repeat_penalty", 1.0, 0.0, 100.0, lo_open=True),
        repeat_last_n=int(_int(d, "repeat_last_n", 64, -1, 1 << 20) or 0),
        logit_bias=_logit_bias(d),
        logprobs=_logprobs(d, chat),
        include_usage=_stream_options(d.get("stream_options")),
        reasoning_format=_reasoning_format(d.get("reasoning_format")),
        template_vars=_template_vars(d.get("chat_template_kwargs")),
    )


REASONING_FORMATS = ("auto", "deepseek", "none")
# names a chat template variable cannot have: the renderer's own inputs, and transformers'
# apply_chat_template parameters (runtime/chat_template.py's _NOT_VARIABLES, which this room
# does not import; tests/test_api_protocol.py checks this holds all of them)
_RESERVED_VARS = frozenset({"messages", "tools", "documents", "add_generation_prompt",
                            "chat_template", "continue_final_message", "tokenize",
                            "sanitize_control_tokens", "padding", "truncation", "max_length",
                            "return_tensors", "return_dict", "return_assistant_tokens_mask",
                            "tokenizer_kwargs", "conversation"})
_VAR_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")


def _reasoning_format(value: Any) -> str:
    if value is None:
        return "auto"
    if value not in REASONING_FORMATS:
        raise _bad("reasoning_format", f"expected one of {', '.join(REASONING_FORMATS)}, got "
                   f"{_show(value)}", 'use "auto" (a thinking model\'s reasoning apart, in '
                   'reasoning_content) or "none" (left in the content)')
    return "none" if value == "none" else "auto"


def _template_vars(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    hint = 'send an object of template variables, e.g. {"enable_thinking": false}'
    if not isinstance(value, dict) or len(value) > 16:
        raise _bad("chat_template_kwargs", f"expected an object of at most 16 variables, got "
                   f"{_show(value)}", hint)
    for key in value:
        if not _VAR_NAME.fullmatch(key) or key in _RESERVED_VARS:
            why = "is the template's own input" if key in _RESERVED_VARS else \
                "is not a variable name (a letter or _, then letters, digits, _)"
            raise _bad(f"chat_template_kwargs.{key}"[:120], f"{_show(key)} {why}", hint)
    return dict(value) or None


# ----- /tokenize and /detokenize (llama-server's shapes) ----------------------------------------

TOKENIZE_FIELDS = ("content", "add_special", "parse_special", "with_pieces", "model")
DETOKENIZE_FIELDS = ("tokens", "model")


@dataclass(frozen=True)
class TokenizeRequest:
    content: str
    add_special: bool  # BOS when the model's vocabulary adds one (llama-server: false)
    parse_special: bool  # control-token text such as <|im_start|> is that token (default true)
    with_pieces: bool  # [{"id", "piece"}] instead of bare ids
    model: str | None


@dataclass(frozen=True)
class DetokenizeRequest:
    tokens: tuple[int, ...]
    model: str | None


def _known_only(d: Mapping[str, Any], takes: Sequence[str], path: str) -> None:
    for key in d:
        if key not in takes:
            raise _unknown(key, takes, f"remove it; {path} takes {', '.join(takes)}",
                           f" for {path}")


def _model_field(d: Mapping[str, Any]) -> str | None:
    model = d.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise _bad("model", f"expected a model name, got {_show(model)}",
                   "GET /v1/models lists the names; leave it out for the default model")
    return model


def bool_field(d: Mapping[str, Any], key: str, default: bool) -> bool:
    """`d[key]` as a JSON boolean (`default` when absent or null); 400 naming `key` else."""
    v = d.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(key, f"expected true or false, got {_show(v)}", f'use "{key}": true')
    return v


def parse_tokenize(body: bytes) -> TokenizeRequest:
    """POST /tokenize: {"content": str, "add_special"?, "parse_special"?, "with_pieces"?,
    "model"?} as llama-server takes it (the model is this server's addition)."""
    d = parse_json_body(body)
    _known_only(d, TOKENIZE_FIELDS, "/tokenize")
    content = d.get("content")
    if not isinstance(content, str):
        raise _bad("content", f"expected a string, got {_show(content)}",
                   'send {"content": "Hello world"}')
    return TokenizeRequest(content=content, add_special=bool_field(d, "add_special", False),
                           parse_special=bool_field(d, "parse_special", True),
                           with_pieces=bool_field(d, "with_pieces", False),
                           model=_model_field(d))


def parse_detokenize(body: bytes) -> DetokenizeRequest:
    """POST /detokenize: {"tokens": [int, ...], "model"?} (ids are checked against the
    model's vocabulary by the caller)."""
    d = parse_json_body(body)
    _known_only(d, DETOKENIZE_FIELDS, "/detokenize")
    tokens = d.get("tokens")
    if not isinstance(tokens, list):
        raise _bad("tokens", f"expected a list of token ids, got {_show(tokens)}",
                   'send {"tokens": [19556, 905]} (ids from POST /tokenize)')
    for i, t in enumerate(tokens):
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise _bad(f"tokens[{i}]", f"expected a non-negative integer, got {_show(t)}",
                       "send token ids as integers (POST /tokenize returns them)")
    return DetokenizeRequest(tokens=tuple(tokens), model=_model_field(d))


# One token's log-probabilities as the control plane holds them: (token id, its logprob, the
# likeliest [(id, logprob), ...], the character offset of its text in the completion); logprob
# None when unknown (generated before a daemon restart).
TokenLogprob = tuple[int, float | None, Sequence[tuple[int, float]], int]


def _token_str(raw: bytes) -> str:
    """A token's text; bytes that are not whole UTF-8 characters as \\xNN escapes (the
    `bytes` field carries them exactly)."""
    return raw.decode("utf-8", errors="backslashreplace")


def chat_logprobs(entries: Sequence[TokenLogprob],
                  token_bytes: Callable[[int], bytes]) -> dict[str, Any]:
    """Chat's `choices[i].logprobs`: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    def one(tid: int, lp: float | None) -> dict[str, Any]:
        raw = token_bytes(tid)
        return {"token": _token_str(raw), "logprob": lp, "bytes": list(raw)}

    return {"content": [{**one(tid, lp), "top_logprobs": [one(i, v) for i, v in top]}
                        for tid, lp, top, _ in entries], "refusal": None}


def completion_logprobs(entries: Sequence[TokenLogprob],
                        token_bytes: Callable[[int], bytes]) -> dict[str, Any]:
    """Completions' `choices[i].logprobs`: {tokens, token_logprobs, top_logprobs, text_offset}
    (`text_offset`: where each token's text starts in the completion's text)."""
    tokens, lps, tops, offsets = [], [], [], []
    for tid, lp, top, at in entries:
        tokens.append(_token_str(token_bytes(tid)))
        lps.append(lp)
        tops.append({_token_str(token_bytes(i)): v for i, v in top} if lp is not None
                    else None)
        offsets.append(at)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops,
            "text_offset": offsets}


def completion_response(
    *, rid: str, model: str, created: int, chat: bool, text: str, finish_reason: str | None,
    prompt_tokens: int, completion_tokens: int, tool_calls: list[dict[str, Any]] | None = None,
    logprobs: dict[str, Any] | None = None, cached_tokens: int = 0,
    reasoning: str | None = None,
) -> dict[str, Any]:
    """The OpenAI-shaped (non-streaming) reply; with `tool_calls` (chat), a reply that calls
    tools: content `text` (the text before the calls) or null, finish_reason "tool_calls"
    ("length" kept: a call cut short) (`logprobs`: chat_logprobs or completion_logprobs, when
    the request asked);
    `cached_tokens`: prompt tokens the prompt cache held (usage.prompt_tokens_details, as
    OpenAI reports its own prompt caching)."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
        if tool_calls:
            choice["message"].update(content=text or None, tool_calls=tool_calls)
            if finish_reason != "length":
                choice["finish_reason"] = "tool_calls"
        if logprobs is not None:  # every token's, a call's too (as a stream carries them)
            choice["logprobs"] = logprobs
    else:
        choice["text"] = text
        choice["logprobs"] = logprobs
    if chat and reasoning is not None:  # a thinking model's reasoning (llama-server's name)
        choice["message"]["reasoning_content"] = reasoning
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
            "prompt_tokens_details": {"cached_tokens": cached_tokens},
        },
    }


def completion_chunk(
    *, rid: str, model: str, created: int, chat: bool, text: str | None,
    finish_reason: str | None, first: bool = False, logprobs: dict[str, Any] | None = None,
    include_usage: bool = False, tool_calls: list[dict[str, Any]] | None = None,
    reasoning: str | None = None,
) -> dict[str, Any]:
    """One streamed chunk; with chat, the first chunk carries the assistant role. `logprobs`:
    those of the tokens this chunk carries; `include_usage`: the chunk has `"usage": null`
    (the usage comes in `usage_chunk`, last); `tool_calls` (chat): the calls' parts as OpenAI
    streams them, each with its `index` (a new call's id, type and name, then more of its
    arguments' text); `reasoning` (chat): a piece of a thinking model's reasoning
    (`delta.reasoning_content`)."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason}
    if chat:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if text:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = tool_calls
        choice["delta"] = delta
        if logprobs is not None:
            choice["logprobs"] = logprobs
    else:
        choice["text"] = text or ""
        choice["logprobs"] = logprobs
    out: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
    }
    if include_usage:
        out["usage"] = None
    return out


def usage_chunk(*, rid: str, model: str, created: int, chat: bool, prompt_tokens: int,
                completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """The last chunk of a stream with stream_options.include_usage: no choices, the usage
    (the whole reply's, `prompt_tokens_details` included)."""
    return {
        "id": rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens},
        },
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
