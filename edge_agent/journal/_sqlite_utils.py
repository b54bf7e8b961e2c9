"""sqlite-utils, imported at its first use with numpy and pandas hidden unless they are imported
already.

sqlite-utils imports both whenever they are installed, only to give their scalar types column
types; the journal stores neither. numpy is installed for the numpy engine and the runner;
imported here it would cost the control plane, which computes nothing with it, 13 MiB of PSS
and 0.1 s of its start.

The import itself (click, dateutil, pluggy: ~50 ms) waits for the first database the journal
opens: a daemon's start spawns its first runner before it, so the runner's model load runs
meanwhile instead of after it. Hiding numpy is global to the process while sqlite-utils imports,
so that first use must not race an import of numpy in another thread: the daemon opens its
journal on the event loop's thread, when the only other thread is the model vocabulary's read
(which imports no numpy), and the command-line tools open it before any thread starts.
"""

from __future__ import annotations

import sqlite3
import sys
import threading
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import sqlite_utils

__all__ = ["database", "load"]

_module: ModuleType | None = None
_lock = threading.Lock()


def load() -> ModuleType:
    """The sqlite_utils module, imported on the first call."""
    global _module
    with _lock:
        if _module is None:
            hidden = [name for name in ("numpy", "pandas") if name not in sys.modules]
            for name in hidden:
                sys.modules[name] = None  # type: ignore[assignment]  # `import numpy` fails
            try:
                import sqlite_utils as module
            finally:
                for name in hidden:
                    if name in sys.modules and sys.modules[name] is None:
                        del sys.modules[name]
            _module = module
        return _module


def database(conn: sqlite3.Connection, **kwargs: Any) -> sqlite_utils.Database:
    """`sqlite_utils.Database(conn, **kwargs)`."""
    db: sqlite_utils.Database = load().Database(conn, **kwargs)
    return db
