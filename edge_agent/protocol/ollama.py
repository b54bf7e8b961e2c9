"""Ollama's HTTP API (`/api/chat`, `/api/generate`, `/api/tags`, ...): validation and shapes.

Invariants owned here:
- Pure: no I/O, no clock (callers pass times as epoch seconds), no randomness.
- The sampling options are validated by protocol/api.py's `parse_generation` (same ranges, same
  refusal policy: honored, or 400 naming the option unless it carries its neutral value); an
  error about one of them names it as Ollama does, `options.NAME`. Ollama's defaults apply
  where an option is absent (OLLAMA_DEFAULTS). Options api.py does not know are handled here:
  IGNORED_OPTIONS (accepted, type checked, no effect), UNSUPPORTED_OPTIONS (400 unless
  neutral), anything else 400 naming it.
- `format` ("json" or a JSON Schema) becomes the OpenAI request's `response_format`.
- Every top-level field is known or refused (400 naming it); fields of features this server
  does not have (`images`, `template`, `context`, `suffix`, `logprobs`, image generation)
  are accepted only with their neutral value. `think` is a boolean (or a level, "high" / "medium" /
  "low", taken as true, as Ollama takes it for a model without levels): false becomes the template
  variable `enable_thinking` false (daemon/ollama.py leaves the thought out of the reply).
- `messages` take Ollama's roles (system, user, assistant, tool); they reach the model's chat
  template as the OpenAI chat route's do. An empty `messages` (or an empty `prompt`) asks for
  a load, or with `keep_alive` 0 an unload (`OllamaRequest.generation` is None).
- `tools` (/api/chat) are the OpenAI route's `tools` with tool_choice "auto" (Ollama has no
  tool_choice), validated by api.py's parser. An assistant message's `tool_calls` (arguments a
  JSON object) become ChatMessage.tool_calls in OpenAI's shape (arguments a JSON string, an id
  `call_I_J` unless the call carries one); a `tool` message answers the call its
  `tool_call_id` names, else the oldest unanswered earlier call of its `tool_name`, else the
  oldest unanswered call (tool_call_id None when there is none). A reply's calls go back in
  Ollama's shape (`ollama_tool_calls`).
- Error bodies are Ollama's: `{"error": message}`, the HTTP status saying the class.
- Durations are integers of nanoseconds; points in time RFC 3339 in UTC.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from edge_agent.protocol.api import (
    UNTIL_CONTEXT,
    ApiError,
    ChatMessage,
    GenerationRequest,
    bool_field,
    message_reasoning,
    parse_generation,
    parse_json_body,
)
from edge_agent.protocol.embeddings import EmbeddingsRequest

__all__ = [
    "OllamaEmbed",
    "parse_embed",
    "renamed",
    "API_VERSION",
    "FOREVER_EPOCH",
    "IGNORED_OPTIONS",
    "KeepAlive",
    "OLLAMA_DEFAULTS",
    "OllamaRequest",
    "Stats",
    "UNSUPPORTED_OPTIONS",
    "chunk",
    "error_body",
    "final",
    "human_number",
    "is_ollama_path",
    "model_details",
    "model_info",
    "model_name",
    "ndjson",
    "ollama_tool_calls",
    "parse_chat",
    "parse_generate",
    "parse_keep_alive",
    "parse_show",
    "quantization_level",
    "rfc3339",
    "show_body",
]

API_VERSION = "0.9.0"  # the Ollama API level these routes follow (GET /api/version)
ROLES = ("system", "user", "assistant", "tool")
FOREVER_EPOCH = 253402300799.0  # 9999-12-31T23:59:59Z: expires_at of a model kept loaded
_MAX_KEEP_ALIVE_S = 100 * 365 * 86400.0  # longer is "forever" (Go's Duration ends at 292 y)
OLLAMA_DEFAULTS: dict[str, Any] = {"temperature": 0.8, "top_k": 40, "top_p": 0.9}

# Ollama option -> the OpenAI field parse_generation validates and honors
_MAPPED = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "stop": "stop"}
# penalties: passed to parse_generation under the same name when api.py knows the field
# (honored there, or refused unless neutral); unknown to api.py: UNSUPPORTED_OPTIONS below
_PASS_THROUGH = ("presence_penalty", "frequency_penalty", "repeat_penalty", "repeat_last_n",
                 "min_p")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_bool(v: Any) -> bool:
    return isinstance(v, bool)


# accepted, type checked, no effect: runtime knobs the daemon's configuration owns
# (models.NAME.context, runtime.threads, runtime.mlock) or that only matter with an option
# refused below; (type check, what it wants)
IGNORED_OPTIONS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "num_ctx": (_is_int, "an integer"), "num_batch": (_is_int, "an integer"),
    "num_gpu": (_is_int, "an integer"), "main_gpu": (_is_int, "an integer"),
    "num_thread": (_is_int, "an integer"), "num_keep": (_is_int, "an integer"),
    "numa": (_is_bool, "true or false"), "low_vram": (_is_bool, "true or false"),
    "f16_kv": (_is_bool, "true or false"), "logits_all": (_is_bool, "true or false"),
    "vocab_only": (_is_bool, "true or false"), "use_mmap": (_is_bool, "true or false"),
    "use_mlock": (_is_bool, "true or false"), "embedding_only": (_is_bool, "true or false"),
    "penalize_newline": (_is_bool, "true or false"),
    "mirostat_tau": (_is_num, "a number"), "mirostat_eta": (_is_num, "a number"),
}
# sampling options not implemented: 400 unless the neutral value; (neutral check, shown)
UNSUPPORTED_OPTIONS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "typical_p": (lambda v: _is_num(v) and v == 1, "1"),
    "tfs_z": (lambda v: _is_num(v) and v == 1, "1"),
    "mirostat": (lambda v: _is_num(v) and v == 0, "0"),
}
_OPTIONS = sorted({"seed", "num_predict", *_MAPPED, *_PASS_THROUGH, *IGNORED_OPTIONS,
                   *UNSUPPORTED_OPTIONS})
# top-level fields: (endpoints, neutral check, neutral value shown, why it is refused)
_CHAT, _GEN = "/api/chat", "/api/generate"
_BOTH = (_CHAT, _GEN)
_NEUTRAL_FIELDS: dict[str, tuple[tuple[str, ...], Callable[[Any], bool], str, str]] = {
    "logprobs": (_BOTH, lambda v: v is False, "false", "log probabilities are not supported"),
    "top_logprobs": (_BOTH, lambda v: v == 0 and _is_int(v), "0", "log probabilities are not "
                     "supported"),
    "images": ((_GEN,), lambda v: v == [], "[]", "the models served here take no images"),
    "suffix": ((_GEN,), lambda v: v == "", '""', "fill-in-the-middle (suffix) is not "
               "supported"),
    "template": ((_GEN,), lambda v: v == "", '""', "the prompt template is the model's own "
                 "(the GGUF's chat template); render the prompt yourself and send it with "
                 '"raw": true'),
    "context": ((_GEN,), lambda v: v == [], "[]", "`context` (deprecated by Ollama) is not "
                "kept; send the conversation as messages to /api/chat"),
    "width": ((_GEN,), lambda v: False, "null", "image generation is not supported"),
    "height": ((_GEN,), lambda v: False, "null", "image generation is not supported"),
    "steps": ((_GEN,), lambda v: False, "null", "image generation is not supported"),
}
_HONORED = {_CHAT: ("model", "messages", "stream", "options", "keep_alive", "format", "tools",
                    "think"),
            _GEN: ("model", "prompt", "system", "raw", "stream", "options", "keep_alive",
                   "format", "think")}
_MESSAGE_KEYS = ("role", "content", "images", "tool_calls", "tool_name", "tool_call_id",
                 "thinking")
_CALL_KEYS, _FUNCTION_KEYS = ("function", "id", "type"), ("name", "arguments", "index")
_DURATION = re.compile(r"([0-9]*\.?[0-9]+)(ns|us|µs|μs|ms|s|m|h)")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0,
           "h": 3600.0}
# llama.cpp's llama_ftype (general.file_type) -> the name Ollama shows as quantization_level
FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1",
              10: "Q2_K", 11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M",
              16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K", 19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S",
              22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL", 26: "IQ3_S", 27: "IQ3_M",
              28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16", 36: "TQ1_0",
              37: "TQ2_0", 38: "MXFP4"}


@dataclass(frozen=True)
class KeepAlive:
    """How long the model stays loaded after the request (None: until told otherwise)."""

    seconds: float | None


@dataclass(frozen=True)
class OllamaRequest:
    chat: bool  # /api/chat (message objects) or /api/generate (response strings)
    model: str  # as the client named it (echoed back); model_name() resolves it
    generation: GenerationRequest | None  # None: load (or unload) the model only
    keep_alive: KeepAlive | None  # None: not given (the model's configured ttl_s)
    stream: bool
    # a thinking model's reasoning: in `thinking` (None: not given, or true), or not thought
    # at all where the template can turn it off and left out of the reply (false)
    think: bool | None = None


@dataclass(frozen=True)
class Stats:
    """The final object's statistics, in seconds (sent as nanoseconds)."""

    total_s: float
    load_s: float
    prompt_tokens: int
    prompt_s: float
    eval_tokens: int
    eval_s: float

    def fields(self) -> dict[str, int]:
        def ns(s: float) -> int:
            return max(0, round(s * 1e9))

        return {"total_duration": ns(self.total_s), "load_duration": ns(self.load_s),
                "prompt_eval_count": self.prompt_tokens, "prompt_eval_duration": ns(self.prompt_s),
                "eval_count": self.eval_tokens, "eval_duration": ns(self.eval_s)}


