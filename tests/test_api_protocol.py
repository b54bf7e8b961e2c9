"""The HTTP API schema (pure) and the h11 Unix-socket transport (real sockets, no model)."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import socket
import stat
import tempfile
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from edge_agent.daemon.ipc import encode_frame, recv_frame, send_frame
from edge_agent.daemon.metrics import Metrics, format_value
from edge_agent.protocol.api import (
    IGNORED_FIELDS,
    SSE_DONE,
    UNSUPPORTED_FIELDS,
    UNTIL_CONTEXT,
    ApiError,
    GenerationRequest,
    completion_chunk,
    completion_response,
    error_body,
    parse_detokenize,
    parse_generation,
    parse_tokenize,
    sse_event,
)
from edge_agent.sockpath import SocketPathError
from edge_agent.transports.http import (
    HttpServer,
    Request,
    Response,
    SocketInUseError,
    StreamResponse,
)

pytestmark = pytest.mark.timeout(60)


def parse(body: object, chat: bool | None = False) -> object:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return parse_generation(raw, chat=chat, max_tokens_limit=1000)


def bad(body: object, chat: bool | None = False) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse(body, chat)
    assert info.value.status == 400
    assert "Hint:" in info.value.message
    return info.value


# ---- protocol: parsing ---------------------------------------------------------------------

def test_completion_defaults_and_fields() -> None:
    r = parse({"prompt": "hi", "max_tokens": 5, "temperature": 0, "top_p": 0.5, "seed": 7,
               "stop": "\n", "stream": True, "priority": 9, "timeout_ms": 10, "user": "x"})
    assert (r.prompt, r.max_tokens, r.temperature, r.top_p, r.seed) == ("hi", 5, 0.0, 0.5, 7)
    assert r.stop == ("\n",) and r.stream and r.priority == 9 and r.timeout_ms == 10
    d = parse({"prompt": ["one"]})
    assert d.prompt == "one" and d.max_tokens == 16 and d.temperature == 1.0
    assert d.priority is None and d.timeout_ms is None and d.seed is None
    assert d.sampling_dict(42)["seed"] == 42 and r.sampling_dict(42)["seed"] == 7


def test_chat_messages_and_content_parts() -> None:
    r = parse({"messages": [{"role": "system", "content": "s"},
                            {"role": "user", "content": [{"type": "text", "text": "a"},
                                                         {"type": "text", "text": "b"}]}]},
              chat=True)
    assert [(m.role, m.content) for m in r.messages] == [("system", "s"), ("user", "ab")]


def test_an_assistants_reasoning_sent_back_is_kept() -> None:
    r = parse({"messages": [{"role": "user", "content": "a"},
                            {"role": "assistant", "content": "b", "reasoning_content": "r"},
                            {"role": "assistant", "content": "c", "reasoning_content": None}]},
              chat=True)
    assert [m.reasoning for m in r.messages] == [None, "r", None]


def test_native_requests_take_prompt_or_messages() -> None:
    assert parse({"prompt": "x"}, chat=None).chat is False
    assert parse({"messages": [{"role": "user", "content": "x"}]}, chat=None).chat is True
    assert "exactly one" in bad({"prompt": "x", "messages": []}, chat=None).message
    assert "exactly one" in bad({}, chat=None).message


@pytest.mark.parametrize("raw, code, words", [
    (b"", "malformed_json", "empty"),
    (b"{", "malformed_json", "line 1 column 2"),
    (b"\xff{}", "malformed_json", "not UTF-8"),
    (b"[1]", "malformed_json", "JSON list"),
])
def test_malformed_bodies(raw: bytes, code: str, words: str) -> None:
    err = bad(raw)
    assert err.code == code and words in err.message


@pytest.mark.parametrize("body, field, words", [
    ({"prompt": 1}, "'prompt'", "expected a string"),
    ({"prompt": "x", "max_tokens": 0}, "'max_tokens'", "out of range"),
    ({"prompt": "x", "max_tokens": 1001}, "'max_tokens'", "1..1000"),
    ({"prompt": "x", "max_tokens": True}, "'max_tokens'", "integer"),
    ({"prompt": "x", "max_tokens": 2.5}, "'max_tokens'", "integer"),
    ({"prompt": "x", "temperature": -1}, "'temperature'", "out of range"),
    ({"prompt": "x", "temperature": "hot"}, "'temperature'", "number"),
    ({"prompt": "x", "top_p": 0}, "'top_p'", "(0.0, 1.0]"),
    ({"prompt": "x", "top_k": -1}, "'top_k'", "out of range"),
    ({"prompt": "x", "seed": -3}, "'seed'", "non-negative"),
    ({"prompt": "x", "seed": False}, "'seed'", "non-negative"),
    ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "'stop'", "at most 4"),
    ({"prompt": "x", "stop": [""]}, "'stop'", "empty"),
    ({"prompt": "x", "stop": 3}, "'stop'", "string or a list"),
    ({"prompt": "x", "stream": 1}, "'stream'", "true or false"),
    ({"prompt": "x", "priority": 11}, "'priority'", "0..10"),
    ({"prompt": "x", "timeout_ms": 0}, "'timeout_ms'", "out of range"),
    ({"prompt": "x", "n": 2}, "'n'", "n=1"),
    ({"prompt": "x", "model": ""}, "'model'", "model name"),
])
def test_bad_fields_name_the_field(body: dict, field: str, words: str) -> None:
    err = bad(body)
    assert err.code == "invalid_request"
    assert field in err.message and words in err.message


@pytest.mark.parametrize("messages, field", [
    (None, "'messages'"),
    ([], "'messages'"),
    (["hi"], "'messages[0]'"),
    ([{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}], "'messages[1].role'"),
    ([{"role": "user", "content": 3}], "'messages[0].content'"),
    ([{"role": "user", "content": [{"type": "image_url"}]}], "'messages[0].content[0]'"),
    ([{"role": "user", "content": "a", "reasoning_content": "r"}],
     "'messages[0].reasoning_content'"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b",
                                          "reasoning_content": ["r"]}],
     "'messages[1].reasoning_content'"),
])
def test_bad_messages_name_the_path(messages: object, field: str) -> None:
    assert field in bad({"messages": messages}, chat=True).message


# ---- protocol: limits (OpenAI semantics) ---------------------------------------------------

def test_chat_without_a_limit_runs_until_the_context() -> None:
    msgs = [{"role": "user", "content": "x"}]
    assert parse({"messages": msgs}, chat=True).max_tokens == UNTIL_CONTEXT
    assert parse({"messages": msgs, "max_tokens": None}, chat=True).max_tokens == UNTIL_CONTEXT
    assert parse({"messages": msgs}, chat=None).max_tokens == UNTIL_CONTEXT
    assert parse({"messages": msgs, "max_tokens": 7}, chat=True).max_tokens == 7
    # max_completion_tokens wins over max_tokens, and is checked like it
    r = parse({"messages": msgs, "max_tokens": 7, "max_completion_tokens": 3}, chat=True)
    assert r.max_tokens == 3 and r.sampling_dict(1)["max_tokens"] == 3
    assert parse({"messages": msgs, "max_completion_tokens": 5}, chat=True).max_tokens == 5
    err = bad({"messages": msgs, "max_completion_tokens": 0}, chat=True)
    assert "'max_completion_tokens'" in err.message and err.param == "max_completion_tokens"
    # completions keep OpenAI's documented default of 16; an explicit default still wins
    assert parse({"prompt": "x"}).max_tokens == 16
    assert parse_generation({"prompt": "x"}, chat=False, max_tokens_limit=9,
                            default_max_tokens=4).max_tokens == 4
    err = bad({"prompt": "x", "max_completion_tokens": 5})
    assert err.code == "unknown_parameter" and "use max_tokens" in err.message


# ---- protocol: unknown, ignored and unsupported fields -------------------------------------

CHAT_MSGS = [{"role": "user", "content": "x"}]


@pytest.mark.parametrize("chat, body, param, words", [
    (False, {"prompt": "x", "foo": 1}, "foo", "unknown parameter for /v1/completions"),
    (True, {"messages": CHAT_MSGS, "max_tokns": 5}, "max_tokns", "did you mean 'max_tokens'"),
    (True, {"messages": CHAT_MSGS, "prompt": "x"}, "prompt", "/v1/completions"),
    (False, {"prompt": "x", "messages": CHAT_MSGS}, "messages", "/v1/chat/completions"),
    (True, {"messages": CHAT_MSGS, "n_predict": 5}, "n_predict", "max_completion_tokens"),
    (False, {"prompt": "x", "store": True}, "store", "unknown"),  # a chat-only field
    (True, {"messages": CHAT_MSGS, "foo": None}, "foo", "unknown"),  # null is no excuse
    (True, {"messages": CHAT_MSGS, "stream_options": {"x": 1}}, "stream_options.x", "unknown"),
])
def test_unknown_fields_are_refused_naming_them(chat: bool, body: dict, param: str,
                                                words: str) -> None:
    err = bad(body, chat=chat)
    assert err.code == "unknown_parameter" and err.param == param
    assert f"'{param}'" in err.message and words in err.message
    doc = json.loads(err.body())["error"]
    assert doc == {"message": err.message, "type": "invalid_request_error", "param": param,
                   "code": "unknown_parameter"}


def test_ignored_fields_are_accepted_and_type_checked() -> None:
    body = {"messages": CHAT_MSGS, "user": "u1", "store": False, "metadata": {"k": "v"},
            "service_tier": "auto", "parallel_tool_calls": True, "safety_identifier": "s",
            "prompt_cache_key": "p", "prompt_cache_retention": "24h",
            "prompt_cache_options": {"ttl": "5m"}, "n": 1, "stream_options": None}
    r = parse(body, chat=True)
    assert r.messages is not None and r.max_tokens == UNTIL_CONTEXT
    assert parse({"prompt": "x", "user": "u", "n": None, "stream": None}).stream is False
    assert set(IGNORED_FIELDS) == {"user", "store", "metadata", "service_tier",
                                   "parallel_tool_calls", "safety_identifier",
                                   "prompt_cache_key", "prompt_cache_retention",
                                   "prompt_cache_options"}
    for key, value in (("user", 3), ("store", "yes"), ("metadata", {"k": 1}),
                       ("parallel_tool_calls", "no"), ("prompt_cache_retention", "1h")):
        err = bad({"messages": CHAT_MSGS, key: value}, chat=True)
        assert err.code == "invalid_request" and err.param == key and "ignored" in err.message
    assert "n=1" in bad({"messages": CHAT_MSGS, "n": 2}, chat=True).message


NOT_YET = [
    (True, "functions", [{"name": "f"}]),
    (False, "echo", True),
    (False, "suffix", "end"),
]


@pytest.mark.parametrize("chat, key, value", NOT_YET)
def test_unimplemented_parameters_are_refused_not_ignored(chat: bool, key: str,
                                                         value: object) -> None:
    body = {"messages": CHAT_MSGS} if chat else {"prompt": "x"}
    err = bad({**body, key: value}, chat=chat)
    assert err.code == "unsupported_parameter" and err.param == key
    assert f"'{key}'" in err.message and "not supported yet" in err.message


def test_stream_options_include_usage() -> None:
    req = parse({"messages": CHAT_MSGS, "stream": True,
                 "stream_options": {"include_usage": True}}, chat=True)
    assert req.include_usage and req.stream
    assert bad({"prompt": "x", "stream_options": 1}).param == "stream_options"
    assert bad({"prompt": "x", "stream_options": {"include_usage": 1}}).param == (
        "stream_options.include_usage")
    ok = {"include_usage": False, "include_obfuscation": True}
    req = parse({"prompt": "x", "stream": True, "stream_options": ok})
    assert req.stream and not req.include_usage


@pytest.mark.parametrize("chat, key, value", [
    (True, "reasoning_effort", "low"), (True, "audio", {"voice": "x"}),
    (True, "modalities", ["text", "audio"]), (True, "prediction", {"type": "content"}),
    (True, "web_search_options", {}), (True, "verbosity", "low"), (False, "best_of", 3),
])
def test_parameters_this_server_lacks_are_refused(chat: bool, key: str, value: object) -> None:
    body = {"messages": CHAT_MSGS} if chat else {"prompt": "x"}
    err = bad({**body, key: value}, chat=chat)
    assert err.code == "unsupported_parameter" and "not supported by this server" in err.message


def test_neutral_values_change_nothing_and_are_accepted() -> None:
    chat = {"messages": CHAT_MSGS, "presence_penalty": 0, "frequency_penalty": 0.0,
            "logit_bias": {}, "min_p": 0, "repeat_penalty": 1.0, "tools": [],
            "tool_choice": "none", "response_format": {"type": "text"}, "logprobs": False,
            "top_logprobs": 0, "modalities": ["text"], "functions": [], "function_call": "none",
            "audio": None, "reasoning_effort": None, "stream_options": {"include_usage": False}}
    plain = parse({"messages": CHAT_MSGS}, chat=True)
    assert parse(chat, chat=True) == plain
    comp = {"prompt": "x", "echo": False, "logprobs": None, "suffix": "", "best_of": 1,
            "presence_penalty": 0, "frequency_penalty": 0, "logit_bias": None}
    assert parse(comp) == parse({"prompt": "x"})
    # every unsupported field has a neutral value or refuses all but null
    for kind in ("chat", "completion"):
        for key, (neutral, shown, _planned) in UNSUPPORTED_FIELDS[kind].items():
            if shown != "null":
                assert neutral(json.loads(shown)), (kind, key)


def test_error_body_has_openai_type_and_param() -> None:
    err = ApiError(400, "invalid_request", "field 'messages[1].role': bad. Hint: fix it.")
    assert err.param == "messages[1].role"
    assert json.loads(err.body())["error"]["type"] == "invalid_request_error"
    doc = json.loads(ApiError(503, "queue_full", "full. Hint: retry.").body())["error"]
    assert doc == {"message": "full. Hint: retry.", "type": "server_error", "param": None,
                   "code": "queue_full"}
    assert bad({"prompt": "x", "temperature": 9}).param == "temperature"
    assert bad({"messages": [{"role": "bot", "content": "x"}]}, chat=True).param == \
        "messages[0].role"


# ---- protocol: /tokenize and /detokenize bodies (llama-server's shapes) --------------------

def test_tokenize_and_detokenize_bodies() -> None:
    t = parse_tokenize(b'{"content": "Hi"}')
    assert (t.content, t.add_special, t.parse_special, t.with_pieces, t.model) == (
        "Hi", False, True, False, None)
    t = parse_tokenize(json.dumps({"content": "", "add_special": True, "parse_special": False,
                                   "with_pieces": True, "model": "m"}).encode())
    assert (t.add_special, t.parse_special, t.with_pieces, t.model) == (True, False, True, "m")
    assert parse_detokenize(b'{"tokens": [1, 2, 3]}').tokens == (1, 2, 3)
    for fn, raw, param, code in (
            (parse_tokenize, b'{}', "content", "invalid_request"),
            (parse_tokenize, b'{"content": ["a"]}', "content", "invalid_request"),
            (parse_tokenize, b'{"content": "a", "with_pieces": 1}', "with_pieces",
             "invalid_request"),
            (parse_tokenize, b'{"content": "a", "text": "b"}', "text", "unknown_parameter"),
            (parse_detokenize, b'{"tokens": "1 2"}', "tokens", "invalid_request"),
            (parse_detokenize, b'{"tokens": [1, -2]}', "tokens[1]", "invalid_request"),
            (parse_detokenize, b'{"tokens": [true]}', "tokens[0]", "invalid_request"),
            (parse_detokenize, b'{"tokens": [1], "model": ""}', "model", "invalid_request"),
            (parse_detokenize, b'{"ids": [1]}', "ids", "unknown_parameter")):
        with pytest.raises(ApiError) as info:
            fn(raw)
        err = info.value
        assert (err.status, err.code, err.param) == (400, code, param), (raw, err.message)
        assert "Hint:" in err.message


# ---- metrics text ----------------------------------------------------------------------------

def test_metrics_exact_integers_model_labels_build_info_prompt_tokens() -> None:
    from edge_agent import __version__

    assert format_value(538_060_032) == "538060032"
    assert format_value(538_060_032.0) == "538060032" and format_value(True) == "1"
    assert format_value(0.1) == "0.1" and format_value(float("inf")) == "+Inf"
    m = Metrics()
    m.observe_step("a", 2, 2, 0.02)

    class Rec:
        model, prompt_tokens, submitted_mono, first_token_at = "a", 12, time.monotonic(), None

    m.request_done(Rec(), "done")
    m.request_done(Rec(), "cancelled")
    text = m.render(lambda: {"edge_agent_locked_bytes": [('model="a"', 538_060_032)],
                             "edge_agent_model_serving": [('model="a"', 1.0)]})
    lines = text.splitlines()
    assert 'edge_agent_locked_bytes{model="a"} 538060032' in lines
    assert 'edge_agent_model_serving{model="a"} 1' in lines
    assert f'edge_agent_build_info{{version="{__version__}"}} 1' in lines
    assert 'edge_agent_prompt_tokens_total{model="a"} 24' in lines
    assert "# TYPE edge_agent_prompt_tokens_total counter" in lines
    assert 'edge_agent_batch_size_bucket{model="a",le="2"} 1' in lines
    assert 'edge_agent_request_latency_seconds_count{model="a"} 2' in lines
    assert 'edge_agent_step_seconds_count{model="a"} 1' in lines
    assert not any("e+" in ln for ln in lines if not ln.startswith("#")), text


# ---- protocol: response shapes -------------------------------------------------------------

def test_openai_shapes_and_sse() -> None:
    c = completion_response(rid="r", model="m", created=1, chat=False, text="t",
                            finish_reason="length", prompt_tokens=2, completion_tokens=3)
    assert c["object"] == "text_completion" and c["choices"][0]["text"] == "t"
    assert c["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5,
                          "prompt_tokens_details": {"cached_tokens": 0}}
    cached = completion_response(rid="r", model="m", created=1, chat=False, text="t",
                                 finish_reason="length", prompt_tokens=9, completion_tokens=1,
                                 cached_tokens=8)
    assert cached["usage"]["prompt_tokens_details"] == {"cached_tokens": 8}
    ch = completion_response(rid="r", model="m", created=1, chat=True, text="t",
                             finish_reason="stop", prompt_tokens=1, completion_tokens=1)
    assert ch["choices"][0]["message"] == {"role": "assistant", "content": "t"}
    first = completion_chunk(rid="r", model="m", created=1, chat=True, text="a",
                             finish_reason=None, first=True)
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "a"}
    assert sse_event({"a": "é"}) == 'data: {"a": "é"}\n\n'.encode()
    assert sse_event("x", event="token", event_id=3) == b"id: 3\nevent: token\ndata: x\n\n"
    assert SSE_DONE == b"data: [DONE]\n\n"
    assert json.loads(error_body("c", "m", {"ran_s": 1})) == {
        "error": {"message": "m", "type": "invalid_request_error", "param": None, "code": "c",
                  "ran_s": 1}}


# ---- runner framing ------------------------------------------------------------------------

def test_ipc_frames_roundtrip_and_eof() -> None:
    a, b = socket.socketpair()
    with a, b:
        send_frame(a, {"op": "step", "add": [1, 2]})
        assert recv_frame(b) == {"op": "step", "add": [1, 2]}
        a.sendall(encode_frame({"x": 1})[:5])
        a.close()
        with pytest.raises(EOFError):
            recv_frame(b)


# ---- transport: a real Unix socket, a trivial handler --------------------------------------

class Harness:
    def __init__(self) -> None:
        self.cancelled = asyncio.Event()
        self.closed_stream = asyncio.Event()
        self.started = asyncio.Event()

    async def handle(self, req: Request) -> Response | StreamResponse:
        if req.path == "/echo":
            return Response(200, json.dumps({"method": req.method, "len": len(req.body),
                                             "q": req.query}).encode())
        if req.path == "/slow":
            self.started.set()
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
            return Response(200, b"{}")
        if req.path == "/stream":
            return StreamResponse(self.stream())
        return Response(404, b"{}")

    async def stream(self) -> AsyncIterator[bytes]:
        try:
            for i in range(1000):
                yield sse_event({"i": i})
                await asyncio.sleep(0.01)
        finally:
            self.closed_stream.set()


async def _request(path: Path, raw: bytes) -> bytes:
    reader, writer = await asyncio.open_unix_connection(str(path))
    writer.write(raw)
    await writer.drain()
    data = await reader.read()
    writer.close()
    return data


def _short_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="ea-t-", dir="/tmp"))


def test_http_server_on_unix_socket() -> None:
    async def main() -> None:
        d = _short_dir()
        sock = d / "s.sock"
        h = Harness()
        srv = HttpServer(h.handle, max_body_bytes=100)
        await srv.listen_unix(sock, mode=0o660)
        assert stat.S_IMODE(sock.stat().st_mode) == 0o660
        # keep-alive: two requests on one connection, then close
        two = (b"POST /echo?x=1 HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\n\r\nabc"
               b"GET /echo HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
        out = await _request(sock, two)
        assert out.count(b"HTTP/1.1 200") == 2
        assert b'"len": 3' in out and b'"q": {"x": ["1"]}' in out
        # 413 by Content-Length, without reading the body; and by chunked size
        out = await _request(sock, b"POST /echo HTTP/1.1\r\nHost: a\r\nContent-Length: 101\r\n\r\n")
        assert out.startswith(b"HTTP/1.1 413") and b"body_too_large" in out
        chunked = (b"POST /echo HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
                   b"64\r\n" + b"x" * 100 + b"\r\n1\r\ny\r\n0\r\n\r\n")
        assert (await _request(sock, chunked)).startswith(b"HTTP/1.1 413")
        # garbage is a 400 from the HTTP layer
        out = await _request(sock, b"NOT HTTP\r\n\r\n")
        assert out.startswith(b"HTTP/1.1 400") and b"bad_http" in out
        # a client hanging up cancels the handler
        reader, writer = await asyncio.open_unix_connection(str(sock))
        writer.write(b"GET /slow HTTP/1.1\r\nHost: a\r\n\r\n")
        await asyncio.wait_for(h.started.wait(), 5)
        writer.close()
        await asyncio.wait_for(h.cancelled.wait(), 5)
        # ... and closes a stream's generator mid-stream
        reader, writer = await asyncio.open_unix_connection(str(sock))
        writer.write(b"GET /stream HTTP/1.1\r\nHost: a\r\n\r\n")
        assert b"text/event-stream" in await reader.readuntil(b"data: ")
        writer.close()
        await asyncio.wait_for(h.closed_stream.wait(), 5)
        # a second server on the live socket is refused; close() removes the file
        with pytest.raises(SocketInUseError, match="already serving"):
            await HttpServer(h.handle).listen_unix(sock)
        await srv.close()
        assert not sock.exists()
        os.rmdir(d)

    asyncio.run(main())


def test_stale_socket_is_replaced_and_non_socket_refused() -> None:
    async def main() -> None:
        d = _short_dir()
        sock = d / "s.sock"
        stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        stale.bind(str(sock))
        stale.close()  # file left behind, nobody listens
        srv = HttpServer(Harness().handle)
        await srv.listen_unix(sock)
        out = await _request(sock, b"GET /echo HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
        assert out.startswith(b"HTTP/1.1 200")
        await srv.close()
        plain = d / "file"
        plain.write_text("x")
        # nothing a restart fixes: a configuration error (exit 78), naming what is there
        with pytest.raises(SocketPathError, match="exists and is a regular file, not a socket"
                           ) as exc:
            await HttpServer(Harness().handle).listen_unix(plain)
        assert exc.value.exit_code == 78 and "Hint:" in str(exc.value)
        sub = d / "dir"
        sub.mkdir()
        with pytest.raises(SocketPathError, match="exists and is a directory, not a socket"):
            await HttpServer(Harness().handle).listen_unix(sub)
        sub.rmdir()
        plain.unlink()
        os.rmdir(d)

    asyncio.run(main())


def test_stream_that_ends_as_the_client_hangs_up_leaves_no_stray_error() -> None:
    """The generator's end (StopAsyncIteration) and the client's EOF seen in the same wait:
    the server must still collect the generator's outcome, or asyncio reports "Task exception
    was never retrieved" for it. The order is forced: the generator blocks the loop while the
    client (a thread) hangs up, then needs two more loop turns to finish, by which time the
    server's read of the socket has seen the EOF."""
    errors: list[dict[str, Any]] = []
    hung_up = threading.Event()

    async def ending() -> AsyncIterator[bytes]:
        yield b"data: last\n\n"
        assert hung_up.wait(5)
        time.sleep(0.2)  # the EOF reaches the socket while the loop is blocked
        await asyncio.sleep(0)
        await asyncio.sleep(0)

    async def handle(req: Request) -> Response | StreamResponse:
        return StreamResponse(ending())

    def client(path: Path) -> None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(str(path))
            s.sendall(b"GET /stream HTTP/1.1\r\nHost: a\r\n\r\n")
            got = b""
            while b"data: last" not in got:
                got += s.recv(4096)
        hung_up.set()

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: errors.append(ctx))
        d = _short_dir()
        srv = HttpServer(handle)
        await srv.listen_unix(d / "s.sock")
        t = threading.Thread(target=client, args=(d / "s.sock",))
        t.start()
        await asyncio.to_thread(t.join, 10)
        await asyncio.sleep(0.3)
        await srv.close()
        gc.collect()
        await asyncio.sleep(0)
        os.rmdir(d)

    asyncio.run(main())
    assert not errors, [e.get("message") for e in errors]


