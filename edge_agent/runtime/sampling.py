"""Choosing the next token: logit bias, repetition penalties, greedy, temperature, top-k, top-p,
min-p, with position-keyed randomness; the log-probabilities of the distribution sampled from.

Invariants this module owns:
- `sample` is a pure function of (logits, params, position): the random number for the token at
  generation index `position` of a request comes from a Philox generator keyed by
  (params.seed, position) alone, so a request resumed after a restart (or decoded in a different
  batch, or on another process) draws exactly the same numbers. `uniform_for` computes it in
  plain Python, bit for bit numpy's `Generator(Philox(key=[seed, position])).random()`
  (`rng_for`, kept as its reference): the draw never imports numpy.random (27 modules, 1.9 MiB
  of a serving SmolLM2 runner's PSS) and takes 3 µs instead of numpy's 7.
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

import numpy as np

from edge_agent.errors import EdgeAgentError
from edge_agent.runtime.sampling_params import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_SEED,
    SamplingParams,
    SamplingParamsError,
    TokenLogprobs,
)

__all__ = ["SamplingParams", "SamplingParamsError", "TokenLogprobs", "sample", "sample_rows",
           "sample_with_logprobs", "sample_rows_with_logprobs", "shape_logits", "rng_for",
           "uniform_for", "MAX_SEED", "MAX_LOGPROBS", "MAX_LOGIT_BIAS"]


def rng_for(seed: int, position: int) -> np.random.Generator:
    """The generator for token `position` of a request with `seed` (Philox, 128-bit key): the
    reference `uniform_for` is checked against."""
    return np.random.Generator(np.random.Philox(key=np.array([seed, position], dtype=np.uint64)))


_M64 = (1 << 64) - 1
_PHILOX_M0, _PHILOX_M1 = 0xD2E7470EE14C6C93, 0xCA5A826395121157  # Random123's Philox4x64
_PHILOX_W0, _PHILOX_W1 = 0x9E3779B97F4A7C15, 0xBB67AE8584CAA73B  # its key increments


def uniform_for(seed: int, position: int) -> float:
    """`rng_for(seed, position).random()`, without numpy: the first 64-bit output of
    Philox4x64-10 keyed by (seed, position) at counter 1 (numpy increments its counter before
    the first block), its top 53 bits as a double in [0, 1)."""
    if not (0 <= seed <= _M64 and 0 <= position <= _M64):
        raise ValueError(f"Philox key ({seed}, {position}): both must be in 0..2**64-1")
    c0, c1, c2, c3 = 1, 0, 0, 0
    k0, k1 = seed, position
    for r in range(10):
        if r:
            k0, k1 = (k0 + _PHILOX_W0) & _M64, (k1 + _PHILOX_W1) & _M64
        p0, p1 = _PHILOX_M0 * c0, _PHILOX_M1 * c2
        c0, c1, c2, c3 = (p1 >> 64) ^ c1 ^ k0, p1 & _M64, (p0 >> 64) ^ c3 ^ k1, p0 & _M64
    return (c0 >> 11) * (1.0 / 9007199254740992.0)


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
    u = uniform_for(params.seed, position) * cdf[-1]
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