def _bad(field: str, problem: str, hint: str, code: str = "invalid_request") -> ApiError:
    return ApiError(400, code, f"field {field!r}: {problem}. Hint: {hint}.", param=field)


def _show(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 80 else text[:80] + "...(cut)"


def is_ollama_path(path: str) -> bool:
    """Errors on these paths take Ollama's shape."""
    return path == "/api" or path.startswith("/api/")


def error_body(message: str) -> bytes:
    return json.dumps({"error": message}, ensure_ascii=False).encode()


def model_name(name: str) -> str:
    """The registered name an Ollama client means: `NAME:latest` is `NAME`."""
    return name[: -len(":latest")] if name.endswith(":latest") else name


def parse_keep_alive(value: Any) -> KeepAlive:
    """Seconds (a number), or a Go duration ("5m", "1h30m", "0", "-1s"); negative: forever."""
    seconds: float | None = None
    if _is_num(value) and math.isfinite(value):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip()
        sign = -1.0 if text.startswith("-") else 1.0
        body = text.lstrip("+-")
        if body.replace(".", "", 1).isdigit():  # a bare number: seconds
            seconds = sign * float(body)
        elif body and _DURATION.sub("", body) == "":
            seconds = sign * sum(float(n) * _UNIT_S[u] for n, u in _DURATION.findall(body))
    if seconds is None:
        raise _bad("keep_alive", f"expected seconds or a duration, got {_show(value)}",
                   'use e.g. "5m", "1h", 300, 0 (unload after the request) or -1 (stay loaded)')
    if seconds < 0 or seconds > _MAX_KEEP_ALIVE_S:
        return KeepAlive(None)
    return KeepAlive(seconds)


def _check_fields(d: Mapping[str, Any], path: str) -> None:
    takes = [*_HONORED[path], *(k for k, v in _NEUTRAL_FIELDS.items() if path in v[0])]
    for key, value in d.items():
        if key in _HONORED[path]:
            continue
        neutral = _NEUTRAL_FIELDS.get(key)
        if neutral is None or path not in neutral[0]:
            close = difflib.get_close_matches(key, takes, n=1, cutoff=0.75)
            raise ApiError(400, "unknown_parameter", f"field {key!r}: unknown parameter for "
                           f"{path}. Hint: " + (f"did you mean {close[0]!r}?" if close else
                                                f"remove it; {path} takes {', '.join(takes)}")
                           + " (docs/api.md).", param=key)
        if value is not None and not neutral[1](value):
            raise _bad(key, f"{neutral[3]} (got {_show(value)}; only {neutral[2]}, which "
                       "changes nothing, is accepted)", f"remove {key!r}",
                       code="unsupported_parameter")


def _model(d: Mapping[str, Any]) -> str:
    model = d.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model", f"expected a model name, got {_show(model)}",
                   "GET /api/tags lists the names")
    return model


