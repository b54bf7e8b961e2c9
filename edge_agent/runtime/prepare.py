"""Prepared weights: a GGUF dequantized once into a page-aligned file that serving maps as is.

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
- A prepared file is keyed by its source's sha256 (`<state>/models/<sha256[:16]>-<dtype>.weights`)
  and records the full sha256 and size; a file whose record does not match its source is an
  error, never silently used.
- Writing goes to a temp file in the same directory (`.<name>.<pid>.<random>.tmp`), is fsynced,
  then renamed, then the directory is fsynced: a crash never leaves a partial file under the
  final name; temp files of dead processes are removed by the next prepare.
- Dequantization runs a chunk of at most CHUNK_BYTES of output at a time: the full f32 model is
  never held in memory, only in the page cache of the file being written.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import struct
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edge_agent.errors import ConfigError, EdgeAgentError, ModelFileError
from edge_agent.runtime import quant
from edge_agent.runtime.gguf import GGUFFile

__all__ = [
    "MAGIC",
    "FORMAT_VERSION",
    "ALIGNMENT",
    "DTYPES",
    "PreparedTensor",
    "PreparedInfo",
    "prepared_path",
    "source_sha256",
    "prepared_size",
    "find_prepared",
    "prepare_model",
]

MAGIC = b"EAWEIGHT"
FORMAT_VERSION = 1
ALIGNMENT = 4096
DTYPES = {"f32": np.dtype("<f4"), "f16": np.dtype("<f2")}
CHUNK_BYTES = 8 * 1024 * 1024
_FIXED = struct.Struct("<8sIIQ")  # magic, version, crc32, json length
_FORMAT_NAME = "edge-agent-prepared-weights"
_FORCE_HINT = "Hint: run `edge-agent model prepare --force` to rebuild it from its source."

Progress = Callable[[int, int], None]


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
        return int(np.prod(self.shape, dtype=np.int64)) * DTYPES[self.dtype].itemsize


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
                    raise _bad(path, f"truncated: {size} bytes, the fixed header alone is "
                               f"{_FIXED.size}")
                magic, version, crc, n = _FIXED.unpack(fixed)
                _check_magic(path, magic)
                if version != FORMAT_VERSION:
                    raise _bad(path, f"format version {version}, this edge-agent reads "
                               f"version {FORMAT_VERSION}")
                if _FIXED.size + n > size:
                    raise _bad(path, f"truncated: the JSON header needs {n} bytes at offset "
                               f"{_FIXED.size} but the file is {size} bytes")
                raw = f.read(n)
        except OSError as exc:
            raise ModelFileError(
                f"{path}: cannot read prepared weights file: {exc.strerror}. {_FORCE_HINT}"
            ) from exc
        if zlib.crc32(raw) != crc:
            raise _bad(path, "header checksum mismatch (the JSON header is corrupt)")
        try:
            header = json.loads(raw.decode("utf-8"))
            info = cls._from_header(path, version, n, header)
        except ModelFileError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise _bad(path, f"malformed JSON header ({type(exc).__name__}: {exc})") from None
        if size != info.file_size:
            raise _bad(path, f"size is {size} bytes but its header describes "
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
                raise _bad(path, f"tensor {name!r} at data offset {rel} is not aligned to "
                           f"{ALIGNMENT} bytes")
            if rel + tensor.nbytes > data_bytes:
                raise _bad(path, f"tensor {name!r} needs data bytes {rel}..{rel + tensor.nbytes}"
                           f" but the data area is {data_bytes} bytes")
            tensors[name] = tensor
        src = h["source"]
        return cls(path, version, h["dtype"], str(src["sha256"]), int(src["size"]),
                   str(src["name"]), dict(h["metadata"]), tensors, data_offset, data_bytes)


def _bad(path: Path, what: str) -> ModelFileError:
    return ModelFileError(f"{path}: not a usable prepared weights file: {what}. {_FORCE_HINT}")


def _check_magic(path: Path, head: bytes) -> None:
    if head[: len(MAGIC)] != MAGIC:
        raise ModelFileError(
            f"{path}: not a prepared weights file (magic {bytes(head[:8])!r}, expected "
            f"{MAGIC!r}). Hint: pass a file made by `edge-agent model prepare`; a .gguf goes "
            "to `model prepare`, not to the weights loader."
        )


# -- source identity ---------------------------------------------------------------------------

_SHA_CACHE: dict[tuple[int, int, int, int], str] = {}


def source_sha256(src: str | os.PathLike[str]) -> str:
    """Hex sha256 of a file, cached in-process by (device, inode, size, mtime)."""
    try:
        st = os.stat(src)
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        if key not in _SHA_CACHE:
            h = hashlib.sha256()
            with open(src, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
            _SHA_CACHE[key] = h.hexdigest()
    except OSError as exc:
        raise ModelFileError(
            f"{src}: cannot read model file: {exc.strerror}. "
            "Hint: check the path given with --model or in the config."
        ) from exc
    return _SHA_CACHE[key]


def prepared_path(state_dir: str | os.PathLike[str], sha256: str, dtype: str) -> Path:
    """Where the prepared file for a source with this sha256 lives."""
    _check_dtype(dtype)
    return Path(state_dir) / "models" / f"{sha256[:16]}-{dtype}.weights"


def _check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise ConfigError(
            f"prepared weights dtype {dtype!r} is not supported. Hint: use one of "
            f"{', '.join(DTYPES)} (f32 is the default; f16 halves memory)."
        )


# -- layout ------------------------------------------------------------------------------------


def _tensor_dtype(shape: tuple[int, ...], dtype: str) -> str:
    return dtype if len(shape) >= 2 else "f32"


def _layout(g: GGUFFile, dtype: str, sha256: str) -> tuple[bytes, list[PreparedTensor], int]:
    """(fixed header + JSON + padding, tensors with absolute offsets, total file size)."""
    entries: dict[str, dict[str, Any]] = {}
    rel = 0
    for name, info in g.tensors.items():
        tdtype = _tensor_dtype(info.shape, dtype)
        entries[name] = {"offset": rel, "shape": list(info.shape), "dtype": tdtype,
                         "source_type": info.type_name}
        rel = _align(rel + info.n_elements * DTYPES[tdtype].itemsize)
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


def prepared_size(g: GGUFFile, dtype: str = "f32") -> int:
    """Size in bytes the prepared file of `g` would have with this dtype."""
    _check_dtype(dtype)
    return _layout(g, dtype, "0" * 64)[2]


# -- finding and preparing --------------------------------------------------------------------


def find_prepared(src: str | os.PathLike[str], state_dir: str | os.PathLike[str],
                  dtype: str = "f32") -> Path | None:
    """The valid prepared file of `src` in `state_dir`, None if there is none yet.

    Raises ModelFileError when a file exists under the key but is corrupt or was made from a
    different source (sha256/size mismatch) or with another dtype.
    """
    sha = source_sha256(src)
    path = prepared_path(state_dir, sha, dtype)
    if not path.exists():
        return None
    info = PreparedInfo.read(path)
    size = os.stat(src).st_size
    if (info.source_sha256, info.source_size) != (sha, size) or info.dtype != dtype:
        raise _bad(path, f"it was prepared from sha256 {info.source_sha256[:16]}... "
                   f"({info.source_size} bytes, dtype {info.dtype}) but its source {src} has "
                   f"sha256 {sha[:16]}... ({size} bytes, dtype {dtype} wanted)")
    return path


def prepare_model(src: str | os.PathLike[str], state_dir: str | os.PathLike[str], *,
                  dtype: str = "f32", progress: Progress | None = None,
                  force: bool = False) -> Path:
    """Dequantize `src` into `<state>/models/<sha256[:16]>-<dtype>.weights`; return its path.

    An existing valid file is reused (progress is not called); an existing invalid one raises
    ModelFileError unless `force`. `progress(done_bytes, total_bytes)` follows the writing.
    """
    _check_dtype(dtype)
    src = Path(src)
    g = GGUFFile(src)
    try:
        _check_types(g)
        if not force:
            found = find_prepared(src, state_dir, dtype)
            if found is not None:
                return found
        sha = source_sha256(src)
        final = prepared_path(state_dir, sha, dtype)
        head, tensors, total = _layout(g, dtype, sha)
        _write(g, final, head, tensors, total, progress)
        return final
    finally:
        try:
            g.close()
        except BufferError:  # a view is still referenced by an exception traceback
            pass


def _check_types(g: GGUFFile) -> None:
    for info in g.tensors.values():
        if quant.type_by_id(info.type_id) is None:
            supported = ", ".join(t.name for t in quant.TYPES.values())
            raise ModelFileError(
                f"{g.path}: tensor {info.name!r} has quantization {info.type_name}, which "
                f"edge-agent cannot dequantize (supported: {supported}). Hint: re-quantize the "
                "model to Q4_0, Q4_1, Q8_0 or F16 with llama.cpp's llama-quantize."
            )


def _write(g: GGUFFile, final: Path, head: bytes, tensors: list[PreparedTensor], total: int,
           progress: Progress | None) -> None:
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(final.parent).free
    except OSError as exc:
        raise EdgeAgentError(
            f"{final.parent}: cannot create the prepared weights directory: {exc.strerror}. "
            "Hint: check --state-dir and its permissions."
        ) from exc
    if free < total:
        raise EdgeAgentError(
            f"{final.parent}: {free:,} bytes free, the prepared weights need {total:,}. "
            "Hint: free space, choose another --state-dir, or use --dtype f16 (half the size)."
        )
    _remove_stale_temps(final)
    tmp = final.with_name(f".{final.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        os.ftruncate(fd, total)
        _pwrite_all(fd, head, 0)
        weight_total = sum(t.nbytes for t in tensors)
        done = 0
        if progress:
            progress(0, weight_total)
        for t in tensors:
            done = _write_tensor(g, fd, t, done, weight_total, progress)
        os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(tmp, final)
        dfd = os.open(final.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError as exc:
        raise EdgeAgentError(
            f"{tmp}: writing prepared weights failed: {exc.strerror}. Hint: check free space "
            "and permissions of the state directory, then run `edge-agent model prepare` again."
        ) from exc
    finally:
        if fd >= 0:
            os.close(fd)
        if tmp.exists():
            tmp.unlink()


def _remove_stale_temps(final: Path) -> None:
    """Delete temp files of `final` left by preparing processes that no longer exist."""
    for tmp in final.parent.glob(f".{final.name}.*.tmp"):
        try:
            pid = int(tmp.name[len(final.name) + 2 :].split(".")[0])
            os.kill(pid, 0)
        except ProcessLookupError:
            tmp.unlink(missing_ok=True)
        except (ValueError, PermissionError):
            continue  # not ours, or another user's live process


def _write_tensor(g: GGUFFile, fd: int, t: PreparedTensor, done: int, total: int,
                  progress: Progress | None) -> int:
    info = g.tensors[t.name]
    gtype = quant.type_by_id(info.type_id)
    assert gtype is not None
    out_dtype = DTYPES[t.dtype]
    raw = g.raw(t.name)
    n_blocks = info.n_elements // gtype.block_elems
    step = max(1, CHUNK_BYTES // (gtype.block_elems * 4))  # blocks per chunk
    pos = t.offset
    for first in range(0, n_blocks, step):
        count = min(step, n_blocks - first)
        part = raw[first * gtype.block_bytes : (first + count) * gtype.block_bytes]
        values = quant.dequantize(part, gtype, count * gtype.block_elems)
        if out_dtype != values.dtype:
            with np.errstate(over="ignore"):
                converted = values.astype(out_dtype)
            bad = ~np.isfinite(converted) & np.isfinite(values)
            if bad.any():
                raise ModelFileError(
                    f"{g.path}: tensor {t.name!r} holds values up to "
                    f"{float(np.abs(values[bad]).max()):g}, beyond float16's range (65504). "
                    "Hint: prepare this model with --dtype f32."
                )
            values = converted
        _pwrite_all(fd, memoryview(values).cast("B"), pos)
        pos += values.nbytes
        done += values.nbytes
        if progress:
            progress(done, total)
    return done


def _pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n
