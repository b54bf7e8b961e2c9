"""What a path is, in words, for errors about a file that must be a regular file.

Invariants owned here: `file_kind` names every st_mode ("a directory", "a FIFO (named pipe)",
"a character device", ...); `not_regular` stats without opening (a FIFO is never opened, so
nothing blocks) and says what is wrong, or None for a regular file (symbolic links followed).
"""

from __future__ import annotations

import os
import stat

__all__ = ["file_kind", "not_regular"]


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