def _options(d: Mapping[str, Any], limit: int) -> tuple[dict[str, Any], dict[str, str]]:
    """The OpenAI-shaped sampling fields for parse_generation, and their Ollama names."""
    opts = d.get("options")
    if opts is None:
        opts = {}
    if not isinstance(opts, dict):
        raise _bad("options", f"expected an object, got {_show(opts)}",
                   'use e.g. "options": {"temperature": 0, "num_predict": 64}')
    fields: dict[str, Any] = dict(OLLAMA_DEFAULTS)
    names: dict[str, str] = {}
    for key, v in opts.items():
        where = f"options.{key}"
        if v is None:  # as if absent
            continue
        if key in _MAPPED or key in _PASS_THROUGH:
            fields[_MAPPED.get(key, key)] = v
            names[_MAPPED.get(key, key)] = where
        elif key == "seed":
            if not _is_int(v) or v >= 2**63:
                raise _bad(where, f"expected an integer, got {_show(v)}",
                           "use an integer 0..2**63-1 (negative: a random seed)")
            if v >= 0:
                fields["seed"] = v
        elif key == "num_predict":
            if not _is_int(v) or not -2 <= v <= limit:
                raise _bad(where, f"expected an integer -2..{limit}, got {_show(v)}",
                           f"use 1..{limit} tokens, or -1 (until end-of-sequence or the "
                           "context)")
            if v > 0:
                fields["max_tokens"] = v
        elif key in IGNORED_OPTIONS:
            check, wants = IGNORED_OPTIONS[key]
            if not check(v):
                raise _bad(where, f"expected {wants}, got {_show(v)}",
                           f"send {wants}, or leave it out (it is accepted and ignored)")
        elif key in UNSUPPORTED_OPTIONS:
            neutral, shown = UNSUPPORTED_OPTIONS[key]
            if not neutral(v):
                raise _bad(where, f"is not supported yet (got {_show(v)}; only {shown}, which "
                           "changes nothing, is accepted)", f"remove {where!r}",
                           code="unsupported_parameter")
        else:
            close = difflib.get_close_matches(key, _OPTIONS, n=1, cutoff=0.75)
            raise ApiError(400, "unknown_parameter", f"field {where!r}: unknown option. Hint: "
                           + (f"did you mean 'options.{close[0]}'?" if close else
                              "remove it; docs/api.md lists the options"), param=where)
    return fields, names


