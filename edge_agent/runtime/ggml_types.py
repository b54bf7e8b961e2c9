"""GGML tensor types: the id, name and block size of every type a GGUF may hold.

Invariant: numpy-free, so reading a GGUF's metadata and tensor table (the control plane's
memory budget, `model info`) imports no numpy; `runtime/quant.py` adds the numpy kernels that
dequantize some of these types.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ALL_TYPES", "GGMLType", "tensor_nbytes", "type_info", "type_name"]


@dataclass(frozen=True)
class GGMLType:
    id: int
    name: str
    block_elems: int
    block_bytes: int


# ggml.h's enum ggml_type with ggml's block sizes: sizes only, so a file of any quantization
# opens, its tensors' bytes are bounds-checked and `model info` counts them.
ALL_TYPES: dict[int, GGMLType] = {
    i: GGMLType(i, name, elems, nbytes)
    for i, name, elems, nbytes in (
        (0, "F32", 1, 4), (1, "F16", 1, 2), (2, "Q4_0", 32, 18), (3, "Q4_1", 32, 20),
        (6, "Q5_0", 32, 22), (7, "Q5_1", 32, 24), (8, "Q8_0", 32, 34),
        (9, "Q8_1", 32, 36), (10, "Q2_K", 256, 84), (11, "Q3_K", 256, 110),
        (12, "Q4_K", 256, 144), (13, "Q5_K", 256, 176), (14, "Q6_K", 256, 210),
        (15, "Q8_K", 256, 292), (16, "IQ2_XXS", 256, 66), (17, "IQ2_XS", 256, 74),
        (18, "IQ3_XXS", 256, 98), (19, "IQ1_S", 256, 50), (20, "IQ4_NL", 32, 18),
        (21, "IQ3_S", 256, 110), (22, "IQ2_S", 256, 82), (23, "IQ4_XS", 256, 136),
        (24, "I8", 1, 1), (25, "I16", 1, 2), (26, "I32", 1, 4), (27, "I64", 1, 8),
        (28, "F64", 1, 8), (29, "IQ1_M", 256, 56), (30, "BF16", 1, 2), (34, "TQ1_0", 256, 54),
        (35, "TQ2_0", 256, 66), (39, "MXFP4", 32, 17), (40, "NVFP4", 64, 36),
        (41, "Q1_0", 128, 18), (42, "Q2_0", 64, 18),
    )
}


def type_info(type_id: int) -> GGMLType | None:
    """Name and block size of any GGML type, None if the id is not a GGML type."""
    return ALL_TYPES.get(type_id)


def type_name(type_id: int) -> str:
    t = ALL_TYPES.get(type_id)
    return t.name if t is not None else f"unknown type {type_id}"


def tensor_nbytes(ggml_type: GGMLType, n_elements: int) -> int:
    return n_elements // ggml_type.block_elems * ggml_type.block_bytes
