"""What a path is, in words, for errors about a file that must be a regular file.

Invariants owned here: `file_kind` names every st_mode ("a directory", "a FIFO (named pipe)",
"a character device", ...); `not_regular` stats without opening (a FIFO is never opened, so
nothing blocks) and says what is wrong, or None for a regular file (symbolic links followed);
`read_regular` reads a regular file of at most `limit` bytes, never more, and raises
`FileKindError` saying what is wrong (what the path is, or its size against the limit).
"""

from __future__ import annotations

import os
import stat

__all__ = ["file_kind", "not_regular", "read_regular", "FileKindError", "MiB"]

MiB = 1 << 20


def file_kind(mode: int) -> str:
    """What an st_mode is, in words."""
    for test, name in ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return "a special file"


def not_regular(path: str | os.PathLike[str]) -> str | None:
    """None for a regular file; else what is wrong ("no such file", "is a directory, not a
    regular file", "cannot be read: Permission denied", ...)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return "no such file"
    except NotADirectoryError:
        return "no such file (a component of its path is not a directory)"
    except OSError as exc:
        return f"cannot be read: {exc.strerror or exc}"
    if stat.S_ISREG(st.st_mode):
        return None
    return f"is {file_kind(st.st_mode)}, not a regular file"


class FileKindError(ValueError):
    """What is wrong with a path that must be a small regular file, in words (no path, no Hint:
    the caller adds both)."""


def read_regular(path: str | os.PathLike[str], limit: int) -> bytes:
    """The bytes of a regular file of at most `limit` bytes. Anything else raises FileKindError:
    "no such file", "is a directory, not a regular file", "is 5000000 bytes, more than the limit
    of 1048576 bytes", ... A FIFO or device is never read (O_NONBLOCK, so opening one that
    replaced the file after the stat cannot block either); a file that grows while it is read
    is refused at limit + 1 bytes."""
    wrong = not_regular(path)
    if wrong is not None:
        raise FileKindError(wrong)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise FileKindError(f"cannot be read: {exc.strerror or exc}") from exc
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FileKindError(f"is {file_kind(st.st_mode)}, not a regular file")
        if st.st_size > limit:
            raise FileKindError(f"is {st.st_size} bytes, more than the limit of {limit} bytes")
        try:
            data = fh.read(min(st.st_size, limit) + 1)
        except OSError as exc:
            raise FileKindError(f"cannot be read: {exc.strerror or exc}") from exc
    if len(data) > limit:
        raise FileKindError(f"grew past the limit of {limit} bytes while it was read")
    return data
