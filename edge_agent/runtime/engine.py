"""Engine: prepared + pinned weights, tokenizer, llama forward and KV pool behind a step API.

The daemon's runner process drives it with `add` (prefill, first token), `step` (one batched
decode step over any subset of active sequences) and `release`; `generate` / `stream_text` are
the one-request conveniences used by `edge-agent generate`.

Invariants this module owns:
- The KV pool is allocated once, in the constructor, for max_batch × context tokens; at most
  max_batch sequences are active; a sequence never grows past `context` tokens.
- `step` is all-or-nothing: every argument is checked and every KV block the step needs is
  available before the forward runs; on an error no sequence has advanced.
- The token sampled for generation index i of a sequence uses `sample(..., position=i)`, so the
  same (prompt, params) give the same tokens whatever the batch they were decoded in, and a
  sequence resumed with `add(..., generated=g)` (prompt + g prefilled) continues at index len(g).
- BLAS threads are limited to `threads` around every forward (threadpoolctl), restoring the
  process setting afterwards; the runner chooses, the machine's default does not.
- `release` returns every block of the sequence; `close` releases everything and unmaps.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edge_agent.errors import EdgeAgentError
from edge_agent.runtime.constrain import Constraints
from edge_agent.runtime.kvcache import BlockTable, KVCacheExhaustedError, blocks_for
from edge_agent.runtime.model import Llama, ModelConfig
from edge_agent.runtime.prefill_groups import NewSeq, prefill_groups
from edge_agent.runtime.sampling import (
    SamplingParams,
    TokenLogprobs,
    sample_rows_with_logprobs,
    sample_with_logprobs,
)

if TYPE_CHECKING:
    from edge_agent.runtime.tokenizer import Tokenizer
    from edge_agent.runtime.weights import PinnedWeights

__all__ = ["Engine", "EngineError", "NewSeq", "DEFAULT_THREADS", "blas_info", "generate",
           "greedy_ids", "stream_text"]

# One BLAS thread: on a shared 2-core board, 2 threads collapsed 3-4x under contention
# (docs/benchmarks.md); batching, not threads, is where the throughput comes from.
DEFAULT_THREADS = 1


class EngineError(EdgeAgentError):
    """A request the engine cannot take (unknown/duplicate sequence, batch full, bad ids)."""


def _controller() -> Any:
    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:  # optional: without it the process default thread count applies
        return None
    return ThreadpoolController()


def blas_info() -> list[dict[str, Any]]:
    """threadpoolctl's view of the BLAS libraries (kernel `architecture`, `num_threads`)."""
    ctl = _controller()
    return [] if ctl is None else [i for i in ctl.info() if i.get("user_api") == "blas"]


@dataclass
class _Seq:
    table: BlockTable
    params: SamplingParams
    last: int  # last sampled token, fed by the next step
    generated: int  # tokens sampled so far (the next one is generation index `generated`)
    history: list[int] | None = None  # prompt + sampled tokens, kept only for penalties


