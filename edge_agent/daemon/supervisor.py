"""Runner supervision: spawn a runner child with a socketpair, talk to it, notice its death.

Invariants owned here:
- A runner is `python -m edge_agent.daemon.runner` started with subprocess + pass_fds: it holds
  only its end of the socketpair; the control plane closes that end in itself right after the
  spawn, so the runner's death closes the pair and the reader task sees EOF at once. A runner
  pre-started with the daemon (prestart.py) is adopted the same way: attached (`on_spawn`)
  before it is sent its arguments, so it loads nothing outside its group.
- At most one request is outstanding per runner (`call` is serialised by a lock); each call gets
  exactly one reply or raises RunnerGone. Progress/status frames go to `on_event`.
- `gone` is set as soon as the socket reports EOF; `returncode` is filled once the process is
  reaped. `stop()` always ends with the process reaped (EOF first, then SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
from collections.abc import Callable, Sequence

from edge_agent.daemon.ipc import (
    Failed,
    Hurry,
    Message,
    Progress,
    Ready,
    RunnerGone,
    Status,
    decode,
    encode,
    encode_frame,
    read_frame,
)
from edge_agent.daemon.prestart import runner_command
from edge_agent.errors import EdgeAgentError

__all__ = ["RunnerHandle", "RunnerLoadError", "RunnerGone"]


def _log_level() -> str:
    """The control plane's `edge_agent` level, for the runner's --log-level."""
    return logging.getLevelName(logging.getLogger("edge_agent").getEffectiveLevel())


class RunnerLoadError(EdgeAgentError):
    """The runner could not load or warm up its model (reason from the runner, or its exit)."""


class _Gone:
    """Queued after the runner's socket closed: every waiting and later `call` sees it."""


