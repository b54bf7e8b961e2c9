"""GGUF reader over a read-only mapping we own.

Layout (GGUF v2/v3, little-endian): magic b"GGUF", u32 version, u64 tensor_count, u64 kv_count,
kv_count × (string key, u32 value_type, value), tensor_count × (string name, u32 n_dims,
n_dims × u64 ne (innermost first), u32 ggml_type, u64 offset), padding to `general.alignment`
(default 32), then tensor data; each tensor's offset is relative to the data start.

Invariants: every read is bounds-checked against the file size, so a truncated file raises
ModelFileError naming the file and what was being read, never IndexError or struct.error.
A length or count is checked against the bytes left before anything is allocated for it (a
2^60-byte string or a 2^60-element array is refused, not attempted); nested arrays (llama.cpp
refuses them too), more than 4 dimensions and a non-integer alignment are refused; a refused
file leaves no mapping open. (tests/test_fuzz_files.py)
Tensor shapes are exposed in numpy order (outermost first, the reverse of GGUF's `ne`).
The mapping stays open for the life of the GGUFFile; views into it are zero-copy.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edge_agent.errors import ModelFileError
from edge_agent.filekind import not_regular
from edge_agent.runtime import ggml_types

if TYPE_CHECKING:
    import numpy as np

__all__ = ["GGUFFile", "TensorInfo", "SkippedStrings", "GGUF_MAGIC", "DEFAULT_ALIGNMENT"]

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
_SUPPORTED_VERSIONS = (2, 3)

# value type id -> (struct format or None for string/array, size)
_SCALARS: dict[int, tuple[str, int]] = {
    0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4),
    6: ("<f", 4), 7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8),
}
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 4  # GGML_MAX_DIMS


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order
    type_id: int
    offset: int  # absolute offset in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        return ggml_types.type_name(self.type_id)

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class SkippedStrings:
    """A metadata array of strings read with `string_arrays=False`: only its length (a
    vocabulary's 50k-260k strings take 0.1-0.5 s to build in Python; the memory budget needs
    only how many there are)."""

    count: int

    def __len__(self) -> int:
        return self.count


_LENGTH = struct.Struct("<Q")


class _Cursor:
    def __init__(self, buf: mmap.mmap, path: Path, *, string_arrays: bool = True) -> None:
        self.buf, self.path, self.pos, self.size = buf, path, 0, len(buf)
        self.string_arrays = string_arrays

    def skip_strings(self, count: int, key: str) -> SkippedStrings:
        """Step over `count` strings, each length checked against the file as `string`
        checks it (the same errors, without building the strings)."""
        what = f"element of {key!r}"
        unpack, buf, size, pos = _LENGTH.unpack_from, self.buf, self.size, self.pos
        for _ in range(count):  # locals: 3x faster over a 50k-260k vocabulary
            if pos + 8 > size:
                self.pos = pos
                self.need(8, f"{what} length")
            n = unpack(buf, pos)[0]
            pos += 8
            if pos + n > size:
                self.pos = pos
                self.need(n, what)
            pos += n
        self.pos = pos
        return SkippedStrings(count)

    def need(self, n: int, what: str) -> None:
        """Raise unless `n` more bytes are in the file (nothing read or allocated)."""
        if n < 0 or self.pos + n > self.size:
            raise ModelFileError(
                f"{self.path}: truncated GGUF file: reading {what} needs {n} bytes at offset "
                f"{self.pos}, but the file is {self.size} bytes. "
                "Hint: the download or copy was cut short; fetch the file again."
            )

    def take(self, n: int, what: str) -> memoryview:
        self.need(n, what)
        view = memoryview(self.buf)[self.pos : self.pos + n]
        self.pos += n
        return view

    def scalar(self, type_id: int, what: str) -> Any:
        fmt, size = _SCALARS[type_id]
        return struct.unpack(fmt, self.take(size, what))[0]

    def string(self, what: str) -> str:
        n = self.scalar(10, f"{what} length")
        raw = bytes(self.take(n, what))
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return raw.decode("utf-8", errors="replace")

    def value(self, type_id: int, key: str) -> Any:
        if type_id in _SCALARS:
            return self.scalar(type_id, f"value of {key!r}")
        if type_id == _STRING:
            return self.string(f"value of {key!r}")
        if type_id == _ARRAY:
            elem = self.scalar(4, f"array type of {key!r}")
            count = self.scalar(10, f"array length of {key!r}")
            if elem in _SCALARS:
                fmt, size = _SCALARS[elem]
                raw = self.take(count * size, f"array {key!r}")
                return list(struct.unpack(f"<{count}{fmt[1]}", raw))
            if elem != _STRING:  # llama.cpp refuses nested arrays too; no unbounded recursion
                raise ModelFileError(
                    f"{self.path}: metadata key {key!r} is an array of element type {elem} "
                    f"({'nested arrays' if elem == _ARRAY else 'unknown'}) at offset "
                    f"{self.pos}. Hint: the file is corrupt or from a newer GGUF version."
                )
            # each string takes at least its 8-byte length: a count the file cannot hold is
            # refused before a list is built for it
            self.need(count * 8, f"array {key!r} of {count} strings")
            if not self.string_arrays:
                return self.skip_strings(count, key)
            return [self.string(f"element of {key!r}") for _ in range(count)]
        raise ModelFileError(
            f"{self.path}: metadata key {key!r} has unknown value type {type_id} at offset "
            f"{self.pos}. Hint: the file is corrupt or from a newer GGUF version."
        )


class GGUFFile:
    """An open GGUF file: `metadata`, `tensors` (name -> TensorInfo), zero-copy raw views."""

    def __init__(self, path: str | os.PathLike[str], *, string_arrays: bool = True) -> None:
        """`string_arrays=False`: arrays of strings in the metadata (the vocabulary, its
        merges) are checked and skipped, and read as `SkippedStrings` (their length)."""
        self.path = Path(path)
        self._string_arrays = string_arrays
        wrong = not_regular(self.path)  # stat only: a FIFO is never opened (it would block)
        if wrong is not None and wrong.startswith("is "):  # missing: the open says so
            raise ModelFileError(
                f"{self.path}: {wrong}. "
                "Hint: check the path given with --model or in the config; it must be a "
                ".gguf weights file."
            )
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError as exc:
            raise ModelFileError(
                f"{self.path}: cannot open model file: {exc.strerror}. "
                "Hint: check the path given with --model or in the config."
            ) from exc
        try:
            self.size = os.fstat(fd).st_size
            if self.size < 24:
                head = os.pread(fd, 4, 0)
                self._check_magic(head)
                raise ModelFileError(
                    f"{self.path}: truncated GGUF file ({self.size} bytes, the header alone "
                    "is 24). Hint: fetch the file again."
                )
            self._map = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        try:
            self._parse()
        except BaseException:
            self._map.close()  # a refused file leaves no mapping behind
            raise

    def _check_magic(self, head: bytes) -> None:
        if head[:4] != GGUF_MAGIC:
            raise ModelFileError(
                f"{self.path}: not a GGUF file (magic {bytes(head[:4])!r}, expected "
                f"{GGUF_MAGIC!r}). Hint: pass the .gguf weights file, not a prepared or "
                "other file."
            )

    def _parse(self) -> None:
        cur = _Cursor(self._map, self.path, string_arrays=self._string_arrays)
        self._check_magic(bytes(cur.take(4, "magic")))
        self.version = cur.scalar(4, "version")
        if self.version not in _SUPPORTED_VERSIONS:
            raise ModelFileError(
                f"{self.path}: GGUF version {self.version} is not supported (supported: "
                f"{', '.join(map(str, _SUPPORTED_VERSIONS))}). Hint: convert it with a current "
                "llama.cpp `convert_hf_to_gguf.py`."
            )
        n_tensors = cur.scalar(10, "tensor count")
        n_kv = cur.scalar(10, "metadata count")
        metadata: dict[str, Any] = {}
        for i in range(n_kv):
            key = cur.string(f"metadata key #{i}")
            vtype = cur.scalar(4, f"value type of {key!r}")
            metadata[key] = cur.value(vtype, key)
        self.metadata: Mapping[str, Any] = metadata
        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if (not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0
                or alignment & (alignment - 1)):
            raise ModelFileError(
                f"{self.path}: general.alignment = {alignment!r:.40} is not a power of two. "
                "Hint: the file is corrupt."
            )
        self.alignment = alignment
        raw_infos = []
        for i in range(n_tensors):
            name = cur.string(f"tensor name #{i}")
            n_dims = cur.scalar(4, f"dimension count of {name!r}")
            if n_dims > _MAX_DIMS:
                raise ModelFileError(
                    f"{self.path}: tensor {name!r} has dimension count {n_dims}, more than "
                    f"GGML's {_MAX_DIMS}. Hint: the file is corrupt."
                )
            ne = [cur.scalar(10, f"dimension of {name!r}") for _ in range(n_dims)]
            type_id = cur.scalar(4, f"type of {name!r}")
            offset = cur.scalar(10, f"offset of {name!r}")
            raw_infos.append((name, tuple(reversed(ne)), type_id, offset))
        self.data_offset = -(-cur.pos // self.alignment) * self.alignment
        tensors: dict[str, TensorInfo] = {}
        for name, shape, type_id, offset in raw_infos:
            n = 1
            for d in shape:
                n *= d
            gtype = ggml_types.type_info(type_id)  # any GGML type: its size, dequantizable or not
            if gtype is None:
                nbytes = 0  # not a GGML type: unknown size; refused when the tensor is read
            else:
                if n % gtype.block_elems:
                    raise ModelFileError(
                        f"{self.path}: tensor {name!r} of type {gtype.name} has {n} elements, "
                        f"not a multiple of its block size {gtype.block_elems}. "
                        "Hint: the file is corrupt."
                    )
                nbytes = ggml_types.tensor_nbytes(gtype, n)
            start = self.data_offset + offset
            if start + nbytes > self.size:
                raise ModelFileError(
                    f"{self.path}: truncated GGUF file: tensor {name!r} needs bytes "
                    f"{start}..{start + nbytes} but the file is {self.size} bytes. "
                    "Hint: the download or copy was cut short; fetch the file again."
                )
            tensors[name] = TensorInfo(name, shape, type_id, start, nbytes)
        self.tensors: Mapping[str, TensorInfo] = tensors

    # -- access ---------------------------------------------------------------------------

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a zero-copy read-only uint8 view of the mapping."""
        import numpy as np  # here, not above: reading metadata needs no numpy

        info = self._info(name)
        return np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=info.offset)

    def dequantize(self, name: str) -> np.ndarray:
        """The tensor as a new float32 array in numpy shape."""
        from edge_agent.runtime import quant

        info = self._info(name)
        gtype = quant.type_by_id(info.type_id)
        assert gtype is not None
        return quant.dequantize(self.raw(name), gtype, info.n_elements).reshape(info.shape)

    def _info(self, name: str) -> TensorInfo:
        from edge_agent.runtime import quant

        try:
            info = self.tensors[name]
        except KeyError:
            raise ModelFileError(
                f"{self.path}: no tensor named {name!r} ({len(self.tensors)} tensors). "
                "Hint: the file is not the architecture the config says it is."
            ) from None
        if quant.type_by_id(info.type_id) is None:
            supported = ", ".join(t.name for t in quant.TYPES.values())
            raise ModelFileError(
                f"{self.path}: tensor {name!r} has quantization {info.type_name}, which "
                f"edge-agent cannot dequantize (supported: {supported}). Hint: re-quantize "
                "the model to Q4_0, Q4_1, Q8_0 or F16 with llama.cpp's llama-quantize."
            )
        return info

    def close(self) -> None:
        self._map.close()

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
