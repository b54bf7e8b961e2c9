"""BlockPool: allocated once, blocks taken and returned whole, exhaustion is all-or-nothing."""

from __future__ import annotations

import numpy as np
import pytest

from edge_agent.errors import EdgeAgentError
from edge_agent.runtime.kvcache import (
    BLOCK_SIZE,
    BlockPool,
    BlockTable,
    KVCacheExhaustedError,
    blocks_for,
)


def _pool(n_blocks: int = 4) -> BlockPool:
    return BlockPool(n_layers=2, n_kv_heads=3, head_dim=8, n_blocks=n_blocks)


def test_storage_is_allocated_once_for_the_budget():
    pool = _pool(5)
    assert BLOCK_SIZE == 16 and pool.block_size == 16
    assert pool.k.shape == pool.v.shape == (2, 5, 16, 3, 8)
    assert pool.nbytes == 2 * 2 * 5 * 16 * 3 * 8 * 4
    assert pool.bytes_per_token == 2 * 2 * 3 * 8 * 4
    k, v = pool.k, pool.v
    table = BlockTable()
    for n in range(1, 5 * 16 + 1):  # grow one token at a time up to the whole pool
        pool.grow(table, n)
        assert len(table.blocks) == blocks_for(n)  # a new block only every 16 tokens
        assert pool.free_blocks == 5 - blocks_for(n)
    assert pool.k is k and pool.v is v  # same arrays: nothing reallocated


def test_blocks_are_returned_and_reused():
    pool = _pool(4)
    a, b = BlockTable(), BlockTable()
    pool.grow(a, 20)
    pool.grow(b, 16)
    assert a.blocks == [0, 1] and b.blocks == [2]
    assert set(a.blocks).isdisjoint(b.blocks)
    a.length = 20
    pool.release(a)
    assert a.blocks == [] and a.length == 0 and pool.free_blocks == 3
    c = BlockTable()
    pool.grow(c, 33)
    assert sorted(c.blocks) == [0, 1, 3] and pool.free_blocks == 0


def test_exhaustion_is_a_clear_error_and_changes_nothing():
    pool = _pool(3)
    a, b = BlockTable(), BlockTable()
    pool.grow(a, 32)
    with pytest.raises(KVCacheExhaustedError) as exc:
        pool.grow(b, 40, what="sequence 'req-7'")
    msg = str(exc.value)
    assert msg.startswith("KV cache: sequence 'req-7' needs 3 more block(s) of 16 tokens to hold "
                          "40 tokens, but only 1 of 3 blocks are free.")
    assert "Hint:" in msg
    assert isinstance(exc.value, EdgeAgentError)
    assert b.blocks == [] and pool.free_blocks == 1  # all or nothing


def test_slots_map_positions_to_block_and_offset():
    pool = _pool(4)
    t = BlockTable()
    pool.grow(t, 16)
    other = BlockTable()
    pool.grow(other, 1)
    pool.grow(t, 40)  # t = [0, 2, 3]: its blocks are not contiguous
    assert t.blocks == [0, 2, 3]
    blocks, offsets = pool.slots(t, 14, 5)
    assert blocks.tolist() == [0, 0, 2, 2, 2]
    assert offsets.tolist() == [14, 15, 0, 1, 2]
    blocks, offsets = pool.slots(t, 39, 1)
    assert (blocks.tolist(), offsets.tolist()) == ([3], [7])


def test_padded_block_ids_for_ragged_tables():
    pool = _pool(4)
    a, b = BlockTable(), BlockTable()
    pool.grow(a, 3)
    pool.grow(b, 30)
    ids = pool.padded_block_ids([a, b], 30)
    assert ids.shape == (2, 2)
    assert ids[0].tolist() == [a.blocks[0], 0] and ids[1].tolist() == b.blocks
    assert ids.dtype == np.intp


def test_invalid_pool_sizes_are_refused():
    with pytest.raises(ValueError, match="n_blocks >= 1"):
        BlockPool(n_layers=1, n_kv_heads=1, head_dim=2, n_blocks=0)