def _generation(d: Mapping[str, Any], *, model: str, stream: bool, limit: int,
                messages: tuple[ChatMessage, ...] | None, prompt: str | None,
                messages_field: str = "messages") -> GenerationRequest:
    fields, names = _options(d, limit)
    body: dict[str, Any] = {"model": model, "stream": stream, **fields}
    fmt = d.get("format")
    if fmt == "json":
        body["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict):
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "format", "schema": fmt}}
    elif fmt not in (None, ""):
        raise _bad("format", f'expected "json" or a JSON Schema object, got {_show(fmt)}',
                   'use "format": "json" or "format": {"type": "object", ...}')
    names["response_format"] = "format"
    if messages is not None:  # checked here (Ollama's roles); a stand-in for api.py's check
        body["messages"] = [{"role": "user", "content": ""}]
        if d.get("tools") is not None:  # validated there, tool_choice "auto"
            body["tools"] = d["tools"]
            body["stream"] = False  # a streamed reply with tools is held (daemon/ollama.py)
    else:
        body["prompt"] = prompt
    try:
        greq = parse_generation(body, chat=messages is not None, max_tokens_limit=limit,
                                default_max_tokens=UNTIL_CONTEXT)
    except ApiError as exc:
        raise renamed(exc, names) from None
    if messages is None:
        return greq
    return dataclasses.replace(greq, messages=messages, stream=stream,
                               messages_field=messages_field)


def renamed(exc: ApiError, names: Mapping[str, str] = {"response_format": "format"}  # noqa: B006 - read only
             ) -> ApiError:
    """An error about an OpenAI field, naming the Ollama option it came from."""
    new = names.get(exc.param or "")
    if new is None:
        return exc
    message = exc.message.replace(f"'{exc.param}'", f"'{new}'")
    return ApiError(exc.status, exc.code, message, headers=exc.headers, param=new)


