"""A thinking model's reasoning kept apart from its answer (daemon/reasoning.py): the split of a
whole reply, and the stream gate that sends each piece as soon as it is known and, whatever
the pieces, sends exactly the split of the whole reply."""

from __future__ import annotations

import random

import pytest

from edge_agent.daemon.reasoning import ReplyGate, ThinkGate, split_thought


@pytest.mark.parametrize(("text", "opened", "expected"), [
    ("Thinking it over.\n</think>\n\nThe answer is 4.", True,
     ("Thinking it over.", "The answer is 4.")),
    ("\n<think>\nHmm.\n</think>\nYes.", False, ("Hmm.", "Yes.")),
    ("Plain answer, no thought.", False, (None, "Plain answer, no thought.")),
    ("  leading blanks stay when there is no thought", False,
     (None, "  leading blanks stay when there is no thought")),
    ("<thinking>is not a tag</thinking>", False, (None, "<thinking>is not a tag</thinking>")),
    ("Cut off while thinking </thi", True, ("Cut off while thinking </thi", "")),
    ("\n</think>\n\nNo thought at all.", True, (None, "No thought at all.")),
    ("All thought.\n</think>\n\n", True, ("All thought.", "")),
    ("<th", False, (None, "<th")),
    ("", True, (None, "")),
    ("a</think>b</think>c", True, ("a", "b</think>c")),
])
def test_a_reply_splits_into_reasoning_and_answer(text: str, opened: bool,
                                                  expected: tuple[str | None, str]) -> None:
    assert split_thought(text, opened) == expected


REPLIES = [("Thinking it over.\n</think>\n\nThe answer is 4.", True),
           ("\n<think>\nHmm, two   spaces.\n\n</think>\n  Yes.\n", False),
           ("Plain answer <think> inside is text.", False),
           ("Cut off while thinking </thi", True), ("  ", False), ("<think>", False),
           ("x</think>", True), ("a</think>b</think>c", True)]


def _gate(pieces: list[str], opened: bool) -> tuple[str, str, list[int]]:
    gate, said, answered, done = ThinkGate(opened), "", "", []
    for piece in pieces:
        r, a = gate.feed(piece)
        said, answered = said + r, answered + a
        done.append(gate.done)
    r, a = gate.end()
    return said + r, answered + a, done


@pytest.mark.parametrize(("text", "opened"), REPLIES)
def test_whatever_the_pieces_a_stream_sends_the_split_of_the_whole(text: str,
                                                                   opened: bool) -> None:
    rng = random.Random(text)
    reasoning, answer = split_thought(text, opened)
    for _ in range(60):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 9)))) \
            if len(text) > 1 else []
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        said, answered, done = _gate(pieces, opened)
        assert (said or None, answered) == (reasoning, answer), pieces
        assert done == sorted(done) and all(d <= len(text) for d in done)  # never backwards


def test_a_thought_streams_as_it_comes_and_holds_only_what_may_be_a_tag() -> None:
    gate = ThinkGate(opened=True)
    assert gate.feed("\nI count") == ("I count", "")
    assert gate.feed(" the r's. ") == (" the r's.", "")  # trailing blanks may end the thought
    assert gate.feed("Three.</th") == (" Three.", "")  # "</th" may begin the tag
    assert gate.feed("ink>\n\nThree") == ("", "Three")
    assert gate.feed(" r's.") == ("", " r's.")
    assert gate.end() == ("", "")


def test_an_answer_that_may_call_tools_is_read_by_the_call_gate_after_the_thought() -> None:
    call = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    gate = ReplyGate(thought=True, names=["f"])
    assert gate.feed("Call f.\n</think>\n\nSure: ") == ("Call f.", "Sure:")
    assert gate.feed(call[:12]) == ("", "")
    assert gate.sent < len(gate.text) and gate.take() == []  # held: it may begin a call
    assert gate.feed(call[12:42]) == ("", "")
    assert gate.take() == [(0, "f", '{"x')]  # a call: its name, and its arguments as they come
    assert gate.feed(call[42:]) == ("", "") and gate.take() == [(0, None, '": 1}')]
    assert gate.rest() == ("", "") and gate.take() == []  # the content went already
    assert [(c.name, c.arguments, c.closed) for c in gate.calls] == [("f", '{"x": 1}', True)]
    plain = ReplyGate(thought=None)
    assert plain.feed("<think>x</think>y") == ("", "<think>x</think>y")
    assert plain.sent == len(plain.text) and plain.rest() == ("", "") and plain.take() == []
