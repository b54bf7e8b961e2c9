"""Paged KV cache: a pool of fixed-size blocks, allocated once (vLLM's PagedAttention layout).

Invariants this module owns:
- The pool's key and value arrays are allocated once, in `BlockPool.__init__`, for the whole
  budget (`n_blocks` blocks of `block_size` tokens); nothing here allocates per token.
- A block belongs to at most one `BlockTable` at a time. `BlockPool.grow` is all-or-nothing:
  when the pool cannot supply every block a request needs, it raises `KVCacheExhaustedError`
  and the table and the free list are unchanged.
- Token `p` of a sequence lives at `(table.blocks[p // block_size], p % block_size)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from edge_agent.errors import EdgeAgentError

__all__ = ["BLOCK_SIZE", "BlockPool", "BlockTable", "KVCacheExhaustedError", "blocks_for"]

BLOCK_SIZE = 16


class KVCacheExhaustedError(EdgeAgentError):
    """The KV block pool has no free block for a sequence that needs one."""


def blocks_for(n_tokens: int, block_size: int = BLOCK_SIZE) -> int:
    """Number of blocks that hold `n_tokens` tokens."""
    return -(-n_tokens // block_size)


@dataclass
class BlockTable:
    """The blocks one sequence owns, in token order, and how many tokens are stored in them."""

    blocks: list[int] = field(default_factory=list)
    length: int = 0


class BlockPool:
    """Key/value storage for every layer as `n_blocks` blocks of `block_size` tokens.

    `k` and `v` have shape (n_layers, n_blocks, block_size, n_kv_heads, head_dim).
    """

    def __init__(
        self,
        *,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        n_blocks: int,
        block_size: int = BLOCK_SIZE,
        dtype: type[np.floating] = np.float32,
    ) -> None:
        if n_blocks < 1 or block_size < 1:
            raise ValueError(f"BlockPool needs n_blocks >= 1 and block_size >= 1, got "
                             f"{n_blocks} and {block_size}")
        self.n_blocks = n_blocks
        self.block_size = block_size
        shape = (n_layers, n_blocks, block_size, n_kv_heads, head_dim)
        self.k = np.zeros(shape, dtype=dtype)  # (L, NB, BS, KVH, HD)
        self.v = np.zeros(shape, dtype=dtype)  # (L, NB, BS, KVH, HD)
        # Pop from the end: low block ids are handed out first.
        self._free: list[int] = list(range(n_blocks - 1, -1, -1))

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def nbytes(self) -> int:
        return int(self.k.nbytes + self.v.nbytes)

    @property
    def bytes_per_token(self) -> int:
        return self.nbytes // (self.n_blocks * self.block_size)

    def grow(self, table: BlockTable, n_tokens: int, *, what: str = "sequence") -> None:
        """Make `table` hold at least `n_tokens` tokens, taking blocks from the pool."""
        need = blocks_for(n_tokens, self.block_size) - len(table.blocks)
        if need <= 0:
            return
        if need > len(self._free):
            raise KVCacheExhaustedError(
                f"KV cache: {what} needs {need} more block(s) of {self.block_size} tokens to "
                f"hold {n_tokens} tokens, but only {len(self._free)} of {self.n_blocks} blocks "
                "are free. Hint: release finished sequences, lower the batch size, or load "
                "the model with a larger max_batch × context budget."
            )
        for _ in range(need):
            table.blocks.append(self._free.pop())

    def shrink(self, table: BlockTable) -> None:
        """Return the blocks `table` holds beyond its `length` (e.g. held for padding)."""
        keep = blocks_for(table.length, self.block_size)
        while len(table.blocks) > keep:
            self._free.append(table.blocks.pop())

    def release(self, table: BlockTable) -> None:
        """Return every block of `table` to the pool and empty it."""
        self._free.extend(reversed(table.blocks))
        table.blocks.clear()
        table.length = 0

    def slots(self, table: BlockTable, start: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(block ids, offsets) of token positions start..start+n-1 of `table`."""
        pos = np.arange(start, start + n)  # (n,)
        blocks = np.asarray(table.blocks, dtype=np.intp)[pos // self.block_size]  # (n,)
        return blocks, pos % self.block_size

    def step_slots(self, tables: Sequence[BlockTable], n: int) -> tuple[np.ndarray, np.ndarray]:
        """(block ids, offsets), each (B*n,), of the next `n` positions of every table.

        Table-major order (table 0's n slots, then table 1's, ...); the positions start at each
        table's `length`, whose blocks must already be held (`grow`).
        """
        bs = self.block_size
        if n == 1:  # a decode step: one slot per sequence, no per-table arrays
            blk = np.fromiter((tab.blocks[tab.length // bs] for tab in tables), dtype=np.intp,
                              count=len(tables))  # (B,)
            off = np.fromiter((tab.length % bs for tab in tables), dtype=np.intp,
                              count=len(tables))  # (B,)
            return blk, off
        parts = [self.slots(tab, tab.length, n) for tab in tables]
        return (np.concatenate([p[0] for p in parts]),  # (B*n,)
                np.concatenate([p[1] for p in parts]))  # (B*n,)

    def padded_block_ids(self, tables: list[BlockTable], n_tokens: int) -> np.ndarray:
        """(B, blocks_for(n_tokens)) block ids, each row padded with block 0 (masked by caller)."""
        width = blocks_for(n_tokens, self.block_size)
        ids = np.zeros((len(tables), width), dtype=np.intp)  # (B, W)
        for row, table in enumerate(tables):
            used = table.blocks[:width]
            ids[row, : len(used)] = used
        return ids
