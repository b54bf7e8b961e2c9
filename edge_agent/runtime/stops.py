"""Stop strings over streamed text: what may be released now, and where the output ends.

One implementation for every path that streams text (`RequestRecord` in the daemon,
`stream_text` for the CLI and the engines' one-request convenience), so a streamed reply and
the same reply fetched whole carry the same text.

Invariants owned here:
- Text is held back only while it could still be the start of a stop string: the longest
  suffix of the unreleased text that is a proper prefix of some stop string. Everything before
  it is released at once.
- The output ends before the first stop string that appears as text is fed (among those
  completed by the same piece, the one that starts first); nothing after it is ever released.
- Released text never contains a whole stop string, so a stop string can only appear within
  the held-back text plus the new piece: that is the only text searched.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["StopText"]


class StopText:
    """Feed decoded text with `push`; `end` at the end of generation. Both return the text
    that may be released now; once `stopped`, the rest is dropped."""

    def __init__(self, stop: Iterable[str]) -> None:
        self.stop = tuple(stop)
        self.held = ""  # unreleased text that could still start a stop string
        self.stopped = False

    def push(self, text: str) -> str:
        """Add `text`; the text that can no longer be part of a stop string."""
        if self.stopped:
            return ""
        pending = self.held + text
        cuts = [i for i in (pending.find(s) for s in self.stop) if i >= 0]
        if cuts:
            self.stopped, self.held = True, ""
            return pending[: min(cuts)]
        keep = self._prefix_len(pending)
        self.held = pending[len(pending) - keep:]
        return pending[: len(pending) - keep]

    def end(self, text: str = "") -> str:
        """Add the last `text` (a decoder's flush) and release everything left."""
        out = self.push(text)
        if not self.stopped:
            out, self.held = out + self.held, ""
        return out

    def _prefix_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
