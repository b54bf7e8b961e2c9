"""POST /v1/embeddings in the control plane: admission, tokenization, the model's runner.

Invariants owned here:
- Admission as for generation (`Daemon.submit`): refused while the daemon stops (503) and from
  memory-pressure stage 2 on (503 + Retry-After); an unknown model is 404. Nothing is journaled
  (an embedding is recomputed, not resumed), so a journal that cannot be written refuses none.
- Every input is tokenized here with the model's own vocabulary, as llama-server tokenizes an
  embedding input: the vocabulary's BOS/EOS rule, special-token text not parsed (as for
  completions). Token-id inputs are checked against the vocabulary. An input longer than the
  model's context is a 400 naming its index and both lengths; nothing reaches the runner then.
- A model that computes no embeddings (numpy engine, no pooling type and no
  `models.NAME.pooling`) is a 400 naming the model and what to do, before any load.
- The vectors come from `ModelService.embed` (loads the model on demand; its messages run
  between the decode steps of running generations).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from edge_agent.daemon.service import EmbeddingError, ModelService
from edge_agent.protocol.api import ApiError
from edge_agent.protocol.embeddings import EmbeddingsRequest, embeddings_response

__all__ = ["create_embeddings", "tokenize_inputs"]


def tokenize_inputs(req: EmbeddingsRequest, tok: Any, *, model: str, context: int
                    ) -> list[list[int]]:
    """The token ids of each input (texts tokenized, ids checked); ApiError 400 naming the
    input for an id outside the vocabulary, no tokens, or more than `context` tokens."""
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
                    raise ApiError(400, "invalid_request", f"field '{where}[{j}]': token id {t} "
                                   f"is outside the vocabulary 0..{size - 1} of model "
                                   f"{model!r}. Hint: send ids this model's POST /tokenize "
                                   "returned.")
        if not ids:
            raise ApiError(400, "invalid_request", f"field {where!r}: encodes to no tokens. "
                           "Hint: send some text.")
        if len(ids) > context and req.truncate:
            ids = ids[:context]
        if len(ids) > context:
            raise ApiError(400, "context_exceeded", f"field {where!r}: input {i} is "
                           f"{len(ids)} tokens, more than the context of {context} tokens of "
                           f"model {model!r}. Hint: split it into shorter pieces, or raise "
                           f"models.{model}.context.")
        out.append(ids)
    return out


async def create_embeddings(req: EmbeddingsRequest, *, stopping: bool,
                            check_admission: Callable[[], None],
                            services: Mapping[str, ModelService], default_model: str,
                            tokenizer: Callable[[ModelService], Any]) -> dict[str, Any]:
    """Admit, tokenize and embed `req`; OpenAI's reply body. ApiError for what is refused.
    `check_admission` raises while memory pressure refuses work; `tokenizer` opens a model's
    vocabulary (a bad GGUF marks the model FAILED and raises)."""
    if stopping:
        raise ApiError(503, "shutting_down", "the daemon is shutting down. "
                       "Hint: retry when it is back (systemd restarts it).",
                       headers=[("retry-after", "5")])
    check_admission()  # 503 + Retry-After from pressure stage 2 on
    name = req.model or default_model
    svc = services.get(name)
    if svc is None:
        raise ApiError(404, "model_not_found", f"field 'model': no model named {name!r} "
                       f"(registered: {', '.join(sorted(services))}). "
                       "Hint: GET /v1/models lists them; add a [models.NAME] table.")
    tok = tokenizer(svc)  # a bad GGUF marks the model FAILED: 503 naming it
    refusal = svc.embedding_refusal()
    if refusal is not None:
        raise ApiError(400, "model_not_embedding", f"field 'model': {refusal}")
    dim = svc.embedding_length
    if req.dimensions is not None and req.dimensions != dim:
        raise ApiError(400, "invalid_request", f"field 'dimensions': {req.dimensions}, but "
                       f"model {name!r} gives vectors of {dim}. Hint: leave dimensions out or "
                       f"send {dim}; vectors are not shortened.")
    lists = tokenize_inputs(req, tok, model=name, context=svc.context)
    try:
        vectors = await svc.embed(lists)
    except EmbeddingError as exc:
        if exc.refused:
            raise ApiError(400, "model_not_embedding", f"field 'model': {exc}") from exc
        raise ApiError(503, "embedding_failed", str(exc)) from exc
    return embeddings_response(model=name, vectors=vectors, encoding_format=req.encoding_format,
                               prompt_tokens=sum(len(ids) for ids in lists))
