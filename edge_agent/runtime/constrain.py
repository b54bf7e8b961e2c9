"""Constrained decoding: a grammar per sequence removes the tokens it cannot take (llguidance).

A grammar is text in llguidance's Lark dialect (`start: %json {...schema...}` for JSON); the
control plane builds it (`json_grammar`, `tool_call_grammar`), checks it (`check_grammar`) and
sends it with the sequence's sampling parameters (key `grammar`); the engine's `Constraints`
masks that sequence's logits row before sampling and advances its matcher with the token drawn.

Invariants owned here:
- A step with no constrained sequence costs one empty-dict test: `mask` and `advance` return at
  once; nothing is built (the token table, a grammar) until the first grammar arrives.
- The tokens allowed at generation index i are a pure function of (grammar, tokens 0..i-1): a
  resumed sequence replays its generated tokens through a fresh matcher (`start(...,
  generated)`) and continues in the state an uninterrupted run has there; masks draw no random
  number, so temperature 0 and a fixed seed stay deterministic.
- Each distinct grammar text is compiled once (an LRU of compiled matchers); a new sequence gets
  a copy of the compiled one.
- Where the grammar allows the end, every end-of-generation token is allowed; once it is
  complete, only they are: the sequence ends with end-of-sequence.
"""

from __future__ import annotations

import collections
import json
import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from edge_agent.errors import EdgeAgentError

# numpy is imported by Constraints (the runner's), not by the grammar builders the control
# plane calls: it would cost the control plane 10 MiB for a check it never computes with
if TYPE_CHECKING:
    import numpy as np

__all__ = ["COMPACT_JSON", "ConstraintError", "Constraints", "check_grammar", "json_grammar",
           "tool_call_grammar"]

log = logging.getLogger("edge_agent.constrain")

CACHE_GRAMMARS = 32  # compiled grammars kept per engine
# JSON written on one line with ", " and ": " (no free whitespace: a small model given free
# whitespace can spend its whole budget on newlines)
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class ConstraintError(EdgeAgentError):
    """A grammar that cannot be compiled, or tokens it does not allow."""


def _llg() -> Any:
    try:
        import llguidance
    except ImportError as exc:  # pragma: no cover - a main dependency
        raise ConstraintError("constrained decoding needs the llguidance package, which is not "
                              "installed. Hint: pip install llguidance (a dependency of "
                              "edge-agent).") from exc
    return llguidance


# -- grammars (control plane side: pure text) ---------------------------------------------------

def _json_rule(schema: Mapping[str, Any]) -> str:
    spec = dict(schema)
    spec["x-guidance"] = {**COMPACT_JSON, **dict(spec.get("x-guidance") or {})}
    return "%json " + json.dumps(spec, ensure_ascii=False, sort_keys=False)


def json_grammar(schema: Mapping[str, Any] | None) -> str:
    """One JSON value following `schema`; None: any JSON object."""
    return "start: " + _json_rule(schema if schema is not None else {"type": "object"})


def tool_call_grammar(functions: Sequence[Mapping[str, Any]], *, tags: bool,
                      key: str = "arguments") -> str:
    """One call of one of `functions` ({"name", "parameters"}): `{"name": NAME, KEY: {...}}`
    with the arguments following that function's parameters schema, KEY "arguments" or
    "parameters" (Llama 3.x's form); with `tags`, wrapped in `<tool_call>\\n...\\n</tool_call>`
    (the Hermes/Qwen form)."""
    variants = []
    for fn in functions:
        params = fn.get("parameters") or {"type": "object"}
        variants.append({"type": "object",
                         "properties": {"name": {"const": fn["name"]}, key: params},
                         "required": ["name", key], "additionalProperties": False})
    schema = variants[0] if len(variants) == 1 else {"anyOf": variants}
    body = _json_rule(schema)
    if tags:
        return f'start: "<tool_call>\\n" call "\\n</tool_call>"\ncall: {body}'
    return f"start: {body}"


def check_grammar(grammar: str) -> str | None:
    """None when `grammar` compiles, else why not (the library's message, one line)."""
    llg = _llg()
    try:
        err: str = llg.LLMatcher.validate_grammar(llg.LLMatcher.grammar_from_lark(grammar))
    except (ValueError, TypeError) as exc:
        err = str(exc)
    if not err:
        return None
    lines = [ln for ln in err.splitlines() if ln.strip()]
    return lines[0] if lines else err


# -- the engine side ----------------------------------------------------------------------------

class _Table:
    """llguidance's view of a tokenizer: every token's bytes (control tokens marked 0xFF)."""

    def __init__(self, tokenizer: Any) -> None:
        size = int(tokenizer.vocab_size)
        special = frozenset(tokenizer.special_ids)
        self.eos_token_id = int(tokenizer.eos_id)
        self.bos_token_id = getattr(tokenizer, "bos_id", None)
        self.tokens = [b"\xff" + tokenizer.token_text(i).encode() if i in special
                       else tokenizer.token_bytes(i) for i in range(size)]
        self.special_token_ids = sorted(special)
        self._tok = tokenizer

    def __call__(self, text: str) -> list[int]:
        return list(self._tok.tokenize(text, add_bos=False, parse_special=False))