class _Adopted:
    """A pre-started runner (prestart.py: a subprocess.Popen) with the parts of
    asyncio.subprocess.Process this module uses: pid, returncode, send_signal, `await wait()`.
    Its exit is noticed through a pidfd (a thread waiting for it where there is none)."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self._popen = popen
        self.pid = popen.pid
        self._exited: asyncio.Future[int] | None = None

    @property
    def returncode(self) -> int | None:
        return self._popen.returncode

    def send_signal(self, sig: int) -> None:
        if self._popen.poll() is None:
            self._popen.send_signal(sig)

    def _watch(self) -> asyncio.Future[int]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[int] = loop.create_future()
        try:
            fd = os.pidfd_open(self.pid)
        except (AttributeError, OSError):  # no pidfd (Linux < 5.3): a thread waits instead
            return asyncio.ensure_future(asyncio.to_thread(self._popen.wait))

        def exited() -> None:
            loop.remove_reader(fd)
            os.close(fd)
            if not fut.done():
                fut.set_result(self._popen.wait())

        loop.add_reader(fd, exited)
        return fut

    async def wait(self) -> int:
        if self._popen.poll() is not None:
            return self._popen.returncode
        if self._exited is None:
            self._exited = self._watch()
        return await asyncio.shield(self._exited)


class RunnerHandle:
    def __init__(self, name: str, args: Sequence[str], *, env: dict[str, str] | None = None,
                 on_event: Callable[[Progress | Status], None] | None = None,
                 on_gone: Callable[[], None] | None = None,
                 on_spawn: Callable[[int], None] | None = None) -> None:
        self.name = name
        self.on_spawn = on_spawn  # called with the pid right after the spawn (cgroup attach)
        self.args = list(args)
        self.env = env
        self.on_event = on_event
        self.on_gone = on_gone
        self.proc: asyncio.subprocess.Process | _Adopted | None = None
        self.spawned = asyncio.Event()  # set once the spawn is done (the process exists) or failed
        self.gone = asyncio.Event()
        self.ready: Ready | None = None
        self._replies: asyncio.Queue[Message | _Gone] = asyncio.Queue()
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode if self.proc else None

    async def start(self, prestarted: tuple[subprocess.Popen[bytes], socket.socket] | None = None
                    ) -> Ready:
        """Spawn (or adopt `prestarted`, a runner waiting for its arguments: prestart.py) and
        wait for `ready` (the load + warm-up). Raises RunnerLoadError."""
        argv = [*self.args, "--log-level", _log_level()]
        if prestarted is not None:
            popen, parent = prestarted
            self.proc = _Adopted(popen)
            try:
                if self.on_spawn is not None:
                    self.on_spawn(self.proc.pid)  # into its group before it loads anything
            except BaseException:
                parent.close()  # EOF: it exits without loading
                raise
            finally:
                self.spawned.set()
            with contextlib.suppress(OSError):  # it died: the reader sees EOF and its status
                parent.sendall(encode_frame({"argv": argv}))
        else:
            parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                self.proc = await asyncio.create_subprocess_exec(
                    *runner_command(child.fileno()), *argv, pass_fds=(child.fileno(),),
                    env=self.env, stdin=asyncio.subprocess.DEVNULL)
                if self.on_spawn is not None:
                    self.on_spawn(self.proc.pid)
            finally:
                child.close()
                self.spawned.set()
        reader, self._writer = await asyncio.open_unix_connection(sock=parent)
        self._reader_task = asyncio.create_task(self._read_loop(reader))
        first = await self._next_reply()
        if isinstance(first, Ready):
            self.ready = first
            return first
        await self.stop()
        if isinstance(first, Failed):
            raise RunnerLoadError(f"model {self.name!r}: {first.error}")
        raise RunnerLoadError(
            f"model {self.name!r}: runner (pid {self.pid}) exited with status "
            f"{self.returncode} while loading. Hint: its stderr above says why; check the "
            "memory limit and the model path."
        )

    async def _read_loop(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                msg = decode(await read_frame(reader))
                if isinstance(msg, (Progress, Status)):
                    if self.on_event:
                        self.on_event(msg)
                else:
                    self._replies.put_nowait(msg)
        except (RunnerGone, ValueError):
            pass
        finally:
            if self.proc is not None:  # reap first, so the exit status is known to callers
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self.proc.wait(), 2.0)
            self.gone.set()
            self._replies.put_nowait(_Gone())
            if self.on_gone:
                self.on_gone()

    async def _next_reply(self) -> Message | _Gone:
        return await self._replies.get()

    async def call(self, msg: Message, at_send: Callable[[Message], Message] | None = None
                   ) -> Message:
        """Send one request and return its reply; RunnerGone if the runner dies meanwhile.
        `at_send` may change the message when its turn to be written comes (a call waits for
        the one before it to be answered)."""
        async with self._lock:
            if self.gone.is_set() or self._writer is None:
                raise RunnerGone(f"model {self.name!r}: runner is not running")
            if at_send is not None:
                msg = at_send(msg)
            try:
                self._writer.write(encode_frame(encode(msg)))
                await self._writer.drain()
            except ConnectionError as exc:
                raise RunnerGone(f"model {self.name!r}: runner socket closed") from exc
            reply = await self._next_reply()
            if isinstance(reply, _Gone):
                self._replies.put_nowait(reply)
                raise RunnerGone(
                    f"model {self.name!r}: runner (pid {self.pid}) died mid-step"
                )
            return reply

    def hurry(self) -> None:
        """Ask the runner to end the step message it runs after its current decode step (a
        `hurry` frame: no reply; one that arrives between messages is dropped)."""
        w = self._writer
        if w is None or self.gone.is_set() or w.is_closing():
            return
        with contextlib.suppress(ConnectionError, RuntimeError):
            w.write(encode_frame(encode(Hurry())))  # whole frames: never inside another

    def kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGKILL)

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Close our end (the runner exits on EOF), then escalate; always reap."""
        if self._writer is not None:
            self._writer.close()  # no wait_closed(): its future is shared with other awaiters
        if self.proc is None:
            return
        for sig in (None, signal.SIGTERM, signal.SIGKILL):
            if sig is not None and self.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.send_signal(sig)
            try:
                await asyncio.wait_for(self.proc.wait(), timeout_s)
                break
            except asyncio.TimeoutError:
                continue
        if self._reader_task is not None:
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(self._reader_task, 1.0)