def _messages(d: Mapping[str, Any]) -> tuple[ChatMessage, ...]:
    v = d.get("messages")
    if v is None:
        return ()
    if not isinstance(v, list):
        raise _bad("messages", f"expected a list of {{role, content}} objects, got {_show(v)}",
                   'use "messages": [{"role": "user", "content": "Hi"}]')
    out = []
    pending: list[tuple[str, str]] = []  # (id, name) of the calls no tool message answered yet
    for i, m in enumerate(v):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(where, f"expected an object, got {_show(m)}",
                       'use {"role": "user", "content": "..."}')
        for key in m:
            if key not in _MESSAGE_KEYS:
                raise _bad(f"{where}.{key}", "unknown message field",
                           f"remove it; a message takes {', '.join(_MESSAGE_KEYS)}",
                           code="unknown_parameter")
        role = m.get("role")
        if role not in ROLES:
            raise _bad(f"{where}.role", f"{_show(role)} is not a known role",
                       f"use one of {', '.join(ROLES)}")
        content = "" if m.get("content") is None else m["content"]
        if not isinstance(content, str):
            raise _bad(f"{where}.content", f"expected a string, got {_show(content)}",
                       "send the message text as a string")
        if m.get("images") not in (None, []):
            raise _bad(f"{where}.images", "the models served here take no images",
                       "remove 'images' from the message", code="unsupported_parameter")
        for key in ("tool_name", "tool_call_id"):
            if m.get(key) is not None and not isinstance(m[key], str):
                raise _bad(f"{where}.{key}", f"expected a string, got {_show(m[key])}",
                           "send a string or leave it out")
        calls = _message_calls(m.get("tool_calls"), where, role, i)
        if calls:
            pending.extend((c["id"], c["function"]["name"]) for c in calls)
        call_id = _answers(m, pending) if role == "tool" else None
        out.append(ChatMessage(role, content, calls, call_id,
                               message_reasoning(m, "thinking", where, role, _bad)))
    return tuple(out)


def _message_calls(v: Any, where: str, role: str, i: int) -> tuple[dict[str, Any], ...] | None:
    """An assistant message's `tool_calls` (Ollama's shape) in OpenAI's, as api.py keeps them."""
    if v is None or v == []:
        return None
    hint = ('send back the message of the reply as it came: "tool_calls": [{"function": '
            '{"name": "get_weather", "arguments": {"city": "Paris"}}}]')
    if role != "assistant":
        raise _bad(f"{where}.tool_calls", "only assistant messages carry tool calls",
                   'send a tool\'s result as {"role": "tool", "tool_name": NAME, "content": '
                   '"..."}')
    if not isinstance(v, list):
        raise _bad(f"{where}.tool_calls", f"expected a list, got {_show(v)}", hint)
    out = []
    for j, call in enumerate(v):
        at = f"{where}.tool_calls[{j}]"
        if not isinstance(call, dict):
            raise _bad(at, f"expected an object, got {_show(call)}", hint)
        fn = call.get("function")
        for key, keys, obj in ((at, _CALL_KEYS, call), (f"{at}.function", _FUNCTION_KEYS, fn)):
            for k in obj if isinstance(obj, dict) else ():
                if k not in keys:
                    raise _bad(f"{key}.{k}", "unknown field of a tool call", f"remove it; "
                               f"{key.rsplit('.', 1)[-1]} takes {', '.join(keys)}",
                               code="unknown_parameter")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise _bad(f"{at}.function", f'expected {{"name": STRING, "arguments": OBJECT}}, '
                       f"got {_show(fn)}", hint)
        args = {} if fn.get("arguments") is None else fn["arguments"]
        if not isinstance(args, dict):
            raise _bad(f"{at}.function.arguments", f"expected a JSON object, got {_show(args)}",
                       'send the arguments as an object, e.g. {"city": "Paris"} (a JSON '
                       "string is the OpenAI routes' form)")
        if fn.get("index") is not None and not _is_int(fn["index"]):
            raise _bad(f"{at}.function.index", f"expected an integer, got {_show(fn['index'])}",
                       "send back the index of the reply's call, or leave it out")
        cid = call.get("id")
        if cid is not None and (not isinstance(cid, str) or not cid):
            raise _bad(f"{at}.id", f"expected a non-empty string, got {_show(cid)}",
                       "send back the id of the reply's call, or leave it out")
        if call.get("type") not in (None, "function"):
            raise _bad(f"{at}.type", f'expected "function", got {_show(call["type"])}', hint)
        out.append({"id": cid or f"call_{i}_{j}", "type": "function",
                    "function": {"name": fn["name"],
                                 "arguments": json.dumps(args, ensure_ascii=False)}})
    return tuple(out)


