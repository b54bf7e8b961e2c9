"""Ctrl-C on a child process, as a terminal delivers it.

A terminal's foreground job starts with SIGINT at its default, and CPython then turns it into
KeyboardInterrupt. A shell without job control (a CI script's `make test &`, `nohup`) starts
its background jobs with SIGINT ignored, and an ignored signal stays ignored across exec: a
child spawned by such a test run would never see the Ctrl-C under test. `foreground` (a
`preexec_fn`) gives the child the terminal's disposition whatever the test run inherited.

`finish` waits for the child after the signal; a child that outlives the wait is made to
print every thread's Python stack (PYTHONFAULTHANDLER, set by `env`, dumps on SIGABRT), so
a failure says where it hung instead of only that it timed out.
"""

from __future__ import annotations

import os
import signal
import subprocess

__all__ = ["env", "finish", "foreground"]


def foreground() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def env() -> dict[str, str]:
    """The caller's environment minus every EDGE_AGENT_* variable, with the fault handler on."""
    out = {k: v for k, v in os.environ.items() if not k.startswith("EDGE_AGENT_")}
    out["PYTHONFAULTHANDLER"] = "1"
    return out


def finish(proc: subprocess.Popen[str], timeout: float) -> tuple[str, str]:
    """(stdout, stderr) once `proc` ends; AssertionError with its stacks if it does not."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        out, err = proc.communicate()
        raise AssertionError(f"still running {timeout:g} s after the interrupt; its stacks:\n"
                             f"{err[-8000:]}") from None