class Engine:
    """A loaded model ready to serve up to `max_batch` sequences of up to `context` tokens."""

    name = "numpy"

    def __init__(
        self,
        model: Llama,
        *,
        tokenizer: Tokenizer | None = None,
        max_batch: int = 8,
        context: int = 2048,
        threads: int = DEFAULT_THREADS,
        weights: PinnedWeights | None = None,
    ) -> None:
        if max_batch < 1 or context < 2 or threads < 1:
            raise EngineError(
                f"engine: max_batch {max_batch}, context {context}, threads {threads} must be "
                ">= 1, >= 2 and >= 1. Hint: fix the model's settings in the config."
            )
        self.model = model
        self.config: ModelConfig = model.config
        self.tokenizer = tokenizer
        self.weights = weights
        self.max_batch = max_batch
        self.context = min(context, model.config.context_length)
        self.threads = threads
        self.pool = model.new_pool(max_batch * blocks_for(self.context))
        self._seqs: dict[str, _Seq] = {}
        self._ctl = _controller()
        self._ids = itertools.count()
        # the log-probabilities of the last add_many / step, by sequence (those that asked)
        self.last_logprobs: dict[str, TokenLogprobs] = {}
        # End-of-generation ids (eos, eot, ...): a completion stops before them.
        eos = None if tokenizer is None else tokenizer.eos_id
        eog = getattr(tokenizer, "eog_ids", None) or ({eos} if eos is not None else set())
        self.stop_ids: frozenset[int] = frozenset(int(i) for i in eog)
        self.constraints = Constraints(tokenizer, self.config.vocab_size)  # grammars by sequence

    # -- construction ---------------------------------------------------------------------

    @classmethod
    def load(
        cls,
        model_path: str | os.PathLike[str] | None = None,
        *,
        state_dir: str | os.PathLike[str],
        dtype: str = "f32",
        mlock: str = "best-effort",
        max_batch: int = 8,
        context: int = 2048,
        threads: int = DEFAULT_THREADS,
        progress: Callable[[int, int], None] | None = None,
    ) -> Engine:
        """Prepare (once) and pin the weights of `model_path` (default model if None), build
        the tokenizer from the pinned metadata and the forward over the pinned views."""
        from edge_agent.paths import default_model_path
        from edge_agent.runtime.prepare import prepare_model
        from edge_agent.runtime.tokenizer import Tokenizer
        from edge_agent.runtime.weights import PinnedWeights

        src = Path(model_path) if model_path is not None else default_model_path()
        prepared = prepare_model(src, Path(state_dir), dtype=dtype, progress=progress)
        weights = PinnedWeights.open(prepared, mlock=mlock)
        try:
            where = str(prepared)
            config = ModelConfig.from_metadata(weights.metadata, source=where)
            tokenizer = Tokenizer.from_metadata(weights.metadata, source=where)
            model = Llama(config, weights.tensors, source=where)
            return cls(model, tokenizer=tokenizer, max_batch=max_batch, context=context,
                       threads=threads, weights=weights)
        except BaseException:
            weights.close()
            raise

    def close(self) -> None:
        for seq_id in list(self._seqs):
            self.release(seq_id)
        if self.weights is not None:
            del self.model  # drop the views before unmapping (PinnedWeights.close)
            self.weights.close()
            self.weights = None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- state ----------------------------------------------------------------------------

    def lock_report(self) -> dict[str, Any] | None:
        """How the prepared weights are pinned (policy, locked, VmLck, error)."""
        return None if self.weights is None else dict(self.weights.lock.as_dict())

    def warmup_ids(self) -> list[int]:
        """A one-token prompt for the warm-up forward."""
        bos = None if self.tokenizer is None else self.tokenizer.bos_id
        return [1 if bos is None else bos]

    def batch_invariance(self, prompt_ids: Sequence[int], *, cache: Path | None = None
                         ) -> bool:
        """True: this engine computes each sequence's rows with the same BLAS calls whatever
        shares the step (per-sequence attention, row-independent matrix products; proven by
        tests/test_engine.py's batch tests against the same requests alone); nothing is
        measured, so `cache` is not used."""
        return True

    def embed(self, token_lists: Sequence[Sequence[int]]) -> Any:
        """Sentence embeddings are the llamacpp engine's (`LlamaCppEngine.embed`)."""
        raise EngineError("engine numpy computes no embeddings. Hint: use the llamacpp engine "
                          "(runtime.engine = \"llamacpp\").")

    def describe(self) -> dict[str, Any]:
        c = self.config
        info = None if self.weights is None else self.weights.info  # the prepared file
        return {"engine": self.name, "prepared": None if info is None else str(info.path),
                "source_sha256": None if info is None else info.source_sha256,
                "architecture": "llama",
                "context": self.context, "max_batch": self.max_batch, "threads": self.threads,
                "layers": c.n_layers, "vocab_size": c.vocab_size, "prompt_cache": None}


    @property
    def free_blocks(self) -> int:
        return self.pool.free_blocks

    @property
    def active(self) -> list[str]:
        return list(self._seqs)

    def length(self, seq_id: str) -> int:
        """Tokens of `seq_id` in the KV cache (prompt + fed tokens)."""
        return self._get(seq_id).table.length

    def _get(self, seq_id: str) -> _Seq:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise EngineError(
                f"engine: no active sequence {seq_id!r} ({len(self._seqs)} active). "
                "Hint: add() it first; it may have been released."
            ) from None

    def _limits(self) -> contextlib.AbstractContextManager[Any]:
        if self._ctl is None:
            return contextlib.nullcontext()
        # threadpoolctl is untyped; limit() returns its threadpool_limits context manager
        limits: contextlib.AbstractContextManager[Any] = self._ctl.limit(
            limits=self.threads, user_api="blas")
        return limits

    # -- step API -------------------------------------------------------------------------

    def add(self, seq_id: str, prompt_ids: Sequence[int], params: SamplingParams, *,
            generated: Sequence[int] = ()) -> int:
        """Prefill `prompt_ids` as a new sequence; return its first sampled token.

        With `generated` (the tokens a previous attempt already produced, e.g. read back from
        the journal after a restart), prompt + generated are prefilled and the token returned
        is generation index len(generated), sampled with the same (seed, position) randomness
        an uninterrupted run uses there: the sequence continues where it stopped."""
        tokens, errors = self.add_many([NewSeq(seq_id, prompt_ids, params, generated)])
        if errors:
            raise errors[seq_id]
        return tokens[seq_id]

    def add_many(
        self, new: Sequence[NewSeq]
    ) -> tuple[dict[str, int], dict[str, EdgeAgentError]]:
        """`add` for several sequences at once: (first token by id, error by id).

        A sequence that cannot be added (bad ids, too long, batch full, no KV blocks) gets its
        error and the others go on. Prompts of similar length are prefilled together, one
        forward for the group (`Llama.prefill_many`): the weights are read once for all of
        them, which is most of a short prompt's cost."""
        tokens: dict[str, int] = {}
        errors: dict[str, EdgeAgentError] = {}
        self.last_logprobs = {}
        seq_ids = [seq.seq_id for seq in new]
        if len(set(seq_ids)) != len(seq_ids):
            raise EngineError(f"engine: add_many() got a sequence id twice in {seq_ids!r}. "
                              "Hint: use a new id for each sequence.")
        ready: list[tuple[NewSeq, list[int]]] = []
        for seq in new:
            try:
                ready.append((seq, self._check_new(seq, len(ready))))
            except EngineError as exc:
                errors[seq.seq_id] = exc
        for group in prefill_groups(ready):
            width = max(len(prompt) for _, prompt in group)
            if len(group) > 1 and blocks_for(width) * len(group) > self.pool.free_blocks:
                group_parts = [[one] for one in group]  # padding does not fit: one by one
            else:
                group_parts = [group]
            for part in group_parts:
                try:
                    self._prefill(part, tokens)
                except KVCacheExhaustedError as exc:
                    for seq, _ in part:
                        errors[seq.seq_id] = exc
        return tokens, errors

    def _check_new(self, seq: NewSeq, pending: int) -> list[int]:
        seq_id = seq.seq_id
        if seq_id in self._seqs:
            raise EngineError(f"engine: sequence {seq_id!r} is already active. Hint: release() "
                              "it first or use a new id.")
        if len(self._seqs) + pending >= self.max_batch:
            raise EngineError(
                f"engine: {len(self._seqs) + pending} sequences active, max_batch is "
                f"{self.max_batch}; cannot add {seq_id!r}. Hint: wait for one to finish or "
                "raise max_batch."
            )
        ids = [int(i) for i in seq.prompt_ids]
        if not ids:
            raise EngineError(f"engine: sequence {seq_id!r} has an empty prompt. Hint: pass at "
                              "least one token id.")
        done = len(seq.generated)
        ids += [int(i) for i in seq.generated]
        bad = [i for i in ids if not 0 <= i < self.config.vocab_size]
        if bad:
            raise EngineError(
                f"engine: prompt of {seq_id!r} holds token id {bad[0]} outside the vocabulary "
                f"0..{self.config.vocab_size - 1}. Hint: encode text with this model's tokenizer."
            )
        bad = [i for i, _ in seq.params.logit_bias if i >= self.config.vocab_size]
        if bad:
            raise EngineError(
                f"engine: logit_bias of {seq_id!r} names token id {bad[0]} outside the "
                f"vocabulary 0..{self.config.vocab_size - 1}. Hint: use ids this model's "
                "tokenizer gives."
            )
        if len(ids) >= self.context:
            raise EngineError(
                f"engine: prompt of {seq_id!r} has {len(ids)} tokens"
                + (f" ({done} of them already generated)" if done else "")
                + f"; the context is {self.context} and at least one must remain to "
                "generate. Hint: shorten the prompt or load the model with a larger context."
            )
        return ids

    def _prefill(self, part: list[tuple[NewSeq, list[int]]], tokens: dict[str, int]) -> None:
        tables = [BlockTable() for _ in part]
        try:
            with self._limits():
                rows = self.model.prefill_many([ids for _, ids in part], tables,
                                               self.pool)  # (B, V)
        except BaseException:
            for table in tables:
                self.pool.release(table)
            raise
        self.constraints.mask([seq.seq_id for seq, _ in part], rows)
        for (seq, ids), table, logits in zip(part, tables, rows, strict=True):
            done = len(seq.generated)
            token, lp = sample_with_logprobs(logits, seq.params, done, ids)
            self.constraints.advance([seq.seq_id], [token])
            history = [*ids, token] if seq.params.penalized else None
            self._seqs[seq.seq_id] = _Seq(table=table, params=seq.params, last=token,
                                          generated=done + 1, history=history)
            tokens[seq.seq_id] = token
            if lp is not None:
                self.last_logprobs[seq.seq_id] = lp

    def step(self, seq_ids: Sequence[str]) -> dict[str, int]:
        """One batched decode step: feed each sequence's last token, sample the next."""
        if not seq_ids:
            return {}
        if len(set(seq_ids)) != len(seq_ids):
            raise EngineError(f"engine: step() got a sequence twice in {list(seq_ids)!r}. "
                              "Hint: pass each active sequence at most once.")
        seqs = [self._get(s) for s in seq_ids]
        full = [s for s, q in zip(seq_ids, seqs, strict=True) if q.table.length + 1 > self.context]
        if full:
            raise EngineError(
                f"engine: sequence {full[0]!r} has reached the context of {self.context} "
                "tokens. Hint: release it (finish the request) or load a larger context."
            )
        need = sum(
            max(0, blocks_for(q.table.length + 1, self.pool.block_size) - len(q.table.blocks))
            for q in seqs
        )
        if need > self.pool.free_blocks:
            raise KVCacheExhaustedError(
                f"KV cache: a step of {len(seqs)} sequences needs {need} new block(s) of "
                f"{self.pool.block_size} tokens, {self.pool.free_blocks} of "
                f"{self.pool.n_blocks} are free. Hint: release finished sequences or lower the "
                "batch size."
            )
        self.last_logprobs = {}
        with self._limits():
            logits = self.model.decode([q.last for q in seqs], [q.table for q in seqs],
                                       self.pool)  # (B, V)
        self.constraints.mask(seq_ids, logits)
        tokens, lps = sample_rows_with_logprobs(
            logits, [q.params for q in seqs], [q.generated for q in seqs],
            [q.history or () for q in seqs])
        self.constraints.advance(seq_ids, tokens)
        out: dict[str, int] = {}
        for seq_id, q, token, lp in zip(seq_ids, seqs, tokens, lps, strict=True):
            q.last = token
            q.generated += 1
            if q.history is not None:
                q.history.append(token)
            out[seq_id] = token
            if lp is not None:
                self.last_logprobs[seq_id] = lp
        return out

    def release(self, seq_id: str) -> None:
        """Forget `seq_id` and return its KV blocks (unknown ids are ignored)."""
        self.constraints.release(seq_id)
        q = self._seqs.pop(seq_id, None)
        if q is not None:
            self.pool.release(q.table)

    # -- prompt-cache snapshots: this engine keeps no cells across sequences ------------------
    def snapshot(self, tokens: Sequence[int]) -> bytes | None:
        """None: nothing to snapshot (the numpy engine has no prompt cache)."""
        return None

    def restore(self, tokens: Sequence[int], blob: bytes) -> bool:
        """False: a snapshot is never loaded here."""
        return False

    def identity(self) -> str:
        return ""

    def snapshot_tokens(self, blob: bytes) -> int:
        return 0

    def cached_tokens(self, seq_id: str) -> int:
        """0: this engine has no prompt cache (every add prefills its whole prompt)."""
        self._get(seq_id)
        return 0

    # -- one-request conveniences ---------------------------------------------------------

    def generate(self, prompt_ids: Sequence[int],
                 params: SamplingParams) -> Generator[int, None, None]:
        """Token ids of one completion: stops after max_tokens, or before a stop token
        (eos) unless params.ignore_eos. Releases its blocks when exhausted or closed."""
        return generate(self, f"_generate-{next(self._ids)}", prompt_ids, params)

    def stream_text(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        on_token: Callable[[int], None] | None = None,
    ) -> Iterator[str]:
        """Text pieces of one completion (see `stream_text`)."""
        if self.tokenizer is None:
            raise EngineError("engine: stream_text needs a tokenizer. Hint: use Engine.load().")
        return stream_text(self.tokenizer, self.generate(prompt_ids, params), params.stop,
                           on_token=on_token)


