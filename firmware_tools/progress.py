"""Per-sector progress of a flash job, on disk, so that `--resume` finishes an interrupted job.

Invariants this module owns:
- One file per (image sha256, board, port identity): `<state_dir>/flash/<key>.json`, written
  atomically (tmp file, fsync, rename, fsync dir) on every change, removed when the job is done.
- A port's identity leaves out fault knobs and options (`port_identity`), so a resumed job finds
  its file whatever the URL's extras.
- Progress is read back only when asked to resume and only if the file's head (image, board,
  port) matches; `loaded` says whether it was.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from firmware_tools.errors import FlashError

__all__ = ["SectorMarked", "SectorProgress", "journal_path", "port_identity"]

SectorMarked = Callable[[list[int], str], None]  # (sector indexes, new state), live


def port_identity(port: str) -> str:
    """The part of a port URL naming the board: fault knobs and options are left out.

    For `stm32sim://` the `state` file is the board's identity (and `chip`, `board`).
    """
    parts = urllib.parse.urlsplit(port)
    if parts.scheme == "stm32sim":
        q = urllib.parse.parse_qs(parts.query)
        keep = {k: q[k] for k in ("chip", "board", "state") if k in q}
        return "stm32sim://?" + urllib.parse.urlencode(sorted(keep.items()), doseq=True)
    if parts.scheme:
        return urllib.parse.urlunsplit((parts.scheme, parts.netloc, parts.path, "", ""))
    return os.path.realpath(port) if os.path.exists(port) else port


def journal_path(state_dir: str | os.PathLike[str], sha256: str, board: str, port: str) -> Path:
    key = hashlib.sha256(f"{sha256}|{board}|{port_identity(port)}".encode()).hexdigest()[:20]
    return Path(state_dir) / "flash" / f"{key}.json"


def _write_atomic(path: Path, doc: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, indent=1, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    dirfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dirfd)
    finally:
        os.close(dirfd)


class SectorProgress:
    """The per-sector progress file of one flash job (None path: in memory only)."""

    def __init__(self, path: Path | None, head: dict[str, Any], resume: bool,
                 on_mark: SectorMarked | None = None) -> None:
        self.path = path
        self.on_mark = on_mark
        self.doc: dict[str, Any] = {**head, "sectors": {}}
        self.loaded = False  # True when an interrupted run's progress was found
        if path is not None and resume and path.exists():
            try:
                old = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise FlashError(
                    f"resume: progress file {path} is unreadable ({exc}). "
                    "Hint: delete it and flash without --resume."
                ) from exc
            if all(old.get(k) == v for k, v in head.items()):
                self.doc["sectors"] = dict(old.get("sectors", {}))
                self.loaded = True

    def state(self, index: int) -> str | None:
        state: str | None = self.doc["sectors"].get(str(index))
        return state

    def mark(self, index: int, state: str) -> None:
        self.mark_many([index], state)

    def mark_many(self, indexes: list[int], state: str) -> None:
        for index in indexes:
            self.doc["sectors"][str(index)] = state
        self.doc["updated"] = time.time()
        if self.path is not None:
            _write_atomic(self.path, self.doc)
        if self.on_mark is not None:  # after the progress file: the caller's record follows it
            self.on_mark(list(indexes), state)

    def done(self) -> None:
        if self.path is not None and self.path.exists():
            self.path.unlink()
