"""A llama forward pass in numpy, over GGUF-named weights and a paged KV cache.

RMSNorm, RoPE, grouped-query attention, SwiGLU, output head tied to `token_embd` when the file
has no `output.weight`. Shapes: N = tokens in a step (B sequences × T tokens each), D = dim,
H = query heads, KVH = key/value heads, G = H // KVH, HD = head_dim, L = keys attended, V = vocab.

Invariants this module owns:
- Weights are used as given (zero-copy views of the pinned file are fine); nothing here copies
  or rewrites a weight. float16 weights are widened per matmul (slower, half the memory).
  Batched decode may hand BLAS a weight in row slabs (views) to reach OpenBLAS's unpacked
  small-matrix kernel (edge_agent.runtime.matmul); each output is still one dot product over
  the full width.
- GGUF stores the Q and K projection rows of each head permuted for llama.cpp's "normal" RoPE
  (pair (2i, 2i+1) holds HF's (i, i + HD/2)). Instead of un-permuting (a copy), RoPE here rotates
  adjacent pairs with the matching angle, which gives exactly the HF/transformers result: the
  q·k dot products are invariant under the same permutation of q and k. The rotation of a
  pair (x0, x1) is computed as the complex product (x0 + i·x1)(cos + i·sin).
- Activations are float32 and a step's own buffers, updated in place (no float64 anywhere).
- Every tensor's shape is checked against the config at construction (ModelFileError naming the
  tensor, the expected and the actual shape).
- A step writes its keys/values into the sequence's blocks before attending; `table.length` is
  advanced only after the step has computed, and the caller's tables must already hold room
  (`BlockPool.grow`), which `forward` does for them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from edge_agent.errors import ModelFileError
from edge_agent.runtime.kvcache import BlockPool, BlockTable
from edge_agent.runtime.matmul import as_f32 as _vec
from edge_agent.runtime.matmul import blas_has_small_kernel
from edge_agent.runtime.matmul import matmul_wt as _mm
from edge_agent.runtime.model_config import SUPPORTED_ARCHITECTURES, ModelConfig

__all__ = [
    "ModelConfig", "Llama", "SUPPORTED_ARCHITECTURES", "PREFILL_CHUNK",
    "blas_has_small_kernel",
]

PREFILL_CHUNK = 256  # prompt tokens per forward in prefill (bounds the attention scores)


@dataclass(frozen=True)
class _Layer:
    attn_norm: np.ndarray  # (D,)
    wq: np.ndarray  # (H*HD, D)
    wk: np.ndarray  # (KVH*HD, D)
    wv: np.ndarray  # (KVH*HD, D)
    wo: np.ndarray  # (D, H*HD)
    ffn_norm: np.ndarray  # (D,)
    w_gate: np.ndarray  # (F, D)
    w_up: np.ndarray  # (F, D)
    w_down: np.ndarray  # (D, F)


class Llama:
    """The forward pass. `forward` runs B sequences × T new tokens each against the KV pool."""

    def __init__(
        self, config: ModelConfig, tensors: Mapping[str, np.ndarray], *, source: str = ""
    ) -> None:
        where = f"{source}: " if source else ""
        tied = "output.weight" not in tensors
        for name, expected in config.tensor_shapes(tied=tied).items():
            if name not in tensors:
                raise ModelFileError(
                    f"{where}tensor {name!r} is missing (expected shape {expected}). "
                    "Hint: the file is not a complete llama model."
                )
            arr = tensors[name]
            if tuple(arr.shape) != expected:
                raise ModelFileError(
                    f"{where}tensor {name!r} has shape {tuple(arr.shape)}, expected {expected} "
                    "from the model's metadata. Hint: the metadata and the weights disagree; "
                    "the file is corrupt or was converted wrongly."
                )
            if arr.dtype not in (np.float32, np.float16):
                raise ModelFileError(
                    f"{where}tensor {name!r} has dtype {arr.dtype}; the forward needs float32 "
                    "or float16. Hint: run `edge-agent model prepare` and load the prepared file."
                )
        self.config = config
        self.tied = tied
        self.slabs = blas_has_small_kernel()  # see edge_agent.runtime.matmul
        self.token_embd = tensors["token_embd.weight"]  # (V, D)
        self.output = tensors["token_embd.weight" if tied else "output.weight"]  # (V, D)
        self.output_norm = _vec(tensors["output_norm.weight"])  # (D,)
        self.layers = [self._layer(tensors, i) for i in range(config.n_layers)]
        # RoPE angles as transformers computes them (float32 throughout).
        half = config.head_dim // 2
        exponent = np.arange(0, config.head_dim, 2, dtype=np.float32) / np.float32(config.head_dim)
        inv_freq = (1.0 / (np.float32(config.rope_base) ** exponent)).astype(np.float32)  # (HD/2,)
        pos = np.arange(config.context_length, dtype=np.float32)  # (C,)
        angles = pos[:, None] * inv_freq[None, :]  # (C, HD/2)
        rot = np.empty((config.context_length, half), dtype=np.complex64)  # (C, HD/2)
        rot.real = np.cos(angles).astype(np.float32)
        rot.imag = np.sin(angles).astype(np.float32)
        self._rot = rot

    @staticmethod
    def _layer(tensors: Mapping[str, np.ndarray], i: int) -> _Layer:
        def w(name: str) -> np.ndarray:
            return tensors[f"blk.{i}.{name}.weight"]

        return _Layer(
            attn_norm=_vec(w("attn_norm")), wq=w("attn_q"), wk=w("attn_k"), wv=w("attn_v"),
            wo=w("attn_output"), ffn_norm=_vec(w("ffn_norm")), w_gate=w("ffn_gate"),
            w_up=w("ffn_up"), w_down=w("ffn_down"),
        )

    def new_pool(self, n_blocks: int) -> BlockPool:
        c = self.config
        return BlockPool(
            n_layers=c.n_layers, n_kv_heads=c.n_kv_heads, head_dim=c.head_dim, n_blocks=n_blocks
        )

    # -- pieces ---------------------------------------------------------------------------

    def _rmsnorm(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        # Same arithmetic as mean(x*x) then x / sqrt(ms + eps) * w, with fewer temporaries.
        sq: np.ndarray = np.square(x)  # (N, D)
        ms = np.add.reduce(sq, axis=-1, keepdims=True)  # (N, 1)
        ms /= np.float32(x.shape[-1])
        ms += np.float32(self.config.rms_eps)
        np.sqrt(ms, out=ms)
        np.divide(x, ms, out=sq)
        sq *= w
        return sq  # (N, D)

    @staticmethod
    def _rope(x: np.ndarray, rot: np.ndarray) -> np.ndarray:
        """Rotate adjacent pairs (llama.cpp's "normal" RoPE) of x (N, heads, HD), in place.

        A pair (x0, x1) read as the complex number x0 + i·x1, times cos + i·sin, is
        (x0·cos − x1·sin) + i·(x0·sin + x1·cos): one complex multiply per pair.
        """
        xc = x.view(np.complex64)  # (N, heads, HD/2), x must be C-contiguous
        xc *= rot  # rot (N, 1, HD/2)
        return x

    # -- forward --------------------------------------------------------------------------

    def forward(
        self,
        tokens: np.ndarray,
        tables: Sequence[BlockTable],
        pool: BlockPool,
        *,
        all_logits: bool = False,
        lengths: Sequence[int] | None = None,
    ) -> np.ndarray:
        """Run tokens (B, T) appended to the B sequences in `tables` (ragged lengths allowed).

        Returns logits (B, T, V) if `all_logits`, else (B, V) for each sequence's last token.
        Advances each table's `length` by T, or by `lengths[b]` when given: row b then holds
        lengths[b] real tokens followed by padding. A pad sits at a later position than every
        real token of its row, so the causal mask already hides it from them; its key/value
        lands in a slot past the table's new length, which the sequence's next token
        overwrites, and blocks held only for pads go back to the pool.
        """
        c = self.config
        tokens = np.asarray(tokens, dtype=np.intp)  # (B, T)
        b, t = tokens.shape
        if len(tables) != b:
            raise ValueError(f"forward: {b} token rows for {len(tables)} tables")
        if lengths is not None:
            if all_logits or len(lengths) != b or not all(1 <= n <= t for n in lengths):
                raise ValueError(f"forward: lengths {list(lengths)} for {b} rows of {t} tokens "
                                 "(each 1..T, and not with all_logits)")
        start = np.array([tab.length for tab in tables], dtype=np.intp)  # (B,)
        end = int(start.max()) + t
        if end > c.context_length:
            raise ValueError(f"forward: position {end - 1} beyond context {c.context_length}")
        for tab in tables:
            pool.grow(tab, tab.length + t)
        positions = (start[:, None] + np.arange(t)[None, :]).reshape(-1)  # (N,)
        blk, off = pool.step_slots(tables, t)  # (N,), (N,)
        ids = pool.padded_block_ids(list(tables), end)  # (B, W)
        n_keys = ids.shape[1] * pool.block_size  # L
        # bias[b, t, j]: 0 where key j is visible to query t of sequence b (causal, own length
        # only), -inf elsewhere; adding it equals masking (x + 0 == x, x + -inf == -inf).
        visible = np.arange(n_keys)[None, None, :] <= positions.reshape(b, t)[:, :, None]
        bias = np.where(visible, np.float32(0.0), np.float32(-np.inf))  # (B, T, L)
        bias = bias[:, None, None]  # (B, 1, 1, T, L)
        kvh, g, hd = c.n_kv_heads, c.n_heads // c.n_kv_heads, c.head_dim
        scale = np.float32(1.0 / np.sqrt(hd))
        rot = self._rot[positions][:, None, :]  # (N, 1, HD/2), gathered once for all layers

        sl = self.slabs
        x = self.token_embd[tokens.reshape(-1)].astype(np.float32, copy=False)  # (N, D), own
        for li, layer in enumerate(self.layers):
            h = self._rmsnorm(x, layer.attn_norm)  # (N, D)
            q = np.ascontiguousarray(_mm(h, layer.wq, slabs=sl))  # (N, H*HD)
            k = np.ascontiguousarray(_mm(h, layer.wk, slabs=sl))  # (N, KVH*HD)
            v = _mm(h, layer.wv, slabs=sl)  # (N, KVH*HD)
            q = self._rope(q.reshape(-1, c.n_heads, hd), rot)  # (N, H, HD)
            k = self._rope(k.reshape(-1, kvh, hd), rot)  # (N, KVH, HD)
            v = v.reshape(-1, kvh, hd)  # (N, KVH, HD)
            pool.k[li, blk, off] = k
            pool.v[li, blk, off] = v
            keys = pool.k[li][ids].reshape(b, n_keys, kvh, hd)  # (B, L, KVH, HD)
            vals = pool.v[li][ids].reshape(b, n_keys, kvh, hd)  # (B, L, KVH, HD)
            # One BLAS call per (sequence, kv head): the queries of the G heads sharing a kv
            # head stacked as rows; keys and values are strided views (leading dimension
            # KVH*HD), which BLAS reads in place (copying them measured slower).
            qg = q.reshape(b, t, kvh, g, hd).transpose(0, 2, 3, 1, 4)  # (B, KVH, G, T, HD)
            qg = qg.reshape(b, kvh, g * t, hd)  # (B, KVH, G*T, HD) copy
            scores = np.matmul(qg, keys.transpose(0, 2, 3, 1))  # (B, KVH, G*T, L)
            scores *= scale
            s5 = scores.reshape(b, kvh, g, t, n_keys)  # (B, KVH, G, T, L) view
            s5 += bias
            s5 -= s5.max(axis=-1, keepdims=True)
            np.exp(s5, out=s5)  # probs
            s5 /= s5.sum(axis=-1, keepdims=True)
            att = np.matmul(scores, vals.transpose(0, 2, 1, 3))  # (B, KVH, G*T, HD)
            att = att.reshape(b, kvh, g, t, hd)  # (B, KVH, G, T, HD)
            att = att.transpose(0, 3, 1, 2, 4).reshape(b * t, c.n_heads * hd)  # (N, H*HD)
            x += _mm(att, layer.wo, slabs=sl)  # (N, D)
            h = self._rmsnorm(x, layer.ffn_norm)  # (N, D)
            gate = _mm(h, layer.w_gate, slabs=sl)  # (N, F)
            up = _mm(h, layer.w_up, slabs=sl)  # (N, F)
            # silu(gate) * up, as gate / (1 + exp(-gate)) * up, in one buffer
            ffn = np.negative(gate)  # (N, F)
            with np.errstate(over="ignore"):  # exp overflow -> inf -> silu == -0.0, as wanted
                np.exp(ffn, out=ffn)
            ffn += np.float32(1.0)
            np.divide(gate, ffn, out=ffn)
            ffn *= up
            x += _mm(ffn, layer.w_down, slabs=sl)  # (N, D)

        if lengths is None:
            for tab in tables:
                tab.length += t
        else:
            for tab, n in zip(tables, lengths, strict=True):
                tab.length += int(n)
                pool.shrink(tab)
        if lengths is not None:
            last = np.asarray(lengths, dtype=np.intp) - 1  # (B,)
            x = x.reshape(b, t, c.dim)[np.arange(b), last]  # (B, D)
        elif not all_logits:
            x = x.reshape(b, t, c.dim)[:, -1]  # (B, D)
        logits = _mm(self._rmsnorm(x, self.output_norm), self.output, slabs=sl)  # (B or N, V)
        return logits.reshape(b, t, c.vocab_size) if all_logits else logits

    def prefill(
        self,
        tokens: Sequence[int],
        table: BlockTable,
        pool: BlockPool,
        *,
        all_logits: bool = False,
        chunk: int = PREFILL_CHUNK,
    ) -> np.ndarray:
        """One sequence's prompt (or continuation): logits (T, V) if all_logits else (V,).

        Runs in chunks of `chunk` tokens so the attention scores stay (chunk × context) in
        size instead of (T × T): a long prompt costs the same arithmetic, bounded memory.
        """
        ids = np.asarray(tokens, dtype=np.intp)  # (T,)
        outs = []
        for lo in range(0, len(ids), chunk):
            part = ids[None, lo : lo + chunk]  # (1, t)
            outs.append(self.forward(part, [table], pool, all_logits=all_logits)[0])
        return np.concatenate(outs) if all_logits else outs[-1]  # (T, V) or (V,)

    def prefill_many(
        self,
        prompts: Sequence[Sequence[int]],
        tables: Sequence[BlockTable],
        pool: BlockPool,
        *,
        chunk: int = PREFILL_CHUNK,
    ) -> np.ndarray:
        """Several sequences' prompts in shared forwards: logits (B, V), one row per prompt.

        Each forward takes up to `chunk` tokens of every prompt that still has some, padded to
        the longest (see `forward`'s `lengths`): the weights are streamed once for all of them
        instead of once per prompt. Callers group prompts of similar length (padding is
        computed for nothing). Blocks for the padded length must be free during a forward.
        """
        ids = [np.asarray(p, dtype=np.intp) for p in prompts]
        if len(ids) != len(tables) or any(len(p) == 0 for p in ids):
            raise ValueError("prefill_many: one non-empty prompt per table")
        out = np.empty((len(ids), self.config.vocab_size), dtype=np.float32)  # (B, V)
        for lo in range(0, max(len(p) for p in ids), chunk):
            rows = [i for i, p in enumerate(ids) if len(p) > lo]
            parts = [ids[i][lo : lo + chunk] for i in rows]
            t = max(len(p) for p in parts)
            block = np.zeros((len(rows), t), dtype=np.intp)  # (B', t), pads are token 0
            for j, p in enumerate(parts):
                block[j, : len(p)] = p
            logits = self.forward(block, [tables[i] for i in rows], pool,
                                  lengths=[len(p) for p in parts])  # (B', V)
            for j, i in enumerate(rows):
                if len(ids[i]) <= lo + chunk:  # this chunk held the prompt's last token
                    out[i] = logits[j]
        return out  # (B, V)

    def decode(
        self, tokens: Sequence[int], tables: Sequence[BlockTable], pool: BlockPool
    ) -> np.ndarray:
        """One token for each of B sequences in one batched step: logits (B, V)."""
        return self.forward(np.asarray(tokens).reshape(-1, 1), tables, pool)
