"""sqlite-utils, imported with numpy and pandas hidden unless they are imported already.

sqlite-utils imports both whenever they are installed, only to give their scalar types column
types; the journal stores neither. numpy is installed for the numpy engine and the runner;
imported here it would cost the control plane, which computes nothing with it, 13 MiB of PSS
and 0.1 s of its start. The journal's modules import sqlite-utils from here, at their own
import, before any thread of the control plane could import numpy meanwhile.
"""

from __future__ import annotations

import sys

__all__ = ["sqlite_utils"]

_hidden = [name for name in ("numpy", "pandas") if name not in sys.modules]
for _name in _hidden:
    sys.modules[_name] = None  # type: ignore[assignment]  # `import numpy` raises ImportError
try:
    import sqlite_utils
finally:
    for _name in _hidden:
        if _name in sys.modules and sys.modules[_name] is None:
            del sys.modules[_name]
