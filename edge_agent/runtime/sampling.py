"""Choosing the next token: greedy, temperature, top-k, top-p, with position-keyed randomness.

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
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from edge_agent.errors import EdgeAgentError, UsageError

__all__ = ["SamplingParams", "SamplingParamsError", "sample", "sample_rows", "rng_for",
           "MAX_SEED"]

MAX_SEED = 2**64 - 1


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
        if problems:
            raise SamplingParamsError(
                f"sampling parameters: {'; '.join(problems)}. Hint: temperature 0 means "
                "greedy; pass e.g. --temperature 0.8 --top-k 40 --top-p 0.95 --seed 7."
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


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


def sample(logits: np.ndarray, params: SamplingParams, position: int) -> int:
    """The token id chosen from 1-D `logits` for generation index `position`."""
    if params.greedy:
        best = int(np.argmax(logits))
        _check_finite(logits, float(logits[best]))
        return best
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
    cdf = np.cumsum(probs)  # (C',)
    u = rng_for(params.seed, position).random() * cdf[-1]
    choice = min(int(np.searchsorted(cdf, u, side="right")), len(cdf) - 1)
    return int(order[choice])


def sample_rows(logits: np.ndarray, params: Sequence[SamplingParams],
                positions: Sequence[int]) -> list[int]:
    """One token per row of `logits` (B, V): row i with params[i] at positions[i]."""
    out = [0] * len(params)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if greedy:
        rows = logits if len(greedy) == len(params) else logits[greedy]  # (G, V)
        best = np.argmax(rows, axis=1)  # (G,)
        top = rows[np.arange(len(greedy)), best]  # (G,)
        if not np.isfinite(top).all():
            _check_finite(logits, float(top[~np.isfinite(top)][0]))
        for i, b in zip(greedy, best.tolist(), strict=True):
            out[i] = b
    for i, p in enumerate(params):
        if not p.greedy:
            out[i] = sample(logits[i], p, positions[i])
    return out