def test_logprobs_render_in_openai_shapes_and_unknown_ones_as_null() -> None:
    from edge_agent.protocol.api import chat_logprobs, completion_logprobs

    pieces = {1: b"Hi", 2: b" \xe2\x80", 3: b"\x94!"}
    entries = [(1, -0.5, [(1, -0.5), (3, -2.0)], 0), (2, None, [], 2), (3, -0.1, [], 3)]
    chat = chat_logprobs(entries, pieces.__getitem__)
    assert chat["content"][0] == {"token": "Hi", "logprob": -0.5, "bytes": [72, 105],
                                  "top_logprobs": [
                                      {"token": "Hi", "logprob": -0.5, "bytes": [72, 105]},
                                      {"token": "\\x94!", "logprob": -2.0,
                                       "bytes": [0x94, 33]}]}
    assert chat["content"][1]["logprob"] is None  # restored from the journal: not known
    comp = completion_logprobs(entries, pieces.__getitem__)
    assert comp == {"tokens": ["Hi", " \\xe2\\x80", "\\x94!"], "token_logprobs": [-0.5, None, -0.1],
                    "top_logprobs": [{"Hi": -0.5, "\\x94!": -2.0}, None, {}],
                    "text_offset": [0, 2, 3]}


def test_sampling_controls_parse_into_the_request() -> None:
    req = parse({"prompt": "x", "presence_penalty": -1.5, "frequency_penalty": 2,
                 "repeat_penalty": 1.1, "repeat_last_n": -1, "min_p": 0.05, "top_k": 40,
                 "logit_bias": {"17": -100, "3": 2.5}, "logprobs": 5})
    assert (req.presence_penalty, req.frequency_penalty, req.repeat_penalty,
            req.repeat_last_n, req.min_p, req.top_k) == (-1.5, 2.0, 1.1, -1, 0.05, 40)
    assert req.logit_bias == ((3, 2.5), (17, -100.0)) and req.logprobs == 5
    d = req.sampling_dict(7)
    assert d["logit_bias"] == [[3, 2.5], [17, -100.0]] and d["logprobs"] == 5
    assert "min_p" not in parse({"prompt": "x"}).sampling_dict(7)  # neutral: not sent
    chat = parse({"messages": CHAT_MSGS, "logprobs": True, "top_logprobs": 20}, chat=True)
    assert chat.logprobs == 20
    assert parse({"messages": CHAT_MSGS, "logprobs": True}, chat=True).logprobs == 0
    assert parse({"messages": CHAT_MSGS, "logprobs": False}, chat=True).logprobs is None
    for body, param in [({"logit_bias": []}, "logit_bias"), ({"logit_bias": {"-1": 1}},
                        "logit_bias.-1"), ({"logit_bias": {"1": True}}, "logit_bias.1"),
                        ({"presence_penalty": -2.01}, "presence_penalty"),
                        ({"repeat_last_n": -2}, "repeat_last_n"), ({"logprobs": True},
                        "logprobs"), ({"min_p": 2}, "min_p")]:
        err = bad({"prompt": "x", **body})
        assert err.param == param and "Hint:" in err.message, (body, err.message)
    err = bad({"messages": CHAT_MSGS, "top_logprobs": 3}, chat=True)
    assert err.param == "top_logprobs" and "logprobs" in err.message


