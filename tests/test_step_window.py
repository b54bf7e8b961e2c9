"""The step window (`runtime.step_window_ms`): one runner message runs several decode steps.

In process, the runner's own `_step` over the real engines and the default model: a message of
N steps gives the tokens N one-step messages give, a sequence stops inside a message at its stop
id and at its limit, and the next message continues it; a `hurry` frame on the runner's real
socket ends a message after its step in progress. End to end, two daemons on llama.cpp, one
with a 1000 ms window and one with none, answer the same requests (temperature 0, a seed, a
stop string, logprobs, two requests batched) with the same text, and the first answers far
fewer runner messages than it samples tokens; a request that arrives while a long message runs
gets its first token within a few of the running stream's tokens, not after two windows, and
a stream whose client hangs up mid-window is sampled about one token past the hang-up, not two
more windows (on llama.cpp and on a numpy daemon with the same window).
"""

from __future__ import annotations

import json
import socket
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon_proc import Daemon, launch, serve_argv
from journal_harness import link_prepared

from edge_agent.client import UnixHTTPConnection
from edge_agent.daemon.ipc import AddSeq, Hurry, Ping, Step, StepResult, encode, send_frame
from edge_agent.daemon.runner import _Inbox, _step
from edge_agent.daemon.service import MAX_STEPS
from edge_agent.paths import default_model_path
from edge_agent.runtime.engines import EngineLike, load_engine

PROMPT = "Once upon a time, a dragon"


@pytest.fixture(scope="module", params=["llamacpp", "numpy"])
def engine(request: pytest.FixtureRequest, prepared_state_dir: Path) -> Iterator[EngineLike]:
    if request.param == "llamacpp":
        pytest.importorskip("llama_cpp", reason="the llama.cpp engine needs llama-cpp-python")
    e = load_engine(str(request.param), default_model_path(), state_dir=prepared_state_dir,
                    mlock="off", max_batch=4, context=256, threads=1)
    try:
        yield e
    finally:
        e.close()


def _ids(engine: EngineLike) -> tuple[int, ...]:
    return tuple(engine.tokenizer.encode(PROMPT))


def _add(engine: EngineLike, sid: str, params: dict[str, Any]) -> int:
    reply = _step(engine, Step(add=(AddSeq(id=sid, prompt=_ids(engine), params=params),)))
    assert not reply.errors, reply.errors
    return reply.tokens[sid]


def _tokens(reply: StepResult, sid: str) -> list[int]:
    return [reply.tokens[sid], *reply.then.get(sid, ())] if sid in reply.tokens else []


@pytest.mark.parametrize("params", [{"max_tokens": 64, "temperature": 0},
                                    {"max_tokens": 64, "temperature": 0.8, "seed": 11}],
                         ids=["greedy", "seeded"])
def test_n_steps_in_one_message_are_n_one_step_messages(engine: EngineLike,
                                                        params: dict[str, Any]) -> None:
    ref = [_add(engine, "one", params)]
    for _ in range(9):
        reply = _step(engine, Step(step=("one",)))
        assert reply.steps == 1 and not reply.then
        ref += _tokens(reply, "one")
    _step(engine, Step(release=("one",)))

    got = [_add(engine, "many", params)]
    for _ in range(3):
        reply = _step(engine, Step(step=("many",), steps=3))
        assert reply.steps == 3 and len(reply.then["many"]) == 2
        got += _tokens(reply, "many")
    _step(engine, Step(release=("many",)))
    assert got == ref


