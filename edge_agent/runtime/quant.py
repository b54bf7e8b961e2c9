"""numpy dequantization kernels for some GGML tensor types (their names and sizes, and those of
all the others, are in `runtime/ggml_types.py`, re-exported here).

Invariants: a quantized tensor's row length is a multiple of its block size; every kernel takes
the raw bytes of whole blocks and returns float32 of exactly `n_elements` values, in GGML order
(element j of a 32-wide Q4 block is the low nibble of byte j, element j+16 its high nibble).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from numpy.typing import NDArray

from edge_agent.runtime.ggml_types import (
    ALL_TYPES,
    GGMLType,
    tensor_nbytes,
    type_info,
    type_name,
)

__all__ = ["ALL_TYPES", "GGMLType", "KERNELS", "TYPES", "dequantize", "tensor_nbytes",
           "type_by_id", "type_info", "type_name"]


# `own: np.ndarray = x.copy()` below: numpy's stubs type copy() as returning `Self`, which is Any
# when read as Python 3.10's; the annotation keeps the array type.

def _scale(blocks: np.ndarray, start: int) -> NDArray[np.float32]:
    # (n, 2) bytes -> (n, 1) f32 from an f16 field
    own: np.ndarray = blocks[:, start : start + 2].copy()
    return own.view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    # (n, 16) uint8 -> (n, 32): low nibbles first, then high nibbles
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _f32(blocks: np.ndarray) -> np.ndarray:
    own: np.ndarray = blocks.copy()
    return own.view(np.float32)


def _f16(blocks: np.ndarray) -> np.ndarray:
    own: np.ndarray = blocks.copy()
    return own.view(np.float16).astype(np.float32)


def _bf16(blocks: np.ndarray) -> np.ndarray:
    own: np.ndarray = blocks.copy()
    return (own.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def _q8_0(blocks: np.ndarray) -> np.ndarray:
    d = _scale(blocks, 0)  # (n, 1)
    q = blocks[:, 2:34].view(np.int8).astype(np.float32)  # (n, 32)
    return q * d


def _q4_0(blocks: np.ndarray) -> np.ndarray:
    d = _scale(blocks, 0)
    q = _nibbles(blocks[:, 2:18]).astype(np.int8) - 8  # (n, 32)
    return q.astype(np.float32) * d


def _q4_1(blocks: np.ndarray) -> np.ndarray:
    d = _scale(blocks, 0)
    m = _scale(blocks, 2)
    q = _nibbles(blocks[:, 4:20]).astype(np.float32)  # (n, 32)
    return q * d + m


def _high_bits(qh: np.ndarray) -> np.ndarray:
    # (n, 4) uint8 little-endian u32 -> (n, 32) bits, bit j is element j's fifth bit
    own: np.ndarray = qh.copy()
    bits = own.view("<u4")  # (n, 1)
    return ((bits >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4


def _q5_0(blocks: np.ndarray) -> np.ndarray:
    d = _scale(blocks, 0)
    q5: NDArray[np.uint8] = _nibbles(blocks[:, 6:22]) | _high_bits(blocks[:, 2:6])  # (n, 32)
    q = q5.astype(np.int8) - 16
    return q.astype(np.float32) * d


def _q5_1(blocks: np.ndarray) -> np.ndarray:
    d = _scale(blocks, 0)
    m = _scale(blocks, 2)
    q5: NDArray[np.uint8] = _nibbles(blocks[:, 8:24]) | _high_bits(blocks[:, 4:8])  # (n, 32)
    q = q5.astype(np.float32)
    return q * d + m


# uint8 blocks (n, block_bytes) -> f32 (n, block_elems), by type id
KERNELS: dict[int, Callable[[np.ndarray], np.ndarray]] = {
    0: _f32, 1: _f16, 2: _q4_0, 3: _q4_1, 6: _q5_0, 7: _q5_1, 8: _q8_0, 30: _bf16,
}
# the types this module can dequantize
TYPES: dict[int, GGMLType] = {i: ALL_TYPES[i] for i in KERNELS}


def type_by_id(type_id: int) -> GGMLType | None:
    """The type if this module can dequantize it, else None (see `type_info` for sizes)."""
    return TYPES.get(type_id)


def dequantize(
    raw: np.ndarray | memoryview | bytes, ggml_type: GGMLType, n_elements: int
) -> np.ndarray:
    """Raw bytes of a tensor -> flat float32 array of n_elements (a new array)."""
    buf = np.frombuffer(raw, dtype=np.uint8)
    n_blocks = n_elements // ggml_type.block_elems
    blocks = buf[: n_blocks * ggml_type.block_bytes].reshape(n_blocks, ggml_type.block_bytes)
    return KERNELS[ggml_type.id](blocks).reshape(n_elements)