def test_reasoning_format_and_template_variables_are_checked() -> None:
    msgs = [{"role": "user", "content": "Hi"}]

    def parse(**body: Any) -> GenerationRequest:
        return parse_generation({"messages": msgs, **body}, chat=True, max_tokens_limit=9)

    assert parse().reasoning_format == "auto" and parse().template_vars is None
    assert parse(reasoning_format="deepseek").reasoning_format == "auto"
    assert parse(reasoning_format="none").reasoning_format == "none"
    assert parse(chat_template_kwargs={"enable_thinking": False}).template_vars == {
        "enable_thinking": False}
    for body, param in (({"reasoning_format": "raw"}, "reasoning_format"),
                        ({"chat_template_kwargs": ["x"]}, "chat_template_kwargs"),
                        ({"chat_template_kwargs": {"messages": []}},
                         "chat_template_kwargs.messages"),
                        ({"chat_template_kwargs": {"a b": 1}}, "chat_template_kwargs.a b"),
                        ({"chat_template_kwargs": {f"v{i}": i for i in range(17)}},
                         "chat_template_kwargs")):
        with pytest.raises(ApiError) as info:
            parse(**body)
        assert info.value.param == param and "Hint:" in info.value.message, info.value
    # every name the Jinja renderer refuses is refused here, as a 400 naming it (the two lists
    # live on either side of the protocol/runtime wall)
    from edge_agent.runtime.chat_template import _NOT_VARIABLES

    for name in sorted(_NOT_VARIABLES | {"tools", "documents", "add_generation_prompt"}):
        with pytest.raises(ApiError) as info:
            parse(chat_template_kwargs={name: 1})
        assert info.value.param == f"chat_template_kwargs.{name}", name
    with pytest.raises(ApiError) as info:  # chat only
        parse_generation({"prompt": "x", "reasoning_format": "none"}, chat=False,
                         max_tokens_limit=9)
    assert info.value.code == "unknown_parameter"
