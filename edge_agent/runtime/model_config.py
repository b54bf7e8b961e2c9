"""The model's hyper-parameters, read from GGUF metadata, and the tensor shapes they imply.

Invariants this module owns:
- Only plain llama (full RoPE, no scaling, GQA allowed) is accepted; another architecture or
  variant is an UnsupportedModel (a ModelFileError) naming the key or the variant, with a
  hint, and a missing key is a ModelFileError naming it. `model info` reports the numpy
  engine's verdict from the same checks.
- `tensor_shapes` is the one statement of what the forward expects of every tensor.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from edge_agent.errors import ModelFileError

__all__ = ["SUPPORTED_ARCHITECTURES", "ModelConfig", "UnsupportedModel"]

SUPPORTED_ARCHITECTURES = ("llama",)


class UnsupportedModel(ModelFileError):
    """A well-formed GGUF the numpy forward cannot run; `reason` says why in one clause."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class ModelConfig:
    n_layers: int
    dim: int
    ffn_dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope_base: float
    context_length: int
    rms_eps: float
    vocab_size: int

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any], *, source: str = "") -> ModelConfig:
        where = f"{source}: " if source else ""
        arch = metadata.get("general.architecture")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModel(
                f"{where}architecture {arch!r} (general.architecture) is not supported "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)}). Hint: use a llama-family "
                "GGUF such as SmolLM2, TinyLlama or Llama 3.",
                f"the numpy engine runs {', '.join(SUPPORTED_ARCHITECTURES)} only, not {arch}",
            )

        def get(key: str, default: Any = None) -> Any:
            full = f"{arch}.{key}"
            if full in metadata:
                return metadata[full]
            if default is not None:
                return default
            raise ModelFileError(
                f"{where}metadata key {full!r} is missing. Hint: the GGUF was written by an "
                "incomplete converter; convert it again with llama.cpp's convert_hf_to_gguf.py."
            )

        dim = int(get("embedding_length"))
        n_heads = int(get("attention.head_count"))
        n_kv_heads = int(get("attention.head_count_kv", n_heads))
        head_dim = int(get("attention.key_length", dim // max(n_heads, 1)))
        rope_dims = int(get("rope.dimension_count", head_dim))
        vocab = metadata.get(f"{arch}.vocab_size")
        if vocab is None and "tokenizer.ggml.tokens" in metadata:
            vocab = len(metadata["tokenizer.ggml.tokens"])
        if vocab is None:
            vocab = get("vocab_size")  # raises naming the key
        scaling = metadata.get(f"{arch}.rope.scaling.type", "none")
        problems = []
        if n_heads < 1 or n_kv_heads < 1 or n_heads % n_kv_heads:
            problems.append(f"head_count {n_heads} is not a multiple of head_count_kv "
                            f"{n_kv_heads}")
        if head_dim % 2 or rope_dims != head_dim:
            problems.append(f"rope.dimension_count {rope_dims} != head_dim {head_dim} "
                            "(partial rotary embeddings)")
        if int(get("attention.value_length", head_dim)) != head_dim:
            problems.append("attention.value_length differs from key_length")
        if scaling not in ("none", None):
            problems.append(f"rope.scaling.type {scaling!r}")
        if problems:
            raise UnsupportedModel(
                f"{where}unsupported llama variant: {'; '.join(problems)}. Hint: edge-agent's "
                "numpy forward supports plain llama (full RoPE, no scaling, GQA).",
                "the numpy engine runs plain llama only (full RoPE, no scaling, GQA), not this "
                f"variant: {'; '.join(problems)}",
            )
        return cls(
            n_layers=int(get("block_count")),
            dim=dim,
            ffn_dim=int(get("feed_forward_length")),
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            head_dim=head_dim,
            rope_base=float(get("rope.freq_base", 10000.0)),
            context_length=int(get("context_length")),
            rms_eps=float(get("attention.layer_norm_rms_epsilon")),
            vocab_size=int(vocab),
        )

    def tensor_shapes(self, *, tied: bool) -> dict[str, tuple[int, ...]]:
        """GGUF tensor name -> numpy shape this config expects."""
        d, hd = self.dim, self.head_dim
        shapes: dict[str, tuple[int, ...]] = {
            "token_embd.weight": (self.vocab_size, d),
            "output_norm.weight": (d,),
        }
        if not tied:
            shapes["output.weight"] = (self.vocab_size, d)
        for i in range(self.n_layers):
            p = f"blk.{i}."
            shapes[p + "attn_norm.weight"] = (d,)
            shapes[p + "attn_q.weight"] = (self.n_heads * hd, d)
            shapes[p + "attn_k.weight"] = (self.n_kv_heads * hd, d)
            shapes[p + "attn_v.weight"] = (self.n_kv_heads * hd, d)
            shapes[p + "attn_output.weight"] = (d, self.n_heads * hd)
            shapes[p + "ffn_norm.weight"] = (d,)
            shapes[p + "ffn_gate.weight"] = (self.ffn_dim, d)
            shapes[p + "ffn_up.weight"] = (self.ffn_dim, d)
            shapes[p + "ffn_down.weight"] = (d, self.ffn_dim)
        return shapes
