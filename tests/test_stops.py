"""StopText, the one hold-back for stop strings (daemon records and `stream_text`), against an
oracle that searches the whole text after every piece."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from edge_agent.runtime.stops import StopText

ALPHABET = "ab\n🙂"
PIECES = st.lists(st.text(ALPHABET, max_size=4), max_size=12)
STOPS = st.lists(st.text(ALPHABET, min_size=1, max_size=4), max_size=3)


def _oracle(pieces: list[str], stops: list[str]) -> tuple[str, bool]:
    """The text before the first stop string completed as the pieces arrive (the earliest
    start among those completed by the same piece), and whether one was."""
    text = ""
    for piece in pieces:
        text += piece
        cuts = [i for i in (text.find(s) for s in stops) if i >= 0]
        if cuts:
            return text[: min(cuts)], True
    return text, False


@given(PIECES, STOPS)
def test_released_text_is_the_oracles_and_only_a_stop_prefix_is_held(
        pieces: list[str], stops: list[str]) -> None:
    s = StopText(stops)
    out = ""
    for piece in pieces:
        out += s.push(piece)
        if s.stopped:
            break
        # held back: a proper prefix of some stop string, and no longer than needed
        assert s.held == "" or any(stop.startswith(s.held) and stop != s.held for stop in stops)
    out += s.end()
    assert (out, s.stopped) == _oracle(pieces, stops)


def test_text_that_cannot_start_a_stop_is_released_at_once() -> None:
    s = StopText(["</end>"])
    assert s.push("hello <") == "hello "  # "<" could start it
    assert s.push("b") == "<b"
    assert s.push(" </en") == " "
    assert s.push("d>tail") == "" and s.stopped
    assert s.push("more") == "" and s.end("x") == ""


def test_no_stops_holds_nothing_and_end_releases_the_flush() -> None:
    s = StopText(())
    assert s.push("abc") == "abc" and s.held == ""
    assert s.end("d") == "d" and not s.stopped
