"""Small random-weight GGUFs of the architectures llama.cpp serves: llama, qwen2, phi3, gemma3.

    write_tiny_arch(tmp_path / "qwen2.gguf", "qwen2")   # ~4-7 MB, loads in milliseconds

Invariants: each file has the tensor names, shapes and metadata keys llama.cpp's loader asks
for that architecture (src/llama-arch.cpp names, src/llama-model.cpp `load_tensors` shapes):
qwen2 has q/k/v biases and a tied output; phi3 a fused attn_qkv, a fused gate+up ffn_up
(2 x ffn rows) and its own output matrix; gemma3 per-head q/k norms, post-attention and
post-ffn norms and a sliding window; llama the plain layout. The tokenizer is the default
model's (tokens, types, merges, special ids, chat template copied from its GGUF), so prompts
encode as for the real model. Quantization is a real mix: F32 norms and biases, F16, Q8_0,
Q4_0 and Q4_K (Q4_K blocks are 256 wide, so only matrices with 256-element rows get it;
written by ggml's own quantizer, `ggml_quantize_chunk`, since the `gguf` package cannot
quantize K-quants). Weights are seeded: the same seed gives the same bytes.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import numpy as np
from qemu.tiny_model import copy_vocabulary

from edge_agent.paths import default_model_path
from edge_agent.runtime.gguf import GGUFFile

__all__ = ["ARCHS", "TINY", "QUANT_MIX", "write_tiny_arch"]

ARCHS = ("llama", "qwen2", "phi3", "gemma3")
# dim, layers, heads (head dim 16), kv heads, ffn rows (256: ffn_down's rows can be Q4_K)
TINY = {"dim": 64, "layers": 2, "heads": 4, "kv_heads": 2, "ffn": 256, "context": 1024}
# tensor name suffix -> GGML type name; the rest (norms, biases) is F32
QUANT_MIX = {
    "token_embd": "Q8_0", "output": "Q8_0", "attn_q": "Q4_0", "attn_k": "F16",
    "attn_v": "Q8_0", "attn_qkv": "Q8_0", "attn_output": "Q4_0", "ffn_gate": "Q4_0",
    "ffn_up": "Q8_0", "ffn_down": "Q4_K",
}


def _ggml() -> Any:
    import llama_cpp

    lib = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                        ctypes.c_void_p]
    return lib


def _ggml_quantize(values: np.ndarray, qtype: Any) -> np.ndarray:
    """(rows, cols) f32 -> (rows, bytes per row) uint8 in `qtype`, by ggml's quantizer."""
    import gguf

    elems, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = values.shape
    assert cols % elems == 0, (qtype, values.shape)
    src = np.ascontiguousarray(values, dtype=np.float32)
    out = np.zeros((rows, cols // elems * nbytes), np.uint8)
    done = _ggml().ggml_quantize_chunk(int(qtype), src.ctypes.data, out.ctypes.data, 0, rows,
                                       cols, None)
    assert done == out.nbytes, (done, out.nbytes)
    return out


def _encode(values: np.ndarray, type_name: str) -> tuple[np.ndarray, Any]:
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    if type_name == "F32":
        return values.astype(np.float32), None
    if type_name == "F16":
        return values.astype(np.float16), None
    if type_name.endswith("_K"):
        return _ggml_quantize(values, qtype), qtype
    return gguf.quants.quantize(values, qtype), qtype


def _tensor_specs(arch: str, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """(name, numpy shape) of every tensor llama.cpp loads for `arch` (rows, row length)."""
    s = TINY
    d, hd, ff = s["dim"], s["dim"] // s["heads"], s["ffn"]
    q, kv = s["heads"] * hd, s["kv_heads"] * hd
    specs: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (vocab, d)),
                                                ("output_norm.weight", (d,))]
    if arch == "phi3":
        specs.append(("output.weight", (vocab, d)))
    for i in range(s["layers"]):
        p = f"blk.{i}."
        specs.append((p + "attn_norm.weight", (d,)))
        if arch == "phi3":
            specs += [(p + "attn_qkv.weight", (q + 2 * kv, d))]
        else:
            specs += [(p + "attn_q.weight", (q, d)), (p + "attn_k.weight", (kv, d)),
                      (p + "attn_v.weight", (kv, d))]
        if arch == "qwen2":
            specs += [(p + "attn_q.bias", (q,)), (p + "attn_k.bias", (kv,)),
                      (p + "attn_v.bias", (kv,))]
        if arch == "gemma3":
            specs += [(p + "attn_q_norm.weight", (hd,)), (p + "attn_k_norm.weight", (hd,)),
                      (p + "post_attention_norm.weight", (d,)),
                      (p + "post_ffw_norm.weight", (d,))]
        specs += [(p + "attn_output.weight", (d, q)), (p + "ffn_norm.weight", (d,))]
        if arch == "phi3":
            specs += [(p + "ffn_up.weight", (2 * ff, d))]
        else:
            specs += [(p + "ffn_gate.weight", (ff, d)), (p + "ffn_up.weight", (ff, d))]
        specs += [(p + "ffn_down.weight", (d, ff))]
    return specs


def type_of(name: str) -> str:
    """The GGML type name `write_tiny_arch` gives tensor `name`."""
    base = name.rsplit(".", 1)[0].split(".")[-1]
    return "F32" if name.endswith(".bias") or base.endswith("norm") else QUANT_MIX[base]


def write_tiny_arch(path: Path, arch: str, *, seed: int = 0, source: Path | None = None,
                    pooling: str | None = None) -> Path:
    """Write a tiny `arch` GGUF at `path`; returns `path`. `pooling` ("mean", "cls", "last")
    declares `<arch>.pooling_type`, as an embedding model's GGUF does."""
    import gguf

    if arch not in ARCHS:
        raise ValueError(f"tiny arch {arch!r}: not one of {ARCHS}")
    meta = GGUFFile(source or default_model_path()).metadata
    s = TINY
    hd = s["dim"] // s["heads"]
    vocab = len(meta["tokenizer.ggml.tokens"])
    w = gguf.GGUFWriter(str(path), arch)
    # not the architecture: llama.cpp gives a model *named* phi-3/phi3 the attributes of
    # Phi-3's own "</s>" token, which this (SmolLM2) vocabulary does not have
    w.add_name("edge-agent tiny test model")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    w.add_context_length(s["context"])
    w.add_embedding_length(s["dim"])
    w.add_block_count(s["layers"])
    w.add_feed_forward_length(s["ffn"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    if pooling is not None:
        w.add_pooling_type(gguf.PoolingType[pooling.upper()])
    if arch == "phi3":
        w.add_rope_dimension_count(hd)
    elif arch == "gemma3":
        w.add_key_length(hd)
        w.add_value_length(hd)
        w.add_sliding_window(128)
    else:
        w.add_rope_dimension_count(hd)
    copy_vocabulary(w, meta)
    rng = np.random.default_rng(seed)
    for name, shape in _tensor_specs(arch, vocab):
        kind = type_of(name)
        if len(shape) == 1:
            values = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
            if name.endswith(".bias"):
                values -= 1.0
            elif ".post_" in name:  # gemma3 scales the embedding by sqrt(dim): let the
                values *= 8.0       # blocks' normed outputs weigh as much in the residual
        else:
            values = (rng.standard_normal(shape) * 2.0 / np.sqrt(shape[-1])).astype(np.float32)
        data, raw_dtype = _encode(values, kind)
        w.add_tensor(name, data, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