def generate(engine: Any, seq_id: str, prompt_ids: Sequence[int],
             params: SamplingParams) -> Generator[int, None, None]:
    """One completion on either engine as sequence `seq_id`: stops after max_tokens, at the
    context, or before a stop token (eos) unless params.ignore_eos; released when exhausted or
    closed."""
    try:
        token = engine.add(seq_id, prompt_ids, params)
        for n in range(1, params.max_tokens + 1):
            if token in engine.stop_ids and not params.ignore_eos:
                return
            yield token
            if n == params.max_tokens or engine.length(seq_id) + 1 > engine.context:
                return
            token = engine.step([seq_id])[seq_id]
    finally:
        engine.release(seq_id)


def stream_text(tokenizer: Any, tokens: Generator[int, None, None], stop: tuple[str, ...], *,
                on_token: Callable[[int], None] | None = None) -> Iterator[str]:
    """Text pieces of a token stream, whole UTF-8 characters only, cut before the first of
    `stop` (text held back only as long as it could still start a stop string). `on_token(id)`
    sees every generated token id. Closing the pieces closes `tokens`."""
    from edge_agent.runtime.detokenizer import IncrementalDecoder
    from edge_agent.runtime.stops import StopText

    decoder = IncrementalDecoder(tokenizer)
    stops = StopText(stop)
    try:
        for token in tokens:
            if on_token is not None:
                on_token(token)
            out = stops.push(decoder.push(token))
            if out:
                yield out
            if stops.stopped:
                return
        out = stops.end(decoder.flush())
        if out:
            yield out
    finally:
        tokens.close()


def greedy_ids(engine: Engine, prompt_ids: Sequence[int], n: int) -> list[int]:
    """n greedy tokens, eos ignored (reference comparisons)."""
    params = SamplingParams(max_tokens=n, ignore_eos=True)
    return [int(t) for t in engine.generate(prompt_ids, params)]
