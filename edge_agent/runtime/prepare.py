"""Prepared weights: a GGUF dequantized once into a page-aligned file that serving maps as is.

The file format (layout, header, reading): runtime/prepared_format.py.

Invariants owned here:
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
import os
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np

from edge_agent.errors import ConfigError, EdgeAgentError, ModelFileError
from edge_agent.paths import fsync_dir
from edge_agent.runtime import quant
from edge_agent.runtime.gguf import GGUFFile
from edge_agent.runtime.prepared_format import (
    ALIGNMENT,
    DTYPES,
    FORMAT_VERSION,
    MAGIC,
    PreparedInfo,
    PreparedTensor,
    bad_prepared,
    encode_layout,
)

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

CHUNK_BYTES = 8 * 1024 * 1024  # dequantized output per chunk while writing


Progress = Callable[[int, int], None]


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


def prepared_size(g: GGUFFile, dtype: str = "f32") -> int:
    """Size in bytes the prepared file of `g` would have with this dtype."""
    _check_dtype(dtype)
    return encode_layout(g, dtype, "0" * 64)[2]


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
        raise bad_prepared(path, f"it was prepared from sha256 {info.source_sha256[:16]}... "
                                 f"({info.source_size} bytes, dtype {info.dtype}) but its "
                                 f"source {src} has sha256 {sha[:16]}... ({size} bytes, "
                                 f"dtype {dtype} wanted)")
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
        head, tensors, total = encode_layout(g, dtype, sha)
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
        fsync_dir(final.parent)
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
    out_dtype = np.dtype(DTYPES[t.dtype])
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
        _pwrite_all(fd, values.data.cast("B"), pos)
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