def test_a_sequence_stops_inside_a_message_at_its_limit_and_its_stop_id(
        engine: EngineLike, monkeypatch: pytest.MonkeyPatch) -> None:
    params = {"max_tokens": 64, "temperature": 0}
    ref = [_add(engine, "ref", params)]
    reply = _step(engine, Step(step=("ref",), steps=8))
    ref += _tokens(reply, "ref")
    _step(engine, Step(release=("ref",)))
    assert len(ref) == 9

    # a limit of 2: that sequence gets 2 tokens, the other all 5; the next message goes on
    _add(engine, "a", params)
    _add(engine, "b", params)
    reply = _step(engine, Step(step=("a", "b"), steps=5, limits={"a": 2}))
    assert _tokens(reply, "a") == ref[1:3] and _tokens(reply, "b") == ref[1:6]
    assert reply.steps == 5
    reply = _step(engine, Step(step=("a",), steps=2))
    assert _tokens(reply, "a") == ref[3:5]
    _step(engine, Step(release=("a", "b")))

    # a stop id (here the greedy run's 4th token, as if it were end-of-sequence): the sequence
    # is not stepped past it, the other one is
    monkeypatch.setattr(engine, "stop_ids", frozenset(engine.stop_ids) | {ref[3]})
    assert ref[3] not in ref[:3]
    ended: set[str] = set()  # the runner's, kept across messages
    _add(engine, "c", params)
    _add(engine, "d", {"max_tokens": 64, "temperature": 0.8, "seed": 5})
    reply = _step(engine, Step(step=("c", "d"), steps=6), ended)
    assert _tokens(reply, "c") == ref[1:4]
    assert len(_tokens(reply, "d")) == 6 or _tokens(reply, "d")[-1] in engine.stop_ids
    assert "c" in ended
    # the next message (sent before the control plane saw the stop) does not step it again
    reply = _step(engine, Step(step=("c", "d"), steps=2), ended)
    assert "c" not in reply.tokens and "c" not in reply.then
    # released, the id is free again: a new sequence of that id is stepped as any other
    _step(engine, Step(release=("c", "d")), ended)
    assert not ended
    reply = _step(engine, Step(add=(AddSeq(id="c", prompt=_ids(engine), params=params),)),
                  ended)
    assert reply.tokens["c"] == ref[0]
    reply = _step(engine, Step(step=("c",), steps=2), ended)
    assert _tokens(reply, "c") == ref[1:3]
    _step(engine, Step(release=("c",)), ended)


def test_a_hurry_ends_a_message_after_the_step_in_progress(engine: EngineLike) -> None:
    params = {"max_tokens": 64, "temperature": 0}
    ref = [_add(engine, "ref", params)]
    ref += _tokens(_step(engine, Step(step=("ref",), steps=6)), "ref")
    _step(engine, Step(release=("ref",)))

    runner_end, cp_end = socket.socketpair()
    with runner_end, cp_end:
        inbox = _Inbox(runner_end)
        asked = []

        def hurried() -> bool:  # the runner's own check, after the control plane wrote
            asked.append(len(asked))  # a hurry and the next message during step 2
            if len(asked) == 2:
                send_frame(cp_end, encode(Hurry()))
                send_frame(cp_end, encode(Ping()))
            return inbox.hurried()

        _add(engine, "h", params)
        reply = _step(engine, Step(step=("h",), steps=6), None, hurried)
        assert reply.steps == 2 and _tokens(reply, "h") == ref[1:3]
        assert asked == [0, 1]  # asked between steps only
        assert inbox.next() == encode(Ping())  # the next message waited its turn
        reply = _step(engine, Step(step=("h",), steps=3), None, inbox.hurried)
        assert reply.steps == 3 and _tokens(reply, "h") == ref[3:6]  # nothing left to hurry
        _step(engine, Step(release=("h",)))

        cp_end.close()  # the control plane went away mid-message: the message ends, then the
        assert inbox.hurried()  # end is reported in its turn
        with pytest.raises(EOFError):
            inbox.next()


# -- end to end ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def daemons() -> Iterator[dict[str, Daemon]]:
    pytest.importorskip("llama_cpp", reason="the llama.cpp engine needs llama-cpp-python")
    with launch_windowed(1000) as wide, launch_windowed(0) as none:
        yield {"wide": wide, "none": none}


@pytest.fixture(scope="module")
def numpy_wide(prepared_state_dir: Path) -> Iterator[Daemon]:
    """The numpy engine's daemon with the same 1000 ms window (its prepared weights linked)."""
    with launch_windowed(1000, engine="numpy", prepared=prepared_state_dir) as d:
        yield d


