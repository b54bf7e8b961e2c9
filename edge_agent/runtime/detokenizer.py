"""A token stream as text: `IncrementalDecoder` emits only complete UTF-8 characters and
resumes a stream at a byte offset it reported.

Invariant: it imports nothing but the standard library, so the control plane (which decodes
every streamed token, through the llama.cpp vocabulary or the numpy engine's tokenizer) keeps
neither numpy nor the `tokenizers` library in memory for it.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable
from typing import Protocol

from edge_agent.errors import EdgeAgentError

__all__ = ["DecoderStateError", "IncrementalDecoder", "TokenBytes"]


class TokenBytes(Protocol):
    """What the decoder needs of a tokenizer (runtime/tokenizer.py's, or LlamaVocab)."""

    @property
    def special_ids(self) -> frozenset[int]: ...

    def token_bytes(self, token_id: int) -> bytes: ...


class DecoderStateError(EdgeAgentError, ValueError):
    """An IncrementalDecoder resumed at an offset that is not a UTF-8 boundary of its stream."""


class IncrementalDecoder:
    """Turns a token stream into text, emitting only complete UTF-8 characters.

    `offset` counts the stream's bytes already emitted as text. To resume a stream, pass the
    tokens generated so far and the offset already delivered: the next `push` (or `flush`)
    returns the rest, starting exactly at that byte. Bytes that can never form a character
    (e.g. a stray continuation byte) come out as U+FFFD, so output is always valid text.
    """

    def __init__(self, tokenizer: TokenBytes, *, tokens: Iterable[int] = (), offset: int = 0,
                 skip_special: bool = False) -> None:
        self._tok = tokenizer
        self._skip = tokenizer.special_ids if skip_special else frozenset()
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        prior = b"".join(tokenizer.token_bytes(t) for t in tokens if t not in self._skip)
        if not 0 <= offset <= len(prior):
            raise DecoderStateError(
                f"cannot resume a token stream at byte {offset}: the {len(prior)} bytes of its "
                "tokens end before that. Hint: pass the offset recorded with these tokens."
            )
        probe = codecs.getincrementaldecoder("utf-8")(errors="replace")
        probe.decode(prior[:offset])
        if probe.getstate()[0]:
            raise DecoderStateError(
                f"cannot resume a token stream at byte {offset}: it splits a UTF-8 character "
                f"(bytes {prior[max(0, offset - 3):offset + 1].hex(' ')} around it). "
                "Hint: pass an offset an IncrementalDecoder reported."
            )
        self._offset = offset
        self._total = len(prior)
        self._carry = self._dec.decode(prior[offset:])

    @property
    def offset(self) -> int:
        return self._offset

    def push(self, token_id: int) -> str:
        """Add one token; return the text that is now complete (may be "")."""
        data = b"" if token_id in self._skip else self._tok.token_bytes(token_id)
        self._total += len(data)
        text = self._carry + self._dec.decode(data)
        self._carry = ""
        self._offset = self._total - len(self._dec.getstate()[0])
        return text

    def flush(self) -> str:
        """End of stream: return whatever is held back (an incomplete tail becomes U+FFFD)."""
        text = self._carry + self._dec.decode(b"", final=True)
        self._carry = ""
        self._offset = self._total
        return text
