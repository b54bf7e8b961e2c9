"""POST /v1/embeddings in the control plane: admission, tokenization, the model's runner.

Invariants owned here:
- Refusals are domain errors (edge_agent/errors.py), mapped to HTTP by the edge as
  `Daemon.submit`'s are. Admission as for generation: refused while the daemon stops
  (ShuttingDown, 503) and from memory-pressure stage 2 on (AdmissionRefused, 503 +
  Retry-After); an unknown model is ModelNotFound (404). Nothing is journaled (an embedding is
  recomputed, not resumed), so a journal that cannot be written refuses none.
- Every input is tokenized here with the model's own vocabulary, as llama-server tokenizes an
  embedding input: the vocabulary's BOS/EOS rule, special-token text not parsed (as for
  completions). Token-id inputs are checked against the vocabulary. An input longer than the
  model's context is a ContextExceeded (400) naming its index and both lengths; nothing
  reaches the runner then.
- A model that computes no embeddings (numpy engine, no pooling type and no
  `models.NAME.pooling`) is a ModelNotEmbedding (400) naming the model and what to do, before
  any load.
- The vectors come from `ModelService.embed` (loads the model on demand; its messages run
  between the decode steps of running generations).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from edge_agent.daemon.service import EmbeddingError, ModelService
from edge_agent.errors import (
    ContextExceeded,
    EmbeddingFailed,
    InvalidRequest,
    ModelNotEmbedding,
    ModelNotFound,
    ShuttingDown,
)
from edge_agent.protocol.embeddings import EmbeddingsRequest, embeddings_response

__all__ = ["create_embeddings", "tokenize_inputs"]


def tokenize_inputs(req: EmbeddingsRequest, tok: Any, *, model: str, context: int
                    ) -> list[list[int]]:
    """The token ids of each input (texts tokenized, ids checked); InvalidRequest naming the
    input for an id outside the vocabulary or no tokens, ContextExceeded for more than
    `context` tokens."""
    size = int(tok.vocab_size)
    out: list[list[int]] = []
    for i, item in enumerate(req.inputs):
        where = req.field(i)
        if isinstance(item, str):
            ids = [int(t) for t in tok.tokenize(item, add_bos=True, parse_special=False)]
        else:
            ids = list(item)
            for j, t in enumerate(ids):
                if t >= size:
                    raise InvalidRequest(f"field '{where}[{j}]': token id {t} is outside the "
                                         f"vocabulary 0..{size - 1} of model {model!r}. Hint: "
                                         "send ids this model's POST /tokenize returned.")
        if not ids:
            raise InvalidRequest(f"field {where!r}: encodes to no tokens. Hint: send some "
                                 "text.")
        if len(ids) > context and req.truncate:
            ids = ids[:context]
        if len(ids) > context:
            raise ContextExceeded(f"field {where!r}: input {i} is {len(ids)} tokens, more "
                                  f"than the context of {context} tokens of model {model!r}. "
                                  f"Hint: split it into shorter pieces, or raise "
                                  f"models.{model}.context.")
        out.append(ids)
    return out


async def create_embeddings(req: EmbeddingsRequest, *, stopping: bool,
                            check_admission: Callable[[], None],
                            services: Mapping[str, ModelService], default_model: str,
                            tokenizer: Callable[[ModelService], Any]) -> dict[str, Any]:
    """Admit, tokenize and embed `req`; OpenAI's reply body. A domain error (ServiceError) for
    what is refused.
    `check_admission` raises while memory pressure refuses work; `tokenizer` opens a model's
    vocabulary (a bad GGUF marks the model FAILED and raises)."""
    if stopping:
        raise ShuttingDown.new_request()
    check_admission()  # 503 + Retry-After from pressure stage 2 on
    name = req.model or default_model
    svc = services.get(name)
    if svc is None:
        raise ModelNotFound.in_request(name, services)
    tok = tokenizer(svc)  # a bad GGUF marks the model FAILED: 503 naming it
    refusal = svc.embedding_refusal()
    if refusal is not None:
        raise ModelNotEmbedding(f"field 'model': {refusal}", name=name)
    dim = svc.embedding_length
    if req.dimensions is not None and req.dimensions != dim:
        raise InvalidRequest(f"field 'dimensions': {req.dimensions}, but model {name!r} gives "
                             f"vectors of {dim}. Hint: leave dimensions out or send {dim}; "
                             "vectors are not shortened.")
    lists = tokenize_inputs(req, tok, model=name, context=svc.context)
    try:
        vectors = await svc.embed(lists)
    except EmbeddingError as exc:
        if exc.refused:
            raise ModelNotEmbedding(f"field 'model': {exc}", name=name) from exc
        raise EmbeddingFailed(str(exc), name=name) from exc
    return embeddings_response(model=name, vectors=vectors, encoding_format=req.encoding_format,
                               prompt_tokens=sum(len(ids) for ids in lists))
