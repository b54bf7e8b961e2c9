"""GGML tensor types: names and sizes of all of them, numpy dequantization kernels for some.

Invariants: a quantized tensor's row length is a multiple of its block size; every kernel takes
the raw bytes of whole blocks and returns float32 of exactly `n_elements` values, in GGML order
(element j of a 32-wide Q4 block is the low nibble of byte j, element j+16 its high nibble).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

__all__ = ["ALL_TYPES", "GGMLType", "TYPES", "dequantize", "tensor_nbytes", "type_by_id",
           "type_info", "type_name"]


@dataclass(frozen=True)
class GGMLType:
    id: int
    name: str
    block_elems: int
    block_bytes: int
    # uint8 blocks (n, block_bytes) -> f32 (n, block_elems)
    kernel: Callable[[np.ndarray], np.ndarray] | None


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


TYPES: dict[int, GGMLType] = {
    t.id: t
    for t in (
        GGMLType(0, "F32", 1, 4, _f32),
        GGMLType(1, "F16", 1, 2, _f16),
        GGMLType(2, "Q4_0", 32, 18, _q4_0),
        GGMLType(3, "Q4_1", 32, 20, _q4_1),
        GGMLType(6, "Q5_0", 32, 22, _q5_0),
        GGMLType(7, "Q5_1", 32, 24, _q5_1),
        GGMLType(8, "Q8_0", 32, 34, _q8_0),
        GGMLType(30, "BF16", 1, 2, _bf16),
    )
}

# Every type a GGUF may hold (ggml.h's enum ggml_type, ggml's block sizes): sizes only, so a
# file of any quantization opens, its tensors' bytes are bounds-checked and `model info` counts
# them; TYPES above is the subset this module can dequantize.
ALL_TYPES: dict[int, GGMLType] = {
    **{
        i: GGMLType(i, name, elems, nbytes, None)
        for i, name, elems, nbytes in (
            (9, "Q8_1", 32, 36), (10, "Q2_K", 256, 84), (11, "Q3_K", 256, 110),
            (12, "Q4_K", 256, 144), (13, "Q5_K", 256, 176), (14, "Q6_K", 256, 210),
            (15, "Q8_K", 256, 292), (16, "IQ2_XXS", 256, 66), (17, "IQ2_XS", 256, 74),
            (18, "IQ3_XXS", 256, 98), (19, "IQ1_S", 256, 50), (20, "IQ4_NL", 32, 18),
            (21, "IQ3_S", 256, 110), (22, "IQ2_S", 256, 82), (23, "IQ4_XS", 256, 136),
            (24, "I8", 1, 1), (25, "I16", 1, 2), (26, "I32", 1, 4), (27, "I64", 1, 8),
            (28, "F64", 1, 8), (29, "IQ1_M", 256, 56), (34, "TQ1_0", 256, 54),
            (35, "TQ2_0", 256, 66), (39, "MXFP4", 32, 17), (40, "NVFP4", 64, 36),
            (41, "Q1_0", 128, 18), (42, "Q2_0", 64, 18),
        )
    },
    **TYPES,
}


def type_by_id(type_id: int) -> GGMLType | None:
    """The type if this module can dequantize it, else None (see `type_info` for sizes)."""
    return TYPES.get(type_id)


def type_info(type_id: int) -> GGMLType | None:
    """Name and block size of any GGML type (kernel None where not dequantized), None if the
    id is not a GGML type."""
    return ALL_TYPES.get(type_id)


def type_name(type_id: int) -> str:
    t = ALL_TYPES.get(type_id)
    return t.name if t is not None else f"unknown type {type_id}"


def tensor_nbytes(ggml_type: GGMLType, n_elements: int) -> int:
    return n_elements // ggml_type.block_elems * ggml_type.block_bytes


def dequantize(
    raw: np.ndarray | memoryview | bytes, ggml_type: GGMLType, n_elements: int
) -> np.ndarray:
    """Raw bytes of a tensor -> flat float32 array of n_elements (a new array)."""
    buf = np.frombuffer(raw, dtype=np.uint8)
    n_blocks = n_elements // ggml_type.block_elems
    blocks = buf[: n_blocks * ggml_type.block_bytes].reshape(n_blocks, ggml_type.block_bytes)
    assert ggml_type.kernel is not None
    return ggml_type.kernel(blocks).reshape(n_elements)
