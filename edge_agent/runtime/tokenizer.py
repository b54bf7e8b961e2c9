"""Byte-level BPE tokenizer built from GGUF metadata, matching llama.cpp's tokenizer.

Invariants owned here:
- Only `tokenizer.ggml.model == "gpt2"` (byte-level BPE) is supported; anything else, an unknown
  `tokenizer.ggml.pre`, or missing/inconsistent tokenizer keys raise ModelFileError naming the
  source and the key.
- Pre-tokenization is llama.cpp's: its regex list for the `pre` type (runtime/pretokenizers.py),
  each regex splitting every fragment into matches and non-matches ("isolated"), then byte-level
  mapping and BPE (rank, then leftmost merge first). The `tokenizers` library runs it; the result
  was checked equal to llama.cpp on the committed corpus
  (tests/data/tokenizer_reference_llamacpp.json) and on llama.cpp's own vocab tests.
- `encode` never parses control tokens in text: "<|im_start|>" typed by a user is plain text.
  Only USER_DEFINED tokens (type 4) are matched in raw text, longest first, as llama.cpp does.
- `token_bytes(id)` is the exact byte string a token stands for (byte-level decoded for normal
  tokens, raw UTF-8 text for control / user-defined tokens), so detokenization is byte-exact and
  `decode(encode(s)) == s` for any str without lone surrogates.
- `to_bytes()` / `from_bytes()` round-trip everything `from_metadata` read; `fingerprint` is a
  sha256 over tokens, types, merges, pre, model, special ids, add_bos and the chat template.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from collections.abc import Iterable, Mapping, Sequence
from functools import cached_property
from typing import Any

import numpy as np
from tokenizers import Regex
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import models as _models
from tokenizers import pre_tokenizers as _pre

from edge_agent.errors import EXIT_USAGE, EdgeAgentError, ModelFileError
from edge_agent.runtime.chat import ChatTemplate, require_chatml
from edge_agent.runtime.detokenizer import DecoderStateError, IncrementalDecoder
from edge_agent.runtime.pretokenizers import PRE_TOKENIZERS

__all__ = [
    "Tokenizer", "IncrementalDecoder", "TokenizerCacheError", "DecoderStateError",
    "InvalidTextError", "PRE_TOKENIZERS", "TOKEN_NORMAL", "TOKEN_UNKNOWN", "TOKEN_CONTROL",
    "TOKEN_USER_DEFINED", "TOKEN_UNUSED", "TOKEN_BYTE",
]

# llama.cpp's token types (tokenizer.ggml.token_type)
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = (
    1, 2, 3, 4, 5, 6
)

_CACHE_MAGIC = b"EATOK\x00\x00\x01"
_EOG_TEXTS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>")


class TokenizerCacheError(ModelFileError):
    """A serialized tokenizer (journal cache) that is corrupt or from another format version."""


class InvalidTextError(EdgeAgentError, ValueError):
    """Text that is not Unicode text (a lone surrogate, e.g. from a JSON "\\ud800" escape)."""

    exit_code = EXIT_USAGE


def _invalid_text(text: str) -> InvalidTextError:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return InvalidTextError(
            f"cannot tokenize text: character {text[exc.start]!r} at index {exc.start} is a lone "
            "surrogate, not a Unicode character. Hint: send valid UTF-8 (check the client's "
            "JSON escapes)."
        )
    return InvalidTextError(f"cannot tokenize text {text[:40]!r}. Hint: send plain str.")


def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte <-> printable character map, as char -> byte."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = list(keep)
    extra = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(keep, chars, strict=True)}


_CHAR_TO_BYTE = _byte_level_table()


class Tokenizer:
    """A byte-level BPE tokenizer; build with `from_metadata` or `from_bytes`."""

    def __init__(self, fields: Mapping[str, Any], tokens: list[str], token_types: list[int],
                 pairs: list[tuple[str, str]]) -> None:
        self._fields = dict(fields)  # model, pre, bos/eos/unk/pad/eot/eom ids, add_bos, ...
        self._tokens, self._types, self._pairs = tokens, token_types, pairs
        self.source: str = self._fields.get("source", "")
        self.pre: str = self._fields["pre"]
        self.bos_id: int | None = self._fields.get("bos")
        self.eos_id: int | None = self._fields.get("eos")
        self.add_bos: bool = bool(self._fields.get("add_bos", False))
        self.chat_template_text: str | None = self._fields.get("chat_template")
        vocab = {t: i for i, t in enumerate(tokens)}
        self._vocab = vocab
        regexes, ignore_merges = PRE_TOKENIZERS[self.pre]
        try:
            hf = _HFTokenizer(_models.BPE(vocab, pairs, ignore_merges=ignore_merges))
        except Exception as exc:  # the Rust side reports e.g. a merge part not in the vocab
            what = f"was refused by the BPE model: {exc}"
            raise self._error("tokenizer.ggml.merges", what) from exc
        hf.pre_tokenizer = _pre.Sequence(
            [_pre.Split(Regex(r), behavior="isolated") for r in regexes]
            + [_pre.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
        self._hf = hf
        self._bytes_cache: list[bytes | None] = [None] * len(tokens)
        kinds = np.asarray(token_types)
        user = [i for i in np.flatnonzero(kinds == TOKEN_USER_DEFINED).tolist() if tokens[i]]
        self._user_defined = sorted(user, key=lambda i: -len(tokens[i]))
        special = np.flatnonzero((kinds == TOKEN_CONTROL) | (kinds == TOKEN_UNKNOWN)).tolist()
        self.special_ids: frozenset[int] = frozenset(special) | {
            i for i in (self.bos_id, self.eos_id) if i is not None
        }
        eog = {self._fields.get(k) for k in ("eos", "eot", "eom")} | {
            vocab[t] for t in _EOG_TEXTS if t in vocab and self._types[vocab[t]] == TOKEN_CONTROL
        }
        self.eog_ids: frozenset[int] = frozenset(i for i in eog if i is not None)
        self._chat = ChatTemplate.detect(self.chat_template_text, vocab, source=self.source)

    # -- construction ---------------------------------------------------------------------

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any], *, source: str = "") -> Tokenizer:
        """Build from GGUF metadata; ModelFileError names `source` and the bad key."""
        where = source or "model metadata"

        def fail(key: str, what: str, hint: str) -> ModelFileError:
            return ModelFileError(f"{where}: tokenizer metadata {key!r} {what}. Hint: {hint}")

        reconvert = "re-convert the model with a current llama.cpp convert_hf_to_gguf.py."
        model = metadata.get("tokenizer.ggml.model")
        if model is None:
            raise fail("tokenizer.ggml.model", "is missing", reconvert)
        if model != "gpt2":
            raise fail("tokenizer.ggml.model", f"is {model!r}, which the numpy engine's "
                       "tokenizer does not read (only 'gpt2', byte-level BPE; 'llama' is "
                       "SentencePiece)", "use the llamacpp engine, which reads every "
                       "vocabulary type (--engine llamacpp, or runtime.engine = \"llamacpp\"), "
                       "or a model with a GPT-2 style BPE tokenizer such as the default SmolLM2.")
        tokens = metadata.get("tokenizer.ggml.tokens")
        if not isinstance(tokens, (list, tuple)) or not tokens or not isinstance(tokens[0], str):
            raise fail("tokenizer.ggml.tokens", "is missing or empty", reconvert)
        merges = metadata.get("tokenizer.ggml.merges")
        if not isinstance(merges, (list, tuple)) or not merges or not isinstance(merges[0], str):
            raise fail("tokenizer.ggml.merges", "is missing or empty (a BPE model needs merges)",
                       reconvert)
        types = metadata.get("tokenizer.ggml.token_type")
        if types is None:
            types = [TOKEN_NORMAL] * len(tokens)  # llama.cpp's default
        elif not isinstance(types, (list, tuple)) or len(types) != len(tokens):
            n = len(types) if isinstance(types, (list, tuple)) else type(types).__name__
            raise fail("tokenizer.ggml.token_type", f"has {n} entries for {len(tokens)} tokens",
                       reconvert)
        pre = metadata.get("tokenizer.ggml.pre", "default")
        if pre not in PRE_TOKENIZERS:
            raise fail("tokenizer.ggml.pre", f"is {pre!r}, a pre-tokenizer edge-agent does not "
                       f"know (supported: {', '.join(sorted(PRE_TOKENIZERS))})",
                       "use a model whose pre-tokenizer is listed, or add its regexes to "
                       "edge_agent.runtime.pretokenizers.PRE_TOKENIZERS.")
        fields: dict[str, Any] = {"model": model, "pre": pre, "source": source}
        for name in ("bos", "eos", "unknown", "padding", "eot", "eom"):
            key = f"tokenizer.ggml.{name}_token_id"
            value = metadata.get(key)
            if value is None:
                continue
            if not isinstance(value, int) or not 0 <= value < len(tokens):
                raise fail(key, f"is {value!r}, outside the vocabulary of {len(tokens)} tokens",
                           reconvert)
            fields[name[:3]] = value
        fields["add_bos"] = bool(metadata.get("tokenizer.ggml.add_bos_token", False))
        template = metadata.get("tokenizer.chat_template")
        fields["chat_template"] = template if isinstance(template, str) else None
        cuts = [m.find(" ", 1) for m in merges]  # llama.cpp: the first space after char 0
        if min(cuts) < 0:
            i = cuts.index(-1)
            raise fail("tokenizer.ggml.merges", f"entry #{i} {merges[i]!r} has no space between "
                       "its two parts", reconvert)
        pairs = [(m[:c], m[c + 1 :]) for m, c in zip(merges, cuts, strict=True)]
        return cls(fields, list(tokens), [int(t) for t in types], pairs)

    def _error(self, key: str, what: str) -> ModelFileError:
        return ModelFileError(
            f"{self.source or 'model metadata'}: tokenizer metadata {key!r} {what}. Hint: "
            "re-convert the model with a current llama.cpp convert_hf_to_gguf.py."
        )

    # -- encode / decode ------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    def token_text(self, token_id: int) -> str:
        """The token as stored in the vocabulary (byte-level characters for normal tokens)."""
        return self._tokens[self._check_id(token_id)]

    def token_id(self, text: str) -> int | None:
        """The id of a vocabulary entry (as stored), or None."""
        return self._vocab.get(text)

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        """Token ids of `text`; control-token text in it is plain text. No BOS unless asked."""
        ids: list[int] = [self.bos_id] if add_bos and self.bos_id is not None else []
        for fragment in self._partition(text):
            if isinstance(fragment, int):
                ids.append(fragment)
            elif fragment:
                try:
                    ids.extend(self._hf.encode(fragment, add_special_tokens=False).ids)
                except TypeError as exc:  # the Rust side refuses str that is not UTF-8-able
                    raise _invalid_text(fragment) from exc
        return ids

    def tokenize(self, text: str, *, add_bos: bool, parse_special: bool) -> list[int]:
        """llama.cpp's `llama_tokenize` semantics (as `LlamaVocab.tokenize`): `add_bos` adds
        BOS only where the vocabulary uses one (`tokenizer.ggml.add_bos_token`); with
        `parse_special`, the text of a control token (`<|im_start|>`) is that token."""
        ids: list[int] = ([self.bos_id] if add_bos and self.add_bos and self.bos_id is not None
                          else [])
        specials = ({self.token_text(i): i for i in self.special_ids if self.token_text(i)}
                    if parse_special else {})
        if not specials:
            return ids + self.encode(text)
        pattern = re.compile("|".join(re.escape(t) for t in sorted(specials, key=len,
                                                                     reverse=True)))
        at = 0
        for m in pattern.finditer(text):
            if m.start() > at:
                ids += self.encode(text[at:m.start()])
            ids.append(specials[m.group()])
            at = m.end()
        if at < len(text):
            ids += self.encode(text[at:])
        return ids

    def _partition(self, text: str) -> list[str | int]:
        """Split out USER_DEFINED tokens, longest first (llama.cpp's st_partition)."""
        parts: list[str | int] = [text]
        for tid in self._user_defined:
            needle = self._tokens[tid]
            nxt: list[str | int] = []
            for part in parts:
                if isinstance(part, int) or needle not in part:
                    nxt.append(part)
                    continue
                pieces = part.split(needle)
                for j, piece in enumerate(pieces):
                    if j:
                        nxt.append(tid)
                    if piece:
                        nxt.append(piece)
            parts = nxt
        return parts

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes the token stands for."""
        cached = self._bytes_cache[self._check_id(token_id)]
        if cached is not None:
            return cached
        text, kind = self._tokens[token_id], self._types[token_id]
        if kind in (TOKEN_NORMAL, TOKEN_BYTE):
            # a character outside the byte-level alphabet (odd conversions) stays as UTF-8
            raw = b"".join(
                bytes((_CHAR_TO_BYTE[c],)) if c in _CHAR_TO_BYTE else c.encode() for c in text
            )
        elif kind == TOKEN_UNUSED:
            raw = b""
        else:
            raw = text.encode("utf-8")
        self._bytes_cache[token_id] = raw
        return raw

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        """Text of the ids (invalid UTF-8 from odd token sequences becomes U+FFFD)."""
        special = self.special_ids if skip_special else frozenset()
        data = b"".join(self.token_bytes(i) for i in ids if i not in special)
        return data.decode("utf-8", errors="replace")

    def detokenize(self, ids: Iterable[int]) -> str:
        """`decode`, control tokens included as their text (POST /detokenize, `tokenize
        --decode`); the llama.cpp vocabulary's `detokenize` gives the same."""
        return self.decode(ids)

    def _check_id(self, token_id: int) -> int:
        if not 0 <= token_id < len(self._tokens):
            last = len(self._tokens) - 1
            raise IndexError(f"token id {token_id} outside the vocabulary (0..{last})")
        return token_id

    # -- chat -----------------------------------------------------------------------------

    @property
    def chat_template(self) -> ChatTemplate | None:
        """The recognised ChatML template, or None (see `chat_note`)."""
        return self._chat if isinstance(self._chat, ChatTemplate) else None

    @property
    def chat_note(self) -> str:
        """Why there is no chat template or no default system prompt ("" when all is well)."""
        return self._chat.note if isinstance(self._chat, ChatTemplate) else self._chat

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True
    ) -> list[int]:
        """ChatML prompt ids: markers as special ids, roles and contents as plain text."""
        template = require_chatml(self._chat)
        return template.encode(messages, self.encode, add_generation_prompt=add_generation_prompt)

    # -- serialization --------------------------------------------------------------------

    def turn_end_ids(self) -> list[int]:
        """What the template writes after an assistant's reply (`<|im_end|>` + newline);
        [] without a template."""
        template = self.chat_template
        if template is None:
            return []
        return [template.im_end_id, *self.encode("\n")]

    def _payload(self) -> tuple[dict[str, Any], bytes]:
        """Layout facts (for the header) and the bytes of tokens, types and merge pairs."""
        lefts, rights = (list(side) for side in zip(*self._pairs, strict=True))
        texts = ["".join(self._tokens), "".join(lefts), "".join(rights)]
        sep = next(c for c in map(chr, (0, 1, *range(0xE000, 0xF900)))
                   if all(c not in t for t in texts))
        types = np.asarray(self._types, dtype="<i4").tobytes()
        strings = sep.join([sep.join(self._tokens), sep.join(lefts), sep.join(rights)])
        layout = {"n_tokens": len(self._tokens), "n_merges": len(self._pairs), "sep": ord(sep)}
        return layout, types + strings.encode("utf-8")

    def _header_fields(self) -> dict[str, Any]:
        return {k: v for k, v in sorted(self._fields.items()) if k != "source"}

    @cached_property
    def fingerprint(self) -> str:
        """sha256 (hex) over everything that changes encode/decode/chat output."""
        # The separator is a function of the content, so the payload is canonical.
        layout, payload = self._payload()
        head = json.dumps([self._header_fields(), layout], sort_keys=True).encode("utf-8")
        return hashlib.sha256(head + payload).hexdigest()

    def to_bytes(self) -> bytes:
        """A self-checking serialized form (for the journal's tokenizer cache)."""
        layout, payload = self._payload()
        header = dict(self._header_fields(), source=self.source, fingerprint=self.fingerprint,
                      **layout)
        head = json.dumps(header, sort_keys=True).encode("utf-8")
        body = struct.pack("<I", len(head)) + head + payload
        return _CACHE_MAGIC + hashlib.sha256(body).digest() + body

    @classmethod
    def from_bytes(cls, data: bytes) -> Tokenizer:
        """Rebuild from `to_bytes()`; TokenizerCacheError if the bytes are not that."""
        def bad(what: str) -> TokenizerCacheError:
            return TokenizerCacheError(
                f"tokenizer cache ({len(data)} bytes): {what}. Hint: drop the cached entry; it "
                "is rebuilt from the model's metadata."
            )

        view = memoryview(data)
        if bytes(view[:8]) != _CACHE_MAGIC:
            raise bad(f"magic {bytes(view[:8])!r}, expected {_CACHE_MAGIC!r}")
        if hashlib.sha256(view[40:]).digest() != bytes(view[8:40]):
            raise bad("checksum mismatch (truncated or corrupt)")
        try:
            (n_head,) = struct.unpack_from("<I", view, 40)
            header = json.loads(bytes(view[44 : 44 + n_head]))
            n_tok, n_merge = header.pop("n_tokens"), header.pop("n_merges")
            types = np.frombuffer(view, dtype="<i4", count=n_tok, offset=44 + n_head).tolist()
            strings = bytes(view[44 + n_head + 4 * n_tok :]).decode("utf-8")
            parts = strings.split(chr(header.pop("sep")))
            fingerprint = header.pop("fingerprint")
        except (struct.error, ValueError, KeyError, TypeError) as exc:
            raise bad(f"unreadable ({exc})") from exc
        if len(parts) != n_tok + 2 * n_merge:
            raise bad(f"{len(parts)} strings for {n_tok} tokens and {n_merge} merges")
        lefts, rights = parts[n_tok : n_tok + n_merge], parts[n_tok + n_merge :]
        tokenizer = cls(header, parts[:n_tok], types, list(zip(lefts, rights, strict=True)))
        tokenizer.__dict__["fingerprint"] = fingerprint  # covered by the checksum
        return tokenizer
