"""The prepared weights file format: its layout, reading and validating a header, and
laying out a new one (runtime/prepare.py writes the file).

File layout (all integers little-endian), format version 1:

    offset 0    8 bytes   magic b"EAWEIGHT"
    offset 8    u32       format version (1)
    offset 12   u32       CRC-32 of the JSON header bytes
    offset 16   u64       length n of the JSON header in bytes
    offset 24   n bytes   JSON header, UTF-8 (see below)
    ...                   zero padding up to data_offset = 24 + n rounded up to 4096
    data_offset ...       tensor data, each tensor C-contiguous at data_offset + its "offset"

JSON header: {"format": "edge-agent-prepared-weights", "dtype": "f32"|"f16",
"alignment": 4096, "data_bytes": D, "source": {"sha256", "size", "name"},
"metadata": {the source GGUF's metadata, tokenizer arrays included},
"tensors": {gguf name: {"offset" (relative to data_offset), "shape" (numpy order),
"dtype" ("f32"|"f16"), "source_type" (GGML type name)}}}.

Invariants owned here:
- Every tensor offset is a multiple of ALIGNMENT (4096) and the file size is exactly
  data_offset + data_bytes (data_bytes is itself a multiple of 4096); `PreparedInfo.read`
  checks magic, version, CRC, size and that each tensor lies in bounds before anyone maps it.
- The requested dtype applies to tensors of 2 or more dimensions; vectors (norms, biases) are
  always stored as f32, since they are tiny and f16 would cost precision for nothing.
"""

from __future__ import annotations

import json
import math
import os
import struct
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edge_agent.errors import ModelFileError
from edge_agent.runtime.gguf import GGUFFile

__all__ = [
    "MAGIC", "FORMAT_VERSION", "ALIGNMENT", "DTYPES", "DTYPE_BYTES", "PreparedTensor",
    "PreparedInfo",
    "bad_prepared", "encode_layout",
]

MAGIC = b"EAWEIGHT"
FORMAT_VERSION = 1
ALIGNMENT = 4096
# prepared dtype -> numpy dtype string, and its bytes per element (no numpy import here:
# the CLI and the control plane read these without the numpy they never compute with)
DTYPES: dict[str, str] = {"f32": "<f4", "f16": "<f2"}
DTYPE_BYTES: dict[str, int] = {"f32": 4, "f16": 2}
_FIXED = struct.Struct("<8sIIQ")  # magic, version, crc32, json length
_FORMAT_NAME = "edge-agent-prepared-weights"
_FORCE_HINT = "Hint: run `edge-agent model prepare --force` to rebuild it from its source."