def launch_windowed(window_ms: float, *, engine: str = "llamacpp",
                    prepared: Path | None = None) -> Any:
    root = Path(tempfile.mkdtemp(prefix="ea-", dir="/tmp"))
    if prepared is not None:
        link_prepared(prepared, root / "state")
    cfg = root / "config.toml"
    cfg.write_text(
        f'[server]\nsocket = "{root / "ea.sock"}"\nstate_dir = "{root / "state"}"\n'
        "[scheduler]\nmax_batch_size = 4\n"
        f'[runtime]\nengine = "{engine}"\nthreads = 1\nstep_window_ms = {window_ms}\n'
        "[models.smollm2]\ncontext = 512\nmax_batch = 4\npreload = true\n")
    return launch(Daemon, root, serve_argv(cfg))


def _metric(d: Daemon, name: str) -> float:
    _, _, data = d.call("GET", "/metrics")
    for line in data.decode().splitlines():
        if line.startswith(name + "{") and 'model="smollm2"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _streamed(d: Daemon, body: dict[str, Any]) -> tuple[str, str | None, Any]:
    status, _, data = d.call("POST", "/v1/completions", {**body, "stream": True})
    assert status == 200, data[:500]
    events = [line[6:] for line in data.decode().split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["text"] or "" for c in chunks)
    lps = [c["choices"][0].get("logprobs") for c in chunks]
    return text, chunks[-1]["choices"][0]["finish_reason"], lps


