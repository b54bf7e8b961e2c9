"""llama.cpp's pre-tokenizer regex lists, keyed by `tokenizer.ggml.pre` (src/llama-vocab.cpp).

Invariants owned here:
- Each entry is (regexes, ignore_merges) exactly as llama.cpp's `llm_tokenizer_bpe` sets them for
  that pre type: the regexes run in order, each splitting every fragment the previous ones left
  into matches and non-matches; ignore_merges (llama3) looks a whole pre-token up in the vocabulary
  before merging.
- Every family but `default` is checked against llama.cpp on real token ids: `smollm` on the
  SmolLM2 vocabulary (tests/test_tokenizer.py), the others on the vocab-only GGUFs llama.cpp
  tests its tokenizer with (tests/test_tokenizer_vocabs.py). Names that only alias a family
  share its entry.
"""

from __future__ import annotations

__all__ = ["PRE_TOKENIZERS"]

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|"
    r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")
_DEEPSEEK_CODER = ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[一-龥\u0800-一가-\ud7ff]+", r"\p{N}")

# name -> (regexes, ignore_merges)
PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...], bool]] = {
    "default": (_DEFAULT, False),
    **{name: ((_GPT2,), False) for name in ("gpt2", "gpt-2", "phi-2", "roberta-bpe")},
    **{name: ((_LLAMA3,), True) for name in ("llama3", "llama-v3", "llama-bpe", "falcon3")},
    **{name: ((_QWEN2,), False) for name in ("qwen2", "deepseek-r1-qwen")},
    **{name: ((r"\p{N}", _GPT2), False) for name in ("smollm", "starcoder", "refact")},
    "deepseek-coder": (_DEEPSEEK_CODER, False),
}
