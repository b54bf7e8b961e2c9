"""The image cache: tests/.cache/qemu/<name>-<hash>/, one folder per set of build inputs.

Invariants: a cache folder is published by an atomic rename only after its build finished, so a
folder that exists is complete; builds of the same name are serialized by an flock, so two test
runs (or engineers) sharing a checkout build once; every use touches its folder, and folders of
the same name with other inputs are removed once unused for KEEP_OLD_SECONDS (a run that started
on the previous inputs, e.g. before a file of the key was edited in a shared tree, may still be
booting them: removing them at once made the two runs rebuild and delete each other's folder).
$EDGE_AGENT_QEMU_CACHE moves the whole cache elsewhere.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

__all__ = ["HERE", "KEEP_OLD_SECONDS", "REPO", "cache_root", "cached_build", "inputs_hash",
           "log"]

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
KEEP_OLD_SECONDS = 3600


def log(message: str) -> None:
    """Progress on stderr (shown by pytest only for failing tests, or with -s)."""
    print(f"[qemu-harness] {message}", file=sys.stderr, flush=True)


def cache_root() -> Path:
    root = Path(os.environ.get("EDGE_AGENT_QEMU_CACHE") or REPO / "tests" / ".cache" / "qemu")
    root.mkdir(parents=True, exist_ok=True)
    return root


def inputs_hash(files: Iterable[Path], values: Iterable[str]) -> str:
    """sha256 over the bytes of `files` (in the given order) and the strings `values`."""
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    for v in values:
        h.update(v.encode() + b"\0")
    return h.hexdigest()[:16]


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def cached_build(name: str, key: str, build: Callable[[Path], None], *,
                 root: Path | None = None) -> Path:
    """Return <root>/<name>-<key> (root: cache_root() unless given), calling build(tmp_dir)
    to make it if it is missing."""
    if root is None:
        root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{name}-{key}"
    if final.is_dir():
        _used(final, name)
        return final
    with _locked(root / f".{name}.lock"):
        if final.is_dir():
            _used(final, name)
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
        t0 = time.monotonic()
        try:
            log(f"building {final.name} (cold cache)")
            build(tmp)
            tmp.rename(final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        log(f"built {final.name} in {time.monotonic() - t0:.1f} s")
        (final / "build-seconds").write_text(f"{time.monotonic() - t0:.1f}\n")
        _used(final, name)
    return final


def _used(final: Path, name: str) -> None:
    """Mark `final` as used now; remove its siblings (other inputs) unused for an hour."""
    now = time.time()
    try:
        os.utime(final, (now, now))
    except OSError:
        pass
    for old in final.parent.glob(f"{name}-*"):
        try:
            stale = old != final and old.is_dir() and now - old.stat().st_mtime > KEEP_OLD_SECONDS
        except OSError:
            continue
        if stale:
            shutil.rmtree(old, ignore_errors=True)
