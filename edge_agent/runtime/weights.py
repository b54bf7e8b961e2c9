"""Serving weights: a prepared file mapped MAP_SHARED | MAP_POPULATE, viewed zero-copy, locked.

Invariants owned here:
- The prepared file's header is validated (PreparedInfo.read: magic, version, CRC, size, every
  tensor in bounds) before it is mapped; a mismatch with an expected source sha256 is an error.
- `tensors` are read-only numpy views into one mapping of the whole file: no copy, no conversion.
  Writing to them raises ValueError; the bytes are the page cache's (MAP_SHARED), so several
  runner processes serving the same model share one copy in RAM.
- The mapping is populated in the mmap call (MAP_POPULATE; `populate_s` times it) and the data
  area is locked with one mlock(2) (`lock_s`); afterwards VmLck is read from /proc/self/status.
- mlock policy: "required" refuses (MemoryLockError, the mapping is released) when the lock
  fails; "best-effort" serves unlocked and reports it loudly (a WARNING log record, which
  reaches stderr even when logging is not configured, and `lock.error`); "off" never locks.
- Lifetime: `close()` drops this object's views first, then unmaps (which also unlocks). If a
  caller still holds a tensor view, the kernel mapping cannot be closed under it (Python raises
  BufferError); `close()` then returns False and the mapping is unmapped when the last view is
  garbage collected. Drop references to `tensors` (e.g. the model object) before `close()`.
- Prepared files are replaced by rename, never rewritten in place, so a live mapping always sees
  a complete file.
"""

from __future__ import annotations

import logging
import mmap
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np

from edge_agent.errors import ConfigError, MemoryLockError, ModelFileError
from edge_agent.runtime import memlock
from edge_agent.runtime.memlock import MLOCK_POLICIES, MemlockEnv
from edge_agent.runtime.prepared_format import DTYPE_BYTES, DTYPES, PreparedInfo

__all__ = ["LockReport", "PinnedWeights", "MLOCK_POLICIES"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LockReport:
    """What pinning achieved. `vmlck_bytes` is process-wide (all locks of this process)."""

    policy: str
    locked: bool
    weight_bytes: int  # bytes of tensor data (what serving needs resident)
    locked_bytes: int  # bytes passed to mlock (the page-aligned data area); 0 if not locked
    vmlck_bytes: int | None  # VmLck after locking, None when /proc does not say
    error: str | None  # why locking failed (None if it succeeded or policy is "off")
    populate_s: float  # seconds spent in mmap(MAP_POPULATE)
    lock_s: float  # seconds spent in mlock
    env: MemlockEnv = field(default_factory=memlock.memlock_env)

    def summary(self) -> str:
        return memlock.lock_summary(self.as_dict())

    def as_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy, "locked": self.locked, "weight_bytes": self.weight_bytes,
            "locked_bytes": self.locked_bytes, "vmlck_bytes": self.vmlck_bytes,
            "error": self.error, "populate_s": self.populate_s, "lock_s": self.lock_s,
            **self.env.as_dict(),
        }