def _align(n: int) -> int:
    return -(-n // ALIGNMENT) * ALIGNMENT


@dataclass(frozen=True)
class PreparedTensor:
    name: str
    offset: int  # absolute offset in the prepared file
    shape: tuple[int, ...]  # numpy order
    dtype: str  # "f32" or "f16"
    source_type: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class PreparedInfo:
    """The validated header of a prepared weights file (no tensor data is read)."""

    path: Path
    version: int
    dtype: str
    source_sha256: str
    source_size: int
    source_name: str
    metadata: Mapping[str, Any]
    tensors: Mapping[str, PreparedTensor]
    data_offset: int
    data_bytes: int

    @property
    def file_size(self) -> int:
        return self.data_offset + self.data_bytes

    @property
    def weight_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> PreparedInfo:
        """Read and validate the header of `path`; ModelFileError names the file and fault."""
        path = Path(path)
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                fixed = f.read(_FIXED.size)
                if len(fixed) < _FIXED.size:
                    _check_magic(path, fixed)
                    raise bad_prepared(path, f"truncated: {size} bytes, the fixed header alone is "
                                             f"{_FIXED.size}")
                magic, version, crc, n = _FIXED.unpack(fixed)
                _check_magic(path, magic)
                if version != FORMAT_VERSION:
                    raise bad_prepared(path, f"format version {version}, this edge-agent reads "
                                             f"version {FORMAT_VERSION}")
                if _FIXED.size + n > size:
                    raise bad_prepared(path, f"truncated: the JSON header needs {n} bytes at "
                                             f"offset {_FIXED.size} but the file is {size} bytes")
                raw = f.read(n)
        except OSError as exc:
            raise ModelFileError(
                f"{path}: cannot read prepared weights file: {exc.strerror}. {_FORCE_HINT}"
            ) from exc
        if zlib.crc32(raw) != crc:
            raise bad_prepared(path, "header checksum mismatch (the JSON header is corrupt)")
        try:
            header = json.loads(raw.decode("utf-8"))
            info = cls._from_header(path, version, n, header)
        except ModelFileError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise bad_prepared(path, f"malformed JSON header ({type(exc).__name__}: "
                                     f"{exc})") from None
        if size != info.file_size:
            raise bad_prepared(path, f"size is {size} bytes but its header describes "
                                     f"{info.file_size} bytes (truncated or overwritten)")
        return info

    @classmethod
    def _from_header(cls, path: Path, version: int, n: int, h: dict[str, Any]) -> PreparedInfo:
        if h["format"] != _FORMAT_NAME or h["dtype"] not in DTYPES:
            raise ValueError(f"format {h['format']!r}, dtype {h['dtype']!r}")
        if int(h["alignment"]) != ALIGNMENT:
            raise ValueError(f"alignment {h['alignment']}")
        data_offset = _align(_FIXED.size + n)
        data_bytes = int(h["data_bytes"])
        tensors: dict[str, PreparedTensor] = {}
        for name, t in h["tensors"].items():
            rel = int(t["offset"])
            tensor = PreparedTensor(name, data_offset + rel, tuple(int(d) for d in t["shape"]),
                                    t["dtype"], str(t["source_type"]))
            if t["dtype"] not in DTYPES or any(d < 0 for d in tensor.shape):
                raise ValueError(f"tensor {name!r}: dtype {t['dtype']!r}, shape {tensor.shape}")
            if rel < 0 or rel % ALIGNMENT:
                raise bad_prepared(path, f"tensor {name!r} at data offset {rel} is not aligned to "
                                         f"{ALIGNMENT} bytes")
            if rel + tensor.nbytes > data_bytes:
                raise bad_prepared(path, f"tensor {name!r} needs data bytes "
                                         f"{rel}..{rel + tensor.nbytes} but the data area is "
                                         f"{data_bytes} bytes")
            tensors[name] = tensor
        src = h["source"]
        return cls(path, version, h["dtype"], str(src["sha256"]), int(src["size"]),
                   str(src["name"]), dict(h["metadata"]), tensors, data_offset, data_bytes)


def bad_prepared(path: Path, what: str) -> ModelFileError:
    return ModelFileError(f"{path}: not a usable prepared weights file: {what}. {_FORCE_HINT}")


def _check_magic(path: Path, head: bytes) -> None:
    if head[: len(MAGIC)] != MAGIC:
        raise ModelFileError(
            f"{path}: not a prepared weights file (magic {bytes(head[:8])!r}, expected "
            f"{MAGIC!r}). Hint: pass a file made by `edge-agent model prepare`; a .gguf goes "
            "to `model prepare`, not to the weights loader."
        )


def _tensor_dtype(shape: tuple[int, ...], dtype: str) -> str:
    return dtype if len(shape) >= 2 else "f32"


def encode_layout(g: GGUFFile, dtype: str, sha256: str) -> tuple[bytes, list[PreparedTensor], int]:
    """(fixed header + JSON + padding, tensors with absolute offsets, total file size)."""
    entries: dict[str, dict[str, Any]] = {}
    rel = 0
    for name, info in g.tensors.items():
        tdtype = _tensor_dtype(info.shape, dtype)
        entries[name] = {"offset": rel, "shape": list(info.shape), "dtype": tdtype,
                         "source_type": info.type_name}
        rel = _align(rel + info.n_elements * DTYPE_BYTES[tdtype])
    header = {
        "format": _FORMAT_NAME, "dtype": dtype, "alignment": ALIGNMENT, "data_bytes": rel,
        "source": {"sha256": sha256, "size": g.size, "name": g.path.name},
        "metadata": dict(g.metadata), "tensors": entries,
    }
    raw = json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    data_offset = _align(_FIXED.size + len(raw))
    head = _FIXED.pack(MAGIC, FORMAT_VERSION, zlib.crc32(raw), len(raw)) + raw
    head += bytes(data_offset - len(head))
    tensors = [PreparedTensor(n, data_offset + e["offset"], tuple(e["shape"]), e["dtype"],
                              e["source_type"]) for n, e in entries.items()]
    return head, tensors, data_offset + rel
