"""POST /v1/embeddings: request validation and OpenAI's response shape (pure, as api.py).

Invariants owned here:
- `input` takes OpenAI's four shapes: a string, a list of strings, a list of token ids, a list
  of token-id lists; at most MAX_EMBED_INPUTS inputs, none empty. Anything else is a 400 naming
  the element (`input[2]`, `input[1][0]`). Token ids are checked against the vocabulary by the
  caller, which knows the model.
- Fields: `model`, `input`, `encoding_format` ("float" or "base64"), `dimensions` (checked by
  the caller against the model's vector length: no truncation is done), `user` (accepted,
  ignored). Any other field is 400 `unknown_parameter`; `null` is as if absent.
- base64 is the vector's float32 little-endian bytes, as OpenAI and llama-server send it.
"""

from __future__ import annotations

import base64
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from edge_agent.protocol.api import _bad, _known_only, _model_field, _show, parse_json_body

__all__ = ["EMBEDDINGS_FIELDS", "MAX_EMBED_INPUTS", "EmbeddingsRequest", "embeddings_response",
           "parse_embeddings"]

EMBEDDINGS_FIELDS = ("input", "model", "encoding_format", "dimensions", "user")
MAX_EMBED_INPUTS = 2048  # OpenAI's limit on one request's inputs
_HINT = ('send "input": "text", ["text", ...], [token ids] or [[token ids], ...] '
         "(docs/api.md#embeddings)")


@dataclass(frozen=True)
class EmbeddingsRequest:
    inputs: tuple[str | tuple[int, ...], ...]  # texts to tokenize, or token ids as given
    single: bool  # `input` was one string or one list of ids: errors name `input`, not input[0]
    model: str | None
    encoding_format: str  # "float" or "base64"
    dimensions: int | None
    truncate: bool = False  # an input longer than the context is cut to it (Ollama's default)

    def field(self, index: int) -> str:
        """The request field of input `index`, for messages."""
        return "input" if self.single else f"input[{index}]"


def _is_id(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _ids(values: list[Any], where: str) -> tuple[int, ...]:
    if not values:
        raise _bad(where, "an empty list of token ids", "send at least one token id")
    for j, t in enumerate(values):
        if not _is_id(t) or t < 0:
            raise _bad(f"{where}[{j}]", f"expected a non-negative token id, got {_show(t)}",
                       "send token ids as integers (POST /tokenize returns them)")
    return tuple(values)


def _inputs(value: Any) -> tuple[tuple[str | tuple[int, ...], ...], bool]:
    if value is None:
        raise _bad("input", "missing", _HINT)
    if isinstance(value, str):
        if not value:
            raise _bad("input", "an empty string", "send some text to embed")
        return (value,), True
    if not isinstance(value, list):
        raise _bad("input", f"expected a string or a list, got {_show(value)}", _HINT)
    if not value:
        raise _bad("input", "an empty list", "send at least one input")
    if len(value) > MAX_EMBED_INPUTS:
        raise _bad("input", f"{len(value)} inputs, more than {MAX_EMBED_INPUTS}",
                   "split them over several requests")
    if all(_is_id(v) for v in value):
        return (_ids(value, "input"),), True
    if _is_id(value[0]):  # one input of token ids, with something else in it
        j = next(j for j, v in enumerate(value) if not _is_id(v))
        raise _bad(f"input[{j}]", f"expected a token id like input[0], got {_show(value[j])}",
                   "send one list of token ids, a list of strings, or a list of token-id lists")
    out: list[str | tuple[int, ...]] = []
    kind = "a string" if isinstance(value[0], str) else "a list of token ids"
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if isinstance(item, str) and isinstance(value[0], str):
            if not item:
                raise _bad(where, "an empty string", "send some text, or leave the input out")
            out.append(item)
        elif isinstance(item, list) and isinstance(value[0], list):
            out.append(_ids(item, where))
        else:
            raise _bad(where, f"expected {kind} like input[0], got {_show(item)}",
                       "send a list of strings or a list of token-id lists, not a mix")
    return tuple(out), False


def parse_embeddings(body: bytes) -> EmbeddingsRequest:
    """POST /v1/embeddings: {"input", "model"?, "encoding_format"?, "dimensions"?, "user"?}."""
    d = {k: v for k, v in parse_json_body(body).items() if v is not None}
    _known_only(d, EMBEDDINGS_FIELDS, "/v1/embeddings")
    inputs, single = _inputs(d.get("input"))
    fmt = d.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise _bad("encoding_format", f"expected \"float\" or \"base64\", got {_show(fmt)}",
                   'use "float" (lists of numbers) or "base64" (float32 little-endian bytes)')
    dims = d.get("dimensions")
    if dims is not None and (not _is_id(dims) or dims < 1):
        raise _bad("dimensions", f"expected a positive integer, got {_show(dims)}",
                   "leave it out, or send the model's vector length")
    user = d.get("user")
    if user is not None and not isinstance(user, str):
        raise _bad("user", f"expected a string, got {_show(user)}", "send a string or leave it "
                   "out (it is accepted and ignored)")
    return EmbeddingsRequest(inputs=inputs, single=single, model=_model_field(d),
                             encoding_format=fmt, dimensions=dims)


def _encode(vector: Sequence[float], fmt: str) -> list[float] | str:
    if fmt == "float":
        return list(vector)
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def embeddings_response(*, model: str, vectors: Sequence[Sequence[float]], encoding_format: str,
                        prompt_tokens: int) -> dict[str, Any]:
    """OpenAI's (and llama-server's) reply: a list of embedding objects in input order."""
    return {
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": _encode(v, encoding_format)}
                 for i, v in enumerate(vectors)],
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }
