"""A streamed reply carries exactly the text of the same reply fetched whole.

`RequestRecord` turns generated token ids into released text pieces; the OpenAI SSE stream, the
native `/v1/requests/{id}/events` stream and the UART all read those pieces with `follow()`,
and a non-streamed reply reads `text`. Text held back because it could start a stop string, then
released when the model ends (end-of-sequence token, length limit), must reach a stream that
already read every earlier piece. The tokens are real ids of the default model's vocabulary
(byte-level BPE: multi-byte characters are split across tokens), decoded by the real
tokenizer; stop strings are cut from the decoded text so that they really occur, straddle token
and character boundaries, or never match.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edge_agent.daemon.outcome import Outcome
from edge_agent.daemon.requests import RequestRecord
from edge_agent.protocol.api import GenerationRequest
from edge_agent.runtime.tokenizer import IncrementalDecoder, Tokenizer
from edge_agent.scheduler import Job

EOS = 2  # <|im_end|> of the default model
TEXTS = ["Hello, world!\n\n\nZZZZZZZZZZ end", "héllo wörld — ünïcode ✓ 日本語 🙂🙂 done",
         "a\n\n\n\nb", "stop STOP st op", "🙂", "ZZZZZZZZZZZZZZZZZZZZZZ"]


def _request(stop: tuple[str, ...], max_tokens: int) -> GenerationRequest:
    return GenerationRequest(chat=False, model=None, prompt="x", messages=None,
                             max_tokens=max_tokens, temperature=0.0, top_p=1.0, top_k=0,
                             seed=None, stop=stop, stream=True, priority=None, timeout_ms=None)


def _expected(tok: Tokenizer, ids: list[int], stop: tuple[str, ...], max_new: int) -> str:
    """The oracle: the text the model generated before it ended, cut where a stop string first
    appears as the text grows token by token (the first stop completed wins, as in
    llama-server; among stops completed by the same token, the one that starts first)."""
    data = b""
    text = ""
    for n, t in enumerate(ids):
        if t == EOS or n >= max_new:
            break
        data += tok.token_bytes(t)
        for trim in range(4):  # the longest prefix that is whole UTF-8
            try:
                text = data[: len(data) - trim].decode("utf-8")
                break
            except UnicodeDecodeError:
                continue
        cuts = [i for i in (text.find(s) for s in stop) if i >= 0]
        if cuts:
            return text[: min(cuts)]
    text = data.decode("utf-8", errors="replace")  # the end: an incomplete tail becomes U+FFFD
    cuts = [i for i in (text.find(s) for s in stop) if i >= 0]
    return text[: min(cuts)] if cuts else text


def _run(tok: Tokenizer, ids: list[int], stop: tuple[str, ...], max_new: int) -> tuple[str, str,
                                                                                        str]:
    """Push `ids` into a record while a reader drains it after every token, as a live stream
    does; return (text seen by the live reader, a stream read after the end, record text)."""

    async def go() -> tuple[str, str, str]:
        rec = RequestRecord(job=Job(id="r1", model="m", prompt_ids=[1]),
                            request=_request(stop, max_new), model="m",
                            decoder=IncrementalDecoder(tok), prompt_tokens=1,
                            stop_ids=frozenset({EOS}), context=4096)
        live: list[str] = []
        reader = rec.follow(0)
        pending = asyncio.ensure_future(reader.__anext__())
        for t in ids:
            if rec.push(t):
                rec.end(Outcome.done(rec.ended))  # as RequestTable.finish does
                break
            await asyncio.sleep(0)  # the reader takes every piece released so far
            while pending.done():
                live.append(pending.result()[1])
                pending = asyncio.ensure_future(reader.__anext__())
                await asyncio.sleep(0)
        assert rec.done.is_set(), "the drawn tokens end by end-of-sequence or max_tokens"
        try:
            while True:
                live.append((await pending)[1])
                pending = asyncio.ensure_future(reader.__anext__())
        except StopAsyncIteration:
            pass
        late = "".join([p async for _, p in rec.follow(0)])
        return "".join(live), late, rec.text

    return asyncio.run(go())


@pytest.fixture(scope="module")
def corpus(tokenizer: Tokenizer) -> list[list[int]]:
    return [tokenizer.encode(t) for t in TEXTS]


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_streamed_text_equals_whole_text(tokenizer: Tokenizer, corpus: list[list[int]],
                                         data: st.DataObject) -> None:
    ids = list(data.draw(st.sampled_from(corpus), label="tokens"))
    assert ids
    cut = data.draw(st.integers(0, len(ids)), label="end-of-sequence at")
    with_eos = data.draw(st.booleans(), label="ends on end-of-sequence")
    if with_eos:
        ids = ids[:cut] + [EOS]
    text = tokenizer.decode([t for t in ids if t != EOS])
    stop_from_text = st.builds(lambda a, n: text[a:a + n], st.integers(0, max(0, len(text) - 1)),
                               st.integers(1, 12)).filter(bool)
    stop = tuple(data.draw(st.lists(st.one_of(stop_from_text, st.sampled_from(
        ["\n\n\n\n", "ZZZZZZZZZZ", "never-there", "🙂🙂", "é"])), max_size=3), label="stop"))
    # without an end-of-sequence token the length limit must end the reply within `ids`
    max_new = data.draw(st.integers(1, len(ids) + 2 if with_eos else max(1, len(ids))),
                        label="max_tokens")
    live, late, whole = _run(tokenizer, ids, stop, max_new)
    expected = _expected(tokenizer, ids, stop, max_new)
    assert whole == expected
    assert late == expected
    assert live == expected


@pytest.mark.parametrize("stop", [("\n\n\n\n",), ("ZZZZZZZZZZ",)])
def test_text_held_for_a_stop_reaches_a_live_stream_at_end_of_sequence(
        tokenizer: Tokenizer, stop: tuple[str, ...]) -> None:
    """The case as a client met it: no stop occurs, the model ends on its end-of-sequence
    token, and the last (longest stop - 1) characters were held back until then."""
    ids = tokenizer.encode("The end of the story.") + [EOS]
    live, late, whole = _run(tokenizer, ids, stop, 64)
    assert whole == "The end of the story."
    assert live == whole and late == whole


def _prefix_len(tok: Tokenizer, ids: list[int]) -> int:
    """Characters of the longest whole-UTF-8 prefix of `ids`' bytes (what has been decoded)."""
    data = b"".join(tok.token_bytes(t) for t in ids)
    for trim in range(4):
        try:
            return len(data[: len(data) - trim].decode("utf-8"))
        except UnicodeDecodeError:
            continue
    raise AssertionError("no UTF-8 prefix")


