"""What a request asks of the sampler: `SamplingParams` (checked when made), the
log-probabilities reported per token, and their limits.

Invariants this module owns:
- A `SamplingParams` exists only with every field in range (`SamplingParamsError`, naming each
  bad field, otherwise); `runtime/sampling.py` draws tokens from it.
- numpy-free: the control plane builds and checks a request's parameters without importing the
  sampler's numpy (which it never runs on the llama.cpp engine).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

from edge_agent.errors import UsageError

__all__ = ["SamplingParams", "SamplingParamsError", "TokenLogprobs", "MAX_SEED", "MAX_LOGPROBS",
           "MAX_LOGIT_BIAS"]

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
