"""Choosing the next token: logit bias, repetition penalties, greedy, temperature, top-k, top-p,
min-p, with position-keyed randomness; the log-probabilities of the distribution sampled from.

Invariants this module owns:
- `sample` is a pure function of (logits, params, position): the random number for the token at
  generation index `position` of a request comes from a Philox generator keyed by
  (params.seed, position) alone, so a request resumed after a restart (or decoded in a different
  batch, or on another process) draws exactly the same numbers.
- `position` is the index of the token among the request's generated tokens (0 = the first token
  sampled after the prompt), not its position in the context window.
- temperature 0 is greedy (argmax, lowest id on ties) and draws no random number.
- Candidates are ordered by (logit descending, id ascending) before top-k / top-p, so ties break
  the same way everywhere.
- `sample_rows` gives, row by row, exactly what `sample` gives (greedy rows share one argmax
  call over the batch; the others go through `sample`).
- The chain, in this order: logit_bias (added), penalties (llama.cpp's
  `llama_sampler_penalties_apply`: a token seen c > 0 times among the last `repeat_last_n` tokens
  of `history`, prompt and generated tokens alike, has a positive logit divided by
  repeat_penalty, a negative one multiplied, then c * frequency_penalty + presence_penalty
  subtracted), then temperature, top-k, top-p, min-p and the draw. Greedy is the argmax after
  bias and penalties. With every new parameter neutral (`params.plain`) the logits are used as
  given: no copy, no history, the same numbers as before these parameters existed.
- Log-probabilities (`params.logprobs` not None) are the log-softmax of the logits after bias
  and penalties, at temperature 1 and before any cut (top-k, top-p, min-p): the model's
  distribution as shaped by the request, independent of how it was truncated for the draw.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from edge_agent.errors import EdgeAgentError, UsageError

__all__ = ["SamplingParams", "SamplingParamsError", "TokenLogprobs", "sample", "sample_rows",
           "sample_with_logprobs", "sample_rows_with_logprobs", "shape_logits", "rng_for",
           "MAX_SEED", "MAX_LOGPROBS", "MAX_LOGIT_BIAS"]

MAX_SEED = 2**64 - 1
MAX_LOGPROBS = 20  # most likely alternatives reported per token (OpenAI's top_logprobs limit)
MAX_LOGIT_BIAS = 100.0  # |bias| (OpenAI's range; -100 bans a token, +100 all but forces it)


class SamplingParamsError(UsageError):
    """A sampling parameter out of range."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k cut
    top_p: float = 1.0  # 1.0: no nucleus cut
    seed: int = 0
    max_tokens: int = 256
    stop: tuple[str, ...] = ()  # text stop sequences (applied on the decoded text)
    ignore_eos: bool = False
    min_p: float = 0.0  # 0: off; keep tokens with p >= min_p * (the most likely token's p)
    presence_penalty: float = 0.0  # 0: off; subtracted once from a token seen in the window
    frequency_penalty: float = 0.0  # 0: off; subtracted per occurrence in the window
    repeat_penalty: float = 1.0  # 1: off; a seen token's logit: positive / it, negative * it
    repeat_last_n: int = 64  # the penalty window: last N tokens (prompt too); -1 all, 0 off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    logprobs: int | None = None  # None: none; N: the chosen token's and the N most likely

    def __post_init__(self) -> None:
        problems = []
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            problems.append(f"temperature {self.temperature!r} must be a finite number >= 0")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            problems.append(f"top_k {self.top_k!r} must be an integer >= 0 (0 = off)")
        if not (math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0):
            problems.append(f"top_p {self.top_p!r} must be in (0, 1] (1 = off)")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not (
            0 <= self.seed <= MAX_SEED
        ):
            problems.append(f"seed {self.seed!r} must be an integer in 0..2**64-1")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or (
            self.max_tokens < 1
        ):
            problems.append(f"max_tokens {self.max_tokens!r} must be an integer >= 1")
        if not isinstance(self.stop, tuple) or not all(
            isinstance(s, str) and s for s in self.stop
        ):
            problems.append(f"stop {self.stop!r} must be a tuple of non-empty strings")
        if not (_is_num(self.min_p) and 0.0 <= self.min_p <= 1.0):
            problems.append(f"min_p {self.min_p!r} must be in [0, 1] (0 = off)")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (_is_num(v) and -2.0 <= v <= 2.0):
                problems.append(f"{name} {v!r} must be in [-2, 2] (0 = off)")
        if not (_is_num(self.repeat_penalty) and self.repeat_penalty > 0):
            problems.append(f"repeat_penalty {self.repeat_penalty!r} must be a number > 0 "
                            "(1 = off)")
        if isinstance(self.repeat_last_n, bool) or not isinstance(self.repeat_last_n, int) or (
                self.repeat_last_n < -1):
            problems.append(f"repeat_last_n {self.repeat_last_n!r} must be an integer >= -1 "
                            "(-1 = every token so far, 0 = penalties off)")
        if not isinstance(self.logit_bias, tuple) or not all(
            isinstance(b, tuple) and len(b) == 2 and isinstance(b[0], int)
            and not isinstance(b[0], bool) and b[0] >= 0 and _is_num(b[1])
            and abs(b[1]) <= MAX_LOGIT_BIAS for b in self.logit_bias
        ):
            problems.append(f"logit_bias {self.logit_bias!r} must be (token id >= 0, bias in "
                            f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]) pairs")
        if self.logprobs is not None and (
            isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
            or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            problems.append(f"logprobs {self.logprobs!r} must be None or an integer "
                            f"0..{MAX_LOGPROBS}")
        if problems:
            raise SamplingParamsError(
                f"sampling parameters: {'; '.join(problems)}. Hint: temperature 0 means "
                "greedy; pass e.g. --temperature 0.8 --top-k 40 --top-p 0.95 --seed 7."
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @cached_property
    def penalized(self) -> bool:
        """Whether a penalty applies: the engine must keep this sequence's token history."""
        return self.repeat_last_n != 0 and (
            self.repeat_penalty != 1.0 or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0)

    @cached_property
    def plain(self) -> bool:
        """No bias, penalty, min-p or logprobs: the sampler's original fast path."""
        return (not self.logit_bias and not self.penalized and self.min_p == 0.0
                and self.logprobs is None)


@dataclass(frozen=True)
class TokenLogprobs:
    """The chosen token's log-probability and the `n` most likely (id, logprob), most likely
    first (ties: lower id first)."""

    logprob: float
    top: tuple[tuple[int, float], ...]


def _is_num(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def rng_for(seed: int, position: int) -> np.random.Generator:
    """The generator for token `position` of a request with `seed` (Philox, 128-bit key)."""
    return np.random.Generator(np.random.Philox(key=np.array([seed, position], dtype=np.uint64)))


def _check_finite(logits: np.ndarray, value: float) -> None:
    if not math.isfinite(value):
        raise EdgeAgentError(
            f"sampling: the model produced non-finite logits (max {value}) over "
            f"{logits.shape[-1]} tokens. Hint: the weights are corrupt or the prepared file is "
            "damaged; run `edge-agent model prepare --force`."
        )


def shape_logits(logits: np.ndarray, params: SamplingParams,
                 history: Sequence[int] = ()) -> np.ndarray:
    """`logits` (V,) after logit_bias and the penalties over the window of `history`, as a new
    float64 array (the input is not changed)."""
    z = np.array(logits, dtype=np.float64)  # (V,) a copy
    if params.logit_bias:
        ids = np.fromiter((i for i, _ in params.logit_bias), np.int64)  # (K,)
        bias = np.fromiter((b for _, b in params.logit_bias), np.float64)  # (K,)
        np.add.at(z, ids, bias)
    if params.penalized and len(history):
        n = params.repeat_last_n
        window = history if n < 0 else history[-n:]
        seen, counts = np.unique(np.asarray(window, dtype=np.int64), return_counts=True)  # (U,)
        cur = z[seen]  # (U,)
        cur = np.where(cur <= 0, cur * params.repeat_penalty, cur / params.repeat_penalty)
        z[seen] = cur - (counts * params.frequency_penalty + params.presence_penalty)
    return z


def _logprobs(z: np.ndarray, token: int, n: int) -> TokenLogprobs:
    """Log-softmax of `z` (V,): the chosen token's value and the `n` largest."""
    top = float(z.max())
    lse = top + math.log(float(np.exp(z - top).sum()))
    best: tuple[tuple[int, float], ...] = ()
    if n:
        k = min(n, z.shape[0])
        part = np.argpartition(-z, k - 1)[:k]  # (k,) unordered
        order = part[np.lexsort((part, -z[part]))]  # (k,) by (logit desc, id asc)
        best = tuple((int(i), float(z[i] - lse)) for i in order)
    return TokenLogprobs(float(z[token] - lse), best)


def sample(logits: np.ndarray, params: SamplingParams, position: int,
           history: Sequence[int] = ()) -> int:
    """The token id chosen from 1-D `logits` for generation index `position`; `history` is the
    sequence's tokens so far (prompt + generated), read only when a penalty applies."""
    return sample_with_logprobs(logits, params, position, history)[0]


def sample_with_logprobs(logits: np.ndarray, params: SamplingParams, position: int,
                         history: Sequence[int] = ()) -> tuple[int, TokenLogprobs | None]:
    """`sample`, and the log-probabilities when `params.logprobs` asks for them."""
    if not params.plain:
        logits = shape_logits(logits, params, history)
    if params.greedy:
        best = int(np.argmax(logits))
        _check_finite(logits, float(logits[best]))
        token = best
    else:
        token = _draw(logits, params, position)
    if params.logprobs is None:
        return token, None
    return token, _logprobs(np.asarray(logits, dtype=np.float64), token, params.logprobs)


def _draw(logits: np.ndarray, params: SamplingParams, position: int) -> int:
    z = np.asarray(logits, dtype=np.float64) / params.temperature  # (V,)
    vocab = z.shape[0]
    if 0 < params.top_k < vocab:
        part = np.argpartition(-z, params.top_k - 1)[: params.top_k]  # (k,) unordered
        order = part[np.lexsort((part, -z[part]))]  # (k,) by (logit desc, id asc)
    elif params.top_p < 1.0:
        order = np.argsort(-z, kind="stable")  # (V,)
    else:
        order = np.arange(vocab)  # (V,) no cut: order does not matter
    cand = z[order]  # (C,)
    top = float(cand.max())
    _check_finite(logits, top)
    probs = np.exp(cand - top)  # (C,)
    probs /= probs.sum()
    if params.top_p < 1.0:
        cum = np.cumsum(probs)  # (C,) candidates are sorted, largest first
        keep = min(int(np.searchsorted(cum, params.top_p)) + 1, len(probs))
        probs = probs[:keep]
    if params.min_p > 0.0:  # the most likely token always stays (its p is the max)
        probs = np.where(probs >= params.min_p * probs.max(), probs, 0.0)  # (C',)
    cdf = np.cumsum(probs)  # (C',)
    u = rng_for(params.seed, position).random() * cdf[-1]
    choice = min(int(np.searchsorted(cdf, u, side="right")), len(cdf) - 1)
    return int(order[choice])


def sample_rows(logits: np.ndarray, params: Sequence[SamplingParams],
                positions: Sequence[int],
                histories: Sequence[Sequence[int]] | None = None) -> list[int]:
    """One token per row of `logits` (B, V): row i with params[i] at positions[i] (and
    histories[i], the sequence's tokens so far, when its params have a penalty)."""
    return sample_rows_with_logprobs(logits, params, positions, histories)[0]


def sample_rows_with_logprobs(
    logits: np.ndarray, params: Sequence[SamplingParams], positions: Sequence[int],
    histories: Sequence[Sequence[int]] | None = None,
) -> tuple[list[int], list[TokenLogprobs | None]]:
    """`sample_rows`, and per row the log-probabilities its params ask for (else None)."""
    out = [0] * len(params)
    lps: list[TokenLogprobs | None] = [None] * len(params)
    greedy = [i for i, p in enumerate(params) if p.greedy and p.plain]
    if greedy:
        rows = logits if len(greedy) == len(params) else logits[greedy]  # (G, V)
        best = np.argmax(rows, axis=1)  # (G,)
        top = rows[np.arange(len(greedy)), best]  # (G,)
        if not np.isfinite(top).all():
            _check_finite(logits, float(top[~np.isfinite(top)][0]))
        for i, b in zip(greedy, best.tolist(), strict=True):
            out[i] = b
    for i, p in enumerate(params):
        if not (p.greedy and p.plain):
            hist = histories[i] if histories is not None and p.penalized else ()
            out[i], lps[i] = sample_with_logprobs(logits[i], p, positions[i], hist)
    return out, lps