def _open_stream(d: Daemon, max_tokens: int) -> tuple[UnixHTTPConnection, Any]:
    """A greedy completion stream of PROMPT, its response open for reading."""
    conn = UnixHTTPConnection(str(d.sock), timeout=120)
    conn.request("POST", "/v1/completions", json.dumps(
        {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True}),
        {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    return conn, resp


def test_a_wide_window_gives_the_same_streams_in_fewer_runner_messages(
        daemons: dict[str, Daemon]) -> None:
    greedy = {"prompt": PROMPT, "max_tokens": 48, "temperature": 0}
    bodies = [greedy,
              {"prompt": PROMPT, "max_tokens": 40, "temperature": 0.8, "seed": 7},
              {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0,
               "logprobs": 2}]
    outs: dict[str, list[Any]] = {}
    before = {k: (_metric(d, "edge_agent_runner_messages_total"),
                  _metric(d, "edge_agent_tokens_generated_total")) for k, d in daemons.items()}
    for kind, d in daemons.items():
        outs[kind] = [_streamed(d, b) for b in bodies]
    assert outs["wide"] == outs["none"]
    text, reason, _ = outs["wide"][0]
    assert reason == "length" and len(text) > 40
    for kind, d in daemons.items():
        messages = _metric(d, "edge_agent_runner_messages_total") - before[kind][0]
        tokens = _metric(d, "edge_agent_tokens_generated_total") - before[kind][1]
        assert tokens >= 48 + 8, (kind, tokens)
        if kind == "wide":  # 3 one-step messages at the start of each request at most
            assert messages * 3 < tokens, (messages, tokens)
        else:
            assert messages >= tokens - 3, (messages, tokens)  # one step, one token each

    # a stop string in the middle of the greedy text: cut there on both, the runner's extra
    # steps past it are dropped; the wide daemon's runner is hurried out of the message that
    # was running when the control plane saw the stop
    stop = text[len(text) // 2:len(text) // 2 + 4]
    cut, sampled = {}, {}
    for kind, d in daemons.items():
        d.wait_quiet()
        before_cut = _metric(d, "edge_agent_tokens_generated_total")
        cut[kind] = _streamed(d, {**greedy, "stop": [stop]})
        d.wait_quiet()
        sampled[kind] = _metric(d, "edge_agent_tokens_generated_total") - before_cut
    assert cut["wide"] == cut["none"]
    assert cut["wide"][1] == "stop" and cut["wide"][0] == text[:text.index(stop)]
    # (the wide daemon's own message that held the stop string ran to its end: up to
    # MAX_STEPS - 1 tokens past it; the one written behind it ends after one step)
    assert sampled["none"] < 48 and sampled["wide"] <= sampled["none"] + MAX_STEPS, sampled


def test_batched_requests_under_a_wide_window_end_where_they_would_alone(
        daemons: dict[str, Daemon]) -> None:
    bodies = [{"prompt": p, "max_tokens": n, "temperature": 0}
              for p, n in (("The capital of France is", 30), ("def fibonacci(n):", 45),
                           (PROMPT, 17))]
    alone = [_streamed(daemons["none"], b)[:2] for b in bodies]
    got: list[Any] = [None] * len(bodies)

    def run(i: int) -> None:
        got[i] = _streamed(daemons["wide"], bodies[i])[:2]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert got == alone
    daemons["wide"].wait_quiet()  # every sequence released: no KV block stays taken


@pytest.mark.parametrize("engine", ["llamacpp", "numpy"])
def test_a_request_that_comes_mid_window_starts_within_a_few_steps(
        engine: str, request: pytest.FixtureRequest) -> None:
    """A long stream runs messages of MAX_STEPS steps; a request that arrives as one begins
    gets its first token within a few of that stream's tokens: the runner ends the message at
    its next step (hurry), and the one already built takes the request in when it is written
    and runs one step (`_at_send`). Without either, the stream gets at least MAX_STEPS more
    tokens first. On both engines: the window, the hurry and the late adds are the control
    plane's and the runner's, the same over either."""
    d: Daemon = (request.getfixturevalue("daemons")["wide"] if engine == "llamacpp"
                 else request.getfixturevalue("numpy_wide"))
    d.wait_quiet()
    seen = [0]  # the long stream's chunks so far
    at_submit = [0]
    burst = threading.Event()

    def long_stream() -> None:
        conn, resp = _open_stream(d, 120)
        try:
            while data := resp.read1(1 << 16):  # what one wake-up brings: a message's burst
                seen[0] += data.count(b"data: {")
                if seen[0] >= 24 and not burst.is_set():
                    at_submit[0] = seen[0]
                    burst.set()  # a message of the full window began about now
        finally:
            conn.close()

    t = threading.Thread(target=long_stream, daemon=True)
    t.start()
    assert burst.wait(120), seen
    conn = UnixHTTPConnection(str(d.sock), timeout=120)
    try:
        conn.request("POST", "/v1/completions", json.dumps(
            {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0,
             "stream": True}), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        while not resp.readline().startswith(b"data: {"):
            pass
        at_first = seen[0]
        resp.read()
    finally:
        conn.close()
    t.join(120)
    assert seen[0] >= at_first + 4, seen  # the long stream was still going
    assert at_first - at_submit[0] < MAX_STEPS - 4, (at_submit, at_first)


@pytest.mark.parametrize("engine", ["llamacpp", "numpy"])
def test_a_stream_cancelled_mid_window_is_not_stepped_on(
        engine: str, request: pytest.FixtureRequest) -> None:
    """A lone stream whose client hangs up while a message of MAX_STEPS steps runs: the
    control plane hurries that message (nothing waits, but its tokens would be dropped) and
    leaves the sequence out of the message already built behind it, so the runner samples a
    few tokens past the hang-up, not the rest of that window and all of the next one."""
    d: Daemon = (request.getfixturevalue("daemons")["wide"] if engine == "llamacpp"
                 else request.getfixturevalue("numpy_wide"))
    d.wait_quiet()
    before = _metric(d, "edge_agent_tokens_generated_total")
    conn, resp = _open_stream(d, 200)
    seen = 0
    try:
        while seen < 24 and (data := resp.read1(1 << 16)):  # a message's burst at a time
            seen += data.count(b"data: {")
    finally:
        conn.close()  # right after a burst: the next message of the window has just begun
    assert 24 <= seen < 200, seen
    d.wait_quiet()
    sampled = _metric(d, "edge_agent_tokens_generated_total") - before
    assert sampled < 200, sampled
    assert sampled - seen < MAX_STEPS // 2, (seen, sampled)