@settings(max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_streamed_logprobs_equal_whole_logprobs(tokenizer: Tokenizer, corpus: list[list[int]],
                                               data: st.DataObject) -> None:
    """Each streamed piece carries the logprob entries released with it, the end the rest: the
    same entries as the whole reply; a stop string's cut drops the tokens whose text starts at
    or after it, and only those."""
    ids = list(data.draw(st.sampled_from(corpus), label="tokens"))
    text = tokenizer.decode(ids)
    stop = tuple(data.draw(st.lists(st.builds(
        lambda a, n: text[a:a + n], st.integers(0, max(0, len(text) - 1)),
        st.integers(1, 6)).filter(bool), max_size=2), label="stop"))
    max_new = data.draw(st.integers(1, len(ids)), label="max_tokens")
    req = dataclasses.replace(_request(stop, max_new), logprobs=1)

    async def go() -> tuple[list[float], list[float], RequestRecord]:
        rec = RequestRecord(job=Job(id="r1", model="m", prompt_ids=[1]), request=req,
                            model="m", decoder=IncrementalDecoder(tokenizer),
                            prompt_tokens=1, stop_ids=frozenset({EOS}), context=4096)
        for i, t in enumerate(ids):
            if rec.push(t, [float(i), [[t, float(i)]]]):
                rec.end(Outcome.done(rec.ended))  # as RequestTable.finish does
                break
        streamed: list[float] = []
        sent = 0
        async for k, _ in rec.follow(0):
            upto = rec.piece_logprobs[k]
            streamed += [e[1] for e in rec.logprob_entries(sent, upto)]
            sent = upto
        streamed += [e[1] for e in rec.logprob_entries(sent, rec.logprobs_released)]
        whole = [e[1] for e in rec.logprob_entries(0, rec.logprobs_released)]
        return streamed, whole, rec

    streamed, whole, rec = asyncio.run(go())
    assert streamed == whole
    pushed = len(rec.tokens)
    if rec.finish_reason == "stop":  # cut by a stop string (no end-of-sequence id here)
        starts = [_prefix_len(tokenizer, ids[:i]) for i in range(pushed)]
        assert whole == [float(i) for i in range(pushed) if starts[i] < len(rec.text)]
    else:
        assert whole == [float(i) for i in range(pushed)]