def _answers(m: Mapping[str, Any], pending: list[tuple[str, str]]) -> str | None:
    """The id of the earlier call a `tool` message answers (taken off `pending`)."""
    by_id, name = m.get("tool_call_id"), m.get("tool_name")
    for k, (cid, fname) in enumerate(pending):
        if (cid == by_id) if by_id else (name is None or fname == name):
            del pending[k]
            return cid
    return by_id or None


def _common(body: bytes, path: str) -> tuple[dict[str, Any], str, bool, KeepAlive | None]:
    d = parse_json_body(body)
    _check_fields(d, path)
    ka = d.get("keep_alive")
    return d, _model(d), bool_field(d, "stream", True), None if ka is None else parse_keep_alive(ka)


THINK_LEVELS = ("high", "medium", "low")


def _think(d: Mapping[str, Any]) -> bool | None:
    """`think`: a boolean, or one of Ollama's levels, which turn thinking on (as Ollama takes
    them for a model with no levels of its own: every model whose thought is parsed here)."""
    v = d.get("think")
    if v in THINK_LEVELS:
        return True
    if v is not None and not isinstance(v, bool):
        raise _bad("think", f"expected true, false or one of {', '.join(THINK_LEVELS)}, got "
                   f"{_show(v)}", 'use "think": true (the reasoning in `thinking`) or false '
                   "(no thinking)")
    return v


def _thinking(greq: GenerationRequest, think: bool | None) -> GenerationRequest:
    """`think: false` asks the template not to think (Qwen3's `enable_thinking`)."""
    if think is False:
        return dataclasses.replace(greq, template_vars={"enable_thinking": False})
    return greq


def parse_chat(body: bytes, *, max_tokens_limit: int) -> OllamaRequest:
    """POST /api/chat. No messages: a load (an unload with keep_alive 0)."""
    d, model, stream, ka = _common(body, _CHAT)
    think = _think(d)
    messages = _messages(d)
    if not messages:
        _options(d, max_tokens_limit)  # checked all the same
        return OllamaRequest(chat=True, model=model, generation=None, keep_alive=ka,
                             stream=stream)
    greq = _generation(d, model=model, stream=stream, limit=max_tokens_limit,
                       messages=messages, prompt=None)
    return OllamaRequest(chat=True, model=model, generation=_thinking(greq, think),
                         keep_alive=ka, stream=stream, think=think)


def parse_generate(body: bytes, *, max_tokens_limit: int) -> OllamaRequest:
    """POST /api/generate: `prompt` through the chat template as a user turn after `system`,
    or as is with `raw`. No prompt and no system: a load (an unload with keep_alive 0)."""
    d, model, stream, ka = _common(body, _GEN)
    think = _think(d)
    texts = {}
    for key in ("prompt", "system"):
        v = d.get(key)
        if v is not None and not isinstance(v, str):
            raise _bad(key, f"expected a string, got {_show(v)}", f'use "{key}": "..."')
        texts[key] = v or ""
    raw = bool_field(d, "raw", False)
    if raw and texts["system"]:
        raise _bad("system", "a raw prompt is sent as is, so a system message has nowhere to "
                   "go", 'put it in the prompt yourself, or drop "raw"')
    if raw and think is not None:
        raise _bad("think", "a raw prompt is sent as is, without the template that opens or "
                   "closes a thought, and its reply is given as written", 'drop "think", or '
                   'drop "raw" to have the prompt rendered as a user turn')
    if not texts["prompt"] and not texts["system"]:
        _options(d, max_tokens_limit)
        return OllamaRequest(chat=False, model=model, generation=None, keep_alive=ka,
                             stream=stream)
    if raw:
        greq = _generation(d, model=model, stream=stream, limit=max_tokens_limit,
                           messages=None, prompt=texts["prompt"])
    else:
        turns = [ChatMessage("system", texts["system"])] if texts["system"] else []
        turns.append(ChatMessage("user", texts["prompt"]))
        greq = _generation(d, model=model, stream=stream, limit=max_tokens_limit,
                           messages=tuple(turns), prompt=None, messages_field="prompt")
    return OllamaRequest(chat=False, model=model, generation=_thinking(greq, think),
                         keep_alive=ka, stream=stream, think=think)