class PinnedWeights:
    """Tensors of a prepared weights file, mapped, populated and (by policy) locked."""

    def __init__(self, info: PreparedInfo, mm: mmap.mmap, tensors: dict[str, np.ndarray],
                 lock: LockReport) -> None:
        self.info = info
        self._mm: mmap.mmap | None = mm
        self._tensors = tensors
        self.tensors: Mapping[str, np.ndarray] = MappingProxyType(tensors)
        self.lock = lock

    @property
    def path(self) -> Path:
        return self.info.path

    @property
    def metadata(self) -> Mapping[str, Any]:
        return self.info.metadata

    @property
    def dtype(self) -> str:
        """The prepared file's dtype ("f32" or "f16"); vectors are always f32."""
        return self.info.dtype

    @property
    def closed(self) -> bool:
        return self._mm is None

    @classmethod
    def open(cls, prepared: str | os.PathLike[str], *, mlock: str = "best-effort",
             expect_sha256: str | None = None) -> PinnedWeights:
        """Validate, map with MAP_POPULATE, view, and lock `prepared` per the `mlock` policy."""
        if mlock not in MLOCK_POLICIES:
            raise ConfigError(
                f"mlock policy {mlock!r} is not valid. Hint: use one of "
                f"{', '.join(MLOCK_POLICIES)}."
            )
        info = PreparedInfo.read(prepared)
        if expect_sha256 is not None and info.source_sha256 != expect_sha256:
            raise ModelFileError(
                f"{info.path}: prepared from a source with sha256 {info.source_sha256[:16]}..., "
                f"expected {expect_sha256[:16]}.... Hint: run `edge-agent model prepare --force` "
                "on the model you mean to serve."
            )
        mm, populate_s = _map(info)
        try:
            tensors = {
                name: np.frombuffer(mm, dtype=DTYPES[t.dtype], count=t.nbytes
                                    // DTYPE_BYTES[t.dtype], offset=t.offset).reshape(t.shape)
                for name, t in info.tensors.items()
            }
        except BaseException:
            mm.close()
            raise
        lock = _lock(info, mm, mlock, populate_s)
        self = cls(info, mm, tensors, lock)
        if not lock.locked and lock.error is not None:
            if mlock == "required":
                self.close()
                raise MemoryLockError(lock.error)
            log.warning("serving UNLOCKED weights (mlock policy best-effort): %s",
                        lock.error)
        return self

    def close(self) -> bool:
        """Drop the views and unmap (which unlocks). True if unmapped now; False if views
        held elsewhere keep the mapping alive until they are garbage collected."""
        if self._mm is None:
            return True
        self._tensors.clear()
        mm, self._mm = self._mm, None
        try:
            mm.close()
        except BufferError:
            return False
        return True

    def __enter__(self) -> PinnedWeights:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else self.lock.summary()
        return f"<PinnedWeights {self.path} {self.dtype}: {state}>"


def _map(info: PreparedInfo) -> tuple[mmap.mmap, float]:
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    try:
        fd = os.open(info.path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise ModelFileError(
            f"{info.path}: cannot open prepared weights: {exc.strerror}. "
            "Hint: check the state directory's permissions."
        ) from exc
    try:
        if os.fstat(fd).st_size != info.file_size:
            raise ModelFileError(
                f"{info.path}: changed size while being opened. Hint: do not run "
                "`edge-agent model prepare --force` while a model is being loaded."
            )
        t0 = time.perf_counter()
        mm = mmap.mmap(fd, info.file_size, flags=flags, prot=mmap.PROT_READ)
        return mm, time.perf_counter() - t0
    except OSError as exc:
        raise ModelFileError(
            f"{info.path}: mmap of {info.file_size:,} bytes failed: {exc.strerror}. "
            "Hint: check the address-space limit (ulimit -v) and free memory."
        ) from exc
    finally:
        os.close(fd)


def _lock(info: PreparedInfo, mm: mmap.mmap, policy: str, populate_s: float) -> LockReport:
    env = memlock.memlock_env()
    weight_bytes = info.weight_bytes
    if policy == "off":
        return LockReport(policy, False, weight_bytes, 0, memlock.vmlck_bytes(), None,
                          populate_s, 0.0, env)
    if info.data_bytes == 0:
        return LockReport(policy, True, 0, 0, memlock.vmlck_bytes(), None, populate_s, 0.0, env)
    # c_char.from_buffer refuses read-only maps; a numpy view exposes the address.
    base = np.frombuffer(mm, dtype=np.uint8, count=1, offset=info.data_offset)
    address = base.ctypes.data
    del base
    t0 = time.perf_counter()
    err = memlock.mlock(address, info.data_bytes)
    lock_s = time.perf_counter() - t0
    vmlck = memlock.vmlck_bytes()
    if err:
        message = memlock.lock_failure_message(f"weights in {info.path}", info.data_bytes,
                                               err, env)
        return LockReport(policy, False, weight_bytes, 0, vmlck, message, populate_s, lock_s,
                          env)
    return LockReport(policy, True, weight_bytes, info.data_bytes, vmlck, None, populate_s,
                      lock_s, env)
