"""A runner started before the control plane is: its interpreter and llama.cpp imports overlap
the control plane's own start.

`edge-agent serve` calls `prestart(config)` right after reading its configuration, before it
imports the daemon (asyncio, the journal, the HTTP server: ~0.2 s). When a model is preloaded on
the llama.cpp engine, a runner process starts at once with `--prestarted`: it imports the engine
and loads the llama.cpp library, then waits on its socket for the rest of its command line. The
first model that loads on the llama.cpp engine claims it (`claim`) instead of spawning a runner:
the budget check and the cgroup attach happen exactly as for a spawned runner, before the argv
frame is sent, so the model's memory is charged to models/NAME as before. Only the imports'
memory (~30 MiB of interpreter heap) stays charged to the group the runner was in before.

Invariants owned here:
- This module imports nothing heavy (no asyncio): it runs before the daemon exists.
- A pre-started runner is claimed at most once; one nobody claims is ended by `discard` (EOF on
  its socket: it exits 0 without loading anything) and reaped.
- It gets exactly the environment a spawned runner gets (`runner_env`), so claiming it changes
  nothing but when the interpreter started.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import socket
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

__all__ = ["Prestarted", "RUNNER_ENV_DROP", "prestart", "runner_env", "runner_command"]

# systemd hands these to the daemon only; a runner must not notify or adopt sockets.
RUNNER_ENV_DROP = frozenset({"NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS",
                             "LISTEN_PID", "LISTEN_FDNAMES"})


def runner_env(engine: str, threads: int | None, env: Mapping[str, str] = os.environ
               ) -> dict[str, str]:
    """A runner's environment: ours without systemd's hand-overs, and the BLAS/OpenMP pools
    numpy gets. The numpy engine computes in them (runtime.threads, else 1: two collapsed
    3-4x on a shared 2-core machine); on llama.cpp numpy only samples, and a pool of 2
    threads cost 0.06-0.09 s more CPU at import, during the start, for nothing: 1."""
    out = {k: v for k, v in env.items() if k not in RUNNER_ENV_DROP}
    n = str((threads or 1) if engine == "numpy" else 1)
    out.update(OPENBLAS_NUM_THREADS=n, OMP_NUM_THREADS=n)
    return out


def runner_command(fd: int) -> list[str]:
    """The runner's command line up to its model arguments."""
    return [sys.executable, "-m", "edge_agent.daemon.runner", "--fd", str(fd)]


class Prestarted:
    """A runner process waiting for its arguments on `sock` (our end of its socketpair)."""

    def __init__(self, proc: subprocess.Popen[bytes], sock: socket.socket,
                 env: dict[str, str]) -> None:
        self.proc = proc
        self.sock: socket.socket | None = sock
        self.env = env

    def claim(self, env: Mapping[str, str]) -> tuple[subprocess.Popen[bytes], socket.socket] | None:
        """The process and its socket, once, when it runs with `env` and is still alive."""
        if self.sock is None or dict(env) != self.env or self.proc.poll() is not None:
            return None
        sock, self.sock = self.sock, None
        return self.proc, sock

    def discard(self, timeout_s: float = 5.0) -> None:
        """End an unclaimed runner (EOF: it exits without loading) and reap it."""
        if self.sock is None:
            return
        self.sock.close()
        self.sock = None
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            self.proc.wait()


def _wants_llamacpp(config: Any) -> bool:
    """A preload model on the llama.cpp engine: runtime.engine's resolution (engines.py's
    resolve_engine) without importing the bindings, which is the runner's work."""
    if not any(entry.preload for entry in config.models.values()):
        return False
    engine = config.runtime.engine
    return engine == "llamacpp" or (engine == "auto"
                                    and importlib.util.find_spec("llama_cpp") is not None)


def prestart(config: Any, env: Mapping[str, str] = os.environ) -> Prestarted | None:
    """Start a runner for the first llama.cpp model load, when the configuration preloads one;
    None when none is wanted or the spawn fails (the model then spawns its runner itself)."""
    if not _wants_llamacpp(config):
        return None
    renv = runner_env("llamacpp", config.runtime.threads, env)
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        proc = subprocess.Popen([*runner_command(child.fileno()), "--prestarted"],
                                pass_fds=(child.fileno(),), env=renv,
                                stdin=subprocess.DEVNULL)
    except OSError:
        parent.close()
        return None
    finally:
        child.close()
    parent.set_inheritable(False)
    return Prestarted(proc, parent, renv)