@dataclass(frozen=True)
class OllamaEmbed:
    model: str
    request: EmbeddingsRequest  # what POST /v1/embeddings would have parsed
    keep_alive: KeepAlive | None
    legacy: bool  # /api/embeddings: one `prompt`, one `embedding` in the reply


_EMBED_FIELDS = ("model", "input", "truncate", "options", "keep_alive", "dimensions")
_LEGACY_EMBED_FIELDS = ("model", "prompt", "options", "keep_alive")


def parse_embed(body: bytes, *, legacy: bool = False) -> OllamaEmbed:
    """POST /api/embed ({"model", "input": text or [texts], "truncate"?, "dimensions"?}) or the
    older /api/embeddings ({"model", "prompt"}). `options` is type checked and ignored (no
    sampling happens); `truncate` (default true, as Ollama) cuts an input to the context."""
    d = parse_json_body(body)
    known = _LEGACY_EMBED_FIELDS if legacy else _EMBED_FIELDS
    for key in d:
        if key not in known:
            raise _bad(key, f"unknown parameter for /api/{'embeddings' if legacy else 'embed'}",
                       f"send {', '.join(known)}", code="unknown_parameter")
    model = _model(d)
    ka = d.get("keep_alive")
    options = d.get("options")
    if options is not None and not isinstance(options, dict):
        raise _bad("options", f"expected an object, got {_show(options)}",
                   'use "options": {} or leave it out')
    key = "prompt" if legacy else "input"
    v = d.get(key)
    texts = [v] if isinstance(v, str) else v
    if not isinstance(texts, list) or not texts or not all(
            isinstance(t, str) and t for t in texts):
        raise _bad(key, f"expected a non-empty string or a list of them, got {_show(v)}",
                   f'use "{key}": "some text"' + ("" if legacy else ' or ["a", "b"]'))
    dims = d.get("dimensions")
    if dims is not None and (not _is_int(dims) or dims < 1):
        raise _bad("dimensions", f"expected a positive integer, got {_show(dims)}",
                   "leave it out (the model's size)")
    req = EmbeddingsRequest(inputs=tuple(texts), single=isinstance(v, str), model=model,
                            encoding_format="float", dimensions=dims,
                            truncate=True if legacy else bool_field(d, "truncate", True))
    return OllamaEmbed(model=model, request=req,
                       keep_alive=None if ka is None else parse_keep_alive(ka), legacy=legacy)


def parse_show(body: bytes) -> str:
    """POST /api/show: {"model", "verbose"?} (Ollama's older `name` too); the model name."""
    d = parse_json_body(body)
    for key in d:
        if key not in ("model", "name", "verbose"):
            raise _bad(key, "unknown parameter for /api/show", "send {\"model\": NAME}",
                       code="unknown_parameter")
    bool_field(d, "verbose", False)
    return _model({"model": d.get("model") or d.get("name")})


# ----- responses --------------------------------------------------------------------------------


def rfc3339(epoch: float) -> str:
    """An epoch time as RFC 3339 in UTC with microseconds (`2025-06-01T12:03:07.412345Z`)."""
    return datetime.fromtimestamp(epoch, tz=timezone.utc).isoformat(
        timespec="microseconds").replace("+00:00", "Z")


def ndjson(obj: Mapping[str, Any]) -> bytes:
    return json.dumps(obj, ensure_ascii=False).encode() + b"\n"


def ollama_tool_calls(calls: Sequence[Mapping[str, Any]], start: int = 0) -> list[dict[str, Any]]:
    """A reply's tool calls (OpenAI's shape, arguments a JSON string) in Ollama's:
    `[{"id", "function": {"index", "name", "arguments": {...}}}]`, indexed from `start`. A call
    whose arguments are not the JSON text of an object (cut short, or malformed) is left out:
    Ollama's calls carry an object."""
    out: list[dict[str, Any]] = []
    for c in calls:
        try:
            args = json.loads(c["function"]["arguments"])
        except ValueError:
            continue
        if isinstance(args, dict):
            out.append({"id": c["id"], "function": {"index": start + len(out),
                                                    "name": c["function"]["name"],
                                                    "arguments": args}})
    return out