class Constraints:
    """The matchers of one engine's constrained sequences, by sequence id."""

    def __init__(self, tokenizer: Any, n_vocab: int) -> None:
        import numpy as np

        self._tokenizer = tokenizer
        self.n_vocab = int(n_vocab)  # width of a logits row (may exceed the tokenizer's)
        self._lltok: Any = None
        self._compiled: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self._matchers: dict[str, Any] = {}
        self._ended: set[str] = set()  # complete or broken: only end-of-generation is allowed
        self._eog = np.array(sorted(int(i) for i in (getattr(tokenizer, "eog_ids", None)
                                                      or {tokenizer.eos_id})), dtype=np.intp
                             ) if tokenizer is not None else np.empty(0, np.intp)
        self._eog_set = frozenset(int(i) for i in self._eog)  # the same ids, for lookups
        self._bits: np.ndarray | None = None

    @property
    def active(self) -> list[str]:
        return list(self._matchers)

    def _tok(self) -> Any:
        if self._lltok is None:
            if self._tokenizer is None:
                raise ConstraintError("constrained decoding: this engine has no tokenizer. "
                                      "Hint: load the engine with Engine.load().")
            import numpy as np

            llg = _llg()
            self._lltok = llg.LLTokenizer(llg.TokenizerWrapper(_Table(self._tokenizer)),
                                          n_vocab=self.n_vocab)
            self._bits = np.full((1, (self.n_vocab + 31) // 32), -1, dtype=np.int32)
        return self._lltok

    def _compile(self, grammar: str) -> Any:
        base = self._compiled.get(grammar)
        if base is not None:
            self._compiled.move_to_end(grammar)
            return base
        llg = _llg()
        base = llg.LLMatcher(self._tok(), llg.LLMatcher.grammar_from_lark(grammar), log_level=0)
        if base.is_error():
            raise ConstraintError(f"grammar does not compile: {base.get_error()}. Hint: check "
                                  "the JSON schema (response_format or the tool's parameters).")
        self._compiled[grammar] = base
        while len(self._compiled) > CACHE_GRAMMARS:
            self._compiled.popitem(last=False)
        return base

    def start(self, seq_id: str, grammar: str, generated: Sequence[int] = ()) -> None:
        """Constrain `seq_id` by `grammar`, its matcher advanced over `generated` (a resume)."""
        matcher = self._compile(grammar).deep_copy()
        done = [int(t) for t in generated]
        stop = self._eog_set
        for k, t in enumerate(done):
            if t in stop:
                break
            if not matcher.consume_token(t):
                raise ConstraintError(
                    f"sequence {seq_id!r}: generated token #{k} (id {t}) is not allowed by its "
                    f"grammar ({matcher.get_error()}). Hint: resume a request with the grammar "
                    "it was generated under.")
        self._matchers[seq_id] = matcher
        self._ended.discard(seq_id)
        if matcher.is_stopped():
            self._ended.add(seq_id)

    def release(self, seq_id: str) -> None:
        self._matchers.pop(seq_id, None)
        self._ended.discard(seq_id)

    def mask(self, seq_ids: Sequence[str], logits: np.ndarray) -> None:
        """Set to -inf, in row i of `logits` (B, V), every token seq_ids[i]'s grammar forbids."""
        if not self._matchers:
            return
        import numpy as np
        from llguidance.numpy import fill_next_token_bitmask

        for i, sid in enumerate(seq_ids):
            matcher = self._matchers.get(sid)
            if matcher is None:
                continue
            row = logits[i]  # (V,)
            if sid in self._ended:
                keep = row[self._eog].copy()
                row[:] = -np.inf
                row[self._eog] = keep
                continue
            assert self._bits is not None
            fill_next_token_bitmask(matcher, self._bits)
            allowed = np.unpackbits(self._bits[0].view(np.uint8), bitorder="little")  # (32k,)
            allowed = allowed[: row.shape[0]].view(bool)  # (V,)
            keep = row[self._eog].copy() if allowed[self._tokenizer.eos_id] else None
            row[~allowed] = -np.inf
            if keep is not None:  # the end may come here: by any end-of-generation token
                row[self._eog] = keep

    def advance(self, seq_ids: Sequence[str], tokens: Sequence[int]) -> None:
        """Move each constrained sequence's matcher past the token it was given."""
        if not self._matchers:
            return
        stop = self._eog_set
        for sid, tok in zip(seq_ids, tokens, strict=True):
            matcher = self._matchers.get(sid)
            if matcher is None or sid in self._ended:
                continue
            tok = int(tok)
            if tok in stop:
                self._ended.add(sid)
                continue
            if not matcher.consume_token(tok):
                log.warning("constrain: sequence %s: token %d refused (%s); ending it", sid,
                            tok, matcher.get_error())
                self._ended.add(sid)
            elif matcher.is_stopped():
                self._ended.add(sid)