def chunk(*, chat: bool, model: str, now: float, text: str,
          tool_calls: list[dict[str, Any]] | None = None,
          thinking: str | None = None) -> dict[str, Any]:
    """One streamed object (`done: false`); with `tool_calls` (Ollama's shape), a message
    that calls tools; `thinking`: (a piece of) a thinking model's reasoning."""
    out: dict[str, Any] = {"model": model, "created_at": rfc3339(now)}
    if chat:
        out["message"] = {"role": "assistant", "content": text}
        if thinking:
            out["message"]["thinking"] = thinking
        if tool_calls:
            out["message"]["tool_calls"] = tool_calls
    else:
        out["response"] = text
        if thinking:
            out["thinking"] = thinking
    out["done"] = False
    return out


def final(*, chat: bool, model: str, now: float, text: str, done_reason: str,
          stats: Stats | None, tool_calls: list[dict[str, Any]] | None = None,
          thinking: str | None = None) -> dict[str, Any]:
    """The last object (`done: true`, why, and the statistics of a generation)."""
    out = chunk(chat=chat, model=model, now=now, text=text, tool_calls=tool_calls,
                thinking=thinking)
    out["done"] = True
    out["done_reason"] = done_reason
    if stats is not None:
        out.update(stats.fields())
    return out


def human_number(n: int) -> str:
    """A parameter count as Ollama prints it: 134515008 -> "134.52M", 8030261248 -> "8.0B"."""
    for size, unit, decimals in ((1e9, "B", 1), (1e6, "M", 2)):
        if n >= size:
            x = n / size
            return f"{x:.0f}{unit}" if x == int(x) else f"{x:.{decimals}f}{unit}"
    return f"{n / 1e3:.0f}K" if n >= 1000 else str(n)


def quantization_level(meta: Mapping[str, Any], dominant: str | None) -> str:
    """general.file_type's name; without it, the tensor type holding the most bytes."""
    ft = meta.get("general.file_type")
    if _is_int(ft) and ft in FILE_TYPES:
        return FILE_TYPES[ft]
    return dominant or "unknown"


def model_details(meta: Mapping[str, Any], parameters: int, dominant: str | None
                  ) -> dict[str, Any]:
    """Ollama's `details` of a GGUF from its metadata."""
    arch = str(meta.get("general.architecture") or "unknown")
    return {"parent_model": "", "format": "gguf", "family": arch, "families": [arch],
            "parameter_size": human_number(parameters),
            "quantization_level": quantization_level(meta, dominant)}


def model_info(meta: Mapping[str, Any], parameters: int) -> dict[str, Any]:
    """/api/show's `model_info`: the GGUF's scalar metadata (arrays such as the vocabulary and
    the chat template, shown as `template`, left out) and the parameter count."""
    out = {k: v for k, v in sorted(meta.items())
           if not isinstance(v, (list, tuple, bytes)) and k != "tokenizer.chat_template"}
    out["general.parameter_count"] = parameters
    return out


def show_body(*, meta: Mapping[str, Any], parameters: int, dominant: str | None,
              path: str, context: int, modified: float,
              template: str | None = None) -> dict[str, Any]:
    """`template`: the chat template in use when it is not the GGUF's own. A template that
    speaks of `</think>` is a thinking model's (daemon/reasoning.py)."""
    if template is None:
        template = meta.get("tokenizer.chat_template")
    thinks = isinstance(template, str) and "</think>" in template
    return {
        "modelfile": f"FROM {path}\nPARAMETER num_ctx {context}\n",
        "parameters": f"num_ctx {context}",
        "template": template if isinstance(template, str) else "",
        "license": str(meta.get("general.license") or ""),
        "details": model_details(meta, parameters, dominant),
        "model_info": model_info(meta, parameters),
        # tools: through the template or a prompt
        "capabilities": ["completion", "tools", *(["thinking"] if thinks else [])],
        "modified_at": rfc3339(modified),
    }

